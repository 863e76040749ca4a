"""The share engine's step exchange: each rank's counts, time, memory and batch digest, then the logged values.

One float64 buffer (:class:`~lightning_balanced.ranks.exchange.ExchangeLayout`), summed over the ranks in one
all_reduce (or carried in DDP's gradient all-reduce): every rank fills its own slot of each per-rank field (the others'
stay 0) and the values it logged, weighted.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import Tensor

from lightning_balanced.ranks.exchange import ExchangeLayout

__all__ = ["PER_RANK_FIELDS", "ExchangeReading", "share_exchange_layout"]

#: The per-rank fields of the step exchange, in buffer order.
PER_RANK_FIELDS = ("samples", "seconds", "peak_bytes", "batch_digest", "micro_batch_cap")


def share_exchange_layout(world_size: int, values: int) -> ExchangeLayout:
    """The step exchange of ``world_size`` ranks with ``values`` combined logged values after the per-rank fields."""
    return ExchangeLayout(dict.fromkeys(PER_RANK_FIELDS, world_size), extra=values)


@dataclass(frozen=True)
class ExchangeReading:
    """An exchanged buffer, read from the device at once (one ``tolist``): the per-rank lists.

    Attributes:
        samples (list[int]): each rank's samples in the step.
        seconds (list[float]): each rank's time of its last timed step, in seconds (0.0 where none was sent).
        peak_bytes (list[int | None]): each rank's peak memory of that step, in bytes (``None``: not measured).
        batch_digest (list[int]): each rank's digest of the global batch's sample indices (the same on every rank when
            the ranks walk the same global order).
        micro_batch_cap (list[int | None]): each rank's measured ``max_micro_batch="auto"`` cap (``None``: none).
    """

    samples: list[int]
    seconds: list[float]
    peak_bytes: list[int | None]
    batch_digest: list[int]
    micro_batch_cap: list[int | None]

    @classmethod
    def of(cls, layout: ExchangeLayout, buffer: Tensor) -> ExchangeReading:
        """The per-rank fields of an exchanged ``buffer``, in one read from its device (a host sync on CUDA)."""
        fields = layout.unpack(buffer[: layout.size].tolist())
        return cls(
            samples=[int(c) for c in fields["samples"]],
            seconds=[float(s) for s in fields["seconds"]],
            peak_bytes=[None if b < 0 else int(b) for b in fields["peak_bytes"]],
            batch_digest=[int(d) for d in fields["batch_digest"]],
            micro_batch_cap=[int(c) or None for c in fields["micro_batch_cap"]],
        )
