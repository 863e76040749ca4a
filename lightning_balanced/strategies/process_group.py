"""Ending the default process group of a finished run, on every torch version the package supports."""

from __future__ import annotations

import time
from datetime import timedelta

import torch

__all__ = ["end_process_group"]

#: How long the gloo workers get, with the GIL free, to release the tensors of their last collectives (s).
_WORKER_CLEANUP_S = 0.05


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
