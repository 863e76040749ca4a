"""The single-launch CUDA NMS of up to 4096 boxes per image (csrc/ops/nms_small.h), run on the CPU by its emulation.

``_nms_tiled`` (nms, batched_nms) and ``_nms_tiled_schedule`` (a batch, as batched_nms_padded) take this path for
images of at most ``small_rows`` boxes (4096, as the CUDA kernels on an H100): one CTA of 1024 threads sorts,
resolves and compacts in shared memory, and the host allocates the output, launches once and reads the kept count.
The emulation runs the same per-thread and per-warp code, the CTA's barriers as the ends of its phases; its cost
model has a row per launch and per host-side torch op, which the tests below bound.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_balanced.ops import batched_nms, batched_nms_padded, batched_nms_reference, nms, nms_reference
from tests.helpers import RunIf, raises_exactly
from tests.ops.test_nms import HYPOTHESIS, _assert_the_gpu_keeps_the_cpu_kernels_indices, _random_boxes

pytestmark = RunIf(compiled_ops=True)

KEPT, TILE_KEPT, BAD_SCORE, BAD_BOX = range(4)
STEP_KERNEL, TILE_KERNEL, TORCH_OP, SMALL_KERNEL, CHAIN_KERNEL = range(5)
SMALL_ROWS = 4096  # csrc/ops/nms_small.h's kSmallMaxRows, the default of the private ops
SIZES = [1, 2, 63, 64, 65, 1023, 1024, 1025, 4095, 4096, 4097]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _expected(boxes, scores, idxs, iou_threshold, offset=0) -> torch.Tensor:
    """The reference up to 1025 boxes; above, the CPU kernel (checked against the reference in test_nms.py): the
    pure-torch reference takes 25 s at 4097 float64 boxes."""
    small = boxes.shape[0] <= 1025
    if idxs is None:
        return (nms_reference if small else nms)(boxes, scores, iou_threshold, offset)
    return (batched_nms_reference if small else batched_nms)(boxes, scores, idxs, iou_threshold, offset)


def _launches_and_host_ops(steps: torch.Tensor) -> tuple[int, int]:
    kind = steps[:, 0]
    return int((kind != TORCH_OP).sum()), int((kind == TORCH_OP).sum())


def _single_launch_critical_path(
    n: int, layout: str, by_class: bool
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One call of n boxes (80 classes when by_class), checked exact and one launch with 2 host ops; returns the
    critical path of its cost model and the inputs (boxes, scores, idxs or None)."""
    boxes, scores = _random_boxes(3, n, layout, torch.float32)
    idxs = torch.randint(0, 80, (n,), generator=torch.Generator().manual_seed(0)) if by_class else None
    keep, steps = torch.ops.lightning_balanced._nms_tiled(boxes, scores, idxs, 0.5, 0)
    assert torch.equal(keep, _expected(boxes, scores, idxs, 0.5))
    assert _launches_and_host_ops(steps) == (1, 2)
    return int(steps[:, 2].sum()), boxes, scores, idxs


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_single_launch_path_matches_the_reference_around_its_threshold(n: int, dtype: torch.dtype) -> None:
    """nms and batched_nms, offsets 0 and 1: one launch up to 4096 boxes, the tiled chain from 4097 on."""
    boxes, scores = _random_boxes(n, n, "clustered", dtype)
    scores = (scores * 8).round() / 8  # many equal scores: the tie order (lower index first) matters
    idxs = torch.arange(n) * 7 % 3
    for offset in (0, 1):
        for classes in (None, idxs):
            keep, steps = torch.ops.lightning_balanced._nms_tiled(boxes, scores, classes, 0.5, offset)
            assert torch.equal(keep, _expected(boxes, scores, classes, 0.5, offset)), (offset, classes is None)
            kinds = set(steps[:, 0].tolist())
            assert (SMALL_KERNEL in kinds) == (n <= SMALL_ROWS)
            assert bool({TILE_KERNEL, CHAIN_KERNEL} & kinds) == (n > SMALL_ROWS)


@pytest.mark.parametrize("layout", ["uniform", "heavy_tailed", "mixed_sizes", "few_large", "degenerate_mix", "tiny"])
@pytest.mark.parametrize("iou_threshold", [0.0, 0.3, 1.0])
def test_single_launch_path_on_every_layout(layout: str, iou_threshold: float) -> None:
    boxes, scores = _random_boxes(5, 4000, layout, torch.float32)
    idxs = torch.randint(-2, 5, (4000,), generator=torch.Generator().manual_seed(1))
    for classes in (None, idxs):
        keep, _ = torch.ops.lightning_balanced._nms_tiled(boxes, scores, classes, iou_threshold, 0)
        assert torch.equal(keep, _expected(boxes, scores, classes, iou_threshold))


@settings(HYPOTHESIS, max_examples=120)
@given(
    seed=st.integers(0, 2**31 - 1),
    n=st.integers(65, 600),
    big=st.sampled_from([0.0, 0.02, 0.3]),
    dtype=st.sampled_from([torch.float32, torch.float64, torch.float16]),
    scale=st.sampled_from([1.0, 0.001, 300.0]),  # float16 holds 160 x 300
    iou_threshold=st.sampled_from([0.0, 0.1, 0.5, 1.0]),
    offset=st.sampled_from([0, 1]),
    by_class=st.booleans(),
)
@pytest.mark.slow
def test_the_grid_of_step_4_never_misses_a_suppressor(
    seed: int,
    n: int,
    big: float,
    dtype: torch.dtype,
    scale: float,
    iou_threshold: float,
    offset: int,
    by_class: bool,
) -> None:
    """Step 4 tests a later row only against the kept rows in the cells it covers (nms_small.h). Boxes on a lattice
    of half units, so edges touch; sides from -2 to 6 (inverted, empty and touching intervals, and gaps below 1,
    which offset 1 turns into overlaps); a share of boxes wider than 1/8 of the extent (`big`, kept out of the
    grid); few overlaps, so most rows are kept and the grid is used. Fails when the offset is left out of a box's
    cells, or the big boxes out of the candidates (both tried)."""
    gen = torch.Generator().manual_seed(seed)
    xy = torch.randint(0, 160, (n, 2), generator=gen).double() / 2
    wh = torch.randint(-4, 13, (n, 2), generator=gen).double() / 2
    large = torch.rand(n, generator=gen) < big
    wh[large] = torch.randint(12, 80, (int(large.sum()), 2), generator=gen).double()
    boxes = (torch.cat([xy, xy + wh], dim=1) * scale).to(dtype)
    scores = torch.randint(0, n, (n,), generator=gen).to(dtype)
    idxs = torch.randint(-2, 3, (n,), generator=gen) * 10**12 if by_class else None
    keep, _ = torch.ops.lightning_balanced._nms_tiled(boxes, scores, idxs, iou_threshold, offset)
    assert torch.equal(keep, _expected(boxes, scores, idxs, iou_threshold, offset))


@pytest.mark.parametrize(
    ("n", "layout", "iou_threshold"),
    [(1000, "few_large", 0.5), (1000, "heavy_tailed", 0.3), (4096, "large", 0.7), (4096, "large", 0.0)],
)
@pytest.mark.parametrize("by_class", [False, True], ids=["nms", "batched"])
def test_step_4_tests_rows_with_many_candidates_in_a_phase_of_their_own(
    n: int, layout: str, iou_threshold: float, by_class: bool
) -> None:
    """Step 4 (e): a later row with more than 24 candidates is tested by 64 threads at once, one kept row each,
    after (d); past 256 such rows in a block, the rest are tested in (d) as before. ``few_large`` and
    ``heavy_tailed`` defer the large later rows; ``large`` (every box wider than 1/8 of the extent, so no grid and
    every kept row a candidate) defers them all and overflows the 256. Fails when (e) is left out, or when an
    overflowing row is left untested (both tried)."""
    if layout == "large":
        gen = torch.Generator().manual_seed(n)
        xy = torch.rand(n, 2, generator=gen) * 100
        boxes = torch.cat([xy, xy + torch.rand(n, 2, generator=gen) * 60 + 20], dim=1)
        scores = torch.rand(n, generator=gen)
    else:
        boxes, scores = _random_boxes(11, n, layout, torch.float32)
    idxs = torch.randint(0, 3, (n,), generator=torch.Generator().manual_seed(1)) if by_class else None
    keep, steps = torch.ops.lightning_balanced._nms_tiled(boxes, scores, idxs, iou_threshold, 0)
    assert _launches_and_host_ops(steps) == (1, 2)
    assert torch.equal(keep, _expected(boxes, scores, idxs, iou_threshold))


def test_single_launch_path_on_duplicates_and_ties() -> None:
    """Every box repeated 40 times with equal scores (4000 boxes): the lower index is kept, the copies suppressed."""
    boxes, _ = _random_boxes(5, 100, "uniform", torch.float32)
    boxes = boxes.repeat(40, 1)
    scores = torch.arange(100, dtype=torch.float32).repeat(40) % 7
    for idxs in (None, torch.arange(4000) % 3):
        keep, _ = torch.ops.lightning_balanced._nms_tiled(boxes, scores, idxs, 0.5, 0)
        assert torch.equal(keep, _expected(boxes, scores, idxs, 0.5))


def test_single_launch_path_reads_strided_input() -> None:
    """Boxes and scores as views with strides: read in place, as the kernel reads them."""
    boxes, scores = _random_boxes(7, 1500, "clustered", torch.float64)
    wide = torch.zeros(1500, 9, dtype=torch.float64)
    wide[:, 1:5] = boxes
    strided_scores = torch.stack([scores, -scores], dim=1)[:, 0]
    keep, _ = torch.ops.lightning_balanced._nms_tiled(wide[:, 1:5], strided_scores, None, 0.5, 0)
    assert torch.equal(keep, _expected(boxes, scores, None, 0.5))


@pytest.mark.parametrize("n", [65, 1000, 4096])
@pytest.mark.parametrize("by_class", [False, True], ids=["nms", "batched"])
def test_padded_batch_takes_one_launch_and_gives_each_image_its_answer(n: int, by_class: bool) -> None:
    """Three images with padding (score -inf, NaN boxes never read), a capacity below and above the kept count."""
    gen = torch.Generator().manual_seed(n)
    images = [_random_boxes(b, n, "clustered", torch.float32) for b in range(3)]
    boxes = torch.stack([b for b, _ in images])
    scores = torch.stack([s for _, s in images])
    scores[1, ::3] = float("-inf")
    boxes[1, ::3] = float("nan")
    idxs = torch.randint(0, 3, (3, n), generator=gen) if by_class else None
    schedule = torch.ops.lightning_balanced._nms_tiled_schedule
    for capacity in (5, n):
        keep, counters, steps = schedule(boxes, scores, idxs, 0.5, 0, True, capacity)
        assert _launches_and_host_ops(steps) == (1, 2)
        for b in range(3):
            real = torch.nonzero(~torch.isneginf(scores[b])).flatten()
            cls = None if idxs is None else idxs[b, real]
            expected = real[_expected(boxes[b, real], scores[b, real], cls, 0.5)]
            assert counters[b, KEPT] == expected.numel() and counters[b].tolist()[BAD_SCORE:] == [0, 0]
            assert torch.equal(keep[b, : min(capacity, expected.numel())], expected[:capacity])
            assert (keep[b, expected.numel() :] == -1).all()


@pytest.mark.parametrize(
    ("where", "value", "flag"),
    [("score", float("nan"), BAD_SCORE), ("score", float("inf"), BAD_SCORE), ("box", float("-inf"), BAD_BOX)],
)
def test_padded_batch_marks_an_image_with_a_non_finite_value_and_erases_its_row(
    where: str, value: float, flag: int
) -> None:
    """The padded op's result: that image's row all -1 (num_kept -1, checked inside the emulation), the others
    untouched."""
    boxes, scores = _random_boxes(11, 2 * 300, "uniform", torch.float32)
    boxes, scores = boxes.view(2, 300, 4).clone(), scores.view(2, 300).clone()
    (scores[1] if where == "score" else boxes[1, :, 2])[123] = value
    keep, counters, _ = torch.ops.lightning_balanced._nms_tiled_schedule(boxes, scores, None, 0.5, 0, True, 300)
    assert counters[1, flag] == 1 and counters[1, BAD_SCORE + BAD_BOX - flag] == 0
    assert (keep[1] == -1).all()
    assert torch.equal(keep[0, : counters[0, KEPT]], nms(boxes[0], scores[0], 0.5))


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("by_class", [False, True], ids=["nms", "batched"])
def test_single_launch_path_refuses_non_finite_values(value: float, by_class: bool) -> None:
    boxes, scores = _random_boxes(13, 3000, "uniform", torch.float32)
    scores[17] = value
    idxs = torch.arange(3000) % 80 if by_class else None
    with raises_exactly(ValueError, "_nms_tiled: scores must be finite (no NaN or infinity)"):
        torch.ops.lightning_balanced._nms_tiled(boxes, scores, idxs, 0.5, 0)
    scores[17] = 0.5
    boxes[5, 3] = value
    with raises_exactly(ValueError, "_nms_tiled: box coordinates must be finite (no NaN or infinity)"):
        torch.ops.lightning_balanced._nms_tiled(boxes, scores, idxs, 0.5, 0)


@pytest.mark.parametrize("layout", ["uniform", "clustered", "mixed_sizes"])
@pytest.mark.parametrize("by_class", [False, True], ids=["nms", "batched"])
def test_one_launch_and_two_host_ops_at_1k_boxes(layout: str, by_class: bool) -> None:
    """Issue 40's bound at 1k: the output allocation, one launch, the read of the kept count. The tiled chain took
    4 launches and 7 host-side ops (8 for batched_nms, whose classes it first counts) for the same call.

    The critical path (serial steps of the one CTA, barriers included; a step is about one IoU test or one cell
    read) stays under 1,000: measured 326 (nms, clustered, few kept) to 686 (nms, mixed sizes, 99 % kept), against
    the chain's 51-242 in 3 launches plus the host's ops between them. Without step 4's grid it was 341 to 1,282:
    every kept row against every later open row, about n^2 / 2 IoU tests on one SM when nearly all boxes are
    kept."""
    critical_path, boxes, scores, idxs = _single_launch_critical_path(1000, layout, by_class)
    assert critical_path < 1_000
    _, chain = torch.ops.lightning_balanced._nms_tiled(boxes, scores, idxs, 0.5, 0, 1024, 8192, 0)
    launches, host_ops = _launches_and_host_ops(chain)
    assert launches >= 3 and host_ops >= 7


@pytest.mark.parametrize("layout", ["uniform", "clustered", "mixed_sizes"])
@pytest.mark.parametrize("by_class", [False, True], ids=["nms", "batched"])
def test_the_grid_keeps_the_critical_path_near_linear_at_4000_boxes(layout: str, by_class: bool) -> None:
    """Step 4's grid: a later row is tested against the kept rows near it, not all of them. Critical path at 4000
    boxes, measured: 942 (nms, clustered) to 3,362 (nms, mixed sizes; 4,407 before step 4 (e)); without the grid
    1,044 to 10,971 (about n^2 / 2 / 1024 IoU tests per thread when most boxes are kept)."""
    critical_path, *_ = _single_launch_critical_path(4000, layout, by_class)
    assert critical_path < 4_000


def test_small_rows_is_checked() -> None:
    boxes, scores = _random_boxes(3, 10, "uniform", torch.float32)
    with raises_exactly(ValueError, "_nms_tiled: small_rows must be in [0, 4096], got 4097"):
        torch.ops.lightning_balanced._nms_tiled(boxes, scores, None, 0.5, 0, 1024, 8192, 4097)


def test_launches_do_not_grow_with_n_above_the_single_launch_path() -> None:
    """Issue 40: at most 4 launches plus torch's sort at any size (6 at 1M). 20,000 boxes stand for the bound; the
    persistent chain makes it 3 (test_nms_persistent_chain.py bounds 100k and 1M and says why N does not matter)."""
    boxes, scores = _random_boxes(3, 20_000, "uniform", torch.float32)
    _, steps = torch.ops.lightning_balanced._nms_tiled(boxes, scores, None, 0.5, 0)
    kind = steps[:, 0]
    assert int((kind != TORCH_OP).sum()) <= 6
    assert int((kind == CHAIN_KERNEL).sum()) == 1


@RunIf(min_cuda_gpus=1)
@pytest.mark.parametrize("small_rows", ["4096", "0", "1000", ""], ids=["single", "tiles", "limit_1000", "unset"])
def test_on_a_gpu_the_single_launch_limit_is_read_at_each_call(
    small_rows: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """LIGHTNING_BALANCED_NMS_SMALL_ROWS moves the single launch's limit (0: always the tiles), for timing the two
    paths against each other (bench_nms_cuda.py's small_ab lines); either way the CPU kernel's indices, nms,
    batched_nms and the padded batch."""
    monkeypatch.setenv("LIGHTNING_BALANCED_NMS_SMALL_ROWS", small_rows)
    boxes, scores = _random_boxes(17, 3000, "mixed_sizes", torch.float32)
    _assert_the_gpu_keeps_the_cpu_kernels_indices(boxes, scores, torch.arange(3000) * 7 % 5)
    keep, num_kept = batched_nms_padded(boxes.view(3, 1000, 4).cuda(), scores.view(3, 1000).cuda(), None, 0.5, 100)
    for b in range(3):
        expected = nms(boxes.view(3, 1000, 4)[b], scores.view(3, 1000)[b], 0.5)[:100]
        assert int(num_kept[b]) == expected.numel() and torch.equal(keep[b, : expected.numel()].cpu(), expected)


@RunIf(min_cuda_gpus=1)
@pytest.mark.parametrize("value", ["-1", "4097", "many", "12x"])
def test_on_a_gpu_a_bad_single_launch_limit_is_refused(value: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_BALANCED_NMS_SMALL_ROWS", value)
    boxes, scores = _random_boxes(3, 10, "uniform", torch.float32)
    message = f"LIGHTNING_BALANCED_NMS_SMALL_ROWS must be an integer in [0, 4096], got '{value}'"
    with raises_exactly(ValueError, message):
        nms(boxes.cuda(), scores.cuda(), 0.5)
