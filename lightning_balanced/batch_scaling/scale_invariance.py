"""Scale invariance: change the number of processes and keep the training curve.

When the effective batch size grows by ``kappa = effective / reference`` over the batch the hyperparameters were tuned
at, the scaling rules say how to change them so that training follows the same curve per sample seen:

* ``"linear"``: learning rate ``x kappa`` (Goyal et al. 2017, "Accurate, Large Minibatch SGD"; SGD);
* ``"sqrt"``: learning rate ``x sqrt(kappa)`` (Krizhevsky 2014; Hoffer et al. 2017);
* ``"adam_sde"``: the square-root rule of the SDE view of adaptive methods (Malladi, Lyu, Panigrahi & Arora,
  NeurIPS 2022): learning rate ``x sqrt(kappa)``, ``1 - beta1`` and ``1 - beta2`` ``x kappa`` (RMSprop's ``alpha`` as
  beta2), ``eps / sqrt(kappa)``;
* ``"ema"``, composable with any of those: every exponential moving average's momentum ``rho -> rho ** kappa``
  (Busbridge et al., NeurIPS 2023, "How to Scale Your EMA"): BatchNorm's running statistics (torch's ``momentum`` is
  ``1 - rho``), the decay of Lightning's ``EMAWeightAveraging`` and of a torch ``AveragedModel`` EMA. The rule takes
  each update of an EMA to see the whole effective batch; under data parallelism without SyncBatchNorm each rank's
  BatchNorm sees only its own batch, so the running statistics are also averaged over the data-parallel ranks after
  every training batch (an EMA is linear: that is the EMA of the ranks' mean statistics). Otherwise rank 0's running
  statistics would average ``kappa`` times fewer samples than one process's, and evaluate worse.

Schedules and warmup are counted in samples (:class:`ScaleInvariance`'s ``warmup_samples`` and
``schedules_in_samples``), so the same config means the same thing on 1 or 8 processes: the warmup ramp is a function
of samples seen, run on every scale (``kappa = 1`` included), each step taking its mean over the samples it consumes.

Which rule fits depends on the job: the square-root rules assume batches well below the gradient noise scale
(Malladi et al., section 5), the linear rule batches near or above it. ``measure_noise_scale=True`` measures it under
DDP (:mod:`lightning_balanced.batch_scaling.noise_scale`) and says when the effective batch is above it.

The rules are pure functions of ``kappa`` in :mod:`lightning_balanced.batch_scaling.lr_scaling` (:class:`ScalingPolicy`,
:func:`scaled_hyperparameters`, :func:`scaled_ema_momentum`), shared with ``ddp_lr_*``; the callback applies them once
per fit, from the reference values, so nothing ever compounds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.utilities import rank_zero_warn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from torch.optim.swa_utils import AveragedModel, get_ema_avg_fn, get_ema_multi_avg_fn
from typing_extensions import override

from lightning_balanced.arguments import check_bool, check_int
from lightning_balanced.batch_scaling.lr_scaling import (
    EMA_RULE_SOURCE,
    LR_RULES,
    ScalingPolicy,
    data_parallel_size,
    rescale_learning_rates,
    scaled_ema_momentum,
    scaled_hyperparameters,
    warmup_in_samples,
)
from lightning_balanced.batch_scaling.noise_scale import GradientNoiseScale
from lightning_balanced.nn.sync_batchnorm import SyncBatchNorm
from lightning_balanced.ranks.reports import rank_zero_report

__all__ = [
    "LR_RULES",
    "REFERENCE_KEY",
    "ScaleInvariance",
    "ScalingPolicy",
    "average_running_statistics",
    "data_parallel_size",
    "scaled_ema_momentum",
    "scaled_hyperparameters",
]

#: The key each param group keeps its reference (unscaled) hyperparameters under; saved with the optimizer state.
REFERENCE_KEY = "scale_invariance_reference"


class ScaleInvariance(Callback):
    """Rescale the hyperparameters with the effective batch size, so the training curve stays the same on any scale.

    At the start of each fit (after a checkpoint was restored), with ``kappa = effective / reference_batch_size`` and
    the effective batch size = data-parallel world size x per-device batch x ``accumulate_grad_batches``, it applies the
    policy once (see the module docstring): every param group's learning rate (and ``initial_lr``, OneCycleLR's range,
    every scheduler's base and floor learning rates, through
    :func:`~lightning_balanced.batch_scaling.lr_scaling.rescale_learning_rates`), Adam's ``betas`` and ``eps``,
    RMSprop's ``alpha`` and ``eps``; with ``"ema"``, every BatchNorm's ``momentum``, the decay of Lightning's
    ``EMAWeightAveraging`` (Lightning 2.6+) and that of every ``torch.optim.swa_utils.AveragedModel`` the
    LightningModule holds whose update function is torch's ``get_ema_avg_fn``/``get_ema_multi_avg_fn``. One line is
    logged per rescaled value: before, after, and the rule's source.

    Resume-safe: the applied LR factor and each group's reference hyperparameters are stored in the param groups, hence
    in every checkpoint; a resume on another world size rescales from the references, never compounding. BatchNorm
    momentum and the EMA decay return to their reference values at the end of fit.

    Works under any strategy: ``ddp``, ``balanced_dp`` and ``gpipe`` (the batch is the whole one), ``pipeline`` (its
    data-parallel size). Not with ``ddp_lr_*`` scaling too: such a run is refused with a ``ValueError``, never scaled
    twice.

    Args:
        policy: ``"linear"``, ``"sqrt"``, ``"adam_sde"``, or a list adding ``"ema"`` (``["adam_sde", "ema"]``), or a
            :class:`ScalingPolicy`.
        reference_batch_size (int): the effective batch size the hyperparameters were tuned at.
        warmup_samples (int): linear warmup counted in samples, on every scale (one process included): the learning
            rate rises linearly from 0 to its (scaled) value over the first ``warmup_samples`` samples seen by all
            ranks, each step taking the ramp's mean over the samples it consumes
            (:func:`~lightning_balanced.batch_scaling.lr_scaling.warmup_in_samples`), so every scale sees the same
            learning rate per sample. The samples seen are saved in checkpoints (this callback's state), so a resume on
            another number of processes continues the ramp where it was.
        schedules_in_samples (bool): step-interval LR schedulers advance by ``kappa`` steps per optimizer step (their
            steps count reference batches), so a schedule means the same number of samples on any scale.
        measure_noise_scale (bool): under DDP with 2 or more processes, measure the gradient noise scale
            ``B_simple`` at every optimizer step from each rank's gradient and the all-reduced one
            (:class:`~lightning_balanced.batch_scaling.noise_scale.GradientNoiseScale`; McCandlish et al. 2018,
            Appendix A.1): one squared norm per parameter per backward, and one scalar ``all_reduce`` per step (the
            mean of the ranks' norms). It is logged as ``noise_scale`` per step and reported at the end of fit; with
            the ``"sqrt"`` or ``"adam_sde"`` rule, an effective batch at or above it draws a warning (those rules
            assume batches well below it). Elsewhere (one process, ``balanced_dp``, ``gpipe``, ``pipeline``, FSDP)
            the report says it was not measured.

    Raises:
        TypeError, ValueError: a bad argument, naming it; at fit start, a train dataloader whose batch size cannot be
            read, or an LR-scaled DDP strategy that scales too.
    """

    #: Read by :class:`~lightning_balanced.batch_scaling.factor_check.LRScaleFactorCheck`: a resumed factor is this
    #: callback's business.
    manages_lr_scale_factor = True

    def __init__(
        self,
        policy: str | Sequence[str] | ScalingPolicy,
        reference_batch_size: int,
        warmup_samples: int = 0,
        schedules_in_samples: bool = False,
        measure_noise_scale: bool = False,
    ) -> None:
        self.policy = ScalingPolicy.parse(policy)
        self.reference_batch_size = check_int("reference_batch_size", reference_batch_size, minimum=1)
        self.warmup_samples = check_int("warmup_samples", warmup_samples, minimum=0)
        self.schedules_in_samples = check_bool("schedules_in_samples", schedules_in_samples)
        self.measure_noise_scale = check_bool("measure_noise_scale", measure_noise_scale)
        #: One estimate per optimizer (by its index in ``trainer.optimizers``), with ``measure_noise_scale`` under DDP.
        self.noise_scales: dict[int, GradientNoiseScale] = {}
        self._local_sq: dict[torch.Tensor, torch.Tensor] = {}
        self.kappa = 1.0
        self.effective_batch_size = reference_batch_size
        #: Samples seen by all data-parallel ranks in the completed training batches of the run (saved in checkpoints).
        self.samples_seen = 0.0
        self._samples_per_batch = float(reference_batch_size)
        self._restored_samples: float | None = None
        self._momentum: dict[_BatchNorm, float] = {}
        self._averaged: list[tuple[AveragedModel, str, Any]] = []
        self._ema: list[tuple[Any, float]] = []
        self._hooks: list[Any] = []

    # ---- the batch -------------------------------------------------------------------------------------------------
    def _effective_batch_size(self, trainer: pl.Trainer) -> int:
        loader = trainer.train_dataloader
        batch_size = getattr(loader, "batch_size", None) or getattr(
            getattr(loader, "batch_sampler", None), "batch_size", None
        )
        if not isinstance(batch_size, int):
            raise ValueError(
                "ScaleInvariance needs the per-device batch size, but the train dataloader has none that can be read"
                " (a DataLoader with `batch_size` or a `batch_sampler.batch_size` is needed)"
            )
        return data_parallel_size(trainer.strategy) * batch_size * trainer.accumulate_grad_batches

    @override
    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        strategy = trainer.strategy
        lr_scaling = getattr(strategy, "lr_scaling", "none")  # ddp_lr_* and pipeline_lr_* scale it themselves
        if lr_scaling != "none":
            raise ValueError(
                f"ScaleInvariance and {type(strategy).__name__}(lr_scaling={lr_scaling!r}) both scale the"
                " learning rate: use `strategy='ddp'` with the callback, or the strategy alone (a `ddp_lr_*` name is"
                " the shorthand of ScaleInvariance('linear' or 'sqrt') for the learning rate only)"
            )

    @override
    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self.effective_batch_size = self._effective_batch_size(trainer)
        self.kappa = kappa = self.effective_batch_size / self.reference_batch_size
        self._samples_per_batch = self.effective_batch_size / trainer.accumulate_grad_batches
        if self._restored_samples is not None:  # from this callback's state in the checkpoint
            self.samples_seen, self._restored_samples = self._restored_samples, None
        else:  # a fresh run (0), or a checkpoint saved without this callback: its batches at today's batch size
            completed = trainer.fit_loop.epoch_loop.batch_progress.total.completed
            self.samples_seen = completed * self._samples_per_batch
        why = f"kappa {kappa:.6g} = effective batch {self.effective_batch_size} / reference {self.reference_batch_size}"
        lines = [f"scale invariance ({self.policy.lr_rule}{' + ema' if self.policy.ema else ''}): {why}"]
        source = LR_RULES[self.policy.lr_rule]
        for index, optimizer in enumerate(trainer.optimizers):
            schedulers = [c.scheduler for c in trainer.lr_scheduler_configs if c.scheduler.optimizer is optimizer]
            before = [_float(group["lr"]) for group in optimizer.param_groups]
            rescale_learning_rates(optimizer, schedulers, self.policy.lr_factor(kappa))
            for g, (group, old) in enumerate(zip(optimizer.param_groups, before, strict=True)):
                lines.append(f"  optimizer {index} group {g} lr: {old:.6g} -> {_float(group['lr']):.6g} ({source})")
                lines += self._scale_group(group, f"optimizer {index} group {g}", kappa, source)
            if self.warmup_samples:
                self._hooks += _warmup_hooks(optimizer, self)
        if self.schedules_in_samples:
            for config in trainer.lr_scheduler_configs:
                if config.interval == "step" and not isinstance(config.scheduler, SampleStepping):
                    config.scheduler = SampleStepping(config.scheduler, kappa)  # type: ignore[assignment]
        if self.policy.ema:
            lines += self._scale_emas(trainer, pl_module, kappa)
        if self.measure_noise_scale:
            lines.append(self._start_noise_scale(trainer, pl_module))
        rank_zero_report("\n".join(lines))

    # ---- the gradient noise scale ----------------------------------------------------------------------------------
    def _start_noise_scale(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> str:
        self.noise_scales = {}
        strategy = trainer.strategy
        # Each rank must hold the whole model's gradient of its own batch, which DDP then averages: a model wrapped in
        # DistributedDataParallel (not a pipeline's stages; balanced_ddp's data-parallel size is 1).
        whole_model = isinstance(strategy.model, DistributedDataParallel)
        if not whole_model or data_parallel_size(strategy) < 2:
            return "  gradient noise scale: not measured (it needs DDP with 2 or more processes)"

        def record(parameter: torch.Tensor) -> None:
            # After each backward's accumulation, before DDP writes the all-reduced gradient back: this rank's.
            assert parameter.grad is not None
            self._local_sq[parameter] = torch.linalg.vector_norm(parameter.grad, dtype=torch.float64).square()

        for parameter in pl_module.parameters():
            if parameter.requires_grad:
                self._hooks.append(parameter.register_post_accumulate_grad_hook(record))
        return "  gradient noise scale: measured at every optimizer step (McCandlish et al. 2018, Appendix A.1)"

    @override
    def on_before_optimizer_step(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, optimizer: Optimizer
    ) -> None:
        if not self._local_sq:
            return
        parameters = [p for group in optimizer.param_groups for p in group["params"]]
        local = [self._local_sq.pop(p) for p in parameters if p in self._local_sq]
        grads = [p.grad for p in parameters if p.grad is not None]
        if not local or not grads:
            return
        small = torch.stack([value.to(grads[0].device) for value in local]).sum()
        scaler = getattr(trainer.precision_plugin, "scaler", None)  # fp16 AMP: the local norms saw the scaled loss
        if scaler is not None:
            small = small / float(scaler.get_scale()) ** 2
        # The mean over the ranks of their small batches' squared norms: world_size times less noisy than one rank's,
        # and the same estimate on every rank (one scalar all_reduce per step).
        small = trainer.strategy.reduce(small, reduce_op="mean")
        big = torch.stack([torch.linalg.vector_norm(g, dtype=torch.float64) for g in grads]).square().sum()
        small_sq, big_sq = torch.stack([small, big.to(small)]).tolist()  # one read from the device per step
        if not (math.isfinite(small_sq) and math.isfinite(big_sq)):
            return  # a step GradScaler skips
        index = next(i for i, opt in enumerate(trainer.optimizers) if opt is optimizer)
        estimate = self.noise_scales.setdefault(index, GradientNoiseScale())
        small_batch = self.effective_batch_size / data_parallel_size(trainer.strategy)
        estimate.update(small_sq, small_batch, big_sq, self.effective_batch_size)
        if estimate.value is not None:
            name = "noise_scale" if index == 0 else f"noise_scale_optimizer_{index}"
            pl_module.log(name, estimate.value, on_step=True, on_epoch=False, rank_zero_only=True)

    def _report_noise_scale(self) -> None:
        for index, estimate in sorted(self.noise_scales.items()):
            value = estimate.value
            where = f"optimizer {index}: " if len(self.noise_scales) > 1 else ""
            if value is None:
                rank_zero_report(f"gradient noise scale: {where}no positive estimate of |G|^2 yet")
                continue
            ratio = self.effective_batch_size / value
            rank_zero_report(
                f"gradient noise scale: {where}B_simple {value:.4g} after {estimate.updates} steps; the effective"
                f" batch {self.effective_batch_size} is {ratio:.3g} x it (McCandlish et al. 2018)"
            )
            if ratio >= 1.0 and self.policy.lr_rule in ("sqrt", "adam_sde"):
                rank_zero_warn(
                    f"ScaleInvariance: the effective batch size {self.effective_batch_size} is {ratio:.3g} x the"
                    f" measured gradient noise scale B_simple {value:.4g}; the {self.policy.lr_rule!r} rule assumes"
                    " batches well below it (Malladi et al. 2022, section 5), so expect this run to learn less per"
                    " sample than the reference run; the 'linear' rule fits batches above it (McCandlish et al. 2018)"
                )

    def _scale_group(self, group: dict[str, Any], where: str, kappa: float, source: str) -> list[str]:
        keys = [key for key in ("betas", "alpha", "eps") if key in group]
        if not keys:
            return []
        reference = group.setdefault(REFERENCE_KEY, {key: group[key] for key in keys})
        scaled = scaled_hyperparameters(reference, kappa, self.policy)
        lines = []
        for key, value in scaled.items():
            if value != group[key]:
                lines.append(f"  {where} {key}: {group[key]} -> {value} ({source})")
            group[key] = value
        return lines

    def _scale_emas(self, trainer: pl.Trainer, pl_module: pl.LightningModule, kappa: float) -> list[str]:
        lines = []
        for name, module in pl_module.named_modules():
            if isinstance(module, _BatchNorm) and module.momentum is not None:
                reference = self._momentum.setdefault(module, float(module.momentum))
                module.momentum = scaled_ema_momentum(reference, kappa)
                lines.append(
                    f"  {name or 'module'} BatchNorm momentum: {reference} -> {module.momentum:.6g} ({EMA_RULE_SOURCE})"
                )
        for callback in trainer.callbacks:  # type: ignore[attr-defined]
            decay = _ema_decay(callback)
            if decay is not None:
                new = 1.0 - scaled_ema_momentum(1.0 - decay, kappa)
                _set_ema_decay(callback, new)
                self._ema.append((callback, decay))
                lines.append(f"  {type(callback).__name__} decay: {decay} -> {new:.6g} ({EMA_RULE_SOURCE})")
        # torch's AveragedModel held by the LightningModule (the EMA of Lightning < 2.6), made with get_ema_avg_fn or
        # get_ema_multi_avg_fn: its update function is rebuilt with the scaled decay, and put back at the end of fit.
        for name, averaged in pl_module.named_modules():
            if not isinstance(averaged, AveragedModel):
                continue
            for attribute in ("multi_avg_fn", "avg_fn"):
                function = getattr(averaged, attribute, None)
                decay = _closure_decay(function)
                if decay is None:
                    continue
                new = 1.0 - scaled_ema_momentum(1.0 - decay, kappa)
                setattr(averaged, attribute, _ema_function_like(function, new))
                self._averaged.append((averaged, attribute, function))
                lines.append(f"  {name} AveragedModel decay: {decay} -> {new:.6g} ({EMA_RULE_SOURCE})")
        return lines

    def step_start(self) -> float:
        """Samples seen before the samples of the optimizer step running now (inside the current training batch)."""
        return max(0.0, self.samples_seen + self._samples_per_batch - self.effective_batch_size)

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"samples_seen": self.samples_seen}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        samples = state_dict.get("samples_seen")  # absent from a state saved before the count existed
        self._restored_samples = None if samples is None else float(samples)

    @override
    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        # Before ModelCheckpoint's hook (Lightning runs checkpoint callbacks last), so a checkpoint counts this batch.
        self.samples_seen += self._samples_per_batch
        # Every batch, not only before the statistics are read: DDP broadcasts rank 0's buffers at each forward
        # (`broadcast_buffers`), which would drop the other ranks' updates of all but the last step.
        if self.policy.ema:
            average_running_statistics(pl_module, trainer.strategy)

    @override
    def on_fit_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._report_noise_scale()
        self._local_sq = {}
        for module, momentum in self._momentum.items():
            module.momentum = momentum
        for callback, decay in self._ema:
            _set_ema_decay(callback, decay)
        self._ema = []
        for averaged, attribute, function in self._averaged:
            setattr(averaged, attribute, function)
        self._averaged = []
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


def average_running_statistics(module: torch.nn.Module, strategy: Any) -> None:
    """Average every BatchNorm's running mean and variance over the data-parallel ranks, in place.

    Each rank's BatchNorm (not synchronized) tracks the statistics of its own batches; their mean over the ranks is the
    moving average of the ranks' mean statistics, the EMA of the whole effective batch. One ``all_reduce`` per dtype
    over the strategy's ``data_parallel_group`` (``strategy="pipeline"``) or the default group. Nothing happens with a
    data-parallel size of 1 or without an initialized process group; synchronized layers (torch's and the package's
    ``SyncBatchNorm``), identical on every rank already, are left as they are, and so are layers off the strategy's
    ``root_device`` (under ``strategy="pipeline"``, the host copies of the stages other ranks train).

    Args:
        module: the model; its ``_BatchNorm`` layers with ``track_running_stats`` are averaged.
        strategy: the Trainer's strategy (its ``data_parallel_size``, or ``world_size``).
    """
    size = data_parallel_size(strategy)
    if size == 1 or not dist.is_available() or not dist.is_initialized():
        return
    device = strategy.root_device
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for layer in module.modules():
        if not isinstance(layer, _BatchNorm) or isinstance(layer, (torch.nn.SyncBatchNorm, SyncBatchNorm)):
            continue
        for buffer in (layer.running_mean, layer.running_var):
            if buffer is not None and buffer.device == device:
                by_dtype.setdefault(buffer.dtype, []).append(buffer)
    group = getattr(strategy, "data_parallel_group", None)
    for buffers in by_dtype.values():
        flat = torch.cat([buffer.detach().reshape(-1) for buffer in buffers])
        dist.all_reduce(flat, group=group)
        flat /= size
        offset = 0
        for buffer in buffers:
            buffer.copy_(flat[offset : offset + buffer.numel()].view_as(buffer))
            offset += buffer.numel()


class SampleStepping:
    """A step-interval LR scheduler that advances ``kappa`` of its steps per optimizer step: a schedule in samples.

    Its steps count batches of the reference size; the fraction of a step is carried over.

    Lightning calls :meth:`step` once per optimizer step; the wrapped scheduler steps ``floor(carry + kappa)`` times.
    Its ``state_dict`` is the wrapped one's plus the carry, so checkpoints load into the plain scheduler too.
    """

    def __init__(self, scheduler: Any, kappa: float) -> None:
        self.scheduler = scheduler
        self.kappa = kappa
        self.carry = float(getattr(scheduler, "_samples_carry", 0.0))

    def step(self, *args: Any, **kwargs: Any) -> None:
        """Advance the wrapped scheduler by the reference batches in one optimizer step."""
        self.carry += self.kappa
        while self.carry >= 1.0 - 1e-9:
            self.scheduler.step(*args, **kwargs)
            self.carry -= 1.0

    def state_dict(self) -> dict[str, Any]:
        """The wrapped scheduler's state, with the carried fraction of a step."""
        return {**self.scheduler.state_dict(), "_samples_carry": self.carry}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the wrapped scheduler and the carry."""
        state = dict(state_dict)
        self.carry = float(state.pop("_samples_carry", 0.0))
        self.scheduler.load_state_dict(state)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.__dict__["scheduler"], name)


def _warmup_hooks(optimizer: Optimizer, callback: ScaleInvariance) -> list[Any]:
    """Optimizer step hooks that scale the learning rate for the step only (so schedulers never see it)."""
    saved: list[Any] = []

    def before(opt: Optimizer, args: Any, kwargs: Any) -> None:
        multiplier = warmup_in_samples(callback.step_start(), callback.effective_batch_size, callback.warmup_samples)
        if multiplier == 1.0:
            return
        saved[:] = [group["lr"] for group in opt.param_groups]
        for group in opt.param_groups:
            group["lr"] = group["lr"] * multiplier

    def after(opt: Optimizer, args: Any, kwargs: Any) -> None:
        if saved:
            for group, lr in zip(opt.param_groups, saved, strict=True):
                group["lr"] = lr
            saved.clear()

    return [optimizer.register_step_pre_hook(before), optimizer.register_step_post_hook(after)]


_EMA_FACTORIES = ("get_ema_avg_fn.", "get_ema_multi_avg_fn.")


def _closure_decay(function: Any) -> float | None:
    """The ``decay`` of an update function from torch's ``get_ema_avg_fn``/``get_ema_multi_avg_fn``, else ``None``."""
    update = getattr(function, "__wrapped__", function)  # under torch.no_grad()'s wrapper
    code = getattr(update, "__code__", None)
    closure = getattr(update, "__closure__", None)
    qualname = getattr(update, "__qualname__", "")
    if code is None or code.co_freevars != ("decay",) or closure is None or not qualname.startswith(_EMA_FACTORIES):
        return None
    return float(closure[0].cell_contents)


def _ema_function_like(function: Any, decay: float) -> Any:
    """An update function from the same torch factory as ``function``, with ``decay``."""
    update = getattr(function, "__wrapped__", function)
    multi = update.__qualname__.startswith("get_ema_multi_avg_fn.")
    return get_ema_multi_avg_fn(decay) if multi else get_ema_avg_fn(decay)


def _ema_decay(callback: Any) -> float | None:
    """The decay of Lightning's ``EMAWeightAveraging`` (torch's ``get_ema_avg_fn`` closure), else ``None``."""
    kwargs = getattr(callback, "_kwargs", None)
    return _closure_decay(kwargs.get("avg_fn") if isinstance(kwargs, dict) else None)


def _set_ema_decay(callback: Any, decay: float) -> None:
    avg_fn = get_ema_avg_fn(decay)
    callback._kwargs["avg_fn"] = avg_fn
    if getattr(callback, "_average_model", None) is not None:
        callback._average_model.avg_fn = avg_fn


def _float(value: Any) -> float:
    return float(value.item() if isinstance(value, torch.Tensor) else value)
