"""nms / batched_nms against real torchvision (skipped where torchvision does not import).

``nms`` must equal ``torchvision.ops.nms`` exactly. ``batched_nms`` must keep the same set as
``torchvision.ops.batched_nms`` and give the same order, except where one of the differences documented in
:func:`lightning_balanced.ops.batched_nms` applies; each of those is asserted here as exactly that difference.
"""

from __future__ import annotations

import pytest
import torch

from lightning_balanced.ops import batched_nms, has_compiled_ops, nms

torchvision = pytest.importorskip("torchvision", reason="torchvision does not import here")
tv_ops = torchvision.ops

pytestmark = pytest.mark.skipif(not has_compiled_ops(), reason="needs the compiled lightning_balanced._C extension")

THRESHOLDS = [0.0, 0.3, 0.5, 0.7, 0.95]
# With integer coordinates an IoU can equal a threshold like 0.3 exactly, where the float32 rounding differs
# (difference 4 below); thresholds exact in float32 avoid that: IoUs of integer boxes are then never within a
# rounding error of the threshold without being equal to it, and equal compares alike.
DYADIC_THRESHOLDS = [0.0, 0.25, 0.5, 0.75, 0.9375]


def _layout(kind: str, n: int, seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    """Boxes with non-negative coordinates (torchvision's documented domain) and scores."""
    gen = torch.Generator().manual_seed(seed)
    if kind == "random":
        xy = torch.rand(n, 2, generator=gen) * 300
        boxes = torch.cat([xy, xy + torch.rand(n, 2, generator=gen) * 60 + 1], dim=1)
        scores = torch.rand(n, generator=gen)
    elif kind == "clustered":  # detector-like: jittered proposals around a few objects
        centers = torch.rand(6, 2, generator=gen) * 200 + 50
        owner = torch.randint(0, 6, (n,), generator=gen)
        c = centers[owner] + torch.randn(n, 2, generator=gen) * 4
        half = 15 + torch.rand(n, 2, generator=gen) * 10
        boxes = torch.cat([c - half, c + half], dim=1)
        scores = torch.rand(n, generator=gen)
    elif kind == "duplicate":  # each box several times, with different scores
        base, _ = _layout("random", (n + 3) // 4, seed, torch.float64)
        boxes = base.repeat(4, 1)[:n]
        scores = torch.rand(boxes.shape[0], generator=gen)
    elif kind == "tied":  # few distinct scores: order among ties decides
        boxes, _ = _layout("clustered", n, seed, torch.float64)
        scores = torch.randint(0, 4, (n,), generator=gen).double()
    elif kind == "degenerate":  # points, zero width/height, x2 < x1 among normal boxes
        boxes, scores = _layout("random", n, seed, torch.float64)
        which = torch.randint(0, 4, (n,), generator=gen)
        boxes[which == 0, 2] = boxes[which == 0, 0]
        boxes[which == 1, 3] = boxes[which == 1, 1]
        boxes[which == 2, 2] = boxes[which == 2, 0] - 5
    else:
        raise AssertionError(kind)
    return boxes.to(dtype), scores.to(dtype)


def _per_class_tv(boxes: torch.Tensor, scores: torch.Tensor, idxs: torch.Tensor, thr: float) -> torch.Tensor:
    """torchvision.ops.nms run on each class, merged by decreasing score, ties by lower index (our semantics)."""
    keep = torch.zeros(boxes.shape[0], dtype=torch.bool)
    for c in torch.unique(idxs):
        members = torch.nonzero(idxs == c).flatten()
        keep[members[tv_ops.nms(boxes[members], scores[members], thr)]] = True
    kept = torch.nonzero(keep).flatten()
    return kept[torch.sort(scores[kept], descending=True, stable=True).indices]


# --------------------------------------------------------------------------------------------------------------
# nms: exactly torchvision's
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["random", "clustered", "duplicate", "tied", "degenerate"])
@pytest.mark.parametrize("n", [1, 37, 500, 3000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_nms_equals_torchvision(kind: str, n: int, dtype: torch.dtype) -> None:
    boxes, scores = _layout(kind, n, seed=n, dtype=dtype)
    for thr in THRESHOLDS:
        assert torch.equal(nms(boxes, scores, thr), tv_ops.nms(boxes, scores, thr)), (kind, n, thr)


def test_nms_equals_torchvision_on_non_contiguous_inputs() -> None:
    boxes, scores = _layout("clustered", 800, seed=3)
    wide = torch.zeros(800, 8)
    wide[:, 1::2] = boxes
    strided_boxes, strided_scores = wide[:, 1::2], torch.stack([scores, scores], dim=1)[:, 1]
    assert not strided_boxes.is_contiguous() and not strided_scores.is_contiguous()
    for thr in THRESHOLDS:
        assert torch.equal(nms(strided_boxes, strided_scores, thr), tv_ops.nms(boxes, scores, thr))


def test_empty_nms_equals_torchvision() -> None:
    boxes, scores = torch.zeros(0, 4), torch.zeros(0)
    ours, theirs = nms(boxes, scores, 0.5), tv_ops.nms(boxes, scores, 0.5)
    assert torch.equal(ours, theirs) and ours.dtype == theirs.dtype == torch.int64


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_types_match_torchvision_under_cpu_autocast(dtype: torch.dtype) -> None:
    """Both compute in float32 under autocast. torchvision's batched_nms adds its class offset in the input dtype
    (outside the autocast op), where half precision rounds it (difference 1); so batched_nms is compared with
    torchvision's nms per class, and with its batched_nms directly on float16 integer coordinates (exact there)."""
    boxes, scores = _layout("clustered", 600, seed=9, dtype=dtype)
    idxs = torch.randint(0, 5, (600,), generator=torch.Generator().manual_seed(0))
    whole = boxes.float().round().to(dtype)
    with torch.autocast("cpu", dtype=dtype):
        for thr in (0.3, 0.5, 0.7):
            assert torch.equal(nms(boxes, scores, thr), tv_ops.nms(boxes, scores, thr))
            assert torch.equal(batched_nms(boxes, scores, idxs, thr), _per_class_tv(boxes, scores, idxs, thr))
        if dtype == torch.float16:
            for thr in DYADIC_THRESHOLDS:
                expected = tv_ops.batched_nms(whole, scores, idxs, thr)
                assert torch.equal(batched_nms(whole, scores, idxs, thr), expected)


# --------------------------------------------------------------------------------------------------------------
# batched_nms: torchvision's kept set everywhere, its order outside the documented differences
# --------------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["random", "clustered", "duplicate", "degenerate"])
@pytest.mark.parametrize(("n", "classes"), [(10, 3), (400, 5), (1000, 80), (3000, 80)])
def test_batched_nms_equals_torchvision_on_integer_coordinates(kind: str, n: int, classes: int) -> None:
    """Integer coordinates and distinct scores: the offset trick is exact and no tie decides, so all agrees.

    N <= 1000 exercises torchvision's coordinate-offset path, N > 1000 its per-class path.
    """
    boxes, _ = _layout(kind, n, seed=n + classes)
    boxes = boxes.round()
    scores = torch.randperm(n, generator=torch.Generator().manual_seed(n)).float() / n  # distinct
    idxs = torch.randint(0, classes, (n,), generator=torch.Generator().manual_seed(classes))
    for thr in DYADIC_THRESHOLDS:
        assert torch.equal(batched_nms(boxes, scores, idxs, thr), tv_ops.batched_nms(boxes, scores, idxs, thr))


@pytest.mark.parametrize("kind", ["random", "clustered", "tied"])
@pytest.mark.parametrize("n", [400, 3000])
def test_batched_nms_equals_nms_per_class_of_torchvision(kind: str, n: int) -> None:
    """Any coordinates and ties: our batched_nms is torchvision's nms run per class (the definition)."""
    boxes, scores = _layout(kind, n, seed=n)
    idxs = torch.randint(0, 7, (n,), generator=torch.Generator().manual_seed(1))
    for thr in THRESHOLDS:
        assert torch.equal(batched_nms(boxes, scores, idxs, thr), _per_class_tv(boxes, scores, idxs, thr))


def test_difference_offset_trick_loses_precision() -> None:
    """Documented difference 1: torchvision's coordinate-offset path (N <= 1000 on CPU) shifts class c by
    ``c * (max coordinate + 1)``; in float32 far-away classes lose the low bits of their coordinates, so IoUs
    near the threshold change. We compute on the original coordinates (= torchvision's nms per class)."""
    boxes, scores = _layout("clustered", 600, seed=4)
    idxs = torch.randint(0, 3, (600,), generator=torch.Generator().manual_seed(2)) * 100_000
    thr = 0.5
    ours, theirs = batched_nms(boxes, scores, idxs, thr), tv_ops.batched_nms(boxes, scores, idxs, thr)
    assert torch.equal(ours, _per_class_tv(boxes, scores, idxs, thr))
    offsets = idxs.to(boxes) * (boxes.max() + 1)
    assert torch.equal(theirs, tv_ops.nms(boxes + offsets[:, None], scores, thr))  # exactly the offset trick
    assert not torch.equal(ours, theirs)  # and here it changes the result


def test_difference_offset_trick_with_negative_coordinates_mixes_classes() -> None:
    """Documented difference 2: with negative coordinates (outside torchvision's documented ``0 <= x1``) the
    offset is too small to separate classes, so torchvision lets boxes of different classes suppress each other."""
    # max coordinate 1, so class 1 is shifted by +2: box 1 lands exactly on box 0.
    boxes = torch.tensor([[-100.0, -100.0, -50.0, -50.0], [-102.0, -102.0, -52.0, -52.0], [0.0, 0.0, 1.0, 1.0]])
    scores = torch.tensor([0.9, 0.8, 0.7])
    idxs = torch.tensor([0, 1, 0])  # boxes 0 and 1 are of different classes: they must not suppress each other
    assert tv_ops.batched_nms(boxes, scores, idxs, 0.5).tolist() == [0, 2]
    assert batched_nms(boxes, scores, idxs, 0.5).tolist() == [0, 1, 2]


def test_difference_tie_order_above_1000_boxes() -> None:
    """Documented difference 3: above 1000 boxes (4000 coordinates) torchvision merges the classes with an
    unstable sort, so boxes with equal scores may come in any order; we keep the lower index first. The kept
    set is the same and the order is the same up to ties."""
    n = 4000
    boxes, _ = _layout("random", n, seed=5)
    boxes = boxes.round()
    scores = torch.randint(0, 3, (n,), generator=torch.Generator().manual_seed(6)).float()
    idxs = torch.randint(0, 80, (n,), generator=torch.Generator().manual_seed(7))
    ours, theirs = batched_nms(boxes, scores, idxs, 0.5), tv_ops.batched_nms(boxes, scores, idxs, 0.5)
    assert torch.equal(torch.sort(ours).values, torch.sort(theirs).values)  # same set
    assert torch.equal(scores[ours], scores[theirs])  # same order of scores
    stable = theirs[torch.sort(theirs).indices]  # torchvision's set ordered by (score desc, index asc):
    stable = stable[torch.sort(scores[stable], descending=True, stable=True).indices]
    assert torch.equal(ours, stable)


@pytest.mark.parametrize("op", ["nms", "batched_nms"])
def test_difference_float32_rounding_when_iou_equals_the_threshold(op: str) -> None:
    """Documented difference 4: torchvision divides in float32 (IoU 1/3 becomes 0.33333334) and compares with the
    float64 threshold, so an IoU exactly equal to the threshold can suppress; we test ``inter > thr * union`` with
    the threshold rounded to the compute dtype, so IoU == threshold never suppresses. float64 input agrees."""
    boxes = torch.tensor([[0.0, 0.0, 2.0, 1.0], [1.0, 0.0, 3.0, 1.0]])  # IoU exactly 1/3
    scores = torch.tensor([0.9, 0.8])
    idxs = torch.zeros(2, dtype=torch.int64)

    def run(impl_nms, impl_batched, b: torch.Tensor, s: torch.Tensor) -> list[int]:
        out = impl_nms(b, s, 1 / 3) if op == "nms" else impl_batched(b, s, idxs, 1 / 3)
        return out.tolist()

    assert run(tv_ops.nms, tv_ops.batched_nms, boxes, scores) == [0]
    assert run(nms, batched_nms, boxes, scores) == [0, 1]
    assert run(tv_ops.nms, tv_ops.batched_nms, boxes.double(), scores.double()) == [0, 1]
    assert run(nms, batched_nms, boxes.double(), scores.double()) == [0, 1]


# --------------------------------------------------------------------------------------------------------------
# Empty input: batched_nms accepts what torchvision's accepts
# --------------------------------------------------------------------------------------------------------------

EMPTY_INPUTS = {
    "boxes (0, 4)": (torch.zeros(0, 4), torch.zeros(0), torch.zeros(0, dtype=torch.int64)),
    "boxes (0,)": (torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.int64)),
    "float idxs": (torch.zeros(0, 4), torch.zeros(0), torch.zeros(0)),
    "int32 idxs": (torch.zeros(0, 4), torch.zeros(0), torch.zeros(0, dtype=torch.int32)),
    "float64 boxes": (torch.zeros(0, 4, dtype=torch.float64), torch.zeros(0, dtype=torch.float64), torch.zeros(0)),
    "integer boxes": (torch.zeros(0, 4, dtype=torch.int64), torch.zeros(0), torch.zeros(0, dtype=torch.int64)),
}


@pytest.mark.parametrize("args", EMPTY_INPUTS.values(), ids=EMPTY_INPUTS.keys())
def test_batched_nms_accepts_the_empty_input_torchvision_accepts(args: tuple[torch.Tensor, ...]) -> None:
    theirs = tv_ops.batched_nms(*args, 0.5)
    ours = batched_nms(*args, 0.5)
    assert ours.dtype == theirs.dtype == torch.int64 and ours.shape == theirs.shape == (0,)
