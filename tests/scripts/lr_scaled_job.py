"""One LRScaledDDPStrategy step on 2 CPU processes; rank 0 writes the world size and the learning rate it used.

Run as ``python lr_scaled_job.py OUT.json`` (Lightning's subprocess launcher starts rank 1) or under
``torchrun --standalone --nproc_per_node=2 lr_scaled_job.py OUT.json`` (TorchElastic environment).
"""

import json
import os
import sys
import threading

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning_balanced  # noqa: F401  (registers "ddp_lr_linear")


class Job(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Linear(6, 2))
        self.lr_used = 0.0

    def training_step(self, batch, batch_idx):
        self.lr_used = self.trainer.optimizers[0].param_groups[0]["lr"]
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


if __name__ == "__main__":
    data = TensorDataset(torch.randn(8, 4), torch.randn(8, 2))
    trainer = pl.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="ddp_lr_linear",
        max_steps=1,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )
    model = Job()
    trainer.fit(model, DataLoader(data, batch_size=4))
    if trainer.global_rank == 0:
        with open(sys.argv[1], "w") as file:
            json.dump({"world_size": trainer.world_size, "lr": model.lr_used}, file)
    # torch 2.13's gloo process group, left for interpreter exit, sometimes aborts the process there ("terminate
    # called without an active exception"), plain DDPStrategy included; end it while the interpreter is whole. torch
    # 2.4's gloo can hang in destroy_process_group when the ranks tear down together (once in CI's floor leg: the
    # test then waited 240 s for this process and its child): the result is written, so exit if it has not returned.
    watchdog = threading.Timer(20.0, os._exit, args=(0,))
    watchdog.daemon = True
    watchdog.start()
    torch.distributed.destroy_process_group()
    watchdog.cancel()
