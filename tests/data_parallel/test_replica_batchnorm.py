"""Synchronized BatchNorm across the replicas of one process equals full-batch BatchNorm on the whole batch.

The replicas are made by the package's own ``replicate`` (CPU emulation) and run in threads by its ``parallel_apply``,
as balanced_dp runs a step; the outputs are concatenated and one backward runs from ``sum(y * grad)``.

Tolerance: float64, ``rtol = atol = 1e-10``. Both sides compute the same statistics in another order (per-chunk
shifted sums + Chan's combination vs. torch's two-pass CPU kernel), so they differ by a few float64 ulps (~1e-15); a
wrong weight, a per-chunk statistic, a missing gradient path through the exchange or a running-statistics update
applied twice is off by 1e-3 or more.
"""

from __future__ import annotations

import copy
import dataclasses
import time
from typing import Any

import pytest
import torch
from torch import nn

from lightning_balanced.data_parallel import parallel_apply, replicate
from lightning_balanced.data_parallel import replica_batchnorm as sync_batchnorm_module
from lightning_balanced.data_parallel.barrier import ReplicaAborted, ReplicaBarrier
from lightning_balanced.data_parallel.replica_batchnorm import (
    ReplicaSyncBatchNorm,
    SyncBatchNormLayers,
    attach_step,
    convert_replica_batchnorm,
    revert_replica_batchnorm,
)
from tests.helpers import CUDA_DEVICE_LISTS

_CPU = torch.device("cpu")
_TOL = {"rtol": 1e-10, "atol": 1e-10}
_STEPS = 2
_LAYERS: dict[str, tuple[type[nn.Module], type[nn.Module], tuple[int, ...]]] = {
    # name: (channel mixer, BatchNorm class, sample shape after the channel dimension)
    "1d_flat": (nn.Linear, nn.BatchNorm1d, ()),
    "1d": (nn.Conv1d, nn.BatchNorm1d, (5,)),
    "2d": (nn.Conv2d, nn.BatchNorm2d, (4, 3)),
    "3d": (nn.Conv3d, nn.BatchNorm3d, (2, 3, 2)),
}


@dataclasses.dataclass(frozen=True)
class Case:
    layers: str
    chunk_sizes: tuple[int, ...]
    momentum: float | None = 0.1
    affine: bool = True
    track_running_stats: bool = True

    @property
    def id(self) -> str:
        parts = [self.layers, "x".join(map(str, self.chunk_sizes))]
        if self.momentum != 0.1:
            parts.append(f"momentum={self.momentum}")
        if not self.affine:
            parts.append("no_affine")
        if not self.track_running_stats:
            parts.append("no_running_stats")
        return "-".join(parts)


def _model(case: Case) -> nn.Module:
    """Mixer -> BN -> tanh -> mixer -> BN: the second BN sees data that depends on the first one's statistics."""
    torch.manual_seed(0)
    mixer, bn, _ = _LAYERS[case.layers]
    kwargs: dict[str, Any] = {"momentum": case.momentum, "affine": case.affine}
    kwargs["track_running_stats"] = case.track_running_stats

    def mix(c_in: int, c_out: int) -> nn.Module:
        return mixer(c_in, c_out) if mixer is nn.Linear else mixer(c_in, c_out, 1)

    model = nn.Sequential(mix(3, 4), bn(4, **kwargs), nn.Tanh(), mix(4, 4), bn(4, **kwargs)).double()
    if case.affine:
        with torch.no_grad():  # not the default 1/0, so a wrong affine path shows
            for layer in (model[1], model[4]):
                layer.weight.uniform_(0.5, 1.5)
                layer.bias.uniform_(-1, 1)
    return model


def _data(case: Case, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    shape = (sum(case.chunk_sizes), 3, *_LAYERS[case.layers][2])
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 2 + 3
    grad = torch.randn(shape[0], 4, *shape[2:], generator=g, dtype=torch.float64)
    return x, grad


def _close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    torch.testing.assert_close(actual, expected, **_TOL, msg=lambda m: f"{what}: {m}")


def _record(model: nn.Module, y: torch.Tensor, x: torch.Tensor) -> dict[str, Any]:
    return {
        "y": y.detach().clone(),
        "x_grad": x.grad,
        "param_grads": {name: p.grad.clone() for name, p in model.named_parameters()},
        "state": {k: v.clone() for k, v in model.state_dict().items()},
    }


def _reference_steps(model: nn.Module, case: Case) -> list[dict[str, Any]]:
    steps = []
    for step in range(_STEPS):
        x, grad = _data(case, step)
        x.requires_grad_(True)
        y = model(x)
        (y * grad).sum().backward()
        steps.append(_record(model, y, x))
        model.zero_grad(set_to_none=True)
    return steps


def _replica_forward(
    model: nn.Module,
    x: torch.Tensor,
    chunk_sizes: tuple[int, ...],
    devices: list[torch.device] | None = None,
    layers: SyncBatchNormLayers | None = None,
) -> torch.Tensor:
    """One data-parallel forward: replicate, attach a barrier, run replicas in threads, concatenate on x's device."""
    devices = devices or [_CPU] * len(chunk_sizes)
    replicas = replicate(model, devices, detach=not torch.is_grad_enabled())
    barrier = ReplicaBarrier(len(chunk_sizes), timeout=30)
    if layers is None:
        attach_step(replicas, barrier)
    else:
        layers.attach(replicas, barrier)
    chunks = [(c.to(d),) for c, d in zip(x.split(list(chunk_sizes)), devices, strict=True)]
    outputs = parallel_apply(replicas, chunks, [{}] * len(replicas), devices)
    return torch.cat([out.to(x.device) for out in outputs])


def _replica_steps(model: nn.Module, case: Case) -> list[dict[str, Any]]:
    steps = []
    for step in range(_STEPS):
        x, grad = _data(case, step)
        x.requires_grad_(True)
        y = _replica_forward(model, x, case.chunk_sizes)
        (y * grad).sum().backward()
        steps.append(_record(model, y, x))
        model.zero_grad(set_to_none=True)
    return steps


_CASES = [
    *(Case(layers, (3, 1, 0, 4)) for layers in _LAYERS),
    *(Case(layers, (1, 1), momentum=None) for layers in _LAYERS),
    Case("2d", (2, 5, 1), affine=False),
    Case("3d", (0, 6), momentum=None, affine=False),
    Case("1d", (4, 0, 1, 2), momentum=None),
    Case("2d", (3, 2), track_running_stats=False),
    Case("1d_flat", (5,)),
]


@pytest.mark.parametrize("case", _CASES, ids=lambda c: c.id)
def test_replicas_on_uneven_chunks_match_full_batch_batchnorm(case: Case) -> None:
    user_model = _model(case)
    user_layers = [user_model[1], user_model[4]]
    reference_model = copy.deepcopy(user_model)
    reference = _reference_steps(reference_model, case)

    model = convert_replica_batchnorm(user_model)
    assert all(type(model[i]) is ReplicaSyncBatchNorm for i in (1, 4))
    got = _replica_steps(model, case)

    for step, (ours, ref) in enumerate(zip(got, reference, strict=True)):
        _close(ours["y"], ref["y"], f"step {step} output")
        _close(ours["x_grad"], ref["x_grad"], f"step {step} input grad")
        assert ours["param_grads"].keys() == ref["param_grads"].keys()
        for name, value in ref["param_grads"].items():
            _close(ours["param_grads"][name], value, f"step {step} {name} grad")
        assert ours["state"].keys() == ref["state"].keys()
        for key, value in ref["state"].items():
            if key.endswith("num_batches_tracked"):
                assert torch.equal(ours["state"][key], value), (step, key)
            else:
                _close(ours["state"][key], value, f"step {step} {key}")

    # Evaluation: running statistics (or, without them, batch statistics over all replicas), no gradient.
    x_eval, _ = _data(case, _STEPS)
    model.eval()
    reference_model.eval()
    with torch.no_grad():
        torch.testing.assert_close(_replica_forward(model, x_eval, case.chunk_sizes), reference_model(x_eval), **_TOL)

    # Teardown: the user's own BatchNorm objects come back with the trained state, plain keys and classes.
    restored = revert_replica_batchnorm(model)
    assert restored is user_model
    assert restored[1] is user_layers[0] and restored[4] is user_layers[1]
    assert type(restored[1]) is _LAYERS[case.layers][1]
    assert restored.state_dict().keys() == reference_model.state_dict().keys()
    for key, value in reference_model.state_dict().items():
        _close(restored.state_dict()[key], value, f"restored {key}")
    assert not restored[1].training


@pytest.mark.parametrize("devices", CUDA_DEVICE_LISTS)
def test_replicas_on_two_gpus_match_full_batch_batchnorm(devices: list[torch.device]) -> None:
    # The statistics cross devices (or streams of one GPU) inside autograd; backward runs in the engine's threads.
    case = Case("2d", (3, 1), momentum=None)
    reference_model = _model(case)
    model = convert_replica_batchnorm(copy.deepcopy(reference_model)).to(devices[0])
    reference_model.to(devices[0])
    for step in range(_STEPS):
        x, grad = (t.to(devices[0]) for t in _data(case, step))
        x_ref = x.clone().requires_grad_(True)
        y_ref = reference_model(x_ref)
        (y_ref * grad).sum().backward()
        x.requires_grad_(True)
        y = _replica_forward(model, x, case.chunk_sizes, devices)
        (y * grad).sum().backward()
        _close(y, y_ref, f"step {step} output")
        _close(x.grad, x_ref.grad, f"step {step} input grad")
        for (name, p), p_ref in zip(model.named_parameters(), reference_model.parameters(), strict=True):
            _close(p.grad, p_ref.grad, f"step {step} {name} grad")
        for (key, value), ref in zip(model.state_dict().items(), reference_model.state_dict().values(), strict=True):
            _close(value.double(), ref.double(), f"step {step} {key}")
        model.zero_grad(set_to_none=True)
        reference_model.zero_grad(set_to_none=True)


def test_float32_at_large_mean_over_std_stays_within_10x_of_torch_batchnorm() -> None:
    g = torch.Generator().manual_seed(5)
    x64 = torch.randn(8, 4, 6, 6, generator=g, dtype=torch.float64) + 1e4
    x = x64.float()
    reference = nn.BatchNorm2d(4, dtype=torch.float64)(x.double())
    torch_error = (nn.BatchNorm2d(4)(x).double() - reference).abs().max().item()
    model = convert_replica_batchnorm(nn.BatchNorm2d(4))
    ours = _replica_forward(model, x, (3, 5))
    ours_error = (ours.double() - reference).abs().max().item()
    assert ours_error <= 10 * torch_error, (ours_error, torch_error)
    assert model.running_var is not None
    torch.testing.assert_close(model.running_var.double(), 0.9 + 0.1 * x.double().var(dim=(0, 2, 3)), rtol=1e-5, atol=0)


def test_one_value_per_channel_over_all_replicas_raises_in_every_replica() -> None:
    model = convert_replica_batchnorm(nn.Sequential(nn.BatchNorm1d(3)))
    replicas = replicate(model, [_CPU, _CPU])
    attach_step(replicas, ReplicaBarrier(2, timeout=30))
    # Replica 1 (0 samples) is the one parallel_apply runs on the calling thread: both get the error, not a hang.
    expected = r"Expected more than 1 value per channel when training, got 1 over all replicas \(samples per replica"
    expected += r" \[1, 0\]\)"
    with pytest.raises(ValueError, match=expected):
        parallel_apply(replicas, [(torch.randn(1, 3),), (torch.randn(0, 3),)], [{}, {}], [_CPU, _CPU])
    # One value per replica, two over all: fine.
    x = torch.randn(2, 3)
    out = parallel_apply(replicas, [(x[:1],), (x[1:],)], [{}, {}], [_CPU, _CPU])
    torch.testing.assert_close(torch.cat(out), nn.BatchNorm1d(3)(x))


class _StepRunner(nn.Module):
    """Runs ``body`` as a strategy's replica would: on failure it aborts the step's barrier before re-raising."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(3, 3), nn.BatchNorm1d(3))

    def forward(self, x: torch.Tensor, barrier: ReplicaBarrier, index: int, mode: str) -> torch.Tensor:
        try:
            if mode == "fail":
                raise RuntimeError("replica failed before BatchNorm")
            if mode == "skip_batchnorm":
                return self.body[0](x)
            return self.body(x)
        except BaseException as err:
            barrier.abort(index, err)
            raise


def _run_runner(modes: list[str], timeout: float) -> tuple[BaseException | None, float]:
    model = convert_replica_batchnorm(_StepRunner())
    devices = [_CPU] * len(modes)
    replicas = replicate(model, devices)
    barrier = ReplicaBarrier(len(modes), timeout=timeout)
    attach_step(replicas, barrier)
    inputs = [(torch.randn(4, 3), barrier, i, mode) for i, mode in enumerate(modes)]
    start = time.monotonic()
    try:
        parallel_apply(replicas, inputs, [{}] * len(modes), devices)
    except BaseException as err:
        return err, time.monotonic() - start
    return None, time.monotonic() - start


def test_a_failing_replica_releases_the_waiting_ones_at_once() -> None:
    error, elapsed = _run_runner(["ok", "fail", "ok"], timeout=60)
    # parallel_apply re-raises the first replica's error as torch's CUDA one does (a copy holding the traceback text,
    # causes included): the released replica 0, caused by replica 1's failure.
    assert isinstance(error, ReplicaAborted), error
    assert "Replica 0 stopped at synchronized BatchNorm layer 'body.1' because replica 1 failed" in str(error)
    assert "RuntimeError: replica failed before BatchNorm" in str(error)
    assert elapsed < 10


def test_a_replica_that_skips_a_layer_times_out_with_the_layer_name() -> None:
    error, elapsed = _run_runner(["ok", "skip_batchnorm"], timeout=0.5)
    assert isinstance(error, RuntimeError), error
    assert "waited 0.5s (the timeout) at synchronized BatchNorm layer 'body.1' (call 1) for replicas [1]" in str(error)
    assert "a BatchNorm inside a data-dependent branch cannot be synchronized" in str(error)
    assert 0.5 <= elapsed < 10


def test_a_layer_called_twice_per_step_meets_twice() -> None:
    # Weight sharing: the same BatchNorm twice in one forward; each call is its own meeting.
    bn = nn.BatchNorm1d(2, dtype=torch.float64)
    reference = copy.deepcopy(bn)
    model = convert_replica_batchnorm(nn.Sequential(bn))
    x = torch.randn(6, 2, dtype=torch.float64) * 3 + 1

    class Twice(nn.Module):
        def __init__(self, inner: nn.Module) -> None:
            super().__init__()
            self.inner = inner

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.inner(self.inner(x) * 2 + 1)

    got = _replica_forward(Twice(model), x, (2, 4))
    torch.testing.assert_close(got, reference(reference(x) * 2 + 1), **_TOL)
    assert model[0].num_batches_tracked.item() == 2
    torch.testing.assert_close(model[0].running_var, reference.running_var, **_TOL)


def test_without_a_step_the_layer_is_plain_batchnorm() -> None:
    bn = nn.BatchNorm2d(3, momentum=None)
    reference = copy.deepcopy(bn)
    layer = convert_replica_batchnorm(bn)
    x = torch.randn(4, 3, 2, 2)
    assert torch.equal(layer(x), reference(x))
    assert torch.equal(layer.running_var, reference.running_var)


def test_convert_keeps_parameters_and_refuses_lazy_layers() -> None:
    bn = nn.BatchNorm1d(3)
    layer = convert_replica_batchnorm(bn)
    assert isinstance(layer, ReplicaSyncBatchNorm)
    assert layer.weight is bn.weight and layer.running_mean is bn.running_mean
    assert convert_replica_batchnorm(layer) is layer
    assert layer.state_dict().keys() == bn.state_dict().keys()
    with pytest.raises(ValueError, match="uninitialized lazy"):
        convert_replica_batchnorm(nn.Sequential(nn.LazyBatchNorm1d()))
    # .to() replaces buffers: the user's layer gets the new ones back.
    layer.double()
    assert revert_replica_batchnorm(layer) is bn
    assert bn.running_mean.dtype == torch.float64 and bn.weight.dtype == torch.float64


def test_attach_checks_its_arguments() -> None:
    model = convert_replica_batchnorm(nn.Sequential(nn.BatchNorm1d(3)))
    with pytest.raises(ValueError, match="not a replica"):
        attach_step([model], ReplicaBarrier(1, timeout=30))
    with pytest.raises(ValueError, match="got 1 replicas for a barrier of 2 parties"):
        attach_step(replicate(model, [_CPU]), ReplicaBarrier(2, timeout=30))


def test_layers_found_once_reach_every_replica_through_changes_of_the_tree(monkeypatch: pytest.MonkeyPatch) -> None:
    # Counted: searches of the replicas' trees (attach_step) and walks of the model's tree (finding the layers).
    searches: list[int] = []
    finds: list[int] = []
    search, find = sync_batchnorm_module.attach_step, SyncBatchNormLayers._find

    def counted_search(replicas: Any, barrier: ReplicaBarrier) -> None:
        searches.append(len(replicas))
        search(replicas, barrier)

    def counted_find(self: SyncBatchNormLayers) -> None:
        finds.append(1)
        find(self)

    monkeypatch.setattr(sync_batchnorm_module, "attach_step", counted_search)
    monkeypatch.setattr(SyncBatchNormLayers, "_find", counted_find)
    case = Case("1d", (3, 1, 4))
    reference = _model(case)
    model = convert_replica_batchnorm(copy.deepcopy(reference))
    layers = SyncBatchNormLayers(model)

    def step_matches_full_batch(step: int) -> None:
        x, _ = _data(case, step)
        _close(_replica_forward(model, x, case.chunk_sizes, layers=layers), reference(x), f"step {step} output")
        assert model.state_dict().keys() == reference.state_dict().keys()
        for key, value in reference.state_dict().items():
            _close(model.state_dict()[key].double(), value.double(), f"step {step} {key}")

    step_matches_full_batch(0)
    step_matches_full_batch(1)
    # The tree did not change: only the recorded paths were followed (replication makes no layer that counts).
    assert (searches, len(finds)) == ([], 1)
    # A synchronized layer moved (wrapped in a container, as a hook between steps might): its path leads elsewhere.
    model[4] = nn.Sequential(model[4])
    reference[4] = nn.Sequential(reference[4])
    step_matches_full_batch(2)
    assert (searches, len(finds)) == ([3], 2)  # the replicas searched once, the new paths recorded ...
    step_matches_full_batch(3)
    assert (searches, len(finds)) == ([3], 2)  # ... and followed from then on
    # A synchronized layer added after the layers were found (a copy, as for a teacher or EMA block): every recorded
    # path still leads to its layer, yet the copy is found and synchronized too.
    model.append(copy.deepcopy(model[1]))
    reference.append(copy.deepcopy(reference[1]))
    step_matches_full_batch(4)
    assert (searches, len(finds)) == ([3], 3)


def test_layers_found_once_check_their_arguments_as_attach_step() -> None:
    model = convert_replica_batchnorm(nn.Sequential(nn.BatchNorm1d(3)))
    layers = SyncBatchNormLayers(model)
    with pytest.raises(ValueError, match="not a replica"):
        layers.attach([model], ReplicaBarrier(1, timeout=30))
    with pytest.raises(ValueError, match="got 1 replicas for a barrier of 2 parties"):
        layers.attach(replicate(model, [_CPU]), ReplicaBarrier(2, timeout=30))


# The first set_sync_debug_mode() call of a process warns (TORCH_WARN_ONCE) that the mode is a prototype; under
# `filterwarnings = error` that warning is raised from the call itself, after the mode was set.
@pytest.mark.filterwarnings("ignore:Synchronization debug mode is a prototype feature:UserWarning")
@pytest.mark.parametrize("devices", CUDA_DEVICE_LISTS)
@pytest.mark.parametrize("momentum", [0.1, None], ids=["momentum", "cumulative"])
def test_the_statistics_exchange_on_cuda_never_makes_the_host_wait(
    devices: list[torch.device], momentum: float | None
) -> None:
    # torch's sync debug mode raises on any operation that synchronizes the host with the GPU (a blocking copy from
    # pageable memory, .item(), ...): the exchange orders the replicas' streams with events instead. With
    # momentum=None the running statistics' factor 1 / num_batches_tracked stays on the GPU.
    case = Case("2d", (3, 5), momentum=momentum)
    model = convert_replica_batchnorm(_model(case)).to(devices[0])
    x, _ = (t.to(devices[0]) for t in _data(case, 0))
    _replica_forward(model, x, case.chunk_sizes, devices)  # warm-up: kernels loaded, library handles made
    torch.cuda.synchronize()
    # The mode is global to the process: set inside the try, so that the mode before the test comes back whatever
    # happens (left at "error", it fails every later test of this pytest worker at its first blocking copy).
    previous = torch.cuda.get_sync_debug_mode()
    try:
        torch.cuda.set_sync_debug_mode("error")
        y = _replica_forward(model, x, case.chunk_sizes, devices)
    finally:
        torch.cuda.set_sync_debug_mode(previous)
    # And it is the exchange of the whole batch's statistics: the output of one BatchNorm over the whole batch (the
    # running statistics do not enter a training forward pass). float32 on the GPU: a merge order apart.
    torch.testing.assert_close(y, _model(case).to(devices[0])(x), rtol=1e-5, atol=1e-5)
