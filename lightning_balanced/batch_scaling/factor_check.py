"""Warn when a resumed checkpoint's learning rates carry an LR-scaling factor that the Trainer's strategy ignores.

``LRScaledDDPStrategy`` stores the factor it applied in every param group (``"lr_scale_factor"``), so a checkpoint's
learning rates are that factor times the base ones. Resumed under ``LRScaledDDPStrategy`` (or with ``ScaleInvariance``)
they are rescaled to the new world size; under any other strategy none of that code runs, and training would go on at
the scaled learning rates without a word.

The package's other strategies (``balanced_dp``, ``gpipe``, ``pipeline``) check the checkpoint they load with
:func:`warn_if_lr_scale_factor_unmanaged`. Under Lightning's own strategies (single device, ``ddp``, FSDP), add
:class:`LRScaleFactorCheck` to the ``Trainer``'s callbacks. Nothing is added to a ``Trainer`` behind the user's back:
a ``Trainer`` that does not use the package shows no trace of it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_balanced.batch_scaling.lr_scaling import LR_SCALE_FACTOR_KEY

if TYPE_CHECKING:
    from lightning.fabric.utilities.types import _PATH
    from lightning.pytorch.strategies import Strategy

    _StrategyBase = Strategy
else:
    _StrategyBase = object

__all__ = [
    "LRScaleFactorCheck",
    "LRScaleFactorCheckOnLoad",
    "LRScaleFactorWarning",
    "stored_lr_scale_factors",
    "warn_if_lr_scale_factor_unmanaged",
]


class LRScaleFactorWarning(UserWarning):
    """A checkpoint's learning rates are scaled by a factor that the resuming strategy does not manage."""


def stored_lr_scale_factors(checkpoint: Mapping[str, Any]) -> dict[int, float]:
    """The LR-scaling factor stored in each optimizer state of a Lightning checkpoint, where it is not 1.

    Args:
        checkpoint (dict): a Lightning checkpoint as loaded by ``torch.load``.

    Returns:
        dict[int, float]: optimizer index -> the factor its param groups carry (the largest, should they disagree);
        optimizers without a factor, or with factor 1, are left out.
    """
    factors = {}
    for index, state in enumerate(checkpoint.get("optimizer_states") or ()):
        stored = [float(g.get(LR_SCALE_FACTOR_KEY, 1.0)) for g in state.get("param_groups", ())]
        factor = max(stored, key=lambda f: abs(f - 1.0), default=1.0)
        if factor != 1.0:
            factors[index] = factor
    return factors


def warn_if_lr_scale_factor_unmanaged(trainer: pl.Trainer, checkpoint: Mapping[str, Any]) -> None:
    """Warn (:class:`LRScaleFactorWarning`, rank 0) when ``checkpoint`` carries a factor nobody will manage.

    Quiet when the ``Trainer`` is not fitting, when its strategy or one of its callbacks manages the factor
    (``manages_lr_scale_factor``: ``ddp_lr_*``, ``pipeline_lr_*``, ``ScaleInvariance``), or when the checkpoint holds no
    factor other than 1.

    Args:
        trainer: the ``Trainer`` restoring the checkpoint.
        checkpoint: the Lightning checkpoint about to be restored.
    """
    if trainer.state.fn != TrainerFn.FITTING or getattr(trainer.strategy, "manages_lr_scale_factor", False):
        return
    if any(getattr(c, "manages_lr_scale_factor", False) for c in trainer.callbacks):  # type: ignore[attr-defined]
        return
    factors = stored_lr_scale_factors(checkpoint)
    if not factors:
        return
    found = ", ".join(f"optimizer {index}: {factor:.6g}" for index, factor in factors.items())
    rank_zero_warn(
        f"The checkpoint {trainer.ckpt_path!r} was written by an LR-scaled DDP strategy: its learning rates carry"
        f" `{LR_SCALE_FACTOR_KEY}` ({found}), i.e. they are that factor times the base learning rates."
        f" {type(trainer.strategy).__name__} does not manage this factor, so training resumes at the scaled"
        " learning rates. To go back to the base ones, call `lightning_balanced.unscale_learning_rates(optimizer,"
        " schedulers)` for each optimizer once the state is restored, e.g. in your LightningModule's"
        " `on_train_start`: `for opt in self.trainer.optimizers: unscale_learning_rates(opt,"
        " [c.scheduler for c in self.trainer.lr_scheduler_configs])`. Resuming with a `ddp_lr_*` strategy instead"
        " rescales them to that run's world size.",
        category=LRScaleFactorWarning,
    )


class LRScaleFactorCheck(Callback):
    """Warns once per resume when the checkpoint's learning rates carry a factor the strategy does not manage.

    For Lightning's own strategies: ``Trainer(callbacks=[LRScaleFactorCheck()])``; the package's strategies check by
    themselves, and leave it to this callback when it is there. The warning (:class:`LRScaleFactorWarning`) names the
    factor and how to undo it: :func:`lightning_balanced.unscale_learning_rates`.
    """

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Check the optimizer states about to be restored."""
        warn_if_lr_scale_factor_unmanaged(trainer, checkpoint)


class LRScaleFactorCheckOnLoad(_StrategyBase):
    """A base-free strategy mixin: ``load_checkpoint`` runs :func:`warn_if_lr_scale_factor_unmanaged`.

    What the package's strategies that do not scale learning rates inherit (``balanced_dp``, ``gpipe``, ``pipeline``),
    so a checkpoint resumed under them is checked without a callback; with an :class:`LRScaleFactorCheck` among the
    callbacks, the check is left to it, so nothing is said twice.
    """

    @override
    def load_checkpoint(self, checkpoint_path: _PATH, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """The checkpoint, with a warning when its learning rates carry an LR-scaling factor left unmanaged here.

        ``*args``/``**kwargs`` pass on what the installed Lightning's ``Strategy.load_checkpoint`` takes
        (``weights_only`` from Lightning 2.6). Without a Trainer attached to the module (the main process after a
        spawned fit) the checkpoint is returned unchecked.
        """
        checkpoint = super().load_checkpoint(checkpoint_path, *args, **kwargs)
        # The main process of a spawned fit loads the workers' result into a module no Trainer holds any more (as
        # DDPStrategy's does, this needs none): there is no resume to check.
        trainer = getattr(self.lightning_module, "_trainer", None)
        if trainer is None:
            return checkpoint
        if not any(isinstance(callback, LRScaleFactorCheck) for callback in trainer.callbacks):
            warn_if_lr_scale_factor_unmanaged(trainer, checkpoint)
        return checkpoint
