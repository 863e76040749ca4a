"""Warn when a resumed checkpoint's learning rates carry an LR-scaling factor that the Trainer's strategy ignores.

``LRScaledDDPStrategy`` stores the factor it applied in every param group (``"lr_scale_factor"``), so a checkpoint's
learning rates are that factor times the base ones. Resumed under ``LRScaledDDPStrategy`` they are rescaled to the new
world size; under any other strategy (single device, ``balanced_dp``, plain ``ddp``) none of that strategy's code runs,
and training would go on at the scaled learning rates without a word.

Lightning adds :class:`LRScaleFactorCheck` to each ``Trainer`` through its ``lightning.pytorch.callbacks_factory``
entry-point group (declared in this package's ``pyproject.toml``), in every process that imports ``lightning_balanced``
before building its ``Trainer``; a process that never imports it gets nothing (:func:`callbacks`). It looks once at the
checkpoint being restored and at nothing else: no per-step cost, no global hook on torch's optimizers.
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_balanced.lr_scaling import LR_SCALE_FACTOR_KEY

__all__ = ["LRScaleFactorCheck", "LRScaleFactorWarning", "callbacks", "stored_lr_scale_factors"]


class LRScaleFactorWarning(UserWarning):
    """A checkpoint's learning rates are scaled by a factor that the resuming strategy does not manage."""


def stored_lr_scale_factors(checkpoint: dict[str, Any]) -> dict[int, float]:
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


class LRScaleFactorCheck(Callback):
    """Warns once per resume when the checkpoint's learning rates carry a factor the strategy does not manage.

    Added to every ``Trainer`` by Lightning through the ``lightning.pytorch.callbacks_factory`` entry point; it can
    also be passed in ``callbacks=[...]`` where the package is not installed. The warning
    (:class:`LRScaleFactorWarning`) names the factor and how to undo it:
    :func:`lightning_balanced.unscale_learning_rates`.
    """

    @override
    def on_load_checkpoint(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, checkpoint: dict[str, Any]
    ) -> None:
        """Check the optimizer states about to be restored."""
        from lightning_balanced.strategies.ddp_lr import LRScaledDDP

        if trainer.state.fn != TrainerFn.FITTING or isinstance(trainer.strategy, LRScaledDDP):
            return
        if any(getattr(c, "manages_lr_scale_factor", False) for c in trainer.callbacks):  # type: ignore[attr-defined]
            return  # ScaleInvariance stores the factor too, and rescales from it
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


def callbacks() -> list[Callback]:
    """The ``lightning.pytorch.callbacks_factory`` entry point: the callbacks Lightning adds to each ``Trainer``.

    :class:`LRScaleFactorCheck` where the package is in use (imported by the user's code before the ``Trainer`` was
    built); nothing in a process whose only import of the package is Lightning's loading this entry point, so a
    ``Trainer`` that does not use the package gets no callback and no log line from it.
    """
    from lightning_balanced._import_origin import IMPORTED_BY_LIGHTNING

    if IMPORTED_BY_LIGHTNING:
        return []
    return [LRScaleFactorCheck()]
