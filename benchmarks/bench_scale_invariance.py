"""ScaleInvariance: the validation-loss curve against samples seen on 1, 2 and 4 processes, per scaling policy.

The digits job (scikit-learn's 8x8 digits, a conv-BatchNorm CNN, float64) trains with Adam (lr 1e-3, betas (0.9,
0.999), eps 1e-8, tuned at batch 32) under ``strategy="ddp"`` on 1, 2 and 4 spawned gloo CPU processes at per-device
batch 32, so the effective batch is 32, 64 and 128 (``kappa`` = 1, 2, 4). The config is the same apart from
``devices``: a :class:`~lightning_balanced.batch_scaling.scale_invariance.ScaleInvariance` callback with
``reference_batch_size=32`` and a linear warmup over the first 512 samples (on every scale, 1 process included), under
each policy (``--per-device-batch 4`` runs the same at batch 4, 8 and 16, the reference following it: batches well
below the gradient noise scale; ``--policies`` picks some):

* ``adam_sde+ema``: the SDE rule for Adam (lr x sqrt(kappa), 1 - beta x kappa, eps / sqrt(kappa); Malladi et al.,
  NeurIPS 2022) and the EMA rule for BatchNorm's momentum (Busbridge et al., NeurIPS 2023);
* ``linear+ema``: the learning rate x kappa (Adam's betas and eps kept) with the EMA rule: the rule of the regime where
  the gradient dominates its noise, where Adam's step is about ``lr x sign(gradient)``;
* ``sqrt``: the learning rate x sqrt(kappa) only (the contrast the issue asks for).

Rank 0 measures the loss on the whole validation split at 8 checkpoints, every 512 samples seen (over all processes),
for ``--seeds`` seeds (the seed sets the initial weights and the data order). A curve is *inside the band* when, at
every checkpoint, its mean over the seeds lies within 2 standard deviations (over the seeds) of the 1-process curve's
mean. The anchor is the 1-process run of the same script. Ends with ``<policy>_inside=`` (the world sizes whose curve
lies inside the band), ``worst_z_<policy>=`` (the largest distance from the 1-process mean, in its standard
deviations) and ``max_noise_scale=``: the gradient noise scale ``B_simple`` of the 1-process runs, measured at each
checkpoint (:func:`gradient_noise_scale`, over the whole training set). On 2 and 4 processes the callback measures it
too (``measure_noise_scale=True``, from each rank's and the all-reduced gradient) and the bench prints its estimate at
the end of the runs. The SDE rule assumes batches well below it (noise-dominated steps); where the effective batch
(64, 128) is not, the larger-batch runs lag in samples. ``--plot`` saves loss against samples, one line per world
size, one panel per policy (needs matplotlib); ``--json`` writes the curves and the noise scales.

Usage: ``python benchmarks/bench_scale_invariance.py [--seeds 5] [--world-sizes 1 2 4] [--per-device-batch 32]
[--plot curves.png]``
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
from datetime import timedelta
from queue import Empty
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from lightning.pytorch.strategies import DDPStrategy
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_balanced.batch_scaling.scale_invariance import ScaleInvariance

PER_DEVICE_BATCH = 32
CHECKPOINT_SAMPLES = 512
CHECKPOINTS = 8
WARMUP_SAMPLES = 512
POLICIES: dict[str, list[str]] = {
    "adam_sde+ema": ["adam_sde", "ema"],
    "linear+ema": ["linear", "ema"],
    "sqrt": ["sqrt"],
}


def digits() -> tuple[TensorDataset, TensorDataset]:
    """The 80/20 stratified split of scikit-learn's digits, standardized with the training set's statistics."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    data = load_digits()
    x = torch.tensor(data.images, dtype=torch.float64).unsqueeze(1)
    y = torch.tensor(data.target, dtype=torch.long)
    train, val = train_test_split(range(len(y)), test_size=0.2, stratify=data.target, random_state=0)
    mean, std = x[train].mean(), x[train].std()
    x = (x - mean) / std
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


class Digits(pl.LightningModule):
    def __init__(self, lr: float) -> None:
        super().__init__()
        self.lr = lr
        self.net = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(16, 32, 3, padding=1, bias=False),
            nn.BatchNorm2d(32),
            nn.ReLU(),
            nn.AdaptiveAvgPool2d(1),
            nn.Flatten(),
            nn.Linear(32, 10),
        ).double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr, betas=(0.9, 0.999), eps=1e-8)


def gradient_noise_scale(net: nn.Module, train: TensorDataset, batch: int = PER_DEVICE_BATCH) -> float:
    """``B_simple = tr(Sigma) / |G|^2`` (McCandlish et al. 2018, "An Empirical Model of Large-Batch Training").

    ``G`` is the mean of the gradients of the training set's batches of ``batch`` samples (in order, BatchNorm in
    training mode on each, as in a step), and ``tr(Sigma) / batch`` their mean squared distance from it. A
    batch much smaller than ``B_simple`` is noise-dominated, the regime where the SDE rule holds (Malladi et al.,
    Section 5); a batch near or above it is not. Measured on a copy, so training is untouched.
    """
    import copy

    probe = copy.deepcopy(net).train()
    x, y = train.tensors
    grads = []
    for start in range(0, len(y) - batch + 1, batch):
        probe.zero_grad()
        F.cross_entropy(probe(x[start : start + batch]), y[start : start + batch]).backward()
        grads.append(torch.cat([p.grad.flatten() for p in probe.parameters() if p.grad is not None]))
    stacked = torch.stack(grads)
    mean = stacked.mean(0)
    spread = (stacked - mean).pow(2).sum(1).mean().item() * len(grads) / (len(grads) - 1)
    return batch * spread / mean.pow(2).sum().item()


class ValidationCurve(pl.Callback):
    """On rank 0, the loss on the whole validation set every ``every_steps`` optimizer steps, and on 1 process the
    gradient noise scale there (:func:`gradient_noise_scale`)."""

    def __init__(
        self, val: TensorDataset, every_steps: int, train: TensorDataset | None = None, batch: int = 32
    ) -> None:
        self.x, self.y = val.tensors
        self.every_steps = every_steps
        self.train = train
        self.batch = batch
        self.losses: list[float] = []
        self.noise_scales: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        if trainer.global_step % self.every_steps or not trainer.is_global_zero:
            return
        net = module.net  # type: ignore[attr-defined]
        net.eval()
        with torch.no_grad():
            self.losses.append(F.cross_entropy(net(self.x), self.y).item())
        net.train()
        if self.train is not None:
            self.noise_scales.append(gradient_noise_scale(net, self.train, self.batch))


def _rank(
    rank: int, world_size: int, port: int, seeds: int, lr: float, every: int, batch: int, names: list[str], queue: Any
) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world_size)
    )
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=300))
    train, val = digits()
    steps_per_checkpoint = every // (batch * world_size)
    curves: dict[str, list[list[float]]] = {name: [] for name in names}
    noise_scales: list[list[float]] = []
    for name in names:
        for seed in range(seeds):
            pl.seed_everything(seed, verbose=False)
            model = Digits(lr)
            curve = ValidationCurve(val, steps_per_checkpoint, train if world_size == 1 else None, batch)
            scaling = ScaleInvariance(
                POLICIES[name],
                reference_batch_size=batch,
                warmup_samples=WARMUP_SAMPLES,
                measure_noise_scale=world_size > 1,
            )
            trainer = pl.Trainer(
                accelerator="cpu",
                devices=world_size,
                strategy=DDPStrategy(),
                max_steps=steps_per_checkpoint * CHECKPOINTS,
                logger=False,
                enable_checkpointing=False,
                enable_progress_bar=False,
                enable_model_summary=False,
                limit_val_batches=0,
                callbacks=[scaling, curve],
            )
            loader = DataLoader(train, batch_size=batch, shuffle=True, drop_last=True)
            trainer.fit(model, loader)
            curves[name].append(curve.losses)
            if curve.noise_scales:
                noise_scales.append(curve.noise_scales)
            elif world_size > 1:  # the callback's estimate under DDP, at the end of the run
                value = scaling.noise_scales[0].value
                noise_scales.append([float("nan") if value is None else value])
    if rank == 0:
        queue.put((curves, noise_scales))
    dist.destroy_process_group()


def run(
    world_size: int, seeds: int, lr: float, every: int, batch: int = PER_DEVICE_BATCH, names: list[str] | None = None
) -> tuple[dict[str, list[list[float]]], list[list[float]]]:
    """Each policy's curves (one per seed, ``CHECKPOINTS`` losses each) on ``world_size`` spawned processes, and the
    gradient noise scale of each run: on one process at each checkpoint, on more ScaleInvariance's estimate at the
    end."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    queue = mp.get_context("spawn").Queue()
    context = mp.start_processes(
        _rank,
        args=(world_size, port, seeds, lr, every, batch, names or list(POLICIES), queue),
        nprocs=world_size,
        start_method="spawn",
        join=False,
    )
    try:
        while True:  # rank 0 puts the result before its teardown; a rank that failed ends the wait
            try:
                return queue.get(timeout=1.0)  # type: ignore[no-any-return]
            except Empty:
                failed = [p.exitcode for p in context.processes if p.exitcode not in (None, 0)]
                if failed:
                    raise RuntimeError(f"a rank of the {world_size}-process run failed (exit codes {failed})") from None
    finally:
        # torch 2.4's gloo can hang in destroy_process_group when the ranks tear down together (as
        # tests/distributed.py notes): a rank still there a few seconds after the result is killed.
        for process in context.processes:
            process.join(timeout=10)
            if process.is_alive():
                process.kill()
                process.join()


def z_scores(curves: list[list[float]], anchor: list[list[float]]) -> list[float]:
    """At each checkpoint: |mean(curves) - mean(anchor)| / std(anchor), over the seeds."""
    scores = []
    for index in range(len(anchor[0])):
        reference = [curve[index] for curve in anchor]
        mean = statistics.fmean(curve[index] for curve in curves)
        spread = statistics.stdev(reference)
        scores.append(abs(mean - statistics.fmean(reference)) / spread if spread > 0 else float("inf"))
    return scores


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=5)
    parser.add_argument(
        "--checkpoint-samples", type=int, default=CHECKPOINT_SAMPLES, help="samples between checkpoints"
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam's learning rate at the reference batch")
    parser.add_argument(
        "--per-device-batch",
        type=int,
        default=PER_DEVICE_BATCH,
        help="each process's batch; also the reference batch the hyperparameters are tuned at (1 process)",
    )
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2, 4])
    parser.add_argument("--policies", nargs="+", choices=list(POLICIES), default=list(POLICIES))
    parser.add_argument("--plot", default=None, help="save the curves to this image (needs matplotlib)")
    parser.add_argument("--json", default=None, help="write the curves to this file")
    args = parser.parse_args()
    if args.world_sizes[0] != 1 or args.seeds < 2:
        parser.error("the first world size must be 1 (the anchor) and --seeds at least 2")
    if args.plot:
        try:
            import matplotlib
        except ImportError:
            parser.error("--plot needs matplotlib: pip install matplotlib")
    every = args.checkpoint_samples
    batch = args.per_device_batch
    if every % (batch * max(args.world_sizes)):
        parser.error(f"--checkpoint-samples must be a multiple of {batch} x the largest world size")
    runs = {w: run(w, args.seeds, args.lr, every, batch, args.policies) for w in args.world_sizes}
    results = {world_size: curves for world_size, (curves, _) in runs.items()}
    noise = runs[1][1]
    samples = [every * (i + 1) for i in range(CHECKPOINTS)]
    print(
        f"validation loss at {samples[0]}..{samples[-1]} samples, mean over {args.seeds} seeds, lr {args.lr},"
        f" per-device batch {batch}"
        f" (torch {torch.__version__})"
    )
    scales = [statistics.fmean(run[i] for run in noise) for i in range(CHECKPOINTS)]
    print(f"{'B_simple':>13} w=1  " + " ".join(f"{value:6.1f}" for value in scales) + "  (gradient noise scale)")
    for world_size in args.world_sizes[1:]:
        ends = [value for (value,) in runs[world_size][1] if value == value]
        measured = f"{statistics.fmean(ends):.1f}" if ends else "none"
        print(f"{'B_simple':>13} w={world_size}  {measured} at the end (ScaleInvariance(measure_noise_scale=True))")
    inside: dict[str, list[int]] = {}
    worst: dict[str, float] = {}
    for name in args.policies:
        anchor = results[1][name]
        inside[name] = []
        worst[name] = 0.0
        for world_size in args.world_sizes:
            curves = results[world_size][name]
            means = [statistics.fmean(curve[i] for curve in curves) for i in range(CHECKPOINTS)]
            line = " ".join(f"{value:.4f}" for value in means)
            if world_size == 1:
                print(f"{name:>13} w=1  {line}  (anchor)")
                continue
            scores = z_scores(curves, anchor)
            verdict = "inside" if max(scores) <= 2 else "outside"
            print(f"{name:>13} w={world_size}  {line}  max |z| {max(scores):.2f}: {verdict} the 2-sigma band")
            if max(scores) <= 2:
                inside[name].append(world_size)
            worst[name] = max(worst[name], max(scores))
    keys = {name: name.replace("+", "_") for name in args.policies}
    print(
        " ".join(f"{keys[name]}_inside={inside[name]}" for name in args.policies)
        + "".join(f" worst_z_{keys[name]}={worst[name]:.2f}" for name in args.policies)
        + f" max_noise_scale={max(scales):.1f}"
    )
    if args.json:
        with open(args.json, "w") as file:
            ddp = {str(w): [value for (value,) in runs[w][1]] for w in args.world_sizes[1:]}
            by_world = {str(w): c for w, c in results.items()}
            json.dump({"samples": samples, "curves": by_world, "noise_scale": noise, "noise_scale_ddp": ddp}, file)
    if args.plot:
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        columns = len(args.policies)
        figure, axes = plt.subplots(1, columns, figsize=(5 * columns, 4), sharey=True, squeeze=False)
        for axis, name in zip(axes[0], args.policies, strict=True):
            for world_size in args.world_sizes:
                curves = results[world_size][name]
                means = [statistics.fmean(curve[i] for curve in curves) for i in range(CHECKPOINTS)]
                axis.plot(samples, means, marker="o", label=f"{world_size} process" + ("es" if world_size > 1 else ""))
            axis.set(title=name, xlabel="samples seen", ylabel="validation loss", yscale="log")
            axis.legend()
        figure.tight_layout()
        figure.savefig(args.plot)
        print(f"plot: {args.plot}")


if __name__ == "__main__":
    main()
