"""How one batch is split over the devices of a single process: the split policies and the chunk plan.

``BalancedDataParallelStrategy(split=...)`` takes one of :class:`EvenSplit`, :class:`Gpu0Budget`, :class:`ChunkSizes`
and :class:`Weights`, or a policy of your own: one subclass of :class:`SplitPolicy`, in any module.
"""

from __future__ import annotations

import inspect
import math
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from fractions import Fraction
from typing import Any, Literal

import torch

from lightning_balanced.arguments import check_int, check_real

__all__ = [
    "ChunkSizes",
    "EvenSplit",
    "Gpu0Budget",
    "SplitOptions",
    "SplitPolicy",
    "Weights",
    "even_split",
    "learns_from_steps",
    "observes_peak_bytes",
    "plan_chunk_sizes",
    "split_policy",
]


def even_split(total: int, num_parts: int) -> list[int]:
    """Split ``total`` into ``num_parts`` sizes that differ by at most one, the larger ones first.

    ``even_split(10, 4) == [3, 3, 2, 2]``; ``even_split(2, 4) == [1, 1, 0, 0]``.

    Raises:
        TypeError: an argument is not an integer.
        ValueError: ``total < 0`` or ``num_parts < 1``.
    """
    total = check_int("total", total, minimum=0)
    num_parts = check_int("num_parts", num_parts, minimum=1)
    unit, remainder = divmod(total, num_parts)
    return [unit + 1 if i < remainder else unit for i in range(num_parts)]


def proportional_split(total: int, weights: Sequence[float]) -> list[int]:
    """Split ``total`` proportionally to non-negative ``weights`` with largest-remainder (Hamilton) rounding.

    Each part gets ``floor(total * w_i / sum(w))``; the samples left over go one each to the parts with the largest
    fractional remainders, ties to the lower index. Quotas are exact rationals (every float is one), so ties are real
    ties, not accidents of rounding. The weights are assumed validated (finite, >= 0, positive sum).
    """
    exact = [Fraction(w) for w in weights]
    weight_sum = sum(exact)
    quotas = [total * w / weight_sum for w in exact]
    sizes = [math.floor(q) for q in quotas]
    leftover = total - sum(sizes)
    by_remainder = sorted(range(len(weights)), key=lambda i: (-(quotas[i] - sizes[i]), i))
    for i in by_remainder[:leftover]:
        sizes[i] += 1
    return sizes


def learns_from_steps(policy: SplitPolicy) -> bool:
    """Whether ``policy`` overrides :meth:`SplitPolicy.observe`: only then do the strategies time the steps for it."""
    return type(policy).observe is not SplitPolicy.observe


def observes_peak_bytes(policy: SplitPolicy) -> bool:
    """Whether ``policy.observe`` takes ``peak_bytes`` (a policy may define ``observe(chunk_sizes, seconds)``)."""
    return "peak_bytes" in inspect.signature(policy.observe).parameters


class SplitPolicy(ABC):
    """How every batch is split over the devices: subclass it for a new rule, one class with all of its rules.

    A policy implements :meth:`_plan` and nothing else is required. The strategy
    (``BalancedDataParallelStrategy(split=policy)``) calls, on its main thread:

    * :meth:`check_devices` once at setup, so a policy that cannot serve the device count fails before the first step;
    * :meth:`plan` for every batch of every loop (fit, validate, test, predict), before the batch is scattered;
    * :meth:`observe` after every training step, with the time each device took, only when the policy overrides it.

    So a policy that learns (say, one that measures each device's speed and re-plans) is still one class: it overrides
    :meth:`observe` to record, and its :meth:`_plan` answers from what it recorded. The policies here are pure: the
    same answer in every loop for the same batch size. Check the settings in ``__init__`` (see
    :mod:`lightning_balanced.arguments`), so a bad one fails where it is written; give ``__str__`` (the setting as
    the user wrote it, quoted in errors) and ``__repr__``.
    """

    @abstractmethod
    def _plan(self, batch_size: int, num_devices: int) -> list[int]:
        """The chunk sizes: ``num_devices`` non-negative ints summing to ``batch_size`` (both checked by :meth:`plan`).

        ``batch_size`` (>= 0) and ``num_devices`` (>= 1) are plain ints, already checked, and :meth:`check_devices`
        has passed. A device planned ``0`` samples is left out of that step.
        """

    def check_devices(self, num_devices: int) -> None:  # noqa: B027 (most policies serve any device count)
        """Raise ``ValueError`` when the policy cannot serve ``num_devices`` devices (a per-device list's length)."""

    def set_capacities(self, capacity_bytes: list[int | None]) -> None:  # noqa: B027 (most policies ignore memory)
        """Learn each device's memory, in bytes (``None``: unknown), once at setup, before the first plan.

        The strategy gives a GPU's total memory (``torch.cuda.get_device_properties(d).total_memory``, divided among
        the replicas that share that GPU) and, on the CPU emulation, a virtual device's emulated capacity
        (:class:`~lightning_balanced.data_parallel.virtual_device.EmulatedDevice`), else ``None``. It is called only
        for a policy that overrides :meth:`observe`.
        """

    def set_devices(self, devices: Sequence[torch.device]) -> None:  # noqa: B027 (most policies ignore devices)
        """Learn each replica's device, once at setup, before the first plan (several replicas may share one GPU).

        Called, like :meth:`set_capacities`, only for a policy that overrides :meth:`observe`.
        """

    def observe(  # noqa: B027 (most policies do not learn)
        self, chunk_sizes: list[int], seconds: list[float], peak_bytes: list[int | None] | None = None
    ) -> None:
        """Learn from a training step that ran: ``seconds[i]`` is how long device ``i`` took for ``chunk_sizes[i]``.

        Both lists have one entry per device: ``chunk_sizes`` is what :meth:`plan` answered for the step, and a device
        planned ``0`` samples has ``0.0`` seconds. The time is that of the step method (``training_step``: the
        forward pass and the loss) on the device, taken with CUDA events on the replica's stream on a GPU (the host
        waits for the step's forward pass to read them) and with the host's clock on the CPU; the backward pass runs
        later, for all replicas at once, and is not in it. ``peak_bytes[i]`` is device ``i``'s memory in the step, in
        bytes, or ``None`` where it is not known: on a GPU ``torch.cuda.max_memory_allocated`` from the start of the
        step to the gathered outputs (the parameters, the optimizer state, the step's activations, on GPU 0 the
        gathered outputs; replicas that share a GPU see its peak), on a virtual CPU device the replica's parameters
        and buffers plus the activations its step method saved for backward. The strategy times the steps only for
        a policy that overrides this method: the others cost nothing.

        Over ranks (``balanced_ddp``, ``balanced_fsdp``) the same contract holds with "device" read as "rank": one
        entry per rank, the same lists on every rank (they travel in the step's all_reduce, so every rank's policy
        sees the same numbers and plans alike); ``seconds[r]`` is rank ``r``'s step method (host clock on the CPU,
        CUDA events on a GPU), and ``peak_bytes[r]`` its ``torch.cuda.max_memory_allocated`` over its whole training
        step on a GPU, under ``balanced_fsdp`` with ``capacities`` its fixed bytes (its shards of the state and the
        largest block unsharded) plus the bytes its forward pass saved for backward, else ``None``. A policy may
        define ``observe(chunk_sizes, seconds)`` without ``peak_bytes``: it is then called with two arguments.
        """

    def plan(self, batch_size: int, num_devices: int) -> list[int]:
        """The chunk sizes, one per device, for a batch of ``batch_size`` samples; see :func:`plan_chunk_sizes`.

        Checks the arguments and :meth:`check_devices`, then asks :meth:`_plan` and checks its answer, so a policy's
        mistake fails here, naming the policy, and not in the scatter.
        """
        batch_size = check_int("batch_size", batch_size, minimum=0)
        num_devices = check_int("num_devices", num_devices, minimum=1)
        self.check_devices(num_devices)
        sizes = self._plan(batch_size, num_devices)
        if (
            len(sizes) != num_devices
            or any(isinstance(s, bool) or not isinstance(s, int) or s < 0 for s in sizes)
            or sum(sizes) != batch_size
        ):
            raise ValueError(
                f"{self!r} planned {sizes} for a batch of {batch_size} over {num_devices} devices: a plan must be"
                f" {num_devices} non-negative ints summing to {batch_size}"
            )
        return list(sizes)


class EvenSplit(SplitPolicy):
    """Sizes that differ by at most one, the larger chunks on the lower device indices (:func:`even_split`)."""

    def _plan(self, batch_size: int, num_devices: int) -> list[int]:
        return even_split(batch_size, num_devices)

    def __str__(self) -> str:
        return "an even split"

    def __repr__(self) -> str:
        return "EvenSplit()"


class Gpu0Budget(SplitPolicy):
    """Device 0 takes at most ``gpu0_bsz`` samples (and never more than an even share); the rest is split evenly.

    Device 0 takes ``min(gpu0_bsz, batch_size // num_devices)``, so a budget larger than the batch (a short last batch,
    a larger validation batch) is never an error; the rest is split evenly over devices ``1..num_devices-1``, the
    remainder going one sample each to devices 1, 2, ... (never to device 0). ``0`` leaves device 0 out (it only
    gathers). On a single device the budget must hold the batch.

    Args:
        gpu0_bsz (int): the most samples device 0 takes per batch, >= 0.
    """

    def __init__(self, gpu0_bsz: int) -> None:
        self.gpu0_bsz = check_int("gpu0_bsz", gpu0_bsz, minimum=0)

    def _plan(self, batch_size: int, num_devices: int) -> list[int]:
        if num_devices == 1:
            if self.gpu0_bsz < batch_size:
                raise ValueError(
                    f"`gpu0_bsz` ({self.gpu0_bsz}) cannot hold a batch of {batch_size} on a single device: there is no"
                    " other device to take the rest; use more devices or drop `gpu0_bsz`"
                )
            return [batch_size]
        first = min(self.gpu0_bsz, batch_size // num_devices)
        return [first, *even_split(batch_size - first, num_devices - 1)]

    def __str__(self) -> str:
        return f"gpu0_bsz={self.gpu0_bsz}"

    def __repr__(self) -> str:
        return f"Gpu0Budget({self.gpu0_bsz})"


class ChunkSizes(SplitPolicy):
    """The given sizes for a batch of their sum; a batch of another size in the same proportions.

    Args:
        chunk_sizes (Sequence[int]): samples per device, one non-negative entry per device, not all zero. A batch of
            another size than their sum (the last one, or another loop's) is split in the same proportions with
            largest-remainder rounding (:func:`proportional_split`).
    """

    def __init__(self, chunk_sizes: Sequence[int]) -> None:
        self.chunk_sizes = validate_chunk_sizes(chunk_sizes, None)

    def check_devices(self, num_devices: int) -> None:
        """Raise ``ValueError`` unless there is one size per device."""
        validate_chunk_sizes(self.chunk_sizes, num_devices)

    def _plan(self, batch_size: int, num_devices: int) -> list[int]:
        if sum(self.chunk_sizes) == batch_size:
            return list(self.chunk_sizes)
        return proportional_split(batch_size, self.chunk_sizes)

    def __str__(self) -> str:
        return f"chunk_sizes={self.chunk_sizes}"

    def __repr__(self) -> str:
        return f"ChunkSizes({self.chunk_sizes})"


class Weights(SplitPolicy):
    """Sizes proportional to per-device weights, rounded by largest remainder (ties to the lower device index).

    Args:
        weights (Sequence[float]): relative capacity per device (e.g. the memory of mixed GPUs), one positive finite
            number per device.
    """

    def __init__(self, weights: Sequence[float]) -> None:
        self.weights = validate_weights(weights, None)

    def check_devices(self, num_devices: int) -> None:
        """Raise ``ValueError`` unless there is one weight per device."""
        validate_weights(self.weights, num_devices)

    def _plan(self, batch_size: int, num_devices: int) -> list[int]:
        return proportional_split(batch_size, self.weights)

    def __str__(self) -> str:
        return f"weights={self.weights}"

    def __repr__(self) -> str:
        return f"Weights({self.weights})"


#: Each shorthand argument of :func:`split_policy` and the policy it stands for.
_SHORTHANDS: dict[str, Any] = {"gpu0_bsz": Gpu0Budget, "chunk_sizes": ChunkSizes, "weights": Weights}

#: Policies named by a string in ``chunk_sizes`` (``chunk_sizes="auto"``), each registered by the module that defines
#: it (``auto_split`` registers ``"auto"``; the package ``__init__`` imports it), so this module imports none of them.
NAMED_POLICIES: dict[str, Callable[[], SplitPolicy]] = {}


def split_policy(
    gpu0_bsz: int | None = None,
    chunk_sizes: Sequence[int] | Literal["auto"] | None = None,
    weights: Sequence[float] | None = None,
    *,
    split: SplitPolicy | None = None,
) -> SplitPolicy:
    """The policy ``split``, or the one of the shorthands ``gpu0_bsz``, ``chunk_sizes``, ``weights`` (none: even).

    ``gpu0_bsz=14`` is short for ``split=Gpu0Budget(14)``, ``chunk_sizes=[...]`` for ``split=ChunkSizes([...])``,
    ``weights=[...]`` for ``split=Weights([...])``, ``chunk_sizes="auto"`` for ``split=AutoSplit()``,
    and nothing for ``split=EvenSplit()``. At most one of the four may
    be given.

    Raises:
        TypeError: ``split`` is not a :class:`SplitPolicy`, a size is not an integer (``chunk_sizes`` a string other
            than ``"auto"``), or a weight not a real number.
        ValueError: more than one option, a negative size, ``chunk_sizes`` all zero, a weight that is not positive
            and finite.
    """
    options = (("gpu0_bsz", gpu0_bsz), ("chunk_sizes", chunk_sizes), ("weights", weights))
    given = [(name, value) for name, value in options if value is not None]
    if len(given) > 1:
        raise ValueError(
            f"Give at most one of `gpu0_bsz`, `chunk_sizes` and `weights`, got {' and '.join(n for n, _ in given)}"
        )
    if split is not None:
        if given:
            name, value = given[0]
            raise ValueError(
                f"`split` and `{name}` cannot be given together: `{name}={value!r}` is short for"
                f" `split={_SHORTHANDS[name].__name__}({value!r})`; give one of them"
            )
        if not isinstance(split, SplitPolicy):
            raise TypeError(
                "`split` must be a SplitPolicy (EvenSplit(), Gpu0Budget(...), ChunkSizes([...]), Weights([...]) or a"
                f" subclass of your own), got {split!r} of type {type(split).__name__}"
            )
        return split
    if not given:
        return EvenSplit()
    name, value = given[0]
    if name == "chunk_sizes" and isinstance(value, str):
        if value not in NAMED_POLICIES:
            named = " or ".join(repr(n) for n in sorted(NAMED_POLICIES))
            raise TypeError(f"`chunk_sizes` must be a sequence of integers or {named}, got {value!r}")
        return NAMED_POLICIES[value]()
    policy: SplitPolicy = _SHORTHANDS[name](value)
    return policy


class SplitOptions:
    """A base-free strategy mixin: the split options of ``balanced_dp``, ``balanced_ddp`` and ``balanced_fsdp``.

    Taken and checked once for the three: ``self.split`` is the policy (:func:`split_policy`), ``self.loss_reduction``
    how the loss is weighted by share; the other arguments go on to the next class (cooperative ``__init__``, as
    Lightning's strategies pass theirs on). LightningCLI and :func:`~lightning_balanced.strategies.trainer_arguments`
    follow the ``**kwargs`` here.

    Args:
        gpu0_bsz (int | None): short for ``split=Gpu0Budget(gpu0_bsz)``.
        chunk_sizes (Sequence[int] | "auto" | None): short for ``split=ChunkSizes(chunk_sizes)``; ``"auto"`` for
            ``split=AutoSplit()``.
        weights (Sequence[float] | None): short for ``split=Weights(weights)``.
        split (SplitPolicy | None): the policy; none of the four: :class:`EvenSplit`.
        loss_reduction (str): ``"mean"`` (a step's loss is the mean over the samples, each share's weighted by its
            size) or ``"sum"``.
        **kwargs: the next class's arguments.

    Raises:
        ValueError: ``loss_reduction`` other than ``"mean"`` or ``"sum"``; as :func:`split_policy`.
        TypeError: as :func:`split_policy`.
    """

    split: SplitPolicy
    loss_reduction: Literal["mean", "sum"]

    def __init__(
        self,
        gpu0_bsz: int | None = None,
        chunk_sizes: Sequence[int] | Literal["auto"] | None = None,
        weights: Sequence[float] | None = None,
        split: SplitPolicy | None = None,
        loss_reduction: Literal["mean", "sum"] = "mean",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if loss_reduction not in ("mean", "sum"):
            raise ValueError(f"`loss_reduction` must be 'mean' or 'sum', got {loss_reduction!r}")
        self.split = split_policy(gpu0_bsz, chunk_sizes, weights, split=split)
        self.loss_reduction = loss_reduction


def plan_chunk_sizes(
    batch_size: int,
    num_devices: int,
    *,
    gpu0_bsz: int | None = None,
    chunk_sizes: Sequence[int] | None = None,
    weights: Sequence[float] | None = None,
) -> list[int]:
    """Plan how many samples of a batch each device processes.

    The policy's rule as a function: ``plan_chunk_sizes(b, n, gpu0_bsz=14) == Gpu0Budget(14).plan(b, n)``, what
    ``balanced_dp`` asks its policy for every batch of every loop. At most one of ``gpu0_bsz``, ``chunk_sizes`` and
    ``weights`` may be given (:func:`split_policy`). With none, the batch is split evenly (sizes differ by at most
    one, the larger chunks on the lower device indices).

    Args:
        batch_size (int): number of samples in the batch, >= 0. A batch of 0 is planned as ``0`` on every device.
        num_devices (int): number of devices the batch is split over, >= 1.
        gpu0_bsz (int, optional): the most samples device 0 may take, a budget: device 0 gets
            ``min(gpu0_bsz, batch_size // num_devices)``, so a budget larger than the batch (a short last batch, or a
            larger validation batch) is never an error. The rest is split evenly over devices ``1..num_devices-1``,
            the remainder going one sample each to devices 1, 2, ... (never to device 0). ``0`` leaves device 0 out.
            On a single device the budget must hold the batch.
        chunk_sizes (Sequence[int], optional): explicit per-device sizes (``num_devices`` non-negative entries, not
            all zero) for a batch of ``sum(chunk_sizes)``; a batch of any other size is split in the same proportions
            with largest-remainder rounding.
        weights (Sequence[float], optional): ``num_devices`` positive finite relative capacities; the batch is split
            proportionally with largest-remainder rounding (ties go to the lower device index).

    Returns:
        list[int]: ``num_devices`` non-negative sizes summing to ``batch_size``. A device planned ``0`` samples is
        left out of that step.

    Raises:
        TypeError: a size or count is not an integer, or a weight is not a real number.
        ValueError: a negative size, ``num_devices < 1``, a ``gpu0_bsz`` that cannot hold the batch on a single
            device, ``chunk_sizes``/``weights`` of the wrong length, ``chunk_sizes`` all zero, weights that are not
            positive and finite, or more than one option given.

    Source: the ``gpu0_bsz`` rule is the classic ``BalancedDataParallel`` (transformer-xl) split without its known
    bugs: one device works, device 0 never exceeds its budget, and small batches still yield one replica per chunk.
    """
    return split_policy(gpu0_bsz, chunk_sizes, weights).plan(batch_size, num_devices)


def validate_chunk_sizes(chunk_sizes: Sequence[int], num_devices: int | None) -> list[int]:
    """Check that ``chunk_sizes`` has non-negative integers, one per device (any length when ``num_devices`` is None).

    Raises:
        TypeError: ``chunk_sizes`` is not a sequence of integers.
        ValueError: wrong length, a negative entry, or all entries zero.
    """
    if isinstance(chunk_sizes, (str, bytes)) or not isinstance(chunk_sizes, Sequence):
        raise TypeError(f"`chunk_sizes` must be a sequence of integers, got {chunk_sizes!r}")
    sizes = [check_int(f"chunk_sizes[{i}]", size, minimum=0) for i, size in enumerate(chunk_sizes)]
    if num_devices is not None and len(sizes) != num_devices:
        raise ValueError(f"`chunk_sizes` needs one entry per device ({num_devices}), got {len(sizes)}: {sizes}")
    if not any(sizes):
        raise ValueError(f"`chunk_sizes` must give at least one device a sample, got {sizes}")
    return sizes


def validate_weights(weights: Sequence[float], num_devices: int | None) -> list[float]:
    """Check that ``weights`` has positive finite real numbers, one per device (any count when ``num_devices`` is None).

    Raises:
        TypeError: ``weights`` is not a sequence of real numbers.
        ValueError: wrong length, or an entry that is not positive and finite.
    """
    if isinstance(weights, (str, bytes)) or not isinstance(weights, Sequence):
        raise TypeError(f"`weights` must be a sequence of positive numbers, got {weights!r}")
    values = [check_real(f"weights[{i}]", weight, positive=True) for i, weight in enumerate(weights)]
    if not values:
        raise ValueError("`weights` must give at least one device a weight, got []")
    if num_devices is not None and len(values) != num_devices:
        raise ValueError(f"`weights` needs one entry per device ({num_devices}), got {len(values)}: {values}")
    return values
