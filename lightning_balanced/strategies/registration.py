"""Put this package's strategies in Lightning's ``StrategyRegistry`` so ``Trainer(strategy="<name>")`` finds them.

Lightning fills its registry only from its own modules; other packages' strategies must register themselves, through
the ``register_strategies(registry)`` classmethod of each ``Strategy`` class. ``import lightning_balanced`` calls
:func:`register_strategies` once. The unified ``lightning`` package (``lightning.pytorch``) and the standalone
``pytorch_lightning`` package keep separate registries and separate base classes: the second gets the classes of
:mod:`lightning_balanced.strategies.pytorch_lightning_compat`. Third-party strategies join through the
``lightning.pytorch.strategies`` entry-point group: see :mod:`lightning_balanced.entry_points`.
"""

from __future__ import annotations

import importlib.util
from typing import Any

from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import StrategyRegistry

from lightning_balanced.strategies.balanced_dp import BalancedDataParallelStrategy
from lightning_balanced.strategies.ddp_lr import LRScaledDDPStrategy
from lightning_balanced.strategies.gpipe import GPipeStrategy

__all__ = ["STRATEGIES", "StrategyNameConflict", "register_strategies", "register_strategy"]

#: The package's strategies, as ``lightning.pytorch`` classes. A new strategy is one more entry here (and the same
#: class under ``[project.entry-points."lightning.pytorch.strategies"]`` in pyproject.toml; a test checks both agree).
STRATEGIES: tuple[type, ...] = (
    BalancedDataParallelStrategy,
    LRScaledDDPStrategy,
    GPipeStrategy,
)


class StrategyNameConflict(ValueError):
    """A strategy registers a name that the registry already holds for something else."""


def _same_entry(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return a["strategy"] is b["strategy"] and a["init_params"] == b["init_params"]


def register_strategy(strategy: Any, registry: _StrategyRegistry) -> list[str]:
    """Register the names of one ``Strategy`` class in ``registry``, idempotently.

    ``strategy.register_strategies`` runs on an empty registry of the same type first; then each name it registered is
    copied into ``registry``. A name already there with the same class and arguments is skipped, so calling this
    again, or for a class whose ``register_strategies`` does not guard against double registration, adds nothing.

    Args:
        strategy (type): a ``Strategy`` class with the ``register_strategies(registry)`` classmethod.
        registry (_StrategyRegistry): ``lightning.pytorch``'s or ``pytorch_lightning``'s ``StrategyRegistry``.

    Returns:
        list[str]: the names added to ``registry`` by this call.

    Raises:
        TypeError: ``strategy`` has no ``register_strategies`` classmethod.
        StrategyNameConflict: a name is already registered for another class or other arguments (the names that do
            not conflict are registered all the same).
    """
    register = getattr(strategy, "register_strategies", None)
    if not isinstance(strategy, type) or not callable(register):
        raise TypeError(
            f"`strategy` must be a Strategy class with a `register_strategies` classmethod, got {strategy!r}"
        )
    scratch = type(registry)()
    register(scratch)
    added, conflicts = [], []
    for name, entry in scratch.items():
        if name in registry:
            if not _same_entry(registry[name], entry):
                conflicts.append(f"{name!r} (held by {registry[name]['strategy'].__qualname__})")
            continue
        registry.register(name, entry["strategy"], description=entry["description"], **entry["init_params"])
        added.append(name)
    if conflicts:
        raise StrategyNameConflict(
            f"{strategy.__qualname__} registers names already taken: {', '.join(conflicts)}; they were left as they are"
        )
    return added


def _registries() -> list[tuple[Any, tuple[type, ...]]]:
    registries: list[tuple[Any, tuple[type, ...]]] = [(StrategyRegistry, STRATEGIES)]
    if importlib.util.find_spec("pytorch_lightning") is not None:
        from pytorch_lightning.strategies import StrategyRegistry as StandaloneRegistry

        from lightning_balanced.strategies import pytorch_lightning_compat

        registries.append((StandaloneRegistry, pytorch_lightning_compat.STRATEGIES))
    return registries


def register_strategies() -> list[str]:
    """Register every strategy of the package in each installed Lightning registry; idempotent.

    Returns:
        list[str]: the names of this package's strategies now in ``lightning.pytorch``'s registry.
    """
    for registry, strategies in _registries():
        for strategy in strategies:
            register_strategy(strategy, registry)
    return [name for name, entry in StrategyRegistry.items() if entry["strategy"] in STRATEGIES]
