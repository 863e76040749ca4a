"""Put this package's strategies in Lightning's ``StrategyRegistry`` so ``Trainer(strategy="<name>")`` finds them.

Lightning fills its registry only from its own modules; external strategies must register themselves. Other packages
can join through the entry-point group ``lightning_balanced.strategies``: each entry names a ``Strategy`` subclass
whose ``register_strategies(registry)`` classmethod is called when ``lightning_balanced`` is imported. The unified
``lightning`` package (``lightning.pytorch``) and the standalone ``pytorch_lightning`` package keep separate registries
and separate base classes: each gets a class built on its own ``ParallelStrategy``. Registering is idempotent.
"""

from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import logging
from typing import Any

from lightning.pytorch.strategies import StrategyRegistry

from lightning_balanced.strategies.balanced_dp import BalancedDataParallel, BalancedDataParallelStrategy
from lightning_balanced.strategies.ddp import LRScaledDDPStrategy

__all__ = ["ENTRY_POINT_GROUP", "register_strategies", "standalone_strategy"]

ENTRY_POINT_GROUP = "lightning_balanced.strategies"

log = logging.getLogger(__name__)

# (base-free implementation or None, the class built on lightning.pytorch's base). Only strategies with a base-free
# implementation get a standalone `pytorch_lightning` variant.
_STRATEGIES: tuple[tuple[type | None, type], ...] = (
    (BalancedDataParallel, BalancedDataParallelStrategy),
    (None, LRScaledDDPStrategy),
)


@functools.cache
def standalone_strategy(strategy: type) -> type:
    """The variant of one of our strategy classes for the standalone ``pytorch_lightning`` package.

    Args:
        strategy (type): a class exported by this package, e.g. ``BalancedDataParallelStrategy``.

    Returns:
        type: the same implementation on ``pytorch_lightning.strategies.ParallelStrategy``; pass an instance to a
        ``pytorch_lightning.Trainer``.

    Raises:
        ModuleNotFoundError: ``pytorch_lightning`` is not installed.
        ValueError: ``strategy`` is not one of this package's strategies.
    """
    import pytorch_lightning.strategies as standalone

    for implementation, public in _STRATEGIES:
        if public is strategy and implementation is not None:
            namespace: dict[str, Any] = {"__doc__": public.__doc__, "__module__": __name__}
            return type(public.__name__, (implementation, standalone.ParallelStrategy), namespace)
    names = [public.__name__ for implementation, public in _STRATEGIES if implementation is not None]
    raise ValueError(f"`strategy` must be one of {names}, got {strategy!r}")


def register_strategies() -> list[str]:
    """Register every strategy of the package, and of the plugins in ``ENTRY_POINT_GROUP``, in each Lightning registry.

    Returns:
        list[str]: the names of this package's strategies now in ``lightning.pytorch``'s registry.
    """
    for _, public in _STRATEGIES:
        public.register_strategies(StrategyRegistry)  # type: ignore[attr-defined]
    ours = {public for _, public in _STRATEGIES}
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            plugin = entry_point.load()
            if plugin not in ours:
                plugin.register_strategies(StrategyRegistry)
        except Exception as err:  # a broken plugin must not break `import lightning_balanced`
            log.warning("Strategy plugin %r (%s) could not be registered: %r", entry_point.name, entry_point.value, err)
    if importlib.util.find_spec("pytorch_lightning") is not None:
        from pytorch_lightning.strategies import StrategyRegistry as StandaloneRegistry

        for implementation, public in _STRATEGIES:
            if implementation is not None:
                standalone_strategy(public).register_strategies(StandaloneRegistry)  # type: ignore[attr-defined]
    return [name for name, entry in StrategyRegistry.items() if entry["strategy"] in ours]
