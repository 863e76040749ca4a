"""Ordering work across CUDA streams without a host sync: events where tensors are made, waits where they are used.

Each replica of a data-parallel step runs on a stream of its own (also when several replicas share one GPU), so a
tensor made on one stream and used on another needs two things: the consuming stream waits for an event recorded on
the producing stream (GPU-side; the host never blocks), and the tensor is recorded on the consuming stream, so that
the caching allocator does not hand its memory to new work before the consumer is done. Off CUDA, every function here
does nothing.

Source: the CUDA semantics notes of PyTorch ("Stream semantics", ``Tensor.record_stream``) and torchgpipe's copy
streams (Lee et al., 2020).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from torch import Tensor

__all__ = ["Ready", "ready", "record_on", "run_between", "use_on_current_stream"]

T = TypeVar("T")

Ready = torch.cuda.Event | None
"""What :func:`ready` returns: an event on a CUDA stream, or ``None`` off CUDA."""


def ready(device: torch.device) -> Ready:
    """An event on ``device``'s current stream (of this thread), marking that the work queued so far is done."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def use_on_current_stream(event: Ready, device: torch.device, value: Any = None) -> None:
    """Make ``device``'s current stream (of this thread) wait for ``event``, and record ``value``'s tensors on it.

    Args:
        event: from :func:`ready` on the producing stream; ``None`` (off CUDA) does nothing.
        device (torch.device): the device whose current stream will use the tensors.
        value: a tensor or any collection of tensors made on the producing stream and used from now on; the CUDA
            tensors on ``device`` are recorded on the current stream (``Tensor.record_stream``).
    """
    if event is None or device.type != "cuda":
        return
    stream = torch.cuda.current_stream(device)
    stream.wait_event(event)
    record_on(value, stream)


def record_on(value: Any, stream: torch.cuda.Stream) -> None:
    """``Tensor.record_stream(stream)`` for every CUDA tensor on ``stream``'s device found in ``value``.

    Looks into lists, tuples, dicts and dataclass fields without rebuilding them (a step's arguments hold objects that
    cannot be copied).
    """
    if isinstance(value, Tensor):
        if value.device == stream.device:
            value.record_stream(stream)
    elif isinstance(value, (list, tuple)):
        for item in value:
            record_on(item, stream)
    elif isinstance(value, dict):
        for item in value.values():
            record_on(item, stream)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            record_on(getattr(value, field.name), stream)


def run_between(stream: torch.cuda.Stream | None, others: Sequence[torch.cuda.Stream], work: Callable[[], T]) -> T:
    """Run ``work`` on ``stream`` after the work queued on ``others``; then ``others`` wait for it.

    For work that one thread does for several replicas, each on a stream of its own (the lockstep calls of manual
    optimization, an update of a metric they share): ``stream`` waits (on the GPU) for every stream of ``others``,
    ``work`` runs with ``stream`` current, and every stream of ``others`` waits for ``stream`` before it goes on. So
    the work sees what each replica queued before it, and each replica sees the work's results; the host never waits.
    With ``stream`` ``None`` (off CUDA) it is ``work()``.
    """
    if stream is None:
        return work()
    for other in others:
        if other != stream:
            stream.wait_stream(other)
    with torch.cuda.stream(stream):
        result = work()
    for other in others:
        if other != stream:
            other.wait_stream(stream)
    return result
