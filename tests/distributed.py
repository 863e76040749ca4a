"""Run a function on N CPU ranks joined by a real gloo process group, and bring the results back to the test.

Usage::

    def _check(rank: int, world_size: int, scale: float) -> torch.Tensor:  # module level, so spawn can pickle it
        t = torch.full((2,), float(rank) * scale)
        torch.distributed.all_reduce(t)
        return t

    results = run_distributed(_check, 2, 3.0)  # [tensor([3., 3.]), tensor([3., 3.])], in rank order

Each rank is a fresh process forked from a forkserver that has already imported torch and Lightning
(``multiprocessing``'s forkserver context, started once per test process with ``set_forkserver_preload``): a rank
starts in a fraction of a second instead of the 5 s (idle) to 10 s (loaded) of a spawned interpreter importing
Lightning on a 2-core machine. As under spawn, the rank runs in a process that shares nothing with the test process
but what it is sent: the test's current environment variables replace the forkserver's (so ``monkeypatch.setenv``
before the call reaches the ranks), and ``sys.path``, the working directory and the test module come as spawn sends
them. Inside a rank:

* the default process group is initialized with ``backend="gloo"`` through a ``TCPStore`` on 127.0.0.1 and a free
  port that the test process hosts (as torchrun's agent does: it outlives every rank), and
  ``timeout=timedelta(seconds=timeout_s / 2)``, so a collective that never completes raises in the rank (with gloo's
  "Timed out" message) before the overall timeout fires;
* ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE`` and ``LOCAL_WORLD_SIZE`` are set, so
  Lightning's cluster environment reads the same topology;
* ``torch.set_num_threads(1)``: N ranks share the CI machine's few cores;
* the process group is destroyed after ``fn`` returns or raises and the rank has reported.

Results travel back pickled (plain :mod:`pickle`, tensors by value, not through shared memory), so they must be
picklable. Warnings in the ranks are not turned into errors (pytest's filter applies to the parent only).
"""

from __future__ import annotations

import os
import pickle
import socket
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Connection, wait
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

__all__ = ["DistributedRankError", "lightning_sampler_seed", "run_distributed"]

# After the first failing rank, how long to wait for the others' reports (often the root cause is on another rank).
_ERROR_GRACE_S = 3.0


class DistributedRankError(RuntimeError):
    """One or more ranks raised; the message holds each failing rank's traceback."""


def _free_port() -> int:
    """A localhost TCP port that was free a moment ago (the OS picks it when binding port 0)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: What the forkserver imports once, so that each rank forked from it starts with them: the import of Lightning is
#: most of a spawned rank's start-up. Only libraries: the package under test is imported in the rank (its import reads
#: the environment, which the test may have set).
_PRELOAD = ["torch", "torch.distributed", "lightning.pytorch"]


def _context() -> Any:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)  # read when the forkserver starts, on the first call in this process
    return ctx


def _worker(
    rank: int,
    world_size: int,
    port: int,
    pg_timeout_s: float,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    conn: Connection,
    environ: dict[str, str],
) -> None:
    os.environ.clear()  # the test process's environment now, not the forkserver's from when it started
    os.environ.update(environ)
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
    )
    torch.set_num_threads(1)
    if os.environ.get("LIGHTNING_BALANCED_TESTS_PRETEND_GPU"):  # see tests/pretend_gpu.py
        from tests.pretend_gpu import install

        install()
    try:
        timeout = timedelta(seconds=pg_timeout_s)
        store = dist.TCPStore("127.0.0.1", port, world_size, False, timeout)  # the test process hosts it
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        try:
            message = ("ok", fn(rank, world_size, *args))
        except BaseException:
            message = ("error", traceback.format_exc())
    except BaseException:
        message = ("error", traceback.format_exc())
    try:
        payload = pickle.dumps(message)
    except Exception:
        payload = pickle.dumps(("error", "the result of fn could not be pickled:\n" + traceback.format_exc()))
    # The result goes out before the teardown: torch 2.4's gloo can hang in destroy_process_group when the ranks tear
    # down together; run_distributed then kills a rank left there after a few seconds instead of reporting a hang.
    conn.send_bytes(payload)
    conn.close()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_distributed(fn: Callable[..., Any], world_size: int, *args: Any, timeout_s: float = 120) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` on ``world_size`` spawned CPU ranks in one gloo group; return the results.

    Args:
        fn: a module-level (picklable) function; its return value must be picklable.
        world_size: number of ranks, >= 1.
        *args: passed to ``fn`` on every rank after ``rank`` and ``world_size`` (pickled once per rank).
        timeout_s: limit for the whole run, start-up included. The default process group's timeout (how long a
            collective waits for its peers before raising in the rank) is half of it; for a shorter one, make a group
            inside ``fn`` with ``torch.distributed.new_group(timeout=...)``.

    Returns:
        list: ``fn``'s return values, index = rank.

    Raises:
        DistributedRankError: a rank raised (its traceback is in the message; so are those of other ranks that failed
            within a few seconds), or exited without reporting (crash, killed).
        TimeoutError: not every rank reported within ``timeout_s`` (a hang). All ranks are killed either way.
    """
    if world_size < 1:
        raise ValueError(f"`world_size` must be >= 1, got {world_size}")
    ctx = _context()
    environ = dict(os.environ)
    port = _free_port()
    # The store lives here, as torchrun's agent hosts it: it outlives any rank, so a rank that stops late can still
    # read the notices of one that stopped first (a forked rank exits at once, rank 0 included).
    store = dist.TCPStore("127.0.0.1", port, world_size, True, timedelta(seconds=timeout_s), wait_for_workers=False)
    procs: list[Any] = []
    readers: dict[Connection, int] = {}
    results: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    first_error_at = 0.0
    try:
        for rank in range(world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_worker,
                args=(rank, world_size, port, timeout_s / 2, fn, args, writer, environ),
                name=f"run_distributed-rank{rank}",
            )
            proc.start()
            writer.close()
            procs.append(proc)
            readers[reader] = rank

        while readers:
            now = time.monotonic()
            if errors:
                deadline = min(deadline, first_error_at + _ERROR_GRACE_S)
            if now >= deadline:
                break
            ready = wait([*readers, *(procs[r].sentinel for r in readers.values())], timeout=deadline - now)
            for reader in [r for r in readers if r in ready or r.poll()]:
                rank = readers.pop(reader)
                try:
                    status, payload = pickle.loads(reader.recv_bytes())
                except EOFError:
                    status, payload = "error", f"exited without a result (exit code {procs[rank].exitcode})"
                reader.close()
                if status == "ok":
                    results[rank] = payload
                else:
                    if not errors:
                        first_error_at = time.monotonic()
                    errors[rank] = payload
            # A rank whose process ended with nothing left to read crashed (poll() above saw no data).
            for reader, rank in list(readers.items()):
                if procs[rank].exitcode is not None and not reader.poll():
                    readers.pop(reader)
                    reader.close()
                    if not errors:
                        first_error_at = time.monotonic()
                    errors[rank] = f"exited without a result (exit code {procs[rank].exitcode})"
    finally:
        for proc in procs:
            proc.join(timeout=max(0.0, min(5.0, deadline - time.monotonic())) if not errors else 0)
            if proc.is_alive():
                proc.kill()
                proc.join()
        del store  # once every rank has ended

    if errors:
        report = "\n".join(f"--- rank {rank} ---\n{tb}" for rank, tb in sorted(errors.items()))
        raise DistributedRankError(f"{len(errors)} of {world_size} ranks failed:\n{report}")
    if len(results) < world_size:
        missing = sorted(set(range(world_size)) - set(results))
        raise TimeoutError(f"ranks {missing} did not finish within {timeout_s} s (killed)")
    return [results[rank] for rank in range(world_size)]


def lightning_sampler_seed() -> int:
    """The seed of the ``DistributedSampler`` Lightning gives the ranks: ``PL_GLOBAL_SEED``, which they inherit from
    this process (an earlier test's ``seed_everything`` sets it), else 0. For a reference that replays their order."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))
