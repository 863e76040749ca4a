"""What both pipelines share: the in-process GPipe core (:mod:`lightning_balanced.gpipe`) and the multi-process
pipeline on ``torch.distributed.pipelining`` (:mod:`lightning_balanced.pipelining`).

``balance`` chooses how many layers each partition or stage gets (even, by parameters, by measured time or memory);
:class:`DeferredBatchNorm` keeps full-mini-batch running statistics while each micro-batch is normalized on its own;
``plan_micro_batches``/``split`` cut a batch into micro-batches; ``recompute`` marks a checkpointed stage's second
forward pass; ``find_sequential`` finds and checks the ``nn.Sequential`` a pipeline strategy cuts.
"""

from lightning_balanced.pipeline.balance import balance_by_parameters, balance_by_time, split_costs
from lightning_balanced.pipeline.batchnorm import DeferredBatchNorm
from lightning_balanced.pipeline.microbatch import plan_micro_batches, split
from lightning_balanced.pipeline.recompute import is_recomputing
from lightning_balanced.pipeline.sequential import find_sequential

__all__ = [
    "DeferredBatchNorm",
    "balance_by_parameters",
    "balance_by_time",
    "find_sequential",
    "is_recomputing",
    "plan_micro_batches",
    "split",
    "split_costs",
]
