"""Detection evaluation: per-image post-processing (:func:`postprocess_detections`) and COCO mAP (:func:`coco_map`).

Under DDP, post-process each image in the step, hand the per-image detections to
:class:`~lightning_balanced.evaluation.DistributedEvalMixin` as ragged list fields (one ``(K_i, 4)`` tensor per image,
and so on), and compute :func:`coco_map` on the gathered set at epoch end: every rank then holds every image exactly
once, so the mAP is that of a single process on the whole evaluation set, on every rank::

    def validation_step(self, batch, batch_idx):
        indices, images, targets = batch
        dets = [postprocess_detections(*self(image)) for image in images]  # (boxes, scores, labels) per image
        self.add_eval_outputs(
            indices,
            pred_boxes=[d["boxes"] for d in dets], pred_scores=[d["scores"] for d in dets],
            pred_labels=[d["labels"] for d in dets],
            gt_boxes=[t["boxes"] for t in targets], gt_labels=[t["labels"] for t in targets],
        )

    def on_validation_epoch_end(self):
        out = self.gather_eval_outputs()
        preds = [dict(boxes=b, scores=s, labels=l) for b, s, l in zip(out["pred_boxes"], out["pred_scores"],
                                                                      out["pred_labels"])]
        targets = [dict(boxes=b, labels=l) for b, l in zip(out["gt_boxes"], out["gt_labels"])]
        self.log_dict(coco_map(preds, targets))  # plain floats, identical on every rank: nothing to sync
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from torch import Tensor

from lightning_balanced.arguments import check_real
from lightning_balanced.ops import batched_nms, batched_nms_padded

__all__ = ["check_boxes", "postprocess_detections"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INTEGER_KEYS, _FLOAT_KEYS = ("labels", "iscrowd"), ("scores", "area")  # per-box entries besides "boxes"


def check_boxes(item: Mapping[str, object], keys: tuple[str, ...], name: Callable[[str], str]) -> dict[str, Tensor]:
    """The one set of checks on boxes and their per-box entries, naming each as the caller knows it (``name(key)``).

    ``keys`` are present; the other entries of ``("labels", "scores", "iscrowd", "area")`` are checked if present.
    Returns the checked tensors by key.
    """
    tensors: dict[str, Tensor] = {}
    for key in [k for k in ("boxes", *_INTEGER_KEYS, *_FLOAT_KEYS) if k in item]:
        value = item[key]
        if not isinstance(value, Tensor):
            raise TypeError(f"{name(key)} must be a torch.Tensor, got {type(value).__name__}")
        tensors[key] = value
    boxes = tensors["boxes"]
    if boxes.dim() != 2 or boxes.shape[1] != 4:
        raise ValueError(f"{name('boxes')} must have shape (N, 4), got {tuple(boxes.shape)}")
    for key, value in tensors.items():
        if key != "boxes" and value.shape != (boxes.shape[0],):
            raise ValueError(
                f"{name(key)} must have shape (N,) with N = {boxes.shape[0]} boxes, got {tuple(value.shape)}"
            )
        if key in _INTEGER_KEYS and (value.dtype == torch.bool or value.is_floating_point() or value.is_complex()):
            raise TypeError(f"{name(key)} must have an integer dtype, got {value.dtype}")
        if (key == "boxes" or key in _FLOAT_KEYS) and value.dtype not in _FLOAT_DTYPES:
            raise TypeError(f"{name(key)} must be float16, bfloat16, float32 or float64, got {value.dtype}")
    return tensors


def postprocess_detections(
    boxes: Tensor,
    scores: Tensor,
    labels: Tensor,
    *,
    iou_threshold: float = 0.5,
    score_threshold: float = 0.05,
    max_detections: int | None = 100,
) -> dict[str, Tensor]:
    """Turn one image's scored, labelled candidate boxes into its final detections.

    Three steps, as in torchvision's ``RoIHeads.postprocess_detections`` and detectron2's
    ``fast_rcnn_inference_single_image``: keep the candidates whose score is **strictly greater** than
    ``score_threshold`` (``scores > score_threshold``, compared in the dtype of ``scores``, as both do); class-aware
    NMS (:func:`lightning_balanced.ops.batched_nms`: boxes of different labels never suppress each other); keep the
    ``max_detections`` highest-scoring survivors. Unlike torchvision, boxes are neither clipped to the image nor
    filtered by size: do that before, if the model needs it. A model that scores every box for every class
    (``(N, C, 4)`` boxes and ``(N, C)`` scores) passes them flattened, with ``labels = arange(C).repeat(N)``.

    A batch of images with the same number of candidates (``(B, N, 4)`` boxes, ``(B, N)`` scores and labels) takes the
    batched path: one :func:`~lightning_balanced.ops.batched_nms_padded` call for all images, fixed output shapes and
    no sync, so it can run inside a CUDA graph or a ``torch.compile(fullgraph=True)`` region. Each image's first
    ``num_detections`` entries equal this function on that image alone. Ragged batches: pad with score ``-inf``.

    Args:
        boxes (Tensor[N, 4] or Tensor[B, N, 4]): candidate boxes as ``(x1, y1, x2, y2)`` in pixels,
            float16/bfloat16/float32/float64, finite.
        scores (Tensor[N] or Tensor[B, N]): one score per box (e.g. a class probability), same dtype and device as
            ``boxes``, finite.
        labels (Tensor[N] or Tensor[B, N]): integer class of each box (any integer dtype), on the device of ``boxes``.
        iou_threshold (float): in ``[0, 1]``; a box is dropped when its IoU with a kept, higher-scoring box of the
            same class is strictly greater than this. Default 0.5 (torchvision's ``box_nms_thresh``).
        score_threshold (float): a box is kept only if its score is strictly greater than this; any real number
            that is not NaN (``-inf`` keeps every box). Default 0.05 (torchvision's ``box_score_thresh``).
        max_detections (int or None): keep at most this many detections (>= 1), or all of them with ``None``.
            Default 100 (torchvision's ``box_detections_per_img``, COCO's largest ``maxDets``).

    Returns:
        dict[str, Tensor]: the ``K`` detections (``K <= max_detections``), by decreasing score; equal scores keep
        the candidate with the lower index first (also when ``max_detections`` cuts between them):

        - ``"boxes"`` (Tensor[K, 4]): ``(x1, y1, x2, y2)`` in pixels, dtype of ``boxes``;
        - ``"scores"`` (Tensor[K]): dtype of ``scores``;
        - ``"labels"`` (Tensor[K], int64).

        No candidate above the threshold gives ``K = 0`` (tensors of shapes ``(0, 4)``, ``(0,)``, ``(0,)``).

        Batched: ``"boxes"`` (Tensor[B, M, 4]), ``"scores"`` (Tensor[B, M]) and ``"labels"`` (Tensor[B, M], int64)
        with ``M = max_detections`` (``N`` for ``None``), and ``"num_detections"`` (Tensor[B], int64): image ``b``'s
        detections are the first ``num_detections[b]`` rows; the rest hold boxes and scores 0 and label -1. Checking
        values would need a sync, so a NaN or infinite score, or a non-finite box scored above the threshold, gives
        that image ``num_detections = -1`` (and no rows) instead of a ``ValueError``.

    Raises:
        TypeError: if ``boxes``, ``scores`` or ``labels`` is not a tensor, ``boxes`` is not floating point,
            ``scores`` has another dtype than ``boxes``, ``labels`` is not an integer tensor, a threshold is not a
            real number or ``max_detections`` is not an int or ``None``.
        ValueError: if the shapes are not ``(N, 4)``, ``(N,)``, ``(N,)``, the devices differ, a box coordinate or
            score is NaN or infinite, ``iou_threshold`` is outside ``[0, 1]`` (raised by ``batched_nms``, which
            checks it), ``score_threshold`` is NaN or ``max_detections < 1``.

    Source: the semantics of torchvision's ``RoIHeads.postprocess_detections`` and detectron2's
    ``fast_rcnn_inference_single_image`` (score filter, per-class NMS, top-k).
    """
    if isinstance(boxes, Tensor) and boxes.dim() == 3:
        return _postprocess_batch(boxes, scores, labels, iou_threshold, score_threshold, max_detections)
    # The checks the score filter and the indexing need; iou_threshold is checked by batched_nms, on every input.
    check_boxes({"boxes": boxes, "scores": scores, "labels": labels}, ("boxes", "scores", "labels"), "`{}`".format)
    if scores.dtype != boxes.dtype:
        raise TypeError(f"`scores` must have the dtype of `boxes` ({boxes.dtype}), got {scores.dtype}")
    for name, tensor in (("scores", scores), ("labels", labels)):
        if tensor.device != boxes.device:
            raise ValueError(f"`{name}` must be on the device of `boxes` ({boxes.device}), got {tensor.device}")
    for name, tensor in (("boxes", boxes), ("scores", scores)):
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"`{name}` must be finite (no NaN or infinity)")
    threshold = check_real("score_threshold", score_threshold, finite=False)
    _check_max_detections(max_detections)

    candidates = torch.nonzero(scores > threshold).flatten()  # ascending: ties stay ordered by original index
    boxes, scores, labels = boxes[candidates], scores[candidates], labels[candidates]
    keep = batched_nms(boxes, scores, labels, iou_threshold)  # by decreasing score, equal scores by lower index
    if max_detections is not None:
        keep = keep[:max_detections]
    return {"boxes": boxes[keep], "scores": scores[keep], "labels": labels[keep].to(torch.int64)}


def _check_max_detections(max_detections: object) -> None:
    if max_detections is not None:
        if isinstance(max_detections, bool) or not isinstance(max_detections, int):
            raise TypeError(f"`max_detections` must be an int or None, got {type(max_detections).__name__}")
        if max_detections < 1:
            raise ValueError(f"`max_detections` must be >= 1 or None, got {max_detections}")


def _postprocess_batch(
    boxes: Tensor,
    scores: Tensor,
    labels: Tensor,
    iou_threshold: float,
    score_threshold: float,
    max_detections: int | None,
) -> dict[str, Tensor]:
    """The batched path of :func:`postprocess_detections`: the score filter as padding, then one padded NMS."""
    for name, value in (("scores", scores), ("labels", labels)):
        if not isinstance(value, Tensor):
            raise TypeError(f"`{name}` must be a torch.Tensor, got {type(value).__name__}")
    if boxes.shape[2] != 4:
        raise ValueError(f"`boxes` must have shape (B, N, 4) or (N, 4), got {tuple(boxes.shape)}")
    for name, value in (("scores", scores), ("labels", labels)):
        if value.shape != boxes.shape[:2]:
            raise ValueError(
                f"`{name}` must have shape (B, N) = {tuple(boxes.shape[:2])} with (B, N, 4) boxes, "
                f"got {tuple(value.shape)}"
            )
    threshold = check_real("score_threshold", score_threshold, finite=False)
    _check_max_detections(max_detections)
    # scores at or below the threshold become padding (-inf); NaN stays NaN, so the image is reported as -1
    candidates = scores.masked_fill(scores <= threshold, float("-inf"))
    limit = boxes.shape[1] if max_detections is None else max_detections
    keep, num_detections = batched_nms_padded(boxes, candidates, labels, iou_threshold, limit)
    found = keep >= 0
    index = keep.clamp(min=0)
    return {
        "boxes": boxes.gather(1, index.unsqueeze(2).expand(-1, -1, 4)).masked_fill(~found.unsqueeze(2), 0),
        "scores": scores.gather(1, index).masked_fill(~found, 0),
        "labels": labels.gather(1, index).to(torch.int64).masked_fill(~found, -1),
        "num_detections": num_detections,
    }
