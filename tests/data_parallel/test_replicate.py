"""Module replicas and running them concurrently, on CPU devices: the data-parallel step against the single module."""

from __future__ import annotations

import copy
import re
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.nn import functional as F

from lightning_balanced.data_parallel import gather, parallel_apply, replicate, scatter, virtual_devices
from lightning_balanced.data_parallel.replicate import ReplicaParameters
from lightning_balanced.data_parallel.virtual_device import on_device
from lightning_balanced.split_policies import plan_chunk_sizes
from tests.helpers import CUDA_DEVICE_LISTS

CPU = torch.device("cpu")

# float64 throughout: a row of the output depends only on its own input row, but the per-chunk and whole-batch matmuls
# may be blocked differently by BLAS, and the parameter gradients sum the per-sample terms per chunk and then across
# chunks instead of in one pass. Those reorderings change float64 results by ~1e-16 relative on values of order 1, so
# 1e-12 leaves a wide margin for rounding while a real mistake (a lost chunk, a chunk weighted wrongly, a gradient
# that does not reach the original parameters) is off by far more.
EXACT = {"rtol": 1e-12, "atol": 1e-12}


class LossModel(nn.Module):
    """Returns what a training step would: the mean loss of its chunk and the per-sample predictions."""

    def __init__(self, net: nn.Module) -> None:
        super().__init__()
        self.net = net

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        preds = self.net(x)
        return {"loss": F.mse_loss(preds, y), "preds": preds}


class TiedWeights(nn.Module):
    """Two layers sharing one weight matrix: one parameter reached through two submodules."""

    def __init__(self) -> None:
        super().__init__()
        self.encode = nn.Linear(4, 4)
        self.decode = nn.Linear(4, 4)
        self.decode.weight = self.encode.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.decode(torch.tanh(self.encode(x)))


def _mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 8), nn.Tanh(), nn.Linear(8, 3)).double()


def _batch(batch_size: int, in_features: int = 5, out_features: int = 3, seed: int = 1) -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(batch_size, in_features, generator=generator, dtype=torch.float64)
    y = torch.randn(batch_size, out_features, generator=generator, dtype=torch.float64)
    return x, y


def _devices(n: int) -> list[torch.device]:
    """Virtual CPU devices cpu:0 ... cpu:n-1, each with its own identity, as the strategy uses them."""
    return virtual_devices([CPU] * n)


def _data_parallel(module: nn.Module, batch: Any, sizes: list[int], *, detach: bool = False) -> Any:
    """The step the strategy composes: scatter → replicate → parallel_apply → gather."""
    devices = _devices(len(sizes))
    chunks = scatter(batch, sizes, devices)
    replicas = replicate(module, devices, detach=detach)
    outputs = parallel_apply(replicas, chunks, [{}] * len(sizes), devices)
    return gather(outputs, CPU, sizes)


def _grads(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: param.grad for name, param in module.named_parameters()}


@st.composite
def compositions(draw: st.DrawFn) -> list[int]:
    return draw(st.lists(st.integers(1, 6), min_size=1, max_size=5))


# --- the step equals the single-module step ---------------------------------------------------------------------------


@settings(max_examples=20, deadline=None)
@given(compositions())
def test_mlp_step_over_chunks_matches_the_whole_batch(sizes: list[int]) -> None:
    model = LossModel(_mlp())
    reference = copy.deepcopy(model)
    x, y = _batch(sum(sizes))

    result = _data_parallel(model, (x, y), sizes)
    result["loss"].backward()
    expected = reference(x, y)
    expected["loss"].backward()

    torch.testing.assert_close(result["preds"], expected["preds"], **EXACT)
    torch.testing.assert_close(result["loss"], expected["loss"], **EXACT)
    grads, expected_grads = _grads(model), _grads(reference)
    assert set(grads) == set(expected_grads)
    for name, grad in grads.items():
        assert grad is not None, name
        torch.testing.assert_close(grad, expected_grads[name], **EXACT, msg=name)


def test_linear_step_over_uneven_chunks_matches_the_whole_batch() -> None:
    torch.manual_seed(0)
    model = LossModel(nn.Linear(5, 3).double())
    reference = copy.deepcopy(model)
    x, y = _batch(10)

    result = _data_parallel(model, (x, y), plan_chunk_sizes(10, 4, gpu0_bsz=2))
    result["loss"].backward()
    reference(x, y)["loss"].backward()

    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, _grads(reference)[name], **EXACT, msg=name)


def test_tied_weights_collect_the_gradient_of_both_uses() -> None:
    torch.manual_seed(0)
    model = TiedWeights().double()
    reference = copy.deepcopy(model)
    x, _ = _batch(7, in_features=4)

    output = _data_parallel(model, (x,), [3, 2, 2])
    output.pow(2).mean().backward()
    expected = reference(x)
    expected.pow(2).mean().backward()

    torch.testing.assert_close(output, expected, **EXACT)
    assert model.encode.weight is model.decode.weight
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, _grads(reference)[name], **EXACT, msg=name)


@pytest.mark.parametrize(("batch_size", "num_devices", "options"), [(3, 5, {}), (2, 4, {"gpu0_bsz": 1}), (1, 3, {})])
def test_small_batch_runs_on_as_many_replicas_as_non_empty_chunks(
    batch_size: int, num_devices: int, options: dict[str, int]
) -> None:
    # The strategy leaves the devices planned 0 samples out; the rest must be exactly one replica per chunk.
    planned = plan_chunk_sizes(batch_size, num_devices, **options)
    sizes = [size for size in planned if size > 0]
    assert len(sizes) == batch_size
    model = LossModel(_mlp())
    reference = copy.deepcopy(model)
    x, y = _batch(batch_size)

    result = _data_parallel(model, (x, y), sizes)
    result["loss"].backward()
    expected = reference(x, y)
    expected["loss"].backward()

    torch.testing.assert_close(result["preds"], expected["preds"], **EXACT)
    for name, grad in _grads(model).items():
        torch.testing.assert_close(grad, _grads(reference)[name], **EXACT, msg=name)


# --- BatchNorm --------------------------------------------------------------------------------------------------------


def _bn_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2)).double().train()


def test_batchnorm_running_stats_persist_from_replica_0_only() -> None:
    model = _bn_net()
    alone = [copy.deepcopy(model) for _ in range(3)]
    x, _ = _batch(8, in_features=4)
    sizes = [3, 2, 3]
    chunks = torch.split(x, sizes)
    devices = _devices(3)

    replicas = replicate(model, devices)
    outputs = parallel_apply(replicas, [(c,) for c in scatter(x, sizes, devices)], [{}] * 3, devices)
    expected_outputs = [m(c) for m, c in zip(alone, chunks, strict=True)]

    # Like torch's DataParallel, each replica normalizes its own chunk with its own batch statistics...
    for output, expected in zip(outputs, expected_outputs, strict=True):
        torch.testing.assert_close(output.cpu(), expected, **EXACT)
    # ...and the original module keeps the running statistics of chunk 0 only.
    bn, bn_alone = model[1], [m[1] for m in alone]
    torch.testing.assert_close(bn.running_mean, bn_alone[0].running_mean, **EXACT)
    torch.testing.assert_close(bn.running_var, bn_alone[0].running_var, **EXACT)
    assert bn.num_batches_tracked.item() == 1
    for other in bn_alone[1:]:
        assert not torch.allclose(bn.running_mean, other.running_mean)
    # The other replicas did update their statistics, on copies that are dropped with them.
    for replica, other in zip(replicas[1:], bn_alone[1:], strict=True):
        torch.testing.assert_close(replica[1].running_mean.cpu(), other.running_mean, **EXACT)
        assert replica[1].running_mean.data_ptr() != bn.running_mean.data_ptr()
    assert replicas[0][1].running_mean.data_ptr() == bn.running_mean.data_ptr()


def test_batchnorm_in_eval_mode_matches_the_whole_batch() -> None:
    model = _bn_net()
    model(_batch(16, in_features=4, seed=5)[0])  # non-trivial running statistics
    model.eval()
    x, _ = _batch(8, in_features=4)
    with torch.no_grad():
        output = _data_parallel(model, (x,), [3, 2, 3], detach=True)
        torch.testing.assert_close(output, model(x), **EXACT)


# --- what a replica is ------------------------------------------------------------------------------------------------


def test_replicas_have_no_parameters_of_their_own() -> None:
    # As in torch.nn.DataParallel: the parameters are views of the original's, plain attributes of the replica, so an
    # optimizer or a grad-clipping pass can only ever see the original module's leaves.
    model = _bn_net()
    replicas = replicate(model, _devices(3))
    assert len(replicas) == 3
    for replica in replicas:
        assert replica is not model
        assert list(replica.parameters()) == []
        assert all(r is not m for r, m in zip(replica.modules(), model.modules(), strict=True))
        assert len(list(replica.buffers())) == len(list(model.buffers()))
        assert torch.equal(replica[0].weight, model[0].weight)
        assert replica[0].weight.requires_grad


def test_detached_replicas_build_no_graph() -> None:
    model = LossModel(_mlp())
    x, y = _batch(6)
    with torch.enable_grad():
        result = _data_parallel(model, (x, y), [2, 2, 2], detach=True)
    assert not result["loss"].requires_grad and result["loss"].grad_fn is None
    assert not result["preds"].requires_grad and result["preds"].grad_fn is None
    for replica in replicate(model, _devices(2), detach=True):
        assert not replica.net[0].weight.requires_grad
    assert all(param.grad is None for param in model.parameters())


def test_replicating_onto_no_device_gives_no_replica() -> None:
    assert replicate(_mlp(), []) == []


# --- parallel_apply ---------------------------------------------------------------------------------------------------


class Recorder(nn.Module):
    """Records, per call, the thread and the grad/inference modes it ran under."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(2, 2)
        self.calls: list[tuple[int, bool, bool]] = []
        self.lock = threading.Lock()

    def forward(self, x: torch.Tensor, fail: bool = False, delay: float = 0.0) -> torch.Tensor:
        time.sleep(delay)
        with self.lock:
            self.calls.append((threading.get_ident(), torch.is_grad_enabled(), torch.is_inference_mode_enabled()))
        if fail:
            raise KeyError("replica failure")
        return self.linear(x)


@pytest.mark.parametrize("mode", ["grad", "no_grad", "inference"])
def test_grad_and_inference_mode_are_carried_into_the_worker_threads(mode: str) -> None:
    model = Recorder()
    devices = _devices(3)
    replicas = replicate(model, devices, detach=mode != "grad")
    inputs = [(on_device(torch.randn(2, 2), device),) for device in devices]
    context = {"grad": torch.enable_grad, "no_grad": torch.no_grad, "inference": torch.inference_mode}[mode]
    with context():
        expected = (torch.is_grad_enabled(), torch.is_inference_mode_enabled())
        outputs = parallel_apply(replicas, inputs, [{}] * 3, devices)

    calls = model.calls  # the replicas share the original's __dict__ entries, the list included
    assert len(calls) == 3
    assert len({thread for thread, _, _ in calls} - {threading.get_ident()}) >= 1, "no replica ran in a worker thread"
    assert all((grad, inference) == expected for _, grad, inference in calls)
    assert all(out.requires_grad == (mode == "grad") for out in outputs)
    assert all(out.is_inference() == (mode == "inference") for out in outputs)


@pytest.mark.parametrize("failing", [0, 1, 2])
def test_a_failing_replica_is_re_raised_after_all_finish_as_cuda_parallel_apply_does(failing: int) -> None:
    model = Recorder()
    devices = _devices(3)
    replicas = replicate(model, devices)
    inputs = [(on_device(torch.randn(2, 2), device),) for device in devices]
    # The healthy replicas are slow, so a failure raised before they finish would leave them out of `calls`.
    kwargs = [{"fail": i == failing, "delay": 0.0 if i == failing else 0.05} for i in range(3)]
    with pytest.raises(KeyError) as info:
        parallel_apply(replicas, inputs, kwargs, devices)
    assert len(model.calls) == 3
    # torch's ExceptionWrapper: a new exception of the same type, the original's traceback as text, no cause.
    message = str(info.value)
    assert message.startswith(f"Caught KeyError in replica {failing} on device cpu:{failing}.")
    assert "replica failure" in message and "Original Traceback" in message
    assert info.value.__cause__ is None


def test_an_exception_that_cannot_be_rebuilt_from_a_message_becomes_a_runtime_error() -> None:
    class TwoArguments(Exception):
        def __init__(self, a: int, b: int) -> None:
            super().__init__(a, b)

    class Failing(nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise TwoArguments(1, 2)

    devices = _devices(2)
    with pytest.raises(RuntimeError, match="Caught TwoArguments in replica 0"):
        parallel_apply(replicate(Failing(), devices), [(torch.ones(1),)] * 2, [{}] * 2, devices)


def test_the_lowest_failing_replica_wins() -> None:
    model = Recorder()
    devices = _devices(3)
    replicas = replicate(model, devices)
    kwargs = [{}, {"fail": True}, {"fail": True}]
    with pytest.raises(KeyError, match="replica 1 on device cpu:1"):
        parallel_apply(replicas, [(torch.randn(2, 2),) for _ in devices], kwargs, devices)


# --- device identity in the emulation ---------------------------------------------------------------------------------


def test_replicate_refuses_a_module_that_is_not_on_the_first_device() -> None:
    # torch's broadcast_coalesced: "All tensors must be on devices[0]". The module lives on the root device, cpu:0.
    devices = _devices(3)
    with pytest.raises(RuntimeError, match=r"All tensors must be on devices\[0\].*cpu:0.*cpu:1"):
        replicate(_mlp(), devices[1:])
    replica_on_1 = replicate(_bn_net(), devices)[1]  # its BatchNorm buffers are on cpu:1
    with pytest.raises(RuntimeError, match=r"All tensors must be on devices\[0\]"):
        replicate(replica_on_1, devices)


def test_each_replica_computes_on_its_own_device_and_mixing_devices_fails() -> None:
    model = _mlp()
    devices = _devices(3)
    replicas = replicate(model, devices)
    chunks = scatter(_batch(6)[0], [2, 2, 2], devices)
    outputs = parallel_apply(replicas, [(c,) for c in chunks], [{}] * 3, devices)
    for replica, output, device in zip(replicas, outputs, devices, strict=True):
        assert replica[0].weight.device == device and output.device == device
    with pytest.raises(RuntimeError, match=r"Expected all tensors to be on the same device.*cpu:0 and cpu:1"):
        torch.cat(outputs)
    with pytest.raises(RuntimeError, match="same device"):
        replicas[1](chunks[0])  # replica 1 on replica 0's chunk
    moved = torch.cat([o.to(devices[0]) for o in outputs])
    assert moved.device == devices[0]
    torch.testing.assert_close(moved.to("cpu"), model(_batch(6)[0]), **EXACT)


def test_compiled_modules_are_refused_before_anything_is_touched() -> None:
    model = nn.Sequential(nn.Linear(2, 2), nn.Tanh())
    compiled_child = nn.Sequential(torch.compile(nn.Linear(2, 2), backend="eager"))
    in_place = nn.Sequential(nn.Linear(2, 2))
    in_place[0].compile(backend="eager")  # the backend does not matter: nothing is run
    for network, name in ((compiled_child, "`0` (torch.compile)"), (in_place, "`0` (Module.compile())")):
        before = [(n, type(m), dict(m._parameters)) for n, m in network.named_modules()]
        with pytest.raises(TypeError, match=re.escape(name) + ".*Remove the `torch.compile`"):
            replicate(network, _devices(2))
        assert [(n, type(m), dict(m._parameters)) for n, m in network.named_modules()] == before
    assert len(replicate(model, _devices(2))) == 2


def test_outputs_come_back_in_replica_order_with_a_reused_executor() -> None:
    model = _mlp()
    devices = _devices(4)
    inputs = [(torch.full((i + 1, 5), float(i), dtype=torch.float64),) for i in range(4)]
    on_devices = [(on_device(x, device),) for (x,), device in zip(inputs, devices, strict=True)]
    with ThreadPoolExecutor(max_workers=3) as executor:
        for _ in range(2):
            outputs = parallel_apply(
                replicate(model, devices, detach=True), on_devices, [{}] * 4, devices, executor=executor
            )
            for output, (x,) in zip(outputs, inputs, strict=True):
                torch.testing.assert_close(output.cpu(), model(x), **EXACT)


def test_parallel_apply_rejects_sequences_of_different_lengths() -> None:
    replicas = replicate(_mlp(), _devices(2))
    with pytest.raises(ValueError, match="must match"):
        parallel_apply(replicas, [(torch.randn(1, 5, dtype=torch.float64),)], [{}, {}], _devices(2))


def test_no_replicas_give_no_outputs() -> None:
    # As torch.nn.parallel.parallel_apply([], [], [], []); replicate(module, []) already returns [].
    assert parallel_apply([], [], [], []) == []


_MULTI_OUTPUT_VIEW = re.compile(
    r"^Output \d+ of \w+ is a view and its base or another view of its base has been modified inplace\. This view is"
    r" the output of a function that returns multiple views\. Such functions do not allow the output views to be"
    r" modified inplace\. You should replace the inplace operation by an out-of-place one\.$"
)


@pytest.mark.parametrize(
    "devices",
    [pytest.param(_devices(3), id="emulation"), *CUDA_DEVICE_LISTS],
)
def test_a_parameter_changed_in_place_reaches_every_replica_once_refreshed(devices: list[torch.device]) -> None:
    # optimizer.step() inside a step (manual optimization). Replica 0 holds Broadcast's multi-output view of the
    # parameter, which autograd refuses after the change (the emulation as torch's Broadcast on CUDA); the other
    # replicas hold stale copies. After refresh() every replica computes with the new values and passes its gradient
    # to the parameter, also when requires_grad was off during the refresh (toggle_optimizer).
    torch.manual_seed(0)
    net = nn.Linear(3, 2).double().to(devices[0])
    replicas = replicate(net, devices)
    held = ReplicaParameters.of(net, replicas)
    xs = [on_device(torch.randn(2, 3, dtype=torch.float64), device) for device in devices]
    with torch.no_grad():
        net.weight.add_(1.0)
    with pytest.raises(RuntimeError, match=_MULTI_OUTPUT_VIEW):
        replicas[0](xs[0])

    net.weight.requires_grad_(False)
    held.refresh()
    net.weight.requires_grad_(True)
    outputs = [replica(x) for replica, x in zip(replicas, xs, strict=True)]
    sum(out.to(devices[0]).sum() for out in outputs).backward()

    reference = copy.deepcopy(net).cpu()
    reference.zero_grad()
    for out, x in zip(outputs, xs, strict=True):
        expected = reference(x.cpu())
        torch.testing.assert_close(out.cpu(), expected.detach(), **EXACT)
        expected.sum().backward()
    torch.testing.assert_close(net.weight.grad.cpu(), reference.weight.grad, **EXACT)
    torch.testing.assert_close(net.bias.grad.cpu(), reference.bias.grad, **EXACT)
