"""A job whose rank 1 raises in its second step: run by tests/strategies/test_peer_failure.py as a user would run it,
``python failing_job.py <strategy> [gather]``, with Lightning's script launcher starting rank 1. With ``gather``, rank 1
raises in its second validation step instead, while rank 0 waits for it in ``gather_eval_outputs``."""

from __future__ import annotations

import sys
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_balanced import DistributedEvalMixin  # (importing registers the strategies)


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.sequential_module = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))

    def compute_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        if self.global_rank == 1 and self.global_step == 1:
            raise ValueError("a mistake on rank 1")
        return F.mse_loss(output, target)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.compute_loss(self.sequential_module(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class ShardedModel(Model):
    """For strategy="balanced_fsdp": sharded with FSDP2, as under ModelParallelStrategy."""

    def configure_model(self) -> None:
        from torch.distributed.fsdp import fully_shard

        fully_shard(self.sequential_module, mesh=self.device_mesh["data_parallel"])


class GatheringModel(DistributedEvalMixin, Model):
    def compute_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        if self.global_rank == 1 and batch_idx == 1:
            raise ValueError("a mistake on rank 1")
        self.add_eval_outputs(prediction=self.sequential_module(batch[0]))

    def on_validation_epoch_end(self) -> None:
        self.gather_eval_outputs(timeout_s=120)


if __name__ == "__main__":
    data = TensorDataset(torch.randn(64, 4), torch.randn(64, 2))
    gather = sys.argv[2:] == ["gather"]
    trainer = pl.Trainer(
        strategy=sys.argv[1],
        accelerator="cpu",
        devices=2,
        max_steps=4,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    if gather:
        trainer.validate(GatheringModel(), DataLoader(data, batch_size=8))
    else:
        trainer.fit(ShardedModel() if sys.argv[1] == "balanced_fsdp" else Model(), DataLoader(data, batch_size=8))
