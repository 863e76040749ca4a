"""No phase of the CUDA NMS kernels depends on the order of its threads (csrc/ops/cpu/nms_tiled_schedule.cpp).

The CPU emulation runs the threads of a phase (the code between two barriers) one after another; on a GPU they
run at once. A phase in which one thread reads what another writes before the barrier gives the right answer in
one order and a wrong one in another: a race the emulation in index order hides. The private ops'
``thread_order`` runs the threads reversed (1) or in a permutation (k > 1); every order must give the indices of
index order, which the other tests compare with the reference. Sequential threads cannot show a torn
read-modify-write (the kernels use atomics for those). Fails when step 5 of the single launch, or the last phase of
a tile, reads a total that thread 0 writes in the same phase (both tried; index order passes them).
"""

from __future__ import annotations

import pytest
import torch

from tests.helpers import RunIf, raises_exactly
from tests.ops.test_nms import _random_boxes

pytestmark = RunIf(compiled_ops=True)

ORDERS = [1, 2, 7]


def _large_boxes(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Every box wider than 1/8 of the extent: no grid, every kept row a candidate, so the single launch defers
    more rows than its 256 a block (step 4 (e)), and which ones overflow depends on the order."""
    gen = torch.Generator().manual_seed(n)
    xy = torch.rand(n, 2, generator=gen) * 100
    return torch.cat([xy, xy + torch.rand(n, 2, generator=gen) * 60 + 20], dim=1), torch.rand(n, generator=gen)


def _inputs(n: int, layout: str, by_class: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    boxes, scores = _large_boxes(n) if layout == "large" else _random_boxes(5, n, layout, torch.float32)
    idxs = torch.randint(0, 4, (n,), generator=torch.Generator().manual_seed(3)) if by_class else None
    return boxes, scores, idxs


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize(("n", "layout"), [(700, "uniform"), (1000, "few_large"), (1000, "clustered"), (4096, "large")])
@pytest.mark.parametrize("by_class", [False, True], ids=["nms", "batched"])
def test_the_single_launch_gives_the_same_indices_in_any_thread_order(
    n: int, layout: str, by_class: bool, order: int
) -> None:
    boxes, scores, idxs = _inputs(n, layout, by_class)
    expected, _ = torch.ops.lightning_balanced._nms_tiled(boxes, scores, idxs, 0.7, 0)
    keep, steps = torch.ops.lightning_balanced._nms_tiled(boxes, scores, idxs, 0.7, 0, thread_order=order)
    assert steps.shape[0] == 3  # the single launch: 1 launch, 2 host ops
    assert torch.equal(keep, expected)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("persistent", [False, True], ids=["per_tile_launches", "persistent_chain"])
@pytest.mark.parametrize("by_class", [False, True], ids=["nms", "batched"])
def test_the_tiles_give_the_same_indices_in_any_thread_order(persistent: bool, by_class: bool, order: int) -> None:
    """3000 boxes in tiles of 256 rows (12 tiles; small_rows 0 turns the single launch off)."""
    boxes, scores, idxs = _inputs(3000, "mixed_sizes", by_class)
    args = (boxes, scores, idxs, 0.5, 0, 256, 64, 0, persistent)
    expected, _ = torch.ops.lightning_balanced._nms_tiled(*args)
    keep, _ = torch.ops.lightning_balanced._nms_tiled(*args, thread_order=order)
    assert torch.equal(keep, expected)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("small_rows", [4096, 0], ids=["single_launch", "tiles"])
def test_the_padded_batch_gives_the_same_rows_in_any_thread_order(small_rows: int, order: int) -> None:
    boxes, scores = _random_boxes(9, 3 * 500, "heavy_tailed", torch.float32)
    boxes, scores = boxes.view(3, 500, 4), scores.view(3, 500)
    args = (boxes, scores, None, 0.5, 0, True, 200, 256, 64, small_rows)
    keep, counters, _ = torch.ops.lightning_balanced._nms_tiled_schedule(*args)
    keep_in_order, counters_in_order, _ = torch.ops.lightning_balanced._nms_tiled_schedule(*args, thread_order=order)
    assert torch.equal(keep_in_order, keep) and torch.equal(counters_in_order, counters)


def test_thread_order_is_checked() -> None:
    boxes, scores = _random_boxes(3, 10, "uniform", torch.float32)
    with raises_exactly(ValueError, "_nms_tiled: thread_order must be >= 0, got -1"):
        torch.ops.lightning_balanced._nms_tiled(boxes, scores, None, 0.5, 0, thread_order=-1)
