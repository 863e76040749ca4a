"""``all_gather_object`` with a deadline, through the default process group's store instead of a collective.

A rank that never reaches a collective leaves the others waiting in it until the process group's timeout (30 minutes
by default). :func:`store_all_gather_object` instead has each rank write its object to the store and wait at most
``timeout_s`` for the others' keys. Whether the exchange goes ahead is decided once, atomically, by the first rank to
write a verdict (``compare_set``): either every rank goes on, or every rank raises, the late one included, naming the
ranks that did not arrive in time.
"""

from __future__ import annotations

import contextlib
import pickle
import time
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from lightning_balanced.ranks.one_line import PeerStopped, print_peer_failures_in_one_line
from lightning_balanced.ranks.stop_notices import StopNotices

__all__ = ["store_all_gather_object"]

_exchanges: dict[tuple[str, tuple[int, ...]], int] = {}  # per (caller, group): the exchanges this process has begun


class _NotSent(str):
    """What a rank sends instead of an object it could not pickle: the reason."""


def _present(store: Any, key: str) -> bool:
    try:
        return bool(store.check([key]))
    except RuntimeError:  # the store's host (rank 0 of the world) has gone
        return False


# What the store's wait raises when it times out (its other errors, a store gone, end the wait at once).
_TIMED_OUT = getattr(dist, "DistStoreError", RuntimeError)

#: How often a waiting rank looks whether a rank it waits for has stopped (seconds).
_LOOK_EVERY_S = 1.0


def _wait(store: Any, keys: list[str], timeout_s: float, caller: str, ranks: tuple[int, ...]) -> None:
    """``store.wait(keys)`` for at most ``timeout_s``, in slices of :data:`_LOOK_EVERY_S`.

    Between them, a rank known to have stopped (an error it left in the store, or its process gone:
    :class:`~lightning_balanced.ranks.stop_notices.StopNotices`) ends the wait at once with
    :class:`~lightning_balanced.ranks.one_line.PeerStopped` naming it, printed as one line.
    """
    notices = StopNotices.of_default_group()
    deadline = time.monotonic() + timeout_s
    while True:
        left = deadline - time.monotonic()
        try:
            store.wait(keys, timedelta(seconds=max(min(left, _LOOK_EVERY_S), 0.001)))
            return
        except _TIMED_OUT:
            if time.monotonic() >= deadline:
                raise
        stopped = notices.stopped_peer(ranks)
        if stopped is not None:
            print_peer_failures_in_one_line()
            raise PeerStopped(f"{caller}: rank {notices.rank} stopped waiting for the other ranks: {stopped}")


def store_all_gather_object(obj: Any, *, caller: str, timeout_s: float, group: Any | None = None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order, on every rank of ``group``; waits at most ``timeout_s``.

    Each rank ``set``s its pickled object under a key of this exchange and ``wait``s for the others' keys; the first
    rank to write the exchange's verdict decides for all (``"go"`` after a complete wait, ``"gave-up"`` after a timed
    out one); then each reads every object in one ``multi_get`` and deletes its key of the previous exchange, which
    every rank has read by then: five store round trips, no collective. Every rank of ``group`` must call it the same
    number of times for the same ``caller``.

    Args:
        obj (Any): this rank's object, pickled (move tensors to the CPU first: they unpickle on their device).
        caller (str): the public function that exchanges, named in errors and in the store keys.
        timeout_s (float): how long, in seconds, to wait for the other ranks; > 0.
        group (ProcessGroup, optional): the ranks taking part (default: the world).

    Returns:
        list: ``W`` objects, rank ``r``'s at position ``r`` of the group.

    Raises:
        ValueError: ``timeout_s`` is not > 0; or, on every rank, some rank's object could not be pickled (named).
        RuntimeError: on every rank that called it, when another rank did not call it within ``timeout_s`` (named).
    """
    if not timeout_s > 0:
        raise ValueError(f"`timeout_s` must be > 0 seconds, got {timeout_s}")
    ranks, me = tuple(dist.get_process_group_ranks(group or dist.group.WORLD)), dist.get_rank()
    count = _exchanges[caller, ranks] = _exchanges.get((caller, ranks), 0) + 1
    prefix = f"lightning_balanced/{caller}/{','.join(map(str, ranks))}/"
    keys, verdict_key = [f"{prefix}{count}/{r}" for r in ranks], f"{prefix}{count}/verdict"
    try:
        payload = pickle.dumps(obj)
    except Exception as err:  # sent as a reason, so every rank raises it instead of waiting for this one
        payload = pickle.dumps(_NotSent(f"rank {me}: {type(err).__name__}: {err}"))
    store = dist.distributed_c10d._get_default_store()
    store.set(keys[ranks.index(me)], payload)  # type: ignore[arg-type]  # the binding takes bytes too
    cause: RuntimeError | None = None
    try:
        _wait(store, keys, timeout_s, caller, ranks)
        verdict = store.compare_set(verdict_key, "", "go")
    except PeerStopped:
        with contextlib.suppress(RuntimeError):
            store.compare_set(verdict_key, "", "gave-up")
        raise
    except RuntimeError as err:  # DistStoreError: the wait timed out; DistNetworkError: the store has gone
        cause = err
        try:
            verdict = store.compare_set(verdict_key, "", "gave-up")
        except RuntimeError:
            verdict = b"gave-up"
    if verdict != b"go":  # a rank whose wait timed out after another wrote "go" goes on: every key was there
        missing = [r for r, key in zip(ranks, keys, strict=True) if r != me and not _present(store, key)]
        who = f"rank(s) {missing} did not call it" if missing else "the other ranks stopped waiting for this one"
        raise RuntimeError(
            f"{caller}: {who} within {timeout_s:g} s. It runs collectives, so every rank must call it at the same"
            " point: not under `if self.global_rank == 0:` (the usual cause), nor in a hook only some ranks run. If a"
            " rank is only slow, raise `timeout_s`."
        ) from cause
    objects = [pickle.loads(value) for value in store.multi_get(keys)]
    store.delete_key(f"{prefix}{count - 1}/{me}")
    if me == ranks[0]:
        store.delete_key(f"{prefix}{count - 1}/verdict")
    failed = [str(o) for o in objects if isinstance(o, _NotSent)]
    if failed:
        raise ValueError(f"{caller}: cannot send the objects of " + "; ".join(failed))
    return objects
