"""BatchNorm that normalizes each micro-batch but tracks running statistics over the whole mini-batch."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Module
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_balanced.pipeline.checkpoint import is_recomputing

__all__ = ["DeferredBatchNorm"]

_CONVERTIBLE = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)


class DeferredBatchNorm(_BatchNorm):
    r"""BatchNorm that normalizes each micro-batch but updates running statistics once, from the whole mini-batch.

    Each micro-batch is normalized with its own statistics, as GPipe does, but the running statistics are those of the
    whole mini-batch.

    In training, every forward pass of a micro-batch (outside a recomputation, :func:`is_recomputing`) adds the
    micro-batch's per-channel count, mean and centered sum of squares to an accumulator, merged with Chan et al.'s
    parallel formula in float32 (float64 for float64 running statistics); :meth:`commit`, called by the pipeline once
    all micro-batches of a mini-batch went through, updates ``running_mean`` and ``running_var`` (with the unbiased
    variance) and ``num_batches_tracked`` exactly once, as :class:`torch.nn.BatchNorm2d` would for the whole
    mini-batch. In eval mode it is plain BatchNorm. Its ``state_dict`` has the keys of the BatchNorm it replaces.

    Args:
        num_features, eps, momentum, affine, track_running_stats, device, dtype: as for
            :class:`torch.nn.BatchNorm2d`; ``momentum=None`` is the cumulative average over ``num_batches_tracked``.

    Shape:
        Input :math:`(N, C, *)` with 0 to 3 trailing dimensions; output of the same shape and dtype.

    Source: ``DeferredBatchNorm`` of torchgpipe (Lee et al., 2020); the running-statistics update of
    :class:`torch.nn.BatchNorm2d`; Chan, Golub & LeVeque (1979) for merging moments.
    """

    _original_class: type[_BatchNorm] = torch.nn.BatchNorm2d

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reset_accumulator()

    def _check_input_dim(self, input: Tensor) -> None:
        if input.dim() < 2 or input.dim() > 5:
            raise ValueError(f"expected 2D to 5D input (got {input.dim()}D input)")

    def reset_accumulator(self) -> None:
        """Forget the micro-batches tracked since the last :meth:`commit`."""
        self._count = 0
        self._mean: Tensor | None = None
        self._m2: Tensor | None = None

    def _track(self, input: Tensor) -> None:
        assert self.running_mean is not None
        dtype = torch.float64 if self.running_mean.dtype == torch.float64 else torch.float32
        with torch.no_grad():
            x = input.detach().to(dtype).transpose(0, 1).reshape(input.shape[1], -1)
            count = x.shape[1]
            mean = x.mean(1)
            m2 = ((x - mean[:, None]) ** 2).sum(1)
            if self._mean is None or self._m2 is None:
                self._count, self._mean, self._m2 = count, mean, m2
                return
            total = self._count + count
            delta = mean - self._mean
            self._mean = self._mean + delta * (count / total)
            self._m2 = self._m2 + m2 + delta**2 * (self._count * count / total)
            self._count = total

    def commit(self) -> None:
        """Update the running statistics from the micro-batches tracked since the last commit; a no-op if none."""
        if self._mean is None or self._m2 is None or not self.track_running_stats:
            self.reset_accumulator()
            return
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            var = self._m2 / max(self._count - 1, 1)
            self.running_mean.mul_(1 - factor).add_(self._mean.to(self.running_mean.dtype), alpha=factor)
            self.running_var.mul_(1 - factor).add_(var.to(self.running_var.dtype), alpha=factor)
        self.reset_accumulator()

    def forward(self, input: Tensor) -> Tensor:
        """Normalize ``input`` (a micro-batch); in training, also track it for :meth:`commit`."""
        self._check_input_dim(input)
        if not (self.training and self.track_running_stats):
            use_batch = self.training or self.running_mean is None
            return F.batch_norm(
                input, self.running_mean, self.running_var, self.weight, self.bias, use_batch, 0.0, self.eps
            )
        if not is_recomputing():
            self._track(input)
        return F.batch_norm(input, None, None, self.weight, self.bias, True, 0.0, self.eps)

    @classmethod
    def convert_deferred_batch_norm(cls, module: Module) -> Module:
        """Replace every ``nn.BatchNorm1d/2d/3d`` in ``module`` by a :class:`DeferredBatchNorm`.

        The replacement holds the same parameters and buffers (the same tensors) and forward hooks. Returns the
        converted module (``module`` itself unless it is a BatchNorm).
        """
        if type(module) in _CONVERTIBLE:
            assert isinstance(module, _BatchNorm)
            converted = cls(module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats)
            converted._original_class = type(module)
            _move_state(module, converted)
            return converted
        for name, child in module.named_children():
            replacement = cls.convert_deferred_batch_norm(child)
            if replacement is not child:
                module.add_module(name, replacement)
        return module

    @classmethod
    def revert_deferred_batch_norm(cls, module: Module) -> Module:
        """Undo :meth:`convert_deferred_batch_norm`: each :class:`DeferredBatchNorm` becomes its original class again.

        The parameters, buffers and forward hooks are carried over.
        """
        if isinstance(module, DeferredBatchNorm):
            reverted = module._original_class(
                module.num_features, module.eps, module.momentum, module.affine, module.track_running_stats
            )
            _move_state(module, reverted)
            return reverted
        for name, child in module.named_children():
            replacement = cls.revert_deferred_batch_norm(child)
            if replacement is not child:
                module.add_module(name, replacement)
        return module


def _move_state(source: _BatchNorm, target: _BatchNorm) -> None:
    for name in ("weight", "bias"):
        target._parameters[name] = source._parameters.get(name)
    for name in ("running_mean", "running_var", "num_batches_tracked"):
        target._buffers[name] = source._buffers.get(name)
    target.train(source.training)
    for hooks in (
        "_forward_hooks",
        "_forward_hooks_with_kwargs",
        "_forward_hooks_always_called",
        "_forward_pre_hooks",
        "_forward_pre_hooks_with_kwargs",
    ):
        if hasattr(source, hooks):
            setattr(target, hooks, getattr(source, hooks))
