"""The learning-rate scaling policy and how it touches optimizers and schedulers (single process)."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.optim import SGD, AdamW, Optimizer
from torch.optim import lr_scheduler as sched

from lightning_balanced.batch_scaling.factor_check import stored_lr_scale_factors
from lightning_balanced.batch_scaling.lr_scaling import (
    LR_SCALE_FACTOR_KEY,
    applied_lr_scale_factor,
    effective_batch_size,
    lr_scale_factor,
    rescale_learning_rates,
    unscale_learning_rates,
    warmup_multiplier,
)
from tests.helpers import whole_message

# Scaling multiplies every learning-rate quantity once; a schedule then does the same float operations on scaled
# inputs, so the scaled trajectory equals factor x the unscaled one up to a few ulps (relative 1e-12 is generous).
CLOSE = {"rel": 1e-12, "abs": 0.0}


def _optimizer(kind: type[Optimizer] = SGD) -> Optimizer:
    """Two param groups with different learning rates, so per-group ratios are checked."""
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    return kind([{"params": [a], "lr": 0.1}, {"params": [b], "lr": 0.01}], lr=0.1)


SCHEDULERS: dict[str, Callable[[Optimizer], Any]] = {
    "StepLR": lambda o: sched.StepLR(o, step_size=2, gamma=0.5),
    "CosineAnnealingLR": lambda o: sched.CosineAnnealingLR(o, T_max=7, eta_min=1e-3),
    "LambdaLR": lambda o: sched.LambdaLR(o, lambda epoch: 1.0 / (1 + epoch)),
    "OneCycleLR": lambda o: sched.OneCycleLR(o, max_lr=[0.4, 0.04], total_steps=12),
    "SequentialLR": lambda o: sched.SequentialLR(
        o,
        [sched.LinearLR(o, start_factor=0.1, total_iters=3), sched.CosineAnnealingLR(o, T_max=6, eta_min=1e-4)],
        milestones=[3],
    ),
    "ReduceLROnPlateau": lambda o: sched.ReduceLROnPlateau(o, factor=0.5, patience=0, min_lr=1e-3),
}


def _trajectory(optimizer: Optimizer, scheduler: Any, steps: int) -> list[list[float]]:
    lrs = [[g["lr"] for g in optimizer.param_groups]]
    for step in range(steps):
        optimizer.step()
        if isinstance(scheduler, sched.ReduceLROnPlateau):
            scheduler.step(1.0)  # never improves: the LR drops every step down to min_lr
        else:
            scheduler.step()
        lrs.append([g["lr"] for g in optimizer.param_groups])
        del step
    return lrs


# torch 2.4's SequentialLR steps its own schedulers with an epoch at a milestone and warns about that itself.
@pytest.mark.filterwarnings("ignore:The epoch parameter in `scheduler.step\\(\\)`:UserWarning:torch\\.optim")
@pytest.mark.parametrize("name", list(SCHEDULERS))
@pytest.mark.parametrize("policy", ["linear", "sqrt"])
def test_scaled_schedule_is_factor_times_the_unscaled_one(name: str, policy: str) -> None:
    factor = lr_scale_factor(policy, effective_batch_size(32, 4, 2), 32)
    assert factor == (8.0 if policy == "linear" else math.sqrt(8.0))
    reference_opt = _optimizer()
    reference = _trajectory(reference_opt, SCHEDULERS[name](reference_opt), steps=10)

    optimizer = _optimizer()
    scheduler = SCHEDULERS[name](optimizer)
    assert rescale_learning_rates(optimizer, [scheduler], factor) == factor
    scaled = _trajectory(optimizer, scheduler, steps=10)
    for step, (got, expected) in enumerate(zip(scaled, reference, strict=True)):
        assert got == pytest.approx([factor * lr for lr in expected], **CLOSE), f"step {step}"
    assert scaled[0][0] / scaled[0][1] == pytest.approx(reference[0][0] / reference[0][1], **CLOSE)


def test_rescaling_is_idempotent_and_stored_in_the_optimizer_state() -> None:
    optimizer = _optimizer(AdamW)
    scheduler = sched.CosineAnnealingLR(optimizer, T_max=5)
    rescale_learning_rates(optimizer, [scheduler], 4.0)
    before = [g["lr"] for g in optimizer.param_groups]
    assert rescale_learning_rates(optimizer, [scheduler], 4.0) == 1.0
    assert [g["lr"] for g in optimizer.param_groups] == before
    assert [g[LR_SCALE_FACTOR_KEY] for g in optimizer.state_dict()["param_groups"]] == [4.0, 4.0]


def test_resume_on_another_world_size_rescales_by_new_over_old() -> None:
    # a run on 4 processes saved its state; it resumes on 2
    saved_opt = _optimizer()
    saved_sched = SCHEDULERS["OneCycleLR"](saved_opt)
    rescale_learning_rates(saved_opt, [saved_sched], 4.0)
    _trajectory(saved_opt, saved_sched, steps=3)
    opt_state, sched_state = saved_opt.state_dict(), saved_sched.state_dict()

    resumed_opt = _optimizer()
    resumed_sched = SCHEDULERS["OneCycleLR"](resumed_opt)
    resumed_opt.load_state_dict(opt_state)
    resumed_sched.load_state_dict(sched_state)
    assert applied_lr_scale_factor(resumed_opt) == 4.0
    assert rescale_learning_rates(resumed_opt, [resumed_sched], 2.0) == 0.5

    reference_opt = _optimizer()
    reference = _trajectory(reference_opt, SCHEDULERS["OneCycleLR"](reference_opt), steps=8)
    resumed = _trajectory(resumed_opt, resumed_sched, steps=5)
    for got, expected in zip(resumed, reference[3:], strict=True):
        assert got == pytest.approx([2.0 * lr for lr in expected], **CLOSE)


def _two_group_sgd(lr_kind: str) -> tuple[Optimizer, list[torch.nn.Parameter], list[float]]:
    """SGD over two param groups whose learning rates are floats, one tensor shared by both, or a tensor per group."""
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))
    if lr_kind == "float":
        return SGD([{"params": [a]}, {"params": [b], "lr": 0.01}], lr=0.1), [a, b], [0.1, 0.01]
    if lr_kind == "tensor shared by the groups":  # torch gives every group the same default-LR object
        return SGD([{"params": [a]}, {"params": [b]}], lr=torch.tensor(0.1)), [a, b], [0.1, 0.1]
    assert lr_kind == "tensor per group"
    groups = [{"params": [a], "lr": torch.tensor(0.1)}, {"params": [b], "lr": torch.tensor(0.01)}]
    return SGD(groups, lr=0.5), [a, b], [0.1, 0.01]


# float32 tensors hold 0.1 and 0.01 to ~6e-8 relative; 1e-6 allows that, and a double scaling is off by 100%.
@pytest.mark.parametrize("lr_kind", ["float", "tensor shared by the groups", "tensor per group"])
def test_each_learning_rate_is_scaled_exactly_once_whatever_its_type(lr_kind: str) -> None:
    optimizer, params, base = _two_group_sgd(lr_kind)
    given = [group["lr"] for group in optimizer.param_groups]  # the caller's objects
    scheduler = sched.StepLR(optimizer, step_size=1, gamma=0.5)  # holds them again in initial_lr and base_lrs
    assert rescale_learning_rates(optimizer, [scheduler], 2.0) == 2.0

    scaled = [2 * lr for lr in base]
    assert [float(g["lr"]) for g in optimizer.param_groups] == pytest.approx(scaled, rel=1e-6)
    assert [float(g["initial_lr"]) for g in optimizer.param_groups] == pytest.approx(scaled, rel=1e-6)
    assert [float(lr) for lr in scheduler.base_lrs] == pytest.approx(scaled, rel=1e-6)
    assert [float(lr) for lr in given] == pytest.approx(base, rel=1e-6)  # nothing was multiplied in place
    if lr_kind != "float":
        assert all(isinstance(g["lr"], torch.Tensor) for g in optimizer.param_groups)  # the type is kept

    # SGD without momentum moves each parameter by -lr * grad: the step uses the scaled rate, once.
    for param in params:
        param.grad = torch.ones_like(param)
    optimizer.step()
    assert [p[0].item() for p in params] == pytest.approx([-lr for lr in scaled], rel=1e-6)
    scheduler.step()  # StepLR halves from the scaled rate, not from the caller's
    assert [float(g["lr"]) for g in optimizer.param_groups] == pytest.approx([lr / 2 for lr in scaled], rel=1e-6)


def test_unscaling_restores_the_base_learning_rates_of_a_restored_state() -> None:
    # A state written under factor 4 (e.g. an LR-scaled DDP run on 4 processes), restored where nothing manages it.
    saved = _optimizer()
    saved_scheduler = SCHEDULERS["StepLR"](saved)
    rescale_learning_rates(saved, [saved_scheduler], 4.0)
    restored = _optimizer()
    restored_scheduler = SCHEDULERS["StepLR"](restored)
    other = _optimizer()
    other_scheduler = SCHEDULERS["StepLR"](other)  # attached to another optimizer: must be left alone
    restored.load_state_dict(saved.state_dict())
    restored_scheduler.load_state_dict(saved_scheduler.state_dict())
    assert [g["lr"] for g in restored.param_groups] == pytest.approx([0.4, 0.04], **CLOSE)

    assert unscale_learning_rates(restored, [restored_scheduler, other_scheduler]) == 4.0
    assert [g["lr"] for g in restored.param_groups] == pytest.approx([0.1, 0.01], **CLOSE)
    assert restored_scheduler.base_lrs == pytest.approx([0.1, 0.01], **CLOSE)
    assert other_scheduler.base_lrs == pytest.approx([0.1, 0.01], **CLOSE)
    assert applied_lr_scale_factor(restored) == 1.0
    assert unscale_learning_rates(restored, [restored_scheduler]) == 1.0  # a second call changes nothing
    assert [g["lr"] for g in restored.param_groups] == pytest.approx([0.1, 0.01], **CLOSE)


def test_stored_factors_are_read_from_a_checkpoints_optimizer_states() -> None:
    scaled, unscaled, plain = _optimizer(), _optimizer(), _optimizer()
    rescale_learning_rates(scaled, [], 1.5)
    rescale_learning_rates(unscaled, [], 1.0)
    checkpoint = {"optimizer_states": [plain.state_dict(), scaled.state_dict(), unscaled.state_dict()]}
    assert stored_lr_scale_factors(checkpoint) == {1: 1.5}
    assert stored_lr_scale_factors({"state_dict": {}}) == {}  # a weights-only checkpoint


def test_groups_that_disagree_on_the_stored_factor_raise() -> None:
    optimizer = _optimizer()
    optimizer.param_groups[0][LR_SCALE_FACTOR_KEY] = 2.0
    with pytest.raises(ValueError, match="different `lr_scale_factor`"):
        rescale_learning_rates(optimizer, [], 2.0)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 4096), st.integers(1, 4096))
def test_sqrt_factor_is_the_root_of_the_linear_one(effective: int, reference: int) -> None:
    linear = lr_scale_factor("linear", effective, reference)
    assert linear == effective / reference
    assert lr_scale_factor("sqrt", effective, reference) == pytest.approx(math.sqrt(linear), rel=1e-15)
    assert lr_scale_factor("none", effective, reference) == 1.0


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 200), st.integers(0, 100), st.floats(0.25, 64.0))
def test_warmup_rises_linearly_from_the_base_to_the_scaled_lr(step: int, warmup: int, factor: float) -> None:
    multiplier = warmup_multiplier(step, warmup, factor)
    if step >= warmup or factor <= 1.0:
        assert multiplier == 1.0
    else:
        assert 1.0 / factor <= multiplier < 1.0
        assert multiplier == pytest.approx(1.0 / factor + (1.0 - 1.0 / factor) * step / warmup, rel=1e-12)
    assert warmup_multiplier(0, 10, 4.0) == 0.25


@pytest.mark.parametrize(
    ("call", "error", "match"),
    [
        (lambda: lr_scale_factor("cubic", 8, 4), ValueError, "lr_scaling"),
        (
            lambda: lr_scale_factor("linear", 8, 0),
            ValueError,
            whole_message("`reference_batch_size` must be >= 1, got 0"),
        ),
        (
            lambda: lr_scale_factor("linear", 0, 8),
            ValueError,
            whole_message("`effective_batch_size` must be >= 1, got 0"),
        ),
        (
            lambda: lr_scale_factor("linear", 8, 2.5),
            TypeError,
            whole_message("`reference_batch_size` must be an integer, got 2.5 of type float"),
        ),
        (lambda: effective_batch_size(8, 0, 1), ValueError, whole_message("`world_size` must be >= 1, got 0")),
        (
            lambda: effective_batch_size(8, 2, 0),
            ValueError,
            whole_message("`accumulate_grad_batches` must be >= 1, got 0"),
        ),
        (
            lambda: rescale_learning_rates(_optimizer(), [], 0.0),
            ValueError,
            whole_message("`factor` must be positive and finite, got 0.0"),
        ),
        (
            lambda: rescale_learning_rates(_optimizer(), [], float("nan")),
            ValueError,
            whole_message("`factor` must be positive and finite, got nan"),
        ),
        (
            lambda: rescale_learning_rates(_optimizer(), [], "2"),
            TypeError,
            whole_message("`factor` must be a real number, got '2' of type str"),
        ),
    ],
)
def test_bad_input_raises_naming_the_argument(call: Callable[[], Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        call()
