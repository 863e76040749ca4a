"""balanced_dp keeps the rules of torch's CUDA ops on the CPU emulation: where the module is replicated from, which
device each replica's tensors are on, and which exception a failing replica surfaces. The same tests run on CUDA where
two GPUs exist."""

from __future__ import annotations

import copy
import threading
from typing import Any

import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_balanced import BalancedDataParallelStrategy
from tests.helpers import CUDA_DEVICE_LISTS, gpu_ids, quiet_trainer
from tests.test_balanced_dp import EXACT, Regressor, _data, _single_device_step


class _DeviceRecorder(Regressor):
    """Records the device of every replica's module, chunk and output."""

    lock = threading.Lock()  # a class attribute: the module itself stays deep-copyable

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.seen: list[tuple[torch.device, torch.device, torch.device, int]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        pred = self(x)
        with self.lock:
            self.seen.append((self.device, x.device, pred.device, len(x)))
        return F.mse_loss(pred, y)


def _fit_one_step(strategy: BalancedDataParallelStrategy, devices: Any, accelerator: str, batch_size: int) -> Any:
    dataset = _data(batch_size)
    model = _DeviceRecorder()
    expected = _single_device_step(model, dataset, batch_size=batch_size)
    quiet_trainer(strategy, devices, accelerator=accelerator, max_steps=1).fit(
        model, DataLoader(dataset, batch_size=batch_size)
    )
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value.cpu(), expected[name], **EXACT)
    return model


@pytest.mark.parametrize(
    ("options", "batch_size", "ran_on"),
    [
        ({"gpu0_bsz": 0}, 8, [1, 2]),
        ({"gpu0_bsz": 2}, 2, [1, 2]),  # a short batch under gpu0_bsz: device 0 gets batch // 3 = 0 samples
        ({"chunk_sizes": [0, 0, 5]}, 5, [2]),
    ],
)
def test_a_plan_that_leaves_device_0_out_replicates_from_device_0_and_runs_the_others(
    options: dict[str, Any], batch_size: int, ran_on: list[int]
) -> None:
    model = _fit_one_step(BalancedDataParallelStrategy(**options), 3, "cpu", batch_size)
    # Each replica ran on its own virtual device, and everything it computed stayed there.
    devices = sorted(model.seen, key=lambda seen: seen[0].index)
    assert [module.index for module, _, _, _ in devices] == ran_on
    assert all(module == x == pred for module, x, pred, _ in devices)


class StepFailure(Exception):
    """An exception that cannot be rebuilt from a message, as torch's ExceptionWrapper tries to."""

    def __init__(self, code: int, detail: str) -> None:
        super().__init__(f"code {code}: {detail}")
        self.code = code


class _FailingReplica(Regressor):
    """Replica with 2 samples fails; the others wait at `manual_backward` (manual) or finish (automatic)."""

    def __init__(self, manual: bool) -> None:
        super().__init__(manual=manual)
        self.raised: list[BaseException] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        if len(x) == 2:
            error = StepFailure(7, "replica with 2 samples fails")
            self.raised.append(error)
            raise error
        loss = F.mse_loss(self(x), y)
        if not self.automatic_optimization:
            self.manual_backward(loss)
        return loss


def _fit_failing(
    manual: bool, accelerator: str, devices: Any, chunk_sizes: list[int], parallel_devices: Any = None
) -> None:
    model = _FailingReplica(manual)
    strategy = BalancedDataParallelStrategy(chunk_sizes=chunk_sizes, parallel_devices=parallel_devices)
    trainer = quiet_trainer(strategy, devices, accelerator=accelerator, max_steps=1)
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(StepFailure) as info:
        trainer.fit(model, DataLoader(_data(sum(chunk_sizes)), batch_size=sum(chunk_sizes)))
    # The very object the replica raised (its type, attributes and traceback), not a copy rebuilt from its message.
    assert model.raised == [info.value]
    assert info.value.code == 7
    assert any("replica" in note for note in info.value.__notes__)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value.cpu(), before[name], rtol=0, atol=0)


@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_a_failing_replica_surfaces_its_own_exception(manual: bool) -> None:
    _fit_failing(manual, "cpu", 3, [4, 2, 4])


# --- the same on GPUs -------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("devices", CUDA_DEVICE_LISTS)
@pytest.mark.parametrize(
    ("options", "batch_size"), [({"gpu0_bsz": 0}, 8), ({"gpu0_bsz": 2}, 1), ({"chunk_sizes": [0, 5]}, 5)]
)
def test_a_plan_that_leaves_device_0_out_runs_on_cuda(
    options: dict[str, Any], batch_size: int, devices: list[torch.device]
) -> None:
    strategy = BalancedDataParallelStrategy(**options, parallel_devices=devices)
    model = _fit_one_step(strategy, gpu_ids(devices), "cuda", batch_size)
    assert [module for module, _, _, _ in model.seen] == [devices[1]]  # only replica 1 ran


@pytest.mark.parametrize("devices", CUDA_DEVICE_LISTS)
@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_a_failing_replica_surfaces_its_own_exception_on_cuda(manual: bool, devices: list[torch.device]) -> None:
    _fit_failing(manual, "cuda", gpu_ids(devices), [4, 2], parallel_devices=devices)
