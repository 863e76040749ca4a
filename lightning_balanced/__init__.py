"""PyTorch Lightning plugins for one multi-GPU box.

Importing the package registers its strategies, so ``Trainer(strategy="balanced_dp")``,
``Trainer(strategy="balanced_ddp")``, ``Trainer(strategy="ddp_lr_linear")``, ``Trainer(strategy="gpipe")`` and
``Trainer(strategy="pipeline")`` work.
"""

from lightning_balanced.batch_scaling.lr_scaling import unscale_learning_rates
from lightning_balanced.evaluation import DistributedEvalMixin, IndexedDataset, coco_map, postprocess_detections
from lightning_balanced.nn.sync_batchnorm import SyncBatchNorm
from lightning_balanced.split_policies import (
    AutoSplit,
    ChunkSizes,
    EvenSplit,
    Gpu0Budget,
    SplitPolicy,
    Weights,
    plan_chunk_sizes,
)
from lightning_balanced.strategies import (
    BalancedDataParallelStrategy,
    BalancedDDPStrategy,
    BalancedFSDPStrategy,
    GPipeStrategy,
    LRScaledDDPStrategy,
    LRScaledPipelineStrategy,
    PipelineStrategy,
)
from lightning_balanced.strategies.registration import register_strategies

__version__ = "0.1.0.dev0"

register_strategies()

__all__ = [
    "AutoSplit",
    "BalancedDDPStrategy",
    "BalancedDataParallelStrategy",
    "BalancedFSDPStrategy",
    "ChunkSizes",
    "DistributedEvalMixin",
    "EvenSplit",
    "GPipeStrategy",
    "Gpu0Budget",
    "IndexedDataset",
    "LRScaledDDPStrategy",
    "LRScaledPipelineStrategy",
    "PipelineStrategy",
    "SplitPolicy",
    "SyncBatchNorm",
    "Weights",
    "__version__",
    "coco_map",
    "plan_chunk_sizes",
    "postprocess_detections",
    "register_strategies",
    "unscale_learning_rates",
]
