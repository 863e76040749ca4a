"""DistributedEvalMixin's edge cases: empty calls in every field kind, fields that differ across ranks, and a rank
that never calls ``gather_eval_outputs``, on real gloo ranks (each spawn costs ~10 s, so one spawn holds many checks).
"""

from __future__ import annotations

import time
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_balanced import BalancedDataParallelStrategy
from lightning_balanced.evaluation import DistributedEvalMixin, IndexedDataset
from lightning_balanced.evaluation.store_gather import _exchanges
from tests.distributed import run_distributed
from tests.helpers import CUDA_DEVICE_LISTS, RunIf, gpu_ids, quiet_trainer, raises_exactly


class Holder(DistributedEvalMixin):
    """The mixin alone, as a LightningModule uses it at epoch end."""


def _fields(indices: list[int]) -> dict[str, Any]:
    """One value of every field kind per sample, a function of the sample index only."""
    return {
        "tensor": torch.tensor(indices, dtype=torch.float32)[:, None].repeat(1, 3),
        "flag": torch.tensor([i % 2 == 0 for i in indices], dtype=torch.bool),
        "ragged": [torch.arange(i, dtype=torch.int32).reshape(i, 1) for i in indices],  # sample 0: a (0, 1) tensor
        "objects": [f"id-{i}" for i in indices],
        "nested": {"pair": ([torch.full((i % 3,), float(i)) for i in indices], torch.tensor(indices))},
    }


def _empty_fields() -> dict[str, Any]:
    """A call with zero samples, in every kind: empty tensors (of other dtypes and shapes), empty lists."""
    return {
        "tensor": torch.zeros(0, 7, dtype=torch.int64),
        "flag": torch.zeros(0),
        "ragged": [],
        "objects": [],
        "nested": {"pair": ([], torch.zeros(0))},
    }


def _check_result(result: dict[str, Any], indices: list[int]) -> None:
    expected = _fields(indices)
    assert result["indices"].tolist() == indices
    assert torch.equal(result["tensor"], expected["tensor"])
    assert result["flag"].dtype == torch.bool and torch.equal(result["flag"], expected["flag"])
    assert len(result["ragged"]) == len(indices)
    assert all(torch.equal(a, b) for a, b in zip(result["ragged"], expected["ragged"], strict=True))
    assert result["objects"] == expected["objects"]
    got, want = result["nested"]["pair"], expected["nested"]["pair"]
    assert all(torch.equal(a, b) for a, b in zip(got[0], want[0], strict=True)) and len(got[0]) == len(want[0])
    assert torch.equal(got[1], want[1])


# ---- one process ---------------------------------------------------------------------------------------------------
def test_an_empty_call_is_a_no_op_in_every_field_kind_before_between_and_after() -> None:
    holder = Holder()
    holder.add_eval_outputs(torch.zeros(0, dtype=torch.int64), **_empty_fields())  # first call: empty
    holder.add_eval_outputs([3, 0], **_fields([3, 0]))
    holder.add_eval_outputs([], **_empty_fields())
    holder.add_eval_outputs(torch.tensor([2, 1]), **_fields([2, 1]))
    holder.add_eval_outputs(torch.zeros(0, dtype=torch.int64), **_empty_fields())
    _check_result(holder.gather_eval_outputs(), [0, 1, 2, 3])


def test_the_issues_example_an_empty_ragged_list_after_a_ragged_one() -> None:
    holder = Holder()
    holder.add_eval_outputs(torch.tensor([0, 1]), r=[torch.ones(2), torch.ones(1)])
    holder.add_eval_outputs(torch.tensor([], dtype=torch.int64), r=[])
    out = holder.gather_eval_outputs()
    assert [t.tolist() for t in out["r"]] == [[1.0, 1.0], [1.0]]


def test_only_empty_calls_give_an_empty_result() -> None:
    holder = Holder()
    holder.add_eval_outputs(None, **_empty_fields())
    assert holder.gather_eval_outputs(dataset_size=0) == {}


def test_an_empty_call_still_checks_its_arguments() -> None:
    with pytest.raises(ValueError, match="disagree on the number of samples"):
        Holder().add_eval_outputs(None, a=[], b=torch.zeros(1))
    with pytest.raises(ValueError, match="`indices` has 1 entries"):
        Holder().add_eval_outputs([0], a=[])
    with pytest.raises(TypeError, match="`a` must be a tensor"):
        Holder().add_eval_outputs([], a=3)


def test_without_indices_a_rank_holding_more_than_the_sampler_gives_it_is_an_error() -> None:
    holder = Holder()
    holder.add_eval_outputs(None, a=torch.arange(4))
    with pytest.raises(ValueError, match=r"rank 0 added 4 samples.*at most 3 of the 3"):
        holder.gather_eval_outputs(dataset_size=3)


# ---- two gloo ranks: empty calls, and fields that differ across ranks ----------------------------------------------
# (name, what rank 0 adds, what rank 1 adds, substrings the error must contain); indices 0/1 for rank 0/1.
_MISMATCHES: list[tuple[str, dict[str, Any], dict[str, Any], list[str]]] = [
    (
        "tensor dtype",
        {"preds": torch.zeros(1)},
        {"preds": torch.zeros(1, dtype=torch.int64)},
        ["`preds`", "torch.float32 tensor of shape (N)", "rank 0", "torch.int64 tensor of shape (N)", "rank 1"],
    ),
    (
        "tensor trailing shape",
        {"scores": torch.zeros(1, 3)},
        {"scores": torch.zeros(1, 4)},
        ["`scores`", "(N, 3) on rank 0", "(N, 4) on rank 1"],
    ),
    (
        "ragged trailing shape",
        {"boxes": [torch.zeros(2, 4)]},
        {"boxes": [torch.zeros(1, 5)]},
        ["`boxes`", "a list of torch.float32 tensors of shape (K_i, 4) on rank 0", "(K_i, 5) on rank 1"],
    ),
    (
        "ragged dtype",
        {"boxes": [torch.zeros(2, 4)]},
        {"boxes": [torch.zeros(1, 4, dtype=torch.float64)]},
        ["`boxes`", "torch.float32 tensors", "torch.float64 tensors"],
    ),
    (
        "ragged against objects",
        {"ids": [torch.zeros(2)]},
        {"ids": ["image-1"]},
        ["`ids`", "a list of torch.float32 tensors of shape (K_i) on rank 0", "a list of Python objects on rank 1"],
    ),
    (
        "objects against tensor",
        {"ids": ["image-0"]},
        {"ids": torch.zeros(1)},
        ["`ids`", "a list of Python objects on rank 0", "a torch.float32 tensor of shape (N) on rank 1"],
    ),
    (
        "names",
        {"a": torch.zeros(1), "b": torch.zeros(1)},
        {"a": torch.zeros(1), "c": torch.zeros(1)},
        ["`b`", "on rank 0 but absent on rank 1"],
    ),
    (
        "structure",
        {"nested": {"x": torch.zeros(1)}},
        {"nested": (torch.zeros(1),)},
        ["`nested`", "a dict ('x': a torch.float32 tensor of shape (N)) on rank 0", "a tuple (a torch.float32"],
    ),
]


def _edge_rank(rank: int, world_size: int) -> dict[str, Any]:
    holder, out = Holder(), {}

    def gather(**kwargs: Any) -> Any:
        try:
            return holder.gather_eval_outputs(timeout_s=30, **kwargs)
        except ValueError as err:
            return f"ValueError: {err}"

    # rank 1 only ever makes empty calls, of every kind
    for chunk in ([0, 3], [2], [1, 4]) if rank == 0 else ([], [], []):
        holder.add_eval_outputs(chunk, **(_fields(chunk) if chunk else _empty_fields()))
    out["only empty calls on rank 1"] = gather()
    # both start with an empty call; rank 1 also ends with one
    holder.add_eval_outputs([], **_empty_fields())
    holder.add_eval_outputs([rank, rank + 2], **_fields([rank, rank + 2]))
    if rank == 1:
        holder.add_eval_outputs(torch.zeros(0, dtype=torch.int64), **_empty_fields())
    out["empty first call"] = gather()
    # the issue's example on rank 1: an empty ragged list after a ragged one
    holder.add_eval_outputs(torch.tensor([2 * rank, 2 * rank + 1]), r=[torch.ones(2), torch.ones(1)])
    if rank == 1:
        holder.add_eval_outputs(torch.tensor([], dtype=torch.int64), r=[])
    out["issue example"] = gather()
    # without indices: rank 1 (3 samples of 5 in DistributedSampler's layout: [1, 3, 0]) with empty calls between
    mine = [rank, rank + 2, (rank + 4) % 5]
    holder.add_eval_outputs(None, value=torch.tensor(mine[:2]), objects=[str(i) for i in mine[:2]])
    holder.add_eval_outputs(None, value=torch.zeros(0, dtype=torch.int64), objects=[])
    holder.add_eval_outputs(None, value=torch.tensor(mine[2:]), objects=[str(i) for i in mine[2:]])
    out["without indices"] = gather(dataset_size=5)
    for name, on_rank0, on_rank1, _ in _MISMATCHES:
        holder.add_eval_outputs([rank], **(on_rank0 if rank == 0 else on_rank1))
        out[name] = gather()
    holder.add_eval_outputs([rank] if rank == 0 else None, a=torch.zeros(1))
    out["indices on one rank only"] = gather()
    # without indices, ranks that disagree on the dataset's size: refused on both, not a rank raising alone
    holder.add_eval_outputs(None, a=torch.zeros(3))
    out["dataset sizes differ"] = gather(dataset_size=5 + 5 * rank)
    # an object that does not pickle on rank 1: named on both ranks at once, not blamed as a rank that did not come
    holder.add_eval_outputs([rank], o=[(lambda: 0) if rank else "x"])
    start = time.monotonic()
    out["unpicklable"] = (gather(), time.monotonic() - start)
    # 0-dim tensors, and tensors inside Python objects (target dicts): each kept once, back on the root device
    scores = torch.tensor([0.5, 1.5]) + rank
    holder.add_eval_outputs(
        [rank, rank + 2], s=list(scores), t=[{"boxes": torch.full((i, 4), float(i))} for i in (1, 2)]
    )
    out["scalars and dicts"] = gather()
    holder.add_eval_outputs([rank], a=torch.tensor([float(rank)]))  # the group still works after all of that
    out["after the errors"] = gather()
    torch.distributed.barrier()
    count = _exchanges["gather_eval_outputs", (0, 1)]
    keys = [f"lightning_balanced/gather_eval_outputs/0,1/{c}/{name}" for c in range(1, count + 1) for name in "01v"]
    store = torch.distributed.distributed_c10d._get_default_store()
    present = [key for key in keys if store.check([key.replace("/v", "/verdict")])]
    out["store keys left"] = [key.rsplit("/", 2)[-2:] for key in present]  # each exchange deletes the one before
    # a rank that arrives after the other gave up raises too, instead of going into the gather alone
    holder.add_eval_outputs([rank], a=torch.zeros(1))
    if rank == 1:
        time.sleep(3)
    try:
        holder.gather_eval_outputs(timeout_s=1.5)
        out["late rank"] = "finished"
    except RuntimeError as err:
        out["late rank"] = str(err)
    if rank == 0:
        time.sleep(3)  # keep the store (hosted by rank 0) up while rank 1 arrives
    return out


@pytest.mark.slow
def test_empty_calls_and_field_mismatches_on_two_gloo_ranks() -> None:
    per_rank = run_distributed(_edge_rank, 2, timeout_s=240)
    for out in per_rank:
        _check_result(out["only empty calls on rank 1"], [0, 1, 2, 3, 4])
        _check_result(out["empty first call"], [0, 1, 2, 3])
        assert [t.tolist() for t in out["issue example"]["r"]] == [[1.0, 1.0], [1.0]] * 2
        assert out["issue example"]["indices"].tolist() == [0, 1, 2, 3]
        assert out["without indices"]["value"].tolist() == [0, 1, 2, 3, 4]  # the repeat of sample 0 dropped
        assert out["without indices"]["objects"] == ["0", "1", "2", "3", "4"]
        for name, _, _, parts in _MISMATCHES:
            message = out[name]
            assert isinstance(message, str) and message.startswith("ValueError: Cannot gather"), (name, message)
            for part in parts:
                assert part in message, (name, part, message)
        assert "`indices` was given on rank 0 but not on rank 1" in out["indices on one rank only"]
        assert "`dataset_size` is 5 on rank 0 but 10 on rank 1" in out["dataset sizes differ"]
        message, seconds = out["unpicklable"]
        assert message.startswith("ValueError: gather_eval_outputs: cannot send the objects of rank 1"), message
        assert seconds < 10, seconds  # not the 30 s meeting timeout
        scalars_and_dicts = out["scalars and dicts"]
        assert [float(v) for v in scalars_and_dicts["s"]] == [0.5, 1.5, 1.5, 2.5]
        assert all(v.dim() == 0 for v in scalars_and_dicts["s"])
        assert [d["boxes"].shape[0] for d in scalars_and_dicts["t"]] == [1, 1, 2, 2]
        assert torch.equal(scalars_and_dicts["t"][3]["boxes"], torch.full((2, 4), 2.0))
        assert out["after the errors"]["a"].tolist() == [0.0, 1.0]
        assert len(out["store keys left"]) == 3, out["store keys left"]  # the last exchange's 2 keys and verdict
        assert {count for count, _ in out["store keys left"]} == {out["store keys left"][0][0]}
    assert "rank(s) [1] did not call it within 1.5 s" in per_rank[0]["late rank"]
    assert "the other ranks stopped waiting for this one" in per_rank[1]["late rank"]
    for name in [*(m[0] for m in _MISMATCHES), "dataset sizes differ"]:
        assert per_rank[0][name] == per_rank[1][name], name  # the same error on every rank


# ---- a rank that never calls gather_eval_outputs -----------------------------------------------------------------
# The ranks run with run_distributed's process-group timeout, timeout_s / 2 = 120 s: without the bounded meeting the
# arrived rank would wait that long in a collective (30 minutes with torch's default), so a case that ends within
# 35 s was ended by it. The meeting's own wait is shortened to 5 s here (60 s by default).
_WAIT_S = 5.0


class SkippingModel(DistributedEvalMixin, pl.LightningModule):
    """Calls ``gather_eval_outputs`` on ``gathering_rank`` only: the mistake this guards against."""

    def __init__(self, gathering_rank: int) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 1)
        self.gathering_rank = gathering_rank

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        _, (x,) = batch
        return self.layer(x).sum()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        indices, (x,) = batch
        self.add_eval_outputs(indices, y=self.layer(x))

    def on_validation_epoch_end(self) -> None:
        if self.global_rank == self.gathering_rank:
            self.gather_eval_outputs(timeout_s=_WAIT_S)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _skipping_rank(rank: int, world_size: int, loop: str, gathering_rank: int) -> tuple[str, float]:
    loader = DataLoader(IndexedDataset(TensorDataset(torch.randn(6, 2))), batch_size=2)
    trainer = quiet_trainer("ddp", world_size, max_epochs=1, num_sanity_val_steps=0)
    start = time.monotonic()
    try:
        if loop == "fit":
            trainer.fit(SkippingModel(gathering_rank), loader, loader)
        else:
            trainer.validate(SkippingModel(gathering_rank), loader, verbose=False)
    except Exception as err:
        return f"{type(err).__name__}: {err}", time.monotonic() - start
    return "finished", time.monotonic() - start


@pytest.mark.parametrize(
    ("loop", "gathering_rank"), [("fit", 0), ("validate", 0), ("validate", 1)], ids=["fit", "validate", "validate-r1"]
)
@pytest.mark.slow
def test_a_rank_that_skips_the_gather_is_named_instead_of_a_hang(loop: str, gathering_rank: int) -> None:
    results = run_distributed(_skipping_rank, 2, loop, gathering_rank, timeout_s=240)
    message, seconds = results[gathering_rank]
    skipping = 1 - gathering_rank
    assert message.startswith("RuntimeError: gather_eval_outputs:"), message
    assert f"rank(s) [{skipping}] did not call it within 5 s" in message
    assert "if self.global_rank == 0:" in message  # the usual cause
    assert seconds < 35, (message, seconds)
    assert results[skipping][1] < 35, results[skipping]  # the rank that skipped is not left hanging either


# ---- several GPUs: balanced_dp's replicas add outputs from their own devices ---------------------------------------
class DeviceModel(DistributedEvalMixin, pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 3)
        self.out: dict[str, Any] = {}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        indices, (x,) = batch
        y = self.layer(x)
        self.add_eval_outputs(indices, y=y, per_sample=list(y), ids=[str(int(i)) for i in indices])

    def on_validation_epoch_end(self) -> None:
        self.out = self.gather_eval_outputs()


@pytest.mark.parametrize("devices", CUDA_DEVICE_LISTS)
def test_balanced_dp_on_several_gpus_gathers_on_the_root_device(devices: list[torch.device]) -> None:
    x = torch.randn(9, 2)
    model = DeviceModel()
    strategy = BalancedDataParallelStrategy(gpu0_bsz=1, parallel_devices=devices)
    trainer = quiet_trainer(strategy, gpu_ids(devices), accelerator="gpu")
    trainer.validate(model, DataLoader(IndexedDataset(TensorDataset(x)), batch_size=4), verbose=False)
    out = model.out
    assert out["y"].device == torch.device("cuda", 0) and out["indices"].tolist() == list(range(9))
    assert all(t.device == torch.device("cuda", 0) for t in out["per_sample"])
    # Lightning's teardown moved the module back to the host: the reference runs there, and the comparison too.
    expected = model.layer(x).detach()
    torch.testing.assert_close(out["y"].cpu(), expected)  # float32 on two devices: summation order, a tolerance
    assert out["ids"] == [str(i) for i in range(9)]


@RunIf(min_cuda_gpus=1)
def test_negative_indices_on_a_gpu_are_refused_at_the_gather_not_with_a_host_sync_in_the_step() -> None:
    holder = Holder()
    holder.add_eval_outputs(torch.tensor([0, -1], device="cuda"), a=torch.zeros(2, device="cuda"))  # no check: no sync
    with pytest.raises(ValueError, match=r"rank 0: `indices` must be >= 0, got -1"):
        holder.gather_eval_outputs()


def test_a_batch_index_passed_as_indices_is_refused_naming_the_call() -> None:
    with raises_exactly(
        TypeError,
        "`indices` must be the dataset indices of the samples, a Tensor[N] or a sequence of N ints, got int 3; pass"
        " the outputs as keywords: `add_eval_outputs(indices, pred=..., target=...)` or `add_eval_outputs(pred=...,"
        " target=...)` without indices",
    ):
        Holder().add_eval_outputs(3, pred=torch.zeros(2))  # type: ignore[arg-type]


# ---- balanced_dp without indices: the replicas' chunks come back in batch order -------------------------------------
class UnindexedModel(DistributedEvalMixin, pl.LightningModule):
    """Adds its outputs without indices; a chunk's step takes longer the more samples it has, so the replicas with the
    first (larger) chunks add theirs last."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(2, 3).double()
        self.out: dict[str, Any] = {}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        (x,) = batch
        time.sleep(0.02 * len(x))
        self.add_eval_outputs(y=self.layer(x), first=[float(x[0, 0])] * len(x))
        if len(x):
            self.add_eval_outputs(y=self.layer(x[:0]), first=[])  # an empty call changes nothing

    def on_validation_epoch_end(self) -> None:
        self.add_eval_outputs(y=self.layer(torch.zeros(0, 2, dtype=torch.float64)), first=[])  # outside the replicas
        self.out = self.gather_eval_outputs()


@pytest.mark.parametrize("chunk_sizes", [[6, 2], [4, 3, 1]], ids=["2-devices", "3-devices"])
def test_balanced_dp_without_indices_gathers_in_batch_order(chunk_sizes: list[int]) -> None:
    x = torch.randn(20, 2, dtype=torch.float64)
    model = UnindexedModel()
    strategy = BalancedDataParallelStrategy(chunk_sizes=chunk_sizes)
    trainer = quiet_trainer(strategy, len(chunk_sizes), accelerator="cpu")
    trainer.validate(model, DataLoader(TensorDataset(x), batch_size=8), verbose=False)
    with torch.no_grad():
        # A row's value depends on how many rows its matrix product had (the CPU GEMM's blocking: 1 ulp apart on a
        # 16-core machine), a row out of order by O(1): float64 rounding is far below the tolerance.
        torch.testing.assert_close(model.out["y"], model.layer(x), rtol=1e-12, atol=1e-12)
    assert len(model.out["first"]) == 20
