"""A step's exchange between the ranks: one float64 buffer of named per-rank fields and the step's logged values.

Every rank fills its own slot of each per-rank field (the others' stay 0) and the values it logged, weighted; one
all_reduce (``SUM``) of the buffer then gives every rank every rank's fields and the combined values. The layout is
described once, here: the fields are read and written by name, never by a hand-computed offset.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
from torch import Tensor

__all__ = ["ExchangeLayout", "ExchangeReading"]


@dataclass(frozen=True)
class ExchangeReading:
    """An exchanged buffer, read from the device at once (one ``tolist``): per-rank lists and the combined values.

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


@dataclass(frozen=True)
class ExchangeLayout:
    """Where each field lies in a step's buffer: ``len(FIELDS)`` per-rank fields of ``world_size`` slots, then values.

    Args:
        world_size (int): the number of ranks.
        values (int): the number of combined logged values that follow the per-rank fields.
    """

    #: The per-rank fields, in buffer order.
    FIELDS: ClassVar[tuple[str, ...]] = ("samples", "seconds", "peak_bytes", "batch_digest", "micro_batch_cap")

    world_size: int
    values: int

    def new_buffer(self, device: torch.device) -> Tensor:
        """A zero buffer (float64) of the whole layout on ``device``."""
        return torch.zeros(len(self.FIELDS) * self.world_size + self.values, dtype=torch.float64, device=device)

    def set(self, buffer: Tensor, field: str, rank: int, value: float) -> None:
        """Write ``rank``'s slot of ``field``."""
        buffer[self.FIELDS.index(field) * self.world_size + rank] = value

    def value_slots(self, buffer: Tensor) -> Tensor:
        """The combined logged values (a view of ``buffer``)."""
        return buffer[len(self.FIELDS) * self.world_size :]

    def read(self, buffer: Tensor) -> ExchangeReading:
        """The per-rank fields of an exchanged ``buffer``, in one read from its device (a host sync on CUDA)."""
        head = buffer[: len(self.FIELDS) * self.world_size].tolist()
        fields = {name: head[k * self.world_size : (k + 1) * self.world_size] for k, name in enumerate(self.FIELDS)}
        return ExchangeReading(
            samples=[int(c) for c in fields["samples"]],
            seconds=[float(s) for s in fields["seconds"]],
            peak_bytes=[None if b < 0 else int(b) for b in fields["peak_bytes"]],
            batch_digest=[int(d) for d in fields["batch_digest"]],
            micro_batch_cap=[int(c) or None for c in fields["micro_batch_cap"]],
        )
