"""Moving a micro-batch between partitions: on CUDA on a copy stream per device, so copies overlap compute."""

from __future__ import annotations

from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor

__all__ = ["CopyStreams", "copy_to_device"]


class CopyStreams:
    """One CUDA copy stream per destination device, made on first use; nothing on other devices."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def get(self, device: torch.device) -> torch.cuda.Stream | None:
        """The copy stream into ``device``, or ``None`` when ``device`` is not a CUDA device."""
        if device.type != "cuda":
            return None
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        return self._streams[device]


def copy_to_device(
    value: Any, device: torch.device, stream: torch.cuda.Stream | None, source: torch.cuda.Stream | None = None
) -> Any:
    """Move the tensors of ``value`` to ``device``, autograd-aware, for use on ``device``'s current stream.

    With a CUDA copy ``stream`` (on ``device``), the copy waits for the producer's stream (``source``, else the current
    stream of the tensor's device), runs on ``stream``, and the current stream of ``device`` waits for it; both tensors
    are recorded on the streams that use them, so the caching allocator does not reuse their memory early. The copy's
    backward runs on the same stream (autograd's stream semantics). A tensor already on ``device`` is not copied, but
    when it was made on another stream of that device (``source``: another partition on the same GPU), the current
    stream waits for that one and the tensor is recorded on it.

    Source: the copy streams of torchgpipe (Lee et al., 2020).
    """
    if stream is None:
        return apply_to_collection(value, Tensor, lambda t: t.to(device))
    compute = torch.cuda.current_stream(device)

    def move(tensor: Tensor) -> Tensor:
        if tensor.device == device:
            if source is not None and source != compute:
                compute.wait_stream(source)
                tensor.record_stream(compute)
            return tensor
        if tensor.device.type == "cuda":
            stream.wait_stream(source if source is not None else torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            moved = tensor.to(device, non_blocking=True)
        if tensor.device.type == "cuda":
            tensor.record_stream(stream)
        compute.wait_stream(stream)
        moved.record_stream(compute)
        return moved

    return apply_to_collection(value, Tensor, move)
