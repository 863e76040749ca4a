"""What a replica's LightningModule uses instead of the shared, not thread-safe trainer state.

A replica runs its step on a worker thread. Anything that touches state shared with the other replicas goes through
this module:

- ``self.log``/``self.log_dict`` are recorded per replica and replayed once, combined, on the main thread;
- in manual optimization, ``manual_backward``, ``optimizer.step``/``zero_grad``, ``lr_scheduler.step`` and
  ``clip_gradients`` become meetings at the step's :class:`~lightning_balanced.data_parallel.barrier.ReplicaBarrier`:
  every replica must call them in the same order, and the call runs once, on the combined input, when all have
  arrived; after ``optimizer.step()`` the replicas' copies of the parameters are refreshed from the root's;
- torchmetrics metrics are not replicated: every replica updates the one original metric, one call at a time, on the
  root device, so a logged metric equals the single-device one. (Under ``torch.nn.DataParallel`` a replica holds a
  shallow copy of the metric whose states are the root's tensors: an update from another GPU fails on the device
  check, and one that reassigns a state is lost with the replica.)

On CUDA, what one thread does for all replicas runs on the root's stream, between the replicas' streams
(:class:`SharedStep`).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.nn import Module
from torchmetrics import Metric

from lightning_balanced.data_parallel.barrier import ReplicaBarrier
from lightning_balanced.data_parallel.replicate import ReplicaParameters, record_device
from lightning_balanced.data_parallel.stream_order import record_on, run_between

_LOG_SIGNATURE = inspect.signature(pl.LightningModule.log)


class ReplicaLogRecorder:
    """Records the ``self.log`` calls of one replica."""

    def __init__(self) -> None:
        self.calls: dict[str, tuple[Any, dict[str, Any]]] = {}

    def log(self, *args: Any, **kwargs: Any) -> None:
        """Record one call; takes the arguments of ``LightningModule.log``."""
        bound = _LOG_SIGNATURE.bind(None, *args, **kwargs)
        arguments = dict(bound.arguments)
        del arguments["self"]
        name, value = arguments.pop("name"), arguments.pop("value")
        if isinstance(value, _SharedMetric):
            value = value.metric
        self.calls[name] = (value, arguments)


def _reduce_name(reduce_fx: object) -> str:
    if isinstance(reduce_fx, str):
        return reduce_fx.lower()
    names: dict[object, str] = {torch.sum: "sum", torch.max: "max", torch.min: "min"}
    return names.get(reduce_fx, "mean")


def _combine(values: Sequence[Any], sizes: Sequence[int], reduce_fx: object, device: torch.device) -> Any:
    if isinstance(values[0], Metric):
        return values[0]  # shared by all replicas (see share_metrics)
    tensors = [torch.as_tensor(v).to(device) for v in values]
    reduce = _reduce_name(reduce_fx)
    if reduce == "sum":
        return torch.stack(tensors).sum(0)
    if reduce in ("max", "min"):
        return getattr(torch.stack(tensors), reduce)(0).values
    total = sum(sizes)
    stacked = torch.stack([t.to(torch.promote_types(t.dtype, torch.float32)) for t in tensors])
    shares = [s / total for s in sizes] if total else [1 / len(sizes)] * len(sizes)  # a batch of 0: one replica ran
    weights = torch.tensor(shares, dtype=stacked.dtype, device=device)
    return (stacked * weights.view(-1, *([1] * (stacked.dim() - 1)))).sum(0)


def combine_logs(
    recorders: Sequence[ReplicaLogRecorder], chunk_sizes: Sequence[int], device: torch.device
) -> dict[str, tuple[Any, dict[str, Any]]]:
    """Each recorded name once: ``(value, log options)`` combined over the recorders (chunks) that logged it.

    Values are combined by the call's ``reduce_fx``: ``"sum"``, ``"max"``, ``"min"`` across chunks, otherwise the mean
    weighted by chunk size (the value the whole batch would have logged). ``batch_size``, when given, is summed.
    """
    names = list(dict.fromkeys(name for recorder in recorders for name in recorder.calls))
    combined: dict[str, tuple[Any, dict[str, Any]]] = {}
    for name in names:
        logged = [
            (recorder.calls[name], size)
            for recorder, size in zip(recorders, chunk_sizes, strict=True)
            if name in recorder.calls
        ]
        values = [value for (value, _), _ in logged]
        sizes = [size for _, size in logged]
        kwargs = dict(logged[0][0][1])
        if kwargs.get("batch_size") is not None:
            kwargs["batch_size"] = sum(call[1].get("batch_size") or size for call, size in logged)
        combined[name] = (_combine(values, sizes, kwargs.get("reduce_fx", "mean"), device), kwargs)
    return combined


def replay_logs(
    module: pl.LightningModule, recorders: Sequence[ReplicaLogRecorder], chunk_sizes: Sequence[int]
) -> None:
    """Log each recorded name once on ``module``, combined over the replicas that logged it (:func:`combine_logs`)."""
    for name, (value, kwargs) in combine_logs(recorders, chunk_sizes, module.device).items():
        module.log(name, value, **kwargs)


_LOCKSTEP_HINT = (
    "In manual optimization under balanced_dp every replica must call manual_backward, optimizer step/zero_grad,"
    " scheduler step and clip_gradients the same number of times, in the same order."
)


@dataclass(frozen=True)
class SharedStep:
    """What the replicas of one step share: the step's barrier and, on CUDA, the streams that order shared work.

    Work that one thread does for all replicas (a lockstep call, a metric update) runs on ``root_stream``, the
    caller's stream on the root device, after the work each replica queued on its own stream (``streams``), and every
    replica's stream waits for it before going on (:func:`~lightning_balanced.data_parallel.stream_order.run_between`).

    Attributes:
        barrier (ReplicaBarrier): where the replicas meet.
        root_device (torch.device): the root's device as the replicas see it (``cpu:0`` in the CPU emulation).
        root_stream (torch.cuda.Stream | None): ``None`` off CUDA.
        streams (Sequence[torch.cuda.Stream]): one per replica, on its device; empty off CUDA.
        parameters (ReplicaParameters): the replicas' hold on the root's parameters, refreshed after each
            ``optimizer.step()`` of manual optimization.
    """

    barrier: ReplicaBarrier
    root_device: torch.device
    root_stream: torch.cuda.Stream | None = None
    streams: Sequence[torch.cuda.Stream] = ()
    parameters: ReplicaParameters = field(default_factory=ReplicaParameters)

    def call_once(self, index: int, name: str, value: Any, action: Callable[[list[Any]], Any]) -> Any:
        """One lockstep call: replica ``index``'s ``name`` call meets the others' (in call order); ``action`` runs once.

        It runs on the root's stream, ordered after every replica's work and before their next (on CUDA).
        """
        return self.barrier.call_once(
            index,
            value,
            lambda values: run_between(self.root_stream, self.streams, lambda: action(values)),
            what=f"`{name}`",
            hint=_LOCKSTEP_HINT,
        )

    def run_shared(self, work: Callable[[], Any]) -> Any:
        """``work`` done by one replica's thread on state the replicas share, ordered as a lockstep call's action."""
        if self.root_stream is None:
            return work()
        return run_between(self.root_stream, [torch.cuda.current_stream()], work)


class _LockstepProxy:
    """Delegates to ``target``; its methods named in ``shared`` run once per meeting of all replicas.

    ``shared`` maps each such method to what runs right after it in the same meeting (or ``None``).
    """

    def __init__(self, target: Any, step: SharedStep, index: int, shared: dict[str, Callable[[], None] | None]) -> None:
        self._target = target
        self._step = step
        self._index = index
        self._shared = shared

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._target, name)
        if name not in self._shared:
            return attribute
        after = self._shared[name]

        def run(args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
            result = attribute(*args, **kwargs)
            if after is not None:
                after()
            return result

        def once(*args: Any, **kwargs: Any) -> Any:
            return self._step.call_once(self._index, name, None, lambda _: run(args, kwargs))

        return once


def install_manual_optimization(
    replica: pl.LightningModule,
    root: pl.LightningModule,
    index: int,
    step: SharedStep,
    loss_weight: float,
) -> None:
    """Route the replica's manual-optimization calls through the step's barrier (see the module docstring).

    ``manual_backward`` runs once on ``sum(loss_weight_i * loss_i)``, so the gradient is the full-batch gradient.
    ``optimizer.step()`` runs once on the root's parameters and then refreshes the replicas' copies of them
    (``step.parameters``), so what the replicas compute after it in the same step (a GAN's second pass) uses the
    updated parameters, as on one device.
    """
    device = root.device

    def manual_backward(loss: Tensor, *args: Any, **kwargs: Any) -> None:
        def backward(losses: list[Tensor]) -> None:
            root.manual_backward(torch.stack([lo.to(device) for lo in losses]).sum(), *args, **kwargs)

        step.call_once(index, "manual_backward", loss * loss_weight, backward)

    def optimizers(use_pl_optimizer: bool = True) -> Any:
        found = root.optimizers(use_pl_optimizer)
        calls = {"step": step.parameters.refresh, "zero_grad": None}
        wrap = [_LockstepProxy(o, step, index, calls) for o in _as_list(found)]
        return wrap if isinstance(found, list) else wrap[0]

    def lr_schedulers() -> Any:
        found = root.lr_schedulers()
        if found is None:
            return None
        wrap = [_LockstepProxy(s, step, index, {"step": None}) for s in _as_list(found)]
        return wrap if isinstance(found, list) else wrap[0]

    def shared(name: str) -> Callable[..., Any]:
        method = getattr(root, name)

        def once(*args: Any, **kwargs: Any) -> Any:
            args = tuple(a._target if isinstance(a, _LockstepProxy) else a for a in args)
            return step.call_once(index, name, None, lambda _: method(*args, **kwargs))

        return once

    replica.manual_backward = manual_backward  # type: ignore[method-assign]
    replica.optimizers = optimizers  # type: ignore[method-assign]
    replica.lr_schedulers = lr_schedulers  # type: ignore[method-assign]
    for name in ("clip_gradients", "toggle_optimizer", "untoggle_optimizer"):
        setattr(replica, name, shared(name))


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else [value]


class _SharedMetric(Module):
    """Stands in a replica for an original torchmetrics ``Metric``: calls run on the original, one at a time.

    Tensor arguments move to the metric's device (the root's), and on CUDA each call runs on the root's stream
    (:meth:`SharedStep.run_shared`), so the updates of replicas on other streams never race on the metric's states.
    """

    def __init__(self, metric: Metric, lock: threading.Lock, step: SharedStep) -> None:
        super().__init__()
        object.__setattr__(self, "metric", metric)  # not a submodule: replicas must not copy it
        object.__setattr__(self, "_lock", lock)
        object.__setattr__(self, "_step", step)

    def _locked(self, method: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        device = self._step.root_device

        def call() -> Any:
            moved = [a.to(device) if isinstance(a, Tensor) else a for a in args]
            return method(*moved, **{k: v.to(device) if isinstance(v, Tensor) else v for k, v in kwargs.items()})

        with self._lock, _reporting_device(self.metric, device):
            result = self._step.run_shared(call)
        if self._step.root_stream is not None:  # used on this replica's stream from now on
            record_on(result, torch.cuda.current_stream(device))
        return result

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self._locked(self.metric, args, kwargs)

    def update(self, *args: Any, **kwargs: Any) -> None:
        self._locked(self.metric.update, args, kwargs)

    def compute(self) -> Any:
        return self._locked(self.metric.compute, (), {})

    def reset(self) -> None:
        self._locked(self.metric.reset, (), {})

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["metric"], name)


@contextmanager
def _reporting_device(metric: Metric, device: torch.device) -> Iterator[None]:
    """While a replica calls the root's ``metric``, it reports the root's device as the replica sees it.

    A metric records the device of its states when it is moved (``Metric._apply``, also called by Lightning's logging
    between steps); on the CPU emulation that reads ``cpu``, the host's device inside a replica, while the states are
    the root's, ``cpu:0``. So what the metric makes with ``device=self.device`` during the call lands with its states.
    """
    recorded = {module: module.__dict__["_device"] for module in metric.modules() if "_device" in module.__dict__}
    record_device(metric, device)
    try:
        yield
    finally:
        for module, previous in recorded.items():
            module.__dict__["_device"] = previous


def find_metrics(root: Module) -> dict[str, Metric]:
    """The torchmetrics ``Metric`` modules of ``root`` by qualified name (found once, at strategy setup)."""
    return {name: module for name, module in root.named_modules() if isinstance(module, Metric)}


def share_metrics(replica: Module, metrics: dict[str, Metric], lock: threading.Lock, step: SharedStep) -> None:
    """Replace the ``metrics`` (from :func:`find_metrics` on the original) inside ``replica`` by stand-ins for them.

    Every replica's calls then reach the original metric, one at a time, on the root device: ``self.log(name,
    metric)`` gives the value of one device that saw the whole batch (up to the order of floating-point sums).
    """
    for name, metric in metrics.items():
        parent_name, _, child = name.rpartition(".")
        parent = replica.get_submodule(parent_name)
        if child in parent._modules:
            parent._modules[child] = _SharedMetric(metric, lock, step)
