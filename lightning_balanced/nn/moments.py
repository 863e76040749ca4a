"""BatchNorm statistics of a batch split into parts: per-part moments, and their exact, numerically stable combination.

Each part (a rank's batch, a replica's chunk) summarizes its samples per channel by ``(count, mean, M2)``, with
``M2 = sum((x - mean) ** 2)`` the centered sum of squares. Parts combine with the parallel formula of Chan, Golub and
LeVeque, which never forms ``E[x^2] - E[x]^2``: that difference cancels catastrophically in float32 once
``|mean| / std`` reaches about ``1e3``. Every function here is built from differentiable torch ops, so gradients flow
through a combination as through full-batch statistics.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["Moments", "batch_moments", "check_batchnorm_input", "combine_moments", "moments_dtype"]


def moments_dtype(device: torch.device) -> torch.dtype:
    """The dtype in which the package's BatchNorms form, exchange and combine moments on ``device``.

    float64 (the ``(C,)`` tensors are tiny, and counts stay exact beyond ``2**24`` samples), float32 on MPS, which has
    no float64.
    """
    return torch.float32 if device.type == "mps" else torch.float64


@dataclass(frozen=True)
class Moments:
    """Per-channel count, mean and centered sum of squares of a set of samples.

    Attributes:
        count (Tensor): number of values per channel, a 0-dim tensor, or ``(K,)`` for ``K`` stacked parts; float64
            (float32 on MPS, which has no float64), so that counts are exact.
        mean (Tensor[C] or Tensor[K, C]): per-channel mean; ``0`` for an empty part.
        m2 (Tensor[C] or Tensor[K, C]): per-channel ``sum((x - mean) ** 2)``; ``0`` for an empty part.
    """

    count: Tensor
    mean: Tensor
    m2: Tensor

    def variance(self, *, unbiased: bool = False) -> Tensor:
        """Per-channel variance ``M2 / count`` (biased), or ``M2 / (count - 1)`` with ``unbiased=True``.

        Returns:
            Tensor: same shape and dtype as ``m2``; ``nan``/``inf`` where the count is too small (0, or 1 when
            unbiased), as in :func:`torch.var`. Callers that normalize check the count first.
        """
        count = self.count.view(*self.count.shape, *([1] * (self.m2.dim() - self.count.dim())))
        return self.m2 / (count - 1 if unbiased else count)


def batch_moments(input: Tensor, dim: Sequence[int], *, dtype: torch.dtype | None = None) -> Moments:
    """The moments of ``input`` over the dimensions ``dim`` (one channel per remaining element).

    Shifted-data algorithm: with ``c`` a per-channel estimate of the mean (``input``'s own mean, detached) and
    ``d = input - c``, ``mean = c + sum(d) / n`` and ``M2 = sum(d * d) - sum(d) ** 2 / n``. ``d`` is small next to
    ``input`` whatever ``|mean| / std``, so the sums (accumulated in ``input``'s dtype) lose nothing to cancellation;
    for any constant ``c`` both formulas are exact functions of ``input``, so autograd through them gives the true
    gradients. An empty ``input`` gives count 0, mean 0 and M2 0 that are still part of ``input``'s autograd graph, so
    a part with no samples takes part in a combination (and its backward) and contributes nothing.

    Args:
        input (Tensor): floating point, any shape; ``(N, C, *)`` for BatchNorm with ``dim = [0, 2, 3, ...]``. Pass
            float16/bfloat16 data as float32.
        dim (Sequence[int]): the dimensions reduced over (for BatchNorm: all but the channel dimension).
        dtype (torch.dtype, optional): the dtype in which ``mean = c + sum(d) / n`` and ``M2`` are formed and
            returned; default ``input``'s. float64 for float32 input keeps each part's mean from rounding to float32
            (half an ulp is ~5e-4 at 1e4), which matters when parts at large ``|mean| / std`` are combined.

    Returns:
        Moments: ``count`` a 0-dim float64 tensor (float32 on MPS), ``mean`` and ``m2`` of the shape of ``input``
        without ``dim``, of ``dtype``.

    Raises:
        TypeError: ``input`` or ``dtype`` is not floating point.

    Source: the shifted-data algorithm in Chan, Golub & LeVeque, "Algorithms for Computing the
    Sample Variance: Analysis and Recommendations", The American Statistician 37(3), 1983.
    """
    if not input.is_floating_point():
        raise TypeError(f"`input` must be a floating point tensor, got {input.dtype}")
    acc_dtype = input.dtype if dtype is None else dtype
    if not acc_dtype.is_floating_point:
        raise TypeError(f"`dtype` must be a floating point dtype, got {acc_dtype}")
    dims = list(dim)
    count = 1
    for d in dims:
        count *= input.shape[d]
    count_dtype = moments_dtype(input.device)
    # A fill on the device, not torch.tensor(..., device=...): that copies from pageable host memory, which makes the
    # host wait for every kernel queued before it on a CUDA stream.
    count_t = torch.full((), float(count), dtype=count_dtype, device=input.device)
    if count == 0:
        zeros = input.sum(dim=dims, dtype=acc_dtype)  # zeros that stay in input's graph
        return Moments(count_t, zeros, zeros)
    shift = input.detach().mean(dim=dims, keepdim=True)
    centered = input - shift
    sum_d = centered.sum(dim=dims).to(acc_dtype)
    # Outside autograd, square in place: one temporary the size of input instead of two.
    squared = centered.square() if centered.requires_grad else centered.square_()
    sum_d2 = squared.sum(dim=dims).to(acc_dtype)
    mean = shift.squeeze(dims).to(acc_dtype) + sum_d / count
    m2 = (sum_d2 - sum_d * sum_d / count).clamp_min(0.0)
    return Moments(count_t, mean, m2)


def combine_moments(count: Tensor, mean: Tensor, m2: Tensor) -> Moments:
    """Combine ``K`` parts' moments, stacked along dimension 0, into the moments of all their samples together.

    With ``n = sum(n_k)``: ``mean = sum(n_k * mean_k) / n`` and ``M2 = sum(M2_k) + sum(n_k * (mean_k - mean) ** 2)``.
    Every term of ``M2`` is non-negative, so nothing cancels: the result is as accurate as the parts' own M2 (a
    two-pass variance), whatever ``|mean| / std``. Parts with count 0 contribute nothing, whatever their mean and M2
    hold (even ``nan``). For float64 parts the result matches the full-batch float64 moments to rounding.

    Args:
        count (Tensor[K]): samples per part, non-negative, floating point (exact integers).
        mean (Tensor[K, *]): per-part means, e.g. ``(K, C)``.
        m2 (Tensor[K, *]): per-part centered sums of squares, same shape as ``mean``.

    Returns:
        Moments: ``count`` 0-dim (the total), ``mean`` and ``m2`` of shape ``mean.shape[1:]`` in the promoted dtype of
        ``count`` and ``mean``; if the total count is 0, mean and M2 are 0. Differentiable with respect to ``mean``
        and ``m2`` (and ``count``).

    Raises:
        ValueError: shapes that do not line up (``count`` not 1-D, ``mean`` and ``m2`` of different shapes or with a
            first dimension other than ``len(count)``).

    Source: the parallel variance update of Chan, Golub & LeVeque, "Updating Formulae and a Pairwise Algorithm for
    Computing Sample Variances" (Stanford CS report STAN-CS-79-773, 1979), ``M2 = M2_a + M2_b + delta**2 * n_a * n_b
    / n``, written for ``K`` parts at once (algebraically identical to applying it pairwise).
    """
    if count.dim() != 1:
        raise ValueError(f"`count` must be 1-D (one entry per part), got shape {list(count.shape)}")
    if mean.shape != m2.shape or mean.dim() < 1 or mean.shape[0] != count.shape[0]:
        raise ValueError(
            f"`mean` and `m2` must both have shape (K, ...) with K = len(count) = {count.shape[0]}, got "
            f"{list(mean.shape)} and {list(m2.shape)}"
        )
    weight = count.view(-1, *([1] * (mean.dim() - 1)))
    present = weight > 0
    # Empty parts are masked out (not just weighted by 0): their mean may be anything, even nan.
    mean = torch.where(present, mean, torch.zeros_like(mean))
    m2 = torch.where(present, m2, torch.zeros_like(m2))
    total = count.sum()
    combined_mean = (weight * mean).sum(0) / total.clamp_min(1)
    spread = weight * (mean - combined_mean) ** 2
    combined_m2 = m2.sum(0) + torch.where(present, spread, torch.zeros_like(spread)).sum(0)
    return Moments(total, combined_mean, combined_m2)


def check_batchnorm_input(layer: _BatchNorm, input: Tensor) -> None:
    """Refuse what BatchNorm1d/2d/3d refuse: not ``(N, C, *)`` with 0 to 3 trailing dims, or not ``C`` channels.

    Raises:
        ValueError: naming ``layer``'s class, the expected shape and the input's.
    """
    if not 2 <= input.dim() <= 5:
        raise ValueError(
            f"{type(layer).__name__} expects a 2D to 5D input (N, C, *) as BatchNorm1d/2d/3d do, got a "
            f"{input.dim()}D input of shape {list(input.shape)}"
        )
    if input.shape[1] != layer.num_features:
        raise ValueError(
            f"{type(layer).__name__} expects {layer.num_features} channels in dimension 1, got input of shape "
            f"{list(input.shape)}"
        )
