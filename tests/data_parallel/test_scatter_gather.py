"""Splitting a batch over devices (``scatter``) and combining the replicas' outputs (``gather``), on CPU."""

from __future__ import annotations

import dataclasses
import math
from collections import OrderedDict, namedtuple
from collections.abc import Mapping
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_balanced.data_parallel import gather, infer_batch_size, scatter
from lightning_balanced.data_parallel.gather import chunk_weights

PROPERTY = settings(max_examples=60, deadline=None)
CPU = torch.device("cpu")

Pair = namedtuple("Pair", ["inputs", "target"])


@dataclasses.dataclass
class Sample:
    image: torch.Tensor
    label: torch.Tensor
    source: str = "train"


@st.composite
def compositions(draw: st.DrawFn, max_batch: int = 40, max_parts: int = 6) -> list[int]:
    """Positive chunk sizes (a composition of the batch size), as ``scatter`` requires."""
    return draw(st.lists(st.integers(1, max_batch // max_parts + 1), min_size=1, max_size=max_parts))


def _cpus(n: int) -> list[torch.device]:
    return [CPU] * n


def _data(batch_size: int, *trailing: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    return torch.arange(batch_size * math.prod(trailing), dtype=dtype).reshape(batch_size, *trailing)


def _assert_is_slice_of(chunk: Any, batch: Any, start: int, stop: int) -> None:
    """``chunk`` has the structure and types of ``batch``; batched tensors are ``[start:stop]``, the rest as is."""
    assert type(chunk) is type(batch)
    if isinstance(batch, torch.Tensor):
        expected = batch if batch.dim() == 0 else batch[start:stop]
        assert chunk.shape == expected.shape
        assert torch.equal(chunk, expected)
    elif isinstance(batch, Mapping):
        assert list(chunk.keys()) == list(batch.keys())
        for key in batch:
            _assert_is_slice_of(chunk[key], batch[key], start, stop)
    elif isinstance(batch, (list, tuple)):
        assert len(chunk) == len(batch)
        for c, b in zip(chunk, batch, strict=True):
            _assert_is_slice_of(c, b, start, stop)
    elif dataclasses.is_dataclass(batch):
        for field in dataclasses.fields(batch):
            _assert_is_slice_of(getattr(chunk, field.name), getattr(batch, field.name), start, stop)
    else:
        assert chunk == batch


def _batches(batch_size: int) -> dict[str, Any]:
    x, y = _data(batch_size, 3), _data(batch_size, dtype=torch.int64)
    return {
        "tensor": x,
        "tuple": (x, y),
        "list": [x, y],
        "dict": {"x": x, "y": y},
        "ordered_dict": OrderedDict(y=y, x=x),
        "namedtuple": Pair(x, y),
        "dataclass": Sample(x, y, source="val"),
        "nested": {"pair": Pair([x, {"deep": y}], y), "samples": [Sample(x, y)], "scale": torch.tensor(0.5)},
        "batch_and_index": ((x, y), 7),
        "with_non_tensor_leaves": {"x": x, "name": "cifar", "epoch": 3, "lr": 0.1, "mask": None, "ids": ["a", "b"]},
        "with_scalar_tensor": (x, torch.tensor(2.0), torch.tensor(3, dtype=torch.int64)),
    }


# --- infer_batch_size -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(_batches(5)))
def test_batch_size_is_dim0_shared_by_every_batched_tensor(kind: str) -> None:
    assert infer_batch_size(_batches(5)[kind]) == 5


def test_batch_size_of_batch_and_batch_idx_ignores_the_index() -> None:
    # The classic BalancedDataParallel read the size from inputs[0]; with (batch, batch_idx) that is the tuple.
    assert infer_batch_size(((_data(6, 2), _data(6)), 3)) == 6
    assert infer_batch_size((({"x": _data(6, 2)},), {"batch_idx": 3})) == 6


@pytest.mark.parametrize(
    "batch",
    [
        {"x": _data(4, 2), "y": _data(5)},
        (_data(4), [_data(4), _data(3, 4)]),
        Pair(_data(2, 2), _data(3, 2)),
        Sample(_data(4, 1), _data(1)),
    ],
)
def test_tensors_disagreeing_on_dim0_raise(batch: Any) -> None:
    with pytest.raises(ValueError, match="dim 0"):
        infer_batch_size(batch)
    with pytest.raises(ValueError, match="dim 0"):
        scatter(batch, [1, 1], _cpus(2))


@pytest.mark.parametrize("batch", [torch.tensor(1.0), {"a": 1, "s": torch.tensor(2.0)}, ("text", 3), []])
def test_batch_without_a_batched_tensor_raises(batch: Any) -> None:
    with pytest.raises(ValueError, match="batch dimension"):
        infer_batch_size(batch)


# --- scatter ----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", list(_batches(9)))
def test_scatter_gives_each_device_its_contiguous_slice_with_the_batch_structure(kind: str) -> None:
    batch = _batches(9)[kind]
    sizes = [4, 2, 3]
    chunks = scatter(batch, sizes, _cpus(3))
    assert len(chunks) == 3
    start = 0
    for chunk, size in zip(chunks, sizes, strict=True):
        _assert_is_slice_of(chunk, batch, start, start + size)
        start += size


def test_non_tensor_leaves_and_scalar_tensors_are_replicated_to_every_device() -> None:
    scale = torch.tensor(0.5)
    batch = ((_data(6, 2), {"scale": scale, "name": "cifar", "mask": None}), 11)
    for chunk in scatter(batch, [3, 1, 2], _cpus(3)):
        (_, extras), batch_idx = chunk
        assert batch_idx == 11
        assert extras["name"] == "cifar"
        assert extras["mask"] is None
        assert extras["scale"].dim() == 0
        assert torch.equal(extras["scale"], scale)


@PROPERTY
@given(compositions(), st.integers(0, 3))
def test_concatenating_the_chunks_restores_the_batch_exactly(sizes: list[int], trailing_dims: int) -> None:
    x = torch.randn(sum(sizes), *([2] * trailing_dims), dtype=torch.float64)
    y = torch.randint(0, 10, (sum(sizes),))
    chunks = scatter({"x": x, "y": y}, sizes, _cpus(len(sizes)))
    assert [c["x"].shape[0] for c in chunks] == sizes
    assert torch.equal(torch.cat([c["x"] for c in chunks]), x)
    assert torch.equal(torch.cat([c["y"] for c in chunks]), y)


def test_the_same_tensor_twice_in_a_batch_is_split_the_same_way() -> None:
    x = _data(5, 2)
    for chunk in scatter((x, {"again": x}), [2, 3], _cpus(2)):
        assert torch.equal(chunk[0], chunk[1]["again"])


def test_cpu_chunks_are_views_of_the_batch() -> None:
    x = _data(6, 2)
    chunks = scatter(x, [4, 2], _cpus(2))
    assert all(c.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() for c in chunks)


@PROPERTY
@given(compositions())
def test_split_is_autograd_aware(sizes: list[int]) -> None:
    torch.manual_seed(len(sizes))
    x = torch.randn(sum(sizes), 3, dtype=torch.float64, requires_grad=True)
    scale = torch.tensor(1.5, dtype=torch.float64, requires_grad=True)
    per_sample = torch.randn(sum(sizes), 3, dtype=torch.float64)

    chunks = scatter((x, per_sample, scale), sizes, _cpus(len(sizes)))
    loss = sum((c_scale * c_x.sin() * c_w).sum() for c_x, c_w, c_scale in chunks)
    grad_x, grad_scale = torch.autograd.grad(loss, (x, scale))

    reference = (scale * x.sin() * per_sample).sum()
    ref_x, ref_scale = torch.autograd.grad(reference, (x, scale))
    # Elementwise: every sample's gradient is computed by the same operations either way.
    assert torch.equal(grad_x, ref_x)
    # The replicated scalar collects the gradient of every chunk; only the summation order differs.
    torch.testing.assert_close(grad_scale, ref_scale, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("sizes", "num_devices", "match"),
    [
        ([3, 3], 3, "devices"),
        ([4, -1, 3], 3, "non-negative"),
        ([], 0, "at least one device"),
        ([3, 2], 2, "sum"),
        ([3, 4], 2, "sum"),
    ],
)
def test_scatter_rejects_chunk_sizes_that_do_not_fit(sizes: list[int], num_devices: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        scatter(_data(6, 2), sizes, _cpus(num_devices))


def test_a_zero_chunk_gives_empty_tensors_and_an_empty_batch_goes_to_one_device() -> None:
    chunks = scatter((_data(6, 2), 5), [6, 0], _cpus(2))
    assert chunks[1][0].shape == (0, 2) and chunks[1][1] == 5
    (empty,) = scatter(_data(0, 2), [0], _cpus(1))
    assert empty.shape == (0, 2)


def test_chunks_on_virtual_devices_carry_their_device() -> None:
    from lightning_balanced.data_parallel import virtual_devices

    devices = virtual_devices(_cpus(3))
    assert devices == [torch.device("cpu", i) for i in range(3)]
    chunks = scatter((_data(6, 2), torch.tensor(2.0)), [1, 2, 3], devices)
    for device, (x, scale) in zip(devices, chunks, strict=True):
        assert x.device == device and scale.device == device
        assert (x * scale).device == device  # computed tensors stay on the replica's device


# --- gather -----------------------------------------------------------------------------------------------------------


@PROPERTY
@given(compositions())
def test_per_sample_tensors_are_concatenated_in_replica_order(sizes: list[int]) -> None:
    whole = torch.randn(sum(sizes), 2, dtype=torch.float64)
    outputs = list(torch.split(whole, sizes))
    gathered = gather(outputs, CPU, sizes)
    assert torch.equal(gathered, whole)


def test_floating_scalars_combine_as_the_chunk_weighted_mean_or_the_sum() -> None:
    losses = [torch.tensor(v, dtype=torch.float64) for v in (1.0, 4.0, -2.0)]
    gathered = gather(losses, CPU, [2, 1, 1])
    assert gathered.dim() == 0
    torch.testing.assert_close(gathered, torch.tensor(1.0, dtype=torch.float64), rtol=0, atol=1e-15)
    summed = gather(losses, CPU, [2, 1, 1], loss_reduction="sum")
    torch.testing.assert_close(summed, torch.tensor(3.0, dtype=torch.float64), rtol=0, atol=1e-15)


@pytest.mark.parametrize("dtype", [torch.int64, torch.int32, torch.uint8])
def test_integer_scalars_are_counts_summed_in_their_dtype(dtype: torch.dtype) -> None:
    whole = torch.tensor([3, 0, 5, 1, 2, 2, 7])
    sizes = [2, 4, 1]
    counts = [(chunk > 1).sum().to(dtype) for chunk in torch.split(whole, sizes)]
    gathered = gather(counts, CPU, sizes)
    assert gathered.dtype == dtype and gathered.dim() == 0
    assert torch.equal(gathered, (whole > 1).sum().to(dtype))


@pytest.mark.parametrize(("values", "expected"), [((False, True, False), True), ((False, False, False), False)])
def test_bool_scalars_are_set_when_set_on_any_replica(values: tuple[bool, ...], expected: bool) -> None:
    gathered = gather([torch.tensor(v) for v in values], CPU, [1, 2, 3])
    assert gathered.dtype == torch.bool and gathered.dim() == 0
    assert bool(gathered) is expected


def test_per_sample_lists_are_concatenated_in_batch_order() -> None:
    sizes = [1, 3, 2]
    ids = [f"img{i}" for i in range(6)]
    detections = [{"boxes": torch.rand(i, 4), "labels": torch.arange(i)} for i in range(6)]
    chunks = [range(0, 1), range(1, 4), range(4, 6)]
    outputs = [{"ids": [ids[i] for i in c], "detections": [detections[i] for i in c]} for c in chunks]
    gathered = gather(outputs, CPU, sizes)
    assert gathered["ids"] == ids  # as one device returns them, not one list per replica
    assert len(gathered["detections"]) == 6
    for got, expected in zip(gathered["detections"], detections, strict=True):
        assert torch.equal(got["boxes"], expected["boxes"]) and torch.equal(got["labels"], expected["labels"])


def test_a_list_of_batched_tensors_is_a_structure_even_when_its_length_equals_the_chunk() -> None:
    preds, target = torch.randn(4, 3), torch.randn(4, 3)
    outputs = [[preds[:2], target[:2]], [preds[2:], target[2:]]]  # length 2 == chunk size 2
    gathered = gather(outputs, CPU, [2, 2])
    assert len(gathered) == 2
    assert torch.equal(gathered[0], preds) and torch.equal(gathered[1], target)


def test_tuples_are_structures_and_lists_of_another_length_are_zipped() -> None:
    outputs = [(torch.zeros(1), "a"), (torch.ones(2), "a")]
    gathered = gather(outputs, CPU, [1, 2])
    assert torch.equal(gathered[0], torch.tensor([0.0, 1.0, 1.0])) and gathered[1] == "a"
    zipped = gather([[torch.tensor(1.0)], [torch.tensor(3.0)]], CPU, [2, 2])
    assert zipped == [torch.tensor(2.0)]


def test_outputs_of_virtual_devices_are_moved_to_the_target_device_first() -> None:
    from lightning_balanced.data_parallel import virtual_devices
    from lightning_balanced.data_parallel.virtual_device import on_device

    devices = virtual_devices([CPU] * 2)
    outputs = [
        {"preds": on_device(torch.full((i + 1, 2), float(i)), d), "ids": [on_device(torch.tensor(i), d)] * (i + 1)}
        for i, d in enumerate(devices)
    ]
    with pytest.raises(RuntimeError, match="same device"):
        torch.cat([o["preds"] for o in outputs])  # what torch.cat does with tensors of two GPUs
    gathered = gather(outputs, CPU, [1, 2])
    assert type(gathered["preds"]) is torch.Tensor and gathered["preds"].device == CPU
    assert all(type(t) is torch.Tensor for t in gathered["ids"])
    assert torch.equal(torch.stack(gathered["ids"]), torch.tensor([0, 1, 1]))


@PROPERTY
@given(compositions())
def test_chunk_means_weighted_by_chunk_size_give_the_batch_mean(sizes: list[int]) -> None:
    whole = torch.randn(sum(sizes), dtype=torch.float64)
    means = [chunk.mean() for chunk in torch.split(whole, sizes)]
    gathered = gather(means, CPU, sizes)
    # Only the summation order differs (float64, values of order 1).
    torch.testing.assert_close(gathered, whole.mean(), rtol=0, atol=1e-12)


def test_chunk_sizes_of_the_wrong_length_raise() -> None:
    with pytest.raises(ValueError, match="chunk_sizes"):
        gather([torch.tensor(1.0), torch.tensor(2.0), torch.tensor(3.0)], CPU, [1, 1])


def test_containers_keep_their_structure_and_types() -> None:
    def step_output(i: int) -> dict[str, Any]:
        return {
            "loss": torch.tensor(float(i)),
            "pair": Pair(torch.full((i + 1, 2), float(i)), [torch.full((i + 1,), i), None]),
            "sample": Sample(torch.full((i + 1, 1), float(i)), torch.tensor(i), source="val"),
            "ordered": OrderedDict(b=torch.full((i + 1,), i), a="same"),
        }

    gathered = gather([step_output(0), step_output(1)], CPU, [1, 3])
    assert type(gathered) is dict
    assert list(gathered) == ["loss", "pair", "sample", "ordered"]
    torch.testing.assert_close(gathered["loss"], torch.tensor(0.75))

    assert type(gathered["pair"]) is Pair
    assert torch.equal(gathered["pair"].inputs, torch.tensor([[0.0, 0.0], [1.0, 1.0], [1.0, 1.0]]))
    assert type(gathered["pair"].target) is list
    assert torch.equal(gathered["pair"].target[0], torch.tensor([0, 1, 1]))
    assert gathered["pair"].target[1] is None

    assert type(gathered["sample"]) is Sample
    assert torch.equal(gathered["sample"].image, torch.tensor([[0.0], [1.0], [1.0]]))
    assert torch.equal(gathered["sample"].label, torch.tensor(1))  # an integer scalar is a count: summed
    assert gathered["sample"].source == "val"

    assert type(gathered["ordered"]) is OrderedDict
    assert list(gathered["ordered"]) == ["b", "a"]
    assert torch.equal(gathered["ordered"]["b"], torch.tensor([0, 1, 1]))
    assert gathered["ordered"]["a"] == "same"


def test_none_stays_none() -> None:
    assert gather([None, None, None], CPU, [2, 3, 5]) is None
    assert gather([{"preds": None}, {"preds": None}], CPU, [1, 1]) == {"preds": None}


def test_equal_leaves_are_kept_once_and_unequal_ones_become_a_list() -> None:
    outputs = [{"name": "cifar", "step": 3, "rank": 0}, {"name": "cifar", "step": 3, "rank": 1}]
    assert gather(outputs, CPU, [1, 1]) == {"name": "cifar", "step": 3, "rank": [0, 1]}
    # Equal in value but not in type: kept per replica.
    assert gather([1, 1.0], CPU, [1, 1]) == [1, 1.0]


@pytest.mark.parametrize(
    "outputs",
    [
        pytest.param([{"loss": torch.tensor(1.0)}, {"loss": torch.tensor(1.0), "extra": 1}], id="dict-keys"),
        pytest.param([[torch.ones(2)], [torch.ones(2), torch.ones(2)]], id="list-lengths"),
        pytest.param([[torch.ones(2)], (torch.ones(2),)], id="list-vs-tuple"),
        pytest.param([Pair(torch.ones(2), 1), (torch.ones(2), 1)], id="namedtuple-vs-tuple"),
        pytest.param([torch.ones(2), [torch.ones(2)]], id="tensor-vs-list"),
        pytest.param([torch.tensor(1.0), torch.ones(2)], id="scalar-vs-batched"),
        pytest.param([torch.ones(2), None], id="tensor-vs-none"),
        pytest.param([None, torch.ones(2)], id="none-vs-tensor"),
        pytest.param([{"loss": torch.tensor(1.0)}, torch.tensor(1.0)], id="dict-vs-tensor"),
        pytest.param([{"loss": torch.tensor(1.0)}, 3.0], id="dict-vs-float"),
        pytest.param([{"loss": torch.tensor(1.0)}, None], id="dict-vs-none"),
        pytest.param([Sample(torch.ones(2), torch.ones(2)), {"image": torch.ones(2)}], id="dataclass-vs-dict"),
    ],
)
def test_mismatched_structures_raise_value_error(outputs: list[Any]) -> None:
    with pytest.raises(ValueError):
        gather(outputs, CPU, [3, 3])


@PROPERTY
@given(compositions())
def test_gradients_flow_through_the_gathered_result(sizes: list[int]) -> None:
    torch.manual_seed(sum(sizes))
    x = torch.randn(sum(sizes), 3, dtype=torch.float64, requires_grad=True)
    target = torch.randn(sum(sizes), 3, dtype=torch.float64)
    chunks = scatter((x, target), sizes, _cpus(len(sizes)))
    outputs = [{"loss": ((c_x.tanh() - c_t) ** 2).mean(), "preds": c_x.tanh()} for c_x, c_t in chunks]
    gathered = gather(outputs, CPU, sizes)
    (gathered["loss"] + gathered["preds"].sum()).backward()

    x_ref = x.detach().clone().requires_grad_(True)
    (((x_ref.tanh() - target) ** 2).mean() + x_ref.tanh().sum()).backward()
    # float64: the two paths differ only in summation order (~1e-16 relative); 1e-12 would still catch a wrong weight.
    torch.testing.assert_close(x.grad, x_ref.grad, rtol=0, atol=1e-12)


@pytest.mark.parametrize(
    ("sizes", "reduction", "expected"),
    [
        ([2, 1, 1], "mean", [0.5, 0.25, 0.25]),
        ([2, 1, 1], "sum", [1.0, 1.0, 1.0]),
        ([0], "mean", [1.0]),  # a batch of 0 samples: the root's one output, as it is
        ([3], "mean", [1.0]),
    ],
)
def test_chunk_weights_are_what_gather_weights_the_losses_with(
    sizes: list[int], reduction: Any, expected: list[float]
) -> None:
    assert chunk_weights(sizes, reduction) == expected
    losses = [torch.tensor(float(i + 1)) for i in range(len(sizes))]
    gathered = gather(losses, CPU, sizes, loss_reduction=reduction)
    assert gathered.item() == pytest.approx(sum(w * (i + 1) for i, w in enumerate(expected)))
