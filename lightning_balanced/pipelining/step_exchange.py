"""The pieces of ``strategy="pipeline"``'s step reduction, packed into the one buffer the step all-reduces.

Shared parameters' gradients, BatchNorm moments and the found-inf flag, in float64 over the pipeline; the running
statistics' commit from those moments, and gradient clipping by the norm over every stage.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_balanced.nn.moments import Moments, combine_moments
from lightning_balanced.pipeline.batchnorm import DeferredBatchNorm

__all__ = [
    "SharedGradients",
    "clip_grad_by_global_norm",
    "commit_running_statistics",
    "mark_non_finite",
    "non_finite",
    "pack_moments",
]


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


def commit_running_statistics(
    layers: list[DeferredBatchNorm], group: Any, data_parallel_size: int, device: torch.device
) -> None:
    """Update each layer's running statistics once, from every micro-batch of the (global) mini-batch.

    With data parallelism (``data_parallel_size > 1``) the moments of the replicas' micro-batches are merged (one
    all_gather over ``group`` for all the layers, Chan et al.'s formula), so every replica updates alike, as one
    process would from the global batch.
    """
    if not layers:
        return
    totals = [layer.tracked() for layer in layers]
    if data_parallel_size > 1:
        packed = torch.cat([pack_moments(layer, total, device) for layer, total in zip(layers, totals, strict=True)])
        gathered = [torch.empty_like(packed) for _ in range(data_parallel_size)]
        dist.all_gather(gathered, packed, group=group)
        rows = torch.stack(gathered)
        starts = [0]
        for layer in layers:
            starts.append(starts[-1] + 1 + 2 * layer.num_features)
        seen = rows[:, starts[:-1]].sum(0).tolist()  # each layer's samples over the replicas: one device read
        merged: list[Moments | None] = []
        for layer, start, samples in zip(layers, starts, seen, strict=False):
            channels = layer.num_features
            part = rows[:, start : start + 1 + 2 * channels]
            count, mean, m2 = part[:, 0], part[:, 1 : 1 + channels], part[:, 1 + channels :]
            merged.append(combine_moments(count, mean, m2) if samples > 0 else None)
        totals = merged
    for layer, total in zip(layers, totals, strict=True):
        if total is None:
            layer.reset_accumulator()
        else:
            layer.commit(total)


def clip_grad_by_global_norm(
    own: Sequence[nn.Parameter],
    shared: Sequence[nn.Parameter],
    counts_shared: bool,
    group: Any,
    clip_val: float,
    device: torch.device,
) -> None:
    """``clip_grad_norm_`` over a pipeline: the norm of every stage's gradients, each rank holding its stages' only.

    Args:
        own: this rank's stages' parameters.
        shared: the parameters outside the stages (the same gradients on every pipeline rank).
        counts_shared (bool): whether this rank adds the shared gradients to the norm (one rank of the pipeline).
        group: the pipeline's process group, over which the squared norms are summed.
        clip_val (float): the largest norm.
        device (torch.device): the rank's device, where the norm is summed (the process group's device).
    """
    grads = [p.grad for p in own if p.grad is not None]
    shared_grads = [p.grad for p in shared if p.grad is not None]
    local = torch.zeros((), dtype=torch.float64, device=device)
    for grad in [*grads, *(shared_grads if counts_shared else [])]:
        local += grad.detach().double().pow(2).sum().to(local.device)
    dist.all_reduce(local, group=group)
    total = math.sqrt(local.item())
    coefficient = clip_val / (total + 1e-6)
    if coefficient < 1:
        for grad in [*grads, *shared_grads]:
            grad.detach().mul_(coefficient)
