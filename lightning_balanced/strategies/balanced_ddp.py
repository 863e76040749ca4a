"""DDP over one global batch, split unevenly over the ranks, each step equal to one process's step on that batch."""

from __future__ import annotations

import importlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_balanced.arguments import check_bool, check_int
from lightning_balanced.batch_scaling.factor_check import LRScaleFactorCheckOnLoad
from lightning_balanced.data_parallel.auto_split import memory_line
from lightning_balanced.data_parallel.carried_exchange import CarriedExchange
from lightning_balanced.data_parallel.rank_shares import RankShare, ShareBatchSampler, share_batch_sampler, share_loader
from lightning_balanced.data_parallel.replica_context import ReplicaLogRecorder, combine_logs
from lightning_balanced.data_parallel.scatter import infer_batch_size
from lightning_balanced.data_parallel.split_policy import SplitPolicy, even_split, split_policy
from lightning_balanced.evaluation.mixin import BATCH_INDICES
from lightning_balanced.nn.layer_sync import DeviceSyncBatchNorm
from lightning_balanced.ranks.reports import rank_zero_report
from lightning_balanced.strategies.peer_failure import PeerFailureReporting
from lightning_balanced.strategies.process_group import end_process_group
from lightning_balanced.strategies.registration import RegisteredStrategy

if TYPE_CHECKING:
    _StrategyBase = DDPStrategy
else:
    _StrategyBase = object

# The registered names and the `start_method` each stands for, as in Lightning's DDP names.
_LAUNCHES = (("balanced_ddp", "popen"), ("balanced_ddp_spawn", "spawn"), ("balanced_ddp_fork", "fork"))
_STEP_LOADERS = {
    "training_step": "train_dataloader",
    "validation_step": "val_dataloaders",
    "test_step": "test_dataloaders",
    "predict_step": "predict_dataloaders",
}


def _loaders(loaders: Any) -> list[Any]:
    if isinstance(loaders, (list, tuple)):
        return list(loaders)
    if isinstance(loaders, dict):
        return list(loaders.values())
    return [] if loaders is None else [loaders]


def _check_max_micro_batch(
    value: int | Sequence[int] | Literal["auto"] | None,
) -> int | list[int] | Literal["auto"] | None:
    if value is None or value == "auto":
        return value
    if isinstance(value, str):
        raise ValueError(f"`max_micro_batch` must be an int >= 1, one per rank, 'auto' or None, got {value!r}")
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [check_int(f"max_micro_batch[{i}]", v, minimum=1) for i, v in enumerate(value)]
    return check_int("max_micro_batch", value, minimum=1)


def _pieces(samples: int, cap: int) -> list[tuple[int, int]]:
    """``(start, size)`` of the micro-batches of a share: as many as ``cap`` needs, sizes within one of each other."""
    count = -(-samples // cap)
    sizes = even_split(samples, count)
    return [(sum(sizes[:k]), size) for k, size in enumerate(sizes)]


def _slice(batch: Any, start: int, size: int) -> Any:
    """Samples ``start .. start + size`` of every tensor of ``batch`` that has a batch dimension."""
    return apply_to_collection(batch, Tensor, lambda t: t[start : start + size] if t.dim() else t)


@dataclass
class _Exchange:
    """A step's exchange in flight, and what :meth:`BalancedDDP._finish_exchange` needs to read it."""

    buffer: Tensor
    logged: list[tuple[str, dict[str, Any]]]  # the combined values' names and self.log options, in buffer order
    share: RankShare
    timed_plan: list[int] | None  # the plan of the step whose time the buffer holds (None: no time sent)
    logs: bool  # whether the per-rank shares and times are logged on this step
    work: Any = None  # its own all_reduce (torch.distributed's Work); None: carried in DDP's gradient all-reduce


# The share of a GPU's memory that max_micro_batch="auto" lets one micro-batch's step use (AutoSplit's default).
_MEMORY_FRACTION = 0.9


class _MeasuredMicroBatch:
    """``max_micro_batch="auto"`` on one rank: the largest micro-batch its GPU holds, from the steps' peak memory.

    A step's peak (forward, backward and optimizer step of its largest micro-batch, with the accumulated gradients and
    the optimizer state) is modelled as ``fixed + per_sample * samples``
    (:func:`~lightning_balanced.data_parallel.auto_split.memory_line` over the last two micro-batch sizes); the cap
    is ``floor((0.9 * capacity - fixed) / per_sample)``, at least 1. Before the first measurement: no cap.
    """

    def __init__(self, capacity_bytes: int) -> None:
        self.capacity_bytes = capacity_bytes
        self.cap: int | None = None
        self._observations: list[tuple[int, int]] = []

    def observe(self, samples: int, peak_bytes: int) -> None:
        """The peak memory of a step whose largest forward pass had ``samples`` samples."""
        if samples < 1 or peak_bytes <= 0:
            return
        if self._observations and self._observations[-1][0] == samples:
            self._observations[-1] = (samples, peak_bytes)
        else:
            self._observations = [*self._observations[-1:], (samples, peak_bytes)]
        fixed, per_sample = memory_line(self._observations)
        room = _MEMORY_FRACTION * self.capacity_bytes - fixed
        if per_sample > 0:
            self.cap = max(math.floor(room / per_sample), 1)
        else:  # no growth with the samples seen: no cap while the fixed part fits
            self.cap = None if room >= 0 else 1


class _StepTimer:
    """This rank's step-method seconds (forward passes and losses) and, on CUDA, peak memory of a training step.

    Several spans (micro-batches) add up. The host clock on the CPU; on CUDA events on the current stream, read at the
    next step's exchange (by then the step has long been queued, so the read waits at most for the previous optimizer
    step). The peak, on CUDA, is ``torch.cuda.max_memory_allocated`` from the start of one step to the start of the
    next: forward, backward and optimizer step.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._cuda = device.type == "cuda"
        self._spans: list[Any] = []
        self._began: Any = None
        self._done: list[Any] | None = None
        self._done_peak = 0

    def new_step(self) -> None:
        """Close the last step's spans for :meth:`take`, and start measuring the peak memory of this one."""
        self._done, self._spans = self._spans or None, []
        if self._cuda:
            self._done_peak = int(torch.cuda.max_memory_allocated(self._device))
            torch.cuda.reset_peak_memory_stats(self._device)

    def start(self) -> None:
        if self._cuda:
            self._began = torch.cuda.Event(enable_timing=True)
            self._began.record()
        else:
            self._began = time.perf_counter()

    def stop(self) -> None:
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._spans.append((self._began, end))
        else:
            self._spans.append(time.perf_counter() - self._began)

    def last_peak(self) -> int | None:
        """The peak bytes of the step before the current one (CUDA); ``None`` on other devices."""
        return self._done_peak if self._cuda else None

    def take(self) -> tuple[float, int | None] | None:
        """The last timed step's seconds and peak bytes (``None``: no step was timed since the last take)."""
        spans, self._done = self._done, None
        if spans is None:
            return None
        if not self._cuda:
            return float(sum(spans)), None
        for _, end in spans:
            end.synchronize()
        seconds = sum(float(began.elapsed_time(end)) for began, end in spans) / 1000.0
        return seconds, self._done_peak


class BalancedDDP(PeerFailureReporting, LRScaleFactorCheckOnLoad, RegisteredStrategy, _StrategyBase):
    """The implementation of :class:`BalancedDDPStrategy`, free of a Lightning base class.

    Combined with ``lightning.pytorch``'s ``DDPStrategy`` it is :class:`BalancedDDPStrategy`; combined with the
    standalone ``pytorch_lightning`` package's, it is the class that package's registry holds.
    """

    strategy_name = "balanced_ddp"
    #: The Lightning package of the base class: where ``TorchSyncBatchNorm`` comes from.
    _lightning_package: ClassVar[str] = "lightning.pytorch"

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``balanced_ddp`` and the ``balanced_ddp_spawn``/``balanced_ddp_fork`` variants.

        Args:
            strategy_registry (_StrategyRegistry): the registry to fill.
        """
        for name, start_method in _LAUNCHES:
            strategy_registry.register(
                name,
                cls,
                description=f"DDP over one global batch split unevenly over the ranks, `start_method` '{start_method}'",
                start_method=start_method,
            )

    def __init__(
        self,
        gpu0_bsz: int | None = None,
        chunk_sizes: Sequence[int] | Literal["auto"] | None = None,
        weights: Sequence[float] | None = None,
        split: SplitPolicy | None = None,
        loss_reduction: Literal["mean", "sum"] = "mean",
        sync_batchnorm: bool = True,
        max_micro_batch: int | Sequence[int] | Literal["auto"] | None = None,
        log_shares: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.max_micro_batch = _check_max_micro_batch(max_micro_batch)
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"`loss_reduction` must be 'mean' or 'sum', got {loss_reduction!r}")
        self.split = split_policy(gpu0_bsz, chunk_sizes, weights, split=split)
        self.loss_reduction = loss_reduction
        self.sync_batchnorm = check_bool("sync_batchnorm", sync_batchnorm)
        self.log_shares = check_bool("log_shares", log_shares)
        # Only a policy that learns from the steps (overrides `observe`) is told each rank's step time.
        self._split_observes = type(self.split).observe is not SplitPolicy.observe
        self._loss_weight = 1.0
        self._micro_batch_grads: list[tuple[Tensor, Tensor]] = []
        self._timer: _StepTimer | None = None
        self._timed_plan: list[int] | None = None  # the plan of the step whose time the timer holds
        self._reported_plan: list[int] | None = None
        self._pending_exchange: _Exchange | None = None
        self._measured_micro_batch: _MeasuredMicroBatch | None = None
        self._largest_forward = 0  # the samples of the last training step's largest forward pass
        self._carrier: CarriedExchange | None = None

    @property
    def data_parallel_size(self) -> int:
        """1: the DataLoader's batch is already the global one, whatever the world size.

        What :func:`~lightning_balanced.batch_scaling.lr_scaling.data_parallel_size` reads: ``ScaleInvariance`` and
        ``ddp_lr``-style scaling see the effective batch ``batch_size x accumulate_grad_batches``, the same on any
        number of ranks.
        """
        return 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """One replica: Lightning's ``DistributedSampler`` then gives every rank the same global order.

        Shuffled for training and seeded as under DDP (``seed_everything``'s seed), reshuffled each epoch
        (``set_epoch``); the strategy cuts each global batch into the ranks' shares (:meth:`process_dataloader`).
        """
        return {"num_replicas": 1, "rank": 0}

    # ---- setup -----------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # As ddp_lr: the accelerator connector sets `_layer_sync` after __init__, and torch's SyncBatchNorm refuses
        # CPU tensors: ours on CPU, torch's on CUDA, both over uneven per-rank counts.
        layer_sync = importlib.import_module(f"{self._lightning_package}.plugins.layer_sync")
        if self.sync_batchnorm and (
            self._layer_sync is None or isinstance(self._layer_sync, layer_sync.TorchSyncBatchNorm)
        ):
            self._layer_sync = DeviceSyncBatchNorm(lambda: self.root_device.type)
        assert self.model is not None
        if self._layer_sync is None and trainer.state.fn == TrainerFn.FITTING:  # evaluation uses running statistics
            layers = [name for name, m in self.model.named_modules() if isinstance(m, _BatchNorm)]
            if layers:
                raise ValueError(
                    f"strategy='balanced_ddp' with `sync_batchnorm=False` cannot give the step of one process on the"
                    f" global batch: BatchNorm layers ({', '.join(layers[:3])}{', ...' if len(layers) > 3 else ''})"
                    " would normalize each rank's share on its own; keep `sync_batchnorm=True` (the default)"
                )
        self.split.check_devices(self.world_size)  # a per-rank list of the wrong length fails on every rank alike
        if isinstance(self.max_micro_batch, list) and len(self.max_micro_batch) != self.world_size:
            raise ValueError(
                f"`max_micro_batch` needs one entry per rank ({self.world_size}), got {len(self.max_micro_batch)}:"
                f" {self.max_micro_batch}"
            )
        if self.max_micro_batch is not None and any(isinstance(m, _BatchNorm) for m in self.model.modules()):
            raise ValueError(
                "strategy='balanced_ddp' cannot run a share in micro-batches (`max_micro_batch`) with BatchNorm layers:"
                " BatchNorm normalizes over the samples of one forward pass, so the step would change (and the ranks'"
                " synchronized layers would meet a different number of times); drop `max_micro_batch`"
            )
        if self.max_micro_batch is not None and not self.lightning_module.automatic_optimization:  # type: ignore[union-attr]
            raise ValueError(
                "strategy='balanced_ddp' runs a share in micro-batches (`max_micro_batch`) under automatic"
                " optimization only: with `automatic_optimization = False`, cut the batch in your training_step"
            )
        super().setup(trainer)
        self._timer = _StepTimer(self.root_device)
        self._timed_plan = None
        self._measured_micro_batch, self._largest_forward = None, 0
        if self.max_micro_batch == "auto":
            if self.root_device.type == "cuda":
                memory = torch.cuda.get_device_properties(self.root_device).total_memory
                self._measured_micro_batch = _MeasuredMicroBatch(memory)
            else:
                rank_zero_report(
                    f"balanced_ddp: max_micro_batch='auto' measures GPU memory; on {self.root_device.type} ranks a"
                    " share runs in one forward pass"
                )
        if self._split_observes and self.root_device.type == "cuda":
            self.split.set_capacities(self._gpu_capacities())

    @override
    def _register_ddp_hooks(self) -> None:
        """As DDP's; without a communication hook of the user's, the step's exchange rides in DDP's all-reduce."""
        super()._register_ddp_hooks()
        self._carrier = None
        if self._ddp_comm_hook is None and self._model_averaging_period is None:
            assert isinstance(self.model, DistributedDataParallel)
            self._carrier = CarriedExchange()
            self.model.register_comm_hook(self.model.process_group, self._carrier.reduce)

    def _gpu_capacities(self) -> list[int | None]:
        """Each rank's GPU memory in bytes (one all_reduce at setup)."""
        capacities = torch.zeros(self.world_size, dtype=torch.float64, device=self.root_device)
        capacities[self.global_rank] = torch.cuda.get_device_properties(self.root_device).total_memory
        dist.all_reduce(capacities)
        return [int(c) for c in capacities.tolist()]

    @override
    def process_dataloader(self, dataloader: object) -> object:
        """``dataloader``, yielding this rank's share of each of its global batches (:func:`share_loader`)."""
        dataloader = super().process_dataloader(dataloader)
        if share_batch_sampler(dataloader) is not None:
            return dataloader
        return share_loader(dataloader, self.split, self.global_rank, self.world_size)

    # ---- the steps -------------------------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._share_step("training_step", args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._share_step("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._share_step("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        return self._share_step("predict_step", args, kwargs)

    def _take_share(self, step_name: str) -> RankShare:
        """The share of the batch this step runs: the oldest one pending in the step's loaders."""
        module = self.lightning_module
        assert module is not None
        loaders = _loaders(getattr(module.trainer, _STEP_LOADERS[step_name], None))
        samplers = [sampler for sampler in map(share_batch_sampler, loaders) if sampler is not None]
        if step_name == "training_step" and len(samplers) > 1:
            raise ValueError(
                f"strategy='balanced_ddp' splits one train DataLoader's global batches, got {len(samplers)}: combine"
                " them into one Dataset"
            )
        pending = [sampler for sampler in samplers if sampler.pending]
        if not pending:
            raise RuntimeError(
                f"strategy='balanced_ddp': a batch reached {step_name} that the strategy's DataLoader did not cut"
                " (no share of a global batch is pending); feed the step through Lightning's loop and its DataLoader"
            )
        oldest: ShareBatchSampler = min(pending, key=lambda sampler: sampler.pending[0].sequence)
        return oldest.pending.popleft()

    def _share_step(self, step_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        module = self.lightning_module
        assert module is not None
        self._finish_exchange()  # a step whose backward never came (a skipped backward): its exchange ends here
        share = self._take_share(step_name)
        samples = len(share.indices)
        batch = args[0] if args else kwargs["batch"]
        if samples == 0:  # the sampler yielded one sample for the structure: cut to none
            batch = _slice(batch, 0, 0)
        try:
            found = infer_batch_size(batch)
        except ValueError:
            found = samples  # no tensor with a batch dimension to count
        if found != samples:
            raise RuntimeError(
                f"strategy='balanced_ddp': a batch of {found} samples reached {step_name} where rank"
                f" {self.global_rank}'s share of the global batch has {samples}; the batch must come from the"
                " strategy's DataLoader unchanged in size"
            )
        training = step_name == "training_step"
        timer = self._timer if training else None
        if timer is not None:
            timer.new_step()
            peak = timer.last_peak()
            if self._measured_micro_batch is not None and peak is not None:
                self._measured_micro_batch.observe(self._largest_forward, peak)
        cap = self._micro_batch_cap() if training else None
        pieces = [(0, samples)] if cap is None or samples <= cap else _pieces(samples, cap)
        if training:
            self._largest_forward = max(size for _, size in pieces)
            # Before the step runs: `manual_backward` in training_step and the last micro-batch's backward read it.
            self._loss_weight = self._weight(pieces[-1][1], share.global_size)
        run = getattr(super(), step_name)
        recorders: list[ReplicaLogRecorder] = []
        output: Any = None
        # The micro-batches' gradients are kept aside until `backward`: Lightning's closure may zero the gradients
        # between training_step and backward (on the first batch of an accumulation window).
        params = [p for p in module.parameters() if p.requires_grad] if len(pieces) > 1 else []
        previous = [param.grad for param in params]
        for param in params:
            param.grad = None
        for number, (start, size) in enumerate(pieces):
            piece = batch if len(pieces) == 1 else _slice(batch, start, size)
            piece_args, piece_kwargs = ((piece, *args[1:]), kwargs) if args else (args, {**kwargs, "batch": piece})
            recorders.append(ReplicaLogRecorder())
            module.log = recorders[-1].log  # type: ignore[method-assign]
            module.__dict__[BATCH_INDICES] = share.indices[start : start + size]
            last = number == len(pieces) - 1
            try:
                if timer is not None:
                    timer.start()
                if last:
                    output = run(*piece_args, **piece_kwargs)
                    if timer is not None:
                        timer.stop()
                else:
                    self._backward_micro_batch(run, piece_args, piece_kwargs, size, share.global_size, timer)
            finally:
                module.__dict__.pop("log", None)
                module.__dict__.pop(BATCH_INDICES, None)
        self._micro_batch_grads = [(param, param.grad) for param in params if param.grad is not None]
        for param, grad in zip(params, previous, strict=True):
            param.grad = grad
        if training:
            self._report_plan(share)
        sizes = [size for _, size in pieces]
        calls = recorders[0].calls if len(recorders) == 1 else combine_logs(recorders, sizes, self.root_device)
        exchange = self._pending_exchange = self._exchange(module, calls, share, training)
        # Where a backward pass follows for sure (automatic optimization, a loss returned), the exchange is finished
        # in `backward`: carried in DDP's gradient all-reduce when that backward synchronizes (no collective of its
        # own), else overlapped with it. Otherwise now.
        overlapped = training and module.automatic_optimization and output is not None
        if overlapped and self._carrier is not None and getattr(self.model, "require_backward_grad_sync", False):
            self._carrier.send(exchange.buffer)
        else:
            exchange.work = dist.all_reduce(exchange.buffer, async_op=True)
        if not overlapped:
            self._finish_exchange()
        if training:
            self._timed_plan = share.chunk_sizes
        return output

    def _weight(self, samples: int, global_size: int) -> float:
        """The loss weight of ``samples`` of a global batch of ``global_size``: DDP's mean then gives the global one."""
        return float(self.world_size) if self.loss_reduction == "sum" else self.world_size * samples / global_size

    def _micro_batch_cap(self) -> int | None:
        cap = self.max_micro_batch
        if cap == "auto":
            measured = self._measured_micro_batch
            return None if measured is None else measured.cap
        return cap[self.global_rank] if isinstance(cap, list) else cap

    def _backward_micro_batch(
        self,
        run: Any,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        samples: int,
        global_size: int,
        timer: _StepTimer | None,
    ) -> None:
        """Forward and backward of one micro-batch of a share, under DDP's ``no_sync``: its gradient accumulates.

        Weighted as the share's last micro-batch will be, and divided by ``accumulate_grad_batches`` as Lightning's
        closure divides the loss it backpropagates, so the share's micro-batches add up to the share's gradient.
        """
        module = self.lightning_module
        assert module is not None and self.model is not None
        with self.model.no_sync():  # type: ignore[operator]
            output = run(*args, **kwargs)
            if timer is not None:
                timer.stop()
            loss = output.get("loss") if isinstance(output, dict) else output
            if not isinstance(loss, Tensor):
                raise ValueError(
                    "strategy='balanced_ddp' with `max_micro_batch` backpropagates each micro-batch's loss:"
                    " training_step must return the loss (a Tensor, or a dict with 'loss'),"
                    f" got {type(output).__name__}"
                )
            weight = self._weight(samples, global_size) / module.trainer.accumulate_grad_batches
            super().backward(loss * weight, None)  # not this class's: no stashed gradients, no weight of the share

    def _report_plan(self, share: RankShare) -> None:
        """One line per rank when a full batch's plan first appears or changes (as balanced_dp reports its split)."""
        if share.chunk_sizes == self._reported_plan or (
            self._reported_plan is not None and share.global_size != sum(self._reported_plan)
        ):
            return
        self._reported_plan = share.chunk_sizes
        total = max(share.global_size, 1)
        lines = [
            f"balanced_ddp: a global batch of {share.global_size} samples is split over"
            f" {self.world_size} ranks as {share.chunk_sizes} ({self.split})"
        ]
        lines += [f"  rank {r}: {n} samples ({100.0 * n / total:.1f}%)" for r, n in enumerate(share.chunk_sizes)]
        rank_zero_report("\n".join(lines))

    def _exchange(
        self, module: pl.LightningModule, calls: dict[str, tuple[Any, dict[str, Any]]], share: RankShare, training: bool
    ) -> _Exchange:
        """Start the step's one all_reduce: each rank's samples, its last step time, and the step's logged values.

        Values logged with the default ``reduce_fx="mean"`` are combined weighted by each rank's share (a zero share
        adds nothing, whatever its value), ``"sum"`` summed; each is logged once, as the global batch's value, with
        ``batch_size`` the global batch and no second reduction (:meth:`_finish_exchange`). Others (``max``/``min``,
        a callable, a Metric) are logged now, as the rank gave them.
        """
        size, rank, samples = self.world_size, self.global_rank, len(share.indices)
        combined: list[tuple[str, Any, dict[str, Any], str]] = []
        for name, (value, options) in calls.items():
            reduce = options.get("reduce_fx", "mean")
            kind = reduce.lower() if isinstance(reduce, str) else {torch.mean: "mean", torch.sum: "sum"}.get(reduce, "")
            if kind in ("mean", "sum") and (
                isinstance(value, (int, float)) or (isinstance(value, Tensor) and value.numel() == 1)
            ):
                combined.append((name, value, options, kind))
            else:
                module.log(name, value, **options)
        # [samples | seconds | peak bytes | logged values], one slot per rank in the first three (the others' are 0).
        buffer = torch.zeros(3 * size + len(combined), dtype=torch.float64, device=self.root_device)
        buffer[rank] = samples
        # Times only where they are used (each rank decides alike): reading them waits for the device on CUDA.
        logs = self.log_shares and getattr(module.trainer._logger_connector, "should_update_logs", True)
        wanted = training and self._timer is not None and (self._split_observes or logs)
        timed = self._timer.take() if wanted and self._timer is not None else None
        if timed is not None:
            buffer[size + rank] = timed[0]
            buffer[2 * size + rank] = -1 if timed[1] is None else timed[1]
        for k, (_, value, _, kind) in enumerate(combined):
            if samples:
                weight = samples / share.global_size if kind == "mean" else 1.0
                buffer[3 * size + k] = torch.as_tensor(value).detach().reshape(()).to(buffer) * weight
        timed_plan = self._timed_plan if timed is not None else None
        return _Exchange(buffer, [(name, options) for name, _, options, _ in combined], share, timed_plan, logs)

    def _finish_exchange(self) -> None:
        """Wait for the step's all_reduce, check the ranks' counts, log the combined values and the shares."""
        exchange, self._pending_exchange = self._pending_exchange, None
        if exchange is None:
            return
        module = self.lightning_module
        assert module is not None
        size, rank, share, buffer = self.world_size, self.global_rank, exchange.share, exchange.buffer
        if exchange.work is not None:
            exchange.work.wait()
        else:
            assert self._carrier is not None
            carried = self._carrier.receive()
            if carried is None:  # no bucket could carry it (or no backward came): on every rank alike
                dist.all_reduce(buffer)
            else:
                buffer = carried
        head = buffer[: 3 * size].tolist()  # one read from the device
        counts = [int(c) for c in head[:size]]
        if counts != share.chunk_sizes:
            raise RuntimeError(
                f"strategy='balanced_ddp': the ranks ran {counts} samples of a global batch planned {share.chunk_sizes}"
                f" (rank {rank}'s view): the ranks' split policies disagree. A policy must plan the same on every rank"
                " (a pure function of the batch size and what it observed from the gathered step times)"
            )
        for k, (name, options) in enumerate(exchange.logged):
            module.log(name, buffer[3 * size + k], **{**options, "batch_size": share.global_size, "sync_dist": False})
        if exchange.timed_plan is None:
            return
        times = head[size : 2 * size]
        if self._split_observes:
            peaks = [None if b < 0 else int(b) for b in head[2 * size :]]
            self.split.observe(list(exchange.timed_plan), times, None if None in peaks else peaks)
        # Only on the steps whose logs reach the loggers (every `log_every_n_steps`): a `self.log` call costs about
        # 0.4 ms, and 3 per rank every step cost 20 % of a small step (measured by benchmarks/bench_balanced_ddp.py).
        if exchange.logs:
            slowest = max(times)
            for r in range(size):
                module.log(f"balanced_ddp/share_rank{r}", float(exchange.timed_plan[r]), batch_size=share.global_size)
                module.log(f"balanced_ddp/step_s_rank{r}", times[r], batch_size=share.global_size)
                module.log(f"balanced_ddp/idle_s_rank{r}", slowest - times[r], batch_size=share.global_size)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """DDP's backward on the loss weighted by ``world_size * share / global batch``.

        DDP averages the ranks' gradients; so weighted, the average is the gradient of the global batch's mean loss.
        A zero share's loss (a mean over no samples: NaN) is weighted by 0, which gives zero gradients.
        """
        for param, grad in self._micro_batch_grads:  # before DDP's synchronized backward, which reduces them too
            param.grad = grad if param.grad is None else param.grad + grad
        self._micro_batch_grads = []
        loss = super().backward(closure_loss * self._loss_weight, optimizer, *args, **kwargs)
        if self._pending_exchange is not None:  # the step's exchange, overlapped with this backward pass
            module = self.lightning_module
            assert module is not None
            called_from, module._current_fx_name = module._current_fx_name, "training_step"  # its logs are the step's
            try:
                self._finish_exchange()
            finally:
                module._current_fx_name = called_from
        return loss

    @override
    def teardown(self) -> None:
        """As DDP's; a spawned or forked worker then ends its process group (as ``ddp_lr`` does)."""
        self._timer = None
        self._pending_exchange = None
        super().teardown()
        if getattr(self, "_start_method", "popen") in ("spawn", "fork", "forkserver"):
            end_process_group()


class BalancedDDPStrategy(BalancedDDP, DDPStrategy):
    """DDP over one global batch split unevenly over the ranks: each step is one process's step on the whole batch.

    The DataLoader's ``batch_size`` is the **global** batch ``B``. Every rank walks the same global order (Lightning's
    ``DistributedSampler`` over one replica: shuffled for training, seeded as under DDP, reshuffled each epoch) and
    takes its share of each global batch, planned by a split policy over the ranks (``EvenSplit`` by default,
    ``ChunkSizes``, ``Weights``, ``Gpu0Budget`` for rank 0, ``chunk_sizes="auto"`` measured and re-planned as the
    ranks' speeds change, or a policy of your own). A rank may get 0 samples; the last, short global batch is split
    too, and ``drop_last`` applies to the global batches. Validation, test and predict split their batches by the
    same policy.

    The step: each rank's loss is weighted by ``world_size * share / B`` (the loss scale, so every precision plugin
    and DDP's own all-reduce stay as they are; a communication hook would have to learn ``B`` and the shares in the
    hook), so DDP's average of the gradients is the gradient of the global batch's mean loss. With
    ``sync_batchnorm=True`` (the default) BatchNorm normalizes over the whole global batch with uneven counts; without
    it a model with BatchNorm is refused at setup, since the step would differ from one process's. Gradient clipping by
    norm sees the all-reduced (global) gradient. What ``training_step`` (and the evaluation steps) log with
    ``self.log`` is combined over the ranks in one ``all_reduce`` per step, weighted by share, and logged once as the
    global batch's value on every rank (``reduce_fx`` ``"mean"`` or ``"sum"``; other reductions and metrics are logged
    as under DDP). Every rank must log the same names in a step. A zero share's step runs on an empty batch (its
    collectives, DDP's and SyncBatchNorm's, must still run): its loss (NaN for a mean over nothing) is weighted by 0.

    Because the step is a function of the global batch only, the same config trains the same on 1 or 64 processes,
    and a checkpoint saved on ``W1`` ranks resumes on ``W2`` at an epoch boundary with exactly the steps an
    uninterrupted run takes (no learning-rate rescaling: the effective batch does not change). A mid-epoch resume
    restarts the interrupted epoch's order, as Lightning does for a plain DataLoader under DDP.

    ``DistributedEvalMixin`` gathers exactly: each rank's share carries its sample indices to ``add_eval_outputs``.

    Args:
        gpu0_bsz: the most samples rank 0 takes of each global batch (:class:`~lightning_balanced.Gpu0Budget`).
        chunk_sizes: samples per rank for a global batch of their sum (:class:`~lightning_balanced.ChunkSizes`), or
            ``"auto"`` (:class:`~lightning_balanced.AutoSplit`: each rank's forward time per sample, measured over the
            first steps and gathered in the step's all_reduce, re-planned on lasting drift).
        weights: relative capacity per rank (:class:`~lightning_balanced.Weights`).
        split: a :class:`~lightning_balanced.SplitPolicy` over the ranks; at most one of these four.
        loss_reduction: how ``training_step``'s loss reduces over samples: ``"mean"`` (weighted by share) or ``"sum"``.
        sync_batchnorm: synchronize BatchNorm over the ranks (torch's ``SyncBatchNorm`` on CUDA, the package's on
            CPU/gloo).
        max_micro_batch: the most samples a rank runs in one forward pass (an int for every rank, or one per rank):
            a larger share runs as micro-batches of near-equal size, all but the last forward and backward under
            DDP's ``no_sync``, each weighted by its samples, so the step is the same. Automatic optimization only, and
            refused with BatchNorm (which normalizes over one forward pass's samples). ``"auto"``: on CUDA, each rank
            its own, from its steps' peak memory (``torch.cuda.max_memory_allocated``) fitted as fixed + per-sample
            bytes, so a micro-batch's step uses at most 90 % of the GPU (the first step runs the share whole); on
            other devices no cap.
        log_shares: log ``balanced_ddp/share_rank{r}``, ``balanced_ddp/step_s_rank{r}`` (the step method's seconds)
            and ``balanced_ddp/idle_s_rank{r}`` (behind the slowest rank) for every rank, on the training steps whose
            logs the loggers write (every ``log_every_n_steps``).
        **kwargs: what :class:`~lightning.pytorch.strategies.DDPStrategy` takes (``start_method``,
            ``process_group_backend``, ``timeout``, ``find_unused_parameters``, ...).

    Raises:
        TypeError, ValueError: a bad split option (:func:`~lightning_balanced.data_parallel.split_policy.split_policy`)
            or ``loss_reduction``; at setup, a per-rank policy of the wrong length, or BatchNorm without
            ``sync_batchnorm``; when a DataLoader is set up, one the strategy cannot split
            (:func:`~lightning_balanced.data_parallel.rank_shares.share_loader`), or several train DataLoaders.
        RuntimeError: in a step, when the ranks' plans disagree (a policy that is not the same on every rank).

    Source: Lightning's ``DDPStrategy``; uneven batches per worker as in LB-BSP (Chen et al., SoCC 2020), with the
    gradient weighted by share so that the step is exact.
    """
