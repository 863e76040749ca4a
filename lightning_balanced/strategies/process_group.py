"""The default process group of a multi-process strategy.

Started by :class:`ProcessGroupStrategy`, ended by :func:`end_process_group`.
"""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any, Literal

import torch
from lightning.fabric.plugins import CheckpointIO, ClusterEnvironment
from lightning.fabric.utilities.distributed import (
    _distributed_is_initialized,
    _get_default_process_group_backend_for_device,
    _init_dist_connection,
    _sync_ddp_if_available,
)
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.fabric.utilities.seed import reset_seed
from lightning.pytorch.accelerators import Accelerator
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher
from lightning_utilities.core.rank_zero import rank_zero_only as utils_rank_zero_only
from torch import Tensor
from torch.distributed import ReduceOp
from torch.distributed.constants import default_pg_timeout
from typing_extensions import override

__all__ = ["ProcessGroupStrategy", "end_process_group"]

#: How long the gloo workers get, with the GIL free, to release the tensors of their last collectives (s).
_WORKER_CLEANUP_S = 0.05


class ProcessGroupStrategy(ParallelStrategy):
    """One process per device in torch's default process group, launched as Lightning's ``DDPStrategy`` is; no wrapper.

    The process plumbing of ``DDPStrategy`` without its model wrapper, for a strategy that runs its own communication
    (as Lightning's ``ModelParallelStrategy`` holds its own plumbing): Lightning's subprocess script launcher
    (``start_method="popen"``, also ``torchrun`` and SLURM, whose environments create the processes) or its
    multiprocessing launcher (``"spawn"``, ``"fork"``, ``"forkserver"``); ``devices=`` and ``num_nodes=``; the default
    group initialized in ``setup_environment`` with ``process_group_backend`` (``None``: NCCL on CUDA, else gloo) and
    ``timeout``; ``barrier``, ``broadcast`` and ``reduce`` over the world. ``model_to_device`` moves the whole model.

    Args:
        accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin: Lightning's plugins, as
            ``ParallelStrategy`` takes them (the Trainer fills those left ``None``).
        process_group_backend: ``"nccl"``, ``"gloo"``, ...; ``None``: the default for the device.
        timeout: how long a collective of the default group may wait (``torch.distributed.init_process_group``).
        start_method: ``"popen"`` (the script launcher) or a ``multiprocessing`` start method.

    Source: Lightning's ``DDPStrategy`` and ``ModelParallelStrategy`` (the same launchers and process group).
    """

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        cluster_environment: ClusterEnvironment | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
        process_group_backend: str | None = None,
        timeout: timedelta | None = default_pg_timeout,
        start_method: Literal["popen", "spawn", "fork", "forkserver"] = "popen",
    ) -> None:
        super().__init__(accelerator, parallel_devices, cluster_environment, checkpoint_io, precision_plugin)
        self.num_nodes = 1  # the Trainer sets it from `num_nodes=`
        self._process_group_backend = process_group_backend
        self._timeout = timeout
        self._start_method = start_method

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None
        return self.parallel_devices[self.local_rank]

    @property
    def is_distributed(self) -> bool:
        """``True``: what Lightning asks a strategy of its own before it gives each rank a ``DistributedSampler``."""
        return True

    @property
    def num_processes(self) -> int:
        """Processes per node: one per device."""
        return len(self.parallel_devices) if self.parallel_devices is not None else 0

    @property
    def process_group_backend(self) -> str | None:
        """The default group's backend (``None`` until ``setup_environment`` chose the device's default)."""
        return self._process_group_backend

    @override
    def _configure_launcher(self) -> None:
        assert self.cluster_environment is not None
        if self._start_method == "popen":
            self._launcher = _SubprocessScriptLauncher(self.cluster_environment, self.num_processes, self.num_nodes)
        else:
            self._launcher = _MultiProcessingLauncher(self, start_method=self._start_method)

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        self.setup_distributed()

    def setup_distributed(self) -> None:
        """Set the ranks and initialize the default process group (nothing when one is initialized already)."""
        reset_seed()
        self.set_world_ranks()
        self._process_group_backend = self._process_group_backend or _get_default_process_group_backend_for_device(
            self.root_device
        )
        assert self.cluster_environment is not None
        device_id = self.root_device if self.root_device.type != "cpu" else None
        _init_dist_connection(
            self.cluster_environment, self._process_group_backend, timeout=self._timeout, device_id=device_id
        )

    def set_world_ranks(self) -> None:
        """The global rank and world size from the node rank, the local rank and the processes per node."""
        if self.cluster_environment is not None:
            self.cluster_environment.set_global_rank(self.node_rank * self.num_processes + self.local_rank)
            self.cluster_environment.set_world_size(self.num_nodes * self.num_processes)
        # Lightning's rank_zero_only: lightning.fabric's (lightning.pytorch's), in newer releases lightning_utilities'
        rank_zero_only.rank = utils_rank_zero_only.rank = self.global_rank  # type: ignore[attr-defined]

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def barrier(self, name: str | None = None) -> None:
        if not _distributed_is_initialized():
            return
        if torch.distributed.get_backend() == "nccl":
            torch.distributed.barrier(device_ids=[self.root_device.index])
        else:
            torch.distributed.barrier()

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if not _distributed_is_initialized():
            return obj
        held = [obj]
        torch.distributed.broadcast_object_list(held, src, group=torch.distributed.group.WORLD)
        return held[0]

    @override
    def reduce(self, tensor: Any, group: Any | None = None, reduce_op: ReduceOp | str | None = "mean") -> Any:
        """``tensor`` reduced over ``group`` (the world by default) by ``reduce_op``; anything else as it is."""
        if isinstance(tensor, Tensor):
            return _sync_ddp_if_available(tensor, group, reduce_op=reduce_op)
        return tensor


def end_process_group(timeout_s: float = 60.0) -> None:
    """Destroy the default process group once every rank is done with it; nothing when none is initialized.

    Left for interpreter exit, torch's gloo backend sometimes aborts a finished process ("terminate called without an
    active exception", torch 2.13 and 2.14). Destroyed at once, on torch 2.4 it can deadlock instead: the group's
    destructor joins gloo's worker threads while holding the GIL, and a worker still releasing the last collective's
    tensors waits for the GIL to free their Python objects. So on gloo every rank first passes a
    ``monitored_barrier`` (all ranks done, every queued collective finished), then sleeps briefly with the GIL free so
    the workers finish their cleanup, and only then destroys the group.

    Args:
        timeout_s (float): how long the barrier waits for the other ranks, in seconds.

    Raises:
        RuntimeError: a rank did not reach the barrier within ``timeout_s`` (torch's ``monitored_barrier`` names it).
    """
    distributed = torch.distributed
    if not (distributed.is_available() and distributed.is_initialized()):
        return
    if distributed.get_backend() == "gloo":
        distributed.monitored_barrier(timeout=timedelta(seconds=timeout_s), wait_all_ranks=True)
        time.sleep(_WORKER_CLEANUP_S)
    distributed.destroy_process_group()
