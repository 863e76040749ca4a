"""Which gathered evaluation rows are kept: the sampler's interleave, decided from each rank's own indices, keeps
exactly what sorting the gathered indices keeps (pure functions, so checked exhaustively and by hypothesis)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, TensorDataset

from lightning_balanced.evaluation.sample_order import (
    KeptRows,
    interleave_size,
    sampler_dataset_size,
    sampler_positions,
    sampler_tail,
)

CPU = torch.device("cpu")


def _decide(blocks: list[list[int]]) -> int | None:
    """What gather_eval_outputs decides from the ranks' metadata alone (each rank checks only its own indices)."""
    world_size = len(blocks)
    tails = [
        sampler_tail(torch.tensor(b, dtype=torch.int64), len(b), rank, world_size, None)
        for rank, b in enumerate(blocks)
    ]
    return interleave_size([len(b) for b in blocks], tails)


def _reference(blocks: list[list[int]]) -> tuple[list[int], list[int]]:
    """Each index once, by index, its first copy in rank order: (indices, rank-major positions), written out plainly."""
    seen: dict[int, int] = {}
    for position, index in enumerate(i for b in blocks for i in b):
        seen.setdefault(index, position)
    return sorted(seen), [seen[i] for i in sorted(seen)]


def _kept(blocks: list[list[int]], n: int | None) -> tuple[list[int], list[int], list[float]]:
    """KeptRows' (indices, positions, rows taken from a field whose row value is its rank-major position)."""
    counts = [len(b) for b in blocks]
    tensors = [torch.tensor(b, dtype=torch.int64) for b in blocks]
    kept = KeptRows(counts, CPU, n, () if n is not None else tensors)
    start = torch.tensor([0, *counts]).cumsum(0).tolist()
    field = [torch.arange(start[r], start[r + 1], dtype=torch.float64) for r in range(len(blocks))]
    return kept.indices.tolist(), kept.positions(), kept.take(field).tolist()


@pytest.mark.parametrize("world_size", [1, 2, 3, 4, 7])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 8, 13])
def test_distributed_sampler_layouts_are_recognised_and_keep_every_sample_once(world_size: int, n: int) -> None:
    blocks = [list(DistributedSampler(range(n), world_size, rank, shuffle=False)) for rank in range(world_size)]
    assert _decide(blocks) == n
    indices, positions, rows = _kept(blocks, n)
    assert (indices, positions) == _reference(blocks)
    assert rows == [float(p) for p in positions]


def _layouts() -> st.SearchStrategy[list[list[int]]]:
    """Per-rank index lists near the sampler's layout (so the fast path is often nearly, but not quite, taken)."""

    @st.composite
    def build(draw: st.DrawFn) -> list[list[int]]:
        world_size, n = draw(st.integers(1, 4)), draw(st.integers(1, 10))
        blocks = [list(DistributedSampler(range(n), world_size, r, shuffle=False)) for r in range(world_size)]
        for _ in range(draw(st.integers(0, 2))):  # perturb: change, drop or append an index on some rank
            rank = draw(st.integers(0, world_size - 1))
            action = draw(st.sampled_from(["change", "drop", "append"]))
            if action == "change" and blocks[rank]:
                blocks[rank][draw(st.integers(0, len(blocks[rank]) - 1))] = draw(st.integers(0, 12))
            elif action == "drop" and blocks[rank]:
                blocks[rank].pop(draw(st.integers(0, len(blocks[rank]) - 1)))
            elif action == "append":
                blocks[rank].append(draw(st.integers(0, 12)))
        return blocks

    return build()


@settings(max_examples=400, deadline=None)
@given(_layouts())
def test_the_interleave_is_taken_only_when_it_keeps_what_the_sort_keeps(blocks: list[list[int]]) -> None:
    n = _decide(blocks)
    repeats_on_a_rank = any(len(set(b)) < len(b) for b in blocks)
    if n is None:
        if repeats_on_a_rank:
            with pytest.raises(ValueError, match="same sample index twice on one rank"):
                KeptRows([len(b) for b in blocks], CPU, None, [torch.tensor(b, dtype=torch.int64) for b in blocks])
            return
    else:
        assert not repeats_on_a_rank
    indices, positions, rows = _kept(blocks, n)
    assert (indices, positions) == _reference(blocks)
    assert rows == [float(p) for p in positions]


def test_generated_positions_follow_the_sampler_and_refuse_too_many_samples() -> None:
    counts = [3, 3]  # 5 samples on 2 ranks: [0, 2, 4] and [1, 3, 0]
    assert [b.tolist() for b in sampler_positions(counts, 5)] == [[0, 2, 4], [1, 3, 0]]
    assert [sampler_tail(None, 3, r, 2, 5) for r in (0, 1)] == [4, 0]
    assert interleave_size(counts, [4, 0]) == 5
    with pytest.raises(ValueError, match=r"rank 0 added 4 samples.*at most 3 of the 5"):
        sampler_positions([4, 3], 5)


def test_the_dataset_size_is_the_one_the_distributed_sampler_splits() -> None:
    dataset = TensorDataset(torch.zeros(10))
    assert sampler_dataset_size(DataLoader(dataset, batch_size=2)) == 10
    assert sampler_dataset_size(DataLoader(dataset, sampler=DistributedSampler(dataset, 2, 0))) == 10
    # a batch sampler around a DistributedSampler over 7 positions (as Lightning wraps a user's sampler): 7, not 10
    batches = BatchSampler(DistributedSampler(range(7), 2, 0), batch_size=2, drop_last=False)
    assert sampler_dataset_size(DataLoader(dataset, batch_sampler=batches)) == 7
    assert sampler_dataset_size(object()) is None
