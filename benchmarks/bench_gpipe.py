"""CPU benchmark: step time and peak memory of a GPipe pipeline against the same model unpipelined.

A deep MLP (``--depth`` blocks of ``Linear(width, width) + ReLU``, then a ``Linear(width, 1)``) takes SGD steps on a
batch of ``--batch-size`` random samples (MSE loss), either

  * ``unpipelined``: the plain ``nn.Sequential`` on one thread: the anchor;
  * ``gpipe``: :class:`~lightning_balanced.gpipe.Pipe` over ``--partitions`` CPU partitions (one worker thread
    each, the ``Trainer(accelerator="cpu", devices=N, strategy="gpipe")`` path), for chunks 1/4/8 with
    ``checkpoint="never"``, ``"except_last"`` and ``"always"``.

Peak memory: every configuration runs two steps in a fresh process, whose peak resident set size during the steps minus
its peak before them (model, optimizer and input are already there) is what the steps add, i.e. the
gradients and, above all, the activations kept for backward and the recomputation. glibc is told to map every
allocation above 64 KiB on its own and to use one arena for all threads, so freed tensors leave the resident set at once
and the peak follows live tensors, whichever thread made them (torch's profiler records only the calling thread).
Step time: all configurations live in this process and take their steps in turn (one warm-up step each, then
``--steps`` rounds), so a change of machine load hits every configuration alike; the median per configuration.

What to expect: without checkpointing the pipeline keeps every activation, as the unpipelined model does; with it,
each partition keeps only its input per micro-batch and recomputes one micro-batch at a time in backward, so peak
memory falls with more chunks, at the price of one more forward pass (about a third more compute). On one CPU the
partitions share the cores, so the pipeline cannot be faster than the anchor; on GPUs each partition has its own.

Run: ``python benchmarks/bench_gpipe.py`` (defaults: depth 32, width 256, batch 1024, 2 partitions, 3 steps, 1 torch
thread per process). The table gives, per configuration, the step time and peak memory with their ratios to the
unpipelined anchor measured in the same run.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

import torch
from torch import nn

CONFIGS: list[tuple[int, str]] = [(c, mode) for mode in ("never", "except_last", "always") for c in (1, 4, 8)]


def _peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux: KiB


def build(depth: int, width: int) -> nn.Sequential:
    torch.manual_seed(0)
    blocks: list[nn.Module] = []
    for _ in range(depth):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    return nn.Sequential(*blocks, nn.Linear(width, 1))


def make(args: argparse.Namespace, chunks: int, checkpoint: str) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The model (``chunks=0``: unpipelined) and its optimizer."""
    model: nn.Module = build(args.depth, args.width)
    if chunks:
        from lightning_balanced.gpipe import Pipe

        layers = len(model)
        first = layers // args.partitions + layers % args.partitions
        balance = [first] + [layers // args.partitions] * (args.partitions - 1)
        model = Pipe(model, balance, [torch.device("cpu")] * args.partitions, chunks, checkpoint)
    return model, torch.optim.SGD(model.parameters(), lr=1e-4)


def step(model: nn.Module, optimizer: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> float:
    """One SGD step; returns its seconds."""
    start = time.perf_counter()
    optimizer.zero_grad(set_to_none=False)
    nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
    return time.perf_counter() - start


def peak_memory(args: argparse.Namespace) -> float:
    """MiB the first two steps add to this process's peak resident set (run in a fresh process)."""
    torch.set_num_threads(args.threads)
    model, optimizer = make(args, args.chunks, args.checkpoint)
    x, y = torch.randn(args.batch_size, args.width), torch.randn(args.batch_size, 1)
    before = _peak_rss_mib()
    step(model, optimizer, x, y)
    step(model, optimizer, x, y)
    return _peak_rss_mib() - before


def step_times(args: argparse.Namespace, configs: list[tuple[int, str]]) -> list[float]:
    """Median step seconds of each configuration, all in this process, interleaved so load changes hit all alike."""
    torch.set_num_threads(args.threads)
    models = [make(args, chunks, checkpoint) for chunks, checkpoint in configs]
    x, y = torch.randn(args.batch_size, args.width), torch.randn(args.batch_size, 1)
    for model, optimizer in models:
        step(model, optimizer, x, y)  # warm-up: gradients allocated, worker threads started
    times: list[list[float]] = [[] for _ in models]
    for _ in range(args.steps):
        for k, (model, optimizer) in enumerate(models):
            times[k].append(step(model, optimizer, x, y))
    return [statistics.median(t) for t in times]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--depth", type=int, default=32)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=1024)
    parser.add_argument("--partitions", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads per process")
    parser.add_argument("--chunks", type=int, default=0, help=argparse.SUPPRESS)  # 0: unpipelined (worker)
    parser.add_argument("--checkpoint", default="never", help=argparse.SUPPRESS)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        print(json.dumps(peak_memory(args)))
        return

    common = [
        f"--depth={args.depth}",
        f"--width={args.width}",
        f"--batch-size={args.batch_size}",
        f"--partitions={args.partitions}",
        f"--steps={args.steps}",
        f"--threads={args.threads}",
    ]

    # glibc: every allocation above 64 KiB is its own mapping, returned to the system when freed, and one arena for all
    # threads, so the peak resident set follows the peak of live tensors, whichever thread allocated them.
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "MALLOC_ARENA_MAX": "1"}

    def memory(chunks: int, checkpoint: str) -> float:
        command = [sys.executable, __file__, "--worker", *common, f"--chunks={chunks}", f"--checkpoint={checkpoint}"]
        out = subprocess.run(command, check=True, capture_output=True, text=True, env=env).stdout
        return float(json.loads(out.strip().splitlines()[-1]))

    print(
        f"MLP depth={args.depth} width={args.width} batch={args.batch_size}, {args.partitions} CPU partitions,"
        f" {args.threads} torch thread(s)/process, median of {args.steps} steps"
    )
    configs = [(0, "never"), *CONFIGS]
    peaks = [memory(chunks, checkpoint) for chunks, checkpoint in configs]
    seconds = step_times(args, configs)
    print(f"{'configuration':<38} {'step ms':>9} {'x time':>7} {'peak MiB':>9} {'x memory':>9}")
    for (chunks, checkpoint), peak, time_s in zip(configs, peaks, seconds, strict=True):
        name = f"gpipe chunks={chunks} checkpoint={checkpoint}" if chunks else "unpipelined (anchor)"
        print(
            f"{name:<38} {1000 * time_s:9.1f} {time_s / seconds[0]:7.2f} {peak:9.1f}"
            f" {peak / peaks[0] if peaks[0] > 0 else float('nan'):9.2f}"
        )


if __name__ == "__main__":
    main()
