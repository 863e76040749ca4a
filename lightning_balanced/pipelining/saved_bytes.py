"""The bytes autograd holds for backward: how much activation memory a pipeline schedule keeps in flight.

:class:`SavedTensorBytes` is a ``torch.autograd.graph.saved_tensors_hooks`` context that counts each storage a
forward pass saves for backward once, from the moment it is saved until autograd frees it (after its backward, or with
its graph), and keeps the peak. Parameters and the tensors given as ``exclude`` are not counted: they live anyway.
It measures what a schedule changes, the activations in flight, on any device, without an allocator's rounding
or caching; the benchmark of the pipeline schedules and their tests read it.

Source: ``torch.autograd.graph.saved_tensors_hooks`` (PyTorch's "Hooks for saved tensors" note).
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Iterable
from types import TracebackType
from typing import Any

import torch
from torch import Tensor, nn

__all__ = ["SavedTensorBytes"]


class _Saved:
    """What autograd holds instead of the tensor while the meter is on: the tensor, and a finalizer that counts it."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: Tensor) -> None:
        self.tensor = tensor


class SavedTensorBytes:
    """Counts the bytes saved for backward while the context is open (peak and current), one count per storage.

    Args:
        exclude (Iterable[Tensor]): tensors whose storages are never counted (a module's parameters and buffers).

    Attributes:
        current (int): bytes saved for backward and not yet freed, in bytes.
        peak (int): the most ``current`` has been since the context opened (or :meth:`reset_peak`), in bytes.

    Example::

        meter = SavedTensorBytes(exclude=model.parameters())
        with meter:
            model(x).sum().backward()
        meter.peak  # the activations the forward pass kept for backward
    """

    def __init__(self, exclude: Iterable[Tensor] = ()) -> None:
        self._excluded = {tensor.untyped_storage().data_ptr() for tensor in exclude}
        self._holders: Counter[int] = Counter()
        self.current = 0
        self.peak = 0
        self._hooks: Any = None

    def reset_peak(self) -> None:
        """Start the peak again from what is held now."""
        self.peak = self.current

    def _pack(self, tensor: Tensor) -> Any:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer == 0 or pointer in self._excluded or isinstance(tensor, nn.Parameter):
            return tensor
        if self._holders[pointer] == 0:
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        self._holders[pointer] += 1
        saved = _Saved(tensor)
        weakref.finalize(saved, self._release, pointer, storage.nbytes())
        return saved

    def _release(self, pointer: int, nbytes: int) -> None:
        self._holders[pointer] -= 1
        if self._holders[pointer] == 0:
            del self._holders[pointer]
            self.current -= nbytes

    @staticmethod
    def _unpack(packed: Any) -> Tensor:
        return packed.tensor if isinstance(packed, _Saved) else packed

    def __enter__(self) -> SavedTensorBytes:
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
        self._hooks.__enter__()
        return self

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, traceback: TracebackType | None
    ) -> None:
        self._hooks.__exit__(kind, error, traceback)
        self._hooks = None
