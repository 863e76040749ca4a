"""PyTorch Lightning plugins for one multi-GPU box.

Importing the package registers its strategies, so ``Trainer(strategy="balanced_dp")`` works.
"""

from lightning_balanced.parallel import plan_chunk_sizes
from lightning_balanced.strategies import BalancedDataParallelStrategy
from lightning_balanced.strategies.registration import register_strategies

__version__ = "0.1.0.dev0"

register_strategies()

__all__ = ["BalancedDataParallelStrategy", "__version__", "plan_chunk_sizes", "register_strategies"]
