"""The device-generic data-parallel core: ``plan_chunk_sizes`` → ``scatter`` → ``replicate`` → ``parallel_apply`` →
``gather``.

Each step is a function of its own. On CUDA the steps are torch's own ops (``Scatter`` with explicit chunk sizes,
``replicate``, ``parallel_apply``, ``Gather``); on other devices the same plan runs over virtual devices that share
one physical device (autograd-aware ``split``, ``Module._replicate_for_data_parallel``, a thread per replica, ``cat``).
"""

from lightning_balanced.parallel.chunk_sizes import plan_chunk_sizes
from lightning_balanced.parallel.gather import gather
from lightning_balanced.parallel.parallel_apply import parallel_apply
from lightning_balanced.parallel.replicate import replicate
from lightning_balanced.parallel.scatter import infer_batch_size, scatter

__all__ = ["gather", "infer_batch_size", "parallel_apply", "plan_chunk_sizes", "replicate", "scatter"]
