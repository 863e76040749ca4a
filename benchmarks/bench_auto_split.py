"""Throughput of ``chunk_sizes="auto"`` against the even split and the best hand-set split, on devices of mixed speed.

The job is the digits CNN of ``examples/digits.py`` (conv-BN-ReLU blocks on scikit-learn's 8x8 digits) with one total
batch for every configuration, trained by ``BalancedDataParallelStrategy`` on the CPU emulation. The devices come from
the emulation's testing aid, ``EmulatedDevice``: each does ``--seconds-per-sample`` of device work per sample of its
chunk (slept on the replica's thread, as a GPU works while its host thread waits: a GPU-bound job) on top of the
host's own compute for the replica, and the speed ratios (1:1, 1:2, 1:1:3) stretch that step method to ``slowdown``
times its time. With ``--seconds-per-sample 0`` the devices' work is the host's compute alone, which two cores, the GIL
and every replica share, so the measured speeds then follow that contention as much as the slowdowns. For each ratio:

* ``even``: ``EvenSplit()``, what ``balanced_dp`` does by default;
* ``auto``: ``AutoSplit()`` with its defaults (it profiles the first 6 steps: those are in the warm-up here, the
  steady state is measured; the fit's total time is printed too);
* ``best hand-set``: the fastest ``ChunkSizes`` of a grid search (every split in steps of ``--grid`` samples, one fit
  each; on three devices the two equal-speed devices get equal chunks), then measured again: its time in the search
  is the luckiest of many noisy draws (the device phase's winner likewise).

``even``, ``auto`` and the winners are then fitted ``--repeats`` times each, in turns (the order reversed every other
round), so that a slow patch of the machine falls on all of them. Each configuration's step time
(``on_train_batch_start`` to ``on_train_batch_end``: scatter, replicate, forward, backward, optimizer step) is the
median over the steps after ``--warmup`` of all its fits; throughput is the batch over it. ``auto``'s plans are
printed, one per distinct plan of its fits.

The device phase is the part of the step the devices run side by side, the slowest replica's step method (what
``auto`` measures), timed the same way for every policy. The ratios printed are throughputs, for the whole step and
for the device phase: ``auto / even`` (target >= 1.25 at 1:2) and ``auto / best`` (target >= 0.95 at every ratio;
the best by the same measure). The emulation's backward pass runs on the host for all replicas one after another and
is not stretched (see ``EmulatedDevice``), so the whole step gains less from a good split here than on GPUs, where
every device runs its own backward pass in parallel; the device phase shows what the split itself does. At 1:1 the
plans are even or within a few samples of it, and the ratios show the run's noise.

``--device cuda`` runs the same job on one GPU with replicas sharing it (``parallel_devices=[cuda:0] * n``; no
emulated slowdown there) and prints ``auto / even``, the overhead of profiling and timing with CUDA events, and
``auto_plan_skew_cuda``, how far ``auto``'s chunks are from equal (the largest ``|chunk - batch / n| / (batch / n)``
over its plans; target <= 0.05: identical replicas on one GPU are planned as that one GPU, once the strategy tells
``AutoSplit`` which replicas share it, ``AutoSplit.set_devices``; the line says whether it did).

Usage: ``python benchmarks/bench_auto_split.py [--steps 30] [--warmup 8] [--batch 256] [--grid 16] [--repeats 3]
[--quick]``

One intra-op thread per replica by default: on a small host, replicas that each spread over every core slow one
another down, and the measured speeds then reflect that contention more than the emulated slowdowns.
"""

from __future__ import annotations

import argparse
import functools
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

from bench_ddp_overhead import StepTimer, timed_trainer
from digits import DigitsClassifier, DigitsDataModule

from lightning_balanced import AutoSplit, BalancedDataParallelStrategy, ChunkSizes, EvenSplit, SplitPolicy
from lightning_balanced.data_parallel.virtual_device import EmulatedDevice, emulate_devices

RATIOS = {"1:1": [1.0, 1.0], "1:2": [1.0, 2.0], "1:1:3": [1.0, 1.0, 3.0]}


class _DevicePhase(SplitPolicy):
    """Wraps a policy and records each step's device phase: the slowest replica's step-method time (s).

    A policy that observes has its replicas timed by the strategy (``SplitPolicy.observe``), so wrapping the even and
    hand-set policies this way measures them exactly as ``auto`` is measured.
    """

    def __init__(self, policy: SplitPolicy) -> None:
        self.policy = policy
        self.phases: list[float] = []

    def _plan(self, batch_size: int, num_devices: int) -> list[int]:
        return self.policy.plan(batch_size, num_devices)

    def check_devices(self, num_devices: int) -> None:
        self.policy.check_devices(num_devices)

    def set_capacities(self, capacity_bytes: list[int | None]) -> None:
        self.policy.set_capacities(capacity_bytes)

    def set_devices(self, devices: Sequence[torch.device]) -> None:
        # AutoSplit learns from the strategy which replicas share a GPU; the other policies have no such method.
        set_devices = getattr(self.policy, "set_devices", None)
        if set_devices is not None:
            set_devices(devices)

    def observe(self, chunk_sizes: list[int], seconds: list[float], peak_bytes: list[int | None] | None = None) -> None:
        self.phases.append(max(seconds))
        if type(self.policy).observe is not SplitPolicy.observe:
            self.policy.observe(chunk_sizes, seconds, peak_bytes)

    def __repr__(self) -> str:
        return repr(self.policy)


@dataclass
class _Measured:
    """One configuration's fits: every measured step's time and device phase (s), each fit's wall time, the plans."""

    steps: list[float] = field(default_factory=list)
    phases: list[float] = field(default_factory=list)
    fit_seconds: list[float] = field(default_factory=list)
    plans: list[list[int]] = field(default_factory=list)
    shared: list[list[int]] | None = None  # AutoSplit's groups of replicas on one device, from its last fit

    @property
    def step(self) -> float:
        return statistics.median(self.steps)

    @property
    def phase(self) -> float:
        return statistics.median(self.phases)


def _fit(policy: SplitPolicy, num_devices: int, args: argparse.Namespace, into: _Measured | None = None) -> _Measured:
    """Fit once with ``policy`` and add its steps after warm-up, wall time and last plan to ``into`` (or a new one)."""
    pl.seed_everything(0, verbose=False)
    timer = StepTimer()
    timed = _DevicePhase(policy)
    devices: dict[str, Any] = {"accelerator": "cpu", "devices": num_devices}
    strategy_devices = None
    if args.device == "cuda":
        devices = {"accelerator": "cuda", "devices": 1}
        strategy_devices = [torch.device("cuda", 0)] * num_devices
    trainer = timed_trainer(
        timer,
        strategy=BalancedDataParallelStrategy(split=timed, parallel_devices=strategy_devices),
        max_steps=args.warmup + args.steps,
        limit_val_batches=0,
        **devices,
    )
    began = time.perf_counter()
    trainer.fit(DigitsClassifier(), DigitsDataModule(batch_size=args.batch))
    measured = into if into is not None else _Measured()
    measured.fit_seconds.append(time.perf_counter() - began)
    measured.steps += timer.times[args.warmup :]
    measured.phases += timed.phases[args.warmup :]
    measured.plans.append(policy.plan(args.batch, num_devices))
    if isinstance(policy, AutoSplit):
        measured.shared = policy.shared_devices
    return measured


def _interleaved(
    policies: dict[str, Callable[[], SplitPolicy]], num_devices: int, args: argparse.Namespace
) -> dict[str, _Measured]:
    """``args.repeats`` fits of each policy, in turns (the order reversed every other round), steps pooled."""
    measured = {name: _Measured() for name in policies}
    for round_index in range(args.repeats):
        names = list(policies) if round_index % 2 == 0 else list(reversed(policies))
        for name in names:
            _fit(policies[name](), num_devices, args, measured[name])
    return measured


def _plans(measured: _Measured) -> str:
    """The distinct plans of a configuration's fits, in order (one when every fit chose the same)."""
    return " ".join(str(list(plan)) for plan in dict.fromkeys(tuple(plan) for plan in measured.plans))


def _grid(batch: int, slowdowns: list[float], step: int) -> list[list[int]]:
    """Hand-set splits to search: every split in steps of ``step``; equal-speed devices get equal chunks."""
    if len(slowdowns) == 2:
        return [[k, batch - k] for k in range(step, batch, step)]
    splits = []
    for k in range(step, batch, step):  # the two fast devices' chunk each, the slow one the rest
        if batch - 2 * k >= 1:
            splits.append([k, k, batch - 2 * k])
    return splits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30, help="measured steps per fit")
    parser.add_argument("--warmup", type=int, default=8, help="steps before measuring (auto profiles 6)")
    parser.add_argument("--batch", type=int, default=256, help="the total batch, split over the devices")
    parser.add_argument("--grid", type=int, default=16, help="the grid search's step, in samples")
    parser.add_argument("--repeats", type=int, default=3, help="fits of even, auto and the winner, in turns")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    parser.add_argument(
        "--seconds-per-sample",
        type=float,
        default=0.0005,
        help="emulated device work per sample (s; 0: the host's own compute only)",
    )
    parser.add_argument("--ratios", nargs="+", choices=list(RATIOS), default=list(RATIOS), help="speed ratios to run")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--quick", action="store_true", help="a smoke run: 10 measured steps")
    args = parser.parse_args()
    if args.quick:
        args.steps = 10
    torch.set_num_threads(args.threads)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            print("bench_auto_split: skipped, no GPU (`--device cuda` needs one)")
            return
        runs = _interleaved({"even": EvenSplit, "auto": AutoSplit}, 2, args)
        even, auto = runs["even"], runs["auto"]
        print(
            f"one GPU, 2 replicas: even {even.step * 1e3:.2f} ms, auto {auto.step * 1e3:.2f} ms (plans {_plans(auto)})"
        )
        print(
            f"  AutoSplit planned replicas {auto.shared} as one GPU"
            if auto.shared
            else "  AutoSplit was not told that the replicas share the GPU (the strategy does not call set_devices):"
            " each replica planned by its own CUDA events, which span the other's work too"
        )
        equal = args.batch / 2
        skew = max(abs(size - equal) / equal for plan in auto.plans for size in plan)
        print(f"auto_over_even_throughput_cuda={even.step / auto.step:.3f}")
        print(f"auto_plan_skew_cuda={skew:.3f}")
        return
    print(
        f"digits CNN, batch {args.batch}, {args.steps} measured steps after {args.warmup}, {args.threads} threads,"
        f" emulated device work {args.seconds_per_sample * 1e3:g} ms/sample"
    )
    print("throughput ratios (> 1: auto faster); step = wall time of a step, device = its device phase")
    print(
        f"{'ratio':>6} | {'plans auto':<45} {'best (step)':<15} | {'even ms':>8} {'auto ms':>8} {'best ms':>8} |"
        f" {'auto/even':>9} {'auto/best':>9} | {'device: auto/even':>17} {'auto/best':>9} | auto fit s"
    )
    summary: dict[str, float] = {}
    for name in args.ratios:
        slowdowns = RATIOS[name]
        n = len(slowdowns)
        emulated = [EmulatedDevice(slowdown=s, seconds_per_sample=args.seconds_per_sample) for s in slowdowns]
        with emulate_devices(emulated):
            searched = {
                tuple(split): _fit(ChunkSizes(split), n, args) for split in _grid(args.batch, slowdowns, args.grid)
            }
            # The search's winners measured again, with even and auto, in turns: a split's time in the search is
            # one noisy draw, and the winner's is the luckiest of many.
            best_split = min(searched, key=lambda split: searched[split].step)
            best_device_split = min(searched, key=lambda split: searched[split].phase)
            policies: dict[str, Callable[[], SplitPolicy]] = {"even": EvenSplit, "auto": AutoSplit}
            for split in dict.fromkeys((best_split, best_device_split)):
                policies[str(list(split))] = functools.partial(ChunkSizes, list(split))
            runs = _interleaved(policies, n, args)
        even, auto = runs["even"], runs["auto"]
        best, best_device = runs[str(list(best_split))], runs[str(list(best_device_split))]
        ratios = {
            "step_even": even.step / auto.step,
            "step_best": best.step / auto.step,
            "device_even": even.phase / auto.phase,
            "device_best": best_device.phase / auto.phase,
        }
        for key, value in ratios.items():
            summary[f"{key}_{name}"] = value
        print(
            f"{name:>6} | {_plans(auto):<45} {list(best_split)!s:<15} | {even.step * 1e3:8.2f} {auto.step * 1e3:8.2f}"
            f" {best.step * 1e3:8.2f} | {ratios['step_even']:9.3f} {ratios['step_best']:9.3f} |"
            f" {ratios['device_even']:17.3f} {ratios['device_best']:9.3f} | {statistics.median(auto.fit_seconds):.1f}"
        )
    if "1:2" in args.ratios:
        print(f"auto_over_even_throughput_1_2={summary['step_even_1:2']:.3f}")
        print(f"auto_over_even_device_throughput_1_2={summary['device_even_1:2']:.3f}")
    print(f"worst_auto_over_best_throughput={min(v for k, v in summary.items() if k.startswith('step_best')):.3f}")
    print(
        "worst_auto_over_best_device_throughput="
        f"{min(v for k, v in summary.items() if k.startswith('device_best')):.3f}"
    )


if __name__ == "__main__":
    main()
