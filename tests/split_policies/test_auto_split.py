"""AutoSplit's pure logic on synthetic observations: speed split, memory cap, drift vs noise, determinism, errors."""

from __future__ import annotations

import logging
import random

import pytest

from lightning_balanced import AutoSplit
from tests.helpers import raises_exactly


def _feed(
    policy: AutoSplit, steps: int, per_sample: list[float], batch: int, jitter: float = 0.0, seed: int = 0
) -> None:
    rng = random.Random(seed)
    for _ in range(steps):
        sizes = policy.plan(batch, len(per_sample))
        seconds = [n * r * (1 + rng.uniform(-jitter, jitter)) for n, r in zip(sizes, per_sample, strict=True)]
        policy.observe(sizes, seconds)


def test_even_before_profiling_then_speed_proportional() -> None:
    policy = AutoSplit(profile_steps=3)
    assert policy.plan(30, 2) == [15, 15]
    _feed(policy, 4, [0.02, 0.01], 30)
    assert policy.plan(30, 2) == [10, 20]


def test_three_devices_sum_exact_and_never_zero() -> None:
    policy = AutoSplit(profile_steps=2)
    _feed(policy, 3, [1.0, 1.0, 1000.0], 10)
    sizes = policy.plan(10, 3)
    assert sum(sizes) == 10 and min(sizes) >= 1


def test_other_batch_size_uses_last_plan_proportions() -> None:
    policy = AutoSplit(profile_steps=2)
    _feed(policy, 3, [0.02, 0.01], 30)
    assert policy.plan(9, 2) == [3, 6]


def test_noise_does_not_replan_but_drift_does() -> None:
    policy = AutoSplit(profile_steps=3, drift_window=5)
    _feed(policy, 4, [0.01, 0.01], 20)
    assert policy.replans == 1
    _feed(policy, 30, [0.01, 0.01], 20, jitter=0.1, seed=1)
    assert policy.replans == 1
    _feed(policy, 10, [0.03, 0.01], 20)
    assert policy.replans >= 2
    assert policy.plan(20, 2) == [5, 15]


def test_plan_is_deterministic_despite_jitter_below_rounding() -> None:
    plans = []
    for seed in (0, 1):
        policy = AutoSplit(profile_steps=3)
        _feed(policy, 4, [0.02, 0.01], 30, jitter=1e-5, seed=seed)
        plans.append(policy.plan(30, 2))
    assert plans[0] == plans[1] == [10, 20]


def test_memory_cap_binds_and_excess_goes_to_others() -> None:
    policy = AutoSplit(profile_steps=2, warmup_steps=0, memory_fraction=0.5, capacity_bytes=[2000, 10**9])
    for sizes in ([20, 20], [22, 18]):
        policy.observe(sizes, [n * 0.01 for n in sizes], peak_bytes=[100 + 50 * n for n in sizes])
    # Equal speeds plan [20, 20], but device 0 holds floor((0.5 * 2000 - 100) / 50) = 18 samples at most.
    assert policy.plan(40, 2) == [18, 22]


def test_one_memory_observation_caps_conservatively() -> None:
    # One chunk size only: fixed bytes unknown, so all of the peak is charged per sample (1100 / 20 = 55 B).
    policy = AutoSplit(profile_steps=1, warmup_steps=0, memory_fraction=0.5, capacity_bytes=[2000, 10**9])
    policy.observe([20, 20], [0.2, 0.2], peak_bytes=[1100, 1100])
    assert policy.plan(40, 2) == [18, 22]  # floor(1000 / 55) = 18


def test_capacities_from_the_strategy_unless_given() -> None:
    policy = AutoSplit(profile_steps=2, warmup_steps=0, memory_fraction=0.5)
    policy.set_capacities([2000, None])
    for sizes in ([20, 20], [22, 18]):
        policy.observe(sizes, [n * 0.01 for n in sizes], peak_bytes=[100 + 50 * sizes[0], None])
    assert policy.plan(40, 2) == [18, 22]
    given = AutoSplit(profile_steps=2, warmup_steps=0, memory_fraction=0.5, capacity_bytes=[10**9, 10**9])
    given.set_capacities([2000, None])
    for sizes in ([20, 20], [22, 18]):
        given.observe(sizes, [n * 0.01 for n in sizes], peak_bytes=[100 + 50 * sizes[0], None])
    assert given.plan(40, 2) == [20, 20]


def test_infeasible_batch_raises_naming_each_device() -> None:
    policy = AutoSplit(profile_steps=2, warmup_steps=0, memory_fraction=0.5, capacity_bytes=[2000, 2000])
    policy.observe([20, 20], [0.2, 0.2], peak_bytes=[1100, 1100])
    with raises_exactly(
        ValueError,
        "AutoSplit: a batch of 40 does not fit in the devices' memory whatever the split: they hold at most 36 samples"
        " (device 0: capacity 2000 B x memory_fraction 0.5, predicted 100 B + 50 B/sample: at most 18 samples;"
        " device 1: capacity 2000 B x memory_fraction 0.5, predicted 100 B + 50 B/sample: at most 18 samples); the"
        " whole batch on the cheapest device would need 2100 B. Lower the batch size, raise `memory_fraction`, or add"
        " devices",
    ):
        policy.observe([22, 18], [0.22, 0.18], peak_bytes=[1200, 1000])


def test_each_plan_is_logged_with_the_line_to_pin_it(caplog: pytest.LogCaptureFixture) -> None:
    policy = AutoSplit(profile_steps=2)
    with caplog.at_level(logging.INFO):
        _feed(policy, 3, [0.02, 0.01], 30)
    assert caplog.messages == [
        "AutoSplit plan 1, after 2 profiled steps: a batch of 30 as [10, 20]\n"
        "  device 0: 10 samples, 0.02 s/sample\n"
        "  device 1: 20 samples, 0.01 s/sample\n"
        "  to pin it: chunk_sizes=[10, 20]"
    ]


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"profile_steps": 0}, ValueError, "`profile_steps` must be >= 1, got 0"),
        ({"memory_fraction": 1.5}, ValueError, "`memory_fraction` must be positive and <= 1.0 and finite, got 1.5"),
        ({"drift_tolerance": 0}, ValueError, "`drift_tolerance` must be positive and finite, got 0"),
        ({"drift_window": 2.5}, TypeError, "`drift_window` must be an integer, got 2.5 of type float"),
    ],
)
def test_argument_errors(kwargs: dict, error: type[Exception], message: str) -> None:
    with raises_exactly(error, message):
        AutoSplit(**kwargs)


def test_chunk_sizes_auto_is_autosplit_and_exclusive_with_gpu0_bsz() -> None:
    from lightning_balanced.split_policies import split_policy

    assert isinstance(split_policy(chunk_sizes="auto"), AutoSplit)
    with raises_exactly(
        ValueError, "Give at most one of `gpu0_bsz`, `chunk_sizes` and `weights`, got gpu0_bsz and chunk_sizes"
    ):
        split_policy(gpu0_bsz=2, chunk_sizes="auto")
