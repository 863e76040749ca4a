"""Lightning strategies of the package, one per module."""

from lightning_balanced.strategies.balanced_dp import BalancedDataParallelStrategy

__all__ = ["BalancedDataParallelStrategy"]
