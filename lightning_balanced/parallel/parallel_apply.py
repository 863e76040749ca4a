"""Run each replica on its own inputs at the same time: torch's ``parallel_apply`` on CUDA, threads elsewhere."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any

import torch
from torch._utils import ExceptionWrapper
from torch.nn import Module
from torch.nn.parallel import parallel_apply as cuda_parallel_apply

__all__ = ["parallel_apply"]


def _run_replica(
    index: int,
    module: Module,
    args: Sequence[Any],
    kwargs: dict[str, Any],
    device: torch.device,
    modes: tuple[bool, bool],
) -> Any:
    # Grad and inference mode are thread-local: carry the caller's into the worker. Precision (autocast) is re-entered
    # by the module itself. A failure is wrapped as torch's CUDA parallel_apply wraps it, traceback as text.
    grad_enabled, inference_mode = modes
    try:
        with torch.inference_mode(inference_mode), torch.set_grad_enabled(grad_enabled):
            return module(*args, **kwargs)
    except Exception:
        return ExceptionWrapper(where=f"in replica {index} on device {device}")


def parallel_apply(
    replicas: Sequence[Module],
    inputs: Sequence[Sequence[Any]],
    kwargs: Sequence[dict[str, Any]],
    devices: Sequence[torch.device],
    *,
    executor: Executor | None = None,
) -> list[Any]:
    """Call ``replicas[i](*inputs[i], **kwargs[i])`` for every ``i`` concurrently and return the outputs in order.

    Args:
        replicas (Sequence[Module]): one module per device, e.g. from :func:`~lightning_balanced.parallel.replicate`.
        inputs (Sequence[Sequence]): positional arguments per replica.
        kwargs (Sequence[dict]): keyword arguments per replica.
        devices (Sequence[torch.device]): the replicas' devices. On CUDA this is ``torch.nn.parallel.parallel_apply``
            (one thread per GPU, each on its device's current stream); otherwise the replicas run in threads of
            ``executor`` (a pool of ``len(replicas) - 1`` threads is made for the call when none is given) and the
            last one on the calling thread.
        executor (Executor, optional): reused worker threads for the non-CUDA path.

    Returns:
        list: the replicas' outputs, in replica order.

    Raises:
        Exception: after all replicas finished, the exception of the failing replica with the lowest index, re-raised
            as torch's CUDA ``parallel_apply`` does on both paths: a new exception of the same type (``RuntimeError``
            when that type cannot be built from a message) whose message is "Caught <type> in replica <i> on device
            <device>" and the original traceback; the original exception object is not kept (no ``__cause__``).
        ValueError: the sequences disagree in length.
    """
    if not (len(replicas) == len(inputs) == len(kwargs) == len(devices)):
        raise ValueError(
            f"Got {len(replicas)} replicas, {len(inputs)} inputs, {len(kwargs)} kwargs and {len(devices)} devices;"
            " they must match"
        )
    if not replicas:
        return []
    if devices[0].type == "cuda":
        return list(cuda_parallel_apply(list(replicas), list(inputs), list(kwargs), list(devices)))

    modes = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
    jobs = list(zip(replicas, inputs, kwargs, devices, strict=True))
    own_pool = executor is None and len(jobs) > 1
    pool = ThreadPoolExecutor(max_workers=len(jobs) - 1) if own_pool else executor
    try:
        # Workers first, then the last replica on this thread while they run.
        futures = [pool.submit(_run_replica, i, *job, modes) for i, job in enumerate(jobs[:-1])] if pool else []
        last = _run_replica(len(jobs) - 1, *jobs[-1], modes)
        outcomes = [future.result() for future in futures] + [last]
    finally:
        if own_pool and pool is not None:
            pool.shutdown(wait=True)
    for outcome in outcomes:
        if isinstance(outcome, ExceptionWrapper):
            outcome.reraise()
    return outcomes
