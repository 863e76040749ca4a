"""Argument checks shared by the public ops and the pure-PyTorch reference (metadata only, no kernels)."""

from __future__ import annotations

import math
from numbers import Real

import torch
from torch import Tensor

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def check_nms_args(op: str, boxes: object, scores: object, iou_threshold: object, offset: object) -> float:
    """Raise ``TypeError``/``ValueError`` for bad arguments; return ``iou_threshold`` as a float."""
    if not isinstance(boxes, Tensor):
        raise TypeError(f"{op}: boxes must be a torch.Tensor, got {type(boxes).__name__}")
    if not isinstance(scores, Tensor):
        raise TypeError(f"{op}: scores must be a torch.Tensor, got {type(scores).__name__}")
    if boxes.dim() != 2 or boxes.shape[1] != 4:
        raise ValueError(f"{op}: boxes must have shape (N, 4), got {tuple(boxes.shape)}")
    if scores.dim() != 1:
        raise ValueError(f"{op}: scores must have shape (N,), got {tuple(scores.shape)}")
    if boxes.shape[0] != scores.shape[0]:
        raise ValueError(
            f"{op}: boxes and scores must have the same length N, got {boxes.shape[0]} boxes "
            f"and {scores.shape[0]} scores"
        )
    if boxes.dtype not in _FLOAT_DTYPES:
        raise TypeError(f"{op}: boxes must be float16, bfloat16, float32 or float64, got {boxes.dtype}")
    if scores.dtype != boxes.dtype:
        raise TypeError(f"{op}: scores must have the dtype of boxes ({boxes.dtype}), got {scores.dtype}")
    if scores.device != boxes.device:
        raise ValueError(f"{op}: boxes and scores must be on the same device, got {boxes.device} and {scores.device}")
    if isinstance(iou_threshold, bool) or not isinstance(iou_threshold, Real):
        raise TypeError(f"{op}: iou_threshold must be a real number, got {type(iou_threshold).__name__}")
    threshold = float(iou_threshold)
    if math.isnan(threshold) or not 0.0 <= threshold <= 1.0:
        raise ValueError(f"{op}: iou_threshold must be a number in [0, 1], got {iou_threshold}")
    if isinstance(offset, bool) or not isinstance(offset, int) or offset not in (0, 1):
        raise ValueError(f"{op}: offset must be the integer 0 or 1, got {offset!r}")
    return threshold


def check_idxs(boxes: Tensor, idxs: object) -> Tensor:
    """Check the class ids of ``batched_nms``; return them as int64."""
    if not isinstance(idxs, Tensor):
        raise TypeError(f"batched_nms: idxs must be a torch.Tensor, got {type(idxs).__name__}")
    if idxs.dim() != 1 or idxs.shape[0] != boxes.shape[0]:
        raise ValueError(f"batched_nms: idxs must have shape (N,) with N = {boxes.shape[0]}, got {tuple(idxs.shape)}")
    if idxs.dtype == torch.bool or idxs.dtype.is_floating_point or idxs.dtype.is_complex:
        raise TypeError(f"batched_nms: idxs must have an integer dtype, got {idxs.dtype}")
    if idxs.device != boxes.device:
        raise ValueError(f"batched_nms: idxs must be on the device of boxes ({boxes.device}), got {idxs.device}")
    return idxs if idxs.dtype == torch.int64 else idxs.to(torch.int64)


def check_finite(op: str, boxes: Tensor, scores: Tensor) -> None:
    """Raise ``ValueError`` when a coordinate or score is NaN or infinite (this one reads the data)."""
    if not bool(torch.isfinite(boxes).all()):
        raise ValueError(f"{op}: box coordinates must be finite (no NaN or infinity)")
    if not bool(torch.isfinite(scores).all()):
        raise ValueError(f"{op}: scores must be finite (no NaN or infinity)")
