"""The pieces of ``strategy="pipeline"``'s step reduction, packed into the one buffer the step all-reduces.

Shared parameters' gradients, BatchNorm moments and the found-inf flag, in float64 over the pipeline.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor, nn

from lightning_balanced.nn.moments import Moments
from lightning_balanced.pipeline.batchnorm import DeferredBatchNorm

__all__ = ["SharedGradients", "mark_non_finite", "non_finite", "pack_moments"]


class SharedGradients:
    """The gradients of the parameters outside the stages, in a float64 buffer from ``offset`` on.

    One "has a gradient" flag per parameter, then their values. Packing writes into zeros, so the ranks whose slots
    stay zero leave the sum exact.
    """

    def __init__(self, params: list[nn.Parameter], offset: int) -> None:
        self.params = params
        self.flags = offset
        self.values = offset + len(params)
        self.end = self.values + sum(param.numel() for param in params)

    def pack(self, buffer: Tensor) -> None:
        """Write the gradients (and a flag for each that has one) into ``buffer``, which holds zeros there."""
        start = self.values
        for index, param in enumerate(self.params):
            if param.grad is not None:
                buffer[self.flags + index] = 1
                buffer[start : start + param.numel()] = param.grad.detach().reshape(-1).to(buffer)
            start += param.numel()

    def unpack(self, buffer: Tensor, head: list[float]) -> None:
        """Set each parameter's gradient from the reduced ``buffer`` (``None`` where no rank had one).

        ``head`` is ``buffer[:values]`` read to the host: a flag is non-zero where any rank had a gradient (after the
        data-parallel average it is a fraction).
        """
        flags = head[self.flags : self.values]
        start = self.values
        for param, flag in zip(self.params, flags, strict=True):
            size = param.numel()
            if flag > 0:
                param.grad = buffer[start : start + size].view(param.shape).to(param.dtype).to(param.device)
            start += size


def non_finite(grads: Sequence[Tensor | None]) -> Tensor | float:
    """1 where any of ``grads`` holds an inf or NaN, else 0: a 0-dim tensor on their device, no host sync."""
    found = [torch.logical_not(torch.isfinite(grad)).any() for grad in grads if grad is not None]
    return torch.stack(found).any() if found else 0.0


def mark_non_finite(params: Sequence[nn.Parameter]) -> None:
    """Put a NaN into the first of ``params``' gradients, where another stage's rank found an inf or NaN in its own.

    The ``GradScaler``'s ``unscale_`` on this rank then finds it as well, so every rank of the pipeline skips the
    step and lowers the scale alike, through the scaler's public behaviour only. (Each rank unscales its own stages'
    gradients: without it the ranks would disagree on the skip and on the next scale.) A data-parallel replica
    needs nothing: the gradients' average carries the inf or NaN to it.
    """
    for param in params:
        if param.grad is not None:
            param.grad[(0,) * param.grad.dim()] = float("nan")
            return


def pack_moments(layer: DeferredBatchNorm, total: Moments | None, device: torch.device) -> Tensor:
    """``[count, mean (C), M2 (C)]`` in float64 (zeros for a layer that tracked nothing)."""
    channels = layer.num_features
    if total is None:
        return torch.zeros(1 + 2 * channels, dtype=torch.float64, device=device)
    return torch.cat([total.count.reshape(1), total.mean, total.m2]).to(device=device, dtype=torch.float64)
