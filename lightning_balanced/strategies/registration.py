"""Put this package's strategies in Lightning's ``StrategyRegistry`` so ``Trainer(strategy="<name>")`` finds them.

Lightning fills its registry only from its own modules; external strategies must register themselves. Registering is
idempotent: a name that is already present is left alone.
"""

from __future__ import annotations

from lightning.pytorch.strategies import StrategyRegistry

from lightning_balanced.strategies.balanced_dp import BalancedDataParallelStrategy

STRATEGIES = (BalancedDataParallelStrategy,)


def register_strategies() -> list[str]:
    """Register every strategy of the package in ``lightning.pytorch``'s registry; return the names now present."""
    for strategy in STRATEGIES:
        strategy.register_strategies(StrategyRegistry)
    return [name for name, entry in StrategyRegistry.items() if entry["strategy"] in STRATEGIES]
