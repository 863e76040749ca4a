"""COCO mean average precision of a whole evaluation set (:func:`coco_map`), computed by pycocotools.

The detections come from :func:`~lightning_balanced.evaluation.detection.postprocess_detections`, gathered with
:class:`~lightning_balanced.evaluation.DistributedEvalMixin` (see :mod:`lightning_balanced.evaluation.detection`), so
every rank computes the mAP of the whole set, each image exactly once.
"""

from __future__ import annotations

import contextlib
import importlib
import io
from collections.abc import Mapping, Sequence
from types import ModuleType

import torch
from torch import Tensor

from lightning_balanced.arguments import check_real
from lightning_balanced.evaluation.detection import check_boxes

__all__ = ["coco_map"]

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
        "info": {"description": "lightning_balanced.evaluation.detection.coco_map"},
        "images": images,
        "annotations": annotations,
        "categories": [{"id": c, "name": str(c)} for c in categories],
    }


def _check_thresholds(name: str, values: Sequence[float] | None) -> list[float] | None:
    if values is None:
        return None
    if isinstance(values, (str, bytes)) or not isinstance(values, Sequence) or not values:
        raise ValueError(f"`{name}` must be a non-empty sequence of numbers in [0, 1], got {values!r}")
    return [check_real(f"{name}[{i}]", v, minimum=0, maximum=1) for i, v in enumerate(values)]


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
            checked.append(check_boxes(item, keys, f"`{name}[{i}][{{!r}}]`".format))

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
