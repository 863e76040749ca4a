"""BatchNorm across devices: :class:`SyncBatchNorm` for process groups, moments and their merge, the conversion walk.

``moments`` computes a batch's count, mean and centered sum of squares and merges them (Chan et al.'s parallel
formula); ``conversion`` swaps BatchNorm layers for another class and back. :class:`SyncBatchNorm` (processes),
balanced_dp's replica BatchNorm (threads, :mod:`lightning_balanced.data_parallel.replica_batchnorm`) and the
pipeline's ``DeferredBatchNorm`` (micro-batches) are built on these two. :class:`DeviceSyncBatchNorm`
(``layer_sync``) is the DDP strategies' Lightning ``LayerSync`` plugin: torch's SyncBatchNorm on CUDA,
:class:`SyncBatchNorm` elsewhere, the user's layers given back at teardown.
"""

from lightning_balanced.nn.layer_sync import DeviceSyncBatchNorm
from lightning_balanced.nn.sync_batchnorm import SyncBatchNorm

__all__ = ["DeviceSyncBatchNorm", "SyncBatchNorm"]
