"""balanced_dp's device replicas: a split policy's plan (:mod:`lightning_balanced.split_policies`) → ``scatter`` →
``replicate`` → ``parallel_apply`` → ``gather``.

Each step is a function of its own. On CUDA the steps are torch's own ops (``Scatter`` with explicit chunk sizes,
``replicate``, ``parallel_apply``, ``Gather``); on CPU the same plan runs over virtual devices ``cpu:0``, ``cpu:1``, ...
that share the host's memory but keep their identity (:mod:`~lightning_balanced.data_parallel.virtual_device`), so the
rules torch's CUDA ops enforce fail on CPU too (autograd-aware ``split``, ``Module._replicate_for_data_parallel``, a
thread per replica, ``cat``).
"""

from lightning_balanced.data_parallel.gather import gather
from lightning_balanced.data_parallel.parallel_apply import parallel_apply
from lightning_balanced.data_parallel.replicate import check_replicable, replicate
from lightning_balanced.data_parallel.scatter import infer_batch_size, scatter
from lightning_balanced.data_parallel.virtual_device import virtual_devices

__all__ = [
    "check_replicable",
    "gather",
    "infer_batch_size",
    "parallel_apply",
    "replicate",
    "scatter",
    "virtual_devices",
]
