"""strategy="pipeline" with ``balance`` chosen by name (the costs ``gpipe`` uses), on real gloo CPU ranks: every rank
cuts the same stages, and the cut follows the cost."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader

from lightning_balanced import PipelineStrategy
from tests.distributed import run_distributed
from tests.helpers import quiet_trainer, raises_exactly
from tests.strategies.test_pipeline_strategy import PipelinedRegressor, _data


class _Slow(nn.Module):
    """A layer whose forward takes 20 ms: its measured time dwarfs the others'."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.02)
        return x


def _model(kind: str) -> PipelinedRegressor:
    model = PipelinedRegressor()
    if kind == "parameters":  # 1,200 | 0 | 40,200 | 0 | 603 parameters: the cut that evens them is [2, 3]
        layers = [nn.Linear(5, 200), nn.Tanh(), nn.Linear(200, 200), nn.Tanh(), nn.Linear(200, 3)]
    else:  # by time [1, 2] (the slow layer alone); by count, [2, 1]
        layers = [_Slow(), nn.Linear(5, 5), nn.Linear(5, 3)]
        if kind == "time":
            model.example_input_array = torch.zeros(4, 5, dtype=torch.float64)
    model.sequential_module = nn.Sequential(*layers).double()
    return model


def _balance_rank(rank: int, world_size: int, runs: list[tuple[str, str]]) -> list[Any]:
    results = []
    for kind, balance in runs:
        strategy = PipelineStrategy(schedule="GPipe", chunks=2, balance=balance)  # type: ignore[arg-type]
        trainer = quiet_trainer(strategy, world_size, max_steps=1)
        try:
            trainer.fit(_model(kind), DataLoader(_data(8), batch_size=4))
        except ValueError as error:
            results.append(str(error))
            continue
        results.append((strategy._balance, strategy._balance_method))
    return results


@pytest.mark.slow
def test_a_balance_by_name_is_the_same_on_every_rank_and_follows_its_cost() -> None:
    runs = [("parameters", "parameters"), ("time", "time"), ("time", "auto"), ("count", "auto"), ("count", "time")]
    for result in run_distributed(_balance_rank, 2, runs, timeout_s=300):
        assert result[0] == ([2, 3], "parameters")
        assert result[1] == ([1, 2], "time")
        assert result[2] == ([1, 2], "time")  # auto on the CPU: time
        assert result[3][1] == "parameters (no example_input_array)"
        assert result[4] == (
            "`balance`='time' measures each layer on a micro-batch: set `example_input_array` on PipelinedRegressor (an"
            " input batch of the first stage), or use `balance='parameters'` or a list"
        )


def test_an_unknown_balance_is_named() -> None:
    with raises_exactly(
        ValueError, "`balance` must be a list of ints, None or one of ['auto', 'time', 'memory', 'parameters'], got 'x'"
    ):
        PipelineStrategy(balance="x")  # type: ignore[arg-type]
