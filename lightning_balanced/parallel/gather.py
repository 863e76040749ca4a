"""Bring the replicas' outputs back to one device: per-sample tensors concatenated, per-replica scalars combined."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor
from torch.nn.parallel._functions import Gather

__all__ = ["gather"]


def _is_namedtuple(obj: object) -> bool:
    return isinstance(obj, tuple) and hasattr(obj, "_fields")


def _gather_tensors(tensors: Sequence[Tensor], target_device: torch.device, weights: Sequence[float]) -> Tensor:
    if all(t.dim() == 0 for t in tensors):
        # A per-replica scalar (the loss, a logged mean): the weighted sum, autograd-aware, on the target device.
        return torch.stack([t.to(target_device) * w for t, w in zip(tensors, weights, strict=True)]).sum()
    if any(t.dim() == 0 for t in tensors):
        raise ValueError(
            f"Cannot gather a step output that is a scalar on some replicas and not on others: shapes"
            f" {[tuple(t.shape) for t in tensors]}"
        )
    if target_device.type == "cuda" and all(t.device.type == "cuda" for t in tensors):
        return Gather.apply(target_device, 0, *tensors)  # type: ignore[no-any-return]
    return torch.cat([t.to(target_device) for t in tensors])


def gather(outputs: Sequence[Any], target_device: torch.device, weights: Sequence[float]) -> Any:
    """Combine the step outputs of the replicas, which ran on consecutive chunks of one batch, on ``target_device``.

    Walks the outputs' common structure (dicts, lists, tuples, namedtuples, dataclasses):

    - tensors with a batch dimension are concatenated along dim 0, in replica order, which is batch order;
    - 0-dim tensors (per-replica scalars such as the loss) become ``sum(weights[i] * t_i)``; with
      ``weights[i] = chunk_sizes[i] / batch_size`` a per-chunk mean becomes the mean over the whole batch;
    - ``None`` stays ``None``; other leaves that are equal on every replica are kept once, otherwise they become the
      list of per-replica values.

    The combination is autograd-aware (torch's ``Gather`` on CUDA, ``cat``/``stack`` elsewhere).

    Args:
        outputs (Sequence): one output per replica, all with the same structure.
        target_device (torch.device): where the result lives.
        weights (Sequence[float]): one weight per replica for the 0-dim tensors.

    Returns:
        The gathered output, with the structure of ``outputs[0]``.

    Raises:
        ValueError: the replicas returned different structures (keys, lengths, types) or a leaf that is a scalar on
            some replicas only.
    """
    first = outputs[0]
    if isinstance(first, Tensor):
        if not all(isinstance(o, Tensor) for o in outputs):
            raise ValueError(f"Replicas returned different types: {[type(o).__name__ for o in outputs]}")
        return _gather_tensors(outputs, target_device, weights)
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
        return mapping_type((k, gather([o[k] for o in outputs], target_device, weights)) for k in keys)
    if isinstance(first, (list, tuple)):
        if any(type(o) is not type(first) or len(o) != len(first) for o in outputs):
            raise ValueError(
                "Replicas returned sequences of different types or lengths; a per-sample sequence must be"
                " a tensor to be gathered"
            )
        items = [gather(list(column), target_device, weights) for column in zip(*outputs, strict=True)]
        return type(first)(*items) if _is_namedtuple(first) else type(first)(items)
    if dataclasses.is_dataclass(first) and not isinstance(first, type):
        if any(type(o) is not type(first) for o in outputs):
            raise ValueError(f"Replicas returned different types: {[type(o).__name__ for o in outputs]}")
        fields = {
            f.name: gather([getattr(o, f.name) for o in outputs], target_device, weights)
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
