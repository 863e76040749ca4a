"""The share engine: each rank's share of one global batch, its loss weight, and the step's exchange between the ranks.

What ``balanced_ddp`` and ``balanced_fsdp`` do per step, written once. A strategy owns one :class:`ShareEngine`, hands
its DataLoaders to :meth:`ShareEngine.process_dataloader` and its step methods to :meth:`ShareEngine.step`, and
multiplies the loss it backpropagates by :attr:`ShareEngine.loss_weight`; the data-parallel reduction (DDP's
all-reduce, FSDP2's reduce-scatter: both average over the ranks) then gives the gradient of the global batch's mean
loss. What differs between the strategies comes in as callables: how to run a micro-batch without gradient
synchronization, and the base class's (unweighted) backward.
"""

from __future__ import annotations

import functools
import math
import os
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal, Protocol

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

from lightning_balanced.arguments import check_bool, check_int
from lightning_balanced.data_parallel.gather import share_weight
from lightning_balanced.data_parallel.replica_context import ReplicaLogRecorder, combine_logs
from lightning_balanced.data_parallel.scatter import infer_batch_size
from lightning_balanced.evaluation.mixin import BATCH_INDICES
from lightning_balanced.rank_shares.carried_exchange import CarriedExchange
from lightning_balanced.rank_shares.exchange import ExchangeReading, share_exchange_layout
from lightning_balanced.rank_shares.loader import RankShare, share_batch_sampler, share_loader
from lightning_balanced.rank_shares.step_timer import StepTimer
from lightning_balanced.ranks.exchange import ExchangeLayout
from lightning_balanced.ranks.reports import rank_zero_report
from lightning_balanced.split_policies.auto_split import memory_line
from lightning_balanced.split_policies.split_policy import (
    SplitPolicy,
    even_split,
    learns_from_steps,
    observes_peak_bytes,
)

__all__ = [
    "GlobalBatchShares",
    "MeasuredMicroBatch",
    "ShareEngine",
    "ShareStep",
    "check_max_micro_batch",
    "gathered_gpu_capacities",
]

_STEP_LOADERS = {
    "training_step": "train_dataloader",
    "validation_step": "val_dataloaders",
    "test_step": "test_dataloaders",
    "predict_step": "predict_dataloaders",
}
# The share of a GPU's memory that max_micro_batch="auto" lets one micro-batch's step use (AutoSplit's default).
_MEMORY_FRACTION = 0.9


class ShareHost(Protocol):
    """What the engine reads of its strategy (a Lightning ``ParallelStrategy``)."""

    @property
    def world_size(self) -> int: ...
    @property
    def global_rank(self) -> int: ...
    @property
    def root_device(self) -> torch.device: ...
    @property
    def lightning_module(self) -> pl.LightningModule | None: ...


def check_max_micro_batch(
    value: int | Sequence[int] | Literal["auto"] | None,
) -> int | list[int] | Literal["auto"] | None:
    """``max_micro_batch`` checked: ``None``, ``"auto"``, an int >= 1 or one per rank.

    Raises:
        ValueError: another string, or a value < 1.
        TypeError: a value that is not an int.
    """
    if value is None or value == "auto":
        return value
    if isinstance(value, str):
        raise ValueError(f"`max_micro_batch` must be an int >= 1, one per rank, 'auto' or None, got {value!r}")
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        return [check_int(f"max_micro_batch[{i}]", v, minimum=1) for i, v in enumerate(value)]
    return check_int("max_micro_batch", value, minimum=1)


def _loaders(loaders: Any) -> list[Any]:
    if isinstance(loaders, (list, tuple)):
        return list(loaders)
    if isinstance(loaders, dict):
        return list(loaders.values())
    return [] if loaders is None else [loaders]


def _pieces(samples: int, cap: int) -> list[tuple[int, int]]:
    """``(start, size)`` of the micro-batches of a share: as many as ``cap`` needs, sizes within one of each other."""
    count = -(-samples // cap)
    sizes = even_split(samples, count)
    return [(sum(sizes[:k]), size) for k, size in enumerate(sizes)]


def _slice(batch: Any, start: int, size: int) -> Any:
    """Samples ``start .. start + size`` of every tensor of ``batch`` that has a batch dimension."""
    return apply_to_collection(batch, Tensor, lambda t: t[start : start + size] if t.dim() else t)


class ShareStep:
    """A strategy's step method (``training_step``, ...) that runs its base class's on this rank's share.

    Written once for every strategy that owns a :class:`ShareEngine` as ``self.shares``: in the class body,
    ``training_step = ShareStep()``. The base class's method is the next one after the class the attribute is set in
    (``super(owner, self)``), as a ``super().training_step`` written there would find; a strategy with a
    ``redirected_step(name, *args, **kwargs)`` method runs the step through it instead.
    """

    def __set_name__(self, owner: type, name: str) -> None:
        self._owner, self._name = owner, name

    def __get__(self, instance: Any, owner: type | None = None) -> Any:
        if instance is None:
            return self
        base = getattr(super(self._owner, instance), self._name)
        redirect = getattr(instance, "redirected_step", None)
        if redirect is not None:
            base = functools.partial(redirect, self._name)

        def step(*args: Any, **kwargs: Any) -> Any:
            return instance.shares.step(self._name, base, args, kwargs)

        return step


class GlobalBatchShares:
    """A base-free strategy mixin: the DataLoader's batch is the global one, and each rank runs its share of it.

    For a strategy that owns a :class:`ShareEngine` as ``self.shares`` (``balanced_ddp``, ``balanced_fsdp``): its
    ``process_dataloader`` yields this rank's share of each global batch (:func:`share_loader`), and its four step
    methods run the base class's on that share (:class:`ShareStep`). List it just before the Lightning base class, so
    the steps' base methods are that class's.
    """

    shares: ShareEngine

    def process_dataloader(self, dataloader: object) -> object:
        """``dataloader``, yielding this rank's share of each of its global batches (:func:`share_loader`)."""
        return self.shares.process_dataloader(super().process_dataloader(dataloader))  # type: ignore[misc]

    training_step = ShareStep()
    validation_step = ShareStep()
    test_step = ShareStep()
    predict_step = ShareStep()


def gathered_gpu_capacities(host: ShareHost) -> list[int | None]:
    """Each rank's GPU memory in bytes (``None`` off CUDA), gathered on every rank (one all_reduce on CUDA)."""
    if host.root_device.type != "cuda":
        return [None] * host.world_size
    capacities = torch.zeros(host.world_size, dtype=torch.float64, device=host.root_device)
    capacities[host.global_rank] = torch.cuda.get_device_properties(host.root_device).total_memory
    dist.all_reduce(capacities)
    return [int(c) for c in capacities.tolist()]


class MeasuredMicroBatch:
    """``max_micro_batch="auto"`` on one rank: the largest micro-batch its device holds, from the steps' peak memory.

    A step's peak (forward, backward and optimizer step of its largest micro-batch, with the accumulated gradients and
    the optimizer state) is modelled as ``fixed + per_sample * samples``
    (:func:`~lightning_balanced.split_policies.auto_split.memory_line` over the last two micro-batch sizes); the cap
    is ``floor((0.9 * capacity - fixed) / per_sample)``, at least 1. Before the first measurement: no cap.

    Args:
        capacity_bytes (int): the device's memory, in bytes.
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


@dataclass
class _Exchange:
    """A step's exchange in flight, and what :meth:`ShareEngine.finish_exchange` needs to read it."""

    layout: ExchangeLayout
    buffer: Tensor
    logged: list[tuple[str, dict[str, Any]]]  # the combined values' names and self.log options, in buffer order
    share: RankShare
    timed_plan: list[int] | None  # the plan of the step whose time the buffer holds (None: no time sent)
    logs: bool  # whether the per-rank shares and times are logged on this step
    work: Any = None  # its own all_reduce (torch.distributed's Work); None: carried in the gradient all-reduce


class ShareEngine:
    """The per-step work of a strategy whose DataLoader batch is the global one, split over the ranks by a policy.

    Args:
        name (str): the strategy's registered name, quoted in errors and reports.
        split (SplitPolicy): the split policy over the ranks (the strategy's
            :class:`~lightning_balanced.split_policies.split_policy.SplitOptions` made it).
        loss_reduction (str): ``"mean"`` (each rank's loss weighted by ``world_size * share / B``) or ``"sum"``
            (weighted by ``world_size``), checked by ``SplitOptions``.
        max_micro_batch: the most samples a rank runs in one forward pass (see :func:`check_max_micro_batch`).
        log_shares (bool): log each rank's share, step seconds and idle seconds on the steps the loggers write.

    Raises:
        TypeError, ValueError: a bad ``max_micro_batch`` or ``log_shares``.
    """

    def __init__(
        self,
        name: str,
        split: SplitPolicy,
        loss_reduction: Literal["mean", "sum"],
        max_micro_batch: int | Sequence[int] | Literal["auto"] | None,
        log_shares: bool,
    ) -> None:
        self.name = name
        self.max_micro_batch = check_max_micro_batch(max_micro_batch)
        self.split = split
        self.loss_reduction = loss_reduction
        self.log_shares = check_bool("log_shares", log_shares)
        #: The loss weight of the step running now (set before its step method runs).
        self.loss_weight = 1.0
        #: Carries the exchange in the gradient all-reduce (DDP's communication hook); ``None``: its own all_reduce.
        self.carrier: CarriedExchange | None = None
        #: Whether the step's own all_reduce may overlap the backward pass. Not where the backward's collectives run
        #: on the same process group concurrently (FSDP2's reduce-scatters): gloo's worker threads could pair two
        #: ranks' collectives in different orders.
        self.overlap = True
        #: Whether every rank runs the same number of micro-batches (FSDP2: each forward pass all-gathers the
        #: parameters, a collective), some of them empty; else each rank as many as its own share needs (DDP).
        self.equal_micro_batches = False
        #: A peak measured on the host for devices without CUDA's allocator statistics (``balanced_fsdp``).
        self.host_peak: Callable[[Callable[[], Any]], Any] | None = None
        self._host: ShareHost | None = None
        self._no_sync: Callable[[], AbstractContextManager[Any]] = nullcontext
        self._backward: Callable[[Tensor], Any] | None = None
        self._micro_batch_grads: list[tuple[Tensor, Tensor]] = []
        self._timer: StepTimer | None = None
        self._timed_plan: list[int] | None = None
        self._reported_plan: list[int] | None = None
        self._pending: _Exchange | None = None
        self._measured_micro_batch: MeasuredMicroBatch | None = None
        self._largest_forward = 0
        self._rank_caps: list[int | None] | None = None  # every rank's measured cap, from the last exchange
        self._seed: int | None = None
        self._observe_peaks = False

    @property
    def host(self) -> ShareHost:
        """The strategy (set by :meth:`attach`)."""
        if self._host is None:
            raise RuntimeError(f"strategy={self.name!r}: the share engine is used before its strategy's setup")
        return self._host

    @property
    def observes(self) -> bool:
        """Whether the split policy learns from the steps: only then are they timed for it."""
        return learns_from_steps(self.split)

    # ---- setup -------------------------------------------------------------------------------------------------------
    def bind(self, host: ShareHost) -> None:
        """The strategy whose ranks the engine splits over (its world size and rank are read when needed)."""
        self._host = host

    def attach(
        self,
        no_sync: Callable[[], AbstractContextManager[Any]],
        backward: Callable[[Tensor], Any],
        capacities: list[int | None] | None,
    ) -> None:
        """Start a run, in the strategy's setup (after :meth:`bind`).

        Args:
            no_sync: a context in which a backward pass accumulates gradients locally (DDP's ``no_sync``).
            backward: the base strategy's backward of a loss (no share weight applied).
            capacities: each rank's memory in bytes for the split policy (``None``: unknown).
        """
        host = self.host
        self._no_sync, self._backward = no_sync, backward
        self._observe_peaks = observes_peak_bytes(self.split)  # read once, not in every step
        self._timer = StepTimer(host.root_device)
        self._timed_plan, self._pending, self._micro_batch_grads = None, None, []
        self._measured_micro_batch, self._largest_forward, self._rank_caps = None, 0, None
        if self.max_micro_batch == "auto":
            if host.root_device.type == "cuda":
                memory = torch.cuda.get_device_properties(host.root_device).total_memory
                self._measured_micro_batch = MeasuredMicroBatch(memory)
            else:
                rank_zero_report(
                    f"{self.name}: max_micro_batch='auto' measures GPU memory; on {host.root_device.type} ranks a"
                    " share runs in one forward pass"
                )
        if self.observes and capacities is not None:
            self.split.set_capacities(capacities)

    def detach(self) -> None:
        """End a run (the strategy's teardown)."""
        self._timer, self._pending, self._micro_batch_grads = None, None, []

    def check_world_size(self, world_size: int) -> None:
        """Refuse per-rank settings of the wrong length: on every rank alike, before any collective.

        Raises:
            ValueError: a per-rank split policy or ``max_micro_batch`` list whose length is not ``world_size``.
        """
        self.split.check_devices(world_size)
        if isinstance(self.max_micro_batch, list) and len(self.max_micro_batch) != world_size:
            raise ValueError(
                f"`max_micro_batch` needs one entry per rank ({world_size}), got {len(self.max_micro_batch)}:"
                f" {self.max_micro_batch}"
            )

    def refuse_micro_batches(self, module: pl.LightningModule, batchnorm: bool) -> None:
        """Refuse ``max_micro_batch`` where it would change the step (BatchNorm, manual optimization).

        Raises:
            ValueError: ``max_micro_batch`` with BatchNorm layers, or under manual optimization.
        """
        if self.max_micro_batch is None:
            return
        if batchnorm:
            raise ValueError(
                f"strategy={self.name!r} cannot run a share in micro-batches (`max_micro_batch`) with BatchNorm"
                " layers: BatchNorm normalizes over the samples of one forward pass, so the step would change (and"
                " the ranks' synchronized layers would meet a different number of times); drop `max_micro_batch`"
            )
        if not module.automatic_optimization:
            raise ValueError(
                f"strategy={self.name!r} runs a share in micro-batches (`max_micro_batch`) under automatic"
                " optimization only: with `automatic_optimization = False`, cut the batch in your training_step"
            )

    def take_over_sampling(self, trainer: pl.Trainer) -> None:
        """Take the global order over from Lightning's distributed sampler, remembering what the user asked for.

        Lightning would give every training loader a shuffled ``DistributedSampler``, whatever its sampler; the
        engine instead keeps the loader's own order (:func:`~lightning_balanced.rank_shares.loader.share_loader`).
        """
        connector = trainer._accelerator_connector
        asked = getattr(connector, "_lightning_balanced_use_distributed_sampler", None)
        if asked is None:  # the first setup of this Trainer: what the user passed
            asked = connector.use_distributed_sampler
            connector._lightning_balanced_use_distributed_sampler = asked  # type: ignore[attr-defined]
        connector.use_distributed_sampler = False
        self._seed = int(os.environ.get("PL_GLOBAL_SEED", 0)) if asked else None

    def process_dataloader(self, dataloader: object) -> object:
        """``dataloader``, yielding this rank's share of each of its global batches (:func:`share_loader`)."""
        if share_batch_sampler(dataloader) is not None:
            return dataloader
        host = self.host
        return share_loader(
            dataloader, self.split, host.global_rank, host.world_size, strategy=self.name, seed=self._seed
        )

    # ---- the steps ---------------------------------------------------------------------------------------------------
    def take_share(self, step_name: str) -> RankShare:
        """The share of the batch this step runs: the oldest one pending in the step's loaders."""
        module = self.host.lightning_module
        assert module is not None
        loaders = _loaders(getattr(module.trainer, _STEP_LOADERS[step_name], None))
        samplers = [sampler for sampler in map(share_batch_sampler, loaders) if sampler is not None]
        if step_name == "training_step" and len(samplers) > 1:
            raise ValueError(
                f"strategy={self.name!r} splits one train DataLoader's global batches, got {len(samplers)}: combine"
                " them into one Dataset"
            )
        pending = [sampler for sampler in samplers if sampler.pending]
        if not pending:
            raise RuntimeError(
                f"strategy={self.name!r}: a batch reached {step_name} that the strategy's DataLoader did not cut"
                " (no share of a global batch is pending); feed the step through Lightning's loop and its DataLoader"
            )
        oldest = min(pending, key=lambda sampler: sampler.pending[0].sequence)
        return oldest.pending.popleft()

    def step(self, step_name: str, run: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """Run ``run`` (the base strategy's step method) on this rank's share, then start the step's exchange.

        The share's loss weight is set before ``run`` runs, so a ``manual_backward`` inside ``training_step`` sees it.
        """
        module = self.host.lightning_module
        assert module is not None
        self.finish_exchange()  # a step whose backward never came (a skipped backward): its exchange ends here
        share = self.take_share(step_name)
        batch = self._checked_batch(step_name, share, args[0] if args else kwargs["batch"])
        training = step_name == "training_step"
        timer = self._timer if training else None
        if timer is not None:
            timer.new_step()
            peak = timer.last_peak()
            if self._measured_micro_batch is not None and peak is not None:
                self._measured_micro_batch.observe(self._largest_forward, peak)
        pieces = self._pieces(share) if training else [(0, len(share.indices))]
        if training:
            self._largest_forward = max(size for _, size in pieces)
            self.loss_weight = self.weight(pieces[-1][1], share.global_size)
        output, calls = self._run_pieces(run, step_name, args, kwargs, batch, share, pieces, timer)
        if training:
            self._report_plan(share)
        exchange = self._pending = self._exchange(module, calls, share, training)
        # Where a backward pass follows for sure (automatic optimization, a loss returned), the exchange is finished
        # in `backward`: carried in the gradient all-reduce when that backward synchronizes (no collective of its
        # own), else overlapped with it. Otherwise now.
        overlapped = self.overlap and training and module.automatic_optimization and output is not None
        model = getattr(self.host, "model", None)
        if overlapped and self.carrier is not None and getattr(model, "require_backward_grad_sync", False):
            self.carrier.send(exchange.buffer)
        else:
            exchange.work = dist.all_reduce(exchange.buffer, async_op=True)
        if not overlapped:
            self.finish_exchange()
        if training:
            self._timed_plan = share.chunk_sizes
        return output

    def _checked_batch(self, step_name: str, share: RankShare, batch: Any) -> Any:
        samples = len(share.indices)
        if samples == 0:  # the sampler yielded one sample for the structure: cut to none
            batch = _slice(batch, 0, 0)
        try:
            found = infer_batch_size(batch)
        except ValueError:
            found = samples  # no tensor with a batch dimension to count
        if found != samples:
            raise RuntimeError(
                f"strategy={self.name!r}: a batch of {found} samples reached {step_name} where rank"
                f" {self.host.global_rank}'s share of the global batch has {samples}; the batch must come from the"
                " strategy's DataLoader unchanged in size"
            )
        return batch

    def _run_pieces(
        self,
        run: Callable[..., Any],
        step_name: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        batch: Any,
        share: RankShare,
        pieces: list[tuple[int, int]],
        timer: StepTimer | None,
    ) -> tuple[Any, dict[str, tuple[Any, dict[str, Any]]]]:
        """The step method over the share's micro-batches (all but the last backpropagated here); the logs combined."""
        module = self.host.lightning_module
        assert module is not None
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
            try:
                if number == len(pieces) - 1:
                    output = self._timed(run, piece_args, piece_kwargs, timer)
                else:
                    self._backward_micro_batch(run, piece_args, piece_kwargs, size, share.global_size, timer)
            finally:
                module.__dict__.pop("log", None)
                module.__dict__.pop(BATCH_INDICES, None)
        self._micro_batch_grads = [(param, param.grad) for param in params if param.grad is not None]
        for param, grad in zip(params, previous, strict=True):
            param.grad = grad
        sizes = [size for _, size in pieces]
        calls = recorders[0].calls if len(recorders) == 1 else combine_logs(recorders, sizes, self.host.root_device)
        return output, calls

    def _timed(self, run: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], timer: Any) -> Any:
        if timer is None:
            return run(*args, **kwargs)
        timer.start()
        if self.host_peak is not None and self.observes:
            output, peak = self.host_peak(lambda: run(*args, **kwargs))
            timer.record_peak(peak)
        else:
            output = run(*args, **kwargs)
        timer.stop()
        return output

    def weight(self, samples: int, global_size: int) -> float:
        """The loss weight of ``samples`` of a global batch of ``global_size``: the ranks' mean is the global one."""
        return self.host.world_size * share_weight(samples, global_size, self.loss_reduction)

    def _micro_batch_cap(self, rank: int) -> int | None:
        cap = self.max_micro_batch
        if cap == "auto" and self.equal_micro_batches:  # the ranks' caps as the last exchange gave them to every rank
            return None if self._rank_caps is None else self._rank_caps[rank]
        if cap == "auto":
            measured = self._measured_micro_batch
            return None if measured is None else measured.cap
        return cap[rank] if isinstance(cap, list) else cap

    def _pieces(self, share: RankShare) -> list[tuple[int, int]]:
        """``(start, size)`` of the micro-batches this rank runs of its share (one: the whole share)."""
        samples = len(share.indices)
        if not self.equal_micro_batches:
            cap = self._micro_batch_cap(self.host.global_rank)
            return [(0, samples)] if cap is None or samples <= cap else _pieces(samples, cap)
        counts = []  # every rank's count, from the plan and the caps, which every rank knows
        for rank, size in enumerate(share.chunk_sizes):
            cap = self._micro_batch_cap(rank)
            counts.append(1 if cap is None or size <= cap else -(-size // cap))
        sizes = even_split(samples, max(counts))
        return [(sum(sizes[:k]), size) for k, size in enumerate(sizes)]

    def _backward_micro_batch(
        self,
        run: Callable[..., Any],
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        samples: int,
        global_size: int,
        timer: StepTimer | None,
    ) -> None:
        """Forward and backward of one micro-batch of a share, without synchronizing: its gradient accumulates.

        Weighted as the share's last micro-batch will be, and divided by ``accumulate_grad_batches`` as Lightning's
        closure divides the loss it backpropagates, so the share's micro-batches add up to the share's gradient.
        """
        module = self.host.lightning_module
        assert module is not None and self._backward is not None
        with self._no_sync():
            output = self._timed(run, args, kwargs, timer)
            loss = output.get("loss") if isinstance(output, dict) else output
            if not isinstance(loss, Tensor):
                raise ValueError(
                    f"strategy={self.name!r} with `max_micro_batch` backpropagates each micro-batch's loss:"
                    " training_step must return the loss (a Tensor, or a dict with 'loss'),"
                    f" got {type(output).__name__}"
                )
            weight = self.weight(samples, global_size) / module.trainer.accumulate_grad_batches
            self._backward(loss * weight)

    def add_micro_batch_grads(self) -> None:
        """Put the share's earlier micro-batches' gradients back, before the synchronizing backward reduces them."""
        for param, grad in self._micro_batch_grads:
            param.grad = grad if param.grad is None else param.grad + grad
        self._micro_batch_grads = []

    def _report_plan(self, share: RankShare) -> None:
        """One line per rank when a full batch's plan first appears or changes (as balanced_dp reports its split)."""
        if share.chunk_sizes == self._reported_plan or (
            self._reported_plan is not None and share.global_size != sum(self._reported_plan)
        ):
            return
        self._reported_plan = share.chunk_sizes
        total = max(share.global_size, 1)
        lines = [
            f"{self.name}: a global batch of {share.global_size} samples is split over"
            f" {self.host.world_size} ranks as {share.chunk_sizes} ({self.split})"
        ]
        lines += [f"  rank {r}: {n} samples ({100.0 * n / total:.1f}%)" for r, n in enumerate(share.chunk_sizes)]
        rank_zero_report("\n".join(lines))

    # ---- the exchange ------------------------------------------------------------------------------------------------
    def _exchange(
        self, module: pl.LightningModule, calls: dict[str, tuple[Any, dict[str, Any]]], share: RankShare, training: bool
    ) -> _Exchange:
        """The step's one buffer: each rank's samples, its last step time and peak, and the step's logged values.

        Values logged with the default ``reduce_fx="mean"`` are combined weighted by each rank's share (a zero share
        adds nothing, whatever its value), ``"sum"`` summed; each is logged once, as the global batch's value, with
        ``batch_size`` the global batch and no second reduction (:meth:`finish_exchange`). Others (``max``/``min``,
        a callable, a Metric) are logged now, as the rank gave them.
        """
        host = self.host
        rank, samples = host.global_rank, len(share.indices)
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
        layout = share_exchange_layout(host.world_size, len(combined))
        buffer = layout.new_buffer(host.root_device)
        layout.set(buffer, "samples", rank, samples)
        layout.set(buffer, "batch_digest", rank, share.digest)
        measured = self._measured_micro_batch
        layout.set(buffer, "micro_batch_cap", rank, 0 if measured is None else measured.cap or 0)
        # Times only where they are used (each rank decides alike): reading them waits for the device on CUDA.
        logs = self.log_shares and getattr(module.trainer._logger_connector, "should_update_logs", True)
        wanted = training and self._timer is not None and (self.observes or logs)
        timed = self._timer.take() if wanted and self._timer is not None else None
        if timed is not None:
            layout.set(buffer, "seconds", rank, timed[0])
            layout.set(buffer, "peak_bytes", rank, -1 if timed[1] is None else timed[1])
        values = layout.extra(buffer)
        for k, (_, value, _, kind) in enumerate(combined):
            if samples:
                weight = share_weight(samples, share.global_size, "mean" if kind == "mean" else "sum")
                values[k] = torch.as_tensor(value).detach().reshape(()).to(buffer) * weight
        timed_plan = self._timed_plan if timed is not None else None
        logged = [(name, options) for name, _, options, _ in combined]
        return _Exchange(layout, buffer, logged, share, timed_plan, logs)

    def finish_exchange(self) -> None:
        """Wait for the step's all_reduce, check the ranks agree, log the combined values and the shares."""
        exchange, self._pending = self._pending, None
        if exchange is None:
            return
        module = self.host.lightning_module
        assert module is not None
        share, buffer = exchange.share, exchange.buffer
        if exchange.work is not None:
            exchange.work.wait()
        else:
            assert self.carrier is not None
            carried = self.carrier.receive()
            if carried is None:  # no bucket could carry it (or no backward came): on every rank alike
                dist.all_reduce(buffer)
            else:
                buffer = carried
        reading = ExchangeReading.of(exchange.layout, buffer)
        self._check_agreement(reading.samples, reading.batch_digest, share)
        self._rank_caps = reading.micro_batch_cap
        values = exchange.layout.extra(buffer)
        for k, (name, options) in enumerate(exchange.logged):
            module.log(name, values[k], **{**options, "batch_size": share.global_size, "sync_dist": False})
        if exchange.timed_plan is None:
            return
        times = reading.seconds
        if self.observes:
            peaks = reading.peak_bytes
            if self._observe_peaks:
                self.split.observe(list(exchange.timed_plan), times, peak_bytes=None if None in peaks else peaks)
            else:  # a policy written for balanced_dp's devices with a two-argument `observe`
                self.split.observe(list(exchange.timed_plan), times)
        # Only on the steps whose logs reach the loggers (every `log_every_n_steps`): a `self.log` call costs about
        # 0.4 ms, and 3 per rank every step cost 20 % of a small step (measured by benchmarks/bench_balanced_ddp.py).
        if exchange.logs:
            slowest = max(times)
            for r in range(self.host.world_size):
                prefix, size = f"{self.name}/", share.global_size
                module.log(f"{prefix}share_rank{r}", float(exchange.timed_plan[r]), batch_size=size)
                module.log(f"{prefix}step_s_rank{r}", times[r], batch_size=size)
                module.log(f"{prefix}idle_s_rank{r}", slowest - times[r], batch_size=size)

    def _check_agreement(self, counts: list[int], digests: list[int], share: RankShare) -> None:
        rank = self.host.global_rank
        if len(set(digests)) > 1:
            raise RuntimeError(
                f"strategy={self.name!r}: the ranks walked different global batches (digests {digests} of their"
                f" sample indices, rank {rank}'s view): every rank must walk the same global order. A sampler of"
                " your own must give the same order on every rank (seed its `generator` alike on every rank)"
            )
        if counts != share.chunk_sizes:
            raise RuntimeError(
                f"strategy={self.name!r}: the ranks ran {counts} samples of a global batch planned"
                f" {share.chunk_sizes} (rank {rank}'s view): the ranks' split policies disagree. A policy must plan"
                " the same on every rank (a pure function of the batch size and what it observed from the gathered"
                " step times)"
            )

    def finish_exchange_after_backward(self) -> None:
        """The step's exchange, overlapped with (or carried in) the backward pass, ended; its logs are the step's."""
        if self._pending is None:
            return
        module = self.host.lightning_module
        assert module is not None
        called_from, module._current_fx_name = module._current_fx_name, "training_step"
        try:
            self.finish_exchange()
        finally:
            module._current_fx_name = called_from
