"""Non-maximum suppression: :func:`nms` and :func:`batched_nms`, and their fake kernels for ``torch.compile``."""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_balanced.ops import _loader
from lightning_balanced.ops._checks import check_idxs, check_nms_args
from lightning_balanced.ops.nms_reference import batched_nms_reference, nms_reference

__all__ = ["batched_nms", "nms"]


def nms(boxes: Tensor, scores: Tensor, iou_threshold: float, offset: int = 0) -> Tensor:
    """Greedy non-maximum suppression.

    Boxes are visited by decreasing score; a box is kept unless its IoU with an already kept box is strictly
    greater than ``iou_threshold``. IoU is computed in float32 for float16/bfloat16/float32 inputs and in float64
    for float64 inputs, as ``inter > iou_threshold * union`` (no division), and is 0 when ``union <= 0``: boxes of
    zero or negative width or height are always kept and never suppress. Identical boxes suppress each other
    (IoU 1) unless ``iou_threshold == 1``.

    Args:
        boxes (Tensor[N, 4]): boxes as ``(x1, y1, x2, y2)``, float16/bfloat16/float32/float64, CPU or CUDA;
            non-contiguous tensors are fine.
        scores (Tensor[N]): one score per box, same dtype and device as ``boxes``.
        iou_threshold (float): in ``[0, 1]``; a box is dropped when its IoU with a kept, higher-scoring box is
            strictly greater than this.
        offset (int): 0 (default), or 1 for the legacy pixel convention: widths and heights (of boxes and of
            intersections) are ``x2 - x1 + 1``.

    Returns:
        Tensor[K] (int64): indices of kept boxes, by decreasing score; equal scores keep the lower index first.
        Empty input gives an empty int64 tensor.

    Raises:
        TypeError: if ``boxes``/``scores`` are not tensors of the same floating dtype, or ``iou_threshold`` is not
            a real number.
        ValueError: if the shapes are not ``(N, 4)`` and ``(N,)``, the devices differ, ``iou_threshold`` is NaN or
            outside ``[0, 1]``, ``offset`` is not 0 or 1, or a coordinate or score is NaN or infinite.

    Source: greedy NMS as in ``torchvision.ops.nms``; ``offset`` as in ``mmcv.ops.nms``.
    """
    threshold = check_nms_args("nms", boxes, scores, iou_threshold, offset)
    if not _loader.has_kernel(boxes.device.type):
        _loader.warn_fallback_once(boxes.device.type)
        return nms_reference(boxes, scores, threshold, offset)
    out: Tensor = torch.ops.lightning_balanced.nms(boxes, scores, threshold, offset)
    return out


def batched_nms(boxes: Tensor, scores: Tensor, idxs: Tensor, iou_threshold: float, offset: int = 0) -> Tensor:
    """Non-maximum suppression done independently per class (or per image).

    Boxes with different ``idxs`` never suppress each other. Unlike the coordinate-offset trick of
    ``torchvision.ops.batched_nms``, IoUs are computed on the original coordinates, so the result is exactly
    that of :func:`nms` run on each class, merged by decreasing score. The arithmetic is that of :func:`nms`.

    Args:
        boxes (Tensor[N, 4]): boxes as ``(x1, y1, x2, y2)``, float16/bfloat16/float32/float64, CPU or CUDA.
        scores (Tensor[N]): one score per box, same dtype and device as ``boxes``.
        idxs (Tensor[N]): integer class id of each box (any integer dtype, any values), same device as ``boxes``.
        iou_threshold (float): in ``[0, 1]``; a box is dropped when its IoU with a kept, higher-scoring box of
            the same class is strictly greater than this.
        offset (int): 0 (default), or 1 for the legacy pixel convention, as in :func:`nms`.

    Returns:
        Tensor[K] (int64): indices of kept boxes, by decreasing score; equal scores keep the lower index first.

    Raises:
        TypeError: as in :func:`nms`, or if ``idxs`` is not an integer tensor.
        ValueError: as in :func:`nms`, or if ``idxs`` is not ``(N,)`` on the device of ``boxes``.

    Source: ``torchvision.ops.batched_nms`` semantics; ``offset`` as in ``mmcv.ops.nms``.
    """
    threshold = check_nms_args("batched_nms", boxes, scores, iou_threshold, offset)
    classes = check_idxs(boxes, idxs)
    if not _loader.has_kernel(boxes.device.type):
        _loader.warn_fallback_once(boxes.device.type)
        return batched_nms_reference(boxes, scores, classes, threshold, offset)
    out: Tensor = torch.ops.lightning_balanced.batched_nms(boxes, scores, classes, threshold, offset)
    return out


def _nms_fake(boxes: Tensor, scores: Tensor, iou_threshold: float, offset: int = 0) -> Tensor:
    torch._check(boxes.dim() == 2 and boxes.shape[1] == 4, lambda: "nms: boxes must have shape (N, 4)")
    torch._check(scores.dim() == 1, lambda: "nms: scores must have shape (N,)")
    torch._check(boxes.shape[0] == scores.shape[0], lambda: "nms: boxes and scores must have the same length")
    torch._check(boxes.dtype == scores.dtype, lambda: "nms: scores must have the dtype of boxes")
    kept = torch.library.get_ctx().new_dynamic_size()
    return boxes.new_empty((kept,), dtype=torch.int64)


def _batched_nms_fake(boxes: Tensor, scores: Tensor, idxs: Tensor, iou_threshold: float, offset: int = 0) -> Tensor:
    torch._check(boxes.dim() == 2 and boxes.shape[1] == 4, lambda: "batched_nms: boxes must have shape (N, 4)")
    torch._check(scores.dim() == 1, lambda: "batched_nms: scores must have shape (N,)")
    torch._check(
        boxes.shape[0] == scores.shape[0] and idxs.shape[0] == boxes.shape[0],
        lambda: "batched_nms: boxes, scores and idxs must have the same length",
    )
    kept = torch.library.get_ctx().new_dynamic_size()
    return boxes.new_empty((kept,), dtype=torch.int64)


# Fake kernels (output size depends on the data) so torch.compile(fullgraph=True) traces through the ops.
# Registered only when the compiled ops exist: a missing _C must never break `import lightning_balanced.ops`.
if _loader.has_compiled_ops():
    torch.library.register_fake("lightning_balanced::nms", _nms_fake)
    torch.library.register_fake("lightning_balanced::batched_nms", _batched_nms_fake)
