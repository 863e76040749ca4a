"""The clock-cycle schedule of a pipeline: which (micro-batch, partition) pairs run at the same time."""

from __future__ import annotations

from collections.abc import Iterator

__all__ = ["clock_cycles"]


def clock_cycles(num_micro_batches: int, num_partitions: int) -> Iterator[list[tuple[int, int]]]:
    """Yield, cycle by cycle, the ``(micro_batch, partition)`` pairs that run concurrently.

    Micro-batch ``i`` runs on partition ``j`` at cycle ``i + j``, so there are ``m + n - 1`` cycles for ``m``
    micro-batches and ``n`` partitions, and within one cycle every pair is on a different partition. Example for
    ``m = 3, n = 2``: ``[(0, 0)]``, ``[(1, 0), (0, 1)]``, ``[(2, 0), (1, 1)]``, ``[(2, 1)]``.

    Args:
        num_micro_batches (int): ``m`` >= 1.
        num_partitions (int): ``n`` >= 1.

    Yields:
        list[tuple[int, int]]: the pairs of one cycle, by increasing partition.

    Raises:
        ValueError: ``m`` or ``n`` below 1.

    Source: the clock-cycle schedule of GPipe (Huang et al., 2019) as described by torchgpipe (Lee et al., 2020).
    """
    if num_micro_batches < 1:
        raise ValueError(f"`num_micro_batches` must be at least 1, got {num_micro_batches}")
    if num_partitions < 1:
        raise ValueError(f"`num_partitions` must be at least 1, got {num_partitions}")
    for cycle in range(num_micro_batches + num_partitions - 1):
        first = max(0, cycle - num_partitions + 1)
        last = min(cycle, num_micro_batches - 1)
        yield [(i, cycle - i) for i in range(last, first - 1, -1)]
