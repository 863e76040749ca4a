"""``batched_nms_padded``: fixed shapes, no sync, and exactly ``batched_nms`` per image (hypothesis, on CPU)."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_balanced.evaluation import postprocess_detections
from lightning_balanced.ops import batched_nms, batched_nms_padded, batched_nms_padded_reference, nms
from tests.helpers import RunIf, raises_exactly
from tests.ops.test_nms import HYPOTHESIS, THRESHOLDS, _random_boxes

compiled = RunIf(compiled_ops=True)
IMPLS = [
    pytest.param(batched_nms_padded, id="op", marks=compiled),
    pytest.param(batched_nms_padded_reference, id="ref"),
]


@st.composite
def padded_batches(draw: st.DrawFn) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Images of up to 60 boxes, some of them padding (-inf), some images all padding; few distinct values."""
    images, n = draw(st.integers(0, 4)), draw(st.integers(0, 60))
    dtype = draw(st.sampled_from([torch.float32, torch.float64, torch.float16]))
    coords = draw(st.lists(st.integers(0, 12).map(float), min_size=4 * images * n, max_size=4 * images * n))
    boxes = torch.tensor(coords, dtype=torch.float64).reshape(images, n, 4) * 2.5
    boxes = torch.cat([torch.minimum(boxes[..., :2], boxes[..., 2:]), torch.maximum(boxes[..., :2], boxes[..., 2:])], 2)
    values = draw(st.lists(st.integers(0, 5).map(float), min_size=images * n, max_size=images * n))
    scores = torch.tensor(values, dtype=torch.float64).reshape(images, n)
    flags = draw(st.lists(st.booleans(), min_size=images * n, max_size=images * n))
    padding = torch.tensor(flags, dtype=torch.bool).reshape(images, n)
    scores[padding] = -math.inf
    if images > 1 and draw(st.booleans()):
        scores[1] = -math.inf  # an image with no boxes
    classes = draw(st.lists(st.integers(-1, 2), min_size=images * n, max_size=images * n))
    idxs = torch.tensor(classes, dtype=torch.int64).reshape(images, n)
    return boxes.to(dtype), scores.to(dtype), idxs if draw(st.booleans()) else None


@compiled
@settings(HYPOTHESIS, max_examples=300)
@given(batch=padded_batches(), iou_threshold=THRESHOLDS, max_output=st.integers(0, 70), offset=st.sampled_from([0, 1]))
@pytest.mark.slow
def test_each_image_is_batched_nms_on_its_boxes_truncated(batch, iou_threshold, max_output, offset) -> None:
    boxes, scores, idxs = batch
    keep, num_kept = batched_nms_padded(boxes, scores, idxs, iou_threshold, max_output, offset)
    assert keep.shape == (boxes.shape[0], max_output) and keep.dtype == torch.int64
    assert num_kept.shape == (boxes.shape[0],) and num_kept.dtype == torch.int64
    for b in range(boxes.shape[0]):
        real = torch.nonzero(~torch.isneginf(scores[b])).flatten()
        if idxs is None:
            kept = nms(boxes[b][real], scores[b][real], iou_threshold, offset)
        else:
            kept = batched_nms(boxes[b][real], scores[b][real], idxs[b][real], iou_threshold, offset)
        expected = real[kept][:max_output]
        assert num_kept[b] == expected.numel()
        assert torch.equal(keep[b, : expected.numel()], expected)
        assert (keep[b, expected.numel() :] == -1).all()
    reference = batched_nms_padded_reference(boxes, scores, idxs, iou_threshold, max_output, offset)
    assert torch.equal(keep, reference[0]) and torch.equal(num_kept, reference[1])


@pytest.mark.parametrize("impl", IMPLS)
def test_empty_batches_and_images_without_boxes(impl) -> None:
    for shape in ((0, 0), (0, 5), (3, 0)):
        keep, num_kept = impl(torch.zeros(*shape, 4), torch.zeros(shape), None, 0.5, 4)
        assert keep.shape == (shape[0], 4) and (keep == -1).all()
        assert torch.equal(num_kept, torch.zeros(shape[0], dtype=torch.int64))
    keep, num_kept = impl(
        torch.zeros(2, 3, 4), torch.full((2, 3), -math.inf), torch.zeros(2, 3, dtype=torch.int32), 0.5, 0
    )
    assert keep.shape == (2, 0) and torch.equal(num_kept, torch.zeros(2, dtype=torch.int64))


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(
    ("where", "value"), [("score", math.nan), ("score", math.inf), ("box", math.nan), ("box", -math.inf)]
)
def test_an_image_with_a_non_finite_value_reports_minus_one(impl, where: str, value: float) -> None:
    boxes, scores = _random_boxes(1, 40, "uniform", torch.float32)
    boxes, scores = boxes.repeat(3, 1, 1), scores.repeat(3, 1)
    (scores[1] if where == "score" else boxes[1, :, 3])[7] = value
    scores[2, 9] = -math.inf
    boxes[2, 9] = math.nan  # a padding box's coordinates are not read
    keep, num_kept = impl(boxes, scores, None, 0.5, 100)
    assert num_kept[1] == -1 and (keep[1] == -1).all()
    assert num_kept[0] == nms(boxes[0], scores[0], 0.5).numel()
    assert num_kept[2] > 0


BAD_INPUT = [
    ((torch.zeros(2, 3), torch.zeros(2, 3), None, 0.5, 4), ValueError, "boxes must have shape (B, N, 4), got [2, 3]"),
    (
        (torch.zeros(2, 3, 4), torch.zeros(2, 4), None, 0.5, 4),
        ValueError,
        "scores must have shape (B, N) = (2, 3), got [2, 4]",
    ),
    (
        (torch.zeros(2, 3, 4), torch.zeros(2, 3), torch.zeros(3, 2, dtype=torch.int64), 0.5, 4),
        ValueError,
        "idxs must have shape (B, N) = (2, 3), got [3, 2]",
    ),
    (
        (torch.zeros(2, 3, 4), torch.zeros(2, 3), torch.zeros(2, 3), 0.5, 4),
        TypeError,
        "idxs must have an integer dtype, got Float",
    ),
    (
        (torch.zeros(2, 3, 4, dtype=torch.int64), torch.zeros(2, 3), None, 0.5, 4),
        TypeError,
        "boxes must be float16, bfloat16, float32 or float64, got Long",
    ),
    (
        (torch.zeros(2, 3, 4), torch.zeros(2, 3, dtype=torch.float64), None, 0.5, 4),
        TypeError,
        "scores must have the dtype of boxes (Float), got Double",
    ),
    (
        (torch.zeros(2, 3, 4), torch.zeros(2, 3), None, 1.5, 4),
        ValueError,
        "iou_threshold must be a number in [0, 1], got 1.5",
    ),
    ((torch.zeros(2, 3, 4), torch.zeros(2, 3), None, 0.5, -1), ValueError, "max_output must be >= 0, got -1"),
    ((torch.zeros(2, 3, 4), torch.zeros(2, 3), None, 0.5, 4.0), TypeError, "max_output must be an int, got float"),
    (
        (torch.zeros(2, 3, 4), torch.zeros(2, 3), [0, 1], 0.5, 4),
        TypeError,
        "idxs must be a torch.Tensor or None, got list",
    ),
]


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize(("args", "error", "message"), BAD_INPUT)
def test_bad_input_raises_a_clear_error(impl, args, error, message) -> None:
    """The compiled op checks tensors in C++ (dtypes named as c10 names them, "Float"); Python checks the types of
    the arguments, and the reference everything (dtypes named as torch names them, "torch.float32")."""
    checked_in_cpp = impl is batched_nms_padded and "must be an int" not in message and "or None" not in message
    if not checked_in_cpp:
        for c10_name, torch_name in (("Float", "torch.float32"), ("Double", "torch.float64"), ("Long", "torch.int64")):
            message = message.replace(f"got {c10_name}", f"got {torch_name}").replace(
                f"({c10_name})", f"({torch_name})"
            )
    with raises_exactly(error, f"batched_nms_padded: {message}"):
        impl(*args)


@compiled
def test_torch_compile_fullgraph_traces_the_padded_form_without_a_graph_break() -> None:
    boxes, scores = _random_boxes(2, 200, "clustered", torch.float32)
    boxes, scores = boxes.reshape(4, 50, 4), scores.reshape(4, 50)
    idxs = torch.arange(200).reshape(4, 50) % 3

    def detect(boxes: torch.Tensor, scores: torch.Tensor, idxs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        keep, num_kept = batched_nms_padded(boxes, scores * 2, idxs, 0.5, 20)
        return keep + 0, num_kept.clamp(min=0)

    torch._dynamo.reset()
    compiled_detect = torch.compile(detect, fullgraph=True, backend="eager")  # fullgraph: a break raises
    expected = detect(boxes, scores, idxs)
    got = compiled_detect(boxes, scores, idxs)
    assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


@compiled
def test_postprocess_detections_batched_path_equals_the_per_image_path() -> None:
    boxes, scores = _random_boxes(4, 1200, "clustered", torch.float32)
    boxes, scores = boxes.reshape(3, 400, 4), (scores / scores.max()).reshape(3, 400)
    labels = torch.randint(0, 4, (3, 400), generator=torch.Generator().manual_seed(2))
    for max_detections in (1, 30, None):
        out = postprocess_detections(boxes, scores, labels, score_threshold=0.2, max_detections=max_detections)
        width = 400 if max_detections is None else max_detections
        assert out["boxes"].shape == (3, width, 4) and out["labels"].dtype == torch.int64
        for b in range(3):
            one = postprocess_detections(
                boxes[b], scores[b], labels[b], score_threshold=0.2, max_detections=max_detections
            )
            count = int(out["num_detections"][b])
            assert count == one["scores"].numel()
            for key in ("boxes", "scores", "labels"):
                assert torch.equal(out[key][b, :count], one[key])
            assert (out["labels"][b, count:] == -1).all() and (out["scores"][b, count:] == 0).all()


# ---- CUDA (skipped without a GPU) --------------------------------------------------------------------------------


@RunIf(min_cuda_gpus=1, compiled_ops=True)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_cuda_padded_form_equals_the_cpu_kernel(dtype: torch.dtype) -> None:
    for n, max_output in ((0, 5), (1, 5), (300, 50), (1500, 2000)):
        boxes, scores = _random_boxes(6, 4 * n, "clustered", dtype)
        boxes, scores = boxes.reshape(4, n, 4), scores.reshape(4, n)
        scores[1, ::4] = -math.inf
        idxs = torch.arange(4 * n).reshape(4, n) % 5
        for classes in (None, idxs):
            expected = batched_nms_padded(boxes, scores, classes, 0.5, max_output)
            got = batched_nms_padded(
                boxes.cuda(), scores.cuda(), None if classes is None else classes.cuda(), 0.5, max_output
            )
            assert torch.equal(got[0].cpu(), expected[0]) and torch.equal(got[1].cpu(), expected[1])


@RunIf(min_cuda_gpus=1, compiled_ops=True)
def test_cuda_padded_form_is_captured_in_a_cuda_graph_and_replayed() -> None:
    boxes, scores = _random_boxes(8, 8 * 700, "mixed_sizes", torch.float32)
    boxes, scores = boxes.reshape(8, 700, 4).cuda(), scores.reshape(8, 700).cuda()
    idxs = (torch.arange(8 * 700).reshape(8, 700) % 7).cuda()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch's CUDA graph docs ask
        for _ in range(2):
            batched_nms_padded(boxes, scores, idxs, 0.5, 100)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # raises if the op synchronizes or copies to the host
        keep, num_kept = batched_nms_padded(boxes, scores, idxs, 0.5, 100)
    for seed in (0, 1):
        new_boxes, new_scores = _random_boxes(20 + seed, 8 * 700, "uniform", torch.float32)
        boxes.copy_(new_boxes.reshape(8, 700, 4))
        scores.copy_(new_scores.reshape(8, 700))
        graph.replay()
        expected = batched_nms_padded(boxes.cpu(), scores.cpu(), idxs.cpu(), 0.5, 100)
        assert torch.equal(keep.cpu(), expected[0]) and torch.equal(num_kept.cpu(), expected[1])
