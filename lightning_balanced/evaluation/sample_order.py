"""Which gathered evaluation rows to keep: each sample index once, ordered by index, its first copy in rank order.

``DistributedSampler(shuffle=False, drop_last=False)``, Lightning's default for evaluation, gives rank ``r`` of ``W``
the positions ``r, r + W, r + 2W, ...`` of the dataset padded to a multiple of ``W``: its ``j``-th sample is
``(j * W + r) % n``, and only its last one can wrap. Interleaved, the ranks' rows are then the ``n`` samples in order,
followed by fewer than ``W`` repeats of the first ones. Each rank checks its own indices against that layout
(:func:`sampler_tail`); when every rank's hold (:func:`interleave_size`), the first ``n`` rows of the interleave are
kept and the indices are not even gathered. Any other order (a shuffled sampler, ranks that filtered their samples)
is sorted by the gathered indices instead, and a repeat on one rank is refused.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.utils.data import DistributedSampler

__all__ = [
    "KeptRows",
    "current_loader",
    "interleave_size",
    "sample_indices",
    "sampler_dataset_size",
    "sampler_positions",
    "sampler_tail",
]


def sample_indices(indices: Any, count: int, device: torch.device) -> Tensor:
    """``add_eval_outputs``'s ``indices`` as int64 on ``device``: values checked here on the CPU, else at the gather.

    Raises:
        TypeError: not a tensor or a sequence of integers (a single integer, such as a ``batch_idx`` passed where the
            indices go).
        ValueError: not integers, not ``count`` of them, or negative.
    """
    if not isinstance(indices, (Tensor, Sequence)) or isinstance(indices, (str, bytes)):
        raise TypeError(
            "`indices` must be the dataset indices of the samples, a Tensor[N] or a sequence of N ints, got"
            f" {type(indices).__name__} {indices!r}; pass the outputs as keywords: `add_eval_outputs(indices,"
            " pred=..., target=...)` or `add_eval_outputs(pred=..., target=...)` without indices"
        )
    if isinstance(indices, Tensor):
        if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
            raise ValueError(f"`indices` must hold integers, got a tensor of dtype {indices.dtype}")
        index = indices.detach().reshape(-1).to(dtype=torch.int64)
    elif any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in indices):
        raise ValueError(f"`indices` must hold integers, got {list(indices)[:5]}...")
    else:
        index = torch.tensor(list(indices), dtype=torch.int64)
    if index.numel() != count:
        raise ValueError(f"`indices` has {index.numel()} entries but the fields have {count} samples")
    if index.device.type == "cpu" and index.numel() and int(index.min()) < 0:
        raise ValueError(f"`indices` must be >= 0, got {int(index.min())}")
    return index.to(device)


def sampler_tail(index: Tensor | None, count: int, rank: int, world_size: int, dataset_size: int | None) -> int | None:
    """This rank's last sample index if its ``count - 1`` before are ``rank, rank + W, ...``, else None.

    Args:
        index (Tensor[count] int64, optional): the rank's sample indices; None: they are generated in that layout
            (:func:`sampler_positions`), modulo ``dataset_size`` when it is known.
        count (int): how many samples the rank evaluated.
        rank (int): the rank.
        world_size (int): the number of ranks, ``W``.
        dataset_size (int, optional): the dataset's length, when known.

    Returns:
        int | None: the last sample's index, or None when the rank's indices do not follow that layout.
    """
    top = (count - 1) * world_size + rank
    if not count or index is None:
        return (top % dataset_size if dataset_size else top) if count else None
    return int(index[-1]) if torch.equal(index[:-1].cpu(), torch.arange(rank, top, world_size)) else None


def interleave_size(counts: list[int], tails: list[int | None]) -> int | None:
    """``n`` if the ranks' samples are DistributedSampler's interleave of ``n`` samples, else None.

    Args:
        counts (list[int]): each rank's number of samples.
        tails (list[int | None]): each rank's :func:`sampler_tail`.
    """
    if len(set(counts)) > 1 or None in tails:
        return None
    top, n = (counts[0] - 1) * len(counts), max(t for t in tails if t is not None) + 1  # n - 1 is in the last row
    return n if top < n and all(t == (top + r) % n for r, t in enumerate(tails)) else None


def current_loader(trainer: Any) -> Any:
    """The dataloader of the trainer's current stage (the first one where there are several); None if none."""
    if trainer.validating or trainer.sanity_checking:
        loaders = trainer.val_dataloaders
    elif trainer.training:
        loaders = trainer.train_dataloader
    else:
        loaders = trainer.test_dataloaders if trainer.testing else trainer.predict_dataloaders
    return loaders[0] if isinstance(loaders, (list, tuple)) and loaders else loaders


def sampler_dataset_size(loader: Any) -> int | None:
    """The size of the dataset ``loader``'s ``DistributedSampler`` splits (else of its dataset); None if unsized.

    Lightning wraps a user's sampler in a ``DistributedSampler`` over the sampler's positions, not the dataset's.
    """
    samplers = [getattr(loader, "sampler", None), getattr(getattr(loader, "batch_sampler", None), "sampler", None)]
    sampler = next((s for s in samplers if isinstance(s, DistributedSampler)), None)
    try:
        return len((sampler if sampler is not None else loader).dataset)  # type: ignore[arg-type]
    except (AttributeError, TypeError):
        return None


def sampler_positions(counts: list[int], dataset_size: int | None) -> list[Tensor]:
    """Without indices: rank ``r``'s ``j``-th sample is taken as position ``(j * W + r) % dataset_size``.

    Raises:
        ValueError: a rank holds more samples than DistributedSampler gives it.
    """
    world_size = len(counts)
    most = math.ceil(dataset_size / world_size) if dataset_size is not None else max(counts)
    for rank, count in enumerate(counts):
        if count > most:
            raise ValueError(
                f"Cannot gather the evaluation outputs: without `indices`, rank {rank} added {count} samples, but"
                f" DistributedSampler gives each of {world_size} ranks at most {most} of the {dataset_size} samples"
                " (`dataset_size`). Pass `indices`, or the right `dataset_size`."
            )
    blocks = [torch.arange(count).mul_(world_size).add_(rank) for rank, count in enumerate(counts)]
    return blocks if dataset_size is None else [block.remainder_(dataset_size) for block in blocks]


class KeptRows:
    """The rows to keep of the ranks' gathered rows, and the sample indices they hold (``indices``, on ``device``).

    Args:
        counts (list[int]): each rank's number of rows.
        device (torch.device): where ``indices`` goes.
        n (int, optional): the rows are DistributedSampler's interleave of ``n`` samples (:func:`interleave_size`).
        blocks (Sequence[Tensor]): otherwise, each rank's sample indices (int64, ``counts[r]`` each).

    Raises:
        ValueError: a rank holds the same sample index twice (named).
    """

    def __init__(self, counts: list[int], device: torch.device, n: int | None, blocks: Sequence[Tensor] = ()) -> None:
        self.counts, self.rows, self.interleave = counts, None, n is not None
        if n is not None:
            self.indices = torch.arange(n, device=device)
            return
        ordered, order = torch.sort(torch.cat(list(blocks)).cpu(), stable=True)  # copies of an index stay in rank order
        first = torch.ones_like(ordered, dtype=torch.bool)
        first[1:] = ordered[1:] != ordered[:-1]
        ends = torch.tensor(counts).cumsum(0)  # a copy and the one before it on the same rank: a repeat
        rank_of = [torch.bucketize(order[i : order.numel() - 1 + i][~first[1:]], ends, right=True) for i in (0, 1)]
        repeats = sorted(set(rank_of[1][rank_of[0] == rank_of[1]].tolist()))
        if repeats:
            raise ValueError(
                "Cannot gather the evaluation outputs: "
                + "; ".join(f"rank {r}: `indices` holds the same sample index twice on one rank" for r in repeats)
            )
        self.rows, self.indices = order[first], ordered[first].to(device)

    def take(self, blocks: list[Tensor]) -> Tensor:
        """The kept rows of a tensor field, from each rank's rows ``blocks[r]`` (``counts[r]`` rows each)."""
        if self.interleave:  # one copy into the interleaved order (as fast as a plain cat), then its first n rows
            return torch.cat([block.unsqueeze(1) for block in blocks], dim=1).flatten(0, 1)[: self.indices.numel()]
        rows = torch.cat(blocks)
        return rows.index_select(0, self._rows().to(rows.device))  # copies whole rows: 2-7x faster than rows[keep]

    def positions(self) -> list[int]:
        """Rank-major positions of the kept rows: list fields are concatenated over ranks."""
        return self._rows().tolist()

    def _rows(self) -> Tensor:
        if self.rows is None:  # the interleave: sample i is row i // W of rank i % W
            grid = torch.arange(sum(self.counts)).view(len(self.counts), -1)
            self.rows = grid.t().reshape(-1)[: self.indices.numel()]
        return self.rows
