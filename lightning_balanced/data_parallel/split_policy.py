"""How one batch is split over the devices of a single process: the chunk plan."""

from __future__ import annotations

import math
import numbers
from abc import ABC, abstractmethod
from collections.abc import Sequence
from fractions import Fraction

__all__ = [
    "EvenSplit",
    "ExplicitChunkSizes",
    "Gpu0Budget",
    "SplitPolicy",
    "WeightedSplit",
    "plan_chunk_sizes",
    "split_policy",
]


def _check_count(name: str, value: object, *, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be an integer, got {value!r} of type {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {value}")
    return int(value)


def _even_split(total: int, num_parts: int) -> list[int]:
    """Sizes that differ by at most one; the larger ones come first."""
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


class SplitPolicy(ABC):
    """How every batch is split over the devices: one subclass per option, each holding all of its rules.

    A policy is checked when it is made; :meth:`plan` is pure and gives the same answer in every loop (fit, validate,
    test, predict) for the same batch size. A batch of 0 samples is planned as ``0`` on every device.
    """

    @abstractmethod
    def _plan(self, batch_size: int, num_devices: int) -> list[int]: ...

    def check_devices(self, num_devices: int) -> None:  # noqa: B027 (most policies serve any device count)
        """Raise ``ValueError`` when the policy cannot serve ``num_devices`` devices (a per-device list's length)."""

    def plan(self, batch_size: int, num_devices: int) -> list[int]:
        """The chunk sizes, one per device, for a batch of ``batch_size`` samples; see :func:`plan_chunk_sizes`."""
        batch_size = _check_count("batch_size", batch_size)
        num_devices = _check_count("num_devices", num_devices, minimum=1)
        self.check_devices(num_devices)
        return self._plan(batch_size, num_devices)


class EvenSplit(SplitPolicy):
    """Sizes that differ by at most one, the larger chunks on the lower device indices."""

    def _plan(self, batch_size: int, num_devices: int) -> list[int]:
        return _even_split(batch_size, num_devices)

    def __str__(self) -> str:
        return "an even split"


class Gpu0Budget(SplitPolicy):
    """Device 0 takes at most ``gpu0_bsz`` samples (and never more than an even share); the rest is split evenly."""

    def __init__(self, gpu0_bsz: int) -> None:
        self.gpu0_bsz = _check_count("gpu0_bsz", gpu0_bsz)

    def _plan(self, batch_size: int, num_devices: int) -> list[int]:
        if num_devices == 1:
            if self.gpu0_bsz < batch_size:
                raise ValueError(
                    f"`gpu0_bsz` ({self.gpu0_bsz}) cannot hold a batch of {batch_size} on a single device: there is no"
                    " other device to take the rest; use more devices or drop `gpu0_bsz`"
                )
            return [batch_size]
        first = min(self.gpu0_bsz, batch_size // num_devices)
        return [first, *_even_split(batch_size - first, num_devices - 1)]

    def __str__(self) -> str:
        return f"gpu0_bsz={self.gpu0_bsz}"


class ExplicitChunkSizes(SplitPolicy):
    """The given sizes for a batch of their sum; a batch of another size in the same proportions."""

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


class WeightedSplit(SplitPolicy):
    """Sizes proportional to per-device weights, rounded by largest remainder (ties to the lower device index)."""

    def __init__(self, weights: Sequence[float]) -> None:
        self.weights = validate_weights(weights, None)

    def check_devices(self, num_devices: int) -> None:
        """Raise ``ValueError`` unless there is one weight per device."""
        validate_weights(self.weights, num_devices)

    def _plan(self, batch_size: int, num_devices: int) -> list[int]:
        return proportional_split(batch_size, self.weights)

    def __str__(self) -> str:
        return f"weights={self.weights}"


def split_policy(
    gpu0_bsz: int | None = None, chunk_sizes: Sequence[int] | None = None, weights: Sequence[float] | None = None
) -> SplitPolicy:
    """The policy for at most one of ``gpu0_bsz``, ``chunk_sizes`` and ``weights`` (none: an even split).

    Raises:
        TypeError: a size is not an integer, or a weight not a real number.
        ValueError: more than one option, a negative size, ``chunk_sizes`` all zero, a weight that is not positive
            and finite.
    """
    options = (("gpu0_bsz", gpu0_bsz), ("chunk_sizes", chunk_sizes), ("weights", weights))
    given = [name for name, value in options if value is not None]
    if len(given) > 1:
        raise ValueError(f"Give at most one of `gpu0_bsz`, `chunk_sizes` and `weights`, got {' and '.join(given)}")
    if gpu0_bsz is not None:
        return Gpu0Budget(gpu0_bsz)
    if chunk_sizes is not None:
        return ExplicitChunkSizes(chunk_sizes)
    if weights is not None:
        return WeightedSplit(weights)
    return EvenSplit()


def plan_chunk_sizes(
    batch_size: int,
    num_devices: int,
    *,
    gpu0_bsz: int | None = None,
    chunk_sizes: Sequence[int] | None = None,
    weights: Sequence[float] | None = None,
) -> list[int]:
    """Plan how many samples of a batch each device processes.

    This is the one place the split is decided: ``balanced_dp`` calls it (through :func:`split_policy`) for every
    batch of every loop. At most one of ``gpu0_bsz``, ``chunk_sizes`` and ``weights`` may be given. With none, the
    batch is split evenly (sizes differ by at most one, the larger chunks on the lower device indices).

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
    sizes = [_check_count(f"chunk_sizes[{i}]", size) for i, size in enumerate(chunk_sizes)]
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
    values: list[float] = []
    for i, weight in enumerate(weights):
        if isinstance(weight, bool) or not isinstance(weight, numbers.Real):
            raise TypeError(f"`weights[{i}]` must be a real number, got {weight!r}")
        if not (math.isfinite(weight) and weight > 0):
            raise ValueError(f"`weights[{i}]` must be positive and finite, got {weight!r}")
        values.append(float(weight))
    if not values:
        raise ValueError("`weights` must give at least one device a weight, got []")
    if num_devices is not None and len(values) != num_devices:
        raise ValueError(f"`weights` needs one entry per device ({num_devices}), got {len(values)}: {values}")
    return values
