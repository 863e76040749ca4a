"""The package's checks of scalar arguments, one wording for all: :func:`check_int` and :func:`check_real`.

Every message names the argument in backquotes, as the caller spells it (``chunk_sizes[1]`` for an item), and says
what it must be and what it got::

    `warmup_steps` must be an integer, got 2.5 of type float
    `warmup_steps` must be >= 0, got -1
    `weights[1]` must be a real number, got '2' of type str
    `weights[1]` must be positive and finite, got 0.0
    `iou_thresholds[0]` must be in [0, 1], got 1.5
    `score_threshold` must not be NaN

``bool`` is refused as a number (``True`` is an ``int`` to Python, never a count or a weight to us); numpy scalars are
accepted. This module is the package's lowest layer: it imports nothing of the package.
"""

from __future__ import annotations

import math
import numbers

__all__ = ["check_bool", "check_int", "check_module_name", "check_real"]


def _got(value: object) -> str:
    return f"{value!r} of type {type(value).__name__}"


def check_int(name: str, value: object, *, minimum: int | None = None) -> int:
    """``value`` as a plain ``int``, or an error naming the argument ``name``.

    Args:
        name (str): the argument as the caller spells it, e.g. ``"warmup_steps"`` or ``"chunk_sizes[1]"``.
        value (object): any ``numbers.Integral`` but ``bool`` (numpy integers included).
        minimum (int, optional): the smallest value allowed.

    Raises:
        TypeError: not an integer: ``"`name` must be an integer, got 2.5 of type float"``.
        ValueError: below ``minimum``: ``"`name` must be >= 1, got 0"``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"`{name}` must be an integer, got {_got(value)}")
    if minimum is not None and value < minimum:
        raise ValueError(f"`{name}` must be >= {minimum}, got {value}")
    return int(value)


def check_real(
    name: str,
    value: object,
    *,
    minimum: float | None = None,
    maximum: float | None = None,
    positive: bool = False,
    finite: bool = True,
) -> float:
    """``value`` as a ``float``, or an error naming the argument ``name``. NaN is always refused.

    Args:
        name (str): the argument as the caller spells it, e.g. ``"factor"`` or ``"weights[0]"``.
        value (object): any ``numbers.Real`` but ``bool`` (numpy floats and integers included).
        minimum (float, optional): the smallest value allowed (inclusive).
        maximum (float, optional): the largest value allowed (inclusive).
        positive (bool): refuse ``0`` and below.
        finite (bool): refuse infinities (implied when both ``minimum`` and ``maximum`` are given).

    Raises:
        TypeError: not a real number: ``"`name` must be a real number, got '1' of type str"``.
        ValueError: outside the conditions, all named in one message: ``"`name` must be positive and finite, got
            inf"``, ``"`name` must be in [0, 1], got 1.5"``; with no condition but NaN's, ``"`name` must not be NaN"``.
    """
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"`{name}` must be a real number, got {_got(value)}")
    number = float(value)
    conditions: list[str] = []
    valid = not math.isnan(number)
    if positive:
        conditions.append("positive")
        valid = valid and number > 0
    if minimum is not None and maximum is not None:
        conditions.append(f"in [{minimum}, {maximum}]")
    elif minimum is not None:
        conditions.append(f">= {minimum}")
    elif maximum is not None:
        conditions.append(f"<= {maximum}")
    valid = valid and (minimum is None or number >= minimum) and (maximum is None or number <= maximum)
    if finite and (minimum is None or maximum is None):
        conditions.append("finite")
        valid = valid and math.isfinite(number)
    if valid:
        return number
    if not conditions:
        raise ValueError(f"`{name}` must not be NaN")
    raise ValueError(f"`{name}` must be {' and '.join(conditions)}, got {value!r}")


def check_bool(name: str, value: object) -> bool:
    """``value`` if it is a bool.

    Raises:
        TypeError: not a bool: ``"`name` must be a bool, got 'yes'"``.
    """
    if not isinstance(value, bool):
        raise TypeError(f"`{name}` must be a bool, got {value!r}")
    return value


def check_module_name(module_name: object) -> str:
    """``module_name``, the attribute of a LightningModule that holds the ``nn.Sequential`` a pipeline strategy cuts.

    Raises:
        TypeError: not a non-empty string.
    """
    if not isinstance(module_name, str) or not module_name:
        raise TypeError(f"`module_name` must be the name of an attribute (a non-empty str), got {module_name!r}")
    return module_name
