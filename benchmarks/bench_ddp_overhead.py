"""Per-step cost of LRScaledDDPStrategy against Lightning's DDPStrategy, and of SyncBatchNorm against plain BatchNorm.

Two CPU processes joined by gloo run the same model on the same data under each configuration, interleaved over
several rounds in one run; the per-step wall time is the median over all measured steps (the first steps of every fit
are warm-up and not counted). Printed ratios are ours / anchor:

* ``lr_scaled_ddp / ddp``: both with plain BatchNorm; scaling happens at fit start, so a step should cost the same
  (target <= 1.02);
* ``ddp_again / ddp``: an A/A control, DDPStrategy against itself, which shows this run's noise floor;
* ``sync_bn / plain_bn``: LRScaledDDPStrategy with its default SyncBatchNorm against DDPStrategy with BatchNorm.

Usage: ``python benchmarks/bench_ddp_overhead.py [--steps 150] [--rounds 4]``
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import time
from datetime import timedelta
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_balanced import LRScaledDDPStrategy

WARMUP_STEPS = 10


class Model(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.Conv2d(32, 32, 3, padding=1),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, 10),
        )

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)
        return [optimizer], [torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=1000)]


class StepTimer(pl.Callback):
    def __init__(self) -> None:
        self.times: list[float] = []
        self._start = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._start)


def timed_trainer(timer: StepTimer, **kwargs: Any) -> pl.Trainer:
    """A ``Trainer`` that times each step with ``timer``, without logger, checkpoints, progress bar or summary."""
    return pl.Trainer(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
        **kwargs,
    )


def _strategy(name: str) -> Any:
    if name in ("ddp", "ddp_again"):
        return DDPStrategy()
    if name == "lr_scaled_ddp":
        return LRScaledDDPStrategy(sync_batchnorm=False)
    return LRScaledDDPStrategy()  # sync_bn: the default, SyncBatchNorm on


def _rank(rank: int, world_size: int, port: int, steps: int, rounds: int, queue: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    g = torch.Generator().manual_seed(rank)
    data = TensorDataset(
        torch.randn(steps * 16, 3, 16, 16, generator=g), torch.randint(0, 10, (steps * 16,), generator=g)
    )
    times: dict[str, list[float]] = {"ddp": [], "lr_scaled_ddp": [], "ddp_again": [], "sync_bn": []}
    for round_index in range(rounds):
        order = list(times) if round_index % 2 == 0 else list(reversed(times))  # no configuration always goes first
        for name in order:
            timer = StepTimer()
            trainer = timed_trainer(
                timer, accelerator="cpu", devices=world_size, strategy=_strategy(name), max_steps=steps
            )
            trainer.fit(Model(), DataLoader(data, batch_size=16))
            times[name].extend(timer.times[WARMUP_STEPS:])
    if rank == 0:
        queue.put({name: statistics.median(values) for name, values in times.items()})
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help="optimizer steps per fit")
    parser.add_argument("--rounds", type=int, default=6, help="interleaved rounds of the configurations")
    args = parser.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    context = mp.get_context("spawn")
    queue = context.Queue()
    mp.start_processes(_rank, args=(2, port, args.steps, args.rounds, queue), nprocs=2, start_method="spawn")
    medians = queue.get()
    for name, value in medians.items():
        print(f"{name:>14}: {1e3 * value:8.3f} ms/step (median, 2 gloo CPU processes)")
    print(f"lr_scaled_ddp / ddp = {medians['lr_scaled_ddp'] / medians['ddp']:.3f}  (target <= 1.02)")
    print(f"ddp_again / ddp = {medians['ddp_again'] / medians['ddp']:.3f}  (A/A control: the noise floor of this run)")
    print(f"sync_bn / plain_bn = {medians['sync_bn'] / medians['ddp']:.3f}")
    print(f"ratio={medians['lr_scaled_ddp'] / medians['ddp']:.3f}")


if __name__ == "__main__":
    main()
