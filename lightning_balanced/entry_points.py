"""Load third-party strategies declared under the ``lightning.pytorch.strategies`` entry-point group.

Lightning 2.x loads no strategy from entry points (its only groups are ``lightning.{pytorch,fabric}.callbacks_factory``,
read after the strategy string is resolved), so a package that ships a strategy declares it in this group, named after
Lightning's own convention::

    # pyproject.toml of the plugin package
    [project.entry-points."lightning.pytorch.strategies"]
    my_strategy = "my_package.strategies:MyStrategy"   # a Strategy subclass with register_strategies(registry)

and :func:`load_strategy_plugins` puts them in Lightning's ``StrategyRegistry``; the ``lightning-balanced`` command
(:mod:`lightning_balanced.cli`) calls it before parsing, so ``strategy: my_strategy`` resolves in a config. This
package's own strategies are in the group too, and only there: that table is the package's list of strategies, which
``import lightning_balanced`` registers in any case (:mod:`lightning_balanced.strategies.registration`).
"""

from __future__ import annotations

import importlib.metadata

from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.utilities import rank_zero_warn

from lightning_balanced.strategies.registration import ENTRY_POINT_GROUP, register_strategy

__all__ = ["ENTRY_POINT_GROUP", "StrategyPluginWarning", "load_strategy_plugins"]


class StrategyPluginWarning(UserWarning):
    """A strategy plugin could not be loaded or registered; it was skipped."""


def load_strategy_plugins(registry: _StrategyRegistry | None = None) -> list[str]:
    """Register the strategies of every installed plugin of ``ENTRY_POINT_GROUP`` in ``registry``.

    Each entry point names a ``Strategy`` subclass; its ``register_strategies(registry)`` classmethod says which names
    it takes. Loading is idempotent: names already registered for the same class and arguments are skipped, so a
    second call adds nothing. A broken plugin (import error, not a strategy class, an error in
    ``register_strategies``, a name already taken by another class) is reported with a
    :class:`StrategyPluginWarning` naming the entry point and the error, and skipped; the others are registered.

    Args:
        registry (_StrategyRegistry | None): the registry to fill; ``None`` = ``lightning.pytorch``'s
            ``StrategyRegistry``.

    Returns:
        list[str]: the strategy names this call added, in entry-point order.
    """
    if registry is None:
        from lightning.pytorch.strategies import StrategyRegistry

        registry = StrategyRegistry
    added: list[str] = []
    for entry_point in importlib.metadata.entry_points(group=ENTRY_POINT_GROUP):
        try:
            added += register_strategy(entry_point.load(), registry)
        except Exception as err:  # a broken plugin must not take the others, or the command line, down with it
            rank_zero_warn(
                f"Strategy plugin {entry_point.name!r} ({entry_point.value}) was skipped: {type(err).__name__}: {err}",
                category=StrategyPluginWarning,
            )
    return added
