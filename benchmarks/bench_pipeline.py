"""strategy="pipeline": each torch schedule's step time, measured bubble and stage-0 activation memory, against GPipe.

``p`` CPU processes joined by gloo (one pipeline stage each, or ``v = 2`` for the looped and V-shaped schedules) train
the same MLP of ``2p`` layers that stand in for GPU kernels: each rank's forward per micro-batch sleeps ``--forward-ms``
(split over its layers), its backward twice as long,
split evenly between the gradient of its input and that of its weight (as a matmul's is), so the zero-bubble
schedules have a weight pass to move into the bubble, and the processes do not compete for the machine's cores. For
each schedule the installed torch runs, in turns over ``--rounds`` rounds:

* ``step``: the median wall time of a training step (the first step of each fit is warm-up, not counted);
* ``bubble``: the median of the strategy's own telemetry, ``pipeline/bubble`` (the mean idle fraction over the ranks),
  beside the schedule's formula ``(p - 1) / (v * m + p - 1)`` (none for the zero-bubble schedules);
* ``stage0_saved``: the peak bytes stage 0's rank held for backward within a step
  (:class:`~lightning_balanced.pipeline.saved_bytes.SavedTensorBytes`, parameters and the batch left out).

Ratios are against GPipe (the anchor: every micro-batch's forward, then every backward) measured in the same run. CPU
only: a GPU form needs one GPU per process (NCCL), more than the one-GPU machines this project is lent.

Usage: ``python benchmarks/bench_pipeline.py [--ranks 4] [--chunks 16] [--forward-ms 5] [--steps 6] [--rounds 2]``
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
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_balanced import PipelineStrategy
from lightning_balanced.pipeline.saved_bytes import SavedTensorBytes
from lightning_balanced.pipeline.stage_plan import SCHEDULES

WIDTH = 64
LAYERS_PER_RANK = 2


class _Sleep(torch.autograd.Function):
    """Identity whose forward takes ``forward_s`` and backward ``backward_s`` (a stand-in for a kernel's time)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


class TimedLinear(nn.Module):
    """``x @ W`` whose forward takes ``forward_s``, its input gradient ``forward_s`` and its weight gradient too."""

    def __init__(self, forward_s: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.eye(WIDTH) + 0.01 * torch.randn(WIDTH, WIDTH))
        self.forward_s = forward_s

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = _Sleep.apply(x, self.forward_s / 2, self.forward_s)
        weight = _Sleep.apply(self.weight, self.forward_s / 2, self.forward_s)
        return torch.tanh(x @ weight)


class Model(pl.LightningModule):
    def __init__(self, layers: int, forward_s: float) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.sequential_module = nn.Sequential(*[TimedLinear(forward_s) for _ in range(layers)])

    def compute_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.compute_loss(self.sequential_module(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=1e-3)


class Probe(pl.Callback):
    """Per step: wall time, the logged bubble, and the peak of the activations saved for backward on this rank."""

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self._meter: SavedTensorBytes | None = None
        self._started = 0.0

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, *args: Any) -> None:
        self._meter = SavedTensorBytes(exclude=[*module.parameters(), *batch]).__enter__()
        self._started = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        elapsed = time.perf_counter() - self._started
        assert self._meter is not None
        self._meter.__exit__(None, None, None)
        bubble = trainer.callback_metrics.get("pipeline/bubble")
        self.steps.append(
            {"step": elapsed, "bubble": float("nan") if bubble is None else float(bubble), "saved": self._meter.peak}
        )


def _schedules() -> list[str]:
    return [name for name, spec in SCHEDULES.items() if spec.available()]


def _stages_per_rank(name: str) -> int:
    return 1 if SCHEDULES[name].placement == "single" else 2


def _rank(rank: int, world_size: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=300))
    batch_size = 4 * args.chunks
    data = TensorDataset(torch.randn(batch_size * args.steps, WIDTH), torch.randn(batch_size * args.steps, WIDTH))
    results: dict[str, list[dict[str, float]]] = {name: [] for name in args.schedules}
    for round_index in range(args.rounds):
        order = args.schedules if round_index % 2 == 0 else list(reversed(args.schedules))
        for name in order:
            probe = Probe()
            trainer = pl.Trainer(
                accelerator="cpu",
                devices=world_size,
                strategy=PipelineStrategy(schedule=name, chunks=args.chunks),
                max_steps=args.steps,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                callbacks=[probe],
            )
            # The same model for every schedule: 2 layers per rank, one per stage where a rank holds two stages.
            model = Model(world_size * LAYERS_PER_RANK, args.forward_ms / 1e3 / LAYERS_PER_RANK)
            trainer.fit(model, DataLoader(data, batch_size=batch_size))
            results[name].extend(probe.steps[1:])
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=4, help="processes, one pipeline of p ranks")
    parser.add_argument("--chunks", type=int, default=16, help="micro-batches per batch, m")
    parser.add_argument("--forward-ms", type=float, default=5.0, help="each rank's forward per micro-batch")
    parser.add_argument("--steps", type=int, default=6, help="training steps per fit")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of all schedules, in turns")
    args = parser.parse_args()
    args.schedules = _schedules()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").Queue()
    mp.start_processes(_rank, args=(args.ranks, port, args, queue), nprocs=args.ranks, start_method="spawn")
    results = queue.get()
    p, m = args.ranks, args.chunks
    medians = {
        name: {key: statistics.median(step[key] for step in steps) for key in ("step", "bubble", "saved")}
        for name, steps in results.items()
    }
    anchor = medians["GPipe"]
    print(f"p={p} ranks, m={m} micro-batches, forward {args.forward_ms} ms per rank, CPU, torch {torch.__version__}")
    header = ("schedule", "v", "step ms", "/GPipe", "bubble", "formula", "stage0 KiB", "/GPipe")
    print(" ".join(f"{title:>{width}}" for title, width in zip(header, (22, 2, 8, 7, 7, 8, 11, 7), strict=True)))
    for name, values in medians.items():
        v = _stages_per_rank(name)
        theory = SCHEDULES[name].theoretical_bubble(p, m, v)
        print(
            f"{name:>22} {v:>2} {1e3 * values['step']:8.1f} {values['step'] / anchor['step']:7.3f}"
            f" {values['bubble']:7.3f} {'-' if theory is None else f'{theory:.3f}':>8}"
            f" {values['saved'] / 1024:11.1f} {values['saved'] / anchor['saved']:7.3f}"
        )
    if "1F1B" in medians:
        one = medians["1F1B"]
        step_ratio, saved_ratio = one["step"] / anchor["step"], one["saved"] / anchor["saved"]
        print(f"1f1b_step_ratio={step_ratio:.3f} 1f1b_stage0_saved_ratio={saved_ratio:.3f} (p/m={p / m:.3f})")


if __name__ == "__main__":
    main()
