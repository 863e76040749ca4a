"""strategy="pipeline" with two tensors between stages and a batch that is not ``(input, target)``, on real gloo CPU
ranks, against the unpipelined ``nn.Sequential`` (which passes a layer's tuple to the next layer as one value).

float64, three SGD steps: 1e-12 is wide against the ~1e-16 of summing micro-batch gradients in another order; a lost
second tensor or a wrong split of the batch is off by far more.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.torch_version import TorchVersion
from torch.utils.data import DataLoader, Dataset, DistributedSampler

from lightning_balanced import PipelineStrategy
from lightning_balanced.pipelining.batches import input_and_target
from lightning_balanced.pipelining.stage_plan import SCHEDULES, SEVERAL_TENSORS_FROM
from tests.distributed import lightning_sampler_seed, run_distributed
from tests.helpers import quiet_trainer, raises_exactly

EXACT = {"rtol": 0, "atol": 1e-12}
SAMPLES = 16
LR = 0.1


class _Split(nn.Module):
    """``(x, z) -> (linear(x), z)``: the pipeline's input is two tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(5, 8)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        x, z = inputs
        return self.linear(x), z


class _Branch(nn.Module):
    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, z = inputs
        return torch.tanh(h), 2 * z


class _Merge(nn.Module):
    """``(h, z) -> h + linear(z)``: takes the two tensors the previous stage sent."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 8)

    def forward(self, inputs: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        h, z = inputs
        return h + self.linear(z)


class _Samples(Dataset[dict[str, torch.Tensor]]):
    def __init__(self) -> None:
        g = torch.Generator().manual_seed(1)
        self.x = torch.randn(SAMPLES, 5, generator=g, dtype=torch.float64)
        self.z = torch.randn(SAMPLES, 2, generator=g, dtype=torch.float64)
        self.y = torch.randn(SAMPLES, 3, generator=g, dtype=torch.float64)

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {"x": self.x[index], "z": self.z[index], "y": self.y[index]}


class _TwoTensors(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.sequential_module = nn.Sequential(_Split(), _Branch(), _Merge(), nn.Linear(8, 3)).double()
        self.val_outputs: list[torch.Tensor] = []

    def pipeline_batch(self, batch: dict[str, torch.Tensor]) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        return (batch["x"], batch["z"]), batch["y"]

    def compute_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        inputs, target = self.pipeline_batch(batch)
        return self.compute_loss(self.sequential_module(inputs), target)

    def validation_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> None:
        inputs, _ = self.pipeline_batch(batch)
        self.val_outputs.append(self.sequential_module(inputs).detach().clone())

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def _fit_rank(rank: int, world_size: int, schedules: list[str]) -> dict[str, Any]:
    results = {}
    for schedule in schedules:
        model = _TwoTensors()
        trainer = quiet_trainer(PipelineStrategy(schedule=schedule, chunks=2, balance=[2, 2]), world_size, max_steps=3)
        trainer.fit(model, DataLoader(_Samples(), batch_size=4))
        trainer.validate(model, DataLoader(_Samples(), batch_size=8), verbose=False)
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        results[schedule] = {"state": state, "val": torch.cat(model.val_outputs)}
    return results


def _reference() -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    model = _TwoTensors()
    optimizer = model.configure_optimizers()
    data = _Samples()
    order = list(DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=lightning_sampler_seed()))
    for start in range(0, 12, 4):
        batch = order[start : start + 4]
        loss = model.training_step({"x": data.x[batch], "z": data.z[batch], "y": data.y[batch]}, 0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    with torch.no_grad():
        val = model.sequential_module((data.x, data.z))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, val


@pytest.mark.skipif(
    TorchVersion(torch.__version__) < SEVERAL_TENSORS_FROM,
    reason=f"several tensors between stages train from torch {SEVERAL_TENSORS_FROM} (older ones hang: refused)",
)
@pytest.mark.slow
def test_two_tensors_cross_the_stage_boundary_and_a_dict_batch_splits_through_the_hook() -> None:
    schedules = ["GPipe"] + (["1F1B"] if SCHEDULES["1F1B"].available() else [])
    ranks = run_distributed(_fit_rank, 2, schedules, timeout_s=300)
    state, val = _reference()
    for rank in ranks:
        for schedule, result in rank.items():
            for name, value in state.items():
                torch.testing.assert_close(result["state"][name], value, **EXACT, msg=f"{schedule} {name}")
            torch.testing.assert_close(result["val"], val, **EXACT, msg=f"{schedule} validation outputs")


def test_a_batch_the_strategy_cannot_split_names_the_hook() -> None:
    with raises_exactly(
        TypeError,
        "strategy='pipeline' takes batches of `(input, target)` tensors: the first stage reads `input`, the last"
        " stage's `compute_loss` gets `target`; got dict. For other batches define"
        " `pipeline_batch(self, batch) -> (input, target)` on the LightningModule",
    ):
        input_and_target(pl.LightningModule(), {"x": torch.zeros(1)})


def _refused_rank(rank: int, world_size: int) -> str:
    trainer = quiet_trainer(PipelineStrategy(schedule="GPipe", chunks=2, balance=[2, 2]), world_size, max_steps=1)
    try:
        trainer.fit(_TwoTensors(), DataLoader(_Samples(), batch_size=4))
    except ValueError as error:
        return str(error)
    return "trained"


@pytest.mark.skipif(
    TorchVersion(torch.__version__) >= SEVERAL_TENSORS_FROM, reason="torch trains several tensors between stages"
)
@pytest.mark.slow
def test_an_older_torch_refuses_several_tensors_between_stages_on_both_ranks_of_the_boundary() -> None:
    expected = (
        f"strategy='pipeline' trains stages that pass several tensors (a tuple) to the next from torch"
        f" {SEVERAL_TENSORS_FROM} (torch {torch.__version__} hangs in the schedule's exchange); stage 0 passes a tuple:"
        " upgrade torch, or pass one tensor (evaluation takes tuples on any torch)"
    )
    assert run_distributed(_refused_rank, 2, timeout_s=120) == [expected, expected]
