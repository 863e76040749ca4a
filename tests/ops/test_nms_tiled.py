"""The CUDA kernels' tiled NMS, run on the CPU by its emulation ``_nms_tiled_schedule`` (csrc/ops/nms_tiled.h).

The emulation runs the kernels' steps (csrc/ops/nms_tiled_driver.h) in their order, and the warp-level code with
its 32 lanes one after another; small tiles give many tiles and many 64-box blocks at sizes the reference can check,
and few step-2 warps make each warp take many pairs, so every path of the algorithm the GPU runs is exercised here:
the tile pass in rounds, the propagation through the spatial index, block and super-block skipping, classes and
padding. Exactness: the kept indices equal the reference's exactly (the arithmetic is the same, rounded to nearest).

The emulation also reports the cost model of the GPU's schedule, a row per launch (kind, parallel width, serial
depth: the most loop iterations any thread, or warp, runs); the tests below bound it, so the parallelism of the
algorithm is checked without a GPU.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_balanced.ops import batched_nms, batched_nms_reference, nms, nms_reference
from tests.helpers import RunIf, raises_exactly
from tests.ops.test_nms import HYPOTHESIS, THRESHOLDS, _random_boxes, box_sets

pytestmark = RunIf(compiled_ops=True)

KEPT, TILE_KEPT, BAD_SCORE, BAD_BOX = range(4)
STEP_KERNEL, TILE_KERNEL, TORCH_OP, SMALL_KERNEL = range(4)
GPU_TILE_ROWS = 1024  # cuda/nms_kernel.cu's kTileRows
LAYOUTS = ["uniform", "clustered", "heavy_tailed", "mixed_sizes", "few_large", "degenerate_mix", "tiny"]


def _tiled(
    boxes: torch.Tensor,
    scores: torch.Tensor,
    idxs: torch.Tensor | None,
    iou_threshold: float,
    offset: int = 0,
    tile_rows: int = 64,
    padded: bool = False,
    capacity: int | None = None,
    warps: int = 3,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The emulation on a batch: ``keep [B, capacity]`` and ``counters [B, 4]``. Above one tile, an even number of
    boxes runs the persistent chain, an odd one the per-tile launches (its fallback): each test and hypothesis run
    covers both at the cost of one (test_nms_persistent_chain.py compares the two on the same input)."""
    persistent = boxes.shape[1] % 2 == 0
    keep, counters, _ = _schedule(
        boxes, scores, idxs, iou_threshold, offset, tile_rows, padded, capacity, warps, persistent
    )
    return keep, counters


def _schedule(
    boxes, scores, idxs, iou_threshold, offset=0, tile_rows=64, padded=False, capacity=None, warps=3, persistent=True
):
    """``keep``, ``counters`` and the cost model ``steps [rows, 3]`` (kind, width, depth), always through the tiles
    (``small_rows=0``: the single-launch path of small images is tested in test_nms_small.py); above one tile, the
    persistent chain or (``persistent=False``) the per-tile launches (test_nms_persistent_chain.py)."""
    capacity = boxes.shape[1] if capacity is None else capacity
    schedule = torch.ops.lightning_balanced._nms_tiled_schedule
    return schedule(boxes, scores, idxs, iou_threshold, offset, padded, capacity, tile_rows, warps, 0, persistent)


def _tiled_single(boxes, scores, idxs, iou_threshold, offset=0, tile_rows=64, warps=3) -> torch.Tensor:
    keep, counters = _tiled(
        boxes[None], scores[None], None if idxs is None else idxs[None], iou_threshold, offset, tile_rows, warps=warps
    )
    assert counters[0, BAD_SCORE] == 0 and counters[0, BAD_BOX] == 0
    assert (keep[0, counters[0, KEPT] :] == -1).all()
    return keep[0, : counters[0, KEPT]]


def _reference(boxes, scores, idxs, iou_threshold, offset=0) -> torch.Tensor:
    if idxs is None:
        return nms_reference(boxes, scores, iou_threshold, offset)
    return batched_nms_reference(boxes, scores, idxs, iou_threshold, offset)


def _cpu_kernel(boxes, scores, idxs, iou_threshold, offset=0) -> torch.Tensor:
    """The CPU kernel, itself checked against the reference in test_nms.py: the oracle for thousands of boxes."""
    if idxs is None:
        return nms(boxes, scores, iou_threshold, offset)
    return batched_nms(boxes, scores, idxs, iou_threshold, offset)


@settings(HYPOTHESIS, max_examples=200)  # the chain's emulation runs every modelled CTA: 74 s at 400 on 2 cores
@given(
    data=box_sets(max_n=200),
    iou_threshold=THRESHOLDS,
    offset=st.sampled_from([0, 1]),
    tile_rows=st.sampled_from([64, 128]),
    classes=st.sampled_from([0, 1, 3]),
    warps=st.sampled_from([1, 3, 8192]),  # 8192: super-blocks of one block; 1: of 64, many pairs per warp
)
@pytest.mark.slow
def test_tiled_schedule_matches_the_reference(data, iou_threshold, offset, tile_rows, classes, warps) -> None:
    boxes, scores = data
    idxs = None if classes == 0 else (torch.arange(boxes.shape[0]) * 7 % classes) - 1
    expected = _reference(boxes, scores, idxs, iou_threshold, offset)
    assert torch.equal(_tiled_single(boxes, scores, idxs, iou_threshold, offset, tile_rows, warps), expected)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("by_class", [False, True], ids=["nms", "batched"])
def test_tiled_schedule_on_many_tiles_and_blocks(layout: str, dtype: torch.dtype, by_class: bool) -> None:
    """5,000 boxes: 79 tiles of 64 rows, 79 blocks, 2 super-blocks; and the GPU's own tile and step-2 sizes."""
    boxes, scores = _random_boxes(3, 5000, layout, dtype)
    idxs = torch.randint(-2, 5, (5000,), generator=torch.Generator().manual_seed(1)) if by_class else None
    for iou_threshold in (0.0, 0.5, 1.0):
        expected = _cpu_kernel(boxes, scores, idxs, iou_threshold)
        for tile_rows, warps in ((64, 3), (GPU_TILE_ROWS, 8192)):
            assert torch.equal(_tiled_single(boxes, scores, idxs, iou_threshold, 0, tile_rows, warps), expected)


def test_tiled_schedule_on_duplicates_and_ties() -> None:
    """Every box repeated 50 times with equal scores: the lower index is kept, the copies suppressed."""
    boxes, _ = _random_boxes(5, 100, "uniform", torch.float32)
    boxes = boxes.repeat(50, 1)
    scores = torch.arange(100, dtype=torch.float32).repeat(50) % 7
    for idxs in (None, torch.arange(5000) % 3):
        expected = _cpu_kernel(boxes, scores, idxs, 0.5)
        assert torch.equal(_tiled_single(boxes, scores, idxs, 0.5, 0, 128), expected)


def test_tiled_schedule_counts_the_kept_boxes_beyond_the_capacity_and_stores_the_best() -> None:
    boxes, scores = _random_boxes(7, 700, "uniform", torch.float32)
    expected = nms(boxes, scores, 0.3)
    keep, counters = _tiled(boxes[None], scores[None], None, 0.3, capacity=10)
    assert counters[0, KEPT] == expected.numel()
    assert torch.equal(keep[0], expected[:10])


def test_tiled_schedule_skips_padding_boxes_in_the_padded_form() -> None:
    boxes, scores = _random_boxes(9, 600, "clustered", torch.float32)
    padded_scores = scores.clone()
    padded_scores[::3] = float("-inf")
    real = torch.nonzero(~torch.isneginf(padded_scores)).flatten()
    boxes_with_garbage = boxes.clone()
    boxes_with_garbage[::3] = float("nan")  # a padding box's values are never read
    expected = real[nms(boxes[real], scores[real], 0.5)]
    keep, counters = _tiled(boxes_with_garbage[None], padded_scores[None], None, 0.5, padded=True)
    assert counters[0].tolist()[BAD_SCORE:] == [0, 0]
    assert torch.equal(keep[0, : counters[0, KEPT]], expected)


@pytest.mark.parametrize(
    ("where", "value", "flag"),
    [("score", float("nan"), BAD_SCORE), ("score", float("inf"), BAD_SCORE), ("box", float("-inf"), BAD_BOX)],
)
@pytest.mark.parametrize("padded", [False, True])
def test_tiled_schedule_flags_non_finite_values(where: str, value: float, flag: int, padded: bool) -> None:
    boxes, scores = _random_boxes(11, 300, "uniform", torch.float32)
    (scores if where == "score" else boxes[:, 2])[123] = value
    _, counters = _tiled(boxes[None], scores[None], None, 0.5, padded=padded)
    assert counters[0, flag] == 1 and counters[0, BAD_SCORE + BAD_BOX - flag] == 0


def test_tiled_schedule_refuses_a_call_over_its_scratch_limit_naming_it() -> None:
    boxes = torch.zeros(1, 1, 4).expand(1, 10_000_000, 4)  # a view: nothing is allocated before the check
    scores = torch.zeros(1, 1).expand(1, 10_000_000)
    message = (
        "_nms_tiled_schedule: 10000000 boxes need 2136 MiB of scratch memory, over the limit of 2048 MiB per call "
        "(about 9586980 boxes); split the input"
    )
    with raises_exactly(ValueError, message):
        _tiled(boxes, scores, None, 0.5, tile_rows=GPU_TILE_ROWS)


@settings(HYPOTHESIS, max_examples=60)
@given(
    seed=st.integers(0, 2**16), n=st.integers(0, 400), images=st.integers(1, 4), tile_rows=st.sampled_from([64, 192])
)
def test_tiled_schedule_on_a_batch_equals_each_image_alone(seed: int, n: int, images: int, tile_rows: int) -> None:
    """Also a tile of 192 rows: 3 blocks of 64, warp 0 resolving each in turn."""
    gen = torch.Generator().manual_seed(seed)
    xy = torch.rand(images, n, 2, generator=gen) * 100
    boxes = torch.cat([xy, xy + torch.rand(images, n, 2, generator=gen) * 30], dim=2)
    scores = torch.randint(0, 20, (images, n), generator=gen).float()
    idxs = torch.randint(0, 3, (images, n), generator=gen)
    keep, counters = _tiled(boxes, scores, idxs, 0.4, tile_rows=tile_rows)
    for b in range(images):
        assert torch.equal(keep[b, : counters[b, KEPT]], batched_nms(boxes[b], scores[b], idxs[b], 0.4))


def test_a_chain_of_suppressions_takes_rounds_and_gives_the_greedy_answer() -> None:
    """Box i overlaps only boxes i - 1 and i + 1 (IoU 1/3): the greedy pass keeps every other box. Within a 64-row
    block each round decides the next link of the chain, the worst case of the rounds."""
    n = 3000
    x = torch.arange(n, dtype=torch.float64)
    boxes = torch.stack([x, torch.zeros(n), x + 2, torch.ones(n)], dim=1)
    scores = torch.linspace(1, 0, n, dtype=torch.float64)
    expected = torch.arange(0, n, 2)
    assert torch.equal(nms_reference(boxes, scores, 0.3), expected)
    for tile_rows, warps in ((64, 3), (GPU_TILE_ROWS, 8192)):
        assert torch.equal(_tiled_single(boxes, scores, None, 0.3, 0, tile_rows, warps), expected)


@pytest.mark.slow  # 100k boxes through the CPU emulation: 2-3 s each
@pytest.mark.parametrize("layout", ["uniform", "few_large"])
@pytest.mark.parametrize("by_class", [False, True], ids=["nms", "batched"])
def test_the_gpu_schedule_at_100k_boxes_is_wide_and_shallow(layout: str, by_class: bool) -> None:
    """The cost model of the GPU's per-tile schedule (1024-row tiles, 8192 step-2 warps; the fallback of the
    persistent chain, test_nms_persistent_chain.py) on 100,000 boxes.

    - Launches: 2 per tile (its pass, then its kept rows' suppression of later boxes), and a few before (the
      host-side torch ops have rows of their own, kind TORCH_OP).
    - No step narrower than 10,000 threads runs more than 64 serial steps, except the tile kernels (one CTA of 1024
      threads per image), which run in rounds: at most 256 steps, against the 1,024 rows a one-thread pass walks.
    - The critical path (the serial steps of all launches, one after another) is under 150,000; the kernel before
      this one ran 277,000 to 882,000 on the workloads of benchmarks/bench_nms_cuda.py.
    The bounds leave about 1.5x room over what was measured.
    """
    n = 100_000
    boxes, scores = _random_boxes(3, n, layout, torch.float32)
    idxs = torch.randint(0, 80, (n,), generator=torch.Generator().manual_seed(0)) if by_class else None
    keep, counters, steps = _schedule(
        boxes[None],
        scores[None],
        None if idxs is None else idxs[None],
        0.5,
        tile_rows=GPU_TILE_ROWS,
        warps=8192,
        persistent=False,
    )
    assert torch.equal(keep[0, : counters[0, KEPT]], _cpu_kernel(boxes, scores, idxs, 0.5))
    kind, width, depth = steps.T
    tiles = -(-n // GPU_TILE_ROWS)
    assert int((kind == TILE_KERNEL).sum()) == tiles
    assert int((kind != TORCH_OP).sum()) <= 2 * tiles + 8
    narrow_steps = (kind == STEP_KERNEL) & (width < 10_000)
    assert int(depth[narrow_steps].max()) <= 64
    assert int(depth[kind == TILE_KERNEL].max()) <= 256
    assert int(depth.sum()) < 150_000


@pytest.mark.slow  # 150 examples through the CPU emulation: about 11 s
@settings(HYPOTHESIS, max_examples=150)
@given(
    data=box_sets(max_n=200),
    iou_threshold=THRESHOLDS,
    classes=st.sampled_from([1, 2, 5, 40]),
    skew=st.booleans(),
)
def test_batched_nms_as_class_chains_matches_the_reference(data, iou_threshold, classes, skew) -> None:
    """``_nms_tiled``, what the CUDA batched_nms runs: the classes as independent chains (rows of a padded batch),
    or, when one class holds most boxes (``skew``), one chain over all of them."""
    boxes, scores = data
    n = boxes.shape[0]
    idxs = torch.arange(n) * 7 % classes
    if skew:
        idxs[: n * 9 // 10] = 0
    expected = batched_nms_reference(boxes, scores, idxs, iou_threshold)
    keep, _ = torch.ops.lightning_balanced._nms_tiled(boxes, scores, idxs, iou_threshold, 0, 64, 3, 0)
    assert torch.equal(keep, expected)


@pytest.mark.slow
def test_batched_nms_runs_its_classes_side_by_side_and_falls_back_to_one_chain_when_one_class_dominates() -> None:
    """100,000 boxes of 80 classes: 2 tiles of the largest class instead of 98 of all boxes. When one class holds
    90 % of the boxes, the padded rows would take 72x the memory: one chain, the class ids pruning. Counted on the
    per-tile launches (persistent=False), where a tile is a launch."""
    n = 100_000
    boxes, scores = _random_boxes(3, n, "uniform", torch.float32)
    idxs = torch.randint(0, 80, (n,), generator=torch.Generator().manual_seed(0))
    per_tile = (1024, 8192, 4096, False)
    keep, steps = torch.ops.lightning_balanced._nms_tiled(boxes, scores, idxs, 0.5, 0, *per_tile)
    assert torch.equal(keep, batched_nms(boxes, scores, idxs, 0.5))
    kind, _, depth = steps.T
    assert int((kind == TILE_KERNEL).sum()) == 2 and int(depth.sum()) < 2_000
    idxs[: n * 9 // 10] = 0
    keep, steps = torch.ops.lightning_balanced._nms_tiled(boxes, scores, idxs, 0.5, 0, *per_tile)
    assert torch.equal(keep, batched_nms(boxes, scores, idxs, 0.5))
    assert int((steps[:, 0] == TILE_KERNEL).sum()) == -(-n // GPU_TILE_ROWS)


@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")])
def test_class_chains_refuse_a_non_finite_score_a_padding_slot_would_hide(value: float) -> None:
    """A real score of -inf looks like a padding slot of the class rows: still an error, as on one chain."""
    boxes, scores = _random_boxes(13, 3000, "uniform", torch.float32)
    scores[17] = value
    with raises_exactly(ValueError, "_nms_tiled: scores must be finite (no NaN or infinity)"):
        torch.ops.lightning_balanced._nms_tiled(boxes, scores, torch.arange(3000) % 80, 0.5, 0, 1024, 8192, 0)
