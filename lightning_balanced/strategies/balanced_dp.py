"""Single-process data parallel with an uneven, user-controlled split of each batch over the devices."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.plugins import CheckpointIO
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.plugins.precision import Precision
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities import rank_zero_info
from torch import Tensor
from torch.nn import Module
from torch.nn.modules.batchnorm import _BatchNorm
from torchmetrics import Metric
from typing_extensions import override

from lightning_balanced.parallel import gather, infer_batch_size, parallel_apply, plan_chunk_sizes, replicate, scatter
from lightning_balanced.parallel.chunk_sizes import (
    check_one_split_option,
    proportional_split,
    validate_chunk_sizes,
    validate_gpu0_bsz,
    validate_weights,
)
from lightning_balanced.strategies.replica_hooks import (
    Rendezvous,
    RendezvousAborted,
    ReplicaLogRecorder,
    find_metrics,
    install_manual_optimization,
    replay_logs,
    share_metrics,
)

_REPORT_MEMORY_AFTER_STEPS = 3
_RENDEZVOUS_TIMEOUT_S = 120.0


@dataclass(frozen=True)
class _StepCall:
    name: str
    inference_mode: bool
    rendezvous: Rendezvous
    replica_index: int


class _StepDispatcher(Module):
    """What each replica runs: the LightningModule's step method, inside the precision context.

    The step is chosen by an argument rather than by patching ``forward`` on the LightningModule, so replicas, which
    copy the module's ``__dict__``, never run the root's step. Autocast and inference mode are thread-local, so both
    are re-entered here, on the replica's thread (torch's ``parallel_apply`` forwards only autocast's ``enabled``).
    """

    def __init__(self, module: pl.LightningModule, precision_plugin: Precision) -> None:
        super().__init__()
        self.module = module
        self.precision_plugin = precision_plugin

    def _step_context(self, name: str) -> AbstractContextManager[Any]:
        contexts: dict[str, Callable[[], AbstractContextManager[Any]]] = {
            "training_step": self.precision_plugin.train_step_context,
            "validation_step": self.precision_plugin.val_step_context,
            "test_step": self.precision_plugin.test_step_context,
            "predict_step": self.precision_plugin.predict_step_context,
        }
        return contexts[name]()

    @override
    def forward(self, call: _StepCall, *args: Any, **kwargs: Any) -> Any:
        try:
            with torch.inference_mode(call.inference_mode), self._step_context(call.name):
                return getattr(self.module, call.name)(*args, **kwargs)
        except BaseException as err:
            call.rendezvous.abort(call.replica_index, err)
            raise


def _has_training_batchnorm(module: Module) -> bool:
    return any(isinstance(m, _BatchNorm) and m.training for m in module.modules())


if TYPE_CHECKING:
    _StrategyBase = ParallelStrategy
else:
    _StrategyBase = object


class BalancedDataParallel(_StrategyBase):
    """The implementation of :class:`BalancedDataParallelStrategy`, free of a Lightning base class.

    Combined with ``lightning.pytorch``'s ``ParallelStrategy`` it is :class:`BalancedDataParallelStrategy`; combined
    with the standalone ``pytorch_lightning`` package's, it is the class that package's registry holds.
    """

    strategy_name = "balanced_dp"

    def __init__(
        self,
        gpu0_bsz: int | None = None,
        chunk_sizes: Sequence[int] | None = None,
        weights: Sequence[float] | None = None,
        loss_reduction: Literal["mean", "sum"] = "mean",
        accelerator: pl.accelerators.Accelerator | None = None,
        parallel_devices: list[torch.device] | None = None,
        checkpoint_io: CheckpointIO | None = None,
        precision_plugin: Precision | None = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices,
            cluster_environment=None,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )
        check_one_split_option(gpu0_bsz, chunk_sizes, weights)
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"`loss_reduction` must be 'mean' or 'sum', got {loss_reduction!r}")
        self.gpu0_bsz = None if gpu0_bsz is None else validate_gpu0_bsz(gpu0_bsz)
        self.chunk_sizes = None if chunk_sizes is None else validate_chunk_sizes(chunk_sizes, len(chunk_sizes))
        self.weights = None if weights is None else validate_weights(weights, len(weights))
        self.loss_reduction = loss_reduction
        self._dispatcher: _StepDispatcher | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._metric_lock = threading.Lock()
        self._metrics: dict[str, Metric] = {}
        self._plan_reported = False
        self._training_steps = 0

    # ---- a single process ------------------------------------------------------------------------------------------
    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None, "parallel_devices are set by the Trainer"
        return self.parallel_devices[0]

    @property
    @override
    def global_rank(self) -> int:
        return 0

    @property
    @override
    def local_rank(self) -> int:
        return 0

    @property
    @override
    def node_rank(self) -> int:
        return 0

    @property
    @override
    def world_size(self) -> int:
        return 1

    @property
    def is_distributed(self) -> bool:
        """One process: Lightning adds no ``DistributedSampler``."""
        return False

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Identity: there is one process, and the replicas' outputs are already combined by the step."""
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Identity: there is one process."""
        return tensor

    @override
    def barrier(self, name: str | None = None) -> None:
        """Nothing to wait for in one process."""

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Identity: there is one process."""
        return obj

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Identity: there is one process."""
        return decision

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    @override
    def batch_to_device(self, batch: Any, device: torch.device | None = None, dataloader_idx: int = 0) -> Any:
        """On CUDA the batch stays in host memory and each chunk is copied straight to its GPU by the scatter."""
        if self.root_device.type == "cuda":
            device = torch.device("cpu")
        return super().batch_to_device(batch, device=device, dataloader_idx=dataloader_idx)

    # ---- setup and teardown ----------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.parallel_devices, "parallel_devices are set by the Trainer"
        num_devices = len(self.parallel_devices)
        if self.chunk_sizes is not None:
            validate_chunk_sizes(self.chunk_sizes, num_devices)
        if self.weights is not None:
            validate_weights(self.weights, num_devices)
        if self._layer_sync is not None:
            raise ValueError(
                "`Trainer(sync_batchnorm=True)` is not supported with strategy='balanced_dp': its replicas run in one"
                " process and BatchNorm normalizes per chunk. Use DDP (e.g. strategy='ddp') for synchronized BatchNorm."
            )
        super().setup(trainer)
        assert self.lightning_module is not None
        self._dispatcher = _StepDispatcher(self.lightning_module, self.precision_plugin)
        self._metrics = find_metrics(self.lightning_module)
        if num_devices > 1 and self.root_device.type != "cuda" and self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=num_devices - 1, thread_name_prefix="balanced_dp")

    @override
    def teardown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._dispatcher = None
        on_cuda = self.parallel_devices is not None and self.root_device.type == "cuda"
        super().teardown()
        if on_cuda:
            torch.cuda.empty_cache()

    # ---- the steps -------------------------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._data_parallel_step("training_step", args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._data_parallel_step("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._data_parallel_step("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._data_parallel_step("predict_step", args, kwargs)

    def plan(self, batch_size: int) -> list[int]:
        """The chunk sizes, one per device (``0`` = left out), for a batch of ``batch_size`` samples."""
        assert self.parallel_devices is not None
        if self.chunk_sizes is not None:
            if sum(self.chunk_sizes) == batch_size:
                return list(self.chunk_sizes)
            return proportional_split(batch_size, self.chunk_sizes)
        if self.gpu0_bsz is not None:
            return plan_chunk_sizes(batch_size, len(self.parallel_devices), gpu0_bsz=min(self.gpu0_bsz, batch_size))
        return plan_chunk_sizes(batch_size, len(self.parallel_devices), weights=self.weights)

    def _data_parallel_step(self, step_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        module, dispatcher = self.lightning_module, self._dispatcher
        assert module is not None and dispatcher is not None and self.parallel_devices is not None
        batch_size = infer_batch_size((args, kwargs))
        planned = self.plan(batch_size)
        if step_name == "training_step":
            self._report_plan(batch_size, planned)
        devices = [d for d, size in zip(self.parallel_devices, planned, strict=True) if size > 0]
        chunk_sizes = [size for size in planned if size > 0]
        weights = [s / batch_size for s in chunk_sizes] if self.loss_reduction == "mean" else [1.0] * len(chunk_sizes)

        scattered = scatter((args, kwargs), chunk_sizes, devices)
        replicas = replicate(dispatcher, devices, detach=not torch.is_grad_enabled())
        recorders = [ReplicaLogRecorder() for _ in replicas]
        rendezvous = Rendezvous(len(replicas), _RENDEZVOUS_TIMEOUT_S)
        manual = step_name == "training_step" and not module.automatic_optimization
        for i, (replica, device) in enumerate(zip(replicas, devices, strict=True)):
            replica_module = replica.module
            replica_module._device = device
            replica_module.log = recorders[i].log  # type: ignore[method-assign]
            share_metrics(replica_module, self._metrics, self._metric_lock)
            if manual:
                install_manual_optimization(replica_module, module, i, rendezvous, weights[i])

        inference_mode = torch.is_inference_mode_enabled()
        inputs = [(_StepCall(step_name, inference_mode, rendezvous, i), *a) for i, (a, _) in enumerate(scattered)]
        try:
            outputs = parallel_apply(replicas, inputs, [k for _, k in scattered], devices, executor=self._executor)
        except RendezvousAborted as err:
            raise (err.__cause__ or err) from None  # the failing replica's own error, not a waiting one's
        except ValueError as err:
            if 1 in chunk_sizes and step_name == "training_step" and _has_training_batchnorm(module):
                raise ValueError(
                    f"balanced_dp split a batch of {batch_size} as {planned}: a chunk of 1 sample cannot be"
                    " batch-normalized in training (BatchNorm needs more than one value per channel). Change the split"
                    f" ({self._split_setting()}), use a batch size of at least 2 per device, or `drop_last=True` in the"
                    " DataLoader for a short last batch."
                ) from err
            raise
        replay_logs(module, recorders, chunk_sizes)
        if step_name == "training_step":
            self._report_memory()
        return gather(outputs, self.root_device, weights)

    def _split_setting(self) -> str:
        if self.gpu0_bsz is not None:
            return f"gpu0_bsz={self.gpu0_bsz}"
        if self.chunk_sizes is not None:
            return f"chunk_sizes={self.chunk_sizes}"
        if self.weights is not None:
            return f"weights={self.weights}"
        return "set gpu0_bsz, chunk_sizes or weights"

    def _report_plan(self, batch_size: int, planned: list[int]) -> None:
        if self._plan_reported:
            return
        self._plan_reported = True
        if self.gpu0_bsz is not None and self.gpu0_bsz > batch_size:
            raise ValueError(f"`gpu0_bsz` ({self.gpu0_bsz}) must not exceed the batch size ({batch_size})")
        assert self.parallel_devices is not None
        lines = [f"balanced_dp: a batch of {batch_size} is split over {len(planned)} devices as {planned}"]
        for index, (device, size) in enumerate(zip(self.parallel_devices, planned, strict=True)):
            share = 100.0 * size / batch_size
            lines.append(f"  device {index} ({device}): {size} samples ({share:.1f}%)" + ("" if size else ", left out"))
        rank_zero_info("\n".join(lines))

    def _report_memory(self) -> None:
        self._training_steps += 1
        if self._training_steps != _REPORT_MEMORY_AFTER_STEPS or self.root_device.type != "cuda":
            return
        assert self.parallel_devices is not None
        lines = [f"balanced_dp: peak GPU memory after {self._training_steps} training steps (tune gpu0_bsz with it)"]
        for index, device in enumerate(self.parallel_devices):
            peak = torch.cuda.max_memory_allocated(device) / 2**20
            lines.append(f"  device {index} ({device}): {peak:.0f} MiB")
        rank_zero_info("\n".join(lines))

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``"balanced_dp"`` (even split; pass the class with arguments for another plan)."""
        if cls.strategy_name not in strategy_registry:
            strategy_registry.register(
                cls.strategy_name, cls, description=cls.__doc__.splitlines()[0] if cls.__doc__ else ""
            )


class BalancedDataParallelStrategy(BalancedDataParallel, ParallelStrategy):
    """Single-process data parallel over several devices, each taking a chunk of the batch you choose.

    Every step, the batch is split along dim 0 by a chunk plan (:func:`~lightning_balanced.parallel.plan_chunk_sizes`),
    the LightningModule is replicated on each device that got samples, the step (``training_step``,
    ``validation_step``, ``test_step`` or ``predict_step``) runs on all replicas at once, and the outputs are gathered
    on the root device (``devices[0]``) in batch order. On CUDA these are torch's ``scatter``/``replicate``/
    ``parallel_apply``/``gather``; on CPU the same plan runs over virtual devices (one thread per replica), so
    ``Trainer(accelerator="cpu", devices=N, strategy="balanced_dp")`` behaves like N GPUs would.

    The loss is exact: a 0-dim step output (the loss) from replica ``i`` is weighted by ``chunk_sizes[i] /
    batch_size``, so with the usual per-chunk mean loss one step equals the single-device step on the whole batch.
    ``self.log`` inside steps is recorded per replica and logged once per step from the main thread, as the
    chunk-weighted mean (or the sum/max/min for those ``reduce_fx``). torchmetrics metrics are not replicated: all
    replicas update the original metric. Manual optimization works: ``manual_backward`` runs once on the weighted sum of
    the replicas' losses, ``optimizer.step()`` once per step.

    What data parallelism changes, as with ``torch.nn.DataParallel``:

    * BatchNorm normalizes each chunk with that chunk's statistics, and only replica 0's running-statistics update
      persists. A chunk of one sample cannot be batch-normalized in training: such a split raises a ``ValueError``
      naming the setting to change. For cross-device BN statistics use DDP with SyncBatchNorm.
    * Inside a step, replicas' ``self.parameters()`` is empty (parameters are broadcast views); use the modules
      themselves.
    * ``world_size`` is 1 and there is no ``DistributedSampler``: the dataloader's ``batch_size`` is the whole batch
      that is split.

    Args:
        gpu0_bsz: the most samples device 0 takes per batch; the rest is spread evenly over the other devices (the
            classic ``BalancedDataParallel`` setting; device 0 also holds the gathered outputs). ``0`` leaves device 0
            to gathering only. A shorter last batch keeps the cap. Must not exceed the batch size.
        chunk_sizes: explicit samples per device, one entry per device, summing to the dataloader's batch size; a
            batch of another size (the last one) is split in the same proportions.
        weights: relative capacity per device (e.g. memory of mixed GPUs); each batch is split proportionally with
            largest-remainder rounding.
        loss_reduction: how the step's scalar outputs combine across replicas: ``"mean"`` (the step returns the mean
            over its chunk, the default) weights each by its chunk's share of the batch; ``"sum"`` (the step returns a
            sum over its chunk) adds them.
        accelerator, parallel_devices, checkpoint_io, precision_plugin: as for Lightning's ``ParallelStrategy``;
            normally filled in by the ``Trainer`` from ``accelerator=`` and ``devices=``.

    Raises:
        ValueError: more than one of ``gpu0_bsz``, ``chunk_sizes``, ``weights``; a negative or non-integer size;
            weights that are not positive and finite; an unknown ``loss_reduction``. At setup: ``chunk_sizes`` or
            ``weights`` whose length differs from the number of devices, or ``Trainer(sync_batchnorm=True)``.

    Source: Lightning 1.9's ``DataParallelStrategy`` (removed in 2.0) and the ``BalancedDataParallel`` of
    transformer-xl, with the loss weighted by chunk size instead of an unweighted mean.
    """
