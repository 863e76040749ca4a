"""Lightning strategies of the package, one per module."""

from lightning_balanced.strategies.balanced_dp import BalancedDataParallelStrategy
from lightning_balanced.strategies.ddp import LRScaledDDPStrategy

__all__ = ["BalancedDataParallelStrategy", "LRScaledDDPStrategy"]
