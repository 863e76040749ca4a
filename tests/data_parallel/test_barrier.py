"""The one barrier of a step's replica threads: exchanges, reuse, timeouts and aborts, with real threads.

No test can hang: every barrier has a short timeout, every thread is a daemon joined with a deadline, and a thread
still alive at the deadline fails the test.
"""

from __future__ import annotations

import math
import pickle
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import pytest

from lightning_balanced.data_parallel.barrier import ReplicaAborted, ReplicaBarrier

_JOIN_S = 20.0  # far above any barrier timeout here: a thread alive after this hung


def _in_threads(replicas: Sequence[Callable[[], Any]]) -> list[Any]:
    """Run each callable on a thread of its own; what each returned, or the exception it raised."""
    outcomes: list[Any] = [None] * len(replicas)

    def run(index: int) -> None:
        try:
            outcomes[index] = replicas[index]()
        except BaseException as err:
            outcomes[index] = err

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(replicas))]
    for thread in threads:
        thread.start()
    deadline = time.monotonic() + _JOIN_S
    for thread in threads:
        thread.join(max(0.0, deadline - time.monotonic()))
    hung = [i for i, thread in enumerate(threads) if thread.is_alive()]
    assert not hung, f"replicas {hung} hung"
    return outcomes


def test_exchange_gives_every_replica_the_values_of_all_in_replica_order() -> None:
    barrier = ReplicaBarrier(4, timeout=10)
    got = _in_threads([lambda i=i: barrier.exchange(i, f"value {i}") for i in range(4)])
    assert got == [["value 0", "value 1", "value 2", "value 3"]] * 4
    assert len({id(values) for values in got}) == 4  # a list of its own each: changing one changes no other


def test_call_once_runs_the_action_once_and_every_replica_returns_its_result() -> None:
    barrier = ReplicaBarrier(3, timeout=10)
    calls: list[list[int]] = []

    def total(values: list[int]) -> int:
        calls.append(values)
        return sum(values)

    got = _in_threads([lambda i=i: barrier.call_once(i, i + 1, total) for i in range(3)])
    assert got == [6, 6, 6]
    assert calls == [[1, 2, 3]]


def test_what_the_action_raises_is_raised_in_every_replica() -> None:
    barrier = ReplicaBarrier(3, timeout=10)
    failure = ValueError("the action failed")

    def fail(values: list[Any]) -> None:
        raise failure

    got = _in_threads([lambda i=i: barrier.call_once(i, None, fail) for i in range(3)])
    assert got == [failure] * 3
    # The next meeting still works: an action's failure is the replicas' to handle (abort), not the barrier's.
    assert _in_threads([lambda i=i: barrier.exchange(i, i) for i in range(3)]) == [[0, 1, 2]] * 3


def test_the_barrier_is_reusable_across_steps_and_layers() -> None:
    # Many meetings on one barrier: a sequence without a key (lockstep calls) and one per key (layers), interleaved;
    # a fast replica's next meeting never takes a slow one's place.
    barrier = ReplicaBarrier(3, timeout=10)
    rounds, layers = 40, ("conv.bn", "head.bn")

    def replica(index: int) -> list[Any]:
        seen = []
        for r in range(rounds):
            if index == r % 3:
                time.sleep(0.001)  # a different replica is the slow one each round
            for layer in layers:
                seen.append(barrier.exchange(index, (layer, r, index), key=layer))
            seen.append(barrier.call_once(index, r * 10 + index, sum))
        return seen

    got = _in_threads([lambda i=i: replica(i) for i in range(3)])
    expected = []
    for r in range(rounds):
        expected += [[(layer, r, i) for i in range(3)] for layer in layers]
        expected.append(sum(r * 10 + i for i in range(3)))
    assert got == [expected] * 3


def test_one_replica_meets_alone() -> None:
    barrier = ReplicaBarrier(1, timeout=10)
    assert barrier.exchange(0, "only") == ["only"]
    assert barrier.call_once(0, 2, lambda values: values[0] * 3) == 6


def test_meetings_under_different_keys_never_mix() -> None:
    # Replica 0 at layer A and replica 1 at layer B do not meet (their moments would be mixed): both stop at the
    # timeout, and the timeout names the layer and its call number.
    barrier = ReplicaBarrier(2, timeout=0.3)
    start = time.monotonic()
    got = _in_threads([lambda: barrier.exchange(0, "a", key="A", what="A"), lambda: barrier.exchange(1, "b", key="B")])
    assert time.monotonic() - start < 10
    timeouts = [e for e in got if type(e) is RuntimeError]
    released = [e for e in got if isinstance(e, ReplicaAborted)]
    assert len(timeouts) == 1 and len(released) == 1, got
    assert "(call 1) for replicas [" in str(timeouts[0])
    assert released[0].error is timeouts[0]


def test_a_timeout_names_itself_the_meeting_and_the_missing_replicas_and_releases_the_others() -> None:
    barrier = ReplicaBarrier(3, timeout=0.2)
    hint = "Every replica must call `step` alike."
    start = time.monotonic()
    got = _in_threads([lambda i=i: barrier.call_once(i, None, len, what="`step`", hint=hint) for i in range(2)])
    elapsed = time.monotonic() - start
    assert 0.2 <= elapsed < 10  # waited the timeout, and the second was released at once, not a timeout later
    timeouts = [e for e in got if type(e) is RuntimeError]
    assert len(timeouts) == 1, got
    timeout = timeouts[0]
    waited = got.index(timeout)
    assert str(timeout) == f"Replica {waited} waited 0.2s (the timeout) at `step` for replicas [2]. {hint}"
    other = got[1 - waited]
    assert isinstance(other, ReplicaAborted)
    assert (other.index, other.failed_index, other.error, other.__cause__) == (1 - waited, waited, timeout, timeout)
    # The timeout is the replica's own failure; a replica arriving late is released at once.
    assert barrier.failure() == (waited, timeout)
    with pytest.raises(ReplicaAborted, match=rf"^Replica 2 stopped at `step` because replica {waited} failed"):
        barrier.call_once(2, None, len, what="`step`")


def test_an_abort_releases_the_waiting_replicas_at_once_with_the_first_failure() -> None:
    barrier = ReplicaBarrier(4, timeout=60)
    first, second = KeyError("replica 2 failed first"), ValueError("replica 3 failed second")

    def fail_later() -> None:
        # Once replicas 0 and 1 wait in the meeting (their values are in; polled, not a guessed sleep).
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            with barrier._condition:
                meeting = barrier._meetings.get((None, 0))
                if meeting is not None and len(meeting.values) == 2:
                    break
            time.sleep(0.001)
        barrier.abort(2, first)
        barrier.abort(3, second)

    start = time.monotonic()
    got = _in_threads(
        [
            lambda: barrier.exchange(0, None, what="`manual_backward`"),
            lambda: barrier.exchange(1, None, what="`manual_backward`"),
            fail_later,
        ]
    )
    assert time.monotonic() - start < 10  # released, not timed out (60 s)
    for index, error in enumerate(got[:2]):
        assert isinstance(error, ReplicaAborted)
        assert str(error) == f"Replica {index} stopped at `manual_backward` because replica 2 failed (KeyError)"
        assert (error.index, error.where, error.failed_index) == (index, "`manual_backward`", 2)
        assert error.error is first and error.__cause__ is first
    with pytest.raises(ReplicaAborted, match="because replica 2 failed") as info:  # later arrivals too
        barrier.call_once(3, None, len, key="layer", what="layer")
    assert info.value.__cause__ is first


def test_failure_is_the_lowest_replica_that_failed_on_its_own() -> None:
    barrier = ReplicaBarrier(4, timeout=10)
    assert barrier.failure() is None
    own_3, own_1 = RuntimeError("3"), KeyError("1")
    barrier.abort(3, own_3)
    released = ReplicaAborted("replica 0 released", index=0, where="`step`", failed_index=3, error=own_3)
    barrier.abort(0, released)  # released by replica 3's failure: not its own
    assert barrier.failure() == (3, own_3)
    barrier.abort(1, own_1)
    barrier.abort(1, RuntimeError("a second failure of replica 1 is not kept"))
    assert barrier.failure() == (1, own_1)


def test_the_abort_error_can_be_rebuilt_from_its_message_and_pickled() -> None:
    # parallel_apply re-raises a replica's error as type(error)(message), as torch's CUDA one does: still the type.
    assert str(ReplicaAborted("Replica 0 stopped at `step`")) == "Replica 0 stopped at `step`"
    error = ReplicaAborted("released", index=0, where="`step`", failed_index=1, error=KeyError("boom"))
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is ReplicaAborted and str(copy) == str(error)
    assert (copy.index, copy.where, copy.failed_index, repr(copy.error)) == (0, "`step`", 1, "KeyError('boom')")
    assert isinstance(error, RuntimeError)


@pytest.mark.parametrize("parties", [0, -1, 1.5, True, "2"])
def test_parties_must_be_a_positive_integer(parties: Any) -> None:
    with pytest.raises(ValueError, match="`parties` must be an integer >= 1"):
        ReplicaBarrier(parties, timeout=10)


@pytest.mark.parametrize("timeout", [0, -1.0, math.inf, math.nan, None, "10"])
def test_the_timeout_must_be_positive_and_finite(timeout: Any) -> None:
    with pytest.raises(ValueError, match="`timeout` must be a positive, finite number of seconds"):
        ReplicaBarrier(2, timeout=timeout)


def test_a_replica_index_outside_the_parties_is_refused() -> None:
    barrier = ReplicaBarrier(2, timeout=10)
    for index in (-1, 2):
        with pytest.raises(ValueError, match=rf"replica index {index} is not in 0 \.\. 1"):
            barrier.exchange(index, None)
