"""The package's argument checks: one wording for every integer and real-number argument."""

from __future__ import annotations

import ast
import math
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import lightning_balanced.arguments as arguments
from lightning_balanced.arguments import check_int, check_real
from tests.helpers import raises_exactly

# --- check_int --------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0, 7, -3, np.int64(7), np.int32(-3), np.uint8(7)])
def test_check_int_gives_a_plain_int(value: Any) -> None:
    got = check_int("n", value)
    assert type(got) is int and got == int(value)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (2.5, "`n` must be an integer, got 2.5 of type float"),
        (2.0, "`n` must be an integer, got 2.0 of type float"),
        (True, "`n` must be an integer, got True of type bool"),
        ("3", "`n` must be an integer, got '3' of type str"),
        (None, "`n` must be an integer, got None of type NoneType"),
        (np.float64(1.0), f"`n` must be an integer, got {np.float64(1.0)!r} of type float64"),
    ],
)
def test_check_int_refuses_what_is_not_an_integer(value: Any, message: str) -> None:
    with raises_exactly(TypeError, message):
        check_int("n", value)


@pytest.mark.parametrize(("value", "minimum"), [(0, 1), (-1, 0), (np.int64(4), 5)])
def test_check_int_refuses_a_value_below_the_minimum(value: Any, minimum: int) -> None:
    with raises_exactly(ValueError, f"`n` must be >= {minimum}, got {value}"):
        check_int("n", value, minimum=minimum)


def test_check_int_accepts_the_minimum_and_any_value_without_one() -> None:
    assert check_int("n", 1, minimum=1) == 1
    assert check_int("n", -(10**30)) == -(10**30)


def test_the_name_is_quoted_as_given() -> None:
    with raises_exactly(ValueError, "`chunk_sizes[2]` must be >= 0, got -1"):
        check_int("chunk_sizes[2]", -1, minimum=0)


# --- check_real -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value", [0.5, 3, -2.0, np.float32(0.25), np.int64(4), Fraction(1, 4)])
def test_check_real_gives_a_float(value: Any) -> None:
    got = check_real("x", value)
    assert type(got) is float and got == float(value)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (True, "`x` must be a real number, got True of type bool"),
        ("0.5", "`x` must be a real number, got '0.5' of type str"),
        (None, "`x` must be a real number, got None of type NoneType"),
        (1j, "`x` must be a real number, got 1j of type complex"),
    ],
)
def test_check_real_refuses_what_is_not_a_real_number(value: Any, message: str) -> None:
    with raises_exactly(TypeError, message):
        check_real("x", value)


@pytest.mark.parametrize(
    ("value", "options", "message"),
    [
        # finite by default
        (math.inf, {}, "`x` must be finite, got inf"),
        (math.nan, {}, "`x` must be finite, got nan"),
        # positive
        (0.0, {"positive": True}, "`x` must be positive and finite, got 0.0"),
        (-1, {"positive": True}, "`x` must be positive and finite, got -1"),
        (math.inf, {"positive": True}, "`x` must be positive and finite, got inf"),
        (math.nan, {"positive": True}, "`x` must be positive and finite, got nan"),
        (0.0, {"positive": True, "finite": False}, "`x` must be positive, got 0.0"),
        # bounds: both imply finite
        (1.5, {"minimum": 0, "maximum": 1}, "`x` must be in [0, 1], got 1.5"),
        (-0.1, {"minimum": 0, "maximum": 1}, "`x` must be in [0, 1], got -0.1"),
        (math.nan, {"minimum": 0, "maximum": 1}, "`x` must be in [0, 1], got nan"),
        (math.inf, {"minimum": 0, "maximum": 1, "finite": False}, "`x` must be in [0, 1], got inf"),
        (-1, {"minimum": 0}, "`x` must be >= 0 and finite, got -1"),
        (math.inf, {"minimum": 0}, "`x` must be >= 0 and finite, got inf"),
        (2, {"maximum": 1.5, "finite": False}, "`x` must be <= 1.5, got 2"),
        # NaN is refused even with no other condition
        (math.nan, {"finite": False}, "`x` must not be NaN"),
        (np.float64("nan"), {"finite": False}, "`x` must not be NaN"),
    ],
)
def test_check_real_names_every_condition_in_one_message(value: Any, options: dict[str, Any], message: str) -> None:
    with raises_exactly(ValueError, message):
        check_real("x", value, **options)


@pytest.mark.parametrize(
    ("value", "options"),
    [
        (math.inf, {"finite": False}),
        (-math.inf, {"finite": False}),
        (1e-300, {"positive": True}),
        (0, {"minimum": 0, "maximum": 1}),
        (1, {"minimum": 0, "maximum": 1}),
        (math.inf, {"minimum": 0, "finite": False}),
    ],
)
def test_check_real_accepts_the_edges(value: Any, options: dict[str, Any]) -> None:
    assert check_real("x", value, **options) == float(value)


# --- the module -------------------------------------------------------------------------------------------------------


def test_the_module_imports_nothing_of_the_package() -> None:
    tree = ast.parse(Path(arguments.__file__).read_text())
    imported = [alias.name for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names]
    imported += [node.module or "" for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)]
    assert not [name for name in imported if name.startswith("lightning_balanced")]
    assert all(node.level == 0 for node in ast.walk(tree) if isinstance(node, ast.ImportFrom))
