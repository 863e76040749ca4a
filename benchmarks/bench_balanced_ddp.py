"""``strategy="balanced_ddp"`` on ranks of mixed speed: ``chunk_sizes="auto"`` against the even and the best split, its
cost against Lightning's DDP, and how fast ``auto`` re-plans when a rank slows down.

``--ranks`` CPU processes (2 by default, one torch thread each) joined by gloo train a tiny MLP on a global batch of
``--batch`` samples under :class:`~lightning_balanced.BalancedDDPStrategy`. Each rank stands in for a GPU of its own
speed: rank ``r`` is ``k_r`` times slower than a reference device (``--speeds``, default ``1:2``), and its
``training_step`` sleeps ``k_r * seconds_per_sample * share`` (``--seconds-per-sample``, default 1 ms) before the
forward pass of its share. This models a GPU-bound job's **per-sample device time**: the part of a step that grows
with the share and that a slower GPU stretches, which is what ``AutoSplit`` measures (the strategy times the step
method) and what the split can balance. It does not model a slower GPU's memory (no cap: the strategy caps by memory
on CUDA only), its communication (the gradient all-reduce runs over gloo at host speed on every rank), its host
overhead (Lightning's loop, the optimizer step and the MLP's own compute cost the same on every rank), nor a slower
backward pass (the backward is the MLP's, host compute, equal on every rank; on GPUs the backward is stretched too,
which gives the split more to balance). The sleeps do not compete for the two cores, so the ranks' speeds are the
stand-in's and not the machine's contention. The parts, all in one run (one spawn of the ranks):

1. **Split** (at ``--speeds``): the best hand-set ``ChunkSizes`` comes from a small grid search, every split in steps
   of ``--grid`` samples, then every split within ``--grid`` samples of the winner (ranks of equal speed get equal
   shares), each run for ``--block`` steps of one fit (a policy that changes the plan every ``--block`` steps: the
   plan of the ``i``-th batch is the one the strategy's sampler asked for ``i``-th; checked against each rank's
   share) and ranked by its median step time. Then ``even`` (``EvenSplit()``), ``auto``
   (``AutoSplit(profile_steps=--profile-steps, warmup_steps=1, drift_window=--drift-window)``, small windows so that
   it plans within the warm-up) and the search's winner as ``ChunkSizes`` are fitted ``--repeats`` times each, in
   turns (the order reversed every other round), ``--warmup`` steps then ``--steps`` measured steps. Throughput: the
   global batch times the measured steps over their wall time (a step's time is from one ``on_train_batch_end`` to the
   next, the batch's fetch included), pooled over the fits. Goals: ``auto / even >= 1.35`` (the stand-in's sleep alone
   gives ``max_r(k_r * even_r) / (B / sum_r(1 / k_r))``, 1.5 at 1:2; the fixed cost of a step dilutes it) and
   ``auto / best >= 0.95``.
2. **Overhead** (every rank at speed 1): ``balanced_ddp`` with its defaults (even split, ``log_shares=True``) against
   ``DDPStrategy()`` (``strategy="ddp"``) at the same global batch (DDP's per-process batch ``B / ranks``), with
   ``balanced_ddp`` at ``log_shares=False`` beside it and an A/A control (``ddp_again``: DDP against itself, this
   run's noise floor), ``--rounds`` rounds in turns. The ratio is the median step time over DDP's (goal <= 1.02,
   i.e. throughput >= 0.98x DDP's).
3. **Recovery**: ``auto`` from ``--speeds``, and rank ``--slow-rank`` turns ``--slowdown`` times slower at global step
   ``--change-step`` (the stand-in's factor changes there), ``--after-change`` steps more. The reference is the best
   hand-set split at the new speeds (a grid search as in 1, then fitted ``--repeats`` times in turns with the
   recovery fits: its median step time ``T*``). Recovery steps: from the change to the first step whose time, and the
   median of the 5 steps from it, are within 10% of ``T*`` (goal <= 20; the worst of the fits). ``AutoSplit`` re-plans
   once the slowed rank's seconds per sample is off its plan's by more than ``drift_tolerance`` (0.2) in each of
   ``--drift-window`` steps; a step's time reaches it in the next step's all_reduce, and the sampler cuts a batch when
   its step begins (Lightning does not prefetch from a loader of known length), so the new plan runs from
   ``drift_window + 1`` steps after the change.

Ends with one line: ``auto_over_even=... auto_over_best=... overhead_vs_ddp=... recovery_steps=...``.

Usage: ``python benchmarks/bench_balanced_ddp.py [--speeds 1:2] [--ranks 4] [--seconds-per-sample 0.001]
[--repeats 3] [--quick]``
"""

from __future__ import annotations

import argparse
import itertools
import logging
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning
import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy, Strategy
from lightning.pytorch.utilities.warnings import PossibleUserWarning
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository root, for tests.distributed

from bench_ddp_overhead import timed_trainer

from lightning_balanced import AutoSplit, BalancedDDPStrategy, EvenSplit, SplitPolicy
from lightning_balanced.split_policies.split_policy import even_split
from tests.distributed import run_distributed

FEATURES, HIDDEN, CLASSES = 32, 64, 10
WITHIN = 1.10  # recovered: a step within 10% of the best hand-set split's step time
SETTLE = 5  # ... and the median of the steps from it
MAX_FINE = 40  # the most splits of the search's second stage


@dataclass(frozen=True)
class SlowDown:
    """Rank ``rank`` turns ``factor`` times slower from global step ``step`` on."""

    rank: int
    factor: float
    step: int


class StandInMLP(pl.LightningModule):
    """A tiny MLP whose ``training_step`` stands in for a GPU ``k_r`` times slower than the reference one.

    Before the forward pass of its share it sleeps ``k_r * seconds_per_sample * share``: the per-sample device time of
    a GPU-bound job (see the module docstring for what it does not model). ``shares`` records each step's share.
    """

    def __init__(self, speeds: Sequence[float], seconds_per_sample: float, change: SlowDown | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, CLASSES))
        self.speeds = list(speeds)
        self.seconds_per_sample = seconds_per_sample
        self.change = change
        self.shares: list[int] = []

    def factor(self) -> float:
        k = self.speeds[self.global_rank]
        change = self.change
        if change is not None and self.global_rank == change.rank and self.trainer.global_step >= change.step:
            k *= change.factor
        return k

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        self.shares.append(int(x.shape[0]))
        time.sleep(self.factor() * self.seconds_per_sample * x.shape[0])
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)


class StepClock(pl.Callback):
    """Each training step's wall time: from the previous step's ``on_train_batch_end`` to its own (the first step's
    from its ``on_train_batch_start``), so the fetch of the batches is in it."""

    def __init__(self) -> None:
        self.ends: list[float] = []
        self._start: float | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, *args: Any) -> None:
        if self._start is None:
            self._start = time.perf_counter()

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.ends.append(time.perf_counter())

    @property
    def times(self) -> list[float]:
        assert self._start is not None
        marks = [self._start, *self.ends]
        return [b - a for a, b in itertools.pairwise(marks)]


class Recorded(SplitPolicy):
    """Wraps a policy and records every plan it gives, in order: with one train loader and no validation, the plan of
    the ``i``-th training step is the ``i``-th. It forwards the strategy's observations (``AutoSplit`` learns as
    unwrapped)."""

    def __init__(self, policy: SplitPolicy) -> None:
        self.policy = policy
        self.plans: list[list[int]] = []

    def _plan(self, batch_size: int, num_devices: int) -> list[int]:
        plan = self.policy.plan(batch_size, num_devices)
        self.plans.append(plan)
        return plan

    def check_devices(self, num_devices: int) -> None:
        self.policy.check_devices(num_devices)

    def set_capacities(self, capacity_bytes: list[int | None]) -> None:
        self.policy.set_capacities(capacity_bytes)

    def observe(self, chunk_sizes: list[int], seconds: list[float], peak_bytes: list[int | None] | None = None) -> None:
        self.policy.observe(chunk_sizes, seconds, peak_bytes)

    def __str__(self) -> str:
        return str(self.policy)

    def __repr__(self) -> str:
        return repr(self.policy)


class Schedule(SplitPolicy):
    """The grid search's policy: the ``i``-th plan asked for is ``plans[i]`` (the last one after the end)."""

    def __init__(self, plans: list[list[int]]) -> None:
        self.plans = plans
        self._asked = 0

    def _plan(self, batch_size: int, num_devices: int) -> list[int]:
        plan = self.plans[min(self._asked, len(self.plans) - 1)]
        self._asked += 1
        assert sum(plan) == batch_size and len(plan) == num_devices, (plan, batch_size, num_devices)
        return list(plan)

    def __str__(self) -> str:
        return "a grid search's schedule"

    def __repr__(self) -> str:
        return f"Schedule({len(self.plans)} steps)"


@dataclass
class Measured:
    """One configuration's fits: the measured steps' times (s) pooled, each fit's whole list, and what auto planned."""

    batch: int
    steps: list[float] = field(default_factory=list)
    fits: list[list[float]] = field(default_factory=list)
    plans: list[list[list[int]]] = field(default_factory=list)  # per fit, each step's plan (a Recorded policy's)
    replans: list[int] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.steps)

    @property
    def throughput(self) -> float:
        return self.batch * len(self.steps) / sum(self.steps)


@dataclass
class Config:
    """How to fit one configuration: a fresh strategy, its DataLoader batch, the stand-in's speeds, its steps."""

    strategy: Callable[[], Strategy]
    batch: int
    speeds: list[float]
    steps: int
    change: SlowDown | None = None
    per_process: bool = False  # ``batch`` is each process's (DDP's), not the global one


def _quiet() -> None:
    """No Lightning info lines (devices, tips, the strategy's plan reports) and no warnings about workers."""
    # The standalone packages' loggers too: with pytorch_lightning installed, Lightning's info lines come through it.
    for name in ("lightning.pytorch", "lightning.fabric", "pytorch_lightning", "lightning_fabric"):
        logging.getLogger(name).setLevel(logging.WARNING)
    warnings.filterwarnings("ignore", category=PossibleUserWarning)
    warnings.filterwarnings("ignore", message=".*LeafSpec.*")  # torch 2.13 on Lightning's pytree helper


def _data(args: argparse.Namespace) -> TensorDataset:
    """The same samples on every rank, enough that no fit reaches a second epoch."""
    n = args.batch * 1000
    g = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn(n, FEATURES, generator=g), torch.randint(0, CLASSES, (n,), generator=g))


def _fit(
    config: Config, data: TensorDataset, args: argparse.Namespace, world_size: int
) -> tuple[StepClock, StandInMLP, Strategy]:
    pl.seed_everything(0, verbose=False)
    clock = StepClock()
    strategy = config.strategy()
    module = StandInMLP(config.speeds, args.seconds_per_sample, config.change)
    trainer = timed_trainer(
        clock,
        accelerator="cpu",
        devices=world_size,
        strategy=strategy,
        max_steps=config.steps,
        limit_val_batches=0,
    )
    trainer.fit(module, DataLoader(data, batch_size=config.batch, shuffle=True))
    if len(clock.times) != config.steps:
        raise RuntimeError(f"a fit ran {len(clock.times)} steps, asked {config.steps}")
    return clock, module, strategy


def _check_plans(plans: list[list[int]], module: StandInMLP, rank: int) -> None:
    """The plans recorded in order are the steps' plans: each step's share on this rank is its plan's."""
    ran = module.shares
    if [plan[rank] for plan in plans[: len(ran)]] != ran:
        raise RuntimeError(
            f"rank {rank}: the recorded plans do not match the steps' shares (the sampler asked for plans out of"
            f" step order): planned {[plan[rank] for plan in plans[: len(ran)]]}, ran {ran}"
        )


def _interleaved(
    configs: dict[str, Config], data: TensorDataset, args: argparse.Namespace, world_size: int, rounds: int
) -> dict[str, Measured]:
    """``rounds`` fits of each configuration, in turns (the order reversed every other round), steps pooled."""
    measured = {
        name: Measured(config.batch * world_size if config.per_process else config.batch)
        for name, config in configs.items()
    }
    rank = dist.get_rank()
    for round_index in range(rounds):
        names = list(configs) if round_index % 2 == 0 else list(reversed(configs))
        for name in names:
            clock, module, strategy = _fit(configs[name], data, args, world_size)
            times = clock.times
            into = measured[name]
            into.fits.append(times)
            into.steps += times[args.warmup :] if configs[name].change is None else []
            policy = getattr(strategy, "split", None)
            if isinstance(policy, Recorded):
                _check_plans(policy.plans, module, rank)
                into.plans.append(policy.plans[: len(times)])
                into.replans.append(getattr(policy.policy, "replans", 0))
    return measured


# ---- the grid search ----------------------------------------------------------------------------------------------
def _groups(speeds: Sequence[float]) -> list[list[int]]:
    """The ranks grouped by speed factor, fastest first: a group's ranks get equal shares in the search."""
    found: dict[float, list[int]] = {}
    for rank, k in enumerate(speeds):
        found.setdefault(k, []).append(rank)
    return [found[k] for k in sorted(found)]


def _split(shares: Sequence[int], groups: list[list[int]], batch: int) -> list[int] | None:
    """Each rank of ``groups[j]`` gets ``shares[j]``, the last (slowest) group the rest, evenly; ``None``: no such."""
    plan = [0] * sum(len(group) for group in groups)
    for group, share in zip(groups[:-1], shares, strict=True):
        if share < 1:
            return None
        for r in group:
            plan[r] = share
    rest = batch - sum(plan)
    if rest < len(groups[-1]):
        return None
    for r, share in zip(groups[-1], even_split(rest, len(groups[-1])), strict=True):
        plan[r] = share
    return plan


def _coarse_grid(batch: int, speeds: Sequence[float], step: int) -> list[list[int]]:
    groups = _groups(speeds)
    if len(groups) == 1:
        return [even_split(batch, len(speeds))]
    values = range(step, batch, step)
    plans = (_split(shares, groups, batch) for shares in itertools.product(values, repeat=len(groups) - 1))
    return [plan for plan in plans if plan is not None]


def _fine_grid(batch: int, speeds: Sequence[float], step: int, around: list[int]) -> list[list[int]]:
    """Every split within ``step`` samples of ``around`` (coarser strides when several groups would give too many)."""
    groups = _groups(speeds)
    if len(groups) == 1:
        return []
    free = len(groups) - 1
    stride = 1
    while (2 * ((step - 1) // stride) + 1) ** free > MAX_FINE:
        stride += 1
    reach = (step - 1) // stride
    offsets = [stride * k for k in range(-reach, reach + 1)]
    centre = [around[group[0]] for group in groups[:-1]]
    plans = (
        _split([c + o for c, o in zip(centre, offset, strict=True)], groups, batch)
        for offset in itertools.product(offsets, repeat=free)
    )
    return [plan for plan in plans if plan is not None]


def _sweep(
    candidates: list[list[int]], speeds: list[float], data: TensorDataset, args: argparse.Namespace, world_size: int
) -> list[float]:
    """Each candidate's median step time over ``args.block`` steps of one fit (after ``args.warmup`` even steps), as
    rank 0 measured it (every rank gets rank 0's, so that they pick the same winner)."""
    even = even_split(args.batch, world_size)
    plans = [even] * args.warmup + [plan for plan in candidates for _ in range(args.block)]
    policy = Schedule(plans)
    config = Config(
        lambda: BalancedDDPStrategy(split=policy, log_shares=args.log_shares), args.batch, speeds, len(plans)
    )
    clock, module, _ = _fit(config, data, args, world_size)
    _check_plans(plans, module, dist.get_rank())
    times = clock.times[args.warmup :]
    medians = [statistics.median(times[k * args.block : (k + 1) * args.block]) for k in range(len(candidates))]
    shared: list[Any] = [medians]
    dist.broadcast_object_list(shared, src=0)
    return list(shared[0])


def _search(
    speeds: list[float], data: TensorDataset, args: argparse.Namespace, world_size: int
) -> tuple[list[int], dict[tuple[int, ...], float]]:
    """The best hand-set split at ``speeds`` and every searched split's median step time."""
    searched: dict[tuple[int, ...], float] = {}
    coarse = _coarse_grid(args.batch, speeds, args.grid)
    searched.update(zip(map(tuple, coarse), _sweep(coarse, speeds, data, args, world_size), strict=True))
    winner = list(min(searched, key=searched.__getitem__))
    fine = [plan for plan in _fine_grid(args.batch, speeds, args.grid, winner) if tuple(plan) not in searched]
    if fine:
        searched.update(zip(map(tuple, fine), _sweep(fine, speeds, data, args, world_size), strict=True))
    return list(min(searched, key=searched.__getitem__)), searched


# ---- the ranks ----------------------------------------------------------------------------------------------------
def _auto(args: argparse.Namespace) -> Recorded:
    return Recorded(AutoSplit(profile_steps=args.profile_steps, warmup_steps=1, drift_window=args.drift_window))


def _rank(rank: int, world_size: int, args: argparse.Namespace) -> dict[str, Any]:
    _quiet()
    data = _data(args)
    speeds, batch, steps = args.speeds, args.batch, args.warmup + args.steps
    began = time.perf_counter()

    # 1. the split: even, auto and the best hand-set split at --speeds
    best, searched = _search(speeds, data, args, world_size)
    split = _interleaved(
        {
            "even": Config(
                lambda: BalancedDDPStrategy(split=EvenSplit(), log_shares=args.log_shares), batch, speeds, steps
            ),
            "auto": Config(
                lambda: BalancedDDPStrategy(split=_auto(args), log_shares=args.log_shares), batch, speeds, steps
            ),
            "best": Config(
                lambda: BalancedDDPStrategy(chunk_sizes=best, log_shares=args.log_shares), batch, speeds, steps
            ),
        },
        data,
        args,
        world_size,
        args.repeats,
    )
    split_s = time.perf_counter() - began

    # 2. the overhead against DDP, every rank at speed 1
    ones = [1.0] * world_size
    overhead = _interleaved(
        {
            "ddp": Config(DDPStrategy, batch // world_size, ones, steps, per_process=True),
            "balanced_ddp": Config(BalancedDDPStrategy, batch, ones, steps),
            "balanced_ddp log_shares=False": Config(lambda: BalancedDDPStrategy(log_shares=False), batch, ones, steps),
            "ddp_again": Config(DDPStrategy, batch // world_size, ones, steps, per_process=True),
        },
        data,
        args,
        world_size,
        args.rounds,
    )
    overhead_s = time.perf_counter() - began - split_s

    # 3. recovery: auto, one rank turns slower at --change-step; the reference is the best split at the new speeds
    change = SlowDown(args.slow_rank, args.slowdown, args.change_step)
    after = list(speeds)
    after[change.rank] *= change.factor
    best_after, searched_after = _search(after, data, args, world_size)
    recovery = _interleaved(
        {
            "best_after": Config(
                lambda: BalancedDDPStrategy(chunk_sizes=best_after, log_shares=args.log_shares), batch, after, steps
            ),
            "recovery": Config(
                lambda: BalancedDDPStrategy(split=_auto(args), log_shares=args.log_shares),
                batch,
                speeds,
                change.step + args.after_change,
                change,
            ),
        },
        data,
        args,
        world_size,
        args.repeats,
    )
    recovery_s = time.perf_counter() - began - split_s - overhead_s
    # Plain data back to the parent: this module is `__mp_main__` in the ranks, so its classes do not unpickle there.
    return {
        "best": best,
        "searched": searched,
        "split": _plain(split),
        "overhead": _plain(overhead),
        "after": after,
        "best_after": best_after,
        "searched_after": searched_after,
        "recovery": _plain(recovery),
        "seconds": (split_s, overhead_s, recovery_s),
    }


def _plain(measured: dict[str, Measured]) -> dict[str, dict[str, Any]]:
    return {name: vars(m) for name, m in measured.items()}


def _measured(plain: dict[str, dict[str, Any]]) -> dict[str, Measured]:
    return {name: Measured(**fields) for name, fields in plain.items()}


# ---- the report ---------------------------------------------------------------------------------------------------
def _ratio(speeds: Sequence[float]) -> str:
    return ":".join(f"{k:g}" for k in speeds)


def _ideal(batch: int, speeds: Sequence[float]) -> float:
    """Throughput of the perfect split over the even one, from the stand-in's sleep alone (no fixed cost per step)."""
    even = max(k * n for k, n in zip(speeds, even_split(batch, len(speeds)), strict=True))
    return even / (batch / sum(1.0 / k for k in speeds))


def _verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def _distinct(plans: list[list[int]]) -> str:
    return " ".join(str(list(plan)) for plan in dict.fromkeys(tuple(plan) for plan in plans))


def _recovery_steps(times: list[float], change: int, target: float) -> int | None:
    """Steps from ``change`` to the first step within 10% of ``target`` with the median of ``SETTLE`` from it too."""
    for step in range(change, len(times) - SETTLE + 1):
        if times[step] <= WITHIN * target and statistics.median(times[step : step + SETTLE]) <= WITHIN * target:
            return step - change
    return None


def _first_new_plan(plans: list[list[int]], change: int) -> tuple[int, list[int]] | None:
    """The first step from ``change`` on whose plan differs from the plan of the step before the change."""
    before = plans[change - 1]
    for step in range(change, len(plans)):
        if plans[step] != before:
            return step, plans[step]
    return None


def _report(args: argparse.Namespace, result: dict[str, Any], wall: float) -> None:
    ranks, batch, speeds = args.ranks, args.batch, args.speeds
    print(
        f"balanced_ddp on {ranks} gloo CPU processes, 1 torch thread each; tiny MLP, global batch {batch}; stand-in"
        f" device time {args.seconds_per_sample * 1e3:g} ms/sample x speed factor; {args.steps} measured steps after"
        f" {args.warmup} per fit; log_shares={args.log_shares} in parts 1 and 3 (torch {torch.__version__},"
        f" lightning {lightning.__version__})"
    )

    # 1. split
    split, best, searched = _measured(result["split"]), result["best"], result["searched"]
    even, auto, hand = split["even"], split["auto"], split["best"]
    print(
        f"\n1. split at speeds {_ratio(speeds)}: grid search over {len(searched)} splits ({args.block} steps each in"
        f" one fit, steps of {args.grid} samples, then within that of the winner): best"
        f" {best} at {searched[tuple(best)] * 1e3:.1f} ms (median); then {args.repeats} fits each, in turns"
    )
    print(f"{'policy':<10} {'plans':<28} {'median ms':>9} {'samples/s':>9} {'/ even':>7} {'/ best':>7}")
    rows = [
        ("even", even, str(even_split(batch, ranks))),
        ("auto", auto, _distinct([plans[-1] for plans in auto.plans])),  # each fit's last plan
        ("best", hand, str(best)),
    ]
    for name, measured, plans in rows:
        print(
            f"{name:<10} {plans:<28} {measured.median * 1e3:9.2f} {measured.throughput:9.1f}"
            f" {measured.throughput / even.throughput:7.3f} {measured.throughput / hand.throughput:7.3f}"
        )
    first = [next((i for i, plan in enumerate(plans) if plan != plans[0]), None) for plans in auto.plans]
    print(f"  auto's first plan ran from step {first} (of each fit); re-plans per fit {auto.replans}")
    auto_over_even = auto.throughput / even.throughput
    auto_over_best = auto.throughput / hand.throughput
    ideal = _ideal(batch, speeds)
    print(
        f"auto / even = {auto_over_even:.3f}  (goal >= 1.35; the stand-in's sleep alone gives {ideal:.3f})"
        f"  {_verdict(auto_over_even >= 1.35)}"
    )
    print(f"auto / best = {auto_over_best:.3f}  (goal >= 0.95)  {_verdict(auto_over_best >= 0.95)}")

    # 2. overhead
    overhead = _measured(result["overhead"])
    ddp = overhead["ddp"]
    print(
        f"\n2. overhead at speeds {_ratio([1] * ranks)}: global batch {batch} (ddp: {batch // ranks} per process),"
        f" {args.rounds} fits each, in turns"
    )
    print(f"{'configuration':<30} {'median ms':>9} {'samples/s':>9} {'step / ddp':>10} {'+ms / ddp':>9}")
    for name, measured in overhead.items():
        print(
            f"{name:<30} {measured.median * 1e3:9.2f} {measured.throughput:9.1f} {measured.median / ddp.median:10.3f}"
            f" {(measured.median - ddp.median) * 1e3:9.2f}"
        )
    overhead_vs_ddp = overhead["balanced_ddp"].median / ddp.median
    control = overhead["ddp_again"].median / ddp.median
    print(
        f"overhead_vs_ddp = {overhead_vs_ddp:.3f}  (step time balanced_ddp / ddp; goal <= 1.02: throughput >= 0.98x)"
        f"  {_verdict(overhead_vs_ddp <= 1.02)}; A/A control ddp_again / ddp = {control:.3f} (the noise floor)"
    )

    # 3. recovery
    runs = _measured(result["recovery"])
    recovery, reference = runs["recovery"], runs["best_after"]
    change = args.change_step
    target = reference.median
    print(
        f"\n3. recovery: auto at speeds {_ratio(speeds)}, rank {args.slow_rank} turns {args.slowdown:g}x slower at step"
        f" {change} (speeds {_ratio(result['after'])}), {args.after_change} steps more; best hand-set split there"
        f" {result['best_after']} (grid search over {len(result['searched_after'])}): {target * 1e3:.2f} ms (median of"
        f" {args.repeats} fits)"
    )
    print(f"{'fit':>3} {'plan before':<14} {'new plan (from step)':<24} {'re-plans':>8} {'recovery steps':>14}")
    worst: float = 0
    for index, (times, plans, replans) in enumerate(
        zip(recovery.fits, recovery.plans, recovery.replans, strict=True), start=1
    ):
        steps = _recovery_steps(times, change, target)
        found = _first_new_plan(plans, change)
        new = "none" if found is None else f"{found[1]} ({found[0]})"
        print(f"{index:>3} {plans[change - 1]!s:<14} {new:<24} {replans:>8} {'never' if steps is None else steps:>14}")
        worst = max(worst, float("inf") if steps is None else steps)
    times = recovery.fits[0]
    shown = range(max(change - 2, 0), min(change + 14, len(times)))
    print(f"  fit 1, steps {shown.start}..{shown.stop - 1} (ms): " + " ".join(f"{times[i] * 1e3:.0f}" for i in shown))
    recovery_steps = "never" if worst == float("inf") else f"{worst:.0f}"
    print(f"recovery_steps = {recovery_steps}  (worst of {args.repeats}; goal <= 20)  {_verdict(worst <= 20)}")
    split_s, overhead_s, recovery_s = result["seconds"]
    print(
        f"\nwall time {wall:.0f} s (parts 1/2/3 {split_s:.0f}/{overhead_s:.0f}/{recovery_s:.0f} s, the rest the spawn)"
    )
    print(
        f"auto_over_even={auto_over_even:.2f} auto_over_best={auto_over_best:.2f}"
        f" overhead_vs_ddp={overhead_vs_ddp:.2f} recovery_steps={recovery_steps}"
    )


def _speeds(text: str) -> list[float]:
    try:
        speeds = [float(k) for k in text.split(":")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--speeds takes factors like 1:2, got {text!r}") from None
    if any(not k > 0 for k in speeds):
        raise argparse.ArgumentTypeError(f"--speeds takes positive factors, got {text!r}")
    return speeds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--ranks", type=int, default=2, help="gloo CPU processes")
    parser.add_argument(
        "--speeds", type=_speeds, default=None, help="slowdown factor per rank, 1:2 (default; 1:1:2:2 on 4 ranks)"
    )
    parser.add_argument("--seconds-per-sample", type=float, default=0.001, help="the stand-in's device time per sample")
    parser.add_argument("--batch", type=int, default=64, help="the global batch")
    parser.add_argument("--warmup", type=int, default=10, help="steps of each fit before measuring")
    parser.add_argument("--steps", type=int, default=30, help="measured steps per fit")
    parser.add_argument("--repeats", type=int, default=3, help="fits of each split and of the recovery, in turns")
    parser.add_argument("--rounds", type=int, default=3, help="fits of each configuration of the overhead, in turns")
    parser.add_argument("--grid", type=int, default=8, help="the grid search's first step, in samples")
    parser.add_argument("--block", type=int, default=6, help="steps per split in the grid search")
    parser.add_argument("--profile-steps", type=int, default=3, help="AutoSplit's profile_steps")
    parser.add_argument("--drift-window", type=int, default=5, help="AutoSplit's drift_window")
    parser.add_argument("--slow-rank", type=int, default=1, help="the rank that turns slower in the recovery")
    parser.add_argument("--slowdown", type=float, default=2.0, help="how many times slower it turns")
    parser.add_argument("--change-step", type=int, default=50, help="the global step it turns slower at")
    parser.add_argument("--after-change", type=int, default=40, help="steps of the recovery fit after the change")
    parser.add_argument(
        "--no-log-shares",
        dest="log_shares",
        action="store_false",
        help="parts 1 and 3 with log_shares=False (the strategy's per-rank logging off; part 2 measures both)",
    )
    parser.add_argument("--quick", action="store_true", help="a smoke run (< 60 s): fewer steps, one fit each")
    args = parser.parse_args()
    if args.quick:
        args.warmup, args.steps, args.repeats, args.rounds, args.block = 6, 10, 1, 1, 3
        args.change_step, args.after_change = 20, 16
    if args.speeds is None:
        args.speeds = [1.0] * (args.ranks - 1) + [2.0] if args.ranks != 4 else [1.0, 1.0, 2.0, 2.0]
    if args.ranks < 2 or len(args.speeds) != args.ranks:
        parser.error(f"--speeds needs one factor per rank ({args.ranks}, at least 2), got {_ratio(args.speeds)}")
    if not 0 <= args.slow_rank < args.ranks or args.change_step <= args.warmup or args.after_change < SETTLE:
        parser.error("--slow-rank must be a rank, --change-step past --warmup, --after-change at least 5")
    if args.batch % args.ranks:
        parser.error("--batch must be a multiple of --ranks (DDP's per-process batch is batch / ranks)")
    began = time.perf_counter()
    results = run_distributed(_rank, args.ranks, args, timeout_s=1800)
    _report(args, results[0], time.perf_counter() - began)


if __name__ == "__main__":
    main()
