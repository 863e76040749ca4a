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

import contextlib
import importlib
import io
import math
from collections.abc import Callable, Mapping, Sequence
from numbers import Real
from types import ModuleType

import torch
from torch import Tensor

from lightning_balanced.ops import batched_nms

__all__ = ["coco_map", "postprocess_detections"]

_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_INTEGER_KEYS, _FLOAT_KEYS = ("labels", "iscrowd"), ("scores", "area")  # per-box entries besides "boxes"


def _check_boxes(item: Mapping[str, object], keys: tuple[str, ...], name: Callable[[str], str]) -> dict[str, Tensor]:
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


def _check_real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"`{name}` must be a real number, got {type(value).__name__}")
    number = float(value)
    if math.isnan(number):
        raise ValueError(f"`{name}` must not be NaN")
    return number


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

    For a batch, call it once per image::

        dets = [
            postprocess_detections(b, s, l, iou_threshold=0.5, score_threshold=0.05, max_detections=100)
            for b, s, l in zip(boxes_per_image, scores_per_image, labels_per_image, strict=True)
        ]

    Args:
        boxes (Tensor[N, 4]): candidate boxes as ``(x1, y1, x2, y2)`` in pixels, float16/bfloat16/float32/float64,
            finite.
        scores (Tensor[N]): one score per box (e.g. a class probability), same dtype and device as ``boxes``, finite.
        labels (Tensor[N]): integer class of each box (any integer dtype), on the device of ``boxes``.
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
    # The checks the score filter and the indexing need; iou_threshold is checked by batched_nms, on every input.
    _check_boxes({"boxes": boxes, "scores": scores, "labels": labels}, ("boxes", "scores", "labels"), "`{}`".format)
    if scores.dtype != boxes.dtype:
        raise TypeError(f"`scores` must have the dtype of `boxes` ({boxes.dtype}), got {scores.dtype}")
    for name, tensor in (("scores", scores), ("labels", labels)):
        if tensor.device != boxes.device:
            raise ValueError(f"`{name}` must be on the device of `boxes` ({boxes.device}), got {tensor.device}")
    for name, tensor in (("boxes", boxes), ("scores", scores)):
        if not bool(torch.isfinite(tensor).all()):
            raise ValueError(f"`{name}` must be finite (no NaN or infinity)")
    threshold = _check_real("score_threshold", score_threshold)
    if max_detections is not None:
        if isinstance(max_detections, bool) or not isinstance(max_detections, int):
            raise TypeError(f"`max_detections` must be an int or None, got {type(max_detections).__name__}")
        if max_detections < 1:
            raise ValueError(f"`max_detections` must be >= 1 or None, got {max_detections}")

    candidates = torch.nonzero(scores > threshold).flatten()  # ascending: ties stay ordered by original index
    boxes, scores, labels = boxes[candidates], scores[candidates], labels[candidates]
    keep = batched_nms(boxes, scores, labels, iou_threshold)  # by decreasing score, equal scores by lower index
    if max_detections is not None:
        keep = keep[:max_detections]
    return {"boxes": boxes[keep], "scores": scores[keep], "labels": labels[keep].to(torch.int64)}


# ---- COCO mAP --------------------------------------------------------------------------------------------------------

_STAT_NAMES = (
    "map",
    "map_50",
    "map_75",
    "map_small",
    "map_medium",
    "map_large",
    "mar_1",
    "mar_10",
    "mar_100",
    "mar_small",
    "mar_medium",
    "mar_large",
)


def _import_pycocotools() -> tuple[ModuleType, ModuleType]:
    try:
        coco = importlib.import_module("pycocotools.coco")
        cocoeval = importlib.import_module("pycocotools.cocoeval")
    except ImportError as err:
        raise ImportError(
            "coco_map needs pycocotools; install it with `pip install 'lightning-balanced[detection]'`"
            " (or `pip install pycocotools`)"
        ) from err
    return coco, cocoeval


def _coco_dataset(items: Sequence[Mapping[str, Tensor]], categories: list[int], *, with_scores: bool) -> dict:
    """COCO-format dict of per-image items, as torchmetrics' ``MeanAveragePrecision`` builds it (image id = position).

    Boxes go to ``(x, y, w, h)`` in their own dtype before becoming Python floats; an annotation's area is the
    ``area`` given for it when positive, else ``w * h``.
    """
    images: list[dict[str, object]] = []
    annotations: list[dict[str, object]] = []
    for image_id, item in enumerate(items):
        images.append({"id": image_id})
        xyxy = item["boxes"].detach()
        xywh = torch.cat([xyxy[:, :2], xyxy[:, 2:] - xyxy[:, :2]], dim=1).cpu().tolist()
        labels = item["labels"].cpu().tolist()
        scores = item["scores"].detach().cpu().tolist() if with_scores else None
        crowds = item["iscrowd"].cpu().tolist() if "iscrowd" in item else [0] * len(labels)
        areas = item["area"].detach().cpu().tolist() if "area" in item else [0.0] * len(labels)
        for k, (box, label) in enumerate(zip(xywh, labels, strict=True)):
            annotation = {
                "id": len(annotations) + 1,  # COCOeval needs ids from 1
                "image_id": image_id,
                "bbox": box,
                "area": areas[k] if areas[k] > 0 else box[2] * box[3],
                "category_id": label,
                "iscrowd": crowds[k],
            }
            if scores is not None:
                annotation["score"] = scores[k]
            annotations.append(annotation)
    return {
        "info": {"description": "lightning_balanced.detection.coco_map"},
        "images": images,
        "annotations": annotations,
        "categories": [{"id": c, "name": str(c)} for c in categories],
    }


def _check_thresholds(name: str, values: Sequence[float] | None) -> list[float] | None:
    if values is None:
        return None
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise ValueError(f"`{name}` must be a non-empty sequence of numbers in [0, 1], got {values!r}")
    out = [_check_real(name, v) for v in values]
    if any(not 0.0 <= v <= 1.0 for v in out):
        raise ValueError(f"`{name}` must hold numbers in [0, 1], got {values!r}")
    return out


def coco_map(
    predictions: Sequence[Mapping[str, Tensor]],
    targets: Sequence[Mapping[str, Tensor]],
    *,
    iou_thresholds: Sequence[float] | None = None,
    rec_thresholds: Sequence[float] | None = None,
    class_metrics: bool = False,
) -> dict[str, float]:
    """COCO-style box mAP and mAR of a whole evaluation set, computed by pycocotools' ``COCOeval``.

    Compute it on the *gathered* set (e.g. from :meth:`DistributedEvalMixin.gather_eval_outputs`): it runs no
    collective, so under DDP every rank computes it on the same data and gets the same floats. Images are identified
    by their position in the lists. The COCO records are built as torchmetrics' ``MeanAveragePrecision(
    backend="pycocotools", iou_type="bbox", box_format="xyxy")`` builds them, and the keys are the same, so the
    figures are those of that metric (which needs torchvision for its box conversion; this function does not). One
    difference: the default thresholds are pycocotools' own float64 ``np.linspace`` values, where torchmetrics rounds
    them to float32. A recall of ``k / G`` that equals a threshold (3/10 and 0.3) then falls on the other side of
    torchmetrics' rounding, which is common: figures differ by up to 1.5e-3 on the 60-image test set. Pass
    ``torch.linspace(0.5, 0.95, 10).tolist()`` and ``torch.linspace(0.0, 1.0, 101).tolist()`` to get that metric's
    figures exactly.

    Args:
        predictions (Sequence[dict[str, Tensor]]): one dict per image: ``"boxes"`` (Tensor[K, 4], floating point,
            ``(x1, y1, x2, y2)`` in pixels), ``"scores"`` (Tensor[K], floating point), ``"labels"`` (Tensor[K],
            integer), e.g. the output of :func:`postprocess_detections`. COCO keeps the 100 best-scoring
            detections of an image.
        targets (Sequence[dict[str, Tensor]]): one dict per image, in the order of ``predictions``: ``"boxes"``
            (Tensor[G, 4]) and ``"labels"`` (Tensor[G], integer); optionally ``"iscrowd"`` (Tensor[G], integer, 1 for
            crowd regions) and ``"area"`` (Tensor[G], floating point, in square pixels; where not positive, the box
            area is used), which decide the small/medium/large split as in COCO.
        iou_thresholds (Sequence[float], optional): IoU thresholds averaged over, each in ``[0, 1]``; default
            pycocotools' ``0.50:0.05:0.95``. ``map_50``/``map_75`` are -1 unless 0.5/0.75 are among them.
        rec_thresholds (Sequence[float], optional): recall points of the interpolated precision, each in ``[0, 1]``;
            default pycocotools' ``0:0.01:1``.
        class_metrics (bool): also report ``"map_per_class/<label>"`` and ``"mar_100_per_class/<label>"`` for every
            label present in the predictions or targets.

    Returns:
        dict[str, float]: ``map``, ``map_50``, ``map_75``, ``map_small``, ``map_medium``, ``map_large``, ``mar_1``,
        ``mar_10``, ``mar_100``, ``mar_small``, ``mar_medium``, ``mar_large`` (plus the per-class entries); -1.0 where
        COCO has nothing to measure (no ground truth in that category or area range, or no image at all).

    Raises:
        ImportError: if pycocotools is not installed (the ``lightning-balanced[detection]`` extra).
        TypeError: if an image entry is not a dict of tensors or a tensor has the wrong kind of dtype, or
            ``class_metrics`` is not a bool.
        ValueError: if ``predictions`` and ``targets`` differ in length, a key is missing, the shapes are not
            ``(K, 4)``/``(K,)``, or a threshold is outside ``[0, 1]``.

    Source: pycocotools ``COCOeval`` (``iouType="bbox"``), fed as in torchmetrics' ``MeanAveragePrecision``.
    """
    coco_module, cocoeval_module = _import_pycocotools()
    for name, seq in (("predictions", predictions), ("targets", targets)):
        if isinstance(seq, Mapping) or not isinstance(seq, Sequence):
            raise TypeError(f"`{name}` must be a sequence with one dict per image, got {type(seq).__name__}")
    if len(predictions) != len(targets):
        raise ValueError(
            f"`predictions` and `targets` must have one entry per image each, got {len(predictions)} and {len(targets)}"
        )
    if not isinstance(class_metrics, bool):
        raise TypeError(f"`class_metrics` must be a bool, got {type(class_metrics).__name__}")
    iou_list = _check_thresholds("iou_thresholds", iou_thresholds)
    rec_list = _check_thresholds("rec_thresholds", rec_thresholds)
    preds: list[dict[str, Tensor]] = []
    gts: list[dict[str, Tensor]] = []
    for items, checked, name, keys in (
        (predictions, preds, "predictions", ("boxes", "scores", "labels")),
        (targets, gts, "targets", ("boxes", "labels")),
    ):
        for i, item in enumerate(items):
            if not isinstance(item, Mapping):
                raise TypeError(f"`{name}[{i}]` must be a dict with keys {keys}, got {type(item).__name__}")
            if any(key not in item for key in keys):
                raise ValueError(f"`{name}[{i}]` lacks the key(s) {[key for key in keys if key not in item]}")
            checked.append(_check_boxes(item, keys, f"`{name}[{i}][{{!r}}]`".format))

    if not preds:
        return dict.fromkeys(_STAT_NAMES, -1.0)
    all_labels = torch.cat([item["labels"].cpu().to(torch.int64) for item in (*preds, *gts)])
    categories = [int(c) for c in torch.unique(all_labels).tolist()]

    import numpy as np  # a dependency of pycocotools

    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its progress
        coco_gt = coco_module.COCO()
        coco_gt.dataset = _coco_dataset(gts, categories, with_scores=False)
        coco_gt.createIndex()
        coco_dt = coco_module.COCO()
        coco_dt.dataset = _coco_dataset(preds, categories, with_scores=True)
        coco_dt.createIndex()

        def evaluate(category_ids: list[int] | None) -> list[float]:
            evaluator = cocoeval_module.COCOeval(coco_gt, coco_dt, iouType="bbox")
            if iou_list is not None:
                evaluator.params.iouThrs = np.array(iou_list, dtype=np.float64)
            if rec_list is not None:
                evaluator.params.recThrs = np.array(rec_list, dtype=np.float64)
            if category_ids is not None:
                evaluator.params.catIds = category_ids
            evaluator.evaluate()
            evaluator.accumulate()
            evaluator.summarize()
            return [float(value) for value in evaluator.stats]

        result = dict(zip(_STAT_NAMES, evaluate(None), strict=True))
        if class_metrics:
            for category in categories:
                stats = evaluate([category])
                result[f"map_per_class/{category}"] = stats[0]
                result[f"mar_100_per_class/{category}"] = stats[8]
    return result
