"""balanced_dp keeps the rules of torch's CUDA ops on the CPU emulation: where the module is replicated from, which
device each replica's tensors are on, and which exception a failing replica surfaces. The same tests run on CUDA where
two GPUs exist."""

from __future__ import annotations

import copy
import threading
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_balanced import BalancedDataParallelStrategy
from tests.helpers import CUDA_DEVICE_LISTS, gpu_ids, quiet_trainer, raises_exactly
from tests.strategies.test_balanced_dp import EXACT, Regressor, _data, _single_device_step


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


# --- CUDA's device rule for every tensor in a replica (virtual_device.VirtualDeviceMode) ----------------------------


class _Mistake(Regressor):
    """A training step that makes one of the classic multi-GPU mistakes, or its correct form."""

    def __init__(self, mistake: str) -> None:
        super().__init__()
        self.mistake = mistake

    def on_fit_start(self) -> None:
        self.offset = torch.ones(3, dtype=torch.float64).to(self.device)  # a plain attribute on the root device
        self.total = torch.zeros((), dtype=torch.float64, device=self.device)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        out = self(x)
        strategy = self.trainer.strategy
        mistakes = {
            "factory without a device": lambda: out + torch.ones(3, dtype=torch.float64),
            "tensor literal": lambda: out * torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64),
            "cat with a host tensor": lambda: torch.cat([out, torch.zeros(1, 3, dtype=torch.float64)]),
            "gather with a host index": lambda: torch.gather(out, 1, torch.zeros(len(x), 1, dtype=torch.long)),
            "root attribute": lambda: out + self.offset,
            "moved to the root device": lambda: out.to(strategy.root_device) + out,
            "moved to a root tensor's device": lambda: out.to(self.offset.device) + out,
            "in-place into a root attribute": lambda: self.total.add_(F.mse_loss(out, y).detach()),
            # the correct forms
            "factory on self.device": lambda: out + torch.ones(3, dtype=torch.float64, device=self.device),
            "literal on x.device": lambda: out * torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64, device=x.device),
            "new_ones": lambda: torch.cat([out, out.new_ones(1, 3)]),
            "0-dim host tensors": lambda: out * torch.tensor(2.0, dtype=torch.float64) + torch.tensor(1.0),
            "moved to this replica": lambda: out + self.offset.to(self.device),
        }
        mistakes[self.mistake]()
        return F.mse_loss(out, y)


_HOST_VS_REPLICA = "cpu and cpu:1"
_ROOT_VS_REPLICA = "cpu:0 and cpu:1"
_MISTAKES = {
    "factory without a device": _HOST_VS_REPLICA,
    "tensor literal": _HOST_VS_REPLICA,
    "cat with a host tensor": _HOST_VS_REPLICA,
    "gather with a host index": _HOST_VS_REPLICA,
    "root attribute": _ROOT_VS_REPLICA,
    "moved to the root device": _HOST_VS_REPLICA,  # on GPUs: cuda:0 and cuda:1
    "moved to a root tensor's device": _ROOT_VS_REPLICA,  # a plain tensor is the root's: its device reads cpu:0
    "in-place into a root attribute": _ROOT_VS_REPLICA,
}


def _two_devices_message(devices: str) -> str:
    # The message, then the note the strategy adds (pytest matches both): the one replica that ran, on cpu:1.
    return (
        f"Expected all tensors to be on the same device, but found at least two devices, {devices}!"
        " (lightning_balanced's CPU emulation: replica or partition i runs on virtual device cpu:i, the root is cpu:0"
        " and tensors made without a device are host tensors, cpu; this would fail on GPUs too. Move tensors to one"
        " device, e.g. `self.device`, before combining them)\n(raised in balanced_dp replica 0 on cpu:1)"
    )


@pytest.mark.parametrize("mistake", list(_MISTAKES))
def test_a_classic_multi_gpu_mistake_fails_on_the_cpu_emulation_as_on_gpus(mistake: str) -> None:
    # Device 0 left out, so the one replica that runs is replica 1, on cpu:1, as GPU 1 would be.
    trainer = quiet_trainer(BalancedDataParallelStrategy(chunk_sizes=[0, 4]), 2, max_steps=1)
    with raises_exactly(RuntimeError, _two_devices_message(_MISTAKES[mistake])):
        trainer.fit(_Mistake(mistake), DataLoader(_data(4), batch_size=4))


@pytest.mark.parametrize(
    "correct",
    ["factory on self.device", "literal on x.device", "new_ones", "0-dim host tensors", "moved to this replica"],
)
def test_the_correct_forms_of_those_steps_run_and_equal_the_single_device_step(correct: str) -> None:
    dataset = _data(8)
    model = _Mistake(correct)
    expected = _single_device_step(model, dataset, batch_size=8)
    quiet_trainer(BalancedDataParallelStrategy(chunk_sizes=[3, 5]), 2, max_steps=1).fit(
        model, DataLoader(dataset, batch_size=8)
    )
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[name], **EXACT)


class _Inner(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(5, 3).double()


class _WithNestedModule(Regressor):
    """A LightningModule holding another one; each replica records both modules' devices."""

    lock = threading.Lock()

    def __init__(self) -> None:
        super().__init__()
        self.inner = _Inner()
        self.devices_seen: list[tuple[torch.device, torch.device, torch.device]] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        zeros = torch.zeros(len(x), 3, dtype=torch.float64, device=self.inner.device)  # on the replica's device
        with self.lock:
            self.devices_seen.append((self.device, self.inner.device, x.device))
        return F.mse_loss(self(x) + self.inner.layer(x) + zeros, y)

    def validation_step(self, batch: Any, batch_idx: int) -> Any:
        return self.training_step(batch, batch_idx)


@pytest.mark.parametrize("stage", ["fit", "validate"])
def test_nested_lightning_modules_report_their_replicas_device(stage: str) -> None:
    model = _WithNestedModule()
    trainer = quiet_trainer(BalancedDataParallelStrategy(chunk_sizes=[2, 2, 2]), 3, max_steps=1)
    getattr(trainer, stage)(model, DataLoader(_data(6), batch_size=6))
    assert sorted(model.devices_seen, key=str) == [(torch.device("cpu", i),) * 3 for i in range(3)]


class _WritesItsWeight(Regressor):
    """Each replica adds 1 to its first weight in place, and records whether its parameters are registered."""

    lock = threading.Lock()

    def __init__(self) -> None:
        super().__init__()
        self.registered: list[int] = []

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        with torch.no_grad():
            self.net[0].weight.add_(1.0)
        with self.lock:
            self.registered.append(len(list(self.parameters())))


def test_in_place_writes_reach_the_root_from_replica_0_only_and_replicas_register_no_parameters() -> None:
    model = _WritesItsWeight()
    before = model.net[0].weight.detach().clone()
    trainer = quiet_trainer(BalancedDataParallelStrategy(chunk_sizes=[2, 2, 2]), 3)
    trainer.validate(model, DataLoader(_data(6), batch_size=6), verbose=False)
    # On GPUs replica 0 holds the root's own tensor and the others broadcast copies: one write persists, not three.
    torch.testing.assert_close(model.net[0].weight.detach(), before + 1.0, rtol=0, atol=0)
    assert model.registered == [0, 0, 0]
