"""What balanced_dp's steps return and raise equals what one device returns and raises for the whole batch."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset

from lightning_balanced import BalancedDataParallelStrategy
from tests.helpers import quiet_trainer
from tests.strategies.test_balanced_dp import EXACT, Regressor, _data


class _Images(Dataset):
    """Each sample is its index and a float64 input; a per-sample id is derived from the index."""

    def __init__(self, n: int) -> None:
        self.data = _data(n)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        x, y = self.data[i]
        return {"index": torch.tensor(i), "x": x, "y": y}


class _Outputs(Regressor):
    """Steps that return every output kind of the strategy's docstring table."""

    def _outputs(self, batch: Any) -> dict[str, Any]:
        x, index = batch["x"], batch["index"]
        pred = self(x)
        return {
            "ids": [f"img{int(i)}" for i in index],  # per-sample list[str]
            "detections": [{"boxes": pred[i : i + 1].detach(), "id": int(index[i])} for i in range(len(x))],
            "pair": [pred.detach(), batch["y"]],  # a structure list of batched tensors
            "count": (x > 0).sum(),  # 0-dim int64
            "flag": (x > 2).any(),  # 0-dim bool
            "mean": pred.mean().detach(),  # 0-dim float: chunk-weighted mean
            "preds": pred.detach(),
            "name": "constant",
        }

    def predict_step(self, batch: Any, batch_idx: int) -> Any:
        return self._outputs(batch)


def _assert_same(got: Any, expected: Any) -> None:
    assert type(got) is type(expected), (type(got), type(expected))
    if isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and got.shape == expected.shape
        torch.testing.assert_close(got, expected, **EXACT)
    elif isinstance(expected, dict):
        assert list(got) == list(expected)
        for key in expected:
            _assert_same(got[key], expected[key])
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected)
        for g, e in zip(got, expected, strict=True):
            _assert_same(g, e)
    else:
        assert got == expected


@pytest.mark.parametrize(
    ("options", "devices"), [({"chunk_sizes": [1, 3, 2]}, 3), ({"gpu0_bsz": 0}, 3), ({"weights": [1.0, 1.0]}, 2)]
)
def test_predict_outputs_equal_single_device_outputs(options: dict[str, Any], devices: int) -> None:
    model = _Outputs()
    loader = DataLoader(_Images(12), batch_size=6)
    expected = quiet_trainer("auto", 1).predict(model, loader)
    got = quiet_trainer(BalancedDataParallelStrategy(**options), devices).predict(model, loader)
    assert got is not None and expected is not None
    assert got[0]["ids"] == [f"img{i}" for i in range(6)]  # not [['img0', 'img2', ...], ['img1', ...]]
    assert got[0]["count"].dtype == torch.int64  # not a float32 chunk-weighted mean
    _assert_same(got, expected)


def test_sum_reduction_sums_floating_scalars_and_keeps_counts() -> None:
    class Sums(Regressor):
        def predict_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return {"loss": F.mse_loss(self(x), y, reduction="sum").detach(), "count": (x > 0).sum()}

    model = Sums()
    loader = DataLoader(_data(10), batch_size=10)
    expected = quiet_trainer("auto", 1).predict(model, loader)
    got = quiet_trainer(BalancedDataParallelStrategy(chunk_sizes=[3, 7], loss_reduction="sum"), 2).predict(
        model, loader
    )
    _assert_same(got, expected)


class _BatchNormThenValueError(Regressor):
    """Has BatchNorm and a chunk of one sample, but fails with a ValueError of its own before any BatchNorm runs."""

    def __init__(self) -> None:
        super().__init__(batchnorm=True)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        raise ValueError("the labels are out of range")


def test_only_the_batchnorm_one_sample_error_gets_the_batchnorm_message() -> None:
    trainer = quiet_trainer(BalancedDataParallelStrategy(gpu0_bsz=1), 3, max_steps=1)
    with pytest.raises(ValueError, match="the labels are out of range") as info:
        trainer.fit(_BatchNormThenValueError(), DataLoader(_data(9), batch_size=9))
    assert "batch-normalized" not in str(info.value)
    # The BatchNorm error itself still gets it.
    trainer = quiet_trainer(BalancedDataParallelStrategy(gpu0_bsz=1), 3, max_steps=1)
    with pytest.raises(ValueError, match=r"gpu0_bsz=1.*drop_last") as info:
        trainer.fit(Regressor(batchnorm=True), DataLoader(_data(9), batch_size=9))
    assert "Expected more than 1 value per channel" in str(info.value.__cause__)


def test_batchnorm_2d_with_a_one_image_chunk_is_not_an_error() -> None:
    # One image still has H * W values per channel: only a single value per channel is the BatchNorm error.
    class Conv(Regressor):
        def __init__(self) -> None:
            super().__init__()
            self.conv = nn.Sequential(nn.Conv2d(1, 2, 3, padding=1), nn.BatchNorm2d(2)).double()

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            return self.conv(batch[0].view(-1, 1, 1, 5)).pow(2).mean()

    model = Conv()
    trainer = quiet_trainer(BalancedDataParallelStrategy(chunk_sizes=[1, 4]), 2, max_steps=1)
    trainer.fit(model, DataLoader(_data(5), batch_size=5))
    # The step ran: one optimizer step, and replica 0's BatchNorm (the one-image chunk) updated the running statistics.
    assert trainer.global_step == 1
    assert int(model.conv[1].num_batches_tracked) == 1
