"""Lightning strategies of the package, one per module."""

from lightning_balanced.strategies.balanced_dp import BalancedDataParallelStrategy
from lightning_balanced.strategies.ddp_lr import LRScaledDDPStrategy
from lightning_balanced.strategies.gpipe import GPipeStrategy

__all__ = ["BalancedDataParallelStrategy", "GPipeStrategy", "LRScaledDDPStrategy"]
