"""Split any Lightning batch into per-device chunks along dim 0, keeping autograd."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.nn.parallel._functions import Scatter

from lightning_balanced.data_parallel.virtual_device import on_device

__all__ = ["infer_batch_size", "scatter"]


def _batched_tensors(batch: Any) -> list[Tensor]:
    found: list[Tensor] = []
    apply_to_collection(batch, Tensor, lambda t: found.append(t) if t.dim() > 0 else None)
    return found


def infer_batch_size(batch: Any) -> int:
    """Return the size of dim 0 shared by every tensor with at least one dimension in ``batch``.

    Args:
        batch: a tensor or any nesting of tuples, lists, dicts, namedtuples and dataclasses around tensors. 0-dim
            tensors and non-tensor leaves carry no batch dimension and are ignored.

    Returns:
        int: the batch size.

    Raises:
        ValueError: the batch holds no tensor with a batch dimension, or its tensors disagree on the size of dim 0.
    """
    tensors = _batched_tensors(batch)
    if not tensors:
        raise ValueError(
            f"Cannot split a batch that holds no tensor with a batch dimension (dim 0); got {type(batch).__name__}"
        )
    sizes = sorted({t.shape[0] for t in tensors})
    if len(sizes) > 1:
        shapes = ", ".join(str(tuple(t.shape)) for t in tensors)
        raise ValueError(
            f"The tensors of the batch disagree on the batch dimension (dim 0): sizes {sizes} in shapes {shapes}."
            " Every tensor in the batch is split along dim 0; put per-batch constants in a 0-dim tensor or a"
            " non-tensor leaf, which are replicated to every device."
        )
    return int(sizes[0])


def _split(tensor: Tensor, chunk_sizes: Sequence[int], devices: Sequence[torch.device]) -> tuple[Tensor, ...]:
    if len(devices) == 1:
        return (on_device(tensor, devices[0]),)
    if devices[0].type == "cuda":
        # torch's comm.scatter: copies straight from the source (host or GPU 0) to each device, on side streams.
        indices = [d.index for d in devices]
        return tuple(Scatter.apply(indices, list(chunk_sizes), 0, tensor))
    return tuple(
        on_device(chunk, device) for chunk, device in zip(torch.split(tensor, list(chunk_sizes)), devices, strict=True)
    )


def scatter(batch: Any, chunk_sizes: Sequence[int], devices: Sequence[torch.device]) -> list[Any]:
    """Split ``batch`` into ``len(devices)`` batches of ``chunk_sizes[i]`` samples along dim 0.

    The chunks are contiguous and in order: device 0 gets the first ``chunk_sizes[0]`` samples, and so on, so
    concatenating per-device results in device order restores the batch order. The split is autograd-aware.

    Args:
        batch: a tensor or any nesting of tuples, lists, dicts, namedtuples and dataclasses. Tensors with a batch
            dimension are split; 0-dim tensors and non-tensor leaves (such as ``batch_idx``) are given to every device
            as they are.
        chunk_sizes (Sequence[int]): non-negative sizes, one per device, summing to the batch size (a ``0`` gives that
            device empty tensors; a batch of 0 samples goes to one device as ``[0]``).
        devices (Sequence[torch.device]): the target devices; on CUDA torch's ``Scatter`` moves each chunk to its GPU
            (from host or device memory). Elsewhere the chunks stay views on the batch's memory; on a virtual device
            (``cpu:i``, see :mod:`~lightning_balanced.data_parallel.virtual_device`) they carry its identity.

    Returns:
        list: one batch per device, each with the structure of ``batch``.

    Raises:
        ValueError: the lengths disagree, a size is negative, or the sizes do not sum to the batch size.
    """
    if len(chunk_sizes) != len(devices):
        raise ValueError(f"`chunk_sizes` has {len(chunk_sizes)} entries but there are {len(devices)} devices")
    if not devices:
        raise ValueError("`devices` must name at least one device")
    if any(size < 0 for size in chunk_sizes):
        raise ValueError(f"`chunk_sizes` must be non-negative, got {list(chunk_sizes)}")
    total = sum(chunk_sizes)

    chunks: dict[int, tuple[Tensor, ...]] = {}

    def split_once(tensor: Tensor) -> Tensor:
        if tensor.dim() > 0 and id(tensor) not in chunks:
            if tensor.shape[0] != total:
                raise ValueError(
                    f"A tensor of shape {tuple(tensor.shape)} has {tensor.shape[0]} samples in dim 0, but"
                    f" `chunk_sizes` {list(chunk_sizes)} sum to {total}; every tensor of the batch must share dim 0"
                )
            chunks[id(tensor)] = _split(tensor, chunk_sizes, devices)
        return tensor

    apply_to_collection(batch, Tensor, split_once)  # one walk: checks dim 0 and splits
    if not chunks:
        raise ValueError(
            f"Cannot split a batch that holds no tensor with a batch dimension (dim 0); got {type(batch).__name__}"
        )

    def pick(i: int) -> Any:
        def leaf(tensor: Tensor) -> Tensor:
            if tensor.dim() == 0:
                return on_device(tensor, devices[i])
            return chunks[id(tensor)][i]

        return apply_to_collection(batch, Tensor, leaf)

    return [pick(i) for i in range(len(devices))]
