"""strategy="pipeline": each torch schedule's step time, measured bubble and stage-0 activation memory, against GPipe.

``p`` CPU processes joined by gloo (one pipeline stage each, or ``v = 2`` for the looped and V-shaped schedules) train
the same MLP of ``2p`` layers that stand in for GPU kernels: each rank's forward per micro-batch sleeps ``--forward-ms``
(split over its layers), its backward twice as long,
split evenly between the gradient of its input and that of its weight (as a matmul's is), so the zero-bubble
schedules have a weight pass to move into the bubble. For each schedule the installed torch runs, in turns over
``--rounds`` rounds (``--part schedules``):

* ``step``: the median wall time of a training step (the first step of each fit is warm-up, not counted);
* ``bubble``: the median of the strategy's own telemetry, ``pipeline/bubble`` (the mean idle fraction over the ranks),
  beside the schedule's formula ``(p - 1) / (v * m + p - 1)`` (none for the zero-bubble schedules);
* ``stage0_saved``: the peak bytes stage 0's rank held for backward within a step
  (:class:`~lightning_balanced.pipelining.saved_bytes.SavedTensorBytes`, parameters and the batch left out).

Ratios are against GPipe (the anchor: every micro-batch's forward, then every backward) measured in the same run.

The validation part (``--part validation``) measures evaluation throughput: ``trainer.validate`` over
``--val-batches`` batches of ``4 m`` samples with ``PipelineStrategy(chunks=m)``, whose forward runs GPipe's forward in
``m`` micro-batches across the ranks, against ``PipelineStrategy(chunks=1)``, which runs the whole batch stage after
stage (the anchor: one rank works at a time), in turns over ``--rounds`` rounds. Here each layer's forward sleeps a
fixed time *per sample* (``--forward-ms`` per micro-batch of 4 samples, a rank's ``t = m * forward-ms`` per batch),
as a GPU-bound stage does whose kernels' time grows with the batch: splitting a batch then splits its time, and with
``p`` stages of time ``t`` a batch takes ``p t`` whole and ``(m + p - 1) t / m`` in micro-batches, an ideal speedup of
``p m / (m + p - 1)``. (A stage whose time is fixed per call, a launch-bound one, would lose: ``m + p - 1`` calls'
time against ``p``.) It prints each form's median batch time on rank 0 (the first batch of each ``validate`` is
warm-up, not counted; the broadcast of the last stage's output ends a batch on every rank) beside the formula's,
samples/s, and the ratio against the whole-batch forward. The formula leaves out the exchange between stages, which
the micro-batched forward pays once per micro-batch and hop, the whole batch once per hop.

The processes sleep instead of computing, so they hardly compete for the machine's cores (the micro-batched forward's
exchanges take up to a fifth of a core per rank); one torch thread each. CPU only: a GPU form needs one GPU per process
(NCCL), more than the one-GPU machines this project is lent. The summary line ends ``1f1b_step_ratio=``,
``1f1b_stage0_saved_ratio=`` (schedules part) and ``validation_speedup=`` (validation part). ``--part memory`` runs
``bench_pipeline_memory.py`` (each rank's peak host memory while building, training and saving, beside its stage's
bytes, for a model built on the meta device against one built whole).

Usage: ``python benchmarks/bench_pipeline.py [--part all|schedules|validation|memory] [--ranks 4] [--chunks 16]
[--forward-ms 5] [--steps 6] [--val-batches 8] [--rounds 2]``
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from bench_ddp_overhead import timed_trainer
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_balanced import PipelineStrategy
from lightning_balanced.pipelining.saved_bytes import SavedTensorBytes
from lightning_balanced.pipelining.stage_plan import SCHEDULES

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


class SampleTimedLinear(TimedLinear):
    """``x @ W`` whose forward takes ``forward_s`` per sample of ``x``, as a GPU-bound kernel's time grows with it."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(self.forward_s * x.shape[0])
        return torch.tanh(x @ self.weight)


class Model(pl.LightningModule):
    def __init__(self, layers: int, forward_s: float, per_sample: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        layer = SampleTimedLinear if per_sample else TimedLinear
        self.sequential_module = nn.Sequential(*[layer(forward_s) for _ in range(layers)])

    def compute_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.compute_loss(self.sequential_module(x), y)

    def validation_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
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


class BatchTimes(pl.Callback):
    """The wall time of each validation batch on this rank (the pipeline's last broadcast ends it on every rank)."""

    def __init__(self) -> None:
        self.times: list[float] = []
        self._started = 0.0

    def on_validation_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self._started = time.perf_counter()

    def on_validation_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self.times.append(time.perf_counter() - self._started)


def _schedules() -> list[str]:
    return [name for name, spec in SCHEDULES.items() if spec.available()]


def _stages_per_rank(name: str) -> int:
    return 1 if SCHEDULES[name].placement == "single" else 2


def _trainer(world_size: int, strategy: PipelineStrategy, callback: pl.Callback, **kwargs: Any) -> pl.Trainer:
    return timed_trainer(callback, accelerator="cpu", devices=world_size, strategy=strategy, **kwargs)


def _train(world_size: int, args: argparse.Namespace) -> dict[str, list[dict[str, float]]]:
    batch_size = 4 * args.chunks
    data = TensorDataset(torch.randn(batch_size * args.steps, WIDTH), torch.randn(batch_size * args.steps, WIDTH))
    results: dict[str, list[dict[str, float]]] = {name: [] for name in args.schedules}
    for round_index in range(args.rounds):
        order = args.schedules if round_index % 2 == 0 else list(reversed(args.schedules))
        for name in order:
            probe = Probe()
            trainer = _trainer(
                world_size, PipelineStrategy(schedule=name, chunks=args.chunks), probe, max_steps=args.steps
            )
            # The same model for every schedule: 2 layers per rank, one per stage where a rank holds two stages.
            model = Model(world_size * LAYERS_PER_RANK, args.forward_ms / 1e3 / LAYERS_PER_RANK)
            trainer.fit(model, DataLoader(data, batch_size=batch_size))
            results[name].extend(probe.steps[1:])
    return results


def _validate(world_size: int, args: argparse.Namespace) -> dict[int, list[float]]:
    """Each validation batch's time by ``chunks`` (1: the whole batch stage after stage), warm-up batches left out."""
    batch_size = 4 * args.chunks
    samples = batch_size * args.val_batches
    data = TensorDataset(torch.randn(samples, WIDTH), torch.randn(samples, WIDTH))
    # Per sample: a micro-batch of 4 takes --forward-ms on each rank, split over its layers.
    per_sample_s = args.forward_ms / 1e3 / 4 / LAYERS_PER_RANK
    results: dict[int, list[float]] = {1: [], args.chunks: []}
    for round_index in range(args.rounds):
        order = list(results) if round_index % 2 == 0 else list(reversed(results))
        for chunks in order:
            times = BatchTimes()
            trainer = _trainer(world_size, PipelineStrategy(chunks=chunks, log_bubble=False), times)
            model = Model(world_size * LAYERS_PER_RANK, per_sample_s, per_sample=True)
            trainer.validate(model, DataLoader(data, batch_size=batch_size), verbose=False)
            results[chunks].extend(times.times[1:])
    return results


def _rank(rank: int, world_size: int, port: int, args: argparse.Namespace, queue: Any) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=300))
    results: dict[str, Any] = {}
    if args.part in ("all", "schedules"):
        results["schedules"] = _train(world_size, args)
    if args.part in ("all", "validation"):
        results["validation"] = _validate(world_size, args)
    if rank == 0:
        queue.put(results)
    dist.destroy_process_group()


def _print_schedules(results: dict[str, list[dict[str, float]]], args: argparse.Namespace) -> list[str]:
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
    if "1F1B" not in medians:
        return []
    one = medians["1F1B"]
    step_ratio, saved_ratio = one["step"] / anchor["step"], one["saved"] / anchor["saved"]
    return [f"1f1b_step_ratio={step_ratio:.3f} 1f1b_stage0_saved_ratio={saved_ratio:.3f} (p/m={p / m:.3f})"]


def _print_validation(results: dict[int, list[float]], args: argparse.Namespace) -> list[str]:
    p, m = args.ranks, args.chunks
    batch_size = 4 * m
    t = m * args.forward_ms / 1e3  # one rank's forward of a whole batch
    ideal = {1: p * t, m: (m + p - 1) * t / m}
    medians = {chunks: statistics.median(times) for chunks, times in results.items()}
    counts = {chunks: len(times) for chunks, times in results.items()}
    print(
        f"validation: p={p} ranks, batches of {batch_size}, forward {args.forward_ms / 4} ms per sample per rank"
        f" (t={1e3 * t:.0f} ms a batch), medians of {counts[m]} batches, CPU, torch {torch.__version__}"
    )
    header = ("forward", "chunks", "batch ms", "formula ms", "samples/s", "/whole", "ideal")
    print(" ".join(f"{title:>{width}}" for title, width in zip(header, (14, 6, 9, 10, 10, 7, 7), strict=True)))
    for chunks, label in ((1, "whole batch"), (m, "micro-batched")):
        speedup, ideal_speedup = medians[1] / medians[chunks], ideal[1] / ideal[chunks]
        print(
            f"{label:>14} {chunks:>6} {1e3 * medians[chunks]:9.1f} {1e3 * ideal[chunks]:10.1f}"
            f" {batch_size / medians[chunks]:10.1f} {speedup:7.3f} {ideal_speedup:7.3f}"
        )
    speedup, ideal_speedup = medians[1] / medians[m], p * m / (m + p - 1)
    return [f"validation_speedup={speedup:.3f} (ideal p*m/(m+p-1)={ideal_speedup:.3f})"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--part",
        choices=("all", "schedules", "validation", "memory"),
        default="all",
        help="what to measure (default: all but memory; memory runs bench_pipeline_memory.py's default run)",
    )
    parser.add_argument("--ranks", type=int, default=4, help="processes, one pipeline of p ranks")
    parser.add_argument("--chunks", type=int, default=16, help="micro-batches per batch, m")
    parser.add_argument("--forward-ms", type=float, default=5.0, help="each rank's forward per micro-batch of 4")
    parser.add_argument("--steps", type=int, default=6, help="training steps per fit")
    parser.add_argument("--val-batches", type=int, default=8, help="batches per validate (the first is warm-up)")
    parser.add_argument("--rounds", type=int, default=2, help="rounds of all schedules (and forms), in turns")
    args = parser.parse_args()
    if args.part == "memory":  # each rank's peak host memory beside its stage's bytes: its own script, own ranks
        subprocess.run([sys.executable, str(Path(__file__).with_name("bench_pipeline_memory.py"))], check=True)
        return
    args.schedules = _schedules()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").Queue()
    mp.start_processes(_rank, args=(args.ranks, port, args, queue), nprocs=args.ranks, start_method="spawn")
    results = queue.get()
    summary: list[str] = []
    if "schedules" in results:
        summary += _print_schedules(results["schedules"], args)
    if "validation" in results:
        summary += _print_validation(results["validation"], args)
    print(" ".join(summary))


if __name__ == "__main__":
    main()
