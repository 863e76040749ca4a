"""The GPipe core: a pipeline over devices for an ``nn.Sequential``, in one process.

The data flows ``plan_micro_batches`` → ``split`` → ``clock_cycles`` (each cycle's tasks on their partitions' worker
threads, ordered in backward by ``fork``/``join``, moved between devices by ``copy_to_device``, optionally through
``Checkpointing``) → ``join``. :class:`Pipe` composes them; :class:`DeferredBatchNorm` keeps full-mini-batch running
statistics; ``balance`` chooses how many layers each partition gets.

Source: GPipe (Huang et al., NeurIPS 2019) and torchgpipe (Lee et al., 2020), written here from their papers and
documentation.
"""

from lightning_balanced.pipeline.balance import balance_by_parameters, balance_by_time, split_costs
from lightning_balanced.pipeline.batchnorm import DeferredBatchNorm
from lightning_balanced.pipeline.checkpoint import Checkpointing
from lightning_balanced.pipeline.dependency import depend, fork, join
from lightning_balanced.pipeline.microbatch import plan_micro_batches, split
from lightning_balanced.pipeline.pipe import Pipe
from lightning_balanced.pipeline.recompute import is_recomputing
from lightning_balanced.pipeline.schedule import clock_cycles

__all__ = [
    "Checkpointing",
    "DeferredBatchNorm",
    "Pipe",
    "balance_by_parameters",
    "balance_by_time",
    "clock_cycles",
    "depend",
    "fork",
    "is_recomputing",
    "join",
    "plan_micro_batches",
    "split",
    "split_costs",
]
