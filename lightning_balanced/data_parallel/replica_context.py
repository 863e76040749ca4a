"""What a replica's LightningModule uses instead of the shared, not thread-safe trainer state.

A replica runs its step on a worker thread. Anything that touches state shared with the other replicas goes through
this module:

- ``self.log``/``self.log_dict`` are recorded per replica and replayed once, combined, on the main thread;
- in manual optimization, ``manual_backward``, ``optimizer.step``/``zero_grad``, ``lr_scheduler.step`` and
  ``clip_gradients`` become meetings at the step's :class:`~lightning_balanced.data_parallel.barrier.ReplicaBarrier`:
  every replica must call them in the same order, and the call runs once, on the combined input, when all have
  arrived;
- torchmetrics metrics are not replicated: every replica updates the one original metric, one call at a time.
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable, Sequence
from typing import Any

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.nn import Module
from torchmetrics import Metric

from lightning_balanced.data_parallel.barrier import ReplicaBarrier

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


def replay_logs(
    module: pl.LightningModule, recorders: Sequence[ReplicaLogRecorder], chunk_sizes: Sequence[int]
) -> None:
    """Log each recorded name once on ``module``, combined over the replicas that logged it.

    Values are combined by the call's ``reduce_fx``: ``"sum"``, ``"max"``, ``"min"`` across replicas, otherwise the mean
    weighted by chunk size (the value the whole batch would have logged). ``batch_size``, when given, is summed.
    """
    names = list(dict.fromkeys(name for recorder in recorders for name in recorder.calls))
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
        value = _combine(values, sizes, kwargs.get("reduce_fx", "mean"), module.device)
        module.log(name, value, **kwargs)


_LOCKSTEP_HINT = (
    "In manual optimization under balanced_dp every replica must call manual_backward, optimizer step/zero_grad,"
    " scheduler step and clip_gradients the same number of times, in the same order."
)


def _lockstep_call(
    barrier: ReplicaBarrier, index: int, name: str, value: Any, action: Callable[[list[Any]], Any]
) -> Any:
    """One lockstep call: every replica's ``name`` call meets the others' (in call order); ``action`` runs once."""
    return barrier.call_once(index, value, action, what=f"`{name}`", hint=_LOCKSTEP_HINT)


class _LockstepProxy:
    """Delegates to ``target``; the methods named in ``shared`` run once per meeting of all replicas."""

    def __init__(self, target: Any, barrier: ReplicaBarrier, index: int, shared: Sequence[str]) -> None:
        self._target = target
        self._barrier = barrier
        self._index = index
        self._shared = frozenset(shared)

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._target, name)
        if name not in self._shared:
            return attribute

        def once(*args: Any, **kwargs: Any) -> Any:
            return _lockstep_call(self._barrier, self._index, name, None, lambda _: attribute(*args, **kwargs))

        return once


def install_manual_optimization(
    replica: pl.LightningModule,
    root: pl.LightningModule,
    index: int,
    barrier: ReplicaBarrier,
    loss_weight: float,
) -> None:
    """Route the replica's manual-optimization calls through the step's ``barrier`` (see the module docstring).

    ``manual_backward`` runs once on ``sum(loss_weight_i * loss_i)``, so the gradient is the full-batch gradient.
    """
    device = root.device

    def manual_backward(loss: Tensor, *args: Any, **kwargs: Any) -> None:
        def backward(losses: list[Tensor]) -> None:
            root.manual_backward(torch.stack([lo.to(device) for lo in losses]).sum(), *args, **kwargs)

        _lockstep_call(barrier, index, "manual_backward", loss * loss_weight, backward)

    def optimizers(use_pl_optimizer: bool = True) -> Any:
        found = root.optimizers(use_pl_optimizer)
        wrap = [_LockstepProxy(o, barrier, index, ("step", "zero_grad")) for o in _as_list(found)]
        return wrap if isinstance(found, list) else wrap[0]

    def lr_schedulers() -> Any:
        found = root.lr_schedulers()
        if found is None:
            return None
        wrap = [_LockstepProxy(s, barrier, index, ("step",)) for s in _as_list(found)]
        return wrap if isinstance(found, list) else wrap[0]

    def shared(name: str) -> Callable[..., Any]:
        method = getattr(root, name)

        def once(*args: Any, **kwargs: Any) -> Any:
            args = tuple(a._target if isinstance(a, _LockstepProxy) else a for a in args)
            return _lockstep_call(barrier, index, name, None, lambda _: method(*args, **kwargs))

        return once

    replica.manual_backward = manual_backward  # type: ignore[method-assign]
    replica.optimizers = optimizers  # type: ignore[method-assign]
    replica.lr_schedulers = lr_schedulers  # type: ignore[method-assign]
    for name in ("clip_gradients", "toggle_optimizer", "untoggle_optimizer"):
        setattr(replica, name, shared(name))


def _as_list(value: Any) -> list[Any]:
    return list(value) if isinstance(value, list) else [value]


class _SharedMetric(Module):
    """Stands in a replica for an original torchmetrics ``Metric``: calls run on the original, one at a time."""

    def __init__(self, metric: Metric, lock: threading.Lock) -> None:
        super().__init__()
        object.__setattr__(self, "metric", metric)  # not a submodule: replicas must not copy it
        object.__setattr__(self, "_lock", lock)

    def _locked(self, method: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        device = self.metric.device
        args = [a.to(device) if isinstance(a, Tensor) else a for a in args]
        kwargs = {k: v.to(device) if isinstance(v, Tensor) else v for k, v in kwargs.items()}
        with self._lock:
            return method(*args, **kwargs)

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


def find_metrics(root: Module) -> dict[str, Metric]:
    """The torchmetrics ``Metric`` modules of ``root`` by qualified name (found once, at strategy setup)."""
    return {name: module for name, module in root.named_modules() if isinstance(module, Metric)}


def share_metrics(replica: Module, metrics: dict[str, Metric], lock: threading.Lock) -> None:
    """Replace the ``metrics`` (from :func:`find_metrics` on the original) inside ``replica`` by stand-ins for them."""
    for name, metric in metrics.items():
        parent_name, _, child = name.rpartition(".")
        parent = replica.get_submodule(parent_name)
        if child in parent._modules:
            parent._modules[child] = _SharedMetric(metric, lock)
