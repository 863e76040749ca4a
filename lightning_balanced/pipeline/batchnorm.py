"""BatchNorm that normalizes each micro-batch but tracks running statistics over the whole mini-batch."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn import Module
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_balanced.nn.conversion import convert_batchnorm, revert_batchnorm
from lightning_balanced.nn.moments import Moments, batch_moments, check_batchnorm_input, combine_moments, moments_dtype
from lightning_balanced.pipeline.recompute import is_recomputing

__all__ = ["DeferredBatchNorm"]

_CONVERTIBLE = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)


class DeferredBatchNorm(_BatchNorm):
    r"""BatchNorm that normalizes each micro-batch but updates running statistics once, from the whole mini-batch.

    Each micro-batch is normalized with its own statistics, as GPipe does, but the running statistics are those of the
    whole mini-batch.

    In training, every forward pass of a micro-batch (outside a recomputation, :func:`is_recomputing`) records the
    micro-batch's per-channel count, mean and centered sum of squares
    (:func:`~lightning_balanced.nn.moments.batch_moments`: sums in float32, float64 for float64 running statistics;
    moments in float64, float32 on MPS). :meth:`commit`, called by the pipeline once all micro-batches of a
    mini-batch went through, merges them with Chan et al.'s parallel formula
    (:func:`~lightning_balanced.nn.moments.combine_moments`) and updates ``running_mean`` and ``running_var`` (with
    the unbiased variance) and ``num_batches_tracked`` exactly once, as :class:`torch.nn.BatchNorm2d` would for the
    whole mini-batch. In eval mode it is plain BatchNorm. Its ``state_dict`` has the keys of the BatchNorm it replaces.

    Args:
        num_features, eps, momentum, affine, track_running_stats, device, dtype: as for
            :class:`torch.nn.BatchNorm2d`; ``momentum=None`` is the cumulative average over ``num_batches_tracked``.

    Shape:
        Input :math:`(N, C, *)` with 0 to 3 trailing dimensions; output of the same shape and dtype.

    Source: ``DeferredBatchNorm`` of torchgpipe (Lee et al., 2020); the running-statistics update of
    :class:`torch.nn.BatchNorm2d`; Chan, Golub & LeVeque (1979) for merging moments.
    """

    #: The class :meth:`revert_deferred_batch_norm` makes for a layer that replaced none (one built directly).
    _original_class: type[_BatchNorm] = torch.nn.BatchNorm2d
    #: The user's BatchNorm object this layer stands in for. Set by :meth:`convert_deferred_batch_norm`.
    _user_batchnorm: _BatchNorm | None = None

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.reset_accumulator()

    def _check_input_dim(self, input: Tensor) -> None:
        check_batchnorm_input(self, input)

    def reset_accumulator(self) -> None:
        """Forget the micro-batches tracked since the last :meth:`commit`."""
        self._parts: list[Moments] = []

    def _track(self, input: Tensor) -> None:
        assert self.running_mean is not None
        dtype = torch.float64 if self.running_mean.dtype == torch.float64 else torch.float32
        with torch.no_grad():
            x = input.detach().to(dtype)
            dims = [0, *range(2, x.dim())]
            self._parts.append(batch_moments(x, dims, dtype=moments_dtype(x.device)))

    def tracked(self) -> Moments | None:
        """The moments of the micro-batches tracked since the last :meth:`commit` (``None``: none were)."""
        parts = self._parts
        if not parts:
            return None
        with torch.no_grad():
            return combine_moments(
                torch.stack([part.count for part in parts]),
                torch.stack([part.mean for part in parts]),
                torch.stack([part.m2 for part in parts]),
            )

    def commit(self, total: Moments | None = None) -> None:
        """Update the running statistics from the micro-batches tracked since the last commit; a no-op if none.

        Args:
            total (Moments, optional): the moments to commit instead of :meth:`tracked`'s, e.g. those of several
                data-parallel replicas' micro-batches merged (``strategy="pipeline"``).
        """
        if total is None:
            total = self.tracked()
        self.reset_accumulator()
        if total is None or not self.track_running_stats:
            return
        assert self.running_mean is not None and self.running_var is not None
        assert self.num_batches_tracked is not None
        with torch.no_grad():
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
            var = total.m2 / (total.count - 1).clamp_min(1)  # unbiased
            self.running_mean.mul_(1 - factor).add_(total.mean.to(self.running_mean.dtype), alpha=factor)
            self.running_var.mul_(1 - factor).add_(var.to(self.running_var.dtype), alpha=factor)

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

        Only those three classes are replaced (not their subclasses, whose ``forward`` may differ). The replacement
        holds the same parameters and buffers (the same tensors), training flag and forward hooks (the same hook
        dicts), through :func:`~lightning_balanced.nn.conversion.convert_batchnorm`, and keeps the user's layer for
        :meth:`revert_deferred_batch_norm`. Returns the converted module (``module`` itself unless it is a BatchNorm).
        """

        def build(layer: _BatchNorm) -> DeferredBatchNorm:
            deferred = cls(
                layer.num_features, layer.eps, layer.momentum, layer.affine, layer.track_running_stats, device="meta"
            )
            deferred._original_class = type(layer)
            object.__setattr__(deferred, "_user_batchnorm", layer)  # not registered as a child module
            return deferred

        return convert_batchnorm(
            module, build, cls, convertible=lambda layer: type(layer) in _CONVERTIBLE, carry_hooks=True
        )

    @classmethod
    def revert_deferred_batch_norm(cls, module: Module) -> Module:
        """Undo :meth:`convert_deferred_batch_norm`: each :class:`DeferredBatchNorm` becomes its original class again.

        A converted layer gives back the user's very BatchNorm object; one built directly becomes a new
        ``nn.BatchNorm2d``. Either holds the current parameters, buffers, hyperparameters, training flag and forward
        hooks of the :class:`DeferredBatchNorm` (:func:`~lightning_balanced.nn.conversion.revert_batchnorm`).
        """

        def original(stand_in: Module) -> _BatchNorm | None:
            if not isinstance(stand_in, DeferredBatchNorm):
                return None
            if stand_in._user_batchnorm is not None:
                return stand_in._user_batchnorm
            return stand_in._original_class(
                stand_in.num_features,
                stand_in.eps,
                stand_in.momentum,
                stand_in.affine,
                stand_in.track_running_stats,
                device="meta",  # its parameters and buffers are the stand-in's
            )

        return revert_batchnorm(module, original, carry_hooks=True)
