""":class:`AutoSplit`: a split policy that measures each device's speed (and memory) and splits the batch by it."""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence

import torch

from lightning_balanced.arguments import check_int, check_real
from lightning_balanced.ranks.reports import rank_zero_report
from lightning_balanced.split_policies.split_policy import NAMED_POLICIES, SplitPolicy, even_split, proportional_split

__all__ = ["AutoSplit", "memory_line"]


def _round_significant(value: float, digits: int = 3) -> float:
    """``value`` rounded to ``digits`` significant digits (``0.0`` stays ``0.0``)."""
    if value == 0.0 or not math.isfinite(value):
        return value
    return round(value, digits - 1 - math.floor(math.log10(abs(value))))


def memory_line(observations: Sequence[tuple[int, int]]) -> tuple[float, float]:
    """A device's memory as ``fixed + per_sample * samples`` bytes, from ``(samples, peak_bytes)`` observations.

    From the last two (of different sizes), the line through them (slope >= 0); from one, the conservative
    ``(0, peak / samples)``, which over-predicts any larger batch (it charges the fixed part to every sample), so a
    cap derived from it is never too large.

    Args:
        observations: ``(samples, peak_bytes)`` pairs, ``samples >= 1``, the last two of different sizes if two.

    Returns:
        ``(fixed_bytes, bytes_per_sample)``, both ``>= 0``.
    """
    if len(observations) == 1:
        ((n, b),) = observations
        return 0.0, b / n
    (n0, b0), (n1, b1) = observations[-2:]
    per_sample = max((b1 - b0) / (n1 - n0), 0.0)
    return max(b1 - per_sample * n1, 0.0), per_sample


class AutoSplit(SplitPolicy):
    """Chunk sizes proportional to each device's measured speed, capped by its memory, re-planned on drift.

    Before its first plan it splits evenly (:func:`even_split`). From the training steps it observes (the first
    ``warmup_steps`` excluded) it estimates each device's seconds per sample as the median of ``seconds / chunk_size``
    (chunks of 0 ignored), rounded to 3 significant digits so that timing jitter does not change a seeded run's plan:
    the plan is a pure function of the observations. After ``profile_steps`` measured steps it plans sizes proportional
    to speed (``1 / seconds_per_sample``) with largest-remainder rounding (exact sum; every device gets >= 1 sample when
    ``batch_size >= num_devices`` and it can hold one). With memory observations (``peak_bytes``) and a capacity per
    device (``capacity_bytes``, else what the strategy reads at setup: a GPU's total memory, a virtual device's
    emulated one), a device's chunk is capped at ``floor((memory_fraction * capacity - fixed) / per_sample)``, with
    ``fixed`` and ``per_sample`` bytes fitted to its peaks at its last two chunk sizes (from one chunk size,
    conservatively ``0`` and ``peak / chunk_size``), and the excess goes to the others in proportion to their speed.
    It re-plans only when a device's seconds per sample differs from the one its plan used by more than
    ``drift_tolerance`` (relative) in each of the last ``drift_window`` steps, all in the same direction (a lasting
    change of speed, never a spike), and then from the medians over those steps. Every plan is logged, one line per
    device, with a ``chunk_sizes=[...]`` line to pin it. A batch of another size (validation, test, predict, the last
    batch) gets the last plan's proportions.

    Replicas that share one physical device (several replicas on one GPU, told by :meth:`set_devices`) are planned as
    that one device: the device's time for a step is the longest of its replicas' times, its speed is its replicas'
    samples over that time, its memory the device's peak against those samples, capped by the device's whole capacity;
    and its replicas get equal chunks of its share. A replica's own time on a shared GPU cannot tell its speed: its
    CUDA events span the other replicas' work on the device too.

    Sources: the rounding is largest-remainder (Hamilton) apportionment; measuring each part's time and memory before
    splitting follows torchgpipe's ``balance_by_time`` / ``balance_by_size`` (Kim et al., 2020, arXiv:2004.09910),
    applied here to data-parallel chunks instead of pipeline partitions.

    Args:
        profile_steps (int): measured steps before the first plan, >= 1.
        memory_fraction (float): the share of each device's capacity a chunk may use, in (0, 1].
        drift_tolerance (float): relative change of a device's seconds per sample that re-plans, > 0.
        drift_window (int): consecutive steps the change must last to re-plan (and the steps the new plan is
            measured on), >= 1.
        warmup_steps (int): first observed steps ignored (compilation, allocator warm-up), >= 0.
        capacity_bytes (Sequence[int], optional): memory per device in bytes; ``None``: the devices' own (see above),
            no cap where unknown.

    Raises:
        TypeError, ValueError: an argument of the wrong type or out of range, naming it
            (:mod:`lightning_balanced.arguments`).
    """

    def __init__(
        self,
        profile_steps: int = 5,
        memory_fraction: float = 0.9,
        drift_tolerance: float = 0.2,
        drift_window: int = 20,
        warmup_steps: int = 1,
        capacity_bytes: Sequence[int] | None = None,
    ) -> None:
        self.profile_steps = check_int("profile_steps", profile_steps, minimum=1)
        self.memory_fraction = check_real("memory_fraction", memory_fraction, positive=True, maximum=1.0)
        self.drift_tolerance = check_real("drift_tolerance", drift_tolerance, positive=True)
        self.drift_window = check_int("drift_window", drift_window, minimum=1)
        self.warmup_steps = check_int("warmup_steps", warmup_steps, minimum=0)
        self.capacity_bytes = (
            None
            if capacity_bytes is None
            else [check_int(f"capacity_bytes[{i}]", c, minimum=1) for i, c in enumerate(capacity_bytes)]
        )
        self._seen = 0
        self._window: deque[tuple[list[int], list[float]]] = deque(maxlen=max(self.drift_window, self.profile_steps))
        self._memory: list[list[tuple[int, int]]] = []
        self._capacities: list[int | None] | None = None if self.capacity_bytes is None else [*self.capacity_bytes]
        self._planned: list[int] | None = None
        self._planned_speeds: list[float] | None = None
        self._batch_size = 0
        self._groups: list[list[int]] = []
        self.replans = 0

    def set_capacities(self, capacity_bytes: list[int | None]) -> None:
        """Each device's memory in bytes, from the strategy at setup; ``capacity_bytes`` given here takes precedence."""
        if self.capacity_bytes is None and any(c is not None for c in capacity_bytes):
            self._capacities = list(capacity_bytes)

    def set_devices(self, devices: Sequence[torch.device]) -> None:
        """Learn which replicas share one physical device, once at setup, before the first plan.

        Replicas given the same device (``parallel_devices=[cuda:0, cuda:0]``: one GPU, a stream per replica) run side
        by side on it, so the CUDA events of each replica's stream time the other replicas' work on the device as well:
        between two identical replicas they measure which one started first, not a speed (on an H100, identical
        replicas measured 1.11e-5 and 1.73e-5 s/sample and were planned ``[156, 100]``). So each group of replicas on
        one device is planned as the device (see the class docstring): in every step it observes, each replica of a
        group of ``k`` that ran ``n`` samples is taken to have run at ``k * T / N`` seconds per sample, where ``N`` is
        the samples of the group's replicas that ran and ``T`` the longest of their times (their streams start
        together after the scatter, so the longest spans the device's work on all ``N``): equal seconds per sample in
        the group, equal chunks, and the group's total in proportion to the device's speed. Distinct devices (two
        GPUs, the CPU emulation's virtual devices ``cpu:0``, ``cpu:1``, ...) are timed each on its own, as without it.

        Args:
            devices (Sequence[torch.device | str]): one device per replica, in replica order, with its index
                (``cuda:0``, not ``cuda``), as the strategy runs them.

        Raises:
            TypeError, RuntimeError: an entry that is not a device (``torch.device``'s own errors).
        """
        found: dict[torch.device, list[int]] = {}
        for index, device in enumerate(devices):
            found.setdefault(torch.device(device), []).append(index)
        self._groups = [group for group in found.values() if len(group) > 1]

    @property
    def shared_devices(self) -> list[list[int]]:
        """The groups of replica indices that share one device (from :meth:`set_devices`); ``[]`` when none do."""
        return [list(group) for group in self._groups]

    def _group(self, device: int, num_devices: int) -> list[int]:
        """The replicas (below ``num_devices``) on ``device``'s physical device, ``device`` itself included."""
        for group in self._groups:
            if device in group:
                return [i for i in group if i < num_devices]
        return [device]

    def _device_seconds(self, chunk_sizes: Sequence[int], seconds: Sequence[float]) -> list[float]:
        """``seconds`` with each shared device's time apportioned to its replicas (see :meth:`set_devices`).

        Pure: for every group of replicas on one device, those that ran (``chunk_sizes[i] > 0``), ``N`` samples in
        all, get ``chunk_sizes[i] * k * T / N`` seconds, with ``T`` the longest of their seconds and ``k`` the replicas
        of the group; every other entry is returned as it is.
        """
        out = [float(s) for s in seconds]
        for group in self._groups:
            members = [i for i in group if i < len(chunk_sizes)]
            ran = [i for i in members if chunk_sizes[i] > 0]
            if not ran:
                continue
            per_sample = max(out[i] for i in ran) * len(members) / sum(chunk_sizes[i] for i in ran)
            for i in ran:
                out[i] = per_sample * chunk_sizes[i]
        return out

    def _device_memory(
        self, device: int, chunk_sizes: Sequence[int], peak_bytes: Sequence[int | None]
    ) -> tuple[int, int]:
        """``(samples, peak)`` of ``device``'s physical device in a step: a shared one's, over all its replicas."""
        ran = [i for i in self._group(device, len(chunk_sizes)) if chunk_sizes[i] > 0]
        peaks = [int(b) for i in ran if (b := peak_bytes[i]) is not None]
        return sum(chunk_sizes[i] for i in ran), max(peaks)

    def observe(self, chunk_sizes: list[int], seconds: list[float], peak_bytes: list[int | None] | None = None) -> None:
        """Record one training step; re-plan at the end of profiling or on drift (see the class docstring).

        Args:
            chunk_sizes (list[int]): samples per device in the step.
            seconds (list[float]): each device's step time in seconds.
            peak_bytes (list[int | None], optional): each device's peak memory in the step, in bytes (``None``:
                unknown).

        Raises:
            ValueError: a (re-)plan finds that the batch cannot fit in the devices' memory caps, whatever the split:
                the message names each device, its capacity, its predicted need and how many samples it can hold.
        """
        self._seen += 1
        if self._seen <= self.warmup_steps:
            return
        self._window.append((list(chunk_sizes), self._device_seconds(chunk_sizes, seconds)))
        if peak_bytes is not None:
            if not self._memory:
                self._memory = [[] for _ in chunk_sizes]
            for i, (n, b) in enumerate(zip(chunk_sizes, peak_bytes, strict=True)):
                if n > 0 and b is not None:
                    # A shared device's peak is the whole device's: against the samples of all its replicas.
                    samples, peak = self._device_memory(i, chunk_sizes, peak_bytes)
                    if not self._memory[i] or self._memory[i][-1][0] != samples:
                        self._memory[i] = [*self._memory[i][-1:], (samples, peak)]
        total = sum(chunk_sizes)
        measured = self._seen - self.warmup_steps
        if self._planned_speeds is None:
            if measured >= self.profile_steps:
                self._replan(total, len(chunk_sizes), f"after {measured} profiled steps")
            return
        recent = self.seconds_per_sample(len(chunk_sizes), self.drift_window)
        drifted = [
            f"device {i} {p:.3g} -> {r:.3g} s/sample"
            for i, (r, p) in enumerate(zip(recent, self._planned_speeds, strict=True))
            if r is not None and self._sustained_drift(i, p)
        ]
        if drifted:
            self._replan(total, len(chunk_sizes), f"on drift ({', '.join(drifted)})")

    def _sustained_drift(self, device: int, planned: float) -> bool:
        """Whether ``device``'s last ``drift_window`` steps are all off ``planned`` s/sample, in the same direction.

        Off means by more than ``drift_tolerance`` (relative): a change of speed, not a spike of noise.
        """
        steps = list(self._window)[-self.drift_window :]
        rates = [s[device] / n[device] for n, s in steps if device < len(n) and n[device] > 0]
        if len(rates) < self.drift_window:
            return False
        bound = self.drift_tolerance * planned
        return all(r > planned + bound for r in rates) or all(r < planned - bound for r in rates)

    def seconds_per_sample(self, num_devices: int, last: int | None = None) -> list[float | None]:
        """Each device's median ``seconds / chunk_size`` over the last ``last`` steps, to 3 significant digits.

        For replicas that share a device, the seconds apportioned from the device's time (see :meth:`set_devices`).
        """
        steps = list(self._window)[-(last or len(self._window)) :]
        out: list[float | None] = []
        for i in range(num_devices):
            rates = [s[i] / n[i] for n, s in steps if i < len(n) and n[i] > 0]
            out.append(_round_significant(statistics.median(rates)) if rates else None)
        return out

    def _memory_model(self, device: int) -> tuple[float, float] | None:
        """``(fixed_bytes, bytes_per_sample)`` of ``device`` (:func:`memory_line` of its observations), or ``None``.

        For replicas that share a device, the device's: its peaks against the samples of all its replicas.
        """
        if not self._memory or not self._memory[device]:
            return None
        return memory_line(self._memory[device])

    def _replan(self, batch_size: int, num_devices: int, reason: str) -> None:
        rates = self.seconds_per_sample(num_devices, self.drift_window)
        known = [r for r in rates if r is not None and r > 0]
        fallback = statistics.median(known) if known else 1.0
        rates_used = [r if r is not None and r > 0 else fallback for r in rates]
        self._planned_speeds = rates_used
        self._batch_size = batch_size
        self._planned = self._split(batch_size, [1.0 / r for r in rates_used])
        self.replans += 1
        lines = [f"AutoSplit plan {self.replans}, {reason}: a batch of {batch_size} as {self._planned}"]
        for i, (n, r) in enumerate(zip(self._planned, rates_used, strict=True)):
            model = self._memory_model(i)
            memory = "" if model is None else f", {model[1]:.0f} B/sample + {model[0]:.0f} B fixed"
            group = self._group(i, num_devices)
            shared = f", one device with devices {group}" if len(group) > 1 else ""
            lines.append(f"  device {i}: {n} samples, {r:.3g} s/sample{memory}{shared}")
        lines.append(f"  to pin it: chunk_sizes={self._planned}")
        rank_zero_report("\n".join(lines))

    def _capacity(self, device: int, num_devices: int) -> int | None:
        """The capacity of ``device``'s physical device: the sum of its replicas' shares; ``None`` if one is unknown."""
        capacities = self._capacities
        if capacities is None:
            return None
        shares = [capacities[i] if i < len(capacities) else None for i in self._group(device, num_devices)]
        return None if any(share is None for share in shares) else sum(share for share in shares if share is not None)

    def _caps(self, num_devices: int) -> list[int | None]:
        """The most samples each device can hold, ``None`` where its capacity or its memory model is unknown.

        A device that replicas share holds its samples in equal parts (:func:`even_split`) for its replicas.
        """
        caps: list[int | None] = []
        for i in range(num_devices):
            model = self._memory_model(i)
            capacity = self._capacity(i, num_devices)
            if model is None or capacity is None or model[1] <= 0:
                caps.append(None)
            else:
                held = max(math.floor((self.memory_fraction * capacity - model[0]) / model[1]), 0)
                group = self._group(i, num_devices)
                caps.append(even_split(held, len(group))[group.index(i)])
        return caps

    def _split(self, batch_size: int, speeds: list[float]) -> list[int]:
        """Largest-remainder sizes by ``speeds``, capped by memory, >= 1 per device that can hold one when possible."""
        caps = self._caps(len(speeds))
        open_ = [c is None or c > 0 for c in caps]
        sizes = [0] * len(speeds)
        rest = batch_size
        while rest > 0:
            active = [i for i in range(len(speeds)) if open_[i]]
            if not active:
                self._raise_infeasible(batch_size, len(speeds))
            share = proportional_split(rest, [speeds[i] for i in active])
            if batch_size >= len(speeds):
                for k, i in enumerate(active):
                    if sizes[i] == 0 and share[k] == 0 and rest >= len(active):
                        donor = max(range(len(active)), key=lambda j: share[j])
                        share[donor] -= 1
                        share[k] += 1
            rest = 0
            for k, i in enumerate(active):
                cap = caps[i]
                add = share[k] if cap is None else min(share[k], cap - sizes[i])
                sizes[i] += add
                rest += share[k] - add
                if cap is not None and sizes[i] >= cap:
                    open_[i] = False
        return sizes

    def _raise_infeasible(self, batch_size: int, num_devices: int) -> None:
        assert self._capacities is not None
        caps = self._caps(num_devices)
        parts = []
        for i, cap in enumerate(caps):
            fixed, per_sample = self._memory_model(i) or (0.0, 0.0)
            group = self._group(i, num_devices)
            capacity = f"{self._capacities[i]} B"
            if len(group) > 1:
                capacity = f"{self._capacity(i, num_devices)} B (one device with devices {group})"
            parts.append(
                f"device {i}: capacity {capacity} x memory_fraction {self.memory_fraction}, predicted"
                f" {fixed:.0f} B + {per_sample:.0f} B/sample: at most {cap} samples"
            )
        need = min(
            (
                fixed + per_sample * batch_size
                for fixed, per_sample in filter(None, map(self._memory_model, range(num_devices)))
            ),
            default=0.0,
        )
        raise ValueError(
            f"AutoSplit: a batch of {batch_size} does not fit in the devices' memory whatever the split: they hold at"
            f" most {sum(c or 0 for c in caps)} samples ({'; '.join(parts)}); the whole batch on the cheapest device"
            f" would need {need:.0f} B. Lower the batch size, raise `memory_fraction`, or add devices"
        )

    def _plan(self, batch_size: int, num_devices: int) -> list[int]:
        if self._planned is None or self._planned_speeds is None or len(self._planned) != num_devices:
            return even_split(batch_size, num_devices)
        if batch_size == self._batch_size:
            return list(self._planned)
        if not any(self._planned):
            return even_split(batch_size, num_devices)
        return proportional_split(batch_size, self._planned)

    def __str__(self) -> str:
        return 'chunk_sizes="auto"'

    def __repr__(self) -> str:
        return (
            f"AutoSplit(profile_steps={self.profile_steps}, memory_fraction={self.memory_fraction},"
            f" drift_tolerance={self.drift_tolerance}, drift_window={self.drift_window})"
        )


NAMED_POLICIES["auto"] = AutoSplit  # chunk_sizes="auto"
