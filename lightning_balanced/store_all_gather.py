"""``all_gather_object`` with a deadline, through the default process group's store instead of a collective.

A rank that never reaches a collective leaves the others waiting in it until the process group's timeout (30 minutes
by default). :func:`store_all_gather_object` instead has each rank write its object to the store and wait at most
``timeout_s`` for the others' keys: the ranks that did not arrive are named in an error on every rank that did, and a
rank that arrives after the others gave up raises too, instead of waiting alone.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any

import torch.distributed as dist

__all__ = ["store_all_gather_object"]

_exchanges: dict[tuple[str, tuple[int, ...]], int] = {}  # per (caller, group): the exchanges this process has begun


def _present(store: Any, key: str, set_it: bool = False) -> bool:
    try:
        if set_it:
            store.set(key, b"1")
        return bool(store.check([key]))
    except RuntimeError:  # the store's host (rank 0 of the world) has gone
        return False


def store_all_gather_object(obj: Any, *, caller: str, timeout_s: float, group: Any | None = None) -> list[Any]:
    """Every rank's picklable ``obj``, in rank order, on every rank of ``group``; waits at most ``timeout_s``.

    Each rank ``set``s its pickled object under a key of this exchange, ``wait``s for the others' keys, ``check``s
    that no rank gave up, reads them in one ``multi_get`` and deletes its key of the previous exchange, which every
    rank has read by then: five store round trips, no collective. Every rank of ``group`` must call it the same
    number of times for the same ``caller``.

    Args:
        obj (Any): this rank's object (pickled; Python objects, tensors on any device).
        caller (str): the public function that exchanges, named in errors and in the store keys.
        timeout_s (float): how long, in seconds, to wait for the other ranks.
        group (ProcessGroup, optional): the ranks taking part (default: the world).

    Returns:
        list: ``W`` objects, rank ``r``'s at position ``r`` of the group.

    Raises:
        RuntimeError: on every rank that called it, when another rank did not call it within ``timeout_s`` (named), or
            when this rank arrived after the others stopped waiting.
    """
    ranks, me = tuple(dist.get_process_group_ranks(group or dist.group.WORLD)), dist.get_rank()
    count = _exchanges[caller, ranks] = _exchanges.get((caller, ranks), 0) + 1
    prefix = f"lightning_balanced/{caller}/{','.join(map(str, ranks))}/"
    keys, gave_up = [f"{prefix}{count}/{r}" for r in ranks], f"{prefix}{count}/gave-up"
    store = dist.distributed_c10d._get_default_store()
    store.set(keys[ranks.index(me)], pickle.dumps(obj))  # type: ignore[arg-type]  # the binding takes bytes too
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
        missing, cause, late = [], None, _present(store, gave_up)
    except RuntimeError as err:  # DistStoreError: the wait timed out; DistNetworkError: the store has gone
        missing, cause, late = (
            [r for r, key in zip(ranks, keys, strict=True) if r != me and not _present(store, key)],
            err,
            True,
        )
        _present(store, gave_up, set_it=True)  # a rank that arrives later raises too, instead of waiting alone
    if late:
        who = f"rank(s) {missing} did not call it" if missing else "the other ranks stopped waiting for this one"
        raise RuntimeError(
            f"{caller}: {who} within {timeout_s:g} s. It runs collectives, so every rank must call it at the same"
            " point: not under `if self.global_rank == 0:` (the usual cause), nor in a hook only some ranks run. If a"
            " rank is only slow, raise `timeout_s`."
        ) from cause
    objects = [pickle.loads(value) for value in store.multi_get(keys)]
    store.delete_key(f"{prefix}{count - 1}/{me}")
    return objects
