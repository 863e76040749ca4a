"""Device-generic SyncBatchNorm: batch statistics over all ranks of a process group, on any backend (gloo/CPU too).

torch's :class:`torch.nn.SyncBatchNorm` raises on CPU tensors in training mode, so CPU (gloo) DDP runs cannot use it.
:class:`SyncBatchNorm` here has the same constructor, the same running-statistics semantics and the same
``convert_sync_batchnorm`` entry point, and works on every device and backend that supports ``all_gather`` and
``all_reduce``. It adds :meth:`SyncBatchNorm.revert_sync_batchnorm`, which restores the user's own BatchNorm classes
(strategy teardown).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_balanced.nn.conversion import convert_batchnorm, revert_batchnorm
from lightning_balanced.nn.moments import batch_moments, check_batchnorm_input, combine_moments, moments_dtype

__all__ = ["SyncBatchNorm"]

# Attributes a converted module keeps to rebuild the original module in ``revert_sync_batchnorm``.
_ORIGINAL_CLS_ATTR = "_original_batchnorm_cls"
_ORIGINAL_STATE_ATTR = "_original_batchnorm_state"


def _accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 input, float32 for everything narrower (float16, bfloat16, float32)."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _reduce_dims(input: Tensor) -> list[int]:
    """Every dimension but the channel dimension 1."""
    return [0, *range(2, input.dim())]


def _per_channel(t: Tensor, input: Tensor) -> Tensor:
    """A ``(C,)`` tensor viewed as ``(1, C, 1, ...)`` to broadcast against ``input``."""
    return t.view(1, -1, *([1] * (input.dim() - 2)))


class _SyncBatchNormFunction(torch.autograd.Function):
    """Batch normalization with statistics gathered over a process group; backward reduces over it too.

    Forward: one ``all_gather`` of each rank's ``[count, mean, M2]`` (shape ``(2C + 1,)``, float64), combined by
    Chan's parallel formula (:func:`~lightning_balanced.nn.moments.combine_moments`) into the global mean and
    biased variance. Backward: one ``all_reduce`` of ``[sum(dy), sum(dy * xhat)]`` (shape ``(2C,)``), the two
    sums that the input gradient of full-batch BN depends on. Weight and bias gradients stay local, as in torch's
    SyncBatchNorm: the data-parallel gradient reduction (DDP) combines them like every other parameter gradient.
    """

    @staticmethod
    def forward(
        ctx: Any,
        input: Tensor,
        weight: Tensor | None,
        bias: Tensor | None,
        running_mean: Tensor | None,
        running_var: Tensor | None,
        eps: float,
        momentum: float,
        process_group: Any,
    ) -> Tensor:
        num_channels = input.shape[1]
        acc_dtype = _accumulation_dtype(input.dtype)
        x = input.to(acc_dtype)
        # Local moments (shifted sums, mean and M2 formed in float64), gathered as one packed [count, mean, M2] per
        # rank (shape (2C + 1,), float64, so counts stay exact); a rank with zero samples contributes count 0 (every
        # rank must call the collective).
        red_dtype = moments_dtype(input.device)
        local = batch_moments(x, _reduce_dims(input), dtype=red_dtype)
        packed = torch.cat([local.count.to(red_dtype).view(1), local.mean, local.m2])
        gathered = packed.new_empty(dist.get_world_size(process_group), packed.numel())
        dist.all_gather(list(gathered.unbind(0)), packed, group=process_group)
        counts, means, m2s = gathered.split([1, num_channels, num_channels], dim=1)
        total = combine_moments(counts.squeeze(1), means, m2s)
        total_count = round(total.count.item())
        if total_count <= 1:
            # Every rank sees the same global count, so every rank raises here: no rank is left in a collective.
            raise ValueError(
                f"Expected more than 1 value per channel when training, got {total_count} over the process group "
                f"(local input size {list(input.shape)})"
            )

        mean, var = total.mean, total.variance()
        invstd = torch.rsqrt(var + eps).to(acc_dtype)

        if running_mean is not None and running_var is not None:
            unbiased_var = total.variance(unbiased=True)
            running_mean.mul_(1.0 - momentum).add_(mean.to(running_mean.dtype), alpha=momentum)
            running_var.mul_(1.0 - momentum).add_(unbiased_var.to(running_var.dtype), alpha=momentum)

        # Normalize with the global statistics: torch's own (eval-mode) batch_norm kernel, one fused pass.
        mean, var = mean.to(acc_dtype), var.to(acc_dtype)
        output = F.batch_norm(
            x,
            mean,
            var,
            None if weight is None else weight.to(acc_dtype),
            None if bias is None else bias.to(acc_dtype),
            False,
            0.0,
            eps,
        ).to(input.dtype)

        ctx.save_for_backward(input, weight, mean, invstd)
        ctx.total_count = total_count
        ctx.process_group = process_group
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: Tensor) -> tuple[Tensor | None, ...]:
        input, weight, mean, invstd = ctx.saved_tensors
        acc_dtype = mean.dtype
        x, dy = input.to(acc_dtype), grad_output.to(acc_dtype)
        # Local per-channel sum(dy) and sum(dy * xhat), xhat = (x - mean) * invstd with the GLOBAL mean/invstd: the
        # reduction part of torch's batch-norm backward kernel (output_mask: no grad_input) computes exactly these.
        if x.numel() > 0:
            _, sum_dy_xhat, sum_dy = torch.ops.aten.native_batch_norm_backward(
                dy, x, None, None, None, mean, invstd, True, 0.0, [False, True, True]
            )
        else:  # the CPU kernel divides by the local count (SIGFPE on a rank with zero samples)
            sum_dy_xhat, sum_dy = torch.zeros_like(mean), torch.zeros_like(mean)

        grad_input = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            # needs_input_grad is the same on every rank (same graph), so either all ranks reduce here or none does;
            # a rank with zero samples reduces zeros.
            packed = torch.cat([sum_dy, sum_dy_xhat])
            dist.all_reduce(packed, op=dist.ReduceOp.SUM, group=ctx.process_group)
            mean_dy, mean_dy_xhat = (packed / ctx.total_count).chunk(2)
            # grad = (dy - mean(dy) - xhat * mean(dy * xhat)) * invstd * weight, computed as
            # (x - mean) * k + dy * scale + c, per channel k = -scale * invstd * mean(dy * xhat), c = -scale * mean(dy).
            scale = invstd if weight is None else invstd * weight.to(acc_dtype)
            grad = (x - _per_channel(mean, x)).mul_(_per_channel(-scale * invstd * mean_dy_xhat, x))
            grad.addcmul_(dy, _per_channel(scale, x)).add_(_per_channel(-scale * mean_dy, x))
            grad_input = grad.to(input.dtype)
        if weight is not None and ctx.needs_input_grad[1]:
            grad_weight = sum_dy_xhat.to(weight.dtype)
        if ctx.needs_input_grad[2]:
            grad_bias = sum_dy.to(grad_output.dtype if weight is None else weight.dtype)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    r"""Batch normalization whose training statistics span every rank of a process group, on any device and backend.

    A drop-in for :class:`torch.nn.SyncBatchNorm` that also works on CPU tensors with the gloo backend (torch's raises
    there in training mode). In training with a process group of world size > 1, each rank computes per-channel
    ``(count, mean, M2)`` of its local batch (``M2`` the centered sum of squares) in float32 (float64 for float64
    input), and **one** ``all_gather`` of the packed ``(2C + 1,)`` tensors gives every rank all of them; Chan's
    parallel formula combines them into the statistics of the concatenated batch of all ranks. Because the
    combination is count-weighted, ranks may hold different numbers of samples, including none: the
    outputs, the running statistics and the input gradients equal those of a single :class:`torch.nn.BatchNorm2d`
    (1d/3d) on the concatenated batch. The backward pass issues one more ``all_reduce`` (of ``(2C,)`` per-channel
    sums of ``dy`` and ``dy * xhat``). Weight and bias gradients are each rank's own contribution, as in torch's
    SyncBatchNorm: DDP's gradient reduction combines them.

    .. math::

        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \gamma + \beta

    with mean and biased variance over the batch and spatial dimensions of all ranks; the running variance is updated
    with the unbiased variance, ``momentum`` as in :class:`torch.nn.BatchNorm2d` (``None``: cumulative average over
    ``num_batches_tracked``).

    When it communicates: only in training mode (``module.training``), with an initialized process group of world
    size > 1, as in torch. In eval mode with running statistics it is plain ``F.batch_norm`` with no communication;
    in eval mode without running statistics (``track_running_stats=False``) it normalizes with the local batch's
    statistics, also without communication (torch's semantics, and no collective in evaluation loops whose ranks may
    run different numbers of batches). With no process group, or one of world size 1, it is exactly
    :class:`torch.nn.BatchNorm2d` (1d/3d).

    Collective contract: every rank of the group must run the same number of training forward passes through each
    SyncBatchNorm, in the same order, and, when the input requires grad, the same number of backward passes through
    them, **including ranks with zero samples** (feed a ``(0, C, ...)`` tensor and backpropagate its empty output, for
    example ``loss = out.sum() * 0 + ...``). A rank that skips one leaves the others waiting in the collective; that
    wait ends only with the process group's timeout, set by ``torch.distributed.init_process_group(timeout=...)``
    (gloo's default is 30 minutes), after which the waiting ranks raise.

    Precision: the variance never goes through ``E[x^2] - E[x]^2`` (which cancels catastrophically in float32 once
    ``|mean| / std`` reaches about ``1e3``). Each rank's mean and M2 come from sums of the data shifted by a rough mean
    (formed in float64), and the gathered parts are combined in float64 with no cancellation, so float32 input
    at ``|mean| / std`` up to ``1e4`` is normalized about as accurately as torch's own float32 BatchNorm (within a
    factor of a few of its error against a float64 reference). torch's CUDA SyncBatchNorm likewise gathers per-rank
    (mean, invstd, count).

    Args:
        num_features (int): :math:`C` of an input of shape :math:`(N, C)`, :math:`(N, C, L)`, :math:`(N, C, H, W)` or
            :math:`(N, C, D, H, W)`.
        eps (float): added to the variance for numerical stability. Default: ``1e-5``.
        momentum (float, optional): weight of the new batch statistic in the running statistics; ``None`` for a
            cumulative moving average. Default: ``0.1``.
        affine (bool): learnable per-channel weight and bias. Default: ``True``.
        track_running_stats (bool): keep ``running_mean``/``running_var``/``num_batches_tracked`` buffers; without
            them batch statistics are used in eval mode as well. Default: ``True``.
        process_group (ProcessGroup, optional): the group whose ranks share statistics; ``None`` is the default
            (world) group.
        device (torch.device, optional): device of the parameters and buffers.
        dtype (torch.dtype, optional): dtype of the parameters and buffers.
        bias (bool): with ``affine``, learn an additive bias. Keyword-only. Default: ``True``.

    Shape:
        - Input: :math:`(N, C, *)` with 0 to 3 trailing dimensions, float16/bfloat16/float32/float64; ``N`` may
          differ between ranks and may be 0 on some of them.
        - Output: same shape and dtype as the input.

    Raises:
        ValueError: (in ``forward``) an input that is not 2D to 5D, whose channel dimension is not ``num_features``,
            or, in training, fewer than 2 values per channel over the whole group (raised on every rank alike).

    Source: Ioffe & Szegedy, "Batch Normalization: Accelerating Deep Network Training by Reducing Internal Covariate
    Shift" (ICML 2015); Chan, Golub & LeVeque's parallel variance formula for combining the ranks; the module
    interface, running-statistics update and gradient semantics of :class:`torch.nn.SyncBatchNorm`.

    Example::

        >>> model = SyncBatchNorm.convert_sync_batchnorm(model)  # before wrapping the model in DDP
        >>> ...  # train
        >>> model = SyncBatchNorm.revert_sync_batchnorm(model)  # back to the original BatchNorm classes
    """

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        process_group: Any | None = None,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        *,
        bias: bool = True,
    ) -> None:
        # ``bias`` is passed on only when False, so torch versions whose _BatchNorm has no ``bias`` argument still work.
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        if affine and not bias:
            self.register_parameter("bias", None)
        self.process_group = process_group

    def _check_input_dim(self, input: Tensor) -> None:
        check_batchnorm_input(self, input)

    def _sync_world_size(self) -> tuple[Any, int]:
        """The process group to reduce over and its size; size 1 when there is nothing to synchronize with."""
        if not (dist.is_available() and dist.is_initialized()):
            return None, 1
        group = self.process_group if self.process_group is not None else dist.group.WORLD
        return group, dist.get_world_size(group)

    def forward(self, input: Tensor) -> Tensor:
        """Normalize ``input`` with statistics over all ranks (training) or with the running statistics (eval).

        Args:
            input (Tensor[N, C, *]): 2D to 5D, floating point; ``N`` may be 0 on some ranks in synchronized training.

        Returns:
            Tensor: same shape and dtype as ``input``.

        Raises:
            ValueError: bad input shape, or fewer than 2 values per channel in training.
        """
        self._check_input_dim(input)

        # The same factor logic as torch's _BatchNorm.forward.
        exponential_average_factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats and self.num_batches_tracked is not None:
            self.num_batches_tracked.add_(1)
            if self.momentum is None:  # cumulative moving average
                exponential_average_factor = 1.0 / float(self.num_batches_tracked)
            else:  # exponential moving average
                exponential_average_factor = self.momentum

        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        # Buffers are updated only in training with tracking, and read only in eval.
        running_mean = self.running_mean if not self.training or self.track_running_stats else None
        running_var = self.running_var if not self.training or self.track_running_stats else None

        process_group, world_size = self._sync_world_size() if self.training else (None, 1)
        if world_size <= 1:
            return F.batch_norm(
                input,
                running_mean,
                running_var,
                self.weight,
                self.bias,
                bn_training,
                exponential_average_factor,
                self.eps,
            )
        output: Tensor = _SyncBatchNormFunction.apply(
            input,
            self.weight,
            self.bias,
            running_mean,
            running_var,
            self.eps,
            exponential_average_factor,
            process_group,
        )
        return output

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module, process_group: Any | None = None) -> torch.nn.Module:
        """Replace every BatchNorm layer of ``module`` (recursively) with a :class:`SyncBatchNorm`.

        Each ``_BatchNorm`` that is not already a :class:`SyncBatchNorm` of this package (BatchNorm1d/2d/3d, user
        subclasses, and torch's own ``nn.SyncBatchNorm``) becomes one that shares its parameters (so
        ``requires_grad`` and optimizer references carry over) and buffers (a subclass's extra ones too, so the
        state-dict keys stay the layer's), and copies its hyperparameters, training flag and ``qconfig``. The new
        module remembers the original class (attribute ``_original_batchnorm_cls``) and the original's other
        attributes for :meth:`revert_sync_batchnorm`.

        Args:
            module (nn.Module): a model, or a single BatchNorm layer.
            process_group (ProcessGroup, optional): the group to synchronize over; ``None`` is the world group.

        Returns:
            nn.Module: ``module`` with its BatchNorm children replaced in place, or a new :class:`SyncBatchNorm` if
            ``module`` itself is a BatchNorm layer.

        Raises:
            ValueError: a lazy BatchNorm layer that has not been initialized yet (run one forward first).

        Source: :meth:`torch.nn.SyncBatchNorm.convert_sync_batchnorm`.
        """

        def build(layer: _BatchNorm) -> SyncBatchNorm:
            sync = cls(
                layer.num_features,
                layer.eps,
                layer.momentum,
                layer.affine,
                layer.track_running_stats,
                process_group,
                device="meta",
                bias=layer.bias is not None,
            )
            if hasattr(layer, "qconfig"):
                sync.qconfig = layer.qconfig
            original_state = {k: v for k, v in vars(layer).items() if k not in ("_parameters", "_buffers", "_modules")}
            object.__setattr__(sync, _ORIGINAL_CLS_ATTR, type(layer))
            object.__setattr__(sync, _ORIGINAL_STATE_ATTR, original_state)
            return sync

        return convert_batchnorm(module, build, SyncBatchNorm)

    @classmethod
    def revert_sync_batchnorm(cls, module: torch.nn.Module) -> torch.nn.Module:
        """Undo :meth:`convert_sync_batchnorm`: restore the original BatchNorm classes with their current state.

        Every :class:`SyncBatchNorm` made by :meth:`convert_sync_batchnorm` becomes a new instance of the class it
        replaced (BatchNorm1d/2d/3d or a user subclass, with the original's other attributes and hooks), holding the
        current parameters, buffers, hyperparameters and training flag of the SyncBatchNorm. A SyncBatchNorm built
        directly (no original class recorded) is left as it is.

        Args:
            module (nn.Module): a model, or a single converted layer.

        Returns:
            nn.Module: ``module`` with its converted children restored in place, or the restored layer if ``module``
            itself is a converted layer.

        Source: the inverse of :meth:`torch.nn.SyncBatchNorm.convert_sync_batchnorm` (torch has none; mmcv's
        ``revert_sync_batchnorm`` is the closest).
        """

        def original(stand_in: torch.nn.Module) -> _BatchNorm | None:
            original_cls = getattr(stand_in, _ORIGINAL_CLS_ATTR, None) if isinstance(stand_in, SyncBatchNorm) else None
            if original_cls is None:
                return None
            # Rebuilt without calling the original constructor, whose signature a user subclass may have changed.
            restored: _BatchNorm = original_cls.__new__(original_cls)
            restored.__dict__.update(getattr(stand_in, _ORIGINAL_STATE_ATTR))
            restored.__dict__.update(_parameters={}, _buffers={}, _modules={})
            return restored

        return revert_batchnorm(module, original)
