"""strategy="pipeline" with a model built on the meta device (in ``configure_model``): each rank gives memory to its
own stages only, trains them exactly, and saves them sharded, on real gloo CPU ranks.

The reference builds the same model on the meta device in one process and materializes every layer with the same
seeded function (``materialize_layers``), then trains as Lightning's loop does. float64: 1e-12 on the weights after
three SGD steps is wide against the ~1e-16 of summing micro-batch gradients in another order.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler

from lightning_balanced import PipelineStrategy
from lightning_balanced.pipelining.materialize import materialize, materialize_layers
from lightning_balanced.pipelining.sharded_checkpoint import consolidate_checkpoint
from tests.distributed import lightning_sampler_seed, run_distributed
from tests.helpers import quiet_trainer, raises_exactly
from tests.strategies.test_pipeline_strategy import LR, _data

EXACT = {"rtol": 0, "atol": 1e-12}
WIDTH = 64  # 4 Linear(64, 64) float64 layers of 33 kB each: a stage's bytes are visible against the others'


class _OnMeta(pl.LightningModule):
    """Its ``nn.Sequential`` and a head outside it are built on the meta device, in ``configure_model``."""

    def __init__(self) -> None:
        super().__init__()
        self.sequential_module: nn.Sequential | None = None
        self.head: nn.Linear | None = None

    def configure_model(self) -> None:
        if self.sequential_module is not None:
            return
        with torch.device("meta"):
            layers: list[nn.Module] = [nn.Linear(5, WIDTH, dtype=torch.float64), nn.Tanh()]
            for _ in range(3):
                layers += [nn.Linear(WIDTH, WIDTH, dtype=torch.float64), nn.Tanh()]
            self.sequential_module = nn.Sequential(*layers)
            self.head = nn.Linear(WIDTH, 3, dtype=torch.float64)

    def compute_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        assert self.head is not None
        return F.mse_loss(self.head(output), target)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        assert self.sequential_module is not None
        return self.compute_loss(self.sequential_module(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def _materialized() -> _OnMeta:
    """The model as one process builds it: every layer materialized as the ranks materialize theirs."""
    model = _OnMeta()
    model.configure_model()
    assert model.sequential_module is not None
    # the ranks' seed: seed_everything's (PL_GLOBAL_SEED, which they inherit from this process), else 0
    seed = lightning_sampler_seed()
    materialize_layers(model.sequential_module, range(len(model.sequential_module)), "cpu", seed=seed)
    sequential = model._modules.pop("sequential_module")
    materialize(model, "cpu", seed - 1, "the rest")
    model._modules["sequential_module"] = sequential
    return model


def _fit_rank(rank: int, world_size: int, directory: str) -> dict[str, Any]:
    model = _OnMeta()
    trainer = quiet_trainer(PipelineStrategy(schedule="GPipe", chunks=2), world_size, max_steps=3)
    trainer.fit(model, DataLoader(_data(24), batch_size=8))
    held = {name: tensor.detach().clone() for name, tensor in model.state_dict().items() if not tensor.is_meta}
    trainer.save_checkpoint(Path(directory) / "meta.ckpt")
    return {"held": held, "meta": sorted(name for name, t in model.state_dict().items() if t.is_meta)}


def _reference() -> dict[str, torch.Tensor]:
    model = _materialized()
    optimizer = model.configure_optimizers()
    data = _data(24)
    x, y = data[:]
    # Lightning shuffles a training DataLoader's DistributedSampler (one replica here), seeded
    order = list(DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=lightning_sampler_seed()))
    for start in range(0, 24, 8):
        batch = order[start : start + 8]
        loss = model.training_step((x[batch], y[batch]), 0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}


@pytest.mark.slow
def test_each_rank_materializes_its_own_stages_trains_them_exactly_and_saves_them_sharded(tmp_path: Path) -> None:
    ranks = run_distributed(_fit_rank, 2, str(tmp_path), timeout_s=300)
    expected = _reference()
    # 8 layers in 2 stages of 4: rank 0 holds layers 0..3, rank 1 layers 4..7; both hold the head
    assert ranks[0]["meta"] == [
        "sequential_module.4.bias",
        "sequential_module.4.weight",
        "sequential_module.6.bias",
        "sequential_module.6.weight",
    ]
    assert ranks[1]["meta"] == [
        "sequential_module.0.bias",
        "sequential_module.0.weight",
        "sequential_module.2.bias",
        "sequential_module.2.weight",
    ]
    for rank in ranks:
        for name, value in rank["held"].items():
            torch.testing.assert_close(value, expected[name], **EXACT, msg=lambda m, name=name: f"{name}: {m}")
    consolidate_checkpoint(tmp_path / "meta.ckpt", tmp_path / "whole.ckpt")
    whole = torch.load(tmp_path / "whole.ckpt", weights_only=False)["state_dict"]
    assert sorted(whole) == sorted(expected)
    for name, value in whole.items():
        torch.testing.assert_close(value, expected[name], **EXACT, msg=lambda m, name=name: f"{name}: {m}")


class _NoReset(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(5, dtype=torch.float64))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def test_a_meta_layer_without_reset_parameters_is_named() -> None:
    with torch.device("meta"):
        layers = nn.Sequential(nn.Linear(5, 5), _NoReset())
    with raises_exactly(
        ValueError,
        "layer 1 was built on the meta device, but _NoReset has no `reset_parameters()` to initialize its parameters"
        " or buffers after they get memory: define one, or build that module on a real device",
    ):
        materialize_layers(layers, [0, 1], "cpu")
    assert not layers[0].weight.is_meta  # the layers before it were materialized
