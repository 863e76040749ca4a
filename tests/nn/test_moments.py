"""Combined per-part BatchNorm moments equal the full-batch moments (float64), and stay accurate in float32.

Tolerances and why:

* float64 parts against float64 full-batch ``torch.var_mean``: mean within ``1e-10 * std`` and variance within
  ``1e-9`` relative. Both sides are stable (torch's one-pass kernel vs. per-part shifted sums + Chan's combination), so
  they differ by rounding that grows with ``|mean| / std`` (up to ``1e4`` here, i.e. ~1e-12 relative); a formula
  error (a wrong weight, a missing spread term, an empty part that counts) is off by orders of magnitude more.
* float32 parts at ``|mean| / std`` up to ``1e4``: the variance within ``2e-3`` relative of the float64 moments of the
  same float32 values with float32 moments: each part's mean is rounded to float32 (half an ulp, ~6e-8 of
  ``|mean|``, i.e. up to ~6e-4 of std at 1e4), and the spread term ``n_k * (mean_k - mean) ** 2`` carries about
  twice that relative error. With float64 moments (``dtype=torch.float64``, what SyncBatchNorm uses) within
  ``1e-6``: only the float32 sums of the shifted values ``d`` and ``d * d`` round. ``E[x^2] - E[x]^2`` in float32 is
  off by 100% and more there (checked below).
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_balanced.nn.moments import Moments, batch_moments, combine_moments

_DIMS = [0, 2]  # (N, C, L) input: reduce over batch and length, one moment per channel


def _stack(parts: list[Moments]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return (
        torch.stack([p.count for p in parts]),
        torch.stack([p.mean for p in parts]),
        torch.stack([p.m2 for p in parts]),
    )


@st.composite
def _split_batches(draw: st.DrawFn, dtype: torch.dtype) -> tuple[torch.Tensor, list[int], float]:
    """A batch ``(N, C, L)`` with per-channel offset ``ratio * std`` and its split into parts (0 and 1 included)."""
    sizes = draw(st.lists(st.integers(0, 6), min_size=1, max_size=5).filter(lambda s: sum(s) >= 2))
    channels, length = draw(st.integers(1, 3)), draw(st.integers(1, 3))
    ratio = draw(st.sampled_from([0.0, 1.0, 1e2, 1e3, 1e4]))
    scale = draw(st.sampled_from([1e-3, 1.0, 1e3]))
    sign = draw(st.sampled_from([-1.0, 1.0]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(sum(sizes), channels, length, generator=g, dtype=torch.float64) + sign * ratio) * scale
    return x.to(dtype), sizes, ratio


def _combined(x: torch.Tensor, sizes: list[int], dtype: torch.dtype | None = None) -> Moments:
    return combine_moments(*_stack([batch_moments(part, _DIMS, dtype=dtype) for part in x.split(sizes)]))


@settings(max_examples=200, deadline=None)
@given(_split_batches(torch.float64))
def test_float64_parts_combine_to_full_batch_moments(batch: tuple[torch.Tensor, list[int], float]) -> None:
    x, sizes, _ = batch
    got = _combined(x, sizes)
    ref_var, ref_mean = torch.var_mean(x, dim=_DIMS, correction=0)
    n = x.shape[0] * x.shape[2]
    assert got.count.item() == n
    std = ref_var.sqrt()
    assert ((got.mean - ref_mean).abs() <= 1e-10 * std + 1e-300).all(), (got.mean, ref_mean)
    torch.testing.assert_close(got.variance(), ref_var, rtol=1e-9, atol=0)
    torch.testing.assert_close(got.variance(unbiased=True), torch.var(x, dim=_DIMS, correction=1), rtol=1e-9, atol=0)


@settings(max_examples=200, deadline=None)
@given(_split_batches(torch.float32))
def test_float32_parts_keep_the_variance_at_large_mean_over_std(batch: tuple[torch.Tensor, list[int], float]) -> None:
    x, sizes, _ = batch
    ref_var, ref_mean = torch.var_mean(x.double(), dim=_DIMS, correction=0)
    # float32 parts: 2e-3 up to the design bound |mean| / std = 1e4; beyond it (a draw of a few samples can have a
    # tenth of the generating std) the parts' float32 means carry half an ulp of |mean| each, so the bound grows as
    # eps * |mean| / std (seen: 0.9 % at |mean| / std = 2e5 with 3 samples, where the bound is 2.5 %).
    float32_rtol = torch.clamp(torch.finfo(torch.float32).eps * ref_mean.abs() / ref_var.sqrt(), min=2e-3)
    for dtype, rtol in ((None, float32_rtol), (torch.float64, torch.full_like(ref_var, 1e-6))):
        got = _combined(x, sizes, dtype)
        error = (got.variance().double() - ref_var).abs()
        assert (error <= rtol * ref_var).all(), (dtype, error / ref_var, rtol)
        # float32 means: half an ulp of |mean|, plus rounding of the sums.
        assert ((got.mean.double() - ref_mean).abs() <= 1e-6 * ref_mean.abs() + 1e-5 * ref_var.sqrt()).all()


def test_float32_sum_of_squares_formula_fails_where_the_combination_holds() -> None:
    # The motivating case (issue 9): 1e4 + randn on 2 parts of 3 and 5 samples.
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(8, 4, 16, generator=g, dtype=torch.float64) + 1e4).float()
    ref_var = torch.var(x.double(), dim=_DIMS, correction=0)
    parts = x.split([3, 5])
    sums = sum(p.sum(dim=_DIMS) for p in parts)
    sumsq = sum((p * p).sum(dim=_DIMS) for p in parts)
    n = x.shape[0] * x.shape[2]
    naive = sumsq / n - (sums / n) ** 2
    assert ((naive - ref_var).abs() / ref_var).max() > 1.0  # useless: off by more than the variance itself
    stable = _combined(x, [3, 5]).variance()
    assert ((stable - ref_var).abs() / ref_var).max() < 1e-3


def test_empty_parts_contribute_nothing_even_with_nan_moments() -> None:
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 3, 2, generator=g, dtype=torch.float64) * 3 + 5
    parts = [batch_moments(p, _DIMS) for p in x.split([3, 4])]
    count, mean, m2 = _stack(parts)
    empty = batch_moments(x[:0], _DIMS)
    assert empty.count.item() == 0
    assert torch.equal(empty.mean, torch.zeros(3, dtype=torch.float64))
    assert torch.equal(empty.m2, torch.zeros(3, dtype=torch.float64))
    with_empty = combine_moments(*_stack([empty, parts[0], empty, parts[1]]))
    nan_part = Moments(empty.count, torch.full_like(empty.mean, float("nan")), torch.full_like(empty.m2, float("inf")))
    with_nan = combine_moments(*_stack([parts[0], nan_part, parts[1]]))
    without = combine_moments(count, mean, m2)
    for got in (with_empty, with_nan):
        assert torch.equal(got.count, without.count)
        assert torch.equal(got.mean, without.mean)
        assert torch.equal(got.m2, without.m2)


def test_all_parts_empty_gives_zero_moments() -> None:
    empty = batch_moments(torch.zeros(0, 2, 3), _DIMS)
    got = combine_moments(*_stack([empty, empty]))
    assert got.count.item() == 0
    assert torch.equal(got.mean, torch.zeros(2, dtype=torch.float64))
    assert torch.equal(got.m2, torch.zeros(2, dtype=torch.float64))


def test_single_sample_parts_have_zero_m2_and_combine() -> None:
    x = torch.tensor([[[1.0]], [[3.0]], [[8.0]]], dtype=torch.float64)  # (3, 1, 1): three 1-sample parts
    parts = [batch_moments(p, _DIMS) for p in x.split(1)]
    assert all(p.m2.item() == 0 and p.count.item() == 1 for p in parts)
    got = combine_moments(*_stack(parts))
    assert got.mean.item() == 4.0
    assert got.m2.item() == pytest.approx(9.0 + 1.0 + 16.0, rel=1e-15)


@pytest.mark.parametrize("sizes", [[3, 5], [1, 4, 0, 2], [0, 6]])
def test_gradients_through_the_combination_equal_full_batch_gradients(sizes: list[int]) -> None:
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(sum(sizes), 3, 4, generator=g, dtype=torch.float64) * 2 + 7).requires_grad_(True)
    w_mean, w_var = torch.randn(3, generator=g, dtype=torch.float64), torch.randn(3, generator=g, dtype=torch.float64)

    got = _combined(x, sizes)
    (grad_got,) = torch.autograd.grad((got.mean * w_mean).sum() + (got.variance() * w_var).sum(), x)
    ref_var, ref_mean = torch.var_mean(x, dim=_DIMS, correction=0)
    (grad_ref,) = torch.autograd.grad((ref_mean * w_mean).sum() + (ref_var * w_var).sum(), x)
    torch.testing.assert_close(grad_got, grad_ref, rtol=1e-10, atol=1e-12)


def test_combine_passes_gradcheck() -> None:
    g = torch.Generator().manual_seed(3)
    count = torch.tensor([3.0, 1.0, 0.0, 5.0], dtype=torch.float64)
    mean = torch.randn(4, 2, generator=g, dtype=torch.float64).requires_grad_(True)
    m2 = (torch.rand(4, 2, generator=g, dtype=torch.float64) * count.view(-1, 1)).requires_grad_(True)

    def combined(mu: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        got = combine_moments(count, mu, s)
        return got.mean, got.m2

    assert torch.autograd.gradcheck(combined, (mean, m2))


def test_bad_arguments_raise() -> None:
    with pytest.raises(TypeError, match="`input` must be a floating point"):
        batch_moments(torch.ones(3, 2, dtype=torch.int64), [0])
    with pytest.raises(TypeError, match="`dtype` must be a floating point"):
        batch_moments(torch.ones(3, 2), [0], dtype=torch.int64)
    with pytest.raises(ValueError, match="`count` must be 1-D"):
        combine_moments(torch.ones(2, 1), torch.zeros(2, 3), torch.zeros(2, 3))
    with pytest.raises(ValueError, match="K = len"):
        combine_moments(torch.ones(2), torch.zeros(3, 3), torch.zeros(3, 3))
    with pytest.raises(ValueError, match="K = len"):
        combine_moments(torch.ones(2), torch.zeros(2, 3), torch.zeros(2, 4))
