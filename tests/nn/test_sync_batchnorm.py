"""SyncBatchNorm on real gloo process groups equals single-process BatchNorm on the concatenated batch.

Spawning ranks is the expensive part (each rank imports torch and Lightning, ~10 s on 2 cores), so every multi-rank
check runs in ONE spawn of 3 ranks (module-scoped fixture, one test per case): the 3-rank cases on the world group,
the 2-rank cases on the group of ranks 0 and 1, a group of ranks 0 and 2, a single-rank group, and a missing peer that
must end in the group's (short) timeout.

Tolerances (``torch.testing.assert_close``), with the worst observed ``|diff| / (atol + rtol * |expected|)`` (observed
with the earlier ``E[x^2] - E[x]^2`` version; the centered moments have no cancellation, so they only do better):

* float64 ``rtol=1e-9, atol=1e-11`` (worst 0.6%). Our variance comes from per-rank shifted sums combined by Chan's
  formula, torch's CPU kernel is two-pass, and summation orders differ; inputs have |mean| / std up to ~4, so a few
  float64 ulps (~1e-16) grown by the normalization stay ~1e-13. The margin still puts any formula error (a wrong
  count, biased vs unbiased variance, a missing gradient term) far outside.
* float32 ``rtol=1e-4, atol=1e-5`` (worst 22%, input gradients): our local sums accumulate in float32, torch's CPU
  kernel accumulates float32 in float64; the same reasoning at float32's ~6e-8 epsilon.
* float32 at ``|mean| / std`` 1e2 to 1e4 (issue 9): the max errors of output, input gradient and ``running_var``
  against float64 BatchNorm stay within 10x of torch's own float32 BatchNorm2d errors (measured: within 1.2x).
* bfloat16 ``rtol=atol=3e-2`` (worst 40%): both sides compute in float32 and round to bfloat16 (one ulp is 2**-8
  relative), so outputs may differ by an ulp or two, and rank-summed bfloat16 weight gradients by a few more.
"""

from __future__ import annotations

import dataclasses
import operator
import time
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn

from lightning_balanced import SyncBatchNorm
from tests.distributed import DistributedRankError, run_distributed

_BN_BY_DIM: dict[int, type[nn.modules.batchnorm._BatchNorm]] = {
    2: nn.BatchNorm1d,
    3: nn.BatchNorm1d,
    4: nn.BatchNorm2d,
    5: nn.BatchNorm3d,
}
_TOL = {
    torch.float64: {"rtol": 1e-9, "atol": 1e-11},
    torch.float32: {"rtol": 1e-4, "atol": 1e-5},
    torch.bfloat16: {"rtol": 3e-2, "atol": 3e-2},
}
_STEPS = 3  # enough for momentum=None (cumulative average over num_batches_tracked) to differ from momentum=1


@dataclasses.dataclass(frozen=True)
class Case:
    """One configuration: per-rank batch sizes and the BatchNorm arguments."""

    sample_shape: tuple[int, ...]  # (C, *spatial)
    sizes: tuple[int, ...]  # samples per rank
    dtype: torch.dtype = torch.float64
    momentum: float | None = 0.1
    affine: bool = True
    bias: bool = True
    track_running_stats: bool = True
    seed: int = 0

    @property
    def id(self) -> str:
        dims = len(self.sample_shape) + 1
        parts = [f"{dims}d", "x".join(map(str, self.sizes)), str(self.dtype).removeprefix("torch.")]
        if self.momentum != 0.1:
            parts.append(f"momentum={self.momentum}")
        if not self.affine:
            parts.append("no_affine")
        if not self.bias:
            parts.append("no_bias")
        if not self.track_running_stats:
            parts.append("no_running_stats")
        return "-".join(parts)

    def bn_kwargs(self) -> dict[str, Any]:
        return {
            "momentum": self.momentum,
            "affine": self.affine,
            "bias": self.bias,
            "track_running_stats": self.track_running_stats,
            "dtype": self.dtype,
        }


def _case_data(case: Case) -> dict[str, Any]:
    """Deterministic inputs, upstream gradients and affine parameters (the same in every process)."""
    g = torch.Generator().manual_seed(case.seed)
    n, channels = sum(case.sizes), case.sample_shape[0]
    view = (1, channels) + (1,) * (len(case.sample_shape) - 1)

    def sample(batch: int) -> torch.Tensor:
        # Per-channel offsets and scales, so channels differ and |mean| / std is not ~0.
        offset = (torch.randn(channels, generator=g, dtype=torch.float64) * 2).view(view)
        scale = (torch.rand(channels, generator=g, dtype=torch.float64) + 0.5).view(view)
        x = torch.randn(batch, *case.sample_shape, generator=g, dtype=torch.float64) * scale + offset
        return x.to(case.dtype)

    return {
        "xs": [sample(n) for _ in range(_STEPS)],
        # Random upstream gradients: with dL/dy = 1 the input gradient of BN is identically 0.
        "grads": [torch.randn(n, *case.sample_shape, generator=g, dtype=torch.float64).to(case.dtype)] * _STEPS,
        "weight": (torch.rand(channels, generator=g, dtype=torch.float64) + 0.5).to(case.dtype),
        "bias": torch.randn(channels, generator=g, dtype=torch.float64).to(case.dtype),
        "eval_x": sample(4),
    }


def _init_affine(module: nn.Module, data: dict[str, Any]) -> None:
    with torch.no_grad():
        if module.weight is not None:
            module.weight.copy_(data["weight"])
        if module.bias is not None:
            module.bias.copy_(data["bias"])


def _state(module: nn.modules.batchnorm._BatchNorm) -> dict[str, Any]:
    return {
        "running_mean": None if module.running_mean is None else module.running_mean.clone(),
        "running_var": None if module.running_var is None else module.running_var.clone(),
        "num_batches_tracked": None if module.num_batches_tracked is None else int(module.num_batches_tracked),
    }


def _train_steps(
    module: nn.modules.batchnorm._BatchNorm, xs: list[torch.Tensor], grads: list[torch.Tensor], eval_x: torch.Tensor
) -> dict[str, Any]:
    """Forward + backward of ``sum(y * grad)`` per step; record everything that must match, then one eval forward."""
    steps = []
    for x, grad in zip(xs, grads, strict=True):
        x = x.clone().requires_grad_(True)
        y = module(x)
        (y * grad).sum().backward()
        steps.append(
            {
                "y": y.detach(),
                "x_grad": x.grad,
                "weight_grad": None if module.weight is None else module.weight.grad,
                "bias_grad": None if module.bias is None else module.bias.grad,
                **_state(module),
            }
        )
        module.zero_grad(set_to_none=True)
    module.eval()
    with torch.no_grad():
        eval_y = module(eval_x)
    module.train()
    return {"steps": steps, "eval_y": eval_y}


def _rank_slice(sizes: tuple[int, ...], rank: int) -> slice:
    start = sum(sizes[:rank])
    return slice(start, start + sizes[rank])


def _sync_bn_on_rank(case: Case, rank: int, process_group: Any = None) -> dict[str, Any]:
    data = _case_data(case)
    module = SyncBatchNorm(case.sample_shape[0], process_group=process_group, **case.bn_kwargs())
    _init_affine(module, data)
    part = _rank_slice(case.sizes, rank)
    return _train_steps(module, [x[part] for x in data["xs"]], [g[part] for g in data["grads"]], data["eval_x"])


def _reference(case: Case) -> dict[str, Any]:
    data = _case_data(case)
    kwargs = case.bn_kwargs()
    bias = kwargs.pop("bias")  # older torch BatchNorm has no `bias` argument: remove the parameter, as bias=False does
    module = _BN_BY_DIM[len(case.sample_shape) + 1](case.sample_shape[0], **kwargs)
    if case.affine and not bias:
        module.register_parameter("bias", None)
    _init_affine(module, data)
    return _train_steps(module, data["xs"], data["grads"], data["eval_x"])


def _assert_close(actual: torch.Tensor | None, expected: torch.Tensor | None, case: Case, what: str) -> None:
    if expected is None:
        assert actual is None, what
        return
    assert actual is not None, what
    torch.testing.assert_close(actual, expected, **_TOL[case.dtype], msg=lambda m: f"{what}: {m}")


def _assert_matches_reference(case: Case, per_rank: list[dict[str, Any]]) -> None:
    """Each rank's results (rank ``i`` of the group, holding ``case.sizes[i]`` samples) against full-batch BN."""
    ranks = list(range(len(case.sizes)))
    ref = _reference(case)
    for step, ref_step in enumerate(ref["steps"]):
        for rank, result in zip(ranks, per_rank, strict=True):
            got, part = result["steps"][step], _rank_slice(case.sizes, rank)
            where = f"rank {rank} step {step}"
            _assert_close(got["y"], ref_step["y"][part], case, f"{where} output")
            _assert_close(got["x_grad"], ref_step["x_grad"][part], case, f"{where} input grad")
            for name in ("running_mean", "running_var"):
                _assert_close(got[name], ref_step[name], case, f"{where} {name}")
            assert got["num_batches_tracked"] == ref_step["num_batches_tracked"], where
        # Weight/bias gradients are per-rank contributions (DDP sums/averages them): their sum is the full-batch one.
        for name in ("weight_grad", "bias_grad"):
            grads = [result["steps"][step][name] for result in per_rank]
            total = None if ref_step[name] is None else torch.stack(grads).sum(0)
            _assert_close(total, ref_step[name], case, f"step {step} {name} summed over ranks")
    for rank, result in zip(ranks, per_rank, strict=True):
        _assert_close(result["eval_y"], ref["eval_y"], case, f"rank {rank} eval output")


# ---------------------------------------------------------------- the cases

_SHAPES = [(3,), (3, 4), (3, 4, 5), (2, 3, 4, 3)]  # BatchNorm1d (N, C), BatchNorm1d (N, C, L), 2d, 3d
_TWO_RANK_CASES = [
    *(
        Case(shape, sizes, dtype)
        for shape in _SHAPES
        for sizes in [(3, 5), (1, 4), (0, 5), (5, 0)]
        for dtype in (torch.float64, torch.float32)
    ),
    *(
        Case((3, 4, 5), sizes, dtype, **options)
        for options in [
            {"momentum": None},
            {"affine": False},
            {"bias": False},
            {"track_running_stats": False},
            {"momentum": None, "affine": False, "track_running_stats": False},
        ]
        for sizes in [(3, 5), (0, 5)]
        for dtype in (torch.float64, torch.float32)
    ),
    Case((3,), (1, 1)),  # one sample per rank: 2 values per channel over the group is enough
    *(Case((3, 4, 5), sizes, torch.bfloat16) for sizes in [(3, 5), (0, 5)]),  # float32 accumulation inside
]
# Over the group a single value per channel: every rank must raise the same ValueError (and none may hang).
_TOO_SMALL_CASES = [Case((3,), (1, 0)), Case((3,), (0, 1)), Case((3, 1), (0, 1))]


# ---------------------------------------------------------------- 3 ranks, and sub-groups

_THREE_RANK_CASES = [
    Case((3, 4, 5), (2, 0, 5)),
    Case((3,), (1, 1, 1), momentum=None),
    Case((2, 3, 4, 3), (4, 1, 2), torch.float32),
]
# Ranks 0 and 2 synchronize in a group of their own; rank 2 is also alone in one (world size 1: plain BatchNorm).
_PAIR_CASE = Case((3, 4, 5), (2, 6), seed=1)
_SOLO_CASE = Case((3, 4, 5), (3,), seed=2)
_SHORT_TIMEOUT_S = 2.0

# ---------------------------------------------------------------- float32 accuracy at large |mean| / std (issue 9)

# 2 ranks with 3 and 5 samples of ``ratio + randn``: float32 in, errors against float64 BatchNorm of the same values.
_ACCURACY_RATIOS = (1e2, 1e3, 1e4)
_ACCURACY_SIZES = (3, 5)
_ACCURACY_KEYS = ("y", "x_grad", "running_var")


def _accuracy_data(ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    n = sum(_ACCURACY_SIZES)
    x = torch.randn(n, 4, 6, 6, generator=g, dtype=torch.float64) + ratio
    grad = torch.randn(n, 4, 6, 6, generator=g, dtype=torch.float64)
    return x.float(), grad.float()


def _forward_backward(module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    y = module(x)
    (y * grad).sum().backward()
    assert x.grad is not None
    return {"y": y.detach(), "x_grad": x.grad, "running_var": module.running_var.detach().clone()}


def _float32_sync_bn_on_rank(ratio: float, rank: int, process_group: Any) -> dict[str, torch.Tensor]:
    x, grad = _accuracy_data(ratio)
    part = _rank_slice(_ACCURACY_SIZES, rank)
    return _forward_backward(SyncBatchNorm(4, process_group=process_group), x[part], grad[part])


def _distributed_worker(rank: int, world_size: int) -> dict[str, Any]:
    """Everything multi-rank, in one spawn: the 2-rank cases run on the group of ranks 0 and 1."""
    # Every rank creates every group, in the same order, right after the rendezvous (so the short timeout holds).
    pair01, pair02, solo2 = dist.new_group([0, 1]), dist.new_group([0, 2]), dist.new_group([2])
    short01 = dist.new_group([0, 1], timeout=timedelta(seconds=_SHORT_TIMEOUT_S))
    out: dict[str, Any] = {case.id: _sync_bn_on_rank(case, rank) for case in _THREE_RANK_CASES}

    if rank in (0, 1):
        out["two_rank"] = {case.id: _sync_bn_on_rank(case, rank, process_group=pair01) for case in _TWO_RANK_CASES}
        out["too_small_errors"] = {}
        for case in _TOO_SMALL_CASES:
            try:
                _sync_bn_on_rank(case, rank, process_group=pair01)
            except ValueError as err:
                out["too_small_errors"][case.id] = str(err)
        # Still in lock-step after the raises: one more collective completes.
        flag = torch.ones(1)
        dist.all_reduce(flag, group=pair01)
        out["flag"] = float(flag)
        out["accuracy"] = {ratio: _float32_sync_bn_on_rank(ratio, rank, pair01) for ratio in _ACCURACY_RATIOS}
    else:
        out["solo"] = _sync_bn_on_rank(_SOLO_CASE, 0, process_group=solo2)
    if rank in (0, 2):
        out["pair"] = _sync_bn_on_rank(_PAIR_CASE, rank // 2, process_group=pair02)
    dist.barrier()

    # Rank 1 skips a training forward that rank 0 runs: rank 0 must fail with the group's timeout, not hang.
    if rank == 0:
        start = time.monotonic()
        try:
            SyncBatchNorm(3, process_group=short01)(torch.randn(4, 3))
            out["missing_peer"] = "forward returned"
        except RuntimeError as err:  # gloo's DistBackendError
            out["missing_peer"] = str(err)
        out["missing_peer_wait_s"] = time.monotonic() - start
    elif rank == 1:
        time.sleep(_SHORT_TIMEOUT_S + 2)  # alive past rank 0's timeout
    return out


@pytest.fixture(scope="module")
def per_rank() -> list[dict[str, Any]]:
    return run_distributed(_distributed_worker, 3)


@pytest.mark.parametrize("case", _TWO_RANK_CASES, ids=lambda c: c.id)
@pytest.mark.slow
def test_two_ranks_uneven_batches_match_full_batch_batchnorm(case: Case, per_rank: list[dict]) -> None:
    _assert_matches_reference(case, [r["two_rank"][case.id] for r in per_rank[:2]])


@pytest.mark.slow  # its per_rank fixture spawns the ranks
def test_one_value_per_channel_over_group_raises_on_every_rank(per_rank: list[dict]) -> None:
    for rank_result in per_rank[:2]:
        assert set(rank_result["too_small_errors"]) == {case.id for case in _TOO_SMALL_CASES}
        for message in rank_result["too_small_errors"].values():
            assert "Expected more than 1 value per channel when training" in message
        assert rank_result["flag"] == 2.0


@pytest.mark.parametrize("case", _THREE_RANK_CASES, ids=lambda c: c.id)
def test_three_ranks_match_full_batch_batchnorm(case: Case, per_rank: list[dict]) -> None:
    _assert_matches_reference(case, [r[case.id] for r in per_rank])


@pytest.mark.parametrize("ratio", _ACCURACY_RATIOS)
def test_float32_error_at_large_mean_over_std_stays_within_10x_of_torch_batchnorm(
    ratio: float, per_rank: list[dict]
) -> None:
    # Issue 9: with E[x^2] - E[x]^2 from float32 sums the output error was 998 at ratio 1e4 (torch's: 1.2e-3).
    x, grad = _accuracy_data(ratio)
    reference = _forward_backward(nn.BatchNorm2d(4, dtype=torch.float64), x.double(), grad.double())
    torch_float32 = _forward_backward(nn.BatchNorm2d(4), x, grad)
    ours = {
        key: torch.cat([r["accuracy"][ratio][key] for r in per_rank[:2]])
        if key != "running_var"
        else per_rank[0]["accuracy"][ratio][key]
        for key in _ACCURACY_KEYS
    }
    for key in _ACCURACY_KEYS:
        ours_error = (ours[key].double() - reference[key]).abs().max().item()
        torch_error = (torch_float32[key].double() - reference[key]).abs().max().item()
        assert ours_error <= 10 * torch_error, f"{key}: ours {ours_error:.3g}, torch float32 {torch_error:.3g}"


def test_process_group_argument_scopes_the_synchronization(per_rank: list[dict]) -> None:
    _assert_matches_reference(_PAIR_CASE, [per_rank[0]["pair"], per_rank[2]["pair"]])
    _assert_matches_reference(_SOLO_CASE, [per_rank[2]["solo"]])


def test_rank_that_skips_the_collective_fails_by_process_group_timeout_not_hang(per_rank: list[dict]) -> None:
    message = per_rank[0]["missing_peer"]
    assert "timed out" in message.lower(), message
    assert _SHORT_TIMEOUT_S <= per_rank[0]["missing_peer_wait_s"] < _SHORT_TIMEOUT_S + 10


@pytest.mark.slow
def test_run_distributed_surfaces_a_rank_exception_with_its_traceback() -> None:
    # A builtin as ``fn`` keeps the spawned rank from importing this module (and Lightning): ~1 s instead of ~10 s.
    # operator.getitem(rank, world_size) raises TypeError in rank 0.
    with pytest.raises(DistributedRankError, match=r"1 of 1 ranks failed:\n--- rank 0 ---\nTraceback[\s\S]*TypeError"):
        run_distributed(operator.getitem, 1)


# ---------------------------------------------------------------- single process (no process group)


_SINGLE_PROCESS_CASES = [Case(shape, (6,), dtype) for shape in _SHAPES for dtype in (torch.float64, torch.float32)]


@pytest.mark.parametrize("case", _SINGLE_PROCESS_CASES, ids=lambda c: c.id)
def test_without_process_group_equals_plain_batchnorm_exactly(case: Case) -> None:
    assert not (dist.is_available() and dist.is_initialized())
    got, ref = _sync_bn_on_rank(case, 0), _reference(case)
    for got_step, ref_step in zip(got["steps"], ref["steps"], strict=True):
        for key, value in ref_step.items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(got_step[key], value), key
            else:
                assert got_step[key] == value, key
    assert torch.equal(got["eval_y"], ref["eval_y"])


@pytest.mark.parametrize(
    ("shape", "match"),
    [((4,), "2D to 5D"), ((2, 3, 2, 2, 2, 2), "2D to 5D"), ((4, 5, 2), "expects 3 channels")],
)
def test_bad_input_shape_raises_value_error(shape: tuple[int, ...], match: str) -> None:
    module = SyncBatchNorm(3)
    with pytest.raises(ValueError, match=match):
        module(torch.randn(shape))
    module.eval()
    with pytest.raises(ValueError, match=match):
        module(torch.randn(shape))


def test_constructor_mirrors_torch_sync_batchnorm() -> None:
    ours = SyncBatchNorm(5, eps=1e-3, momentum=None, affine=True, track_running_stats=True, dtype=torch.float64)
    theirs = nn.SyncBatchNorm(5, eps=1e-3, momentum=None, affine=True, track_running_stats=True, dtype=torch.float64)
    assert ours.state_dict().keys() == theirs.state_dict().keys()
    for key, value in theirs.state_dict().items():
        assert torch.equal(ours.state_dict()[key], value), key
    assert SyncBatchNorm(5, bias=False).bias is None
    assert SyncBatchNorm(5, affine=False).weight is None
    assert SyncBatchNorm(5, track_running_stats=False).running_mean is None


# ---------------------------------------------------------------- convert / revert


class TaggedBatchNorm2d(nn.BatchNorm2d):
    """A user subclass with its own constructor signature and an extra attribute."""

    def __init__(self, tag: str, channels: int) -> None:
        super().__init__(channels, momentum=0.3)
        self.tag = tag


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 4, 3),
        nn.BatchNorm2d(4),
        nn.ReLU(),
        nn.Sequential(TaggedBatchNorm2d("inner", 4), nn.Conv2d(4, 2, 1)),
        nn.BatchNorm2d(2, affine=False, track_running_stats=False),
        nn.Flatten(),
        nn.LazyLinear(6),
        nn.BatchNorm1d(6, momentum=None),
    )
    for _ in range(3):  # non-trivial running statistics, and initializes LazyLinear
        model(torch.randn(5, 3, 6, 6))
    model[1].weight.requires_grad_(False)
    model[3][0].eval()  # a child in another mode than its parent
    return model


def _batchnorms(model: nn.Module) -> dict[str, nn.Module]:
    return {name: m for name, m in model.named_modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)}


def test_convert_then_revert_restores_classes_and_state() -> None:
    original = _model()
    before = {name: (type(m), m.training) for name, m in _batchnorms(original).items()}
    params_before = {name: p for name, p in original.named_parameters()}
    state_before = {k: v.clone() for k, v in original.state_dict().items()}
    x = torch.randn(4, 3, 6, 6)
    original.eval()
    expected_eval = original(x)
    original.train()
    original[3][0].eval()

    converted = SyncBatchNorm.convert_sync_batchnorm(original)
    converted_bns = _batchnorms(converted)
    assert converted_bns.keys() == before.keys()
    for name, m in converted_bns.items():
        assert type(m) is SyncBatchNorm, name
        assert m._original_batchnorm_cls is before[name][0], name
        assert m.training == before[name][1], name
    # Parameters are shared (same objects, so requires_grad and optimizer references carry over); state is equal.
    assert {name: p for name, p in converted.named_parameters()} == params_before
    assert converted[1].weight.requires_grad is False
    assert converted.state_dict().keys() == state_before.keys()
    for key, value in converted.state_dict().items():
        assert torch.equal(value, state_before[key]), key
    converted.eval()
    assert torch.equal(converted(x), expected_eval)

    # Train the converted model (no process group: plain BatchNorm path), then revert and compare the state.
    converted.train()
    converted(torch.randn(5, 3, 6, 6))
    converted[4].momentum = 0.5  # a hyperparameter changed on the converted module is kept
    converted[3][0].eval()
    state_trained = {k: v.clone() for k, v in converted.state_dict().items()}
    reverted = SyncBatchNorm.revert_sync_batchnorm(converted)
    reverted_bns = _batchnorms(reverted)
    for name, m in reverted_bns.items():
        assert type(m) is before[name][0], name
        assert not hasattr(m, "_original_batchnorm_cls"), name
        assert m.training == before[name][1], name
    assert reverted[3][0].tag == "inner"
    assert reverted[4].momentum == 0.5
    assert {name: p for name, p in reverted.named_parameters()} == params_before
    for key, value in reverted.state_dict().items():
        assert torch.equal(value, state_trained[key]), key
    reverted.eval()
    converted_eval = SyncBatchNorm.convert_sync_batchnorm(reverted).eval()
    assert torch.equal(SyncBatchNorm.revert_sync_batchnorm(converted_eval)(x), converted_eval(x))


def test_convert_and_revert_a_single_layer() -> None:
    bn = nn.BatchNorm3d(4, dtype=torch.float64)
    sync = SyncBatchNorm.convert_sync_batchnorm(bn)
    assert type(sync) is SyncBatchNorm
    assert sync.weight is bn.weight and sync.running_var is bn.running_var
    assert sync.weight.dtype == torch.float64
    back = SyncBatchNorm.revert_sync_batchnorm(sync)
    assert type(back) is nn.BatchNorm3d and back.weight is bn.weight
    # Already-sync modules are left alone; directly-built ones have no original class to revert to.
    own = SyncBatchNorm(4)
    assert SyncBatchNorm.convert_sync_batchnorm(own) is own
    assert SyncBatchNorm.revert_sync_batchnorm(own) is own


def test_convert_refuses_an_uninitialized_lazy_batchnorm() -> None:
    with pytest.raises(ValueError, match="uninitialized lazy"):
        SyncBatchNorm.convert_sync_batchnorm(nn.Sequential(nn.LazyBatchNorm2d()))
