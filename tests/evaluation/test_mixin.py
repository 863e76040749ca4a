"""DistributedEvalMixin: exact evaluation over ranks, compared with a single-process run on the whole dataset."""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
from torchmetrics.functional.classification import multiclass_accuracy, multiclass_f1_score

from lightning_balanced import BalancedDataParallelStrategy, LRScaledDDPStrategy
from lightning_balanced.evaluation import DistributedEvalMixin, IndexedDataset
from tests.distributed import run_distributed
from tests.helpers import quiet_trainer

NUM_CLASSES = 4


def _dataset(n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(n)
    return TensorDataset(
        torch.randn(n, 3, generator=g, dtype=torch.float64), torch.randint(0, NUM_CLASSES, (n,), generator=g)
    )


class Classifier(DistributedEvalMixin, pl.LightningModule):
    """Hands over predictions, targets, a bool field, per-sample ids and a nested field with their indices."""

    def __init__(self, use_indices: bool = True) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.layer = nn.Linear(3, NUM_CLASSES).double()
        self.use_indices = use_indices
        self.gathered: dict[str, Any] = {}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        indices, (x, y) = batch
        preds = self.layer(x).argmax(1)
        self.add_eval_outputs(
            indices if self.use_indices else None,
            preds=preds,
            target=y,
            correct=preds == y,
            ids=[f"sample-{int(i)}" for i in indices],
            nested={"logits": self.layer(x), "pair": (indices, y)},
        )

    def on_validation_epoch_end(self) -> None:
        self.gathered = self.gather_eval_outputs()
        if self.gathered:
            self.log("val_acc", multiclass_accuracy(self.gathered["preds"], self.gathered["target"], NUM_CLASSES))


def _single_process_reference(n: int) -> dict[str, torch.Tensor]:
    x, y = _dataset(n)[:]
    preds = Classifier().layer(x).argmax(1)
    return {
        "preds": preds,
        "target": y,
        "accuracy": multiclass_accuracy(preds, y, NUM_CLASSES),
        "f1": multiclass_f1_score(preds, y, NUM_CLASSES),
    }


def _validate(strategy: Any, devices: int, n: int, shuffle: bool, use_indices: bool) -> dict[str, Any]:
    model = Classifier(use_indices)
    trainer = quiet_trainer(strategy, devices)
    loader = DataLoader(IndexedDataset(_dataset(n)), batch_size=2, shuffle=shuffle)
    trainer.validate(model, loader, verbose=False)
    out = model.gathered
    return {
        "indices": out.get("indices"),
        "preds": out["preds"],
        "target": out["target"],
        "correct": out["correct"],
        "ids": out["ids"],
        "nested_pair": out["nested"]["pair"],
        "logits": out["nested"]["logits"],
        "accuracy": multiclass_accuracy(out["preds"], out["target"], NUM_CLASSES),
        "f1": multiclass_f1_score(out["preds"], out["target"], NUM_CLASSES),
    }


def _check_exact(result: dict[str, Any], n: int, *, ordered: bool) -> None:
    reference = _single_process_reference(n)
    if result["indices"] is not None:
        assert result["indices"].tolist() == list(range(n))
    order = torch.arange(n) if ordered else result["nested_pair"][0]  # without indices: sampler order
    assert sorted(order.tolist()) == list(range(n))  # every sample exactly once
    assert torch.equal(result["preds"], reference["preds"][order])
    assert torch.equal(result["target"], reference["target"][order])
    assert result["correct"].dtype == torch.bool
    assert torch.equal(result["correct"], reference["preds"][order] == reference["target"][order])
    assert result["ids"] == [f"sample-{i}" for i in order.tolist()]
    assert result["logits"].shape == (n, NUM_CLASSES)
    # bit for bit: the same predictions and targets give the same floats
    assert torch.equal(result["accuracy"], reference["accuracy"])
    assert torch.equal(result["f1"], reference["f1"])


def _ddp_rank(rank: int, world_size: int) -> list[tuple[str, int, bool, bool, dict[str, Any]]]:
    runs = []
    for n in range(1, world_size + 4):
        for shuffle in (False, True):
            strategy = "ddp" if n % 2 else LRScaledDDPStrategy(sync_batchnorm=False)
            runs.append(("indices", n, shuffle, True, _validate(strategy, world_size, n, shuffle, True)))
        # without indices: exact by count when the sampler does not shuffle, in dataset order
        runs.append(("count", n, False, False, _validate("ddp", world_size, n, False, False)))
    return runs


@pytest.mark.parametrize("world_size", [2, 3])
@pytest.mark.slow
def test_gathered_set_equals_the_dataset_and_metrics_equal_single_process(world_size: int) -> None:
    per_rank = run_distributed(_ddp_rank, world_size, timeout_s=300)
    for runs in per_rank:
        for mode, n, shuffle, _, result in runs:
            _check_exact(result, n, ordered=mode == "indices" or not shuffle)
    # identical on every rank
    for runs in zip(*per_rank, strict=True):
        first = runs[0][4]
        for other in runs[1:]:
            assert torch.equal(other[4]["preds"], first["preds"])
            assert torch.equal(other[4]["accuracy"], first["accuracy"])


def _naive_vs_exact_rank(rank: int, world_size: int) -> tuple[float, float, int]:
    """The motivating failure: 5 samples on 2 ranks, a metric synced by torchmetrics counts the padded repeat."""
    from torchmetrics.aggregation import SumMetric
    from torchmetrics.classification import MulticlassAccuracy

    model = Classifier()
    naive, counted = MulticlassAccuracy(NUM_CLASSES, average="micro"), SumMetric()
    loader = DataLoader(IndexedDataset(_dataset(5)), batch_size=2)
    trainer = quiet_trainer("ddp", world_size)
    trainer.validate(model, loader, verbose=False)
    from torch.utils.data import DistributedSampler

    for i in DistributedSampler(range(5), num_replicas=world_size, rank=rank, shuffle=False):
        x, y = _dataset(5)[i]
        naive.update(model.layer(x[None]).argmax(1), y[None])
        counted.update(1.0)
    return float(naive.compute()), float(trainer.callback_metrics["val_acc"]), int(counted.compute())


@pytest.mark.slow
def test_duplicates_padded_by_distributed_sampler_are_not_counted() -> None:
    reference = _single_process_reference(5)
    correct = (reference["preds"] == reference["target"]).double()
    for naive, exact, naive_total in run_distributed(_naive_vs_exact_rank, 2):
        assert naive_total == 6  # [0, 2, 4] and [1, 3, 0]: sample 0 counted twice by the synced metric
        assert naive == pytest.approx(float((correct.sum() + correct[0]) / 6), abs=1e-7)
        assert exact == float(reference["accuracy"])  # the exact one counts it once (macro, as logged)


def _uneven_rank(rank: int, world_size: int) -> dict[str, Any]:
    model = Classifier()
    # rank r holds samples r, r + world_size, ... of 10, in r + 1 calls of unequal size; the last rank holds none
    mine = [i for i in range(10) if i % (world_size - 1) == rank] if rank < world_size - 1 else []
    for chunk in [mine[j : j + rank + 1] for j in range(0, len(mine), rank + 1)]:
        index = torch.tensor(chunk)
        model.add_eval_outputs(index, value=index.double() * 2, flags=index % 3 == 0, names=[str(i) for i in chunk])
    return model.gather_eval_outputs()


@pytest.mark.slow
def test_ranks_with_different_numbers_of_calls_and_an_empty_rank() -> None:
    for result in run_distributed(_uneven_rank, 3):
        assert result["indices"].tolist() == list(range(10))
        assert result["value"].tolist() == [2.0 * i for i in range(10)]
        assert result["flags"].tolist() == [i % 3 == 0 for i in range(10)]
        assert result["names"] == [str(i) for i in range(10)]


def _problem_rank(rank: int, world_size: int) -> str:
    model = Classifier()
    model.add_eval_outputs(torch.tensor([0, 1]), preds=torch.zeros(2))
    if rank == 1:
        model.add_eval_outputs(torch.tensor([1]), preds=torch.zeros(1))  # repeats index 1 on this rank
    try:
        model.gather_eval_outputs()
    except ValueError as err:
        return str(err)
    return "no error"


@pytest.mark.slow
def test_a_problem_on_one_rank_raises_on_every_rank_instead_of_hanging() -> None:
    for message in run_distributed(_problem_rank, 2):
        assert "rank 1" in message and "same sample index twice" in message


# Shuffled evaluation loaders are exactly what the exact gather must survive; Lightning advises against them.
@pytest.mark.filterwarnings("ignore:Your `val_dataloader`'s sampler has shuffling enabled")
@pytest.mark.parametrize("balanced", [True, False], ids=["balanced_dp", "single_device"])
def test_single_process_strategies_gather_the_same_exact_set(balanced: bool) -> None:
    for n in (1, 5, 8):
        strategy = BalancedDataParallelStrategy(gpu0_bsz=1) if balanced else "auto"
        result = _validate(strategy, 3 if balanced else 1, n, shuffle=True, use_indices=True)
        _check_exact(result, n, ordered=True)


def test_without_indices_on_one_device_keeps_call_order() -> None:
    result = _validate("auto", 1, 7, shuffle=False, use_indices=False)
    _check_exact(result, 7, ordered=True)


@pytest.mark.parametrize(
    ("call", "match"),
    [
        (lambda m: m.add_eval_outputs(torch.tensor([0, 1]), a=torch.zeros(2), b=torch.zeros(3)), r"disagree.*'a': 2"),
        (lambda m: m.add_eval_outputs(torch.tensor([0.0, 1.0]), a=torch.zeros(2)), "`indices` must hold integers"),
        (lambda m: m.add_eval_outputs([0, 1.5], a=torch.zeros(2)), "`indices` must hold integers"),
        (lambda m: m.add_eval_outputs(torch.tensor([0, 1]), a=torch.zeros(3)), "`indices` has 2 entries"),
        (lambda m: m.add_eval_outputs(torch.tensor([-1]), a=torch.zeros(1)), ">= 0"),
        (lambda m: m.add_eval_outputs(torch.tensor([0])), "at least one"),
        (lambda m: m.add_eval_outputs(torch.tensor([0]), a=torch.tensor(1.0)), "`a` is a 0-dim tensor"),
    ],
)
def test_bad_per_sample_fields_raise_value_error_naming_them(call: Any, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        call(Classifier())


def test_fields_that_change_between_calls_raise_at_gather() -> None:
    model = Classifier()
    model.add_eval_outputs(torch.tensor([0]), a=torch.zeros(1))
    model.add_eval_outputs(torch.tensor([1]), a=torch.zeros(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="changed between calls"):
        model.gather_eval_outputs()
    model.add_eval_outputs(torch.tensor([0]), a=torch.zeros(1), ids=["x"])  # then a call with fewer fields
    model.add_eval_outputs(torch.tensor([1]), a=torch.zeros(1))
    with pytest.raises(ValueError, match="changed between calls"):
        model.gather_eval_outputs()
    model.add_eval_outputs(torch.tensor([0]), a=torch.zeros(1))
    model.add_eval_outputs(torch.tensor([0]), a=torch.zeros(1))
    with pytest.raises(ValueError, match="same sample index twice on one rank"):
        model.gather_eval_outputs()
    model.add_eval_outputs(torch.tensor([3, 3]), a=torch.zeros(2))  # within one call: the same check, at the gather
    with pytest.raises(ValueError, match="same sample index twice on one rank"):
        model.gather_eval_outputs()


def test_a_field_that_changed_between_calls_is_named_with_both_versions() -> None:
    model = Classifier()
    model.add_eval_outputs([0, 1], boxes=[torch.rand(3, 4), torch.rand(1, 4)])
    model.add_eval_outputs([2], boxes=[torch.empty(0)])  # "no detections" written as a 1-d empty tensor
    with pytest.raises(
        ValueError, match=r"`boxes` is a list of torch.float32 tensors of shape \(K_i, 4\) in the first"
    ):
        model.gather_eval_outputs()


def test_empty_containers_and_a_timeout_that_is_not_positive_raise_value_error() -> None:
    with pytest.raises(ValueError, match="hold no tensor or list"):
        Classifier().add_eval_outputs([0], x={})
    with pytest.raises(ValueError, match="`timeout_s` must be > 0"):
        Classifier().gather_eval_outputs(timeout_s=0)


def test_a_view_of_a_larger_tensor_is_copied_when_added() -> None:
    model, logits = Classifier(), torch.arange(12.0).reshape(4, 3)
    model.add_eval_outputs([0, 1, 2, 3], last=logits[:, -1], rows=list(logits))
    logits.fill_(-1.0)  # neither the column nor the rows pin or share the user's tensor
    out = model.gather_eval_outputs()
    assert out["last"].tolist() == [2.0, 5.0, 8.0, 11.0]
    assert [r.tolist() for r in out["rows"]] == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0], [6.0, 7.0, 8.0], [9.0, 10.0, 11.0]]


def test_non_tensor_fields_of_other_types_raise_type_error() -> None:
    with pytest.raises(TypeError, match="`a` must be a tensor, a list"):
        Classifier().add_eval_outputs(torch.tensor([0]), a=3)


def test_gather_with_nothing_added_returns_empty() -> None:
    assert Classifier().gather_eval_outputs() == {}
