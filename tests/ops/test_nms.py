"""lightning_balanced.ops.nms / batched_nms: compiled kernels against the pure-PyTorch reference."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightning_balanced.ops import batched_nms, batched_nms_reference, nms, nms_reference
from tests.helpers import RunIf, raises_exactly

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
THRESHOLDS = st.one_of(st.sampled_from([0.0, 0.25, 0.5, 0.7, 1.0]), st.floats(0.0, 1.0))
HYPOTHESIS = settings(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

compiled = RunIf(compiled_ops=True)


def _coord() -> st.SearchStrategy[float]:
    # Few distinct values: identical boxes, shared edges and exact IoU ties are common.
    return st.one_of(st.integers(0, 8).map(float), st.floats(0.0, 8.0, width=16), st.sampled_from([0.5, 2.75]))


@st.composite
def box_sets(draw: st.DrawFn, max_n: int = 40) -> tuple[torch.Tensor, torch.Tensor]:
    n = draw(st.integers(0, max_n))
    dtype = draw(st.sampled_from(DTYPES))
    scale = draw(st.sampled_from([1.0, 0.125, 37.5, 1000.0]))
    ordered = draw(st.booleans())  # otherwise x2 < x1 (degenerate boxes) happens often
    coords = torch.tensor(draw(st.lists(_coord(), min_size=4 * n, max_size=4 * n)), dtype=torch.float64)
    boxes = coords.reshape(n, 4) * scale
    if ordered:
        lo = torch.minimum(boxes[:, :2], boxes[:, 2:])
        hi = torch.maximum(boxes[:, :2], boxes[:, 2:])
        boxes = torch.cat([lo, hi], dim=1)
    score_values = st.one_of(st.integers(0, 3).map(float), st.floats(-1e3, 1e3, width=16))
    scores = torch.tensor(draw(st.lists(score_values, min_size=n, max_size=n)), dtype=torch.float64)
    return boxes.to(dtype), scores.to(dtype)


def _random_boxes(seed: int, n: int, layout: str, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """Larger inputs (grid path of the CPU kernel) in several layouts."""
    gen = torch.Generator().manual_seed(seed)
    if layout == "uniform":
        xy = torch.rand(n, 2, generator=gen) * 200
        wh = torch.rand(n, 2, generator=gen) * 30
    elif layout == "clustered":
        centers = torch.rand(8, 2, generator=gen) * 200
        owner = torch.randint(0, 8, (n,), generator=gen)
        xy = centers[owner] + torch.randn(n, 2, generator=gen) * 3
        wh = 20 + torch.randn(n, 2, generator=gen) * 2
    elif layout == "heavy_tailed":  # some boxes cover many grid cells
        xy = torch.rand(n, 2, generator=gen) * 200
        wh = torch.rand(n, 2, generator=gen).pow(6) * 200
    elif layout == "mixed_sizes":  # sides log-uniform over two decades, width and height independent
        xy = torch.rand(n, 2, generator=gen) * 300
        wh = torch.exp(torch.rand(n, 2, generator=gen) * math.log(100)) * 0.6
    elif layout == "few_large":  # small boxes with about 1% of boxes 20-60x larger
        xy = torch.rand(n, 2, generator=gen) * 200
        wh = torch.rand(n, 2, generator=gen) * 4 + 1
        large = torch.rand(n, generator=gen) < 0.01
        wh[large] = torch.rand(int(large.sum()), 2, generator=gen) * 150 + 50
    elif layout == "degenerate_mix":
        xy = torch.rand(n, 2, generator=gen) * 50
        wh = torch.rand(n, 2, generator=gen) * 12 - 3  # negative, zero and positive sides
    else:  # "tiny": coordinates near the float32 subnormal range and huge ones
        xy = torch.rand(n, 2, generator=gen) * 1e-30
        wh = torch.rand(n, 2, generator=gen) * 1e-31
    boxes = torch.cat([xy, xy + wh], dim=1)
    if layout != "tiny":
        boxes = boxes.round(decimals=int(torch.randint(0, 2, (1,), generator=gen)))
    scores = torch.randint(0, max(2, n // 4), (n,), generator=gen).double()  # many ties
    return boxes.to(dtype), scores.to(dtype)


def _assert_the_gpu_keeps_the_cpu_kernels_indices(
    boxes: torch.Tensor, scores: torch.Tensor, idxs: torch.Tensor
) -> None:
    """nms and batched_nms (classes ``idxs``) on the GPU keep the CPU kernels' indices, IoU 0.5."""
    assert torch.equal(nms(boxes.cuda(), scores.cuda(), 0.5).cpu(), nms(boxes, scores, 0.5))
    on_gpu = batched_nms(boxes.cuda(), scores.cuda(), idxs.cuda(), 0.5).cpu()
    assert torch.equal(on_gpu, batched_nms(boxes, scores, idxs, 0.5))


# --------------------------------------------------------------------------------------------------------------
# Kernels against the reference
# --------------------------------------------------------------------------------------------------------------


@compiled
@settings(HYPOTHESIS, max_examples=1000)
@given(data=box_sets(), iou_threshold=THRESHOLDS, offset=st.sampled_from([0, 1]))
@pytest.mark.slow
def test_nms_matches_reference_on_small_sets(
    data: tuple[torch.Tensor, torch.Tensor], iou_threshold: float, offset: int
) -> None:
    boxes, scores = data
    assert torch.equal(nms(boxes, scores, iou_threshold, offset), nms_reference(boxes, scores, iou_threshold, offset))


@compiled
@settings(HYPOTHESIS, max_examples=250)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(48, 700),
    layout=st.sampled_from(
        ["uniform", "clustered", "heavy_tailed", "mixed_sizes", "few_large", "degenerate_mix", "tiny"]
    ),
    dtype=st.sampled_from(DTYPES),
    iou_threshold=THRESHOLDS,
    offset=st.sampled_from([0, 1]),
)
@pytest.mark.slow
def test_nms_matches_reference_on_larger_sets(
    seed: int, n: int, layout: str, dtype: torch.dtype, iou_threshold: float, offset: int
) -> None:
    boxes, scores = _random_boxes(seed, n, layout, dtype)
    assert torch.equal(nms(boxes, scores, iou_threshold, offset), nms_reference(boxes, scores, iou_threshold, offset))


@compiled
@settings(HYPOTHESIS, max_examples=400)
@given(
    data=box_sets(),
    iou_threshold=THRESHOLDS,
    offset=st.sampled_from([0, 1]),
    class_values=st.sampled_from([[0], [0, 1], [-3, 2, 7], [0, 10**12, -(10**12)]]),
    seed=st.integers(0, 2**16),
    idx_dtype=st.sampled_from([torch.int64, torch.int32, torch.uint8]),
)
@pytest.mark.slow
def test_batched_nms_matches_per_class_reference(
    data: tuple[torch.Tensor, torch.Tensor],
    iou_threshold: float,
    offset: int,
    class_values: list[int],
    seed: int,
    idx_dtype: torch.dtype,
) -> None:
    boxes, scores = data
    gen = torch.Generator().manual_seed(seed)
    values = torch.tensor(class_values, dtype=torch.int64)
    if idx_dtype != torch.int64:
        values = values.clamp(0, 255)
    idxs = values[torch.randint(0, len(class_values), (boxes.shape[0],), generator=gen)].to(idx_dtype)
    expected = batched_nms_reference(boxes, scores, idxs, iou_threshold, offset)
    assert torch.equal(batched_nms(boxes, scores, idxs, iou_threshold, offset), expected)


@compiled
@pytest.mark.parametrize("layout", ["uniform", "clustered", "heavy_tailed"])
def test_batched_nms_on_larger_sets_equals_nms_per_class(layout: str) -> None:
    boxes, scores = _random_boxes(7, 3000, layout, torch.float32)
    idxs = torch.randint(0, 20, (3000,), generator=torch.Generator().manual_seed(1))
    keep = torch.zeros(3000, dtype=torch.bool)
    for c in range(20):
        members = torch.nonzero(idxs == c).flatten()
        keep[members[nms(boxes[members], scores[members], 0.5)]] = True
    kept = torch.nonzero(keep).flatten()
    expected = kept[torch.sort(scores[kept], descending=True, stable=True).indices]
    assert torch.equal(batched_nms(boxes, scores, idxs, 0.5), expected)


@compiled
@pytest.mark.parametrize("layout", ["mixed_sizes", "few_large", "heavy_tailed"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, 1])
def test_mixed_box_sizes_match_reference(layout: str, dtype: torch.dtype, offset: int) -> None:
    """Several size classes at once (the multi-level grid of the CPU kernel), nms and batched_nms."""
    boxes, scores = _random_boxes(21, 1500, layout, dtype)
    idxs = torch.randint(0, 4, (1500,), generator=torch.Generator().manual_seed(2))
    for thr in (0.0, 0.3, 0.7):
        assert torch.equal(nms(boxes, scores, thr, offset), nms_reference(boxes, scores, thr, offset))
        expected = batched_nms_reference(boxes, scores, idxs, thr, offset)
        assert torch.equal(batched_nms(boxes, scores, idxs, thr, offset), expected)


@compiled
def test_nms_on_many_boxes_matches_reference() -> None:
    boxes, scores = _random_boxes(3, 2500, "uniform", torch.float32)
    assert torch.equal(nms(boxes, scores, 0.3), nms_reference(boxes, scores, 0.3))


@compiled
@pytest.mark.parametrize("dtype", DTYPES)
def test_non_contiguous_inputs_give_the_contiguous_result(dtype: torch.dtype) -> None:
    boxes, scores = _random_boxes(5, 300, "clustered", dtype)
    wide = torch.zeros(300, 8, dtype=dtype)
    wide[:, ::2] = boxes
    strided_boxes = wide[:, ::2]
    transposed_boxes = boxes.t().contiguous().t()
    strided_scores = torch.stack([scores, scores], dim=1)[:, 0]
    assert not strided_boxes.is_contiguous() and not transposed_boxes.is_contiguous()
    assert not strided_scores.is_contiguous()
    expected = nms(boxes, scores, 0.5)
    assert torch.equal(nms(strided_boxes, strided_scores, 0.5), expected)
    assert torch.equal(nms(transposed_boxes, strided_scores, 0.5), expected)
    idxs = torch.arange(600)[::2] % 3
    assert torch.equal(batched_nms(strided_boxes, strided_scores, idxs, 0.5), batched_nms(boxes, scores, idxs, 0.5))


@compiled
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_types_are_computed_in_float32(dtype: torch.dtype) -> None:
    boxes, scores = _random_boxes(11, 500, "clustered", dtype)
    assert torch.equal(nms(boxes, scores, 0.6), nms(boxes.float(), scores.float(), 0.6))


@compiled
def test_autocast_computes_in_float32() -> None:
    boxes, scores = _random_boxes(12, 400, "clustered", torch.bfloat16)
    expected = nms(boxes.float(), scores.float(), 0.5)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(nms(boxes, scores, 0.5), expected)
        assert torch.equal(nms(boxes.float(), scores.float(), 0.5), expected)


# --------------------------------------------------------------------------------------------------------------
# Documented semantics (both the compiled path and the reference)
# --------------------------------------------------------------------------------------------------------------

IMPLEMENTATIONS = [pytest.param(nms, id="nms", marks=compiled), pytest.param(nms_reference, id="reference")]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_empty_input_gives_empty_int64(impl, dtype: torch.dtype) -> None:
    out = impl(torch.zeros(0, 4, dtype=dtype), torch.zeros(0, dtype=dtype), 0.5)
    assert out.dtype == torch.int64 and out.shape == (0,)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_output_is_sorted_by_score_and_ties_keep_the_lower_index(impl) -> None:
    boxes = torch.tensor([[0, 0, 1, 1], [10, 10, 11, 11], [20, 20, 21, 21], [30, 30, 31, 31.0]])
    scores = torch.tensor([0.5, 0.9, 0.5, 0.9])
    assert impl(boxes, scores, 0.5).tolist() == [1, 3, 0, 2]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_identical_boxes_keep_only_the_best_unless_threshold_is_one(impl) -> None:
    boxes = torch.tensor([[0, 0, 2, 2.0]] * 4)
    scores = torch.tensor([0.1, 0.7, 0.7, 0.3])
    assert impl(boxes, scores, 0.99).tolist() == [1]
    assert impl(boxes, scores, 1.0).tolist() == [1, 2, 3, 0]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_iou_equal_to_threshold_does_not_suppress(impl) -> None:
    boxes = torch.tensor([[0, 0, 2, 1], [1, 0, 3, 1.0]])  # IoU exactly 1/3
    scores = torch.tensor([1.0, 0.5])
    assert impl(boxes, scores, 0.5).tolist() == [0, 1]
    assert impl(boxes, scores, 0.25).tolist() == [0]
    boxes = torch.tensor([[0, 0, 2, 1], [0, 0, 1, 1.0]])  # IoU exactly 0.5
    assert impl(boxes, scores, 0.5).tolist() == [0, 1]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_degenerate_boxes_are_kept_and_never_suppress(impl) -> None:
    boxes = torch.tensor(
        [
            [1, 1, 1, 1],  # a point
            [1, 1, 1, 1],  # the same point
            [0, 0, 4, 0],  # zero height
            [3, 3, 1, 1],  # x2 < x1, y2 < y1
            [0, 0, 4, 4],  # a normal box over all of them
        ],
        dtype=torch.float32,
    )
    scores = torch.tensor([0.9, 0.8, 0.7, 0.6, 0.5])
    assert impl(boxes, scores, 0.0).tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_offset_one_adds_a_pixel_to_widths_and_heights(impl) -> None:
    boxes = torch.tensor([[0, 0, 1, 1], [1, 1, 2, 2.0]])  # touch at a corner
    scores = torch.tensor([1.0, 0.5])
    assert impl(boxes, scores, 0.1, offset=0).tolist() == [0, 1]  # no overlap
    assert impl(boxes, scores, 0.1, offset=1).tolist() == [0]  # 1 pixel of 7: IoU 1/7 > 0.1
    assert impl(boxes, scores, 0.15, offset=1).tolist() == [0, 1]
    point = torch.tensor([[5, 5, 5, 5], [5, 5, 5, 5.0]])  # a 1 x 1 pixel with offset=1
    assert impl(point, scores, 0.5, offset=1).tolist() == [0]
    assert impl(point, scores, 0.5, offset=0).tolist() == [0, 1]


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
def test_threshold_zero_suppresses_any_overlap(impl) -> None:
    boxes = torch.tensor([[0, 0, 10, 10], [9.5, 9.5, 20, 20], [10, 0, 20, 5.0]])  # 2 only touches 0
    scores = torch.tensor([1.0, 0.9, 0.8])
    assert impl(boxes, scores, 0.0).tolist() == [0, 2]


@pytest.mark.parametrize("impl", [pytest.param(batched_nms, marks=compiled), batched_nms_reference])
def test_boxes_of_different_classes_do_not_suppress_each_other(impl) -> None:
    boxes = torch.tensor([[0, 0, 10, 10]] * 3 + [[0, 0, 9, 10]], dtype=torch.float32)
    scores = torch.tensor([0.9, 0.8, 0.7, 0.95])
    idxs = torch.tensor([0, 1, 0, 1])
    assert impl(boxes, scores, idxs, 0.5).tolist() == [3, 0]
    assert impl(boxes, scores, torch.zeros(4, dtype=torch.int64), 0.5).tolist() == [3]


# --------------------------------------------------------------------------------------------------------------
# Bad input: clear ValueError / TypeError from Python and from the C++ checks
# --------------------------------------------------------------------------------------------------------------

B = torch.tensor([[0, 0, 1, 1], [0, 0, 2, 2.0]])
S = torch.tensor([0.5, 0.6])
# (args, error, whole message): "{op}" is the op's name; a pair is (the C++ check's, the Python check's) where they
# name a dtype differently. Whole messages, so a truncated or garbled one fails (a private libstdc++ cut them short).
BAD_INPUTS = [
    ((B[0], S, 0.5, 0), ValueError, "{op}: boxes must have shape (N, 4), got [4]"),
    ((B[:, :3], S, 0.5, 0), ValueError, "{op}: boxes must have shape (N, 4), got [2, 3]"),
    ((B, S[:, None], 0.5, 0), ValueError, "{op}: scores must have shape (N,), got [2, 1]"),
    ((B, S[:1], 0.5, 0), ValueError, "{op}: boxes and scores must have the same length N, got 2 boxes and 1 scores"),
    (
        (B.long(), S.long(), 0.5, 0),
        TypeError,
        (
            "{op}: boxes must be float16, bfloat16, float32 or float64, got Long",
            "{op}: boxes must be float16, bfloat16, float32 or float64, got torch.int64",
        ),
    ),
    (
        (B, S.double(), 0.5, 0),
        TypeError,
        (
            "{op}: scores must have the dtype of boxes (Float), got Double",
            "{op}: scores must have the dtype of boxes (torch.float32), got torch.float64",
        ),
    ),
    ((B, S, math.nan, 0), ValueError, "{op}: iou_threshold must be a number in [0, 1], got nan"),
    ((B, S, 1.5, 0), ValueError, "{op}: iou_threshold must be a number in [0, 1], got 1.5"),
    ((B, S, -0.1, 0), ValueError, "{op}: iou_threshold must be a number in [0, 1], got -0.1"),
    ((B, S, 0.5, 2), ValueError, "{op}: offset must be 0 or 1, got 2"),
    ((B, S, 0.5, -1), ValueError, "{op}: offset must be 0 or 1, got -1"),
    (
        (torch.tensor([[0, 0, math.nan, 1.0]]), S[:1], 0.5, 0),
        ValueError,
        "{op}: box coordinates must be finite (no NaN or infinity)",
    ),
    (
        (torch.tensor([[0, 0, math.inf, 1.0]]), S[:1], 0.5, 0),
        ValueError,
        "{op}: box coordinates must be finite (no NaN or infinity)",
    ),
    ((B, torch.tensor([0.5, math.nan]), 0.5, 0), ValueError, "{op}: scores must be finite (no NaN or infinity)"),
    ((B, torch.tensor([0.5, -math.inf]), 0.5, 0), ValueError, "{op}: scores must be finite (no NaN or infinity)"),
]


def _message(message: str | tuple[str, str], op: str, compiled_check: bool) -> str:
    """The whole expected message of ``op``, from the C++ check (``compiled_check``) or the Python one."""
    if isinstance(message, tuple):
        message = message[0] if compiled_check else message[1]
    return message.format(op=op)


@pytest.mark.parametrize("impl", IMPLEMENTATIONS)
@pytest.mark.parametrize(("args", "error", "message"), BAD_INPUTS)
def test_bad_input_raises_a_clear_error(impl, args, error, message) -> None:
    with raises_exactly(error, _message(message, "nms", compiled_check=impl is nms)):
        impl(*args)


@compiled
@pytest.mark.parametrize(("args", "error", "message"), BAD_INPUTS)
def test_compiled_op_checks_its_preconditions(args, error, message) -> None:
    with raises_exactly(error, _message(message, "nms", compiled_check=True)):
        torch.ops.lightning_balanced.nms(*args)
    boxes, scores, thr, offset = args
    idxs = torch.zeros(boxes.shape[0] if boxes.dim() else 1, dtype=torch.int64)
    with raises_exactly(error, _message(message, "batched_nms", compiled_check=True)):
        torch.ops.lightning_balanced.batched_nms(boxes, scores, idxs, thr, offset)


@pytest.mark.parametrize("impl", [pytest.param(nms, marks=compiled), nms_reference])
def test_python_level_type_errors(impl) -> None:
    with raises_exactly(TypeError, "nms: boxes must be a torch.Tensor, got list"):
        impl(B.tolist(), S, 0.5)
    with raises_exactly(TypeError, "nms: scores must be a torch.Tensor, got list"):
        impl(B, S.tolist(), 0.5)
    with raises_exactly(TypeError, "nms: iou_threshold must be a real number, got str"):
        impl(B, S, "0.5")
    with raises_exactly(TypeError, "nms: iou_threshold must be a real number, got Tensor"):
        impl(B, S, torch.tensor(0.5))
    with raises_exactly(TypeError, "nms: offset must be an int (0 or 1), got bool"):
        impl(B, S, 0.5, offset=True)
    with raises_exactly(TypeError, "nms: offset must be an int (0 or 1), got float"):
        impl(B, S, 0.5, offset=1.0)


@pytest.mark.parametrize("impl", [pytest.param(batched_nms, marks=compiled), batched_nms_reference])
def test_batched_nms_rejects_bad_idxs(impl) -> None:
    float32, boolean = ("Float", "Bool") if impl is batched_nms else ("torch.float32", "torch.bool")
    with raises_exactly(TypeError, f"batched_nms: idxs must have an integer dtype, got {float32}"):
        impl(B, S, torch.zeros(2), 0.5)
    with raises_exactly(TypeError, f"batched_nms: idxs must have an integer dtype, got {boolean}"):
        impl(B, S, torch.zeros(2, dtype=torch.bool), 0.5)
    with raises_exactly(ValueError, "batched_nms: idxs must have shape (N,) with N = 2, got [3]"):
        impl(B, S, torch.zeros(3, dtype=torch.int64), 0.5)
    with raises_exactly(TypeError, "batched_nms: idxs must be a torch.Tensor, got list"):
        impl(B, S, [0, 1], 0.5)


@compiled
def test_compiled_batched_op_checks_idxs() -> None:
    op = torch.ops.lightning_balanced.batched_nms
    with raises_exactly(TypeError, "batched_nms: idxs must have an integer dtype, got Float"):
        op(B, S, torch.zeros(2), 0.5, 0)
    with raises_exactly(TypeError, "batched_nms: idxs must have an integer dtype, got Bool"):
        op(B, S, torch.zeros(2, dtype=torch.bool), 0.5, 0)
    with raises_exactly(ValueError, "batched_nms: idxs must have shape (N,) with N = 2, got [3]"):
        op(B, S, torch.zeros(3, dtype=torch.int64), 0.5, 0)
    for dtype in (torch.int32, torch.int16, torch.uint8):  # any integer dtype, read as int64
        assert op(B, S, torch.tensor([0, 1], dtype=dtype), 0.5, 0).tolist() == [1, 0]


@pytest.mark.parametrize("impl", [pytest.param(batched_nms, marks=compiled), batched_nms_reference])
def test_batched_nms_of_no_boxes_is_empty_whatever_the_shapes(impl) -> None:
    """As torchvision.ops.batched_nms: ``boxes.numel() == 0`` gives an empty int64 result."""
    for boxes, scores, idxs in (
        (torch.zeros(0, 4), torch.zeros(0), torch.zeros(0, dtype=torch.int64)),
        (torch.zeros(0), torch.zeros(0), torch.zeros(0, dtype=torch.int64)),
        (torch.zeros(0, 4), torch.zeros(0), torch.zeros(0)),
        (torch.zeros(0, 4, dtype=torch.int64), torch.zeros(0), torch.zeros(0, dtype=torch.int32)),
    ):
        out = impl(boxes, scores, idxs, 0.5)
        assert out.dtype == torch.int64 and out.shape == (0,)
    with raises_exactly(ValueError, "batched_nms: iou_threshold must be a number in [0, 1], got 1.5"):  # still checked
        impl(torch.zeros(0, 4), torch.zeros(0), torch.zeros(0, dtype=torch.int64), 1.5)


@RunIf(min_cuda_gpus=1)
def test_different_devices_are_rejected() -> None:
    with raises_exactly(ValueError, "nms: boxes and scores must be on the same device, got cpu and cuda:0"):
        nms(B, S.cuda(0), 0.5)
    with raises_exactly(ValueError, "batched_nms: idxs must be on the device of boxes (cpu), got cuda:0"):
        batched_nms(B, S, torch.zeros(2, dtype=torch.int64, device="cuda:0"), 0.5)


def test_different_devices_are_rejected_before_any_kernel() -> None:
    with raises_exactly(ValueError, "nms: boxes and scores must be on the same device, got cpu and meta"):
        nms_reference(B, S.to("meta"), 0.5)
    with raises_exactly(ValueError, "batched_nms: idxs must be on the device of boxes (cpu), got meta"):
        batched_nms_reference(B, S, torch.zeros(2, dtype=torch.int64, device="meta"), 0.5)
