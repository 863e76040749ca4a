"""Bring the replicas' outputs back to one device so that they equal what one device returns for the whole batch."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import torch
from lightning_utilities.core.apply_func import apply_to_collection
from torch import Tensor
from torch.nn.parallel._functions import Gather

__all__ = ["chunk_weights", "gather"]


def _is_namedtuple(obj: object) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def _combine_scalars(tensors: Sequence[Tensor], target_device: torch.device, weights: Sequence[float]) -> Tensor:
    moved = [t.to(target_device) for t in tensors]
    dtype = moved[0].dtype
    if dtype == torch.bool:  # a flag per chunk: set for the batch when set for any chunk (the sum, kept in bool)
        return torch.stack(moved).any()
    if not (dtype.is_floating_point or dtype.is_complex):  # a count per chunk: the batch's count is the sum
        return torch.stack(moved).sum(dtype=dtype)
    # A per-chunk mean (the loss, a metric) weighted by the chunk's share: the batch mean; or the sum for "sum".
    return torch.stack([t * w for t, w in zip(moved, weights, strict=True)]).sum()


def _gather_tensors(tensors: Sequence[Tensor], target_device: torch.device, weights: Sequence[float]) -> Tensor:
    if all(t.dim() == 0 for t in tensors):
        return _combine_scalars(tensors, target_device, weights)
    if any(t.dim() == 0 for t in tensors):
        raise ValueError(
            f"Cannot gather a step output that is a scalar on some replicas and not on others: shapes"
            f" {[tuple(t.shape) for t in tensors]}"
        )
    if target_device.type == "cuda" and all(t.device.type == "cuda" for t in tensors):
        return Gather.apply(target_device, 0, *tensors)  # type: ignore[no-any-return]
    return torch.cat([t.to(target_device) for t in tensors])


def _is_per_sample_list(outputs: Sequence[Any], chunk_sizes: Sequence[int]) -> bool:
    """A ``list`` with one item per sample of its replica's chunk, and not a list of batched tensors."""
    if not all(type(o) is list and len(o) == size for o, size in zip(outputs, chunk_sizes, strict=True)):
        return False
    batched = all(
        isinstance(item, Tensor) and item.dim() > 0 and item.shape[0] == size
        for o, size in zip(outputs, chunk_sizes, strict=True)
        for item in o
    )
    return not batched or not any(outputs)


def share_weight(samples: int, total: int, loss_reduction: Literal["mean", "sum"] = "mean") -> float:
    """The weight of the loss of ``samples`` of a batch of ``total`` in the batch's loss.

    ``"mean"`` (the loss is a mean over the samples): ``samples / total``, so the weighted sum of the parts' losses is
    the batch mean; ``"sum"``, or a batch of 0 samples: ``1``. ``balanced_dp`` weights each replica's loss by it;
    ``balanced_ddp`` and ``balanced_fsdp`` each rank's, times ``world_size`` (their reduction averages the ranks).
    """
    return samples / total if loss_reduction == "mean" and total > 0 else 1.0


def chunk_weights(chunk_sizes: Sequence[int], loss_reduction: Literal["mean", "sum"] = "mean") -> list[float]:
    """The weight of each replica's 0-dim floating output (its loss) in the batch's: what :func:`gather` applies.

    ``"mean"`` (each replica returns the mean over its chunk): the chunk's share of the batch, so the weighted sum is
    the batch mean; ``"sum"`` (each returns a sum), or a batch of 0 samples: ``1`` each. balanced_dp's manual
    optimization weights each replica's loss with the same numbers, so ``manual_backward`` sees the loss
    :func:`gather` returns.
    """
    total = sum(chunk_sizes)
    return [share_weight(size, total, loss_reduction) for size in chunk_sizes]


def gather(
    outputs: Sequence[Any],
    target_device: torch.device,
    chunk_sizes: Sequence[int],
    *,
    loss_reduction: Literal["mean", "sum"] = "mean",
) -> Any:
    """Combine the step outputs of the replicas, which ran on consecutive chunks of one batch, on ``target_device``.

    Walks the outputs' common structure and combines each leaf so that the result is what one device returns for the
    whole batch in the usual cases: batched tensors and per-sample lists concatenated in batch order, 0-dim floating
    tensors as the chunk-weighted mean (or sum), 0-dim integer/bool tensors summed in their dtype, containers item by
    item. The rule, with its table of output kinds, is documented once, in
    :class:`~lightning_balanced.BalancedDataParallelStrategy`.

    Every tensor is moved to ``target_device`` before it is combined (an autograd-aware ``Gather`` on CUDA, ``to`` and
    ``cat``/``stack`` elsewhere), so the result lives on ``target_device`` whatever device each replica ran on.

    Args:
        outputs (Sequence): one output per replica, all with the same structure.
        target_device (torch.device): where the result lives.
        chunk_sizes (Sequence[int]): the number of samples each replica ran on.
        loss_reduction (str): ``"mean"`` when a 0-dim floating output is a mean over the chunk, ``"sum"`` when it is
            a sum.

    Returns:
        The gathered output, with the structure of ``outputs[0]``.

    Raises:
        ValueError: ``chunk_sizes`` does not have one entry per output, or the replicas returned different structures
            (keys, lengths, types) or a leaf that is a scalar on some replicas only.

    Source: torch's ``Gather`` for tensors; per-sample lists and counts as one device would return them.
    """
    if len(chunk_sizes) != len(outputs):
        raise ValueError(f"`chunk_sizes` has {len(chunk_sizes)} entries for {len(outputs)} outputs; they must match")
    return _gather(outputs, target_device, chunk_sizes, chunk_weights(chunk_sizes, loss_reduction))


def _gather(outputs: Sequence[Any], device: torch.device, sizes: Sequence[int], weights: Sequence[float]) -> Any:
    first = outputs[0]
    if isinstance(first, Tensor):
        if not all(isinstance(o, Tensor) for o in outputs):
            raise ValueError(f"Replicas returned different types: {[type(o).__name__ for o in outputs]}")
        return _gather_tensors(outputs, device, weights)
    if first is None:
        if any(o is not None for o in outputs):
            raise ValueError("Some replicas returned None and others did not")
        return None
    if isinstance(first, Mapping):
        if not all(isinstance(o, Mapping) for o in outputs):
            raise ValueError(f"Replicas returned different types: {[type(o).__name__ for o in outputs]}")
        keys = list(first.keys())
        if any(set(o.keys()) != set(keys) for o in outputs):
            raise ValueError(f"Replicas returned dicts with different keys: {[list(o) for o in outputs]}")
        mapping_type: Any = type(first)
        return mapping_type((k, _gather([o[k] for o in outputs], device, sizes, weights)) for k in keys)
    if isinstance(first, (list, tuple)):
        if _is_per_sample_list(outputs, sizes):
            return [apply_to_collection(item, Tensor, Tensor.to, device) for o in outputs for item in o]
        if any(type(o) is not type(first) or len(o) != len(first) for o in outputs):
            raise ValueError(
                f"Replicas returned sequences of different types or lengths ({[len(o) for o in outputs]} for chunks"
                f" of {list(sizes)}): a per-sample list must have one item per sample of the chunk"
            )
        items = [_gather(list(column), device, sizes, weights) for column in zip(*outputs, strict=True)]
        return type(first)(*items) if _is_namedtuple(first) else type(first)(items)
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        if any(type(o) is not type(first) for o in outputs):
            raise ValueError(f"Replicas returned different types: {[type(o).__name__ for o in outputs]}")
        fields = {
            f.name: _gather([getattr(o, f.name) for o in outputs], device, sizes, weights)
            for f in dataclasses.fields(first)
            if f.init
        }
        return dataclasses.replace(first, **fields)
    if all(_equal(o, first) for o in outputs[1:]):
        return first
    return list(outputs)


def _equal(a: object, b: object) -> bool:
    try:
        return type(a) is type(b) and bool(a == b)
    except (TypeError, ValueError, RuntimeError):  # e.g. arrays, whose == is elementwise
        return False
