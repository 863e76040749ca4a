"""The chunk planner: how one batch is split over the devices of a single process."""

from __future__ import annotations

import importlib
import itertools
import math
import re
from fractions import Fraction
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import lightning_balanced
from lightning_balanced.split_policies import (
    ChunkSizes,
    EvenSplit,
    Gpu0Budget,
    SplitPolicy,
    Weights,
    even_split,
    plan_chunk_sizes,
    split_policy,
)
from tests.helpers import raises_exactly

# The module, not the function of the same name that the package `split_policies` exports.
split_policy_module = importlib.import_module("lightning_balanced.split_policies.split_policy")

# The planner is pure and cheap: many examples cost milliseconds.
PROPERTY = settings(max_examples=300, deadline=None)

batch_sizes = st.integers(min_value=0, max_value=1000)
device_counts = st.integers(min_value=1, max_value=16)
positive_weights = st.floats(min_value=1e-3, max_value=1e3, allow_nan=False, allow_infinity=False)


@st.composite
def gpu0_plans(draw: st.DrawFn) -> tuple[int, int, int]:
    """(batch_size, num_devices, gpu0_bsz) that the planner must accept."""
    batch_size = draw(batch_sizes)
    num_devices = draw(device_counts)
    # One device has nowhere to send the rest: its budget must hold the whole batch.
    gpu0_bsz = batch_size if num_devices == 1 else draw(st.integers(min_value=0, max_value=batch_size))
    return batch_size, num_devices, gpu0_bsz


@st.composite
def any_plan(draw: st.DrawFn) -> tuple[int, int, dict[str, Any]]:
    """A valid call of the planner with no option, ``gpu0_bsz``, ``chunk_sizes`` or ``weights``."""
    kind = draw(st.sampled_from(["even", "gpu0_bsz", "chunk_sizes", "weights"]))
    if kind == "gpu0_bsz":
        batch_size, num_devices, gpu0_bsz = draw(gpu0_plans())
        return batch_size, num_devices, {"gpu0_bsz": gpu0_bsz}
    num_devices = draw(device_counts)
    if kind == "chunk_sizes":
        sizes = draw(st.lists(st.integers(0, 100), min_size=num_devices, max_size=num_devices).filter(any))
        return sum(sizes), num_devices, {"chunk_sizes": sizes}
    batch_size = draw(batch_sizes)
    if kind == "weights":
        weights = draw(st.lists(positive_weights, min_size=num_devices, max_size=num_devices))
        return batch_size, num_devices, {"weights": weights}
    return batch_size, num_devices, {}


def _differ_by_at_most_one_larger_first(sizes: list[int]) -> bool:
    return all(a >= b for a, b in itertools.pairwise(sizes)) and (not sizes or max(sizes) - min(sizes) <= 1)


def _exact_largest_remainder(total: int, weights: list[float]) -> list[int]:
    """Hamilton's method in exact rational arithmetic, ties to the lower index: the reference."""
    exact = [Fraction(w) for w in weights]
    quotas = [total * w / sum(exact) for w in exact]
    sizes = [math.floor(q) for q in quotas]
    leftover = total - sum(sizes)
    for i in sorted(range(len(quotas)), key=lambda i: (-(quotas[i] - sizes[i]), i))[:leftover]:
        sizes[i] += 1
    return sizes


# --- every plan -------------------------------------------------------------------------------------------------------


@PROPERTY
@given(any_plan())
def test_every_plan_has_one_non_negative_int_per_device_summing_to_the_batch(plan: tuple[int, int, dict]) -> None:
    batch_size, num_devices, options = plan
    sizes = plan_chunk_sizes(batch_size, num_devices, **options)
    assert len(sizes) == num_devices
    assert sum(sizes) == batch_size
    assert all(type(size) is int and size >= 0 for size in sizes)


def test_numpy_integers_are_accepted_and_plain_ints_returned() -> None:
    sizes = plan_chunk_sizes(np.int64(10), np.int64(4), gpu0_bsz=np.int32(2))
    assert sizes == [2, 3, 3, 2]
    assert all(type(size) is int for size in sizes)


# --- no option: even split --------------------------------------------------------------------------------------------


@PROPERTY
@given(batch_sizes, device_counts)
def test_even_split_differs_by_at_most_one_with_larger_chunks_first(batch_size: int, num_devices: int) -> None:
    sizes = plan_chunk_sizes(batch_size, num_devices)
    assert _differ_by_at_most_one_larger_first(sizes)
    assert sum(sizes) == batch_size


@pytest.mark.parametrize(
    ("batch_size", "num_devices", "expected"),
    [(10, 4, [3, 3, 2, 2]), (8, 4, [2, 2, 2, 2]), (7, 1, [7]), (0, 3, [0, 0, 0]), (2, 4, [1, 1, 0, 0])],
)
def test_even_split_examples(batch_size: int, num_devices: int, expected: list[int]) -> None:
    assert plan_chunk_sizes(batch_size, num_devices) == expected


@PROPERTY
@given(st.integers(0, 15), st.integers(1, 16))
def test_batch_smaller_than_device_count_gives_one_chunk_per_sample(batch_size: int, num_devices: int) -> None:
    # The classic BalancedDataParallel made fewer chunks than replicas here and parallel_apply failed; here the devices
    # planned 0 are simply left out, so the number of non-empty chunks is the number of replicas the step needs.
    sizes = plan_chunk_sizes(batch_size, num_devices)
    non_empty = [size for size in sizes if size > 0]
    assert len(non_empty) == min(batch_size, num_devices)
    if batch_size < num_devices:
        assert non_empty == [1] * batch_size
        assert sizes[batch_size:] == [0] * (num_devices - batch_size)


# --- gpu0_bsz ---------------------------------------------------------------------------------------------------------


@PROPERTY
@given(gpu0_plans())
def test_gpu0_budget_is_never_exceeded(plan: tuple[int, int, int]) -> None:
    batch_size, num_devices, gpu0_bsz = plan
    assert plan_chunk_sizes(batch_size, num_devices, gpu0_bsz=gpu0_bsz)[0] <= gpu0_bsz


@PROPERTY
@given(gpu0_plans())
def test_gpu0_remainder_goes_evenly_to_the_other_devices(plan: tuple[int, int, int]) -> None:
    batch_size, num_devices, gpu0_bsz = plan
    sizes = plan_chunk_sizes(batch_size, num_devices, gpu0_bsz=gpu0_bsz)
    if num_devices == 1:
        assert sizes == [batch_size]
        return
    # The documented rule: device 0 takes min(gpu0_bsz, batch // n); devices 1.. share the rest evenly, the extra
    # samples going to devices 1, 2, ... and never to device 0.
    assert sizes[0] == min(gpu0_bsz, batch_size // num_devices)
    assert _differ_by_at_most_one_larger_first(sizes[1:])
    assert sizes[0] <= min(sizes[1:])


def test_gpu0_anchor_case_stays_within_budget() -> None:
    # The classic BalancedDataParallel falls back to torch's [3, 3, 3, 1] here, giving GPU 0 more than its budget of 2.
    assert plan_chunk_sizes(10, 4, gpu0_bsz=2) == [2, 3, 3, 2]


@pytest.mark.parametrize(("batch_size", "num_devices"), [(10, 4), (3, 4), (1, 2), (0, 3)])
def test_gpu0_bsz_zero_leaves_device_0_out(batch_size: int, num_devices: int) -> None:
    sizes = plan_chunk_sizes(batch_size, num_devices, gpu0_bsz=0)
    assert sizes[0] == 0
    assert sum(sizes[1:]) == batch_size
    assert _differ_by_at_most_one_larger_first(sizes[1:])


@pytest.mark.parametrize("batch_size", [0, 1, 7])
def test_one_device_takes_the_whole_batch_when_gpu0_bsz_equals_it(batch_size: int) -> None:
    # The classic BalancedDataParallel divides by n - 1 = 0 here.
    assert plan_chunk_sizes(batch_size, 1, gpu0_bsz=batch_size) == [batch_size]


def test_one_device_refuses_a_gpu0_bsz_below_the_batch() -> None:
    with pytest.raises(ValueError, match="`gpu0_bsz`"):
        plan_chunk_sizes(10, 1, gpu0_bsz=4)


@PROPERTY
@given(gpu0_plans())
def test_gpu0_plan_never_leaves_a_device_idle_while_another_has_two_samples(plan: tuple[int, int, int]) -> None:
    batch_size, num_devices, gpu0_bsz = plan
    sizes = plan_chunk_sizes(batch_size, num_devices, gpu0_bsz=gpu0_bsz)
    rest = sizes[1:]
    # Devices 1.. take one sample each before any takes a second, so a small batch still yields one replica per
    # non-empty chunk (the classic split produced fewer chunks than replicas when bsz < n).
    assert sum(1 for size in rest if size > 0) == min(batch_size - sizes[0], num_devices - 1)
    if batch_size < num_devices:
        assert sizes[0] == 0
        assert [size for size in sizes if size > 0] == [1] * batch_size


# --- weights ----------------------------------------------------------------------------------------------------------


@PROPERTY
@given(batch_sizes, st.lists(positive_weights, min_size=1, max_size=16))
def test_weighted_sizes_are_within_one_of_the_exact_quota(batch_size: int, weights: list[float]) -> None:
    sizes = plan_chunk_sizes(batch_size, len(weights), weights=weights)
    exact = [Fraction(w) for w in weights]
    for size, weight in zip(sizes, exact, strict=True):
        quota = batch_size * weight / sum(exact)
        assert abs(size - quota) < 1
    assert sum(sizes) == batch_size


@PROPERTY
@given(batch_sizes, st.lists(st.integers(1, 20), min_size=1, max_size=8))
def test_weighted_split_is_exact_largest_remainder(batch_size: int, weights: list[int]) -> None:
    # Integer weights make the quotas exact rationals, so ties are real ties and must go to the lower index.
    assert plan_chunk_sizes(batch_size, len(weights), weights=weights) == _exact_largest_remainder(batch_size, weights)


@pytest.mark.parametrize(
    ("batch_size", "weights", "expected"),
    [
        (4, [1, 1, 1], [2, 1, 1]),
        (2, [1, 2, 1], [1, 1, 0]),
        (10, [3, 1], [8, 2]),
        # Quotas 4/3, 1/3, 1/3: all three remainders are exactly 1/3, so the one left-over sample goes to device 0.
        (2, [4, 1, 1], [2, 0, 0]),
    ],
)
def test_weighted_split_ties_go_to_the_lower_device_index(
    batch_size: int, weights: list[int], expected: list[int]
) -> None:
    assert plan_chunk_sizes(batch_size, len(weights), weights=weights) == expected


@PROPERTY
@given(batch_sizes, device_counts, positive_weights)
def test_equal_weights_give_the_even_split(batch_size: int, num_devices: int, weight: float) -> None:
    assert plan_chunk_sizes(batch_size, num_devices, weights=[weight] * num_devices) == plan_chunk_sizes(
        batch_size, num_devices
    )


# --- chunk_sizes ------------------------------------------------------------------------------------------------------


@PROPERTY
@given(st.lists(st.integers(0, 100), min_size=1, max_size=16).filter(any), st.booleans())
def test_explicit_chunk_sizes_are_returned_as_given(sizes: list[int], as_tuple: bool) -> None:
    given_sizes = tuple(sizes) if as_tuple else list(sizes)
    assert plan_chunk_sizes(sum(sizes), len(sizes), chunk_sizes=given_sizes) == sizes


@PROPERTY
@given(st.lists(st.integers(0, 100), min_size=1, max_size=16).filter(any), batch_sizes)
def test_a_batch_of_another_size_is_split_in_the_proportions_of_chunk_sizes(sizes: list[int], batch_size: int) -> None:
    # The short last batch, or a validation loader with another batch size: the same rule in every loop.
    planned = plan_chunk_sizes(batch_size, len(sizes), chunk_sizes=sizes)
    assert planned == _exact_largest_remainder(batch_size, [float(s) for s in sizes])
    assert all(p == 0 for p, s in zip(planned, sizes, strict=True) if s == 0)


@PROPERTY
@given(batch_sizes, st.integers(2, 16), st.integers(0, 2000))
def test_gpu0_bsz_is_a_budget_even_above_the_batch_size(batch_size: int, num_devices: int, gpu0_bsz: int) -> None:
    planned = plan_chunk_sizes(batch_size, num_devices, gpu0_bsz=gpu0_bsz)
    assert planned[0] == min(gpu0_bsz, batch_size // num_devices)
    assert sum(planned) == batch_size


@pytest.mark.parametrize(
    "options", [{}, {"gpu0_bsz": 3}, {"gpu0_bsz": 0}, {"chunk_sizes": [0, 4, 6]}, {"weights": [1.0, 2.0, 3.0]}]
)
def test_a_batch_of_zero_samples_is_planned_as_zero_everywhere(options: dict[str, Any]) -> None:
    assert plan_chunk_sizes(0, 3, **options) == [0, 0, 0]


def test_the_policy_checks_the_device_count_and_names_its_setting() -> None:
    policy = split_policy(chunk_sizes=[2, 3])
    with pytest.raises(ValueError, match=r"one entry per device \(3\)"):
        policy.check_devices(3)
    assert str(policy) == "chunk_sizes=[2, 3]"
    assert str(split_policy(gpu0_bsz=4)) == "gpu0_bsz=4"
    assert str(split_policy(weights=[1, 2])) == "weights=[1.0, 2.0]"
    assert str(split_policy()) == "an even split"
    assert policy.plan(10, 2) == plan_chunk_sizes(10, 2, chunk_sizes=[2, 3]) == [4, 6]


# --- the policy objects -----------------------------------------------------------------------------------------------

POLICY_OF_OPTION = {"gpu0_bsz": Gpu0Budget, "chunk_sizes": ChunkSizes, "weights": Weights}


@PROPERTY
@given(any_plan())
def test_each_shorthand_is_its_policy_object(plan: tuple[int, int, dict]) -> None:
    batch_size, num_devices, options = plan
    policy = next((POLICY_OF_OPTION[name](value) for name, value in options.items()), EvenSplit())
    assert type(split_policy(**options)) is type(policy)
    assert policy.plan(batch_size, num_devices) == plan_chunk_sizes(batch_size, num_devices, **options)


def test_policies_show_how_they_are_made() -> None:
    assert repr(Gpu0Budget(14)) == "Gpu0Budget(14)"
    assert repr(ChunkSizes((4, 14, 14))) == "ChunkSizes([4, 14, 14])"
    assert repr(Weights([24, 12])) == "Weights([24.0, 12.0])"
    assert repr(EvenSplit()) == "EvenSplit()"


def test_policies_are_exported_where_the_other_public_names_are() -> None:
    for cls in (SplitPolicy, EvenSplit, Gpu0Budget, ChunkSizes, Weights):
        assert getattr(lightning_balanced, cls.__name__) is cls
        assert getattr(split_policy_module, cls.__name__) is cls
        assert cls.__name__ in lightning_balanced.__all__
    assert "even_split" in lightning_balanced.split_policies.__all__


def test_an_unknown_name_of_the_module_is_still_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="has no attribute 'Nothing'"):
        split_policy_module.Nothing  # noqa: B018


def test_split_returns_the_given_policy() -> None:
    policy = Gpu0Budget(3)
    assert split_policy(split=policy) is policy


@pytest.mark.parametrize(
    ("options", "message"),
    [
        (
            {"gpu0_bsz": 14},
            "`split` and `gpu0_bsz` cannot be given together: `gpu0_bsz=14` is short for `split=Gpu0Budget(14)`;"
            " give one of them",
        ),
        (
            {"chunk_sizes": [4, 14]},
            "`split` and `chunk_sizes` cannot be given together: `chunk_sizes=[4, 14]` is short for"
            " `split=ChunkSizes([4, 14])`; give one of them",
        ),
        (
            {"weights": [1.0, 2.0]},
            "`split` and `weights` cannot be given together: `weights=[1.0, 2.0]` is short for"
            " `split=Weights([1.0, 2.0])`; give one of them",
        ),
    ],
)
def test_split_with_a_shorthand_names_both(options: dict[str, Any], message: str) -> None:
    with raises_exactly(ValueError, message):
        split_policy(split=EvenSplit(), **options)


@pytest.mark.parametrize("bad", [14, [4, 14], "Gpu0Budget", Gpu0Budget])
def test_split_must_be_a_policy(bad: Any) -> None:
    message = (
        "`split` must be a SplitPolicy (EvenSplit(), Gpu0Budget(...), ChunkSizes([...]), Weights([...]) or a subclass"
        f" of your own), got {bad!r} of type {type(bad).__name__}"
    )
    with raises_exactly(TypeError, message):
        split_policy(split=bad)


def test_the_abstract_policy_cannot_be_made() -> None:
    with pytest.raises(TypeError, match="abstract"):
        SplitPolicy()  # type: ignore[abstract]


class _LastDeviceFirst(SplitPolicy):
    """A new policy is one class: the even split, with the larger chunks on the higher device indices."""

    def _plan(self, batch_size: int, num_devices: int) -> list[int]:
        return even_split(batch_size, num_devices)[::-1]

    def __repr__(self) -> str:
        return "_LastDeviceFirst()"


def test_a_new_policy_is_one_class() -> None:
    policy = _LastDeviceFirst()
    assert policy.plan(10, 4) == [2, 2, 3, 3]
    assert policy.plan(0, 2) == [0, 0]
    policy.check_devices(5)  # serves any device count
    policy.observe([2, 2, 3, 3], [0.1, 0.1, 0.2, 0.2])  # learns nothing, and needs to say nothing
    with raises_exactly(ValueError, "`num_devices` must be >= 1, got 0"):
        policy.plan(10, 0)  # the arguments are checked before the policy sees them


class _Broken(SplitPolicy):
    def __init__(self, answer: list[Any]) -> None:
        self.answer = answer

    def _plan(self, batch_size: int, num_devices: int) -> list[int]:
        return self.answer

    def __repr__(self) -> str:
        return f"_Broken({self.answer})"


@pytest.mark.parametrize("answer", [[5, 4], [5, 5, 0], [11, -1], [5.0, 5], [True, 9]])
def test_a_wrong_plan_fails_in_plan_naming_the_policy(answer: list[Any]) -> None:
    message = f"_Broken({answer}) planned {answer} for a batch of 10 over 2 devices: a plan must be 2 non-negative ints"
    with raises_exactly(ValueError, message + " summing to 10"):
        _Broken(answer).plan(10, 2)


# --- even_split -------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("total", "parts", "expected"),
    [(10, 4, [3, 3, 2, 2]), (2, 4, [1, 1, 0, 0]), (0, 2, [0, 0]), (7, 1, [7]), (np.int64(5), np.int32(2), [3, 2])],
)
def test_even_split_examples_public(total: int, parts: int, expected: list[int]) -> None:
    got = even_split(total, parts)
    assert got == expected and all(type(size) is int for size in got)


@PROPERTY
@given(batch_sizes, device_counts)
def test_even_split_is_the_even_policy(total: int, parts: int) -> None:
    sizes = even_split(total, parts)
    assert sizes == EvenSplit().plan(total, parts)
    assert sum(sizes) == total and _differ_by_at_most_one_larger_first(sizes)


@pytest.mark.parametrize(
    ("args", "error", "message"),
    [
        ((-1, 2), ValueError, "`total` must be >= 0, got -1"),
        ((4, 0), ValueError, "`num_parts` must be >= 1, got 0"),
        ((4.0, 2), TypeError, "`total` must be an integer, got 4.0 of type float"),
        ((4, True), TypeError, "`num_parts` must be an integer, got True of type bool"),
    ],
)
def test_even_split_checks_its_arguments(args: tuple[Any, Any], error: type[Exception], message: str) -> None:
    with raises_exactly(error, message):
        even_split(*args)


# --- errors -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "options", "name"),
    [
        ((-1, 2), {}, "batch_size"),
        ((10, 0), {}, "num_devices"),
        ((10, -2), {}, "num_devices"),
        ((10, 2), {"gpu0_bsz": -1}, "gpu0_bsz"),
        ((10, 1), {"gpu0_bsz": 9}, "gpu0_bsz"),
        ((10, 3), {"chunk_sizes": [6, -1, 5]}, "chunk_sizes"),
        ((10, 3), {"chunk_sizes": [5, 5]}, "chunk_sizes"),
        ((10, 3), {"chunk_sizes": [5, 5, 0, 0]}, "chunk_sizes"),
        ((10, 3), {"chunk_sizes": [0, 0, 0]}, "chunk_sizes"),
        ((10, 3), {"weights": [1.0, 1.0]}, "weights"),
        ((10, 3), {"weights": [1.0, 1.0, 1.0, 1.0]}, "weights"),
        ((10, 3), {"weights": [1.0, 0.0, 1.0]}, "weights"),
        ((10, 3), {"weights": [1.0, -2.0, 1.0]}, "weights"),
        ((10, 3), {"weights": [1.0, math.nan, 1.0]}, "weights"),
        ((10, 3), {"weights": [1.0, math.inf, 1.0]}, "weights"),
        ((10, 2), {"gpu0_bsz": 2, "weights": [1, 1]}, "gpu0_bsz"),
        ((10, 2), {"gpu0_bsz": 0, "chunk_sizes": [5, 5]}, "chunk_sizes"),
        ((10, 2), {"chunk_sizes": [5, 5], "weights": [1, 1]}, "weights"),
    ],
)
def test_invalid_values_raise_value_error_naming_the_argument(
    args: tuple[int, int], options: dict[str, Any], name: str
) -> None:
    with pytest.raises(ValueError, match=re.escape(name)):
        plan_chunk_sizes(*args, **options)


def test_two_options_at_once_name_both() -> None:
    with raises_exactly(
        ValueError, "Give at most one of `gpu0_bsz`, `chunk_sizes` and `weights`, got gpu0_bsz and weights"
    ):
        plan_chunk_sizes(10, 2, gpu0_bsz=2, weights=[1, 1])


@pytest.mark.parametrize(
    ("options", "error", "message"),
    [
        ({"gpu0_bsz": 2.5}, TypeError, "`gpu0_bsz` must be an integer, got 2.5 of type float"),
        ({"gpu0_bsz": -1}, ValueError, "`gpu0_bsz` must be >= 0, got -1"),
        ({"chunk_sizes": [5, True]}, TypeError, "`chunk_sizes[1]` must be an integer, got True of type bool"),
        ({"chunk_sizes": [6, -1]}, ValueError, "`chunk_sizes[1]` must be >= 0, got -1"),
        ({"weights": ["1", 1.0]}, TypeError, "`weights[0]` must be a real number, got '1' of type str"),
        ({"weights": [1.0, 0.0]}, ValueError, "`weights[1]` must be positive and finite, got 0.0"),
        ({"weights": [1.0, math.inf]}, ValueError, "`weights[1]` must be positive and finite, got inf"),
    ],
)
def test_the_settings_messages_in_full(options: dict[str, Any], error: type[Exception], message: str) -> None:
    with raises_exactly(error, message):
        plan_chunk_sizes(10, 2, **options)


@pytest.mark.parametrize("bad", [2.5, 10.0, True, "3", None])
def test_non_integer_batch_size_raises_type_error(bad: Any) -> None:
    with pytest.raises(TypeError, match="batch_size"):
        plan_chunk_sizes(bad, 2)


@pytest.mark.parametrize("bad", [2.5, 2.0, True, "3"])
def test_non_integer_num_devices_raises_type_error(bad: Any) -> None:
    with pytest.raises(TypeError, match="num_devices"):
        plan_chunk_sizes(10, bad)


@pytest.mark.parametrize("bad", [2.5, True, "3"])
def test_non_integer_gpu0_bsz_raises_type_error(bad: Any) -> None:
    with pytest.raises(TypeError, match="gpu0_bsz"):
        plan_chunk_sizes(10, 4, gpu0_bsz=bad)


@pytest.mark.parametrize("bad", [[2.5, 7.5], [True, 9], ["3", 7], "37", 10])
def test_non_integer_chunk_sizes_raise_type_error(bad: Any) -> None:
    with pytest.raises(TypeError, match="chunk_sizes"):
        plan_chunk_sizes(10, 2, chunk_sizes=bad)


@pytest.mark.parametrize("bad", [["1", 1.0], [True, 1.0], [1.0, None], "11", 1.0])
def test_non_real_weights_raise_type_error(bad: Any) -> None:
    with pytest.raises(TypeError, match="weights"):
        plan_chunk_sizes(10, 2, weights=bad)
