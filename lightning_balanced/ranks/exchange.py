"""A buffer the ranks exchange in one all_reduce (``SUM``), described once by named fields.

Each rank writes its own slots of the fields (the others' stay 0), so after the sum every rank holds every rank's
values; a field of one slot sums what the ranks put there. Fields are read and written by name, never by an offset
computed at two ends. The share engine's step exchange (``balanced_ddp``, ``balanced_fsdp``) and the pipeline's step
report (``pipeline``) are such buffers.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ExchangeLayout"]


class ExchangeLayout:
    """Named fields of ``float64`` slots, in order, then ``extra`` slots of the caller's own (values, gradients).

    Args:
        fields (dict[str, int]): each field's name and number of slots (``world_size`` for a per-rank field), in
            buffer order.
        extra (int): slots after the fields, for data laid out by the caller (:meth:`extra`).

    Example::

        layout = ExchangeLayout({"samples": world_size, "loss": 1})
        buffer = layout.new_buffer(device)
        layout.set(buffer, "samples", rank, 8)
        dist.all_reduce(buffer)
        layout.unpack(buffer[: layout.size].tolist())["samples"]  # every rank's
    """

    def __init__(self, fields: dict[str, int], extra: int = 0) -> None:
        self._slices: dict[str, slice] = {}
        start = 0
        for name, slots in fields.items():
            self._slices[name] = slice(start, start + slots)
            start += slots
        self.size = start
        self.extra_slots = extra

    def new_buffer(self, device: torch.device) -> Tensor:
        """A zero buffer (float64) of the whole layout on ``device``."""
        return torch.zeros(self.size + self.extra_slots, dtype=torch.float64, device=device)

    def field(self, buffer: Tensor, name: str) -> Tensor:
        """Field ``name`` of ``buffer`` (a view)."""
        return buffer[self._slices[name]]

    def set(self, buffer: Tensor, name: str, index: int, value: float | Tensor) -> None:
        """Write slot ``index`` of field ``name`` (the rank's own, or 0 for a field of one slot)."""
        buffer[self._slices[name].start + index] = value

    def extra(self, buffer: Tensor) -> Tensor:
        """The slots after the fields (a view)."""
        return buffer[self.size :]

    def unpack(self, head: list[float]) -> dict[str, list[float]]:
        """The fields of ``head``, the buffer's first :attr:`size` slots read to the host (one ``tolist``)."""
        return {name: head[part] for name, part in self._slices.items()}
