"""The forward pass across processes on real gloo groups: micro-batches, tuples between stages, any placement.

One spawn per world size runs every case (a spawn costs about 8 s); each rank also computes the reference in its own
process (same threads, same kernels), so the pipeline's output can be compared bitwise.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn

from lightning_balanced.pipelining.p2p_forward import Activation, StageExamples, pipelined_forward
from tests.distributed import run_distributed

pytestmark = pytest.mark.slow

WIDTH = 6
# (chunks, batch): the whole batch; uneven micro-batches (3, 2, 2); a batch smaller than chunks; an empty batch.
RUNS = [(1, 7), (3, 7), (5, 3), (2, 0)]
FIRST_MICRO_BATCH = {(1, 7): 7, (3, 7): 3, (5, 3): 1, (2, 0): 0}
PLACEMENTS = {
    2: [
        ("plain", [0, 1]),  # single
        ("plain", [1, 0]),  # stage 0 on rank 1
        ("plain", [0, 1, 0, 1]),  # loop
        ("plain", [0, 1, 1, 0]),  # V
        ("plain", [0, 0, 1]),  # two consecutive stages on one rank
        ("tuple", [0, 1, 0, 1]),
        ("tuple", [0, 1, 1, 0]),
        ("tuple", [0, 0, 1, 1]),
    ],
    3: [
        ("plain", [0, 1, 2]),
        ("plain", [0, 1, 2, 0, 1, 2]),
        ("plain", [0, 1, 2, 2, 1, 0]),
        ("plain", [2, 2, 0, 1, 1]),
        ("tuple", [0, 1, 2, 0]),
        ("tuple", [1, 0, 0, 2]),
    ],
}


# ---- the models: plain stages (eval-mode BatchNorm included), and stages that pass two tensors ---------------------
def _plain_stages(count: int) -> list[nn.Module]:
    torch.manual_seed(0)
    stages: list[nn.Module] = []
    for _ in range(count):
        norm = nn.BatchNorm1d(WIDTH)
        norm.running_mean.uniform_(-1, 1)
        norm.running_var.uniform_(0.5, 2)
        stages.append(nn.Sequential(nn.Linear(WIDTH, WIDTH), norm, nn.Tanh()).double().eval())
    return stages


class _Fork(nn.Module):
    """(x, y) -> (h, skip): the pipeline's input is a tuple, and two tensors leave."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: Tensor, y: Tensor) -> tuple[Tensor, Tensor]:
        return self.linear(x), y


class _Mix(nn.Module):
    """(h, skip) -> (h', skip'): two tensors in, two out."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: Tensor, skip: Tensor) -> tuple[Tensor, Tensor]:
        return torch.tanh(self.linear(h)), skip * 2


class _Join(nn.Module):
    """(h, skip) -> one tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, h: Tensor, skip: Tensor) -> Tensor:
        return self.linear(h) + skip


class _Heads(nn.Module):
    """One tensor -> a tuple of a float64 and a bool tensor: the pipeline's output is a tuple."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, 3)

    def forward(self, h: Tensor) -> tuple[Tensor, Tensor]:
        return self.linear(h), h > 0


def _tuple_stages(count: int) -> list[nn.Module]:
    assert count == 4
    torch.manual_seed(0)
    return [stage.double() for stage in (_Fork(), _Mix(), _Join(), _Heads())]


def _input(kind: str, batch: int) -> Activation:
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(batch, WIDTH, dtype=torch.float64, generator=generator)
    return x if kind == "plain" else (x, torch.randn(batch, WIDTH, dtype=torch.float64, generator=generator))


def _stages(kind: str, count: int) -> list[nn.Module]:
    return _plain_stages(count) if kind == "plain" else _tuple_stages(count)


# ---- the reference: the same layers in one process ------------------------------------------------------------------
def _args(value: Activation) -> tuple[Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


def _split(x: Activation, pieces: int) -> list[Activation]:
    parts = [torch.tensor_split(t, pieces) for t in _args(x)]
    return [micro if isinstance(x, tuple) else micro[0] for micro in zip(*parts, strict=True)]


def _reference(
    stages: list[nn.Module], x: Activation, pieces: int
) -> tuple[Activation, dict[int, Any], dict[int, Any]]:
    """The micro-batches one after another through every stage, joined; and each stage's first in- and output."""
    inputs: dict[int, Any] = {}
    outputs: dict[int, Any] = {}
    results = []
    for micro, value in enumerate(_split(x, pieces)):
        for index, stage in enumerate(stages):
            if micro == 0:
                inputs[index] = value
            value = stage(*_args(value))
            if micro == 0:
                outputs[index] = value
        results.append(value)
    if len(results) == 1:
        return results[0], inputs, outputs
    joined = tuple(torch.cat(parts) for parts in zip(*(_args(r) for r in results), strict=True))
    return (joined if isinstance(results[0], tuple) else joined[0]), inputs, outputs


# ---- what each rank runs --------------------------------------------------------------------------------------------
class _ReturnsDict(nn.Module):
    def forward(self, x: Tensor) -> dict[str, Tensor]:
        return {"y": x}


class _ReturnsTupleWithInt(nn.Module):
    def forward(self, x: Tensor) -> tuple[Tensor, int]:
        return x, 3


class _ReturnsComplex(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.to(torch.complex128)


def _error_of(rank: int, bad: nn.Module, **options: Any) -> str | None:
    """Stage 0 (rank 0) sends its output to ``bad``, stage 1 (rank 1): the error on rank 1, ``None`` on rank 0."""
    torch.manual_seed(0)
    stages = {0: nn.Linear(WIDTH, WIDTH).double()} if rank == 0 else {1: bad}
    x = _input("plain", 4)
    try:
        pipelined_forward(x, stages, [0, 1], rank, dist.group.WORLD, torch.device("cpu"), **options)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return None


def _forward_cases(rank: int, world_size: int) -> dict[str, Any]:
    group = dist.group.WORLD
    assert group is not None
    cases = []
    with torch.no_grad():
        for kind, owners in PLACEMENTS[world_size]:
            for chunks, batch in RUNS:
                for output_to in ("all", "last"):
                    stages = _stages(kind, len(owners))
                    mine = {index: stage for index, stage in enumerate(stages) if owners[index] == rank}
                    x = _input(kind, batch)
                    # Only the rank of stage 0 reads the input: the others pass one that would not fit.
                    given = x if owners[0] == rank else torch.zeros(0)
                    examples = StageExamples({}, {})
                    output = pipelined_forward(
                        given,
                        mine,
                        owners,
                        rank,
                        group,
                        torch.device("cpu"),
                        examples,
                        chunks=chunks,
                        output_to=output_to,
                    )
                    pieces = 1 if chunks == 1 else max(1, min(chunks, batch))
                    expected, inputs, outputs = _reference(stages, x, pieces)
                    whole, _, _ = _reference(stages, x, 1)
                    cases.append(
                        {
                            "case": f"{kind} owners={owners} chunks={chunks} batch={batch} output_to={output_to}",
                            "owners": owners,
                            "chunks_batch": (chunks, batch),
                            "output_to": output_to,
                            "output": output,
                            "expected": expected,
                            "whole": whole,
                            "examples": (examples.inputs, examples.outputs),
                            "expected_examples": (
                                {i: v for i, v in inputs.items() if i in mine},
                                {i: v for i, v in outputs.items() if i in mine},
                            ),
                        }
                    )
    errors: dict[str, str | None] = {}
    if world_size == 2:
        errors["dict"] = _error_of(rank, _ReturnsDict(), output_to="last")
        errors["tuple with int"] = _error_of(rank, _ReturnsTupleWithInt(), output_to="last")
        errors["complex"] = _error_of(rank, _ReturnsComplex(), output_to="last")
        errors["chunks"] = _error_of(rank, nn.Identity(), chunks=0)
        errors["output_to"] = _error_of(rank, nn.Identity(), output_to="first")
    return {"cases": cases, "errors": errors}


@pytest.fixture(scope="module")
def two_ranks() -> list[dict[str, Any]]:
    return run_distributed(_forward_cases, 2, timeout_s=60)


@pytest.fixture(scope="module")
def three_ranks() -> list[dict[str, Any]]:
    return run_distributed(_forward_cases, 3, timeout_s=60)


# ---- checks ----------------------------------------------------------------------------------------------------------
def _same(actual: Any, expected: Any) -> bool:
    """Equal bitwise, in dtype and structure (a tensor is not a 1-tuple)."""
    if isinstance(expected, Tensor):
        return isinstance(actual, Tensor) and actual.dtype == expected.dtype and torch.equal(actual, expected)
    return (
        isinstance(actual, tuple)
        and len(actual) == len(expected)
        and all(_same(a, e) for a, e in zip(actual, expected, strict=True))
    )


def _check_outputs(results: list[dict[str, Any]]) -> None:
    for per_rank in zip(*(result["cases"] for result in results), strict=True):
        last_owner = per_rank[0]["owners"][-1]
        for rank, case in enumerate(per_rank):
            if case["output_to"] == "last" and rank != last_owner:
                assert case["output"] is None, f"rank {rank}: {case['case']}"
                continue
            assert _same(case["output"], case["expected"]), f"rank {rank}: {case['case']}"
            # The whole batch at once: equal up to MKL's batch-size dependent rounding (the last bit of float64).
            torch.testing.assert_close(case["output"], case["whole"], rtol=1e-14, atol=1e-14)


def _check_examples(results: list[dict[str, Any]]) -> None:
    for rank, result in enumerate(results):
        for case in result["cases"]:
            (inputs, outputs), (expected_inputs, expected_outputs) = case["examples"], case["expected_examples"]
            mine = [index for index, owner in enumerate(case["owners"]) if owner == rank]
            assert sorted(inputs) == sorted(outputs) == mine, case["case"]
            first = FIRST_MICRO_BATCH[case["chunks_batch"]]
            for index in mine:
                for example, expected in (
                    (inputs[index], expected_inputs[index]),
                    (outputs[index], expected_outputs[index]),
                ):
                    assert _same(example, expected), f"rank {rank} stage {index}: {case['case']}"
                    assert all(t.shape[0] == first for t in _args(example)), f"rank {rank}: {case['case']}"


def test_micro_batched_forward_on_two_ranks_equals_the_micro_batches_in_one_process(two_ranks: list[Any]) -> None:
    _check_outputs(two_ranks)


def test_micro_batched_forward_on_three_ranks_equals_the_micro_batches_in_one_process(three_ranks: list[Any]) -> None:
    _check_outputs(three_ranks)


def test_examples_hold_each_stages_first_micro_batch(two_ranks: list[Any], three_ranks: list[Any]) -> None:
    _check_examples(two_ranks)
    _check_examples(three_ranks)


def test_output_to_last_keeps_the_output_on_the_last_stages_rank(two_ranks: list[Any]) -> None:
    # V placement: the last stage is on rank 0; rank 1 gets None and no broadcast runs.
    case = "tuple owners=[0, 1, 1, 0] chunks=3 batch=7 output_to=last"
    first, second = ({c["case"]: c for c in result["cases"]}[case] for result in two_ranks)
    assert second["output"] is None
    assert isinstance(first["output"], tuple) and [t.dtype for t in first["output"]] == [torch.float64, torch.bool]
    assert first["output"][0].shape == (7, 3)


DTYPES = (
    "['torch.float32', 'torch.float64', 'torch.float16', 'torch.bfloat16', 'torch.int64', 'torch.int32',"
    " 'torch.int16', 'torch.int8', 'torch.uint8', 'torch.bool']"
)


@pytest.mark.parametrize(
    ("error", "message"),
    [
        (
            "dict",
            "TypeError: pipeline stage 1 returned dict; the stages of strategy='pipeline' pass a tensor or a tuple of"
            " tensors to the next",
        ),
        (
            "tuple with int",
            "TypeError: pipeline stage 1 returned a tuple whose item 1 is of type int; the stages of"
            " strategy='pipeline' pass a tensor or a tuple of tensors to the next",
        ),
        (
            "complex",
            "TypeError: pipeline stage 1 returned a torch.complex128 tensor of 2 dims; the stages of"
            f" strategy='pipeline' exchange tensors of up to 8 dims of dtypes {DTYPES}",
        ),
    ],
)
def test_a_stage_returning_what_cannot_travel_is_named_on_its_rank(
    two_ranks: list[Any], error: str, message: str
) -> None:
    first, second = (result["errors"][error] for result in two_ranks)
    assert first is None  # stage 0's rank sent its output and returned
    assert second == message  # the whole message


def test_invalid_arguments_are_refused_on_every_rank_before_any_message(two_ranks: list[Any]) -> None:
    for result in two_ranks:
        assert result["errors"]["chunks"] == "ValueError: `chunks` must be an int >= 1, got 0"
        assert result["errors"]["output_to"] == "ValueError: `output_to` must be one of ('all', 'last'), got 'first'"
