"""How one batch is split over the devices of a single process: the chunk plan."""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from fractions import Fraction

__all__ = ["plan_chunk_sizes"]


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


def plan_chunk_sizes(
    batch_size: int,
    num_devices: int,
    *,
    gpu0_bsz: int | None = None,
    chunk_sizes: Sequence[int] | None = None,
    weights: Sequence[float] | None = None,
) -> list[int]:
    """Plan how many samples of a batch each device processes.

    At most one of ``gpu0_bsz``, ``chunk_sizes`` and ``weights`` may be given. With none, the batch is split evenly
    (sizes differ by at most one, the larger chunks on the lower device indices).

    Args:
        batch_size (int): number of samples in the batch, >= 0.
        num_devices (int): number of devices the batch is split over, >= 1.
        gpu0_bsz (int, optional): the most samples device 0 may take. Device 0 gets
            ``min(gpu0_bsz, batch_size // num_devices)``; the rest is split evenly over devices ``1..num_devices-1``,
            the remainder going one sample each to devices 1, 2, ... (never to device 0). ``0`` leaves device 0 out.
            Must not exceed ``batch_size``.
        chunk_sizes (Sequence[int], optional): explicit per-device sizes; must have ``num_devices`` non-negative
            entries summing to ``batch_size``.
        weights (Sequence[float], optional): ``num_devices`` positive finite relative capacities; the batch is split
            proportionally with largest-remainder rounding (ties go to the lower device index).

    Returns:
        list[int]: ``num_devices`` non-negative sizes summing to ``batch_size``. A device planned ``0`` samples is
        left out of that step (there are as many replicas as non-empty chunks).

    Raises:
        TypeError: a size or count is not an integer, or a weight is not a real number.
        ValueError: a negative size, ``num_devices < 1``, ``gpu0_bsz > batch_size``, a ``gpu0_bsz`` that cannot hold
            the batch on a single device, ``chunk_sizes``/``weights`` of the wrong length, ``chunk_sizes`` that do not
            sum to ``batch_size``, weights that are not positive and finite, or more than one option given.

    Source: the ``gpu0_bsz`` rule is the classic ``BalancedDataParallel`` (transformer-xl) split without its known
    bugs: one device works, device 0 never exceeds its budget, and small batches still yield one replica per chunk.
    """
    batch_size = _check_count("batch_size", batch_size)
    num_devices = _check_count("num_devices", num_devices, minimum=1)
    check_one_split_option(gpu0_bsz, chunk_sizes, weights)

    if chunk_sizes is not None:
        sizes = validate_chunk_sizes(chunk_sizes, num_devices)
        if sum(sizes) != batch_size:
            raise ValueError(f"`chunk_sizes` {sizes} sum to {sum(sizes)}, but the batch has {batch_size} samples")
        return sizes

    if weights is not None:
        return proportional_split(batch_size, validate_weights(weights, num_devices))

    if gpu0_bsz is not None:
        gpu0_bsz = validate_gpu0_bsz(gpu0_bsz)
        if gpu0_bsz > batch_size:
            raise ValueError(f"`gpu0_bsz` ({gpu0_bsz}) must not exceed the batch size ({batch_size})")
        if num_devices == 1:
            if gpu0_bsz < batch_size:
                raise ValueError(
                    f"`gpu0_bsz` ({gpu0_bsz}) cannot hold a batch of {batch_size} on a single device: there is no other"
                    " device to take the rest; use more devices or drop `gpu0_bsz`"
                )
            return [batch_size]
        first = min(gpu0_bsz, batch_size // num_devices)
        return [first, *_even_split(batch_size - first, num_devices - 1)]

    return _even_split(batch_size, num_devices)


def check_one_split_option(gpu0_bsz: object, chunk_sizes: object, weights: object) -> None:
    """Raise ``ValueError`` when more than one of ``gpu0_bsz``, ``chunk_sizes`` and ``weights`` is given."""
    options = (("gpu0_bsz", gpu0_bsz), ("chunk_sizes", chunk_sizes), ("weights", weights))
    given = [name for name, value in options if value is not None]
    if len(given) > 1:
        raise ValueError(f"Give at most one of `gpu0_bsz`, `chunk_sizes` and `weights`, got {' and '.join(given)}")


def validate_gpu0_bsz(gpu0_bsz: int) -> int:
    """Check that ``gpu0_bsz`` is a non-negative integer and return it.

    Raises:
        TypeError: not an integer.
        ValueError: negative.
    """
    return _check_count("gpu0_bsz", gpu0_bsz)


def validate_chunk_sizes(chunk_sizes: Sequence[int], num_devices: int) -> list[int]:
    """Check that ``chunk_sizes`` has one non-negative integer per device and return it as a list.

    Raises:
        TypeError: ``chunk_sizes`` is not a sequence of integers.
        ValueError: wrong length, a negative entry, or all entries zero.
    """
    if isinstance(chunk_sizes, (str, bytes)) or not isinstance(chunk_sizes, Sequence):
        raise TypeError(f"`chunk_sizes` must be a sequence of integers, got {chunk_sizes!r}")
    sizes = [_check_count(f"chunk_sizes[{i}]", size) for i, size in enumerate(chunk_sizes)]
    if len(sizes) != num_devices:
        raise ValueError(f"`chunk_sizes` needs one entry per device ({num_devices}), got {len(sizes)}: {sizes}")
    if sizes and not any(sizes):
        raise ValueError(f"`chunk_sizes` must give at least one device a sample, got {sizes}")
    return sizes


def validate_weights(weights: Sequence[float], num_devices: int) -> list[float]:
    """Check that ``weights`` has one positive finite real number per device and return it as a list of floats.

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
    if len(values) != num_devices:
        raise ValueError(f"`weights` needs one entry per device ({num_devices}), got {len(values)}: {values}")
    return values
