"""The GPipe core: a pipeline over devices for an ``nn.Sequential``, in one process (``strategy="gpipe"``).

The data flows ``plan_micro_batches`` → ``split`` → ``clock_cycles`` (each cycle's tasks on their partitions' worker
threads, ordered in backward by ``fork``/``join``, moved between devices by ``copy_to_device``, optionally through
``Checkpointing``) → ``join``. :class:`Pipe` composes them. The parts it shares with the multi-process pipeline
(``balance``, :class:`~lightning_balanced.pipeline.DeferredBatchNorm`, micro-batches) are in
:mod:`lightning_balanced.pipeline`.

Source: GPipe (Huang et al., NeurIPS 2019) and torchgpipe (Lee et al., 2020), written here from their papers and
documentation.
"""

from lightning_balanced.gpipe.checkpoint import Checkpointing
from lightning_balanced.gpipe.dependency import depend, fork, join
from lightning_balanced.gpipe.pipe import Pipe
from lightning_balanced.gpipe.schedule import clock_cycles

__all__ = ["Checkpointing", "Pipe", "clock_cycles", "depend", "fork", "join"]
