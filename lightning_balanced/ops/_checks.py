"""Argument checks of the NMS ops.

Two layers, each written once:

* :func:`check_argument_types` checks what the compiled operator's dispatcher cannot see and would only report
  as a ``RuntimeError``: that the arguments are tensors and numbers. The public wrappers and the reference call it.
* :func:`check_tensor_args`, :func:`check_idxs` and :func:`check_finite` are the pure-PyTorch copy of
  ``csrc/ops/nms_checks.h`` for the reference (the fallback when the compiled ops are missing). The compiled ops do
  these checks in C++ with the same messages, so the public wrappers never run them.
"""

from __future__ import annotations

import math
from numbers import Real

import torch
from torch import Tensor

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_argument_types(
    op: str, boxes: object, scores: object, iou_threshold: object, offset: object, idxs: object = None
) -> float:
    """Raise ``TypeError`` unless the arguments are tensors and numbers; return ``iou_threshold`` as a float.

    ``idxs`` is checked only for ``batched_nms`` (``op == "batched_nms"``).
    """
    named = [("boxes", boxes), ("scores", scores)] + ([("idxs", idxs)] if op == "batched_nms" else [])
    for name, value in named:
        if not isinstance(value, Tensor):
            raise TypeError(f"{op}: {name} must be a torch.Tensor, got {type(value).__name__}")
    if isinstance(iou_threshold, bool) or not isinstance(iou_threshold, Real):
        raise TypeError(f"{op}: iou_threshold must be a real number, got {type(iou_threshold).__name__}")
    if isinstance(offset, bool) or not isinstance(offset, int):
        raise TypeError(f"{op}: offset must be an int (0 or 1), got {type(offset).__name__}")
    return float(iou_threshold)


def check_padded_argument_types(
    boxes: object, scores: object, idxs: object, iou_threshold: object, max_output: object, offset: object
) -> float:
    """:func:`check_argument_types` for ``batched_nms_padded`` (``idxs`` may be ``None``; ``max_output`` an int)."""
    op = "batched_nms_padded"
    threshold = check_argument_types(op, boxes, scores, iou_threshold, offset)
    if idxs is not None and not isinstance(idxs, Tensor):
        raise TypeError(f"{op}: idxs must be a torch.Tensor or None, got {type(idxs).__name__}")
    if isinstance(max_output, bool) or not isinstance(max_output, int):
        raise TypeError(f"{op}: max_output must be an int, got {type(max_output).__name__}")
    return threshold


def check_padded_tensor_args(
    boxes: Tensor, scores: Tensor, idxs: Tensor | None, iou_threshold: float, max_output: int, offset: int
) -> None:
    """Shapes, dtypes, devices and numbers of ``batched_nms_padded`` (``check_padded_args`` of ``nms_checks.h``)."""
    op = "batched_nms_padded"
    if boxes.dim() != 3 or boxes.shape[2] != 4:
        raise ValueError(f"{op}: boxes must have shape (B, N, 4), got {list(boxes.shape)}")
    batch, n = boxes.shape[:2]
    if scores.shape != (batch, n):
        raise ValueError(f"{op}: scores must have shape (B, N) = ({batch}, {n}), got {list(scores.shape)}")
    _check_dtypes_and_devices(op, boxes, scores)
    if idxs is not None:
        if idxs.shape != (batch, n):
            raise ValueError(f"{op}: idxs must have shape (B, N) = ({batch}, {n}), got {list(idxs.shape)}")
        if idxs.dtype == torch.bool or idxs.dtype.is_floating_point or idxs.dtype.is_complex:
            raise TypeError(f"{op}: idxs must have an integer dtype, got {idxs.dtype}")
        if idxs.device != boxes.device:
            raise ValueError(f"{op}: idxs must be on the device of boxes ({boxes.device}), got {idxs.device}")
    _check_scalar_args(op, iou_threshold, offset)
    if max_output < 0:
        raise ValueError(f"{op}: max_output must be >= 0, got {max_output}")


def _check_dtypes_and_devices(op: str, boxes: Tensor, scores: Tensor) -> None:
    if boxes.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{op}: boxes must be float16, bfloat16, float32 or float64, got {boxes.dtype}")
    if scores.dtype != boxes.dtype:
        raise TypeError(f"{op}: scores must have the dtype of boxes ({boxes.dtype}), got {scores.dtype}")
    if scores.device != boxes.device:
        raise ValueError(f"{op}: boxes and scores must be on the same device, got {boxes.device} and {scores.device}")


def _check_scalar_args(op: str, iou_threshold: float, offset: int) -> None:
    if math.isnan(iou_threshold) or not 0.0 <= iou_threshold <= 1.0:
        raise ValueError(f"{op}: iou_threshold must be a number in [0, 1], got {iou_threshold}")
    if offset not in (0, 1):
        raise ValueError(f"{op}: offset must be 0 or 1, got {offset}")


def check_tensor_args(op: str, boxes: Tensor, scores: Tensor, iou_threshold: float, offset: int) -> None:
    """Shapes, dtypes, devices, ``iou_threshold`` range and ``offset`` (``check_nms_args`` of ``nms_checks.h``)."""
    if boxes.dim() != 2 or boxes.shape[1] != 4:
        raise ValueError(f"{op}: boxes must have shape (N, 4), got {list(boxes.shape)}")
    if scores.dim() != 1:
        raise ValueError(f"{op}: scores must have shape (N,), got {list(scores.shape)}")
    if boxes.shape[0] != scores.shape[0]:
        raise ValueError(
            f"{op}: boxes and scores must have the same length N, got {boxes.shape[0]} boxes "
            f"and {scores.shape[0]} scores"
        )
    _check_dtypes_and_devices(op, boxes, scores)
    _check_scalar_args(op, iou_threshold, offset)


def batched_nms_input_is_empty(boxes: Tensor, iou_threshold: float, offset: int) -> bool:
    """As ``torchvision.ops.batched_nms``: no box coordinates at all gives an empty result, whatever the shapes."""
    _check_scalar_args("batched_nms", iou_threshold, offset)
    return boxes.numel() == 0


def check_idxs(boxes: Tensor, idxs: Tensor) -> Tensor:
    """Check the class ids of ``batched_nms`` (``check_idxs_arg`` of ``nms_checks.h``); return them as int64."""
    if idxs.dim() != 1 or idxs.shape[0] != boxes.shape[0]:
        raise ValueError(f"batched_nms: idxs must have shape (N,) with N = {boxes.shape[0]}, got {list(idxs.shape)}")
    if idxs.dtype == torch.bool or idxs.dtype.is_floating_point or idxs.dtype.is_complex:
        raise TypeError(f"batched_nms: idxs must have an integer dtype, got {idxs.dtype}")
    if idxs.device != boxes.device:
        raise ValueError(f"batched_nms: idxs must be on the device of boxes ({boxes.device}), got {idxs.device}")
    return idxs.to(torch.int64)


def check_finite(op: str, boxes: Tensor, scores: Tensor) -> None:
    """Raise ``ValueError`` when a coordinate or score is NaN or infinite (this one reads the data)."""
    if not bool(torch.isfinite(scores).all()):
        raise ValueError(f"{op}: scores must be finite (no NaN or infinity)")
    if not bool(torch.isfinite(boxes).all()):
        raise ValueError(f"{op}: box coordinates must be finite (no NaN or infinity)")
