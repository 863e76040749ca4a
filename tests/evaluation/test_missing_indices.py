"""The mixin's pattern over a plain dataset names IndexedDataset (``evaluation/missing_indices.py``)."""

from __future__ import annotations

import re
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.utilities.signature_utils import is_param_in_hook_signature
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_balanced import BalancedDataParallelStrategy, DistributedEvalMixin, IndexedDataset
from tests.helpers import quiet_trainer


def _dataset(n: int = 8) -> TensorDataset:
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, 3, generator=g), torch.randint(0, 2, (n,), generator=g))


class ReadmeModel(DistributedEvalMixin, pl.LightningModule):
    """The README's validation step: ``indices, (x, y) = batch``."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(3, 2)
        self.kept = 0

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        indices, (x, y) = batch
        self.add_eval_outputs(indices, preds=self.layer(x).argmax(1), target=y)

    def test_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if batch_idx == 1:
            raise RuntimeError("a bug of the step's own, on its second batch")
        x, y = batch
        self.add_eval_outputs(preds=self.layer(x).argmax(1), target=y)

    def on_validation_epoch_end(self) -> None:
        self.kept = len(self.gather_eval_outputs()["preds"])


def _message(batch_size: int, step_error: str) -> str:
    return (
        f"validation_step failed on its first batch ({step_error}), and that batch carries no sample indices:"
        f" TensorDataset items, whose first element is a float32 tensor of shape ({batch_size}, 3). If the step unpacks"
        " `indices, sample = batch` (DistributedEvalMixin's example), wrap the evaluation dataset:"
        " DataLoader(IndexedDataset(dataset), ...), with `from lightning_balanced import IndexedDataset`. Indices are"
        " optional: add_eval_outputs(preds=..., target=...) without them is exact under DistributedSampler,"
        " balanced_dp and balanced_ddp"
    )


@pytest.mark.parametrize("batch_size", [4, 2], ids=["unpacking_fails", "linear_fails"])
def test_the_readme_step_over_a_plain_dataset_names_indexed_dataset(batch_size: int) -> None:
    loader = DataLoader(_dataset(), batch_size=batch_size)
    with pytest.raises((ValueError, RuntimeError)) as step_error:  # the step's own error (batch_idx 1: not named)
        ReadmeModel().validation_step(next(iter(loader)), 1)
    assert type(step_error.value) is (ValueError if batch_size == 4 else RuntimeError)  # torch's, inside nn.Linear
    expected = _message(batch_size, f"{type(step_error.value).__name__}: {step_error.value}")
    with pytest.raises(ValueError, match=f"^{re.escape(expected)}$") as raised:
        quiet_trainer().validate(ReadmeModel(), loader, verbose=False)
    assert type(raised.value.__cause__) is type(step_error.value)


def test_before_training_in_the_sanity_check() -> None:
    model = ReadmeModel()
    model.training_step = lambda batch, batch_idx: model.layer(batch[0]).sum()  # type: ignore[method-assign]
    model.configure_optimizers = lambda: torch.optim.SGD(model.parameters(), lr=0.1)  # type: ignore[method-assign]
    loader = DataLoader(_dataset(), batch_size=4)
    trainer = quiet_trainer(max_epochs=1)
    with pytest.raises(ValueError, match=r"^validation_step failed on its first batch .* wrap the evaluation dataset"):
        trainer.fit(model, loader, loader)
    assert trainer.global_step == 0


def test_under_balanced_dp_the_replicas_error_names_it_too() -> None:
    trainer = quiet_trainer(BalancedDataParallelStrategy(chunk_sizes=[2, 2]), devices=2)
    with pytest.raises(
        ValueError, match=re.escape("wrap the evaluation dataset: DataLoader(IndexedDataset(dataset), ...)")
    ):
        trainer.validate(ReadmeModel(), DataLoader(_dataset(), batch_size=4), verbose=False)


def test_with_indexed_dataset_the_step_runs() -> None:
    model = ReadmeModel()
    quiet_trainer().validate(model, DataLoader(IndexedDataset(_dataset()), batch_size=4), verbose=False)
    assert model.kept == 8


def test_an_error_after_the_first_batch_is_the_steps_own() -> None:
    trainer = quiet_trainer()
    with pytest.raises(RuntimeError, match=r"^a bug of the step's own, on its second batch$"):
        trainer.test(ReadmeModel(), DataLoader(_dataset(), batch_size=4), verbose=False)


def test_an_error_on_a_batch_that_carries_indices_is_the_steps_own() -> None:
    class Failing(ReadmeModel):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            raise TypeError("the step's own")

    with pytest.raises(TypeError, match=r"^the step's own$"):
        quiet_trainer().validate(Failing(), DataLoader(IndexedDataset(_dataset()), batch_size=4), verbose=False)


def test_out_of_memory_is_left_as_it_is() -> None:
    class OutOfMemory(ReadmeModel):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(torch.cuda.OutOfMemoryError):
        quiet_trainer().validate(OutOfMemory(), DataLoader(_dataset(), batch_size=4), verbose=False)


def test_the_step_keeps_its_signature_for_lightning() -> None:
    assert is_param_in_hook_signature(ReadmeModel.test_step, "dataloader_idx", explicit=True)
    assert not is_param_in_hook_signature(ReadmeModel.validation_step, "dataloader_idx", explicit=True)

    class Subclass(ReadmeModel):  # inherits the wrapped steps: wrapped once, named once
        pass

    assert Subclass.validation_step is ReadmeModel.validation_step
