"""Choosing the balance: even by layer count, from parameter counts, or from measured costs with a fallback."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from torch import nn

import lightning_balanced.pipeline.balance as balance_module
from lightning_balanced.pipeline.balance import (
    BALANCE_CHOICES,
    balance_by_parameters,
    choose_balance,
    even_balance,
    layer_times,
)

CPU = torch.device("cpu")


def _layers() -> list[nn.Module]:
    # 96+1+1 | 272 | 1+51 parameters (+1 per layer): [3, 1, 2] by parameters over 3 partitions.
    return list(nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3)))


def test_balance_by_parameters_is_deterministic() -> None:
    model = nn.Sequential(nn.Linear(100, 100), nn.ReLU(), nn.Linear(100, 10), nn.ReLU(), nn.Linear(10, 10))
    assert balance_by_parameters(list(model), 2) == [1, 4]
    assert balance_by_parameters(list(model), 3) == [1, 2, 2]  # ties broken toward the more even split


def test_layer_times_leave_no_trace() -> None:
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Dropout(0.5), nn.Linear(4, 1))
    model[0].weight.grad = torch.ones(4, 4)
    before = copy.deepcopy(model.state_dict())
    sample = torch.randn(8, 4)
    torch.manual_seed(3)
    times = layer_times(list(model), sample, torch.device("cpu"), repeats=2)
    after_rng = torch.rand(1)
    torch.manual_seed(3)
    assert torch.equal(after_rng, torch.rand(1))  # the global generator did not move
    assert len(times) == 4 and all(t > 0 for t in times)
    for key, value in model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert torch.equal(model[0].weight.grad, torch.ones(4, 4)) and model[3].weight.grad is None


@pytest.mark.parametrize(
    ("num_layers", "partitions", "expected"),
    [(6, 3, [2, 2, 2]), (7, 3, [3, 2, 2]), (8, 3, [3, 3, 2]), (3, 3, [1, 1, 1]), (5, 1, [5])],
)
def test_even_balance_puts_the_larger_partitions_first(num_layers: int, partitions: int, expected: list[int]) -> None:
    assert even_balance(num_layers, partitions) == expected


def test_even_balance_refuses_more_partitions_than_layers() -> None:
    with pytest.raises(ValueError, match=r"one partition on each of the 7 devices, but the nn.Sequential has only 6"):
        even_balance(6, 7)


def test_choose_balance_by_parameters_and_by_time() -> None:
    layers, sample = _layers(), torch.randn(8, 5)
    assert choose_balance(layers, sample, 3, CPU, "parameters") == ([3, 1, 2], "parameters")
    balance, method = choose_balance(layers, sample, 3, CPU, "auto")  # time on CPU
    assert method == "time" and sum(balance) == 6 and len(balance) == 3
    assert set(BALANCE_CHOICES) == {"auto", "time", "memory", "parameters"}


def _fail(*args: Any, **kwargs: Any) -> list[float]:
    raise RuntimeError("out of memory while profiling")


def test_auto_falls_back_to_parameter_counts_but_a_named_cost_raises(monkeypatch: pytest.MonkeyPatch) -> None:
    layers, sample = _layers(), torch.randn(8, 5)
    monkeypatch.setattr(balance_module, "layer_times", _fail)
    assert choose_balance(layers, sample, 3, CPU, "auto") == (
        [3, 1, 2],
        "parameters (measuring time failed: out of memory while profiling)",
    )
    with pytest.raises(RuntimeError, match="out of memory while profiling"):
        choose_balance(layers, sample, 3, CPU, "time")
    monkeypatch.setattr(balance_module, "layer_times", lambda *args, **kwargs: [0.0] * 6)
    _, method = choose_balance(layers, sample, 3, CPU, "auto")
    assert method == "parameters (measuring time failed: every layer measured 0)"


def test_memory_is_measured_on_cuda_only() -> None:
    with pytest.raises(ValueError, match="measured on CUDA devices only"):
        choose_balance(_layers(), torch.randn(8, 5), 3, CPU, "memory")
