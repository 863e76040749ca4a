"""Which rank stopped: each rank leaves the reason it stops in the process group's store, and where it runs.

When a rank of a multi-process pipeline stops (an error in its stage, or killed), the ranks exchanging with it get a
transport error from the backend (gloo: ``Connection closed by peer``) that names no rank. Before its error leaves
the step, a rank writes a *notice* to the default process group's store (the ``TCPStore`` that
``init_process_group`` rendezvoused through): ``error`` with its exception, or ``lost`` when it is itself only a
peer that lost its connection. A rank that gets a transport error reads the notices and names the first rank that
stopped on an error of its own. A killed rank writes nothing; it is found by the host name and process id each rank
records at setup (on the reader's own host: a process that no longer runs, or a zombie, was killed). When the store
itself is unreachable, its host stopped: rank 0's process under Lightning's launchers, torchrun's agent under
torchrun.

Every store operation here runs with a short timeout (:data:`STORE_TIMEOUT`) and is best effort: a notice that cannot
be written or read only makes the message less precise, never hides the original error.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist
from torch._C._distributed_c10d import Store

__all__ = ["STORE_TIMEOUT", "StopNotices"]

#: The timeout of each store operation on the failure path (the process group's own can be 30 minutes).
STORE_TIMEOUT = timedelta(seconds=5)

_PREFIX = "lightning_balanced/stop/"


@dataclass(frozen=True)
class StopNotices:
    """The notices of the ranks of one process group in its store.

    Args:
        store (torch.distributed.Store): the default process group's store, shared by every rank.
        rank (int): this process's global rank.
    """

    store: Store
    rank: int

    @classmethod
    def of_default_group(cls) -> StopNotices:
        """The notices in the store of the initialized default process group (``dist.init_process_group``)."""
        from torch.distributed.distributed_c10d import _get_default_store

        return cls(_get_default_store(), dist.get_rank())

    def record_process(self) -> None:
        """Record where this rank runs (host name and process id), so a peer on the same host can tell it was killed.

        Also clears the reason an earlier run in the same process group left.
        """
        with contextlib.suppress(Exception), self._short_timeout():
            self.store.set(f"{_PREFIX}process/{self.rank}", f"{socket.gethostname()} {os.getpid()}")
            self.store.delete_key(f"{_PREFIX}reason/{self.rank}")

    def report(self, error: BaseException, *, lost: bool) -> None:
        """Leave this rank's reason to stop: its own ``error``, or (``lost=True``) a lost connection to a peer."""
        text = str(error).strip().splitlines()
        summary = f"{type(error).__name__}: {text[0]}" if text else type(error).__name__
        with contextlib.suppress(Exception), self._short_timeout():
            self.store.set(f"{_PREFIX}reason/{self.rank}", f"{'lost' if lost else 'error'} {summary}")

    def who_stopped(self, ranks: Sequence[int], wait_s: float = 3.0) -> str:
        """A sentence naming the rank among ``ranks`` that stopped first, and why, as far as the notices tell.

        A killed process can still be in the process table for a moment after its connections closed, so the notices
        and the processes are looked at again for up to ``wait_s`` seconds before giving up.

        Args:
            ranks: the global ranks to look at (this rank is skipped).
            wait_s: how long to look again for a reason (seconds).

        Returns:
            ``"rank 2 stopped on TypeError: ..."``; ``"rank 3 (process 4711 on host h) no longer runs and reported no
            error: it was killed"``; or, when nothing is known, which ranks reported nothing.
        """
        others = [rank for rank in ranks if rank != self.rank]
        deadline = time.monotonic() + wait_s
        while True:
            try:
                found, silent = self._look(others)
            except Exception:  # the store is gone with its host
                return (
                    "the process group's store no longer answers, so the process that hosts it stopped (rank 0 under"
                    " Lightning's launchers, the agent under torchrun)"
                )
            if found is not None:
                return found
            if not silent:
                return "every other rank reported a lost connection too"
            if time.monotonic() >= deadline:
                which = f"rank {silent[0]}" if len(silent) == 1 else f"ranks {silent}"
                return f"no rank reported an error of its own; {which} reported nothing (killed, or still running)"
            time.sleep(0.1)

    def stopped_peer(self, ranks: Sequence[int]) -> str | None:
        """:meth:`who_stopped`'s sentence if a rank among ``ranks`` has stopped for sure, else ``None``; one look.

        Stopped for sure: it left an error of its own, or its process on this host no longer runs. For a rank that
        waits for others that may never come (a gather with a deadline), between its waits.
        """
        try:
            return self._look([rank for rank in ranks if rank != self.rank])[0]
        except Exception:
            return None

    def _look(self, others: list[int]) -> tuple[str | None, list[int]]:
        """The sentence naming a rank of ``others`` that stopped, if one did; and the ranks that reported nothing."""
        host = socket.gethostname()
        with self._short_timeout():
            reasons = {rank: self._read(f"reason/{rank}") for rank in others}
            processes = {rank: self._read(f"process/{rank}") for rank in others}
        for rank in others:
            reason = reasons[rank]
            if reason is not None and reason.startswith("error "):
                return f"rank {rank} stopped on {reason.removeprefix('error ')}", []
        silent = [rank for rank in others if reasons[rank] is None]
        for rank in silent:
            rank_host, _, pid = (processes[rank] or "").rpartition(" ")
            if rank_host == host and pid.isdigit() and not _runs(int(pid)):
                killed = "no longer runs and reported no error: it was killed"
                return f"rank {rank} (process {pid} on host {host}) {killed}", silent
        return None, silent

    def _read(self, key: str) -> str | None:
        full = _PREFIX + key
        return self.store.get(full).decode() if self.store.check([full]) else None

    @contextlib.contextmanager
    def _short_timeout(self) -> Iterator[None]:
        previous = self.store.timeout  # type: ignore[attr-defined]  # in every torch, missing from the stub
        self.store.set_timeout(STORE_TIMEOUT)
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                self.store.set_timeout(previous)


def _runs(pid: int) -> bool:
    """Whether process ``pid`` of this host still runs (a zombie, killed and not yet reaped, does not)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rpartition(")")[2].split()[0] not in ("Z", "X")  # zombie, dead
    except OSError:
        return True
