"""Pure-PyTorch reference of :func:`~lightning_balanced.ops.nms` and :func:`~lightning_balanced.ops.batched_nms`.

This is both the fallback when the compiled operators are missing and the oracle of the tests, so its arithmetic is
written in exactly the form of the C++/CUDA kernels:

* float16/bfloat16 are computed in float32, float32 in float32, float64 in float64 (the *compute dtype*);
* ``area = ((x2 - x1) + offset) * ((y2 - y1) + offset)``;
* ``w = max((min(x2_a, x2_b) - max(x1_a, x1_b)) + offset, 0)``, ``h`` likewise, ``inter = w * h``;
* ``union = (area_a + area_b) - inter``;
* a box is suppressed by a kept, higher-scoring box when ``union > 0 and inter > thr * union`` (``thr`` is
  ``iou_threshold`` rounded to the compute dtype). That is ``IoU > iou_threshold`` without a division, with
  ``IoU = 0`` whenever ``union <= 0`` (degenerate boxes never suppress nor get suppressed).

Each step of the greedy loop is vectorized over the remaining candidates: one Python iteration per kept box.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_balanced.ops._checks import (
    batched_nms_input_is_empty,
    check_argument_types,
    check_finite,
    check_idxs,
    check_padded_argument_types,
    check_padded_tensor_args,
    check_tensor_args,
)

__all__ = ["batched_nms_padded_reference", "batched_nms_reference", "nms_reference"]


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _greedy_keep(boxes: Tensor, iou_threshold: float, offset: int) -> Tensor:
    """Keep mask of boxes that are already sorted by decreasing score (compute dtype)."""
    n = boxes.shape[0]
    keep = torch.zeros(n, dtype=torch.bool, device=boxes.device)
    if n == 0:
        return keep
    x1, y1, x2, y2 = boxes.unbind(1)
    off = torch.tensor(offset, dtype=boxes.dtype, device=boxes.device)
    thr = torch.tensor(iou_threshold, dtype=boxes.dtype, device=boxes.device)
    areas = ((x2 - x1) + off) * ((y2 - y1) + off)
    remaining = torch.arange(n, device=boxes.device)
    while remaining.numel() > 0:
        i = remaining[0]
        keep[i] = True
        rest = remaining[1:]
        w = ((torch.minimum(x2[i], x2[rest]) - torch.maximum(x1[i], x1[rest])) + off).clamp(min=0)
        h = ((torch.minimum(y2[i], y2[rest]) - torch.maximum(y1[i], y1[rest])) + off).clamp(min=0)
        inter = w * h
        union = (areas[i] + areas[rest]) - inter
        suppressed = (union > 0) & (inter > union * thr)
        remaining = rest[~suppressed]
    return keep


def nms_reference(boxes: Tensor, scores: Tensor, iou_threshold: float, offset: int = 0) -> Tensor:
    """Greedy non-maximum suppression in pure PyTorch; same results as :func:`lightning_balanced.ops.nms`.

    Args:
        boxes (Tensor[N, 4]): boxes as ``(x1, y1, x2, y2)``, float16/bfloat16/float32/float64, any device.
        scores (Tensor[N]): one score per box, same dtype and device as ``boxes``.
        iou_threshold (float): in ``[0, 1]``; a box is dropped when its IoU with a kept, higher-scoring box is
            strictly greater than this.
        offset (int): 0, or 1 for the legacy pixel convention (``+1`` on widths and heights), as in mmcv.

    Returns:
        Tensor[K] (int64): indices of kept boxes, by decreasing score; ties keep the lower index first.

    Raises:
        TypeError: if an argument has the wrong type or dtype.
        ValueError: if a shape, device, ``iou_threshold`` or ``offset`` is invalid, or a value is NaN or infinite.
    """
    threshold = check_argument_types("nms", boxes, scores, iou_threshold, offset)
    check_tensor_args("nms", boxes, scores, threshold, offset)
    check_finite("nms", boxes, scores)
    ct = _compute_dtype(boxes.dtype)
    order = torch.sort(scores.to(ct), descending=True, stable=True).indices
    keep = _greedy_keep(boxes.to(ct)[order], threshold, offset)
    return order[keep]


def batched_nms_reference(boxes: Tensor, scores: Tensor, idxs: Tensor, iou_threshold: float, offset: int = 0) -> Tensor:
    """Per-class NMS in pure PyTorch; same results as :func:`lightning_balanced.ops.batched_nms`.

    Boxes with different ``idxs`` never suppress each other; IoUs are computed on the original coordinates.

    Args:
        boxes (Tensor[N, 4]): boxes as ``(x1, y1, x2, y2)``, float16/bfloat16/float32/float64, any device.
        scores (Tensor[N]): one score per box, same dtype and device as ``boxes``.
        idxs (Tensor[N]): integer class (or image) id of each box, same device as ``boxes``.
        iou_threshold (float): in ``[0, 1]``; suppression when IoU is strictly greater.
        offset (int): 0, or 1 for the legacy pixel convention, as in mmcv.

    Returns:
        Tensor[K] (int64): indices of kept boxes, by decreasing score; ties keep the lower index first.

    Raises:
        TypeError: if an argument has the wrong type or dtype.
        ValueError: if a shape, device, ``iou_threshold`` or ``offset`` is invalid, or a value is NaN or infinite.
    """
    threshold = check_argument_types("batched_nms", boxes, scores, iou_threshold, offset, idxs)
    if batched_nms_input_is_empty(boxes, threshold, offset):
        return torch.empty(0, dtype=torch.int64, device=boxes.device)
    check_tensor_args("batched_nms", boxes, scores, threshold, offset)
    classes = check_idxs(boxes, idxs)
    check_finite("batched_nms", boxes, scores)
    ct = _compute_dtype(boxes.dtype)
    order = torch.sort(scores.to(ct), descending=True, stable=True).indices
    sorted_boxes = boxes.to(ct)[order]
    sorted_classes = classes[order]
    keep = torch.zeros(order.shape[0], dtype=torch.bool, device=boxes.device)
    for cls in torch.unique(sorted_classes):
        positions = torch.nonzero(sorted_classes == cls).flatten()  # ascending: still by decreasing score
        keep[positions] = _greedy_keep(sorted_boxes[positions], threshold, offset)
    return order[keep]


def batched_nms_padded_reference(
    boxes: Tensor, scores: Tensor, idxs: Tensor | None, iou_threshold: float, max_output: int, offset: int = 0
) -> tuple[Tensor, Tensor]:
    """:func:`lightning_balanced.ops.batched_nms_padded` in pure PyTorch, one image after another.

    Args:
        boxes (Tensor[B, N, 4]): boxes as ``(x1, y1, x2, y2)``, float16/bfloat16/float32/float64, any device.
        scores (Tensor[B, N]): same dtype and device; ``-inf`` marks a padding box.
        idxs (Tensor[B, N] or None): integer class ids, or ``None`` for class-agnostic NMS.
        iou_threshold (float): in ``[0, 1]``.
        max_output (int): kept indices stored per image, ``>= 0``.
        offset (int): 0, or 1 for the legacy pixel convention.

    Returns:
        (Tensor[B, max_output], Tensor[B]), both int64: the kept indices by decreasing score, ``-1`` after the last,
        and their number; ``-1`` and an all ``-1`` row for an image with a NaN or infinite value (other than a
        padding score).

    Raises:
        TypeError: if an argument has the wrong type or dtype.
        ValueError: if a shape, device, ``iou_threshold``, ``max_output`` or ``offset`` is invalid.
    """
    threshold = check_padded_argument_types(boxes, scores, idxs, iou_threshold, max_output, offset)
    check_padded_tensor_args(boxes, scores, idxs, threshold, max_output, offset)
    batch = boxes.shape[0]
    keep = torch.full((batch, max_output), -1, dtype=torch.int64, device=boxes.device)
    num_kept = torch.empty(batch, dtype=torch.int64, device=boxes.device)
    for b in range(batch):
        real = ~torch.isneginf(scores[b])
        if not bool((torch.isfinite(scores[b]) | ~real).all()) or not bool(
            (torch.isfinite(boxes[b]).all(1) | ~real).all()
        ):
            num_kept[b] = -1
            continue
        index = torch.nonzero(real).flatten()
        if idxs is None:
            kept = nms_reference(boxes[b][index], scores[b][index], threshold, offset)
        else:
            kept = batched_nms_reference(boxes[b][index], scores[b][index], idxs[b][index], threshold, offset)
        count = min(kept.shape[0], max_output)
        keep[b, :count] = index[kept[:count]]
        num_kept[b] = count
    return keep, num_kept
