"""The gradient noise scale ``B_simple``: which batch-size scaling rule fits a job.

McCandlish, Kaplan, Amodei et al. 2018, "An Empirical Model of Large-Batch Training": ``B_simple = tr(Sigma) / |G|^2``,
with ``G`` the true gradient and ``Sigma`` the covariance of one sample's gradient. Batches well below it are
noise-dominated, the regime of the square-root rules (``"sqrt"``, and Adam's SDE rule ``"adam_sde"``: Malladi et al.
2022, section 5); batches near or above it are not, and there a larger batch gains less per sample (the linear rule's
regime, up to the critical batch size).

Under data parallelism it costs next to nothing (McCandlish et al., Appendix A.1): each rank's gradient is that of a
small batch, the all-reduced gradient that of the effective batch, and the two squared norms give unbiased estimates of
``|G|^2`` and ``tr(Sigma)``. :class:`GradientNoiseScale` smooths them as the paper does;
:class:`~lightning_balanced.batch_scaling.scale_invariance.ScaleInvariance` feeds it under DDP
(``measure_noise_scale=True``).
"""

from __future__ import annotations

from lightning_balanced.arguments import check_real

__all__ = ["GradientNoiseScale"]


class GradientNoiseScale:
    """Running estimate of the gradient noise scale ``B_simple = tr(Sigma) / |G|^2`` from two batch sizes.

    From the squared norms of the gradients of a small and a big batch (``B_small < B_big`` samples, gradients of the
    mean loss), McCandlish et al. 2018, Appendix A.1:

    * ``|G|^2 ~ (B_big |G_big|^2 - B_small |G_small|^2) / (B_big - B_small)``;
    * ``tr(Sigma) ~ (|G_small|^2 - |G_big|^2) / (1 / B_small - 1 / B_big)``.

    Both are unbiased but noisy; each is smoothed by an exponential moving average (bias-corrected, as Adam's moments)
    and ``B_simple`` is the ratio of the averages.

    Args:
        decay (float): the moving averages' decay per update, in ``[0, 1)``. The default averages about 100 steps:
            one step's estimate of ``|G|^2`` is far noisier than its value when the batches are well below
            ``B_simple``.

    Raises:
        ValueError: ``decay`` outside ``[0, 1)``; in :meth:`update`, batch sizes that are not ``0 < small < big``.
    """

    def __init__(self, decay: float = 0.99) -> None:
        self.decay = check_real("decay", decay, minimum=0.0)
        if not self.decay < 1.0:
            raise ValueError(f"`decay` must be < 1, got {decay!r}")
        self.updates = 0
        self._gradient_sq = 0.0  # the EMA of |G|^2, before bias correction
        self._trace = 0.0  # the EMA of tr(Sigma)

    def update(self, small_sq: float, small_batch: float, big_sq: float, big_batch: float) -> None:
        """Add one pair of measurements.

        Args:
            small_sq (float): ``|G_small|^2``, the squared norm of the gradient of a batch of ``small_batch`` samples
                (one rank's under data parallelism, or the mean of the ranks' squared norms: less noisy).
            small_batch (float): ``B_small``.
            big_sq (float): ``|G_big|^2``, the squared norm of the gradient of ``big_batch`` samples (all-reduced).
            big_batch (float): ``B_big``, the effective batch size.
        """
        if not 0 < small_batch < big_batch:
            raise ValueError(f"the batch sizes must be 0 < small < big, got small {small_batch} and big {big_batch}")
        gradient_sq = (big_batch * big_sq - small_batch * small_sq) / (big_batch - small_batch)
        trace = (small_sq - big_sq) / (1.0 / small_batch - 1.0 / big_batch)
        self._gradient_sq = self.decay * self._gradient_sq + (1.0 - self.decay) * gradient_sq
        self._trace = self.decay * self._trace + (1.0 - self.decay) * trace
        self.updates += 1

    @property
    def gradient_sq(self) -> float | None:
        """The smoothed estimate of ``|G|^2`` (bias-corrected), or ``None`` before the first update."""
        return None if not self.updates else self._gradient_sq / (1.0 - self.decay**self.updates)

    @property
    def trace(self) -> float | None:
        """The smoothed estimate of ``tr(Sigma)`` (bias-corrected), or ``None`` before the first update."""
        return None if not self.updates else self._trace / (1.0 - self.decay**self.updates)

    @property
    def value(self) -> float | None:
        """``B_simple`` in samples; ``None`` before the first update or while the estimate of ``|G|^2`` is not > 0.

        The estimate of ``|G|^2`` can dip below 0 from noise when the gradient is far smaller than its noise.
        """
        gradient_sq, trace = self.gradient_sq, self.trace
        if gradient_sq is None or trace is None or gradient_sq <= 0.0:
            return None
        return trace / gradient_sq
