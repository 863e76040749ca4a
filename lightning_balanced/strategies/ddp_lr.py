"""DDP that scales the learning rate with the effective batch size and synchronizes BatchNorm, also on CPU."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar

import lightning.pytorch as pl
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.utilities import rank_zero_warn
from torch.nn import Module
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_balanced.arguments import check_int
from lightning_balanced.batch_scaling.lr_scaling import (
    LR_SCALE_FACTOR_KEY,
    data_parallel_size,
    effective_batch_size,
    lr_scale_factor,
    rescale_learning_rates,
    validate_policy,
    warmup_multiplier,
)
from lightning_balanced.nn.layer_sync import DeviceSyncBatchNorm
from lightning_balanced.ranks.reports import rank_zero_report
from lightning_balanced.strategies.peer_failure import PeerFailureReporting
from lightning_balanced.strategies.process_group import end_process_group
from lightning_balanced.strategies.registration import RegisteredStrategy, register_variants

# Set on the LightningModule by a `Tuner.lr_find` run under this strategy: the learning rate it suggests was found at
# this factor's effective batch, so the next fit treats it as already scaled by it.
_LR_FOUND_AT_FACTOR = "_lightning_balanced_lr_found_at_factor"


def _train_batch_size(trainer: pl.Trainer) -> int | None:
    loader = trainer.train_dataloader
    if isinstance(loader, DataLoader):
        if loader.batch_size is not None:
            return loader.batch_size
        return getattr(loader.batch_sampler, "batch_size", None)
    return None


# The name prefixes of the registered names and the `start_method` each stands for, as in Lightning's DDP names.
_LAUNCHES = (("ddp", "popen"), ("ddp_spawn", "spawn"), ("ddp_fork", "fork"), ("ddp_notebook", "fork"))

if TYPE_CHECKING:
    _StrategyBase = DDPStrategy
else:
    _StrategyBase = object


class LRScaledDDP(PeerFailureReporting, RegisteredStrategy, _StrategyBase):
    """The implementation of :class:`LRScaledDDPStrategy`, free of a Lightning base class.

    Combined with ``lightning.pytorch``'s ``DDPStrategy`` it is :class:`LRScaledDDPStrategy`; combined with the
    standalone ``pytorch_lightning`` package's, it is
    :class:`lightning_balanced.strategies.pytorch_lightning_compat.LRScaledDDPStrategy`. The two differ only in
    ``_lightning_package``, the package whose Lightning classes it recognizes.
    """

    strategy_name = "ddp_lr"
    #: A resumed factor is rescaled here (read by ``callbacks.warn_if_lr_scale_factor_unmanaged``).
    manages_lr_scale_factor: ClassVar[bool] = True
    #: The Lightning package of the base class: where ``TorchSyncBatchNorm`` and the LR finder's callback come from.
    _lightning_package: ClassVar[str] = "lightning.pytorch"

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``ddp_lr_{linear,sqrt}`` and the ``ddp_spawn``/``ddp_fork``/``ddp_notebook`` variants.

        Args:
            strategy_registry (_StrategyRegistry): the registry to fill.
        """
        variants = [
            (
                f"{prefix}_lr_{policy}",
                f"DDP with {policy} learning-rate scaling and `start_method` '{start_method}'",
                {"lr_scaling": policy, "start_method": start_method},
            )
            for prefix, start_method in _LAUNCHES
            for policy in ("linear", "sqrt")
        ]
        register_variants(cls, strategy_registry, variants)

    def __init__(
        self,
        lr_scaling: str = "linear",
        reference_batch_size: int | None = None,
        warmup_steps: int = 0,
        sync_batchnorm: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.lr_scaling = validate_policy(lr_scaling)
        self.reference_batch_size: int | None = (
            None if reference_batch_size is None else check_int("reference_batch_size", reference_batch_size, minimum=1)
        )
        self.warmup_steps: int = check_int("warmup_steps", warmup_steps, minimum=0)
        self.sync_batchnorm: bool = sync_batchnorm
        self.lr_scale_factor: float = 1.0

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        # The accelerator connector overwrites `_layer_sync` after __init__, so the default is applied here. torch's
        # SyncBatchNorm (what `Trainer(sync_batchnorm=True)` puts there) refuses CPU: replace it by ours.
        layer_sync = importlib.import_module(f"{self._lightning_package}.plugins.layer_sync")
        torch_sync_batchnorm = layer_sync.TorchSyncBatchNorm
        if self.sync_batchnorm and (self._layer_sync is None or isinstance(self._layer_sync, torch_sync_batchnorm)):
            self._layer_sync = DeviceSyncBatchNorm(lambda: self.root_device.type)
        super().setup(trainer)

    def scale_factor(self, trainer: pl.Trainer) -> tuple[float, str]:
        """The factor for the current run and a sentence that explains it."""
        accumulate = trainer.accumulate_grad_batches
        size = data_parallel_size(self)  # the world size, or the pipelines of strategy="pipeline_lr_*"
        size_name = "world_size" if size == self.world_size else "data-parallel size"
        if self.reference_batch_size is None:
            factor = lr_scale_factor(self.lr_scaling, size * accumulate, 1)
            return factor, (
                f"{size_name} {size} x accumulate_grad_batches {accumulate} against one device without accumulation"
            )
        per_device = _train_batch_size(trainer)
        if per_device is None:
            raise ValueError(
                "`reference_batch_size` needs the per-device batch size, but the train dataloader has none that can be"
                " read (a DataLoader with `batch_size` or a `batch_sampler.batch_size` is needed); use"
                " `reference_batch_size=None` to scale by world_size x accumulate_grad_batches"
            )
        effective = effective_batch_size(per_device, size, accumulate)
        factor = lr_scale_factor(self.lr_scaling, effective, self.reference_batch_size)
        return factor, (
            f"effective batch {effective} (per-device {per_device} x {size_name} {size} x"
            f" accumulate_grad_batches {accumulate}) against reference_batch_size {self.reference_batch_size}"
        )

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        module = self.lightning_module
        assert module is not None
        trainer = module.trainer
        factor, why = self.scale_factor(trainer)
        if self._is_lr_find_run(trainer):
            # The finder sweeps absolute learning rates at this effective batch: leave them alone, and remember that
            # what it suggests is already right for this factor.
            setattr(module, _LR_FOUND_AT_FACTOR, factor)
            return
        if self.lr_scaling == "linear" and factor != 1.0:
            adaptive = [type(o).__name__ for o in self.optimizers if any("betas" in g for g in o.param_groups)]
            if adaptive:
                rank_zero_warn(
                    f"ddp_lr_linear scales the learning rate of {', '.join(adaptive)} linearly, by {factor:.6g}; for"
                    " Adam-like optimizers the square-root rule holds (Malladi et al. 2022): use `ddp_lr_sqrt`, or"
                    " `strategy='ddp'` with `ScaleInvariance('adam_sde', reference_batch_size=...)`, which also"
                    " scales the betas and eps.",
                    category=PossibleUserWarning,
                )
        for index, optimizer in enumerate(self.optimizers):
            if any("lr" not in group for group in optimizer.param_groups):
                raise ValueError(
                    f"strategy='{self.strategy_name}_{self.lr_scaling}' scales each param group's learning rate, but"
                    f" optimizer {index} ({type(optimizer).__name__}) has a param group without an 'lr' key: give"
                    " every param group an `lr`, or use strategy='ddp' with an optimizer that sets its own step size"
                )
        found_at = getattr(module, _LR_FOUND_AT_FACTOR, None)
        ratios = []
        for index, optimizer in enumerate(self.optimizers):
            if found_at is not None:
                for group in optimizer.param_groups:
                    group.setdefault(LR_SCALE_FACTOR_KEY, found_at)
            schedulers = [c.scheduler for c in self.lr_scheduler_configs if c.scheduler.optimizer is optimizer]
            ratio = rescale_learning_rates(optimizer, schedulers, factor)
            ratios.append(ratio)
            lrs = ", ".join(f"{group['lr']:.6g}" for group in optimizer.param_groups)
            rank_zero_report(
                f"lr scaling ({self.lr_scaling}): factor {factor:.6g} from {why}; optimizer {index}"
                f" ({type(optimizer).__name__}) param group lrs now [{lrs}]"
                + ("" if ratio == factor else f" (rescaled by {ratio:.6g} from a stored factor)")
            )
        self.lr_scale_factor = factor

    def _is_lr_find_run(self, trainer: pl.Trainer) -> bool:
        lr_callback = importlib.import_module(f"{self._lightning_package}.tuner.lr_finder")._LRCallback
        return any(isinstance(callback, lr_callback) for callback in trainer.callbacks)  # type: ignore[attr-defined]

    @override
    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: pl.LightningModule | Module | None = None,
        **kwargs: Any,
    ) -> Any:
        module = self.lightning_module
        step = module.trainer.global_step if module is not None else 0
        multiplier = warmup_multiplier(step, self.warmup_steps, self.lr_scale_factor)
        if multiplier == 1.0:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        scheduled = [group["lr"] for group in optimizer.param_groups]
        for group, lr in zip(optimizer.param_groups, scheduled, strict=True):
            group["lr"] = lr * multiplier
        try:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        finally:
            for group, lr in zip(optimizer.param_groups, scheduled, strict=True):
                group["lr"] = lr

    @override
    def teardown(self) -> None:
        """As DDP's, then a spawned or forked worker ends its process group before its process exits.

        Such a worker exits as soon as the run returns, and torch's gloo backend, left for interpreter exit, sometimes
        aborts a finished worker there, which fails the whole launch (see
        :func:`~lightning_balanced.strategies.process_group.end_process_group`). The script launcher's processes keep
        theirs: the user's script goes on.
        """
        super().teardown()
        if getattr(self, "_start_method", "popen") in ("spawn", "fork", "forkserver"):
            end_process_group()


class LRScaledDDPStrategy(LRScaledDDP, DDPStrategy):
    """DDP that multiplies the learning rate by a factor of the effective batch size, with SyncBatchNorm by default.

    The effective batch size is ``per-device batch x world_size (all nodes) x accumulate_grad_batches``. With
    ``reference_batch_size=None`` the base learning rate counts as tuned on one device without accumulation, so the
    factor is ``world_size x accumulate_grad_batches`` (linear) or its square root (sqrt); with a
    ``reference_batch_size`` it is ``effective / reference`` or its square root.

    The factor is applied once, at the start of fit, after the dataloader exists and after a checkpoint was restored:
    multiplicatively to every param group (groups keep their ratios), ``initial_lr``, OneCycleLR's ``max_lr``/
    ``min_lr``, and every scheduler's ``base_lrs`` and absolute floors (``eta_min``, ``min_lrs``), so the whole
    schedule is ``factor`` times the unscaled one. The applied factor is stored in each param group
    (``"lr_scale_factor"``), hence in every checkpoint: resuming on the same world size changes nothing, resuming on
    another rescales by new/old, and nothing is scaled twice. A learning rate suggested by ``Tuner.lr_find`` under this
    strategy was found at the effective batch and is not scaled again. Steps cost nothing extra (scaling happens at
    setup), except during warmup.

    SyncBatchNorm is on by default (``sync_batchnorm=True``): torch's ``nn.SyncBatchNorm`` on CUDA, our
    :class:`~lightning_balanced.SyncBatchNorm` on CPU/gloo, applied at fit setup and reverted at teardown to the
    user's original BatchNorm classes.

    Args:
        lr_scaling: ``"linear"`` (Goyal et al. 2017, SGD), ``"sqrt"`` (Krizhevsky 2014, Hoffer et al. 2017; Malladi et
            al. 2022 for Adam-like optimizers) or ``"none"``.
        reference_batch_size: the effective batch size the base learning rate was tuned for; ``None`` = the
            dataloader's batch size on one device without accumulation.
        warmup_steps: optimizer steps of gradual warmup (Goyal et al. 2017): the learning rate used by the optimizer
            rises linearly from the unscaled base to the scaled value, then the schedule runs as configured. The
            learning rates a scheduler or ``LearningRateMonitor`` reports are the scaled, un-warmed ones.
        sync_batchnorm: convert BatchNorm layers to synchronized BatchNorm while fitting.
        **kwargs: everything :class:`~lightning.pytorch.strategies.DDPStrategy` takes (``start_method``,
            ``process_group_backend``, ``timeout``, ``find_unused_parameters``, ...).

    Raises:
        ValueError: unknown ``lr_scaling``, ``reference_batch_size < 1``, ``warmup_steps < 0``; at fit start, a
            ``reference_batch_size`` when the dataloader's batch size cannot be read.
        TypeError: ``reference_batch_size`` or ``warmup_steps`` not an integer.
    """
