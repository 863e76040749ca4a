"""Moving a micro-batch between partitions: on CUDA through a copy stream per device, so copies overlap compute."""

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
    value: Any, device: torch.device, streams: CopyStreams, source: torch.cuda.Stream | None = None
) -> Any:
    """Move the tensors of ``value`` to ``device``, autograd-aware, for use on ``device``'s current stream.

    ``source`` is the stream that made them (the previous partition's compute stream; ``None``: the current stream of
    their device). Between two CUDA devices the copy runs with both devices' copy streams current (``streams``): the
    source's copy stream waits for ``source``, the copy runs there (torch orders it with the destination's copy
    stream), and the current stream of ``device`` waits for the destination's copy stream, so copies overlap compute
    on both devices. From the host, the copy runs on the destination's copy stream; to the host, after ``source``.
    Every tensor is recorded on the streams that use it, so the caching allocator does not reuse its memory early;
    the copy's backward runs on the same streams (autograd's stream semantics). A tensor already on ``device`` is not
    copied, but when another stream of that device made it (another partition on the same GPU), the current stream
    waits for that one and the tensor is recorded on it.

    Source: ``copy.py`` of torchgpipe (Lee et al., 2020), which enters both copy streams.
    """
    destination = streams.get(device)

    def wait_for_source(tensor: Tensor, stream: torch.cuda.Stream) -> None:
        stream.wait_stream(source if source is not None else torch.cuda.current_stream(tensor.device))

    if destination is None:  # to the host (or another non-CUDA device): after the producing stream, synchronously

        def to_host(tensor: Tensor) -> Tensor:
            if tensor.device.type == "cuda" and tensor.device != device:
                wait_for_source(tensor, torch.cuda.current_stream(tensor.device))
            return tensor.to(device)

        return apply_to_collection(value, Tensor, to_host)
    compute = torch.cuda.current_stream(device)

    def move(tensor: Tensor) -> Tensor:
        if tensor.device == device:
            if source is not None and source != compute:
                compute.wait_stream(source)
                tensor.record_stream(compute)
            return tensor
        if tensor.device.type == "cuda":
            origin = streams.get(tensor.device)
            assert origin is not None
            wait_for_source(tensor, origin)
            with torch.cuda.stream(origin), torch.cuda.stream(destination):
                moved = tensor.to(device, non_blocking=True)
            tensor.record_stream(origin)
        else:
            with torch.cuda.stream(destination):
                moved = tensor.to(device, non_blocking=True)
        compute.wait_stream(destination)
        moved.record_stream(compute)
        return moved

    return apply_to_collection(value, Tensor, move)
