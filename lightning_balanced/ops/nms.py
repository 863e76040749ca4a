"""Non-maximum suppression: :func:`nms`, :func:`batched_nms`, the fixed-shape :func:`batched_nms_padded`, fake kernels.

The fake kernels describe the outputs for ``torch.compile``.
"""

from __future__ import annotations

import torch
from torch import Tensor

from lightning_balanced.ops import _loader
from lightning_balanced.ops._checks import check_argument_types, check_padded_argument_types
from lightning_balanced.ops.nms_reference import batched_nms_padded_reference, batched_nms_reference, nms_reference

__all__ = ["batched_nms", "batched_nms_padded", "nms"]


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
        TypeError: if ``boxes``/``scores`` are not tensors of the same floating dtype, ``iou_threshold`` is not a
            real number, or ``offset`` is not an int.
        ValueError: if the shapes are not ``(N, 4)`` and ``(N,)``, the devices differ, ``iou_threshold`` is NaN or
            outside ``[0, 1]``, ``offset`` is not 0 or 1, or a coordinate or score is NaN or infinite.

    The compiled operator makes the tensor checks, so they raise the same errors in eager mode and under
    ``torch.compile(fullgraph=True)`` (when the compiled graph runs). Only the Python type checks (an argument that
    is not a tensor or a number) run while tracing, where ``torch._dynamo`` reports them as ``Unsupported``
    ("Observed exception"), with our ``TypeError`` as the cause from torch 2.10 on.

    Differences from ``torchvision.ops.nms`` (0.29; tested in ``tests/ops/test_nms_torchvision.py``): none on float
    inputs except when an IoU equals ``iou_threshold`` exactly. torchvision divides in float32 and compares the
    rounded quotient with the float64 threshold, so e.g. IoU 1/3 (rounded up to 0.33333334) suppresses at
    threshold ``1/3``; here it never does (float64 input agrees with torchvision). torchvision also accepts no
    ``offset``, NaN/infinite values or thresholds outside ``[0, 1]`` without an error.

    Source: greedy NMS as in ``torchvision.ops.nms``; ``offset`` as in ``mmcv.ops.nms``.
    """
    threshold = check_argument_types("nms", boxes, scores, iou_threshold, offset)
    if not _use_compiled_op("nms", boxes):
        _loader.warn_fallback_once(boxes.device.type)
        return nms_reference(boxes, scores, threshold, offset)
    # The operator checks shapes, dtypes, devices, iou_threshold, offset and finiteness (csrc/ops/nms_checks.h).
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
        As in torchvision, input without coordinates (``boxes.numel() == 0``, e.g. shape ``(0, 4)`` or ``(0,)``)
        gives an empty int64 tensor whatever the shapes and dtypes of ``scores`` and ``idxs``.

    Raises:
        TypeError: as in :func:`nms`, or if ``idxs`` is not a tensor of an integer dtype.
        ValueError: as in :func:`nms`, or if ``idxs`` is not ``(N,)`` on the device of ``boxes``.

    Differences from ``torchvision.ops.batched_nms`` (0.29; each asserted in ``tests/ops/test_nms_torchvision.py``).
    The kept set and order are torchvision's except:

    1. Offset trick (torchvision, CPU, ``N <= 1000``): it shifts class ``c`` by ``c * (max coordinate + 1)`` in
       the input dtype, so large class ids or coordinates lose low bits (float32; much sooner in float16/bfloat16)
       and IoUs near the threshold change; we compute on the original coordinates, i.e. torchvision's ``nms`` per
       class.
    2. Negative coordinates (outside torchvision's documented ``0 <= x1 < x2``): its offset no longer separates
       the classes, and boxes of different classes can suppress each other; here they never do.
    3. Tie order (torchvision, CPU, ``N > 1000``): it merges the classes with an unstable sort, so boxes of equal
       score may come in any order; we keep the lower index first. Same set, same order up to ties.
    4. IoU exactly equal to ``iou_threshold``: as for :func:`nms`.

    Source: ``torchvision.ops.batched_nms`` semantics; ``offset`` as in ``mmcv.ops.nms``.
    """
    threshold = check_argument_types("batched_nms", boxes, scores, iou_threshold, offset, idxs)
    if not _use_compiled_op("batched_nms", boxes):
        _loader.warn_fallback_once(boxes.device.type)
        return batched_nms_reference(boxes, scores, idxs, threshold, offset)
    out: Tensor = torch.ops.lightning_balanced.batched_nms(boxes, scores, idxs, threshold, offset)
    return out


def batched_nms_padded(
    boxes: Tensor, scores: Tensor, idxs: Tensor | None, iou_threshold: float, max_output: int, offset: int = 0
) -> tuple[Tensor, Tensor]:
    """NMS of a batch of images in fixed shapes, with no device-to-host copy and no sync.

    Each image is reduced as :func:`batched_nms` (with ``idxs``) or :func:`nms` (without) reduces it, and its kept
    indices are stored up to ``max_output``. The output shapes depend on the input shapes only, and on CUDA nothing
    waits for the GPU, so the call can be captured in a CUDA graph and traced by ``torch.compile(fullgraph=True)``
    without a graph break. On CPU the results are the same.

    Args:
        boxes (Tensor[B, N, 4]): boxes as ``(x1, y1, x2, y2)``, float16/bfloat16/float32/float64, CPU or CUDA.
        scores (Tensor[B, N]): one score per box, same dtype and device. A score of ``-inf`` marks a padding box
            (for images with fewer than ``N`` boxes): it is never kept and never suppresses.
        idxs (Tensor[B, N] or None): integer class ids (any integer dtype) for per-class NMS within each image, or
            ``None`` for class-agnostic NMS.
        iou_threshold (float): in ``[0, 1]``, as in :func:`nms`.
        max_output (int): kept indices stored per image, ``>= 0``; the highest-scoring ones are stored.
        offset (int): 0 (default), or 1 for the legacy pixel convention, as in :func:`nms`.

    Returns:
        ``(keep, num_kept)``: ``keep`` (Tensor[B, max_output], int64) holds each image's kept box indices (into
        ``N``) by decreasing score, ``-1`` after the last; ``num_kept`` (Tensor[B], int64) their number,
        ``min(kept, max_output)``. The first ``num_kept[b]`` entries of ``keep[b]`` equal ``batched_nms`` on image
        ``b``'s non-padding boxes, truncated to ``max_output``. An image with a NaN or infinite coordinate or score
        (other than a ``-inf`` padding score) gets ``num_kept = -1`` and an all ``-1`` row: checking the values
        would need a sync, so test ``(num_kept < 0).any()`` where the input may hold such values.

    Raises:
        TypeError: if ``boxes``/``scores`` are not tensors of the same floating dtype, ``idxs`` is not ``None`` or an
            integer tensor, ``iou_threshold`` is not a real number, or ``max_output``/``offset`` is not an int.
        ValueError: if the shapes are not ``(B, N, 4)``, ``(B, N)`` and ``(B, N)``, the devices differ,
            ``iou_threshold`` is outside ``[0, 1]``, ``max_output < 0`` or ``offset`` is not 0 or 1.

    Source: the fixed-shape output of TensorRT's ``EfficientNMS`` plugin and ``torchvision``'s open requests for a
    batched NMS (pytorch/vision#392, pytorch/pytorch#39312), with the exact semantics of :func:`batched_nms`.
    """
    threshold = check_padded_argument_types(boxes, scores, idxs, iou_threshold, max_output, offset)
    if not _use_compiled_op("batched_nms_padded", boxes):
        _loader.warn_fallback_once(boxes.device.type)
        return batched_nms_padded_reference(boxes, scores, idxs, threshold, max_output, offset)
    keep, num_kept = torch.ops.lightning_balanced.batched_nms_padded(boxes, scores, idxs, threshold, max_output, offset)
    return keep, num_kept


def _use_compiled_op(op: str, boxes: Tensor) -> bool:
    """Whether the compiled operator ``op`` serves ``boxes``: a kernel for its device, or meta tensors (fake kernel).

    Fake tensors (``torch.compile``, ``FakeTensorMode``) report the device they stand for, so they are served
    whenever real tensors on that device are, and the dispatcher sends them to the fake kernel.
    """
    return _loader.has_kernel(boxes.device.type, op) or (boxes.device.type == "meta" and _loader.has_compiled_ops())


# torch < 2.10: Dynamo lets a fake kernel create a data-dependent size (`new_dynamic_size`) only when the global
# `torch._dynamo.config.capture_dynamic_output_shape_ops` is set, even under fullgraph=True, and refuses the op as a
# "dynamic shape operator" otherwise (2.10 allows it whenever fullgraph=True). Rather than set that config behind the
# user's back, the fake kernels then create the size as torch's own internal fake kernels do: an unbacked SymInt of
# the ShapeEnv with `new_dynamic_size`'s range (>= 0). On those versions the op is captured in the graph also without
# fullgraph instead of breaking it. Private API, so only on these released versions; newer torch takes the public path.
_OWN_DYNAMIC_SIZE = torch.__version__ < "2.10"


def _new_kept_size() -> torch.SymInt:
    ctx = torch.library.get_ctx()
    shape_env = getattr(ctx, "_shape_env", None)
    if _OWN_DYNAMIC_SIZE and shape_env is not None and not shape_env.allow_dynamic_output_shape_ops:
        from torch.fx.experimental.symbolic_shapes import _constrain_range_for_size

        size: torch.SymInt = shape_env.create_unbacked_symint()
        _constrain_range_for_size(size, min=0)
        return size
    return ctx.new_dynamic_size()


# The fake kernels only describe the output: int64 indices of a data-dependent length K <= N. They check nothing,
# so under torch.compile the argument checks run in C++ when the graph runs, with the same ValueError/TypeError
# as in eager mode (a check raised while tracing would reach the user wrapped in a torch._dynamo error).
def _nms_fake(boxes: Tensor, scores: Tensor, iou_threshold: float, offset: int = 0) -> Tensor:
    return boxes.new_empty((_new_kept_size(),), dtype=torch.int64)


def _batched_nms_fake(boxes: Tensor, scores: Tensor, idxs: Tensor, iou_threshold: float, offset: int = 0) -> Tensor:
    return boxes.new_empty((_new_kept_size(),), dtype=torch.int64)


def _batched_nms_padded_fake(
    boxes: Tensor, scores: Tensor, idxs: Tensor | None, iou_threshold: float, max_output: int, offset: int = 0
) -> tuple[Tensor, Tensor]:
    batch = boxes.shape[0]
    return boxes.new_empty((batch, max_output), dtype=torch.int64), boxes.new_empty((batch,), dtype=torch.int64)


# Fake kernels (output size depends on the data, except for the padded form) so torch.compile(fullgraph=True) traces
# through the ops. Registered only when the compiled ops exist: a missing _C must never break the import.
if _loader.has_compiled_ops():
    torch.library.register_fake("lightning_balanced::nms", _nms_fake)
    torch.library.register_fake("lightning_balanced::batched_nms", _batched_nms_fake)
    torch.library.register_fake("lightning_balanced::batched_nms_padded", _batched_nms_padded_fake)
