"""Scaling with the effective batch size: the rules, and how they touch optimizers and schedulers.

The rules cover the learning rate, Adam's betas and eps, and EMA decays; ``ddp_lr_*`` and
:class:`~lightning_balanced.batch_scaling.scale_invariance.ScaleInvariance` both use them.

The rules (Goyal et al. 2017, "Accurate, Large Minibatch SGD"; Krizhevsky 2014 and Hoffer et al. 2017 for the square
root; Malladi et al. 2022 for sqrt with Adam): when the effective batch grows by ``k`` over the batch the learning
rate was tuned for, multiply the learning rate by ``k`` (``"linear"``) or ``sqrt(k)`` (``"sqrt"``). Conventions follow
timm (``--lr-base-size``, ``--lr-base-scale``) and mmengine (``auto_scale_lr`` with ``base_batch_size``).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from torch import Tensor
from torch.optim import Optimizer

from lightning_balanced.arguments import check_int, check_real

__all__ = [
    "EMA_RULE_SOURCE",
    "LR_RULES",
    "LR_SCALE_FACTOR_KEY",
    "LRScalingPolicy",
    "ScalingPolicy",
    "applied_lr_scale_factor",
    "data_parallel_size",
    "effective_batch_size",
    "lr_scale_factor",
    "rescale_learning_rates",
    "scaled_ema_momentum",
    "scaled_hyperparameters",
    "unscale_learning_rates",
    "warmup_in_samples",
    "warmup_multiplier",
]

LRScalingPolicy = Literal["linear", "sqrt", "none"]
POLICIES: tuple[str, ...] = ("linear", "sqrt", "none")

#: Key each optimizer param group carries with the factor already applied to it. It is saved with the optimizer state
#: in every checkpoint, so a resume knows what was applied and nothing is ever scaled twice.
LR_SCALE_FACTOR_KEY = "lr_scale_factor"


def validate_policy(lr_scaling: str) -> LRScalingPolicy:
    """Return ``lr_scaling`` if it is a known policy.

    Raises:
        ValueError: not one of ``"linear"``, ``"sqrt"``, ``"none"``.
    """
    if lr_scaling not in POLICIES:
        raise ValueError(f"`lr_scaling` must be one of {list(POLICIES)}, got {lr_scaling!r}")
    return lr_scaling  # type: ignore[return-value]


def data_parallel_size(strategy: Any) -> int:
    """The processes that each see their own data: the ``world_size`` of the effective batch size.

    The strategy's ``data_parallel_size`` where it has one (``strategy="pipeline"``: its pipelines, ``world_size / p``),
    else its ``world_size`` (1 for single-process ``balanced_dp`` and ``gpipe``, whose batch is already the whole one).
    """
    return int(getattr(strategy, "data_parallel_size", strategy.world_size))


def effective_batch_size(per_device_batch_size: int, world_size: int, accumulate_grad_batches: int = 1) -> int:
    """Samples behind one optimizer step: ``per_device_batch_size * world_size * accumulate_grad_batches``.

    Args:
        per_device_batch_size (int): the dataloader's batch size on each process.
        world_size (int): number of processes over all nodes.
        accumulate_grad_batches (int): batches accumulated per optimizer step.

    Raises:
        TypeError: an argument is not an integer.
        ValueError: an argument is < 1.
    """
    return (
        check_int("per_device_batch_size", per_device_batch_size, minimum=1)
        * check_int("world_size", world_size, minimum=1)
        * check_int("accumulate_grad_batches", accumulate_grad_batches, minimum=1)
    )


def lr_scale_factor(lr_scaling: str, effective_batch_size: int, reference_batch_size: int) -> float:
    """The factor by which the base learning rate is multiplied.

    Args:
        lr_scaling (str): ``"linear"``: ``effective / reference``; ``"sqrt"``: ``sqrt(effective / reference)``;
            ``"none"``: ``1``.
        effective_batch_size (int): samples per optimizer step now.
        reference_batch_size (int): samples per optimizer step the base learning rate was tuned for.

    Returns:
        float: the factor, > 0.

    Raises:
        ValueError: unknown policy or a batch size < 1.
        TypeError: a batch size is not an integer.
    """
    policy = validate_policy(lr_scaling)
    ratio = check_int("effective_batch_size", effective_batch_size, minimum=1) / check_int(
        "reference_batch_size", reference_batch_size, minimum=1
    )
    return 1.0 if policy == "none" else ScalingPolicy(policy).lr_factor(ratio)


def warmup_multiplier(step: int, warmup_steps: int, factor: float) -> float:
    """Gradual warmup (Goyal et al. 2017, §2.2): the multiplier on the scaled learning rate at ``step``.

    It rises linearly from ``1 / factor`` (the unscaled base learning rate) at step 0 to ``1`` (the scaled learning
    rate) at ``warmup_steps``, and stays ``1`` after; with ``warmup_steps == 0`` or ``factor <= 1`` it is always 1.
    ``step`` and ``warmup_steps`` count optimizer steps (``ddp_lr_*``) or samples (``ScaleInvariance``) alike.
    """
    if step >= warmup_steps or factor <= 1.0:
        return 1.0
    start = 1.0 / factor
    return start + (1.0 - start) * step / warmup_steps


def warmup_in_samples(start: float, batch: float, warmup_samples: int) -> float:
    """Linear warmup counted in samples: the multiplier on the learning rate of a step.

    The step's batch holds samples ``[start, start + batch)`` of the run. The ramp ``min(1, s / warmup_samples)``
    rises from 0 at sample 0 to 1 at ``warmup_samples``, the same on every scale; a step takes the ramp's mean over
    the samples it consumes: ``(start + batch / 2) / warmup_samples`` inside the ramp. So over any span of samples the
    mean learning rate is the same whatever the batch, which is what keeps a curve against samples seen in place while
    the batch changes. It is 1 once ``start >= warmup_samples``, and always with ``warmup_samples == 0``.

    Args:
        start (float): samples seen (by all data-parallel ranks) before the step, >= 0.
        batch (float): samples the step consumes: the effective batch size, > 0.
        warmup_samples (int): the length of the ramp in samples, >= 0.
    """
    end = start + batch
    if warmup_samples <= 0 or start >= warmup_samples:
        return 1.0
    if end <= warmup_samples:
        return (start + batch / 2) / warmup_samples
    ramp = (warmup_samples * warmup_samples - start * start) / (2 * warmup_samples)  # area under the ramp part
    return (ramp + (end - warmup_samples)) / batch


def _walk_schedulers(schedulers: Iterable[Any]) -> Iterator[Any]:
    for scheduler in schedulers:
        yield scheduler
        yield from _walk_schedulers(getattr(scheduler, "_schedulers", ()))  # SequentialLR, ChainedScheduler


def _scale(value: Any, ratio: float) -> Any:
    """A new object holding ``value * ratio``; ``value`` itself is never modified.

    torch gives every param group the same default-LR tensor (``SGD(groups, lr=torch.tensor(0.1))``) and a group's
    ``initial_lr`` or a scheduler's ``base_lrs`` may hold that same object: multiplying in place would scale a shared
    tensor once per place that holds it. Writing a new object into each place scales each learning rate exactly once.
    """
    if isinstance(value, (list, tuple)):
        return type(value)(_scale(v, ratio) for v in value)
    return value * ratio  # a float, or a new tensor of the same dtype and device


# Learning rates held in a param group (OneCycleLR keeps its range there) and in schedulers (absolute floors and
# ranges included, so the whole schedule is multiplied by the factor: lr_t(scaled) == factor * lr_t(unscaled)).
_GROUP_KEYS = ("lr", "initial_lr", "max_lr", "min_lr")
_SCHEDULER_ATTRIBUTES = ("base_lrs", "max_lrs", "min_lrs", "eta_min", "_last_lr")


def applied_lr_scale_factor(optimizer: Optimizer) -> float:
    """The factor already applied to ``optimizer`` (1.0 if none), read from its param groups.

    Raises:
        ValueError: the param groups disagree (some were scaled and others not, e.g. a group added later).
    """
    factors = {group.get(LR_SCALE_FACTOR_KEY, 1.0) for group in optimizer.param_groups}
    if len(factors) > 1:
        raise ValueError(
            f"The param groups of {type(optimizer).__name__} carry different `{LR_SCALE_FACTOR_KEY}` values"
            f" {sorted(factors)}; groups added after scaling must be given the scaled learning rate and the key"
        )
    return factors.pop() if factors else 1.0


def rescale_learning_rates(optimizer: Optimizer, schedulers: Iterable[Any], factor: float) -> float:
    """Bring ``optimizer`` and its ``schedulers`` to ``factor`` times the base learning rates; return the ratio applied.

    Multiplies by ``factor / applied`` (``applied`` = the factor stored in the param groups, 1.0 at first): every
    param group's ``lr``, ``initial_lr``, ``max_lr``, ``min_lr`` (each group keeps its own ratio), and each scheduler's
    ``base_lrs``, ``max_lrs``, ``min_lrs``, ``eta_min``, last learning rates, recursing into ``SequentialLR`` and
    ``ChainedScheduler``. Calling it again with the same factor changes nothing; after a resume on another world size it
    rescales by new/old.

    Each value is written back as a new object (float, or a new tensor of the same dtype and device), never multiplied
    in place, so a learning-rate tensor shared by several param groups, or by a group and a scheduler, is scaled once
    per place that holds it and the caller's tensor keeps its value.

    Args:
        optimizer (Optimizer): the optimizer whose learning rates are the base ones (or already scaled by the stored
            factor).
        schedulers (Iterable): the schedulers attached to ``optimizer`` (``torch.optim.lr_scheduler`` objects, including
            ``ReduceLROnPlateau``).
        factor (float): the target factor, > 0.

    Returns:
        float: the ratio that was applied (1.0 when nothing changed).

    Raises:
        TypeError: ``factor`` is not a real number.
        ValueError: ``factor`` is not positive and finite, or the groups disagree on the stored factor.
    """
    factor = check_real("factor", factor, positive=True)
    ratio = factor / applied_lr_scale_factor(optimizer)
    if ratio != 1.0:
        for group in optimizer.param_groups:
            for key in _GROUP_KEYS:
                if key in group:
                    group[key] = _scale(group[key], ratio)
        for scheduler in _walk_schedulers(schedulers):
            for attribute in _SCHEDULER_ATTRIBUTES:
                value = getattr(scheduler, attribute, None)
                if isinstance(value, (numbers.Real, Tensor, list, tuple)) and not isinstance(value, bool):
                    setattr(scheduler, attribute, _scale(value, ratio))
    for group in optimizer.param_groups:
        group[LR_SCALE_FACTOR_KEY] = factor
    return ratio


def unscale_learning_rates(optimizer: Optimizer, schedulers: Iterable[Any] = ()) -> float:
    """Undo the LR-scaling factor stored in ``optimizer``'s param groups: back to the base learning rates.

    Use it after resuming, under a strategy that does not manage the factor (single device, ``balanced_dp``, plain
    ``ddp``), a checkpoint written by ``LRScaledDDPStrategy``: its param groups carry ``"lr_scale_factor"`` and their
    learning rates are that factor times the base ones. Call it once the optimizer state is restored, e.g. in the
    LightningModule's ``on_train_start``::

        def on_train_start(self):
            schedulers = [config.scheduler for config in self.trainer.lr_scheduler_configs]
            for optimizer in self.trainer.optimizers:
                lightning_balanced.unscale_learning_rates(optimizer, schedulers)

    Args:
        optimizer (Optimizer): an optimizer whose state was restored from such a checkpoint.
        schedulers (Iterable): learning-rate schedulers; those attached to another optimizer (``scheduler.optimizer is
            not optimizer``) are left alone, so all of a trainer's schedulers can be passed.

    Returns:
        float: the factor that was removed (1.0 when there was none; then nothing is touched).

    Raises:
        ValueError: the param groups disagree on the stored factor.
    """
    applied = applied_lr_scale_factor(optimizer)
    if applied == 1.0:
        return applied
    attached = [s for s in schedulers if getattr(s, "optimizer", None) is optimizer]
    rescale_learning_rates(optimizer, attached, 1.0)
    return applied


# ---- the scaling rules of ScaleInvariance (lightning_balanced.batch_scaling.scale_invariance), pure
#: The learning-rate rules: how the learning rate scales with ``kappa``, and their sources.
LR_RULES: dict[str, str] = {
    "linear": "Goyal et al. 2017 (linear)",
    "sqrt": "Krizhevsky 2014, Hoffer et al. 2017 (square root)",
    "adam_sde": "Malladi et al. 2022 (SDE rule for adaptive methods)",
}
#: The source of the EMA rule, as the scaling log names it.
EMA_RULE_SOURCE = "Busbridge et al. 2023 (EMA rule)"


@dataclass(frozen=True)
class ScalingPolicy:
    """A learning-rate rule and, optionally, the EMA rule: what :class:`ScaleInvariance` applies.

    Args:
        lr_rule (str): ``"linear"``, ``"sqrt"`` or ``"adam_sde"`` (see the module docstring).
        ema (bool): also scale every EMA's momentum (``rho -> rho ** kappa``).

    Raises:
        ValueError: an unknown rule.
        TypeError: ``ema`` not a bool.
    """

    lr_rule: str
    ema: bool = False

    def __post_init__(self) -> None:
        if self.lr_rule not in LR_RULES:
            raise ValueError(
                f"`policy` must name one of the learning-rate rules {list(LR_RULES)}, got {self.lr_rule!r}"
            )
        if not isinstance(self.ema, bool):
            raise TypeError(f"`ema` must be a bool, got {self.ema!r}")

    @classmethod
    def parse(cls, policy: str | Sequence[str] | ScalingPolicy) -> ScalingPolicy:
        """A policy from ``"adam_sde"``, ``["adam_sde", "ema"]`` or a :class:`ScalingPolicy`.

        Raises:
            ValueError: no learning-rate rule, or more than one; an unknown name.
            TypeError: not a string, a sequence of strings or a policy.
        """
        if isinstance(policy, ScalingPolicy):
            return policy
        names = [policy] if isinstance(policy, str) else list(policy)
        if not all(isinstance(name, str) for name in names):
            raise TypeError(f"`policy` must be a rule name or a list of them, got {policy!r}")
        unknown = [name for name in names if name not in LR_RULES and name != "ema"]
        lr_rules = [name for name in names if name in LR_RULES]
        if unknown or len(lr_rules) != 1:
            raise ValueError(
                f"`policy` must name exactly one learning-rate rule of {list(LR_RULES)}, optionally with 'ema', got"
                f" {policy!r}"
            )
        return cls(lr_rules[0], ema="ema" in names)

    def lr_factor(self, kappa: float) -> float:
        """The learning-rate factor at ``kappa``."""
        return kappa if self.lr_rule == "linear" else math.sqrt(kappa)


def scaled_hyperparameters(reference: dict[str, Any], kappa: float, policy: ScalingPolicy) -> dict[str, Any]:
    """The optimizer hyperparameters (other than the learning rate) for a batch ``kappa`` times the reference one.

    Args:
        reference (dict): the reference values of a param group: ``betas`` (Adam family), ``alpha`` (RMSprop), ``eps``.
        kappa (float): effective batch size / reference batch size, > 0.
        policy (ScalingPolicy): only ``"adam_sde"`` changes them: ``1 - beta`` and ``1 - alpha`` times ``kappa``,
            ``eps / sqrt(kappa)``.

    Returns:
        dict: the new values of the keys of ``reference``.

    Raises:
        ValueError: ``1 - beta`` times ``kappa`` reaches 1 (the batch grew too much for this beta: a momentum of 0 or
            below), naming the value.
    """
    if policy.lr_rule != "adam_sde" or kappa == 1:  # at the reference batch, every value exactly as it was
        return dict(reference)
    scaled: dict[str, Any] = {}
    for key, value in reference.items():
        if key == "eps":
            scaled[key] = value / math.sqrt(kappa)
        elif key == "betas":
            scaled[key] = tuple(_scaled_decay(f"betas[{i}]", beta, kappa) for i, beta in enumerate(value))
        elif key == "alpha":
            scaled[key] = _scaled_decay("alpha", value, kappa)
        else:
            scaled[key] = value
    return scaled


def _scaled_decay(name: str, value: float, kappa: float) -> float:
    scaled = 1.0 - kappa * (1.0 - float(value))
    if not scaled > 0.0:
        raise ValueError(
            f"the adam_sde rule gives `{name}` = 1 - {kappa:.6g} x (1 - {value}) = {scaled:.6g} for a batch {kappa:.6g}"
            " times the reference one; it must stay above 0: use a larger reference_batch_size, or a decay closer to 1"
        )
    return scaled


def scaled_ema_momentum(momentum: float, kappa: float) -> float:
    """An EMA momentum as torch counts it (``1 - rho``, as BatchNorm) at ``kappa``: ``1 - (1 - momentum)^kappa``."""
    if kappa == 1:  # exactly as it was: 1 - (1 - m) is not always m in floating point
        return float(momentum)
    return 1.0 - float((1.0 - momentum) ** kappa)
