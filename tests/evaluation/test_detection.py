"""Detection evaluation: postprocess_detections against a plain reference, coco_map, and exact mAP under real DDP."""

from __future__ import annotations

import math
import sys
import types
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import Tensor
from torch.utils.data import DataLoader, Dataset

from lightning_balanced.evaluation import DistributedEvalMixin, IndexedDataset, coco_map, postprocess_detections
from lightning_balanced.ops import nms_reference
from tests.distributed import run_distributed
from tests.helpers import quiet_trainer, whole_message

POST = {"iou_threshold": 0.5, "score_threshold": 0.3, "max_detections": 6}
NUM_IMAGES = 7
NUM_CLASSES = 3


# ---- postprocess_detections: a plain reference --------------------------------------------------------------------
def _reference_keep(
    boxes: Tensor, scores: Tensor, labels: Tensor, iou_threshold: float, score_threshold: float, max_detections: Any
) -> list[int]:
    """Score filter, then greedy NMS class by class (nms_reference), then the best ``max_detections`` overall."""
    candidates = torch.nonzero(scores > score_threshold).flatten().tolist()
    kept: list[int] = []
    for label in sorted({int(labels[i]) for i in candidates}):
        members = [i for i in candidates if int(labels[i]) == label]
        local = nms_reference(boxes[members], scores[members], iou_threshold).tolist()
        kept += [members[j] for j in local]
    kept.sort(key=lambda i: (-float(scores[i]), i))  # decreasing score, equal scores by lower index
    return kept if max_detections is None else kept[:max_detections]


def _assert_matches_reference(boxes: Tensor, scores: Tensor, labels: Tensor, **kwargs: Any) -> dict[str, Tensor]:
    out = postprocess_detections(boxes, scores, labels, **kwargs)
    keep = _reference_keep(boxes, scores, labels, **kwargs)
    assert torch.equal(out["boxes"], boxes[keep])
    assert torch.equal(out["scores"], scores[keep])
    assert torch.equal(out["labels"], labels[keep].to(torch.int64))
    assert out["labels"].dtype == torch.int64
    assert out["boxes"].dtype == boxes.dtype and out["scores"].dtype == scores.dtype
    return out


def _random_candidates(seed: int, n: int, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    g = torch.Generator().manual_seed(seed)
    xy = torch.randint(0, 40, (n, 2), generator=g).to(torch.float64)
    wh = torch.randint(1, 25, (n, 2), generator=g).to(torch.float64)
    boxes = torch.cat([xy, xy + wh], dim=1).to(dtype)  # integer pixels: many overlaps, some equal IoUs
    scores = (torch.randint(0, 9, (n,), generator=g) / 8).to(dtype)  # multiples of 1/8: many ties
    labels = torch.randint(0, 3, (n,), generator=g, dtype=torch.int32)
    return boxes, scores, labels


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_postprocess_matches_filter_then_per_class_nms_then_topk(dtype: torch.dtype) -> None:
    for seed in range(20):
        boxes, scores, labels = _random_candidates(seed, n=5 + 3 * seed, dtype=dtype)
        for iou, score_threshold, max_detections in [(0.5, 0.3, None), (0.3, 0.0, 4), (0.7, 0.5, 1), (1.0, -1.0, 50)]:
            _assert_matches_reference(
                boxes,
                scores,
                labels,
                iou_threshold=iou,
                score_threshold=score_threshold,
                max_detections=max_detections,
            )


def test_postprocess_equal_scores_keep_the_lower_index_first_also_at_the_topk_cut() -> None:
    boxes = torch.tensor([[0.0, 0, 10, 10], [20, 0, 30, 10], [40, 0, 50, 10], [60, 0, 70, 10]])
    scores = torch.tensor([0.5, 0.9, 0.5, 0.5])
    labels = torch.tensor([0, 1, 0, 2])
    out = _assert_matches_reference(boxes, scores, labels, iou_threshold=0.5, score_threshold=0.1, max_detections=3)
    assert out["scores"].tolist() == pytest.approx([0.9, 0.5, 0.5])
    assert torch.equal(out["boxes"], boxes[[1, 0, 2]])  # index 3 ties with 0 and 2 and is cut


def test_postprocess_score_threshold_is_strict_and_nms_is_per_class() -> None:
    boxes = torch.tensor([[0.0, 0, 10, 10], [0, 0, 10, 10], [0, 0, 10, 10], [1, 1, 11, 11]])
    scores = torch.tensor([0.5, 0.8, 0.7, 0.6])
    labels = torch.tensor([0, 0, 1, 0])
    out = postprocess_detections(boxes, scores, labels, iou_threshold=0.5, score_threshold=0.5, max_detections=None)
    # 0.5 is not > 0.5; box 3 (IoU 0.68 with box 1, same class) is suppressed; box 2 has another class
    assert out["scores"].tolist() == pytest.approx([0.8, 0.7])
    assert out["labels"].tolist() == [0, 1]


def test_postprocess_defaults_are_torchvisions() -> None:
    boxes, scores, labels = _random_candidates(7, n=300, dtype=torch.float32)
    boxes = boxes + 100 * torch.arange(300, dtype=torch.float32)[:, None]  # no overlaps: only the top-k cuts
    scores = scores * 0.9 + 0.1  # all > 0.05
    out = postprocess_detections(boxes, scores, labels)
    expected = _reference_keep(boxes, scores, labels, 0.5, 0.05, 100)
    assert len(expected) == 100
    assert torch.equal(out["boxes"], boxes[expected])


@pytest.mark.parametrize(
    ("boxes", "scores", "labels"),
    [
        (torch.zeros(0, 4), torch.zeros(0), torch.zeros(0, dtype=torch.int64)),  # empty input
        (torch.tensor([[0.0, 0, 5, 5], [1, 1, 6, 6]]), torch.tensor([0.1, 0.3]), torch.tensor([0, 1])),  # all <= 0.3
    ],
    ids=["empty", "all-below-threshold"],
)
def test_postprocess_without_survivors_gives_empty_tensors_of_the_right_shapes(
    boxes: Tensor, scores: Tensor, labels: Tensor
) -> None:
    out = postprocess_detections(boxes, scores, labels, iou_threshold=0.5, score_threshold=0.3, max_detections=5)
    assert out["boxes"].shape == (0, 4) and out["boxes"].dtype == torch.float32
    assert out["scores"].shape == (0,) and out["scores"].dtype == torch.float32
    assert out["labels"].shape == (0,) and out["labels"].dtype == torch.int64


def test_postprocess_max_detections_smaller_than_the_survivors_keeps_the_best() -> None:
    boxes = torch.tensor([[10.0 * i, 0, 10 * i + 5, 5] for i in range(6)])
    scores = torch.tensor([0.2, 0.9, 0.4, 0.8, 0.6, 0.7])
    labels = torch.zeros(6, dtype=torch.int64)
    out = _assert_matches_reference(boxes, scores, labels, iou_threshold=0.5, score_threshold=0.0, max_detections=2)
    assert out["scores"].tolist() == pytest.approx([0.9, 0.8])


_B, _S, _L = torch.zeros(3, 4), torch.zeros(3), torch.zeros(3, dtype=torch.int64)


@pytest.mark.parametrize(
    ("args", "kwargs", "error", "match"),
    [
        (([[0, 0, 1, 1]], _S[:1], _L[:1]), {}, TypeError, "`boxes` must be a torch.Tensor"),
        ((_B, [0.0, 0, 0], _L), {}, TypeError, "`scores` must be a torch.Tensor"),
        ((_B, _S, [0, 0, 0]), {}, TypeError, "`labels` must be a torch.Tensor"),
        ((torch.zeros(3, 5), _S, _L), {}, ValueError, r"`boxes` must have shape \(N, 4\), got \(3, 5\)"),
        ((_B, torch.zeros(2), _L), {}, ValueError, r"`scores` must have shape \(N,\) with N = 3"),
        ((_B, _S, torch.zeros(3, 1, dtype=torch.int64)), {}, ValueError, r"`labels` must have shape \(N,\)"),
        ((_B.long(), _S, _L), {}, TypeError, "`boxes` must be float16"),
        ((_B, _S.double(), _L), {}, TypeError, r"`scores` must have the dtype of `boxes` \(torch.float32\)"),
        ((_B, _S, _L.float()), {}, TypeError, "`labels` must have an integer dtype"),
        ((_B, _S, _L.bool()), {}, TypeError, "`labels` must have an integer dtype"),
        ((_B, torch.tensor([0.0, math.nan, 1]), _L), {}, ValueError, "`scores` must be finite"),
        ((torch.tensor([[0.0, 0, math.inf, 1]] * 3), _S, _L), {}, ValueError, "`boxes` must be finite"),
        # iou_threshold is checked by batched_nms (on every input, an empty one included): its whole message, as the
        # op tests match them (a compiled op with a private libstdc++ cut its messages short)
        (
            (_B, _S, _L),
            {"iou_threshold": 1.5},
            ValueError,
            whole_message("batched_nms: iou_threshold must be a number in [0, 1], got 1.5"),
        ),
        (
            (_B[:0], _S[:0], _L[:0]),
            {"iou_threshold": -0.5},
            ValueError,
            whole_message("batched_nms: iou_threshold must be a number in [0, 1], got -0.5"),
        ),
        (
            (_B, _S, _L),
            {"iou_threshold": "0.5"},
            TypeError,
            whole_message("batched_nms: iou_threshold must be a real number, got str"),
        ),
        ((_B, _S.double(), _L.double()), {}, TypeError, "`labels` must have an integer dtype"),
        ((_B, _S.int(), _L), {}, TypeError, "`scores` must be float16, bfloat16, float32 or float64"),
        ((_B, _S, _L), {"score_threshold": math.nan}, ValueError, whole_message("`score_threshold` must not be NaN")),
        (
            (_B, _S, _L),
            {"score_threshold": None},
            TypeError,
            whole_message("`score_threshold` must be a real number, got None of type NoneType"),
        ),
        ((_B, _S, _L), {"max_detections": 0}, ValueError, "`max_detections` must be >= 1 or None, got 0"),
        ((_B, _S, _L), {"max_detections": 2.0}, TypeError, "`max_detections` must be an int or None"),
        ((_B, _S, _L), {"max_detections": True}, TypeError, "`max_detections` must be an int or None"),
    ],
)
def test_postprocess_rejects_bad_input_naming_the_argument(
    args: tuple[Any, ...], kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        postprocess_detections(*args, **kwargs)


# ---- a small synthetic detection set, deterministic from the image index ------------------------------------------
def _image(index: int) -> dict[str, Tensor]:
    """Ground truth and scored proposals of one image (pixels, (x1, y1, x2, y2)): 1-4 objects, jittered proposals
    around them (some with the wrong class), random false positives; image 4 has no object, image 3 only
    low-scoring proposals (no detection survives)."""
    g = torch.Generator().manual_seed(1000 + index)
    num_gt = 0 if index == 4 else 1 + (3 * index) % 4
    xy = torch.rand(num_gt, 2, generator=g) * 120
    wh = 8 + torch.rand(num_gt, 2, generator=g) * 120  # small, medium and large objects
    gt_boxes = torch.cat([xy, xy + wh], dim=1)
    gt_labels = torch.randint(0, NUM_CLASSES, (num_gt,), generator=g)
    proposals, labels = [], []
    for box, label in zip(gt_boxes, gt_labels, strict=True):
        size = (box[2:] - box[:2]).repeat(2)
        for spread in (0.05, 0.15, 0.35):
            proposals.append(box + torch.randn(4, generator=g) * spread * size)
            labels.append(int(label) if torch.rand((), generator=g) > 0.2 else (int(label) + 1) % NUM_CLASSES)
    for _ in range(3):
        xy = torch.rand(2, generator=g) * 150
        proposals.append(torch.cat([xy, xy + 10 + torch.rand(2, generator=g) * 50]))
        labels.append(int(torch.randint(0, NUM_CLASSES, (), generator=g)))
    scores = torch.rand(len(proposals), generator=g)
    if index == 3:
        scores = scores * 0.25  # all below POST's score_threshold
    return {
        "proposal_boxes": torch.stack(proposals),
        "proposal_scores": scores,
        "proposal_labels": torch.tensor(labels),
        "gt_boxes": gt_boxes,
        "gt_labels": gt_labels,
    }


class SyntheticDetection(Dataset):
    def __len__(self) -> int:
        return NUM_IMAGES

    def __getitem__(self, index: int) -> dict[str, Tensor]:
        return _image(index)


def _single_process() -> tuple[list[dict[str, Tensor]], list[dict[str, Tensor]]]:
    """Post-processed predictions and targets of the whole set, in order, in this process."""
    images = [_image(i) for i in range(NUM_IMAGES)]
    preds = [
        postprocess_detections(im["proposal_boxes"], im["proposal_scores"], im["proposal_labels"], **POST)
        for im in images
    ]
    targets = [{"boxes": im["gt_boxes"], "labels": im["gt_labels"]} for im in images]
    return preds, targets


def test_synthetic_set_has_the_edge_cases_it_claims() -> None:
    preds, targets = _single_process()
    assert preds[3]["boxes"].shape == (0, 4)
    assert targets[4]["boxes"].shape == (0, 4) and preds[4]["boxes"].shape[0] > 0
    assert any(p["boxes"].shape[0] == POST["max_detections"] for p in preds)


# ---- coco_map -----------------------------------------------------------------------------------------------------
def test_coco_map_of_perfect_predictions_is_one_and_returns_plain_floats() -> None:
    _, targets = _single_process()
    preds = [{**t, "scores": torch.linspace(0.9, 0.5, t["labels"].numel())} for t in targets]
    result = coco_map(preds, targets)
    assert all(type(v) is float for v in result.values())
    assert result["map"] == 1.0 and result["map_50"] == 1.0 and result["mar_100"] == 1.0
    assert set(result) >= {"map", "map_50", "map_75", "map_small", "map_medium", "map_large", "mar_1", "mar_100"}


def _real_torchvision() -> str | None:
    """Why real torchvision cannot be used here, or None when it imports."""
    try:
        import torchvision  # noqa: F401
    except Exception as err:  # ImportError, or a torch/torchvision mismatch failing at import
        return f"torchvision does not import here ({type(err).__name__}: {err})"
    return None


_NO_TORCHVISION = _real_torchvision()


def _torchmetrics_map(
    monkeypatch: pytest.MonkeyPatch | None,
    preds: list[dict[str, Tensor]],
    targets: list[dict[str, Tensor]],
    **kwargs: Any,
) -> dict[str, Tensor]:
    """torchmetrics' MeanAveragePrecision (pycocotools backend). It needs torchvision only for ``box_convert``; with
    ``monkeypatch``, a stand-in does that conversion (xyxy -> xywh: x1, y1, x2 - x1, y2 - y1) and everything else is
    torchmetrics' own code; without, torchmetrics runs with the real torchvision."""
    from torchmetrics.detection import mean_ap

    # Its "torchvision is usable" flag: _TORCHVISION_GREATER_EQUAL_0_8 in torchmetrics 1.4, then _TORCHVISION_AVAILABLE.
    flag = "_TORCHVISION_AVAILABLE" if hasattr(mean_ap, "_TORCHVISION_AVAILABLE") else "_TORCHVISION_GREATER_EQUAL_0_8"
    if monkeypatch is not None:
        stub = types.ModuleType("torchvision")
        ops = types.ModuleType("torchvision.ops")

        def box_convert(boxes: Tensor, in_fmt: str, out_fmt: str) -> Tensor:
            assert (in_fmt, out_fmt) == ("xyxy", "xywh")
            x1, y1, x2, y2 = boxes.unbind(-1)
            return torch.stack((x1, y1, x2 - x1, y2 - y1), dim=-1)

        ops.box_convert = box_convert  # type: ignore[attr-defined]
        stub.ops = ops  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "torchvision", stub)
        monkeypatch.setitem(sys.modules, "torchvision.ops", ops)
        monkeypatch.setattr(mean_ap, flag, True)
    else:
        assert getattr(mean_ap, flag) and "box_convert" in dir(sys.modules["torchvision.ops"])
    metric = mean_ap.MeanAveragePrecision(backend="pycocotools", iou_type="bbox", sync_on_compute=False, **kwargs)
    metric.update(preds, targets)
    return metric.compute()  # type: ignore[no-any-return]


def _assert_same_figures(ours: dict[str, float], expected: dict[str, Tensor]) -> None:
    for key, value in ours.items():
        if "/" in key:
            name, label = key.split("/")
            position = expected["classes"].tolist().index(int(label))
            assert value == pytest.approx(float(expected[name][position]), abs=1e-6), key
        else:
            assert value == pytest.approx(float(expected[key]), abs=1e-6), key  # torchmetrics rounds to float32


# Where real torchvision imports (the torch 2.14 CI leg), torchmetrics runs with it; elsewhere (the torch 2.13 leg),
# the same comparison runs with a stand-in for its one torchvision call.
@pytest.mark.parametrize(
    "backend",
    [
        pytest.param("real", marks=pytest.mark.skipif(_NO_TORCHVISION is not None, reason=str(_NO_TORCHVISION))),
        pytest.param(
            "stub",
            marks=pytest.mark.skipif(_NO_TORCHVISION is None, reason="real torchvision imports: the real test runs"),
        ),
    ],
)
def test_coco_map_gives_the_figures_of_torchmetrics_mean_average_precision(
    backend: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    preds, targets = _single_process()
    thresholds = {
        "iou_thresholds": torch.linspace(0.5, 0.95, 10).tolist(),  # torchmetrics' float32 defaults, given to both
        "rec_thresholds": torch.linspace(0.0, 1.0, 101).tolist(),
    }
    stub = monkeypatch if backend == "stub" else None
    expected = _torchmetrics_map(stub, preds, targets, class_metrics=True, **thresholds)
    ours = coco_map(preds, targets, class_metrics=True, **thresholds)
    _assert_same_figures(ours, expected)
    assert 0.1 < ours["map"] < 0.9  # a set that discriminates
    assert sorted(k for k in ours if k.startswith("map_per_class/")) == [f"map_per_class/{c}" for c in range(3)]
    defaults = coco_map(preds, targets)
    assert {k: defaults[k] for k in defaults} == {k: ours[k] for k in defaults}  # no edge case in this set


@pytest.mark.skipif(_NO_TORCHVISION is not None, reason=str(_NO_TORCHVISION))
def test_coco_map_equals_torchmetrics_with_real_torchvision_on_a_larger_set_with_crowds() -> None:
    """60 images: crowd regions, images without objects or detections, float64 boxes, and the default thresholds."""
    preds, targets = [], []
    for index in range(60):
        image = _image(index)
        preds.append(
            postprocess_detections(
                image["proposal_boxes"].double(), image["proposal_scores"].double(), image["proposal_labels"], **POST
            )
        )
        crowd = (torch.arange(image["gt_labels"].numel()) % 3 == 2).to(torch.int64)
        targets.append({"boxes": image["gt_boxes"].double(), "labels": image["gt_labels"], "iscrowd": crowd})
    assert any(t["iscrowd"].any() for t in targets) and any(p["boxes"].numel() == 0 for p in preds)
    float32_thresholds = {
        "iou_thresholds": torch.linspace(0.5, 0.95, 10).tolist(),  # torchmetrics' defaults: float32 linspaces
        "rec_thresholds": torch.linspace(0.0, 1.0, 101).tolist(),
    }
    expected = _torchmetrics_map(None, preds, targets, class_metrics=True)  # torchmetrics' defaults
    _assert_same_figures(coco_map(preds, targets, class_metrics=True, **float32_thresholds), expected)
    # With pycocotools' float64 defaults, a recall that equals a threshold (k / G, e.g. 3 / 10) counts on the other
    # side of torchmetrics' float32 one: the documented difference, visible on this set.
    defaults = coco_map(preds, targets)
    differences = {k: abs(defaults[k] - float(expected[k])) for k in defaults}
    assert 0 < max(differences.values()) < 1e-2, differences


def test_coco_map_of_no_image_is_minus_one() -> None:
    assert set(coco_map([], []).values()) == {-1.0}


def test_coco_map_without_pycocotools_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("pycocotools", "pycocotools.coco", "pycocotools.cocoeval"):
        monkeypatch.setitem(sys.modules, name, None)
    with pytest.raises(ImportError, match=r"lightning-balanced\[detection\]"):
        coco_map([], [])


_P = {"boxes": torch.zeros(1, 4), "scores": torch.ones(1), "labels": torch.zeros(1, dtype=torch.int64)}
_T = {"boxes": torch.zeros(1, 4), "labels": torch.zeros(1, dtype=torch.int64)}


@pytest.mark.parametrize(
    ("preds", "targets", "kwargs", "error", "match"),
    [
        ([_P, _P], [_T], {}, ValueError, "one entry per image each, got 2 and 1"),
        (_P, _T, {}, TypeError, "`predictions` must be a sequence"),
        ([{"boxes": _P["boxes"], "labels": _P["labels"]}], [_T], {}, ValueError, r"predictions\[0\]` lacks .*scores"),
        ([_P], [{**_T, "boxes": torch.zeros(1, 5)}], {}, ValueError, r"targets\[0\]\['boxes'\]` must have shape"),
        ([_P], [{**_T, "labels": torch.zeros(2, dtype=torch.int64)}], {}, ValueError, r"targets\[0\]\['labels'\]"),
        ([{**_P, "labels": torch.zeros(1)}], [_T], {}, TypeError, "must have an integer dtype"),
        ([{**_P, "scores": [1.0]}], [_T], {}, TypeError, r"predictions\[0\]\['scores'\]` must be a torch.Tensor"),
        (
            [_P],
            [_T],
            {"iou_thresholds": [0.5, 1.5]},
            ValueError,
            whole_message("`iou_thresholds[1]` must be in [0, 1], got 1.5"),
        ),
        (
            [_P],
            [_T],
            {"rec_thresholds": [math.nan]},
            ValueError,
            whole_message("`rec_thresholds[0]` must be in [0, 1], got nan"),
        ),
        (
            [_P],
            [_T],
            {"iou_thresholds": [0.5, "0.7"]},
            TypeError,
            whole_message("`iou_thresholds[1]` must be a real number, got '0.7' of type str"),
        ),
        ([_P], [_T], {"class_metrics": 1}, TypeError, "`class_metrics` must be a bool"),
    ],
)
def test_coco_map_rejects_bad_input(
    preds: Any, targets: Any, kwargs: dict[str, Any], error: type[Exception], match: str
) -> None:
    with pytest.raises(error, match=match):
        coco_map(preds, targets, **kwargs)


# ---- exact mAP under real DDP (gloo): every rank gets the single-process figure -----------------------------------
def _collate(items: list[tuple[int, dict[str, Tensor]]]) -> tuple[Tensor, list[dict[str, Tensor]]]:
    """Keeps one dict of tensors per image (detection images have different numbers of boxes)."""
    return torch.tensor([index for index, _ in items]), [sample for _, sample in items]


class DetectionEvalModule(DistributedEvalMixin, pl.LightningModule):
    """Post-processes each image's proposals and evaluates COCO mAP exactly over all ranks."""

    def __init__(self) -> None:
        super().__init__()
        self.local: list[tuple[int, dict[str, Tensor], dict[str, Tensor]]] = []  # what this rank saw, for the test
        self.result: dict[str, Any] = {}

    def validation_step(self, batch: tuple[Tensor, list[dict[str, Tensor]]], batch_idx: int) -> None:
        indices, samples = batch
        dets = [
            postprocess_detections(s["proposal_boxes"], s["proposal_scores"], s["proposal_labels"], **POST)
            for s in samples
        ]
        self.add_eval_outputs(
            indices,
            pred_boxes=[d["boxes"] for d in dets],
            pred_scores=[d["scores"] for d in dets],
            pred_labels=[d["labels"] for d in dets],
            gt_boxes=[s["gt_boxes"] for s in samples],
            gt_labels=[s["gt_labels"] for s in samples],
        )
        for index, det, sample in zip(indices.tolist(), dets, samples, strict=True):
            self.local.append((index, det, {"boxes": sample["gt_boxes"], "labels": sample["gt_labels"]}))

    def on_validation_epoch_end(self) -> None:
        out = self.gather_eval_outputs()
        preds = [
            {"boxes": b, "scores": s, "labels": lab}
            for b, s, lab in zip(out["pred_boxes"], out["pred_scores"], out["pred_labels"], strict=True)
        ]
        targets = [{"boxes": b, "labels": lab} for b, lab in zip(out["gt_boxes"], out["gt_labels"], strict=True)]
        self.result = {
            "indices": out["indices"].tolist(),
            "preds": preds,
            "targets": targets,
            "map": coco_map(preds, targets),
        }


def _ddp_detection_rank(rank: int, world_size: int) -> dict[str, Any]:
    model = DetectionEvalModule()
    trainer = quiet_trainer("ddp", world_size)
    loader = DataLoader(IndexedDataset(SyntheticDetection()), batch_size=2, collate_fn=_collate)
    trainer.validate(model, loader, verbose=False)
    return {**model.result, "local": model.local}


# 3 ranks pass too (two padded repeats) but cost 20-30 s more on a 2-core machine; add 3 here to run them.
@pytest.mark.parametrize("world_size", [2])
@pytest.mark.slow
def test_ddp_coco_map_on_every_rank_equals_the_single_process_map(world_size: int) -> None:
    preds, targets = _single_process()
    expected = coco_map(preds, targets)
    results = run_distributed(_ddp_detection_rank, world_size)

    for rank, result in enumerate(results):
        assert result["indices"] == list(range(NUM_IMAGES)), rank  # each image once, in order
        assert result["map"] == expected, rank  # the same floats, exactly
        for got, want in zip(result["preds"], preds, strict=True):
            assert all(torch.equal(got[k], want[k]) for k in ("boxes", "scores", "labels"))
        for got, want in zip(result["targets"], targets, strict=True):
            assert all(torch.equal(got[k], want[k]) for k in ("boxes", "labels"))

    # DistributedSampler padded the ranks with repeats of the first images; naively concatenating the local sets
    # counts them twice and gives another mAP.
    local = [entry for result in results for entry in result["local"]]
    padded = -NUM_IMAGES % world_size
    assert sorted(index for index, _, _ in local) == sorted([*range(NUM_IMAGES), *range(padded)])
    naive = coco_map([det for _, det, _ in local], [gt for _, _, gt in local])
    assert naive["map"] != expected["map"]
