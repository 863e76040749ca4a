"""``end_process_group``: the default group of a finished run ended on every rank, on 2 real gloo ranks."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from lightning_balanced.strategies.process_group import end_process_group
from tests.distributed import run_distributed


def _end_rank(rank: int, world_size: int) -> tuple[bool, bool]:
    before = dist.is_initialized()
    end_process_group(timeout_s=30)
    return before, dist.is_initialized()


@pytest.mark.slow
def test_every_rank_ends_its_group() -> None:
    assert run_distributed(_end_rank, 2) == [(True, False), (True, False)]


def _rank_1_absent(rank: int, world_size: int) -> str:
    if rank == 1:
        return "absent"  # never reaches the barrier
    try:
        end_process_group(timeout_s=2)
    except RuntimeError as error:
        return str(error).splitlines()[0]
    return "no error"


@pytest.mark.slow
def test_a_rank_that_never_arrives_is_named_in_an_error_after_the_timeout() -> None:
    rank_0, rank_1 = run_distributed(_rank_1_absent, 2)
    assert rank_1 == "absent"
    # torch's monitored_barrier names the missing rank (the same first line on torch 2.4.1 and 2.13).
    assert rank_0 == "[Rank 0]: Ranks 1 failed to pass monitoredBarrier in 2000 ms"


def test_without_a_group_it_does_nothing() -> None:
    assert not dist.is_initialized()
    end_process_group()
    assert not dist.is_initialized()
