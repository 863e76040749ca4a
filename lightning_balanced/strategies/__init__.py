"""Lightning strategies of the package, one per module.

The package's list of strategies is its ``lightning.pytorch.strategies`` entry points in ``pyproject.toml``
(:mod:`lightning_balanced.strategies.registration`). The names below are import shortcuts to their classes, which
registration does not read: a new strategy needs a line here only to have such a shortcut.
"""

from lightning_balanced.strategies.balanced_ddp import BalancedDDPStrategy
from lightning_balanced.strategies.balanced_dp import BalancedDataParallelStrategy
from lightning_balanced.strategies.balanced_fsdp import BalancedFSDPStrategy
from lightning_balanced.strategies.ddp_lr import LRScaledDDPStrategy
from lightning_balanced.strategies.gpipe import GPipeStrategy
from lightning_balanced.strategies.pipeline import PipelineStrategy
from lightning_balanced.strategies.pipeline_lr import LRScaledPipelineStrategy

__all__ = [
    "BalancedDDPStrategy",
    "BalancedDataParallelStrategy",
    "BalancedFSDPStrategy",
    "GPipeStrategy",
    "LRScaledDDPStrategy",
    "LRScaledPipelineStrategy",
    "PipelineStrategy",
]
