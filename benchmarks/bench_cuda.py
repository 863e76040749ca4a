"""GPU benchmark: balanced_dp and gpipe on one GPU against one device.

Two parts, each measuring ours and its anchor in this one process, interleaved, after warm-up; GPU time from CUDA
events, medians:

* ``balanced_dp``: a Lightning step of a small conv-BN CNN (batch 256 of 3x32x32, SGD) under
  ``BalancedDataParallelStrategy(parallel_devices=[cuda:0] * 2, gpu0_bsz=96)``, two replicas on the one GPU, each on
  its own stream, against the same step on one device (``Trainer(devices=1)``), the anchor. Step time is from
  ``on_train_batch_start`` to ``on_train_batch_end`` (CUDA events), the first steps being warm-up.
* ``gpipe``: :class:`~lightning_balanced.gpipe.Pipe` over two partitions on the one GPU (``[cuda:0, cuda:0]``,
  chunks 4, ``checkpoint="except_last"``) against the unpipelined ``nn.Sequential`` (an MLP, depth 32, width 1024,
  batch 2048): SGD step time and the peak memory a step adds (``torch.cuda.max_memory_allocated``).

One GPU cannot be faster with two replicas or partitions than with one: the ratios are the price of the one-GPU form
(streams, copies, threads), not a speed-up. The CUDA NMS has its own benchmark, ``benchmarks/bench_nms_cuda.py``.
Run on a GPU machine from the repository root: ``python benchmarks/bench_cuda.py [--quick]``. The last line is the
summary ``bench_cuda: balanced_dp 2 replicas on one device / one device <ratio>; gpipe 2 partitions on one device /
unpipelined: time <ratio>, memory <ratio>``, which ``tools/gpu_check.py`` quotes. ``--device cpu`` runs the same code
on the CPU (virtual devices), as a smoke test.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import Any

import lightning.pytorch as pl
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_balanced import BalancedDataParallelStrategy
from lightning_balanced.gpipe import Pipe


class Clock:
    """Elapsed seconds of a region: CUDA events on a GPU, ``perf_counter`` (after a sync) elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"

    def time(self, fn: Callable[[], Any]) -> float:
        if not self.cuda:
            start = time.perf_counter()
            fn()
            return time.perf_counter() - start
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / 1e3


class _StepEvents(pl.Callback):
    def __init__(self, device: torch.device) -> None:
        self.clock = Clock(device)
        self.times: list[float] = []
        self._marks: list[Any] = []

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.clock.cuda:
            event = torch.cuda.Event(enable_timing=True)
            event.record()
            self._marks = [event]
        else:
            self._marks = [time.perf_counter()]

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        if self.clock.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            self.times.append(self._marks[0].elapsed_time(end) / 1e3)
        else:
            self.times.append(time.perf_counter() - self._marks[0])


class _Cnn(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(
            nn.Conv2d(3, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
            nn.Conv2d(64, 64, 3, padding=1), nn.BatchNorm2d(64), nn.ReLU(),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, 10),
        )  # fmt: skip

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def _fit_steps(device: torch.device, replicas: int, steps: int) -> list[float]:
    g = torch.Generator().manual_seed(0)
    data = TensorDataset(torch.randn(256 * steps, 3, 32, 32, generator=g), torch.randint(0, 10, (256 * steps,)))
    timer = _StepEvents(device)
    if device.type == "cuda":
        accelerator, devices = "cuda", [device.index or 0]
        strategy: Any = (
            BalancedDataParallelStrategy(parallel_devices=[device] * replicas, gpu0_bsz=96) if replicas > 1 else "auto"
        )
    else:  # virtual CPU devices
        accelerator, devices = "cpu", replicas
        strategy = BalancedDataParallelStrategy(gpu0_bsz=96) if replicas > 1 else "auto"
    trainer = pl.Trainer(
        accelerator=accelerator,
        devices=devices,
        strategy=strategy,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[timer],
    )
    trainer.fit(_Cnn(), DataLoader(data, batch_size=256))
    return timer.times[3:]


def bench_balanced_dp(device: torch.device, steps: int, rounds: int) -> float:
    """Print balanced_dp's step time with two replicas on one device against one device; return the ratio."""
    times: dict[int, list[float]] = {1: [], 2: []}
    for round_index in range(rounds):
        for replicas in (1, 2) if round_index % 2 == 0 else (2, 1):
            times[replicas] += _fit_steps(device, replicas, steps)
    single, two = statistics.median(times[1]), statistics.median(times[2])
    print(f"balanced_dp: one device {single * 1e3:.2f} ms, two replicas on it {two * 1e3:.2f} ms", flush=True)
    return two / single


def _mlp(depth: int, width: int, device: torch.device) -> nn.Sequential:
    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*layers, nn.Linear(width, 1)).to(device)


def bench_gpipe(device: torch.device, steps: int, width: int, batch: int) -> tuple[float, float]:
    """Print gpipe's step time and added peak memory on one device against unpipelined; return both ratios."""
    clock = Clock(device)
    x, y = torch.randn(batch, width, device=device), torch.randn(batch, 1, device=device)
    models: dict[str, nn.Module] = {"unpipelined": _mlp(32, width, device)}
    pipe = Pipe(_mlp(32, width, device), [33, 32], [device, device], chunks=4, checkpoint="except_last")
    pipe.place()
    models["gpipe"] = pipe
    optimizers = {name: torch.optim.SGD(model.parameters(), lr=1e-4) for name, model in models.items()}

    def step(name: str) -> None:
        optimizers[name].zero_grad(set_to_none=False)
        F.mse_loss(models[name](x), y).backward()
        optimizers[name].step()

    peaks: dict[str, float] = {}
    for name in models:
        step(name)  # warm-up: gradients allocated, workers started
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            base = torch.cuda.memory_allocated(device)
            torch.cuda.reset_peak_memory_stats(device)
            step(name)
            torch.cuda.synchronize(device)
            peaks[name] = (torch.cuda.max_memory_allocated(device) - base) / 2**20
    times: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(steps):
        for name in models:
            times[name].append(clock.time(lambda name=name: step(name)))
    pipe.close()
    medians = {name: statistics.median(t) for name, t in times.items()}
    time_ratio = medians["gpipe"] / medians["unpipelined"]
    memory_ratio = peaks["gpipe"] / peaks["unpipelined"] if peaks else float("nan")
    for name in models:
        memory = f", peak +{peaks[name]:.0f} MiB" if peaks else ""
        print(f"gpipe: {name:>11} step {medians[name] * 1e3:.2f} ms{memory}", flush=True)
    return time_ratio, memory_ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu for a smoke run")
    parser.add_argument("--quick", action="store_true", help="fewer steps and repeats")
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("bench_cuda: no CUDA GPU visible; run it on a GPU machine, or with --device cpu")
        device = torch.device("cuda", torch.cuda.current_device())
        print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    dp_ratio = bench_balanced_dp(device, steps=10 if args.quick else 30, rounds=2 if args.quick else 4)
    width, batch = (256, 256) if device.type == "cpu" or args.quick else (1024, 2048)
    pipe_time, pipe_memory = bench_gpipe(device, steps=3 if args.quick else 10, width=width, batch=batch)
    print(
        f"bench_cuda: balanced_dp 2 replicas on one device / one device {dp_ratio:.3f}; gpipe 2 partitions on one "
        f"device / unpipelined: time {pipe_time:.3f}, memory {pipe_memory:.3f}",
        flush=True,
    )


if __name__ == "__main__":
    main()
