"""balanced_dp with synchronized BatchNorm: training equals the single-device run on the whole batch, whatever the
split, BatchNorm included."""

from __future__ import annotations

import copy
import time
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_balanced import BalancedDataParallelStrategy
from tests.helpers import CUDA_DEVICE_LISTS, gpu_ids, quiet_trainer

# float64: the synchronized statistics are combined from per-chunk (count, mean, M2) by Chan's formula instead of one
# pass over the batch, and the gradients are summed per chunk then across chunks. Those reorderings change float64
# results by ~1e-15 on values of order 1 after two SGD steps; a per-chunk statistic (the unsynchronized behaviour) or a
# count-unweighted combination is off by ~1e-2, so 1e-10 separates them with a wide margin.
EXACT = {"rtol": 0, "atol": 1e-10}

_BATCHNORM = {1: nn.BatchNorm1d, 2: nn.BatchNorm2d, 3: nn.BatchNorm3d}
_SPATIAL = {1: (3,), 2: (3, 2), 3: (2, 2, 2)}


class BatchNormNet(pl.LightningModule):
    """Conv (or linear) → BatchNorm → tanh → linear, float64, trained by SGD with momentum."""

    def __init__(self, dim: int, momentum: float | None, affine: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        conv = {1: nn.Conv1d, 2: nn.Conv2d, 3: nn.Conv3d}[dim]
        self.dim = dim
        self.features = nn.Sequential(
            conv(2, 4, kernel_size=1), _BATCHNORM[dim](4, momentum=momentum, affine=affine), nn.Tanh()
        )
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(4 * int(torch.tensor(_SPATIAL[dim]).prod()), 3))
        self.flat_bn = nn.BatchNorm1d(3, momentum=momentum, affine=affine)  # a 2D (N, C) input as well
        self.double()
        self.losses: list[torch.Tensor] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.flat_bn(self.head(self.features(x))), y)

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.losses.append(outputs["loss"].detach().cpu())  # on the host, to compare with runs on other devices

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.3, momentum=0.9)


def _data(dim: int, n: int) -> TensorDataset:
    g = torch.Generator().manual_seed(dim)
    x = 3.0 + 2.0 * torch.randn(n, 2, *_SPATIAL[dim], generator=g, dtype=torch.float64)
    return TensorDataset(x, torch.randn(n, 3, generator=g, dtype=torch.float64))


def _fit_two_steps(model: BatchNormNet, strategy: Any, devices: Any, batch_size: int, **kwargs: Any) -> BatchNormNet:
    dataset = _data(model.dim, 2 * batch_size)
    quiet_trainer(strategy, devices, max_steps=2, **kwargs).fit(model, DataLoader(dataset, batch_size=batch_size))
    return model


def _assert_equal_runs(got: BatchNormNet, expected: BatchNormNet) -> None:
    state, reference = got.state_dict(), expected.state_dict()
    assert list(state) == list(reference)  # plain BatchNorm keys, nothing added
    for name, value in state.items():
        torch.testing.assert_close(value, reference[name], **EXACT, msg=name)
    assert len(got.losses) == len(expected.losses) == 2
    for loss, reference_loss in zip(got.losses, expected.losses, strict=True):
        torch.testing.assert_close(loss, reference_loss, **EXACT)


@pytest.mark.parametrize("dim", [1, 2, 3])
@pytest.mark.parametrize(("momentum", "affine"), [(0.1, True), (None, True), (0.1, False)])
def test_synchronized_batchnorm_matches_the_single_device_run(dim: int, momentum: float | None, affine: bool) -> None:
    model = BatchNormNet(dim, momentum, affine)
    expected = _fit_two_steps(copy.deepcopy(model), "auto", 1, batch_size=7)
    # Chunks of 1, 0, 4 and 2 samples: a one-sample chunk is normalized with the batch's statistics, an empty device
    # is left out.
    strategy = BalancedDataParallelStrategy(chunk_sizes=[1, 0, 4, 2], sync_batchnorm=True)
    got = _fit_two_steps(model, strategy, 4, batch_size=7)
    _assert_equal_runs(got, expected)
    bn = got.features[1]
    assert int(bn.num_batches_tracked) == 2  # once per step, not once per replica


@pytest.mark.parametrize("options", [{"gpu0_bsz": 0}, {"gpu0_bsz": 1}, {"weights": [1.0, 5.0]}])
def test_trainer_sync_batchnorm_flag_turns_it_on(options: dict[str, Any]) -> None:
    model = BatchNormNet(2, 0.1, True)
    expected = _fit_two_steps(copy.deepcopy(model), "auto", 1, batch_size=6)
    # Lightning's accelerator connector sets the strategy's `_layer_sync` after __init__: that is the switch here.
    got = _fit_two_steps(model, BalancedDataParallelStrategy(**options), 2, batch_size=6, sync_batchnorm=True)
    _assert_equal_runs(got, expected)


def test_the_users_batchnorm_objects_are_back_after_fit_with_the_trained_state() -> None:
    model = BatchNormNet(1, 0.1, True)
    layers = [model.features[1], model.flat_bn]
    types = [type(layer) for layer in layers]
    _fit_two_steps(model, BalancedDataParallelStrategy(chunk_sizes=[3, 1], sync_batchnorm=True), 2, batch_size=4)
    assert [model.features[1], model.flat_bn] == layers
    assert [type(layer) for layer in layers] == types
    assert int(layers[0].num_batches_tracked) == 2
    assert not torch.equal(layers[0].running_mean, torch.zeros(4, dtype=torch.float64))


def test_without_sync_batchnorm_each_chunk_is_normalized_on_its_own() -> None:
    # The default stays nn.DataParallel's: per-chunk statistics, so the run differs from the single-device one.
    model = BatchNormNet(2, 0.1, True)
    expected = _fit_two_steps(copy.deepcopy(model), "auto", 1, batch_size=6)
    got = _fit_two_steps(model, BalancedDataParallelStrategy(chunk_sizes=[2, 4]), 2, batch_size=6)
    assert not torch.allclose(got.losses[0], expected.losses[0], rtol=0, atol=1e-6)


def test_validation_uses_the_running_statistics_as_on_one_device() -> None:
    model = BatchNormNet(2, 0.1, True)
    _fit_two_steps(model, BalancedDataParallelStrategy(sync_batchnorm=True), 2, batch_size=6)

    class Validating(BatchNormNet):
        def validation_step(self, batch: Any, batch_idx: int) -> None:
            self.log("val_loss", self.training_step(batch, batch_idx))

    validating = Validating(2, 0.1, True)
    validating.load_state_dict(model.state_dict())
    loader = DataLoader(_data(2, 10), batch_size=5)
    expected = quiet_trainer("auto", 1).validate(validating, loader, verbose=False)[0]["val_loss"]
    strategy = BalancedDataParallelStrategy(chunk_sizes=[1, 4], sync_batchnorm=True)
    got = quiet_trainer(strategy, 2).validate(validating, loader, verbose=False)[0]["val_loss"]
    assert got == pytest.approx(expected, rel=1e-12)


def test_a_batch_of_one_sample_in_total_raises_the_batchnorm_error_as_on_one_device() -> None:
    model = BatchNormNet(1, 0.1, True)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        quiet_trainer("auto", 1, max_steps=1).fit(copy.deepcopy(model), DataLoader(_data(1, 1), batch_size=1))
    strategy = BalancedDataParallelStrategy(sync_batchnorm=True)
    with pytest.raises(ValueError, match="Expected more than 1 value per channel when training"):
        quiet_trainer(strategy, 2, max_steps=1).fit(model, DataLoader(_data(1, 1), batch_size=1))


class _MovedBetweenSteps(BatchNormNet):
    """Wraps ``flat_bn`` in a container before the second step: the synchronized layer's path changes mid-fit."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if batch_idx == 1:
            self.flat_bn = nn.Sequential(self.flat_bn)  # type: ignore[assignment]


def test_a_synchronized_layer_moved_between_steps_stays_synchronized() -> None:
    # The strategy finds the synchronized layers once, at setup; a layer moved by a hook is still reached in every
    # replica (a per-chunk statistic in the second step would be off by ~1e-2).
    model = _MovedBetweenSteps(1, 0.1, True)
    expected = _fit_two_steps(copy.deepcopy(model), "auto", 1, batch_size=7)
    strategy = BalancedDataParallelStrategy(chunk_sizes=[1, 2, 4], sync_batchnorm=True)
    got = _fit_two_steps(model, strategy, 3, batch_size=7)
    _assert_equal_runs(got, expected)
    assert type(got.flat_bn[0]) is nn.BatchNorm1d  # the user's layer back at teardown, in its new container
    assert int(got.flat_bn[0].num_batches_tracked) == 2


class _FailsBetweenTheLayers(BatchNormNet):
    """The replica with 2 samples fails after the first synchronized layer; the others wait at the second one."""

    def __init__(self, manual: bool) -> None:
        super().__init__(1, 0.1, True)
        self.automatic_optimization = not manual
        self.raised: list[BaseException] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        features = self.head(self.features(x))
        if len(x) == 2:
            self.raised.append(KeyError("replica with 2 samples fails"))
            raise self.raised[-1]
        loss = F.mse_loss(self.flat_bn(features), y)
        if not self.automatic_optimization:
            self.manual_backward(loss)
        return loss


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_a_replica_failing_between_two_synchronized_layers_surfaces_its_own_error_at_once(
    manual: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The layers and the manual-optimization calls meet at the step's one barrier: the failure releases the waiting
    # replicas at once (not after the timeout), and the fit raises the failing replica's own exception, not the
    # ReplicaAborted of a released one.
    import lightning_balanced.data_parallel.runner as runner_module

    monkeypatch.setattr(runner_module, "REPLICA_TIMEOUT_S", 60.0)
    model = _FailsBetweenTheLayers(manual)
    strategy = BalancedDataParallelStrategy(chunk_sizes=[4, 2, 4], sync_batchnorm=True)
    start = time.monotonic()
    with pytest.raises(KeyError, match="replica with 2 samples fails") as info:
        quiet_trainer(strategy, 3, max_steps=1).fit(model, DataLoader(_data(1, 10), batch_size=10))
    assert time.monotonic() - start < 30
    assert model.raised == [info.value]
    assert any("replica 1" in note for note in info.value.__notes__)
    assert type(model.flat_bn) is nn.BatchNorm1d  # reverted at teardown after the failure too


@pytest.mark.parametrize("devices", CUDA_DEVICE_LISTS)
def test_synchronized_batchnorm_matches_the_single_device_run_on_cuda(devices: list[torch.device]) -> None:
    # Three replicas (device 0 left out, a chunk of one sample) on the GPUs given, the first one used twice.
    model = BatchNormNet(2, 0.1, True)
    expected = _fit_two_steps(copy.deepcopy(model), "auto", 1, batch_size=7)
    replicas = [devices[0], *devices]
    strategy = BalancedDataParallelStrategy(chunk_sizes=[0, 1, 6], sync_batchnorm=True, parallel_devices=replicas)
    got = _fit_two_steps(model, strategy, gpu_ids(devices), batch_size=7, accelerator="cuda")
    _assert_equal_runs(got.cpu(), expected)
