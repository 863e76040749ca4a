"""The gradient noise scale: the estimator's algebra, and ScaleInvariance measuring it under DDP (2 gloo processes)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_balanced.batch_scaling.noise_scale import GradientNoiseScale
from lightning_balanced.batch_scaling.scale_invariance import ScaleInvariance
from tests.helpers import raises_exactly
from tests.test_scale_invariance import Net, Plain, _data, _fit, _two_rank_replay


@settings(max_examples=200, deadline=None)
@given(
    st.floats(1e-6, 1e3),
    st.floats(0.0, 1e5),
    st.integers(1, 512),
    st.integers(2, 64),
    st.floats(0.0, 0.99),
)
def test_on_expected_squared_norms_the_estimates_are_exact(
    gradient_sq: float, trace: float, small: int, ratio: int, decay: float
) -> None:
    # E|G_B|^2 = |G|^2 + tr(Sigma) / B for a batch of B independent samples: the estimators are unbiased, so fed the
    # expected values they return |G|^2 and tr(Sigma) exactly, at every update (the averages are bias-corrected).
    big = small * ratio
    estimate = GradientNoiseScale(decay)
    for _ in range(3):
        estimate.update(gradient_sq + trace / small, small, gradient_sq + trace / big, big)
        assert estimate.gradient_sq == pytest.approx(gradient_sq, rel=1e-9, abs=1e-9 * trace / small)
        assert estimate.trace == pytest.approx(trace, rel=1e-9, abs=1e-9 * gradient_sq * small)
    assert estimate.updates == 3


def test_the_value_is_the_ratio_of_the_averages_and_none_until_the_gradient_estimate_is_positive() -> None:
    estimate = GradientNoiseScale(decay=0.5)
    assert estimate.value is None and estimate.gradient_sq is None
    estimate.update(1.0, 4, 2.0, 8)  # the big batch's norm above the small one's: |G|^2 = 3, tr(Sigma) = -8
    assert estimate.gradient_sq == 3.0 and estimate.trace == -8.0
    estimate.update(10.0, 4, 1.0, 8)  # |G|^2 = -8, tr(Sigma) = 72
    assert estimate.gradient_sq == pytest.approx((0.5 * 0.5 * 3 + 0.5 * -8) / (1 - 0.5**2))  # bias-corrected
    assert estimate.value is None  # the average of |G|^2 is below 0
    estimate = GradientNoiseScale(decay=0.0)
    estimate.update(5.0, 4, 2.0, 16)  # |G|^2 = (32 - 20) / 12 = 1, tr(Sigma) = 3 / (1/4 - 1/16) = 16
    assert estimate.value == pytest.approx(16.0)


def test_bad_arguments_are_refused_naming_them() -> None:
    with raises_exactly(ValueError, "`decay` must be < 1, got 1.0"):
        GradientNoiseScale(1.0)
    with raises_exactly(ValueError, "`decay` must be >= 0.0 and finite, got -0.5"):
        GradientNoiseScale(-0.5)
    with raises_exactly(ValueError, "the batch sizes must be 0 < small < big, got small 8 and big 8"):
        GradientNoiseScale().update(1.0, 8, 1.0, 8)
    with raises_exactly(TypeError, "`measure_noise_scale` must be a bool, got 'yes'"):
        ScaleInvariance("sqrt", reference_batch_size=8, measure_noise_scale="yes")  # type: ignore[arg-type]


def test_in_one_process_the_report_says_it_was_not_measured(caplog: pytest.LogCaptureFixture) -> None:
    callback = ScaleInvariance("sqrt", reference_batch_size=8, measure_noise_scale=True)
    with caplog.at_level("INFO"):
        _fit(Net("sgd"), [callback], batch_size=8)
    assert "  gradient noise scale: not measured (it needs DDP with 2 or more processes)" in caplog.text
    assert callback.noise_scales == {}


def test_an_effective_batch_above_the_noise_scale_warns_under_a_square_root_rule() -> None:
    callback = ScaleInvariance("adam_sde", reference_batch_size=32, measure_noise_scale=True)
    callback.effective_batch_size = 128
    estimate = callback.noise_scales.setdefault(0, GradientNoiseScale(decay=0.0))
    estimate.update(5.0, 4, 2.0, 16)  # B_simple 16
    with pytest.warns(UserWarning) as record:
        callback._report_noise_scale()
    assert [str(w.message) for w in record] == [
        "ScaleInvariance: the effective batch size 128 is 8 x the measured gradient noise scale B_simple 16; the"
        " 'adam_sde' rule assumes batches well below it (Malladi et al. 2022, section 5), so expect this run to learn"
        " less per sample than the reference run; the 'linear' rule fits batches above it (McCandlish et al. 2018)"
    ]
    linear = ScaleInvariance("linear", reference_batch_size=32, measure_noise_scale=True)
    linear.effective_batch_size, linear.noise_scales = 128, callback.noise_scales
    linear._report_noise_scale()  # the linear rule's regime: no warning (pytest's filterwarnings makes one an error)


def _measuring_rank(rank: int, world_size: int) -> dict[str, Any]:
    from tests.helpers import quiet_trainer

    model = Plain()
    callback = ScaleInvariance("adam_sde", reference_batch_size=8, measure_noise_scale=True)
    quiet_trainer("ddp", world_size, max_steps=3, callbacks=[callback]).fit(model, DataLoader(_data(), batch_size=8))
    estimate = callback.noise_scales[0]
    return {"updates": estimate.updates, "gradient_sq": estimate.gradient_sq, "trace": estimate.trace}


@pytest.mark.slow
def test_under_ddp_each_rank_estimates_from_its_own_gradient_and_the_all_reduced_one() -> None:
    from tests.distributed import run_distributed

    results = run_distributed(_measuring_rank, 2)
    # One process replays the 2 ranks' steps (as in test_scale_invariance), measuring on the way: the small batches
    # are each rank's own 8 samples (the mean of their two squared norms), the big one both ranks' 16.
    model = Plain()
    optimizer, orders = _two_rank_replay(model)
    x, y = _data()[:]
    estimate = GradientNoiseScale()
    for step in range(3):
        grads = []
        for order in orders:
            rows = order[step * 8 : (step + 1) * 8]
            model.zero_grad()
            F.mse_loss(model.net(x[rows]), y[rows]).backward()
            grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
        small_sq = float((grads[0].square().sum() + grads[1].square().sum()) / 2)
        estimate.update(small_sq, 8, float(((grads[0] + grads[1]) / 2).square().sum()), 16)
        optimizer.zero_grad()
        rows_both = [order[step * 8 : (step + 1) * 8] for order in orders]
        (sum(F.mse_loss(model.net(x[r]), y[r]) for r in rows_both) / 2).backward()
        optimizer.step()
    # 1e-9: float64 gradients through the same operations; the norms differ in their summation order only.
    for rank in results:
        assert rank["updates"] == 3
        assert rank["gradient_sq"] == pytest.approx(estimate.gradient_sq, rel=1e-9)
        assert rank["trace"] == pytest.approx(estimate.trace, rel=1e-9)
    assert results[0] == results[1]  # the same estimate on every rank
