"""The GPipe core on CPU threads: schedule, micro-batches, exactness, checkpointing, dropout, DeferredBatchNorm."""

from __future__ import annotations

import copy
import threading
from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from torch import Tensor, nn

from lightning_balanced.gpipe import Pipe, clock_cycles
from lightning_balanced.gpipe.streams import CopyStreams, copy_to_device
from lightning_balanced.pipeline import DeferredBatchNorm, plan_micro_batches, split_costs
from tests.helpers import CUDA_DEVICE_LISTS, RunIf, whole_message

CPU2 = [torch.device("cpu")] * 2
CPU3 = [torch.device("cpu")] * 3
MODES = ["always", "except_last", "never"]


def mlp(dropout: float = 0.0, dtype: torch.dtype = torch.float64) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(5, 16),
        nn.Tanh(),
        nn.Dropout(dropout),
        nn.Linear(16, 16),
        nn.GELU(),
        nn.Linear(16, 3),
    ).to(dtype)


# ---- schedule and micro-batches --------------------------------------------------------------------------------------
def test_clock_cycles_run_micro_batch_i_on_partition_j_at_cycle_i_plus_j() -> None:
    cycles = list(clock_cycles(3, 2))
    assert cycles == [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(2, 1)]]
    for m, n in [(1, 1), (4, 3), (7, 2), (2, 5)]:
        cycles = list(clock_cycles(m, n))
        assert len(cycles) == m + n - 1
        assert sorted(p for c in cycles for p in c) == [(i, j) for i in range(m) for j in range(n)]
        for k, cycle in enumerate(cycles):
            assert all(i + j == k for i, j in cycle)
            assert len({j for _, j in cycle}) == len(cycle)  # one task per partition per cycle
    with pytest.raises(ValueError, match="num_micro_batches"):
        list(clock_cycles(0, 2))


@given(st.integers(1, 200), st.integers(1, 50), st.booleans())
def test_micro_batch_plan_is_even_ordered_and_loses_no_sample(batch_size: int, chunks: int, bn: bool) -> None:
    sizes = plan_micro_batches(batch_size, chunks, batchnorm_training=bn)
    assert sum(sizes) == batch_size and all(s >= 1 for s in sizes)
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)
    assert len(sizes) <= chunks
    if bn and chunks < batch_size:
        assert min(sizes) >= 2  # never a micro-batch BatchNorm cannot normalize, unless asked for
    if not bn:
        assert len(sizes) == min(chunks, batch_size)


def test_micro_batch_of_one_only_when_asked_for_with_training_batchnorm() -> None:
    assert plan_micro_batches(9, 8) == [2] + [1] * 7
    assert plan_micro_batches(9, 8, batchnorm_training=True) == [3, 2, 2, 2]
    assert plan_micro_batches(5, 5, batchnorm_training=True) == [1] * 5  # chunks >= batch size: asked for
    with pytest.raises(ValueError, match="chunks"):
        plan_micro_batches(4, 0)


@given(st.lists(st.integers(0, 1000), min_size=1, max_size=9), st.integers(1, 9))
def test_split_costs_is_the_optimal_contiguous_split(costs: list[int], partitions: int) -> None:
    if partitions > len(costs):
        with pytest.raises(ValueError, match="partitions"):
            split_costs(costs, partitions)
        return
    balance = split_costs(costs, partitions)
    assert len(balance) == partitions and sum(balance) == len(costs) and min(balance) >= 1

    def largest(b: list[int]) -> int:
        bounds = [sum(b[:k]) for k in range(len(b) + 1)]
        return max(sum(costs[bounds[k] : bounds[k + 1]]) for k in range(len(b)))

    # brute force over all cuts
    import itertools

    best = min(
        largest([e - s for s, e in zip((0, *cuts), (*cuts, len(costs)), strict=True)])
        for cuts in itertools.combinations(range(1, len(costs)), partitions - 1)
    )
    assert largest(balance) == best


# ---- exactness ---------------------------------------------------------------------------------------------------
def sgd_steps(model: nn.Module, batches: list[tuple[Tensor, Tensor]]) -> list[dict[str, Tensor]]:
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    states = []
    for x, y in batches:
        optimizer.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
        states.append({k: v.detach().clone() for k, v in model.state_dict().items()})
    return states


@pytest.mark.parametrize("chunks", [1, 2, 4, 7])
@pytest.mark.parametrize("checkpoint", MODES)
def test_two_training_steps_equal_the_unpipelined_model_in_float64(chunks: int, checkpoint: str) -> None:
    torch.manual_seed(1)
    batches = [(torch.randn(9, 5, dtype=torch.float64), torch.randn(9, 3, dtype=torch.float64)) for _ in range(2)]
    reference = sgd_steps(mlp(), batches)
    pipe = Pipe(mlp(), [2, 1, 3], CPU3, chunks=chunks, checkpoint=checkpoint)
    pipelined = sgd_steps(pipe, batches)
    # float64 and the same operations per sample; only the order of the batch sums in the weight gradients differs.
    for step in range(2):
        assert reference[step].keys() == pipelined[step].keys()
        for key in reference[step]:
            torch.testing.assert_close(pipelined[step][key], reference[step][key], rtol=0, atol=1e-10)


def test_outputs_are_invariant_to_the_number_of_micro_batches() -> None:
    x = torch.randn(13, 5, dtype=torch.float64)
    outputs = [Pipe(mlp(), [3, 3], CPU2, chunks=chunks)(x) for chunks in (1, 2, 3, 5, 13, 20)]
    for output in outputs[1:]:
        torch.testing.assert_close(output, outputs[0], rtol=0, atol=1e-12)


def test_batch_structures_flow_through_the_pipeline() -> None:
    class TakeDict(nn.Module):
        def forward(self, batch: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
            return batch["x"] * batch["scale"], batch["x"]

    class Add(nn.Module):
        def forward(self, pair: tuple[Tensor, Tensor]) -> Tensor:
            return pair[0] + pair[1]

    x = torch.randn(7, 3, dtype=torch.float64)
    batch = {"x": x, "scale": torch.tensor(2.0, dtype=torch.float64)}
    out = Pipe(nn.Sequential(TakeDict(), Add(), nn.Identity()), [1, 2], CPU2, chunks=3)(batch)
    torch.testing.assert_close(out, 3 * x)


# ---- checkpointing -----------------------------------------------------------------------------------------------
def count_calls(model: nn.Module) -> Counter[str]:
    counts: Counter[str] = Counter()
    for name, layer in model.named_children():
        layer.register_forward_hook(lambda *_, name=name: counts.update([name]))
    return counts


@pytest.mark.parametrize(("checkpoint", "recomputed"), [("always", 4), ("except_last", 3), ("never", 0)])
def test_recomputation_matches_the_checkpoint_mode(checkpoint: str, recomputed: int) -> None:
    model = mlp()
    counts = count_calls(model)
    pipe = Pipe(model, [3, 3], CPU2, chunks=4, checkpoint=checkpoint)
    out = pipe(torch.randn(8, 5, dtype=torch.float64))
    assert set(counts.values()) == {4}  # forward: once per micro-batch
    out.sum().backward()
    assert set(counts.values()) == {4 + recomputed}
    counts.clear()
    pipe.eval()
    pipe(torch.randn(8, 5, dtype=torch.float64)).sum().backward()  # eval mode: no checkpointing
    assert set(counts.values()) == {4}
    counts.clear()
    pipe.train()
    with torch.no_grad():
        pipe(torch.randn(8, 5, dtype=torch.float64))
    assert set(counts.values()) == {4}


def test_dropout_recompute_reproduces_the_forward_mask_and_gradients() -> None:
    x = torch.randn(12, 5, dtype=torch.float64)
    grads = {}
    for checkpoint in ["always", "never", "except_last"]:
        model = mlp(dropout=0.5)
        masks: list[tuple[Tensor, Tensor]] = []  # (input, kept) per call of the dropout layer
        model[2].register_forward_hook(
            lambda _, args, out, masks=masks: masks.append((args[0].detach().clone(), out != 0))
        )
        pipe = Pipe(model, [2, 2, 2], CPU3, chunks=4, checkpoint=checkpoint)
        torch.manual_seed(123)
        pipe(x).pow(2).sum().backward()
        grads[checkpoint] = [p.grad.clone() for p in model.parameters()]
        forward, recomputed = masks[:4], masks[4:]
        assert len(recomputed) == {"always": 4, "never": 0, "except_last": 3}[checkpoint]
        for inputs, kept in recomputed:
            match = [k for i, k in forward if torch.equal(i, inputs)]
            assert len(match) == 1 and torch.equal(match[0], kept)
        dropped = torch.cat([k for _, k in forward])
        assert 0.3 < dropped.double().mean() < 0.7  # dropout really dropped
    for checkpoint in ["always", "except_last"]:
        for a, b in zip(grads[checkpoint], grads["never"], strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


class _CpuDrawnDropPath(nn.Module):
    """Drop-path that draws its mask on the CPU generator whatever the input's device, as many models do."""

    draws_random_numbers = True

    def forward(self, x: Tensor) -> Tensor:
        keep = (torch.rand(x.shape[0], 1, dtype=x.dtype) > 0.5).to(x.device)
        return x * keep * 2.0


def test_recompute_replays_cpu_random_numbers_on_a_partition_with_its_own_generator(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The partitions stand in for CUDA ones: their device generator is not the CPU one, so only a replay of the CPU
    # generator too (as torchgpipe restores both) gives the recomputation the forward's mask.
    import lightning_balanced.gpipe.rng as rng

    device_generator = torch.Generator()
    monkeypatch.setattr(rng, "_generator", lambda device: ("cuda:0", device_generator))
    x = torch.randn(12, 5, dtype=torch.float64)
    grads = {}
    for checkpoint in ["always", "never"]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(5, 8), _CpuDrawnDropPath(), nn.Tanh(), nn.Linear(8, 3)).double()
        pipe = Pipe(model, [2, 2], CPU3[:2], chunks=3, checkpoint=checkpoint)
        torch.manual_seed(7)
        pipe(x).pow(2).sum().backward()
        grads[checkpoint] = [p.grad.clone() for p in model.parameters()]
    for a, b in zip(grads["always"], grads["never"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("devices", CUDA_DEVICE_LISTS)
def test_recompute_replays_cpu_and_cuda_random_numbers_on_cuda(devices: list[torch.device]) -> None:
    x = torch.randn(12, 5, dtype=torch.float64, device=devices[0])
    grads = {}
    for checkpoint in ["always", "never"]:
        torch.manual_seed(0)
        layers = [nn.Linear(5, 8), _CpuDrawnDropPath(), nn.Dropout(0.5), nn.Tanh(), nn.Linear(8, 3)]
        model = nn.Sequential(*layers).double()
        pipe = Pipe(model, [2, 3], devices, chunks=3, checkpoint=checkpoint)
        pipe.place()
        torch.manual_seed(7)
        pipe(x).pow(2).sum().backward()
        grads[checkpoint] = [p.grad.cpu() for p in model.parameters()]
    for a, b in zip(grads["always"], grads["never"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


def test_same_seed_same_masks_whatever_the_thread_timing() -> None:
    x = torch.randn(16, 5, dtype=torch.float64)
    runs = []
    for _ in range(3):
        torch.manual_seed(7)
        runs.append(Pipe(mlp(dropout=0.5), [3, 3], CPU2, chunks=8)(x))
    torch.testing.assert_close(runs[1], runs[0], rtol=0, atol=0)
    torch.testing.assert_close(runs[2], runs[0], rtol=0, atol=0)


@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("balance", [[1, 3], [2, 2]])
def test_in_place_first_layer_of_a_partition(checkpoint: str, balance: list[int]) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.ReLU(inplace=True), nn.Linear(4, 6), nn.ReLU(inplace=True), nn.Linear(6, 2)).double()
    reference = copy.deepcopy(model)
    x = torch.randn(6, 4, dtype=torch.float64)
    original = x.clone()
    out = Pipe(model, balance, CPU2, chunks=3, checkpoint=checkpoint)(x)
    out.pow(2).sum().backward()
    expected = reference(original.clone())
    expected.pow(2).sum().backward()
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad, rtol=0, atol=1e-12)
    assert torch.equal(x, original)  # the pipeline gave the in-place layer a copy


def test_inference_mode_output() -> None:
    x = torch.randn(9, 5, dtype=torch.float64)
    model = mlp()
    expected = copy.deepcopy(model)(x)
    with torch.inference_mode():
        out = Pipe(model, [3, 3], CPU2, chunks=4)(x)
    assert out.is_inference()
    torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)


def test_autocast_is_reentered_on_each_partition_thread() -> None:
    model = mlp(dtype=torch.float32)
    pipe = Pipe(model, [2, 2, 2], CPU3, chunks=3, checkpoint="always")
    dtypes: list[torch.dtype] = []
    model[5].register_forward_hook(lambda _, args, out: dtypes.append(out.dtype))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = pipe(torch.randn(6, 5))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()  # recomputation in backward re-enters autocast too
    assert dtypes == [torch.bfloat16] * 6
    assert all(p.grad is not None and p.grad.dtype == torch.float32 for p in model.parameters())


def test_partitions_run_on_their_own_threads_concurrently() -> None:
    barrier = threading.Barrier(2, timeout=10)
    seen: dict[int, str] = {}

    class Meet(nn.Module):
        def __init__(self, index: int) -> None:
            super().__init__()
            self.index = index

        def forward(self, x: Tensor) -> Tensor:
            seen[self.index] = threading.current_thread().name
            if (self.index, int(x[0, 0])) in {(0, 2), (1, 0)}:
                barrier.wait()  # micro-batch 1 on partition 0 and micro-batch 0 on partition 1 share cycle 1
            return x

    x = torch.tensor([[0.0] * 3, [0.0] * 3, [2.0] * 3, [2.0] * 3])  # micro-batches of 0s and of 2s
    Pipe(nn.Sequential(Meet(0), Meet(1)), [1, 1], CPU2, chunks=2)(x)
    assert seen[0] != seen[1] and all(name.startswith("gpipe-partition") for name in seen.values())


# ---- DeferredBatchNorm ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("checkpoint", MODES)
@pytest.mark.parametrize("momentum", [0.1, None])
def test_deferred_batchnorm_running_statistics_equal_full_batch_batchnorm(
    checkpoint: str, momentum: float | None
) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4, momentum=momentum), nn.ReLU(), nn.Linear(4, 2)).double()
    reference = copy.deepcopy(model)
    DeferredBatchNorm.convert_deferred_batch_norm(model)
    assert isinstance(model[1], DeferredBatchNorm)
    pipe = Pipe(model, [2, 2], CPU2, chunks=4, checkpoint=checkpoint)
    for _ in range(2):
        x = torch.randn(11, 3, dtype=torch.float64) * 5 + 100  # |mean|/std = 20: the merge must be centered
        pipe(x).sum().backward()
        reference(x)
    bn, full = model[1], reference[1]
    assert int(bn.num_batches_tracked) == int(full.num_batches_tracked) == 2
    torch.testing.assert_close(bn.running_mean, full.running_mean, rtol=0, atol=1e-10)
    torch.testing.assert_close(bn.running_var, full.running_var, rtol=1e-12, atol=1e-10)
    assert list(model.state_dict()) == list(reference.state_dict())  # the keys of plain BatchNorm
    reverted = DeferredBatchNorm.revert_deferred_batch_norm(model)
    assert type(reverted[1]) is nn.BatchNorm1d and reverted[1].running_mean is bn.running_mean


def test_plain_batchnorm_is_not_updated_again_by_the_recomputation() -> None:
    stats = {}
    for checkpoint in ["always", "never"]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4), nn.Linear(4, 2)).double()
        Pipe(model, [2, 1], CPU2, chunks=3, checkpoint=checkpoint)(
            torch.randn(9, 3, dtype=torch.float64)
        ).sum().backward()
        stats[checkpoint] = (model[1].running_mean.clone(), int(model[1].num_batches_tracked))
    assert stats["always"][1] == stats["never"][1] == 3  # once per micro-batch, not again in backward
    torch.testing.assert_close(stats["always"][0], stats["never"][0], rtol=0, atol=0)


# ---- errors ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"balance": [2, 2]}, ValueError, r"`balance` \[2, 2\] covers 4 layers, but the nn.Sequential has 6"),
        ({"balance": [2, 2, 2], "devices": CPU2}, ValueError, "3 partitions but there are only 2 devices"),
        ({"balance": [3, 0, 3]}, ValueError, "`balance` must hold"),
        ({"balance": "3,3"}, TypeError, "`balance` must be a list of ints"),
        ({"balance": [3.0, 3]}, TypeError, "`balance` must be a list of ints"),
        ({"chunks": 0}, ValueError, whole_message("`chunks` must be >= 1, got 0")),
        ({"chunks": 2.5}, TypeError, whole_message("`chunks` must be an integer, got 2.5 of type float")),
        ({"checkpoint": "sometimes"}, ValueError, "`checkpoint` must be one of"),
    ],
)
def test_pipe_argument_errors(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    settings: dict[str, Any] = {"balance": [3, 3], "devices": CPU3, "chunks": 2, "checkpoint": "never"}
    settings.update(kwargs)
    with pytest.raises(error, match=match):
        Pipe(mlp(), settings.pop("balance"), **settings)


def test_parameter_shared_between_partitions_is_an_error() -> None:
    shared = nn.Linear(4, 4)
    model = nn.Sequential(shared, nn.ReLU(), shared)
    with pytest.raises(ValueError, match=r"`module\[0\]` and `module\[2\]` share a parameter .* change `balance`"):
        Pipe(model, [2, 1], CPU2)
    Pipe(nn.Sequential(shared, shared, nn.ReLU()), [2, 1], CPU2)  # same partition: fine


def test_layer_returning_a_non_tensor_is_an_error_naming_the_layers() -> None:
    class ReturnsShape(nn.Module):
        def forward(self, x: Tensor) -> Any:
            return x.shape[1]

    class ReturnsPair(nn.Module):
        def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
            return x, x

    with pytest.raises(TypeError, match=r"`net\[1\]` \(ReturnsShape\) returned int, which holds no tensor"):
        Pipe(nn.Sequential(nn.Linear(3, 3), ReturnsShape(), nn.Linear(3, 3)), [2, 1], CPU2, module_name="net")(
            torch.randn(4, 3)
        )
    with pytest.raises(TypeError, match=r"`net\[2\]` \(Linear\) cannot take the tuple that `net\[1\]` returned"):
        Pipe(nn.Sequential(nn.Linear(3, 3), ReturnsPair(), nn.Linear(3, 3)), [1, 2], CPU2, module_name="net")(
            torch.randn(4, 3)
        )


def test_error_in_a_partition_names_it_and_the_pipe_stays_usable() -> None:
    model = nn.Sequential(nn.Linear(3, 4), nn.Linear(5, 2))
    pipe = Pipe(model, [1, 1], CPU2, chunks=2)
    with pytest.raises(RuntimeError, match="shapes cannot be multiplied") as info:
        pipe(torch.randn(4, 3))
    assert any("gpipe partition 1" in note for note in getattr(info.value, "__notes__", ["gpipe partition 1"]))
    model[1] = nn.Linear(4, 2)
    pipe2 = Pipe(model, [1, 1], CPU2, chunks=2)
    assert pipe2(torch.randn(4, 3)).shape == (4, 2)


# ---- CUDA ------------------------------------------------------------------------------------------------------------
# Also a GPU and the host: copies in both directions, through the GPU's copy stream and after the producing stream.
GPU_AND_HOST = pytest.param(
    [torch.device("cuda", 0), torch.device("cpu")], id="gpu-and-host", marks=RunIf(min_cuda_gpus=1)
)


@pytest.mark.parametrize("devices", [*CUDA_DEVICE_LISTS, GPU_AND_HOST])
@pytest.mark.parametrize("checkpoint", MODES)
def test_cuda_two_devices_equal_the_unpipelined_model(checkpoint: str, devices: list[torch.device]) -> None:
    torch.manual_seed(1)
    batches = [(torch.randn(9, 5, dtype=torch.float64), torch.randn(9, 3, dtype=torch.float64)) for _ in range(2)]
    reference = sgd_steps(mlp().cuda(0), [(x.cuda(0), y.cuda(0)) for x, y in batches])
    pipe = Pipe(mlp(), [3, 3], devices, chunks=4, checkpoint=checkpoint)
    pipe.place()
    assert pipe[0].weight.device == devices[0] and pipe[5].weight.device == devices[1]
    pipelined = sgd_steps(pipe, [(x.cuda(0), y.cuda(0)) for x, y in batches])
    for key in reference[1]:
        torch.testing.assert_close(pipelined[1][key].cuda(0), reference[1][key], rtol=0, atol=1e-10)


@pytest.mark.parametrize("devices", CUDA_DEVICE_LISTS)
def test_cuda_dropout_recompute_and_deferred_batchnorm(devices: list[torch.device]) -> None:
    grads = {}
    for checkpoint in ["always", "never"]:
        torch.manual_seed(5)  # before the model: both runs start from the same weights, input and dropout masks
        model = nn.Sequential(nn.Linear(5, 8), nn.BatchNorm1d(8), nn.Dropout(0.5), nn.Linear(8, 2)).double()
        DeferredBatchNorm.convert_deferred_batch_norm(model)
        pipe = Pipe(model, [2, 2], devices, chunks=3, checkpoint=checkpoint)
        pipe.place()
        pipe(torch.randn(9, 5, dtype=torch.float64, device="cuda:0")).sum().backward()
        grads[checkpoint] = [p.grad.cpu() for p in model.parameters()]
    for a, b in zip(grads["always"], grads["never"], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


# Copies must wait for the stream that made the tensor, and the consumer for the copy: a producer (or a copy stream)
# that sleeps first shows a missing wait as wrong values. About 50 ms of sleep at ~1 GHz.
_SLEEP_CYCLES = 50_000_000


@RunIf(min_cuda_gpus=1)
@pytest.mark.parametrize("target", ["cuda:0", "cpu"], ids=["same-gpu-other-stream", "gpu-to-host"])
def test_copy_from_a_gpu_waits_for_the_producing_stream(target: str) -> None:
    gpu = torch.device("cuda", 0)
    producer = torch.cuda.Stream(gpu)
    with torch.cuda.stream(producer):
        x = torch.zeros(1 << 20, device=gpu)
        torch.cuda._sleep(_SLEEP_CYCLES)
        x.fill_(1.0)
    moved = copy_to_device(x, torch.device(target), CopyStreams(), source=producer)
    assert moved.device == torch.device(target)
    assert bool((moved == 1).all())  # on the current stream, which must have waited for `producer`


@RunIf(min_cuda_gpus=1)
def test_copy_from_the_host_is_waited_for_by_the_consumer_stream() -> None:
    gpu = torch.device("cuda", 0)
    streams = CopyStreams()
    copy_stream = streams.get(gpu)
    assert copy_stream is not None and copy_stream != torch.cuda.current_stream(gpu)
    with torch.cuda.stream(copy_stream):
        torch.cuda._sleep(_SLEEP_CYCLES)  # the copy queues behind this
    x = torch.arange(1 << 20, dtype=torch.float32, requires_grad=True)
    moved = copy_to_device(x, gpu, streams)
    assert torch.equal((moved * 1).cpu(), x.detach())  # `* 1` on the current stream, after the copy
    moved.sum().backward()
    assert torch.equal(x.grad, torch.ones_like(x))


@RunIf(min_cuda_gpus=2)
def test_copy_between_gpus_enters_both_copy_streams_and_waits_for_the_producer() -> None:
    source, target = torch.device("cuda", 1), torch.device("cuda", 0)
    producer = torch.cuda.Stream(source)
    with torch.cuda.stream(producer):
        x = torch.zeros(1 << 20, device=source)
        torch.cuda._sleep(_SLEEP_CYCLES)
        x.fill_(1.0)
    x.requires_grad_(True)
    moved = copy_to_device(x, target, CopyStreams(), source=producer)
    assert moved.device == target
    assert bool((moved == 1).all())
    moved.sum().backward()
    torch.cuda.synchronize()
    assert x.grad is not None and bool((x.grad == 1).all())
