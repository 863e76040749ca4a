"""Run each replica on its own inputs at the same time: a thread per replica, on CUDA each on a stream of its own."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from contextlib import ExitStack
from typing import Any

import torch
from torch._utils import ExceptionWrapper
from torch.nn import Module

from lightning_balanced.data_parallel.stream_order import record_on
from lightning_balanced.data_parallel.virtual_device import VirtualDeviceMode

__all__ = ["parallel_apply"]


def _run_replica(
    index: int,
    module: Module,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    device: torch.device,
    modes: tuple[bool, bool],
    stream: torch.cuda.Stream | None,
) -> Any:
    # Grad and inference mode are thread-local: carry the caller's into the worker. Precision (autocast) is re-entered
    # by the module itself. A failure is wrapped as torch's CUDA parallel_apply wraps it, traceback as text.
    grad_enabled, inference_mode = modes
    try:
        with ExitStack() as contexts:
            if stream is not None:  # CUDA: the replica's device and stream are current in this thread
                contexts.enter_context(torch.cuda.device(device))
                contexts.enter_context(torch.cuda.stream(stream))
            elif device.type == "cpu" and device.index is not None:  # a virtual device: CUDA's rule, every tensor
                contexts.enter_context(VirtualDeviceMode(device.index))
            contexts.enter_context(torch.inference_mode(inference_mode))
            contexts.enter_context(torch.set_grad_enabled(grad_enabled))
            return module(*args, **kwargs)
    except Exception:
        return ExceptionWrapper(where=f"in replica {index} on device {device}")


def _replica_tensors(replica: Module) -> list[Any]:
    """A replica's broadcast parameters (plain attributes, kept in ``_former_parameters``) and buffers."""
    tensors: list[Any] = []
    for module in replica.modules():
        tensors += getattr(module, "_former_parameters", {}).values()
        tensors += module._buffers.values()
    return tensors


def parallel_apply(
    replicas: Sequence[Module],
    inputs: Sequence[Sequence[Any]],
    kwargs: Sequence[dict[str, Any]],
    devices: Sequence[torch.device],
    *,
    executor: Executor | None = None,
    streams: Sequence[torch.cuda.Stream] | None = None,
) -> list[Any]:
    """Call ``replicas[i](*inputs[i], **kwargs[i])`` for every ``i`` concurrently and return the outputs in order.

    Each replica runs in a thread of ``executor`` (a pool of ``len(replicas) - 1`` threads is made for the call when
    none is given), the last one on the calling thread, with the caller's grad and inference modes (autocast, which
    is thread-local too, is the replica's own business, as in torch's ``parallel_apply``). On CUDA, replica ``i`` runs
    with ``devices[i]`` current and on a stream of its own, so several replicas can share one GPU (``devices`` may
    repeat a device) and still overlap: its stream first waits (on the GPU) for the work the caller queued on the
    device's current stream (the scatter, the replication), and when all replicas are done, each device's current
    stream waits for the replicas' streams, so what follows (the gather, backward) sees their outputs. Inputs, the
    replicas' broadcast tensors and the outputs are recorded on the streams that use them (``Tensor.record_stream``),
    so the caching allocator never reuses their memory under a stream still reading it. The host never waits.

    Args:
        replicas (Sequence[Module]): one module per device, e.g. from
            :func:`~lightning_balanced.data_parallel.replicate`.
        inputs (Sequence[Sequence]): positional arguments per replica.
        kwargs (Sequence[dict]): keyword arguments per replica.
        devices (Sequence[torch.device]): the replicas' devices, CUDA (possibly repeated) or virtual CPU devices.
        executor (Executor, optional): reused worker threads.
        streams (Sequence[torch.cuda.Stream], optional): on CUDA, one stream per replica, on its device (reuse them
            between calls); new streams from torch's pool when not given.

    Returns:
        list: the replicas' outputs, in replica order.

    Raises:
        Exception: after all replicas finished, the exception of the failing replica with the lowest index, re-raised
            as torch's CUDA ``parallel_apply`` does: a new exception of the same type (``RuntimeError`` when that type
            cannot be built from a message) whose message is "Caught <type> in replica <i> on device <device>" and
            the original traceback; the original exception object is not kept (no ``__cause__``).
        ValueError: the sequences disagree in length, or a stream is not on its replica's device.

    Source: ``torch.nn.parallel.parallel_apply`` (threads, device guards, the exception wrapper), with a stream per
    replica as torchgpipe gives each partition its own.
    """
    if not (len(replicas) == len(inputs) == len(kwargs) == len(devices)):
        raise ValueError(
            f"Got {len(replicas)} replicas, {len(inputs)} inputs, {len(kwargs)} kwargs and {len(devices)} devices;"
            " they must match"
        )
    if not replicas:
        return []
    on_cuda = devices[0].type == "cuda"
    replica_streams: list[torch.cuda.Stream | None] = [None] * len(devices)
    if on_cuda:
        replica_streams = list(streams) if streams is not None else [torch.cuda.Stream(d) for d in devices]
        if len(replica_streams) != len(devices) or any(
            s is None or s.device != d for s, d in zip(replica_streams, devices, strict=True)
        ):
            raise ValueError(
                f"`streams` must hold one CUDA stream per replica, on its device {[str(d) for d in devices]}, got"
                f" {[str(s.device) if s is not None else None for s in replica_streams]}"
            )
        for stream, device, replica, args, kw in zip(replica_streams, devices, replicas, inputs, kwargs, strict=True):
            assert stream is not None
            stream.wait_stream(torch.cuda.current_stream(device))
            record_on((args, kw, _replica_tensors(replica)), stream)

    modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
    jobs = list(zip(replicas, inputs, kwargs, devices, replica_streams, strict=True))
    own_pool = executor is None and len(jobs) > 1
    pool = ThreadPoolExecutor(max_workers=len(jobs) - 1) if own_pool else executor
    try:
        # Workers first, then the last replica on this thread while they run.
        futures = (
            [
                pool.submit(_run_replica, i, module, args, kw, device, modes, stream)
                for i, (module, args, kw, device, stream) in enumerate(jobs[:-1])
            ]
            if pool
            else []
        )
        module, args, kw, device, stream = jobs[-1]
        last = _run_replica(len(jobs) - 1, module, args, kw, device, modes, stream)
        outcomes = [future.result() for future in futures] + [last]
    finally:
        if own_pool and pool is not None:
            pool.shutdown(wait=True)
    if on_cuda:
        for stream, device, outcome in zip(replica_streams, devices, outcomes, strict=True):
            assert stream is not None
            current = torch.cuda.current_stream(device)
            current.wait_stream(stream)
            if not isinstance(outcome, ExceptionWrapper):
                record_on(outcome, current)
    for outcome in outcomes:
        if isinstance(outcome, ExceptionWrapper):
            outcome.reraise()
    return outcomes
