"""A batch of 0 samples (e.g. a collate function that filtered every sample out) runs as on one device."""

from __future__ import annotations

import copy
import math
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from lightning_balanced import BalancedDataParallelStrategy
from tests.helpers import quiet_trainer
from tests.strategies.test_balanced_dp import EXACT, Regressor, _data

_DATA = _data(12)


class _Indices(Dataset):
    def __len__(self) -> int:
        return len(_DATA)

    def __getitem__(self, i: int) -> int:
        return i


def _drop_4_to_7(indices: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Batches of 4: the second batch loses every sample and is empty, of shapes (0, 5) and (0, 3)."""
    kept = [i for i in indices if not 4 <= i < 8]
    x, y = _DATA.tensors
    return x[kept], y[kept]


def _loader() -> DataLoader:
    return DataLoader(_Indices(), batch_size=4, collate_fn=_drop_4_to_7)


def _run_all_loops(strategy: Any, devices: int, model: Regressor) -> dict[str, Any]:
    trainer = quiet_trainer(strategy, devices, max_epochs=1)
    trainer.fit(model, _loader(), _loader())
    results: dict[str, Any] = {"params": copy.deepcopy(model.state_dict())}
    results["fit"] = {k: v.item() for k, v in trainer.callback_metrics.items()}
    results["validate"] = trainer.validate(model, _loader(), verbose=False)[0]
    results["test"] = trainer.test(model, _loader(), verbose=False)[0]
    results["predict"] = trainer.predict(model, _loader())
    return results


def _same_number(a: float, b: float) -> bool:
    return (math.isnan(a) and math.isnan(b)) or a == pytest.approx(b, rel=1e-6)


@pytest.mark.parametrize(
    ("options", "devices"),
    [
        ({}, 2),
        ({"gpu0_bsz": 1}, 3),
        ({"chunk_sizes": [2, 2]}, 2),
        ({"weights": [1, 3]}, 2),
        ({"chunk_sizes": [1, 3], "sync_batchnorm": True}, 2),  # BatchNorm, exact: sees the empty batch as one device
    ],
)
def test_an_empty_batch_runs_as_on_one_device_in_all_four_loops(options: dict[str, Any], devices: int) -> None:
    model = Regressor(batchnorm=options.get("sync_batchnorm", False))
    expected = _run_all_loops("auto", 1, copy.deepcopy(model))
    got = _run_all_loops(BalancedDataParallelStrategy(**options), devices, model)
    for name, value in got["params"].items():
        torch.testing.assert_close(value, expected["params"][name], **EXACT, msg=name)
    for loop in ("fit", "validate", "test"):
        assert got[loop].keys() == expected[loop].keys()
        assert all(_same_number(got[loop][k], expected[loop][k]) for k in expected[loop]), (loop, got[loop])
    assert [p.shape for p in got["predict"]] == [(4, 3), (0, 3), (4, 3)]
    for g, e in zip(got["predict"], expected["predict"], strict=True):
        torch.testing.assert_close(g, e, **EXACT)
