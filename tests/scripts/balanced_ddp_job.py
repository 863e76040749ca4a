"""A balanced_ddp fit on 2 CPU processes, launched as users launch one; the main process checks it against one process.

Run as ``python balanced_ddp_job.py STRATEGY OUT.json``: ``balanced_ddp`` (Lightning's subprocess launcher starts rank 1
with this script again; rank 0 is this process) or ``balanced_ddp_spawn`` (Lightning spawns both ranks; this process
gets the trained weights and the callbacks' state back, as ``"ddp_spawn"`` users rely on). Afterwards this process
trains one process on the same global batches and writes how far the trained weights and the checkpoint callback's
best checkpoint are from it.
"""

import json
import os
import sys
import threading

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

import lightning_balanced  # noqa: F401  (registers "balanced_ddp")


class Job(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 3)).double()

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def loader():
    g = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(24, 5, generator=g, dtype=torch.float64), torch.randn(24, 3, generator=g).double())
    return DataLoader(data, batch_size=8, sampler=DistributedSampler(data, num_replicas=1, rank=0, seed=0))


def trainer(strategy, devices, root, callbacks=()):
    return pl.Trainer(
        accelerator="cpu",
        devices=devices,
        strategy=strategy,
        max_epochs=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=bool(callbacks),
        callbacks=list(callbacks),
        default_root_dir=root,
    )


def max_difference(a, b):
    return max((a[k].double() - b[k].double()).abs().max().item() for k in b)


if __name__ == "__main__":
    strategy, out = sys.argv[1], sys.argv[2]
    root = os.path.dirname(os.path.abspath(out))
    model = Job()
    checkpoints = ModelCheckpoint(dirpath=os.path.join(root, "checkpoints"))
    fit = trainer(strategy, 2, root, [checkpoints, EarlyStopping("train_loss", patience=100)])
    fit.fit(model, loader())
    if fit.global_rank == 0:
        reference = Job()
        trainer("auto", 1, root).fit(reference, loader())
        best = Job.load_from_checkpoint(checkpoints.best_model_path)
        result = {
            "world_size": fit.world_size,
            # the main process of a spawned fit gets the weights back, not the loops' progress: read the checkpoint's
            "checkpoint_global_step": torch.load(checkpoints.best_model_path, weights_only=False)["global_step"],
            "trained_vs_one_process": max_difference(model.state_dict(), reference.state_dict()),
            "best_checkpoint_vs_one_process": max_difference(best.state_dict(), reference.state_dict()),
        }
        with open(out, "w") as file:
            json.dump(result, file)
    # As tests/scripts/lr_scaled_job.py: end gloo's process group while the interpreter is whole, with a watchdog for
    # torch 2.4's hang in destroy_process_group.
    if torch.distributed.is_initialized():
        watchdog = threading.Timer(20.0, os._exit, args=(0,))
        watchdog.daemon = True
        watchdog.start()
        torch.distributed.destroy_process_group()
