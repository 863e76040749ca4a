"""The one barrier of a step's replica threads: they meet, exchange values, and never hang.

balanced_dp runs each replica of a step on a thread of its own. Wherever the replicas must wait for one another, they
meet at the step's :class:`ReplicaBarrier`: the lockstep calls of manual optimization (``manual_backward``,
``optimizer.step``, ... in :mod:`~lightning_balanced.data_parallel.replica_context`) and every synchronized BatchNorm
layer (:mod:`~lightning_balanced.data_parallel.replica_batchnorm`). One barrier per step, so that one failure releases
every replica, wherever it waits.

A meeting is one call by every replica: each contributes a value, and when the last one arrives all continue with the
values of all (:meth:`~ReplicaBarrier.exchange`) or with what one function made of them, run once
(:meth:`~ReplicaBarrier.call_once`). Meetings are counted per ``key``: replica ``i``'s ``n``-th call with a key meets
the other replicas' ``n``-th calls with that key. Calls without a key form one sequence (the lockstep calls, which every
replica makes in the same order); a key per layer keeps the layers apart (replica 0 waiting at layer A never meets
replica 1 arriving at layer B). The barrier is reusable: any number of meetings, in sequence or under many keys.

It never hangs:

- a replica that fails calls :meth:`~ReplicaBarrier.abort`: every replica waiting now, or arriving later, raises
  :class:`ReplicaAborted`, whose ``__cause__`` is the first failure and whose message names the replica that failed;
- a replica that waits longer than ``timeout`` (the others call a shared operation a different number of times) raises
  a ``RuntimeError`` naming the timeout, the meeting and the replicas that did not come, and aborts the barrier, so the
  other waiting replicas are released at once.

An aborted barrier stays aborted: make a new one per step.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any, TypeVar

__all__ = ["ReplicaAborted", "ReplicaBarrier"]

DEFAULT_TIMEOUT_S = 120.0

T = TypeVar("T")


class ReplicaAborted(RuntimeError):
    """A replica was released from a meeting because another replica failed first; ``__cause__`` is that failure.

    The message names both replicas and the meeting. It takes the message alone too, so that ``parallel_apply``'s
    copy of it (re-raised from the message, as torch's CUDA ``parallel_apply`` does) is still a ``ReplicaAborted``;
    such a copy has the attributes ``None``.

    Attributes:
        index (int | None): the replica that was released.
        where (str | None): the meeting it was released from (or was arriving at).
        failed_index (int | None): the replica whose failure aborted the barrier: the first to fail.
        error (BaseException | None): that failure, also the ``__cause__``.
    """

    def __init__(
        self,
        message: str,
        *,
        index: int | None = None,
        where: str | None = None,
        failed_index: int | None = None,
        error: BaseException | None = None,
    ) -> None:
        super().__init__(message)
        self.index = index
        self.where = where
        self.failed_index = failed_index
        self.error = error
        if error is not None:
            self.__cause__ = error


@dataclass
class _Meeting:
    """One meeting: the ``n``-th call under one key, by every replica."""

    values: dict[int, Any] = field(default_factory=dict)
    done: bool = False
    result: Any = None
    error: BaseException | None = None
    collected: int = 0


class ReplicaBarrier:
    """Meetings of ``parties`` replica threads, abortable and with a timeout (see the module docstring).

    Args:
        parties (int): the replicas that meet, indexed ``0 .. parties - 1``.
        timeout (float): seconds a replica waits at one meeting for the others. Default: 120.

    Raises:
        ValueError: ``parties`` is not an integer >= 1, or ``timeout`` not a positive, finite number.
    """

    def __init__(self, parties: int, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        if isinstance(parties, bool) or not isinstance(parties, int) or parties < 1:
            raise ValueError(f"`parties` must be an integer >= 1, got {parties!r}")
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not 0 < timeout < math.inf:
            raise ValueError(f"`timeout` must be a positive, finite number of seconds, got {timeout!r}")
        self.parties = parties
        self.timeout = float(timeout)
        self._condition = threading.Condition()
        self._meetings: dict[tuple[Hashable, int], _Meeting] = {}
        self._calls: dict[tuple[int, Hashable], int] = {}
        self._aborted: tuple[int, BaseException] | None = None
        self._failures: dict[int, BaseException] = {}

    def exchange(self, index: int, value: Any, *, key: Hashable = None, what: str = "the barrier") -> list[Any]:
        """Contribute ``value`` as replica ``index``; return the values of all replicas, in replica order.

        Args:
            index (int): this replica, ``0 .. parties - 1``.
            value (Any): its contribution.
            key (Hashable): the sequence of meetings this call belongs to (see the module docstring).
            what (str): the meeting, as messages name it (e.g. "`manual_backward`").

        Raises:
            ReplicaAborted: another replica failed (:meth:`abort`), before or while this one waited.
            RuntimeError: the other replicas did not arrive within ``timeout``.
        """
        return list(self.call_once(index, value, tuple, key=key, what=what))

    def call_once(
        self,
        index: int,
        value: Any,
        action: Callable[[list[Any]], T],
        *,
        key: Hashable = None,
        what: str = "the barrier",
        hint: str = "",
    ) -> T:
        """Contribute ``value`` as replica ``index``; the last to arrive runs ``action(values)`` once, for all.

        Every replica returns what ``action`` returned, or raises what it raised. ``action`` runs with the barrier
        held, so no replica meets anywhere before it is done.

        Args:
            index (int): this replica, ``0 .. parties - 1``.
            value (Any): its contribution.
            action (Callable[[list[Any]], T]): gets the values of all replicas, in replica order.
            key (Hashable): the sequence of meetings this call belongs to (see the module docstring).
            what (str): the meeting, as messages name it.
            hint (str): appended to the timeout message: what the replicas must do alike.

        Raises:
            ReplicaAborted: another replica failed (:meth:`abort`), before or while this one waited.
            RuntimeError: the other replicas did not arrive within ``timeout``.
            BaseException: whatever ``action`` raised, in every replica.
        """
        if not 0 <= index < self.parties:
            raise ValueError(f"replica index {index} is not in 0 .. {self.parties - 1}")
        with self._condition:
            self._raise_if_aborted(index, what)
            call = self._calls.get((index, key), 0)
            self._calls[(index, key)] = call + 1
            meeting = self._meetings.setdefault((key, call), _Meeting())
            meeting.values[index] = value
            if len(meeting.values) == self.parties:
                try:
                    meeting.result = action([meeting.values[i] for i in range(self.parties)])
                except BaseException as err:
                    meeting.error = err
                meeting.done = True
                meeting.values = {}
                self._condition.notify_all()
            else:
                arrived = self._condition.wait_for(lambda: meeting.done or self._aborted is not None, self.timeout)
                if not meeting.done:
                    self._raise_if_aborted(index, what)
                if not arrived:
                    raise self._time_out(index, what, meeting, call if key is not None else None, hint)
            meeting.collected += 1
            if meeting.collected == self.parties:
                del self._meetings[(key, call)]
            if meeting.error is not None:
                raise meeting.error
            return meeting.result  # type: ignore[no-any-return]

    def abort(self, index: int, error: BaseException) -> None:
        """Replica ``index`` failed with ``error``: release every replica waiting now or later.

        The first abort is the one every released replica's :class:`ReplicaAborted` names; each replica's own
        failure is kept for :meth:`failure`.
        """
        with self._condition:
            if self._aborted is None:
                self._aborted = (index, error)
            self._failures.setdefault(index, error)
            self._condition.notify_all()

    def failure(self) -> tuple[int, BaseException] | None:
        """The lowest-index replica that failed on its own, and the exception object it raised (``None``: none failed).

        Replicas released by another's failure (:class:`ReplicaAborted`) do not count. The object is the one the
        replica raised, traceback included: torch's CUDA ``parallel_apply`` re-raises a copy built from the message,
        which loses it.
        """
        with self._condition:
            own = [(i, e) for i, e in self._failures.items() if not isinstance(e, ReplicaAborted)]
        return min(own, key=lambda failure: failure[0]) if own else None

    def _raise_if_aborted(self, index: int, what: str) -> None:
        if self._aborted is not None:
            failed, error = self._aborted
            raise ReplicaAborted(
                f"Replica {index} stopped at {what} because replica {failed} failed ({type(error).__name__})",
                index=index,
                where=what,
                failed_index=failed,
                error=error,
            ) from error

    def _time_out(self, index: int, what: str, meeting: _Meeting, call: int | None, hint: str) -> RuntimeError:
        """The timeout error of replica ``index``, recorded as its failure; the barrier is aborted with it."""
        missing = sorted(set(range(self.parties)) - set(meeting.values))
        where = what if call is None else f"{what} (call {call + 1})"
        message = f"Replica {index} waited {self.timeout:.3g}s (the timeout) at {where} for replicas {missing}."
        error = RuntimeError(f"{message} {hint}" if hint else message)
        self._aborted = (index, error)
        self._failures.setdefault(index, error)
        self._condition.notify_all()
        return error
