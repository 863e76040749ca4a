"""Each rank's share of a global batch: the batch sampler and the DataLoader of ``balanced_ddp``.

Every rank walks the same global order (one sampler over the whole dataset, seeded alike on every rank), cuts it into
the same global batches, asks the same split policy for the same plan, and keeps its own slice: rank ``r`` of a
global batch planned ``chunk_sizes`` takes the ``chunk_sizes[r]`` samples after the first ``sum(chunk_sizes[:r])``.
The global batches, hence each optimizer step, do not depend on the number of ranks.
"""

from __future__ import annotations

import functools
import itertools
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, IterableDataset, RandomSampler, Sampler

from lightning_balanced.split_policies.split_policy import SplitPolicy

__all__ = ["RankShare", "ShareBatchSampler", "share_batch_sampler", "share_loader"]

_SEQUENCE = itertools.count()  # orders the shares of every sampler: a step takes the oldest one pending


@dataclass(frozen=True)
class RankShare:
    """One rank's part of one global batch.

    Attributes:
        global_size (int): samples in the global batch, ``B``.
        chunk_sizes (list[int]): the plan: samples per rank, summing to ``global_size``.
        indices (list[int]): this rank's sample indices (``chunk_sizes[rank]`` of them; ``[]`` for a zero share).
        sequence (int): when the share was cut, across all samplers of the process (the oldest is stepped first).
        digest (int): a digest of the global batch's sample indices, in order (:func:`batch_digest`): the same on every
            rank when the ranks walk the same global order.
    """

    global_size: int
    chunk_sizes: list[int]
    indices: list[int]
    sequence: int
    digest: int = 0


def batch_digest(indices: Sequence[int]) -> int:
    """A digest of a global batch's sample indices, order included, below ``2**52`` (exact in a float64 exchange)."""
    digest = len(indices)
    for index in indices:
        digest = (digest * 1_000_003 + int(index) + 1) % 4_503_599_627_370_449  # a prime below 2**52
    return digest


class ShareBatchSampler(Sampler[list[int]]):
    """This rank's index lists from the global batches of ``batch_sampler``, split by ``split``.

    A zero share yields the global batch's first index, so that the DataLoader can collate a batch of the right
    structure; the strategy cuts it to 0 samples (:attr:`RankShare.indices` is ``[]``). Each yielded list's
    :class:`RankShare` waits in :attr:`pending` until the step that runs it takes it (:meth:`take`); a new iteration
    drops what an abandoned one left.

    Args:
        batch_sampler (Iterable[Sequence[int]]): the global batches, the same on every rank (Lightning's
            ``BatchSampler`` over ``DistributedSampler(num_replicas=1)``, the loader's own sampler otherwise).
        split (SplitPolicy): plans each global batch over the ranks.
        rank (int): this process's rank.
        world_size (int): the number of ranks.
    """

    def __init__(self, batch_sampler: Iterable[Sequence[int]], split: SplitPolicy, rank: int, world_size: int) -> None:
        self.batch_sampler = batch_sampler
        self.split = split
        self.rank = rank
        self.world_size = world_size
        self.pending: deque[RankShare] = deque()

    @property
    def sampler(self) -> Any:
        """The global sampler (Lightning calls its ``set_epoch`` here each epoch)."""
        return getattr(self.batch_sampler, "sampler", None)

    def __iter__(self) -> Iterator[list[int]]:
        self.pending.clear()
        for batch in self.batch_sampler:
            indices = list(batch)
            plan = self.split.plan(len(indices), self.world_size)
            start = sum(plan[: self.rank])
            mine = indices[start : start + plan[self.rank]]
            self.pending.append(RankShare(len(indices), plan, mine, next(_SEQUENCE), batch_digest(indices)))
            yield mine or indices[:1]

    def __len__(self) -> int:
        return len(self.batch_sampler)  # type: ignore[arg-type]


def share_loader(
    loader: Any,
    split: SplitPolicy,
    rank: int,
    world_size: int,
    *,
    strategy: str = "balanced_ddp",
    seed: int | None = None,
) -> DataLoader[Any]:
    """A DataLoader that yields this rank's share of each of ``loader``'s (global) batches.

    The global order is the loader's own: a ``SequentialSampler`` (``shuffle=False``) walks the dataset in order, so
    global batch ``k`` is samples ``[k * B, (k + 1) * B)``, as in one process; a sampler of the user's own (a
    ``WeightedRandomSampler``, a ``RandomSampler`` with a ``generator``, a batch sampler) is walked as it is, on every
    rank, so it must give the same order on every rank (seeded alike). A ``RandomSampler`` without a ``generator``
    (``shuffle=True``) would shuffle each rank alone: with ``seed`` it becomes Lightning's ``DistributedSampler`` over
    one replica, shuffled with that seed and reshuffled each epoch (``set_epoch``), the order Lightning's DDP walks on
    one process; without (``use_distributed_sampler=False``) it is refused.

    The new loader keeps ``loader``'s dataset, workers, collate function and memory pinning; its batch sampler is a
    :class:`ShareBatchSampler` over ``loader``'s (inside Lightning's index tracking when ``loader``'s was: a
    ``BasePredictionWriter`` gets this rank's sample indices of each share). Its ``sampler`` is the global one
    (Lightning's ``DistributedSampler`` over one replica, or the loader's own): the order every rank walks, of the
    whole dataset, not this rank's samples. A ``DataLoader`` subclass comes back as a plain ``DataLoader``.

    Raises:
        ValueError: ``loader`` is not a ``torch.utils.data.DataLoader``; its dataset is an ``IterableDataset`` (no
            sample indices to split by); it has no batch sampler (``batch_size=None``); or its sampler gives each rank
            its own order (a ``RandomSampler`` without a ``generator``, a ``DistributedSampler`` over several
            replicas: Lightning's ``use_distributed_sampler=False`` kept the user's).
    """
    if not isinstance(loader, DataLoader):
        raise ValueError(
            f"strategy={strategy!r} splits each batch of a torch DataLoader over the ranks; got a"
            f" {type(loader).__name__}: return a `torch.utils.data.DataLoader` from the `*_dataloader` hooks"
        )
    if isinstance(loader.dataset, IterableDataset):
        raise ValueError(
            f"strategy={strategy!r} splits each global batch by sample index, which an IterableDataset"
            f" ({type(loader.dataset).__name__}) does not have: use a map-style Dataset (with `__getitem__` and"
            " `__len__`), or strategy='ddp' with a dataset that shards itself"
        )
    if loader.batch_sampler is None:
        raise ValueError(
            f"strategy={strategy!r} splits the DataLoader's batches, but it has none (`batch_size=None`): give it a"
            " `batch_size`, the global batch size"
        )
    sampler = loader.sampler
    global_batches: Iterable[Sequence[int]] = loader.batch_sampler
    unseeded = isinstance(sampler, RandomSampler) and sampler.generator is None and not sampler.replacement
    if unseeded and seed is not None and type(loader.batch_sampler) is BatchSampler:
        shuffled: DistributedSampler[Any] = DistributedSampler(
            loader.dataset, num_replicas=1, rank=0, shuffle=True, seed=seed
        )
        global_batches = BatchSampler(shuffled, loader.batch_sampler.batch_size, loader.batch_sampler.drop_last)
    elif (isinstance(sampler, RandomSampler) and sampler.generator is None) or (
        isinstance(sampler, DistributedSampler) and sampler.num_replicas > 1
    ):
        raise ValueError(
            f"strategy={strategy!r} needs the same global sample order on every rank, but the DataLoader's"
            f" {type(sampler).__name__} gives each rank its own (`use_distributed_sampler=False` keeps it): leave"
            " `use_distributed_sampler=True` (every rank then shuffles alike, seeded as Lightning seeds DDP), or give"
            " the sampler a `generator` seeded alike on every rank"
        )
    options: dict[str, Any] = {
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
    }
    if loader.num_workers > 0:
        options["prefetch_factor"] = loader.prefetch_factor
    if getattr(loader, "pin_memory_device", ""):
        options["pin_memory_device"] = loader.pin_memory_device
    shares = ShareBatchSampler(global_batches, split, rank, world_size)
    batch_sampler: Iterable[list[int]] = shares
    if type(loader.batch_sampler).__name__ == "_IndexBatchSamplerWrapper":  # Lightning's, for prediction writers
        batch_sampler = _index_tracking(type(loader.batch_sampler))(shares)  # type: ignore[arg-type]
    shared = DataLoader(loader.dataset, batch_sampler=batch_sampler, **options)
    if shares.sampler is not None:
        # `loader.sampler` is where users and Lightning's own tests look for the DistributedSampler; a DataLoader built
        # from a batch sampler would say SequentialSampler (its placeholder, never iterated: the batch sampler's is).
        object.__setattr__(shared, "sampler", shares.sampler)
    return shared


def share_batch_sampler(loader: Any) -> ShareBatchSampler | None:
    """The :class:`ShareBatchSampler` of a DataLoader made by :func:`share_loader` (``None`` for any other)."""
    batch_sampler = getattr(loader, "batch_sampler", None)
    batch_sampler = getattr(batch_sampler, "_batch_sampler", batch_sampler)  # inside the index tracking
    return batch_sampler if isinstance(batch_sampler, ShareBatchSampler) else None


@functools.cache
def _index_tracking(wrapper: type) -> type:
    """Lightning's ``_IndexBatchSamplerWrapper`` (of ``lightning.pytorch`` or ``pytorch_lightning``) over shares.

    The prediction loop hands a ``BasePredictionWriter`` the indices its batch sampler yielded. A share records the
    rank's own sample indices instead: ``[]`` for a zero share, whose batch is cut to no samples after the loader
    collated one for the structure.
    """

    class ShareIndexBatchSamplerWrapper(wrapper):  # type: ignore[misc]
        def __next__(self) -> list[int]:
            batch: list[int] = next(self._iterator)
            self.seen_batch_indices.append(list(self._batch_sampler.pending[-1].indices))
            return batch

    return ShareIndexBatchSamplerWrapper
