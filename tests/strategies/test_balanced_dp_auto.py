"""balanced_dp with ``chunk_sizes="auto"`` on emulated devices of different speeds and memories (CPU, real Trainer).

The speeds come from the emulation's testing aid (:class:`EmulatedDevice`, a slowdown that stretches a replica's step
method) over a step that sleeps a fixed time per sample, so the measured seconds per sample follow the slowdown even on
a loaded two-core machine: compute noise is small against the sleeps, and every check allows the one sample of
rounding the issue allows.
"""

from __future__ import annotations

import copy
import threading
import time
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_balanced import AutoSplit, BalancedDataParallelStrategy
from lightning_balanced.data_parallel.virtual_device import (
    EmulatedDevice,
    EmulatedOutOfMemoryError,
    emulate_devices,
    emulated_step,
)
from lightning_balanced.split_policies.split_policy import proportional_split
from tests.helpers import CUDA_DEVICE_LISTS, gpu_ids, quiet_trainer, raises_exactly
from tests.strategies.test_balanced_dp import Regressor, _data
from tests.strategies.test_balanced_dp_syncbn import EXACT, BatchNormNet
from tests.strategies.test_balanced_dp_syncbn import _data as _image_data

SLEEP_PER_SAMPLE_S = 0.006  # 3 ms let a loaded 16-core machine (-n 15) measure a 1:2 speed as 1:1.5


class _Paced(Regressor):
    """Each training step sleeps ``SLEEP_PER_SAMPLE_S`` per sample of its chunk and records the chunk sizes."""

    def __init__(self) -> None:
        super().__init__(lr=0.0)
        self.chunks: dict[tuple[str, int], list[int]] = {}
        self._lock = threading.Lock()

    def _record(self, loop: str, batch_idx: int, batch: Any) -> None:
        with self._lock:
            self.chunks.setdefault((loop, batch_idx), []).append(len(batch[0]))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        time.sleep(SLEEP_PER_SAMPLE_S * len(batch[0]))
        self._record("fit", batch_idx, batch)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._record("validate", batch_idx, batch)
        super().validation_step(batch, batch_idx)


class _Recording(AutoSplit):
    """AutoSplit that keeps every observation and every plan of a training batch of 30."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.observed: list[tuple[list[int], list[int | None] | None]] = []

    def observe(self, chunk_sizes: list[int], seconds: list[float], peak_bytes: list[int | None] | None = None) -> None:
        self.observed.append((chunk_sizes, peak_bytes))
        super().observe(chunk_sizes, seconds, peak_bytes)


def _fit(
    policy: AutoSplit,
    devices: list[EmulatedDevice],
    steps: int,
    model: pl.LightningModule | None = None,
    batch_size: int = 30,
    **kwargs: Any,
) -> pl.LightningModule:
    model = model or _Paced()
    trainer = quiet_trainer(BalancedDataParallelStrategy(split=policy), len(devices), max_steps=steps, **kwargs)
    with emulate_devices(devices):
        trainer.fit(model, DataLoader(_data(batch_size * steps), batch_size=batch_size))
    return model


def _last_plan(model: _Paced, step: int) -> list[int]:
    return sorted(model.chunks[("fit", step)], reverse=True)


def _assert_within_one_sample(got: list[int], expected: list[int]) -> None:
    assert sum(got) == sum(expected)
    assert all(abs(g - e) <= 1 for g, e in zip(got, expected, strict=True)), (got, expected)


def test_a_1_to_2_speed_split_converges_within_one_sample_of_the_proportion(caplog: pytest.LogCaptureFixture) -> None:
    policy = AutoSplit(profile_steps=3, warmup_steps=1)
    with caplog.at_level("INFO"):
        model = _fit(policy, [EmulatedDevice(), EmulatedDevice(slowdown=2.0)], steps=6)
    assert isinstance(model, _Paced)
    assert _last_plan(model, 0) == [15, 15]  # even until profiled
    planned = policy.plan(30, 2)
    _assert_within_one_sample(planned, [20, 10])
    assert sorted(model.chunks[("fit", 5)], reverse=True) == sorted(planned, reverse=True)
    assert policy.replans == 1
    # The plan is logged, one line per device, with the line that pins it.
    (message,) = [m for m in caplog.messages if m.startswith("AutoSplit plan")]
    assert message.splitlines()[0] == f"AutoSplit plan 1, after 3 profiled steps: a batch of 30 as {planned}"
    assert message.splitlines()[-1] == f"  to pin it: chunk_sizes={planned}"


def test_three_devices_1_1_3_get_speed_proportional_chunks() -> None:
    policy = AutoSplit(profile_steps=3)
    _fit(policy, [EmulatedDevice(), EmulatedDevice(), EmulatedDevice(slowdown=3.0)], steps=5, batch_size=35)
    _assert_within_one_sample(policy.plan(35, 3), [15, 15, 5])


@pytest.mark.slow
def test_the_plan_is_the_same_in_two_seeded_runs_within_the_rounding_of_measured_times() -> None:
    plans = []
    for _ in range(2):
        pl.seed_everything(7, verbose=False)
        policy = AutoSplit(profile_steps=3)
        _fit(policy, [EmulatedDevice(), EmulatedDevice(slowdown=2.0)], steps=5)
        plans.append(policy.plan(30, 2))
    _assert_within_one_sample(plans[0], plans[1])


def test_validation_uses_the_proportions_of_the_last_plan() -> None:
    policy = AutoSplit(profile_steps=2)
    model = _Paced()
    trainer = quiet_trainer(
        BalancedDataParallelStrategy(split=policy), 2, max_steps=4, limit_val_batches=1, val_check_interval=4
    )
    with emulate_devices([EmulatedDevice(), EmulatedDevice(slowdown=2.0)]):
        trainer.fit(model, DataLoader(_data(120), batch_size=30), DataLoader(_data(9), batch_size=9))
    planned = policy.plan(30, 2)
    assert planned != [15, 15]
    # The sanity check ran before any plan (even); the validation after training, the last plan's proportions.
    validation = model.chunks[("validate", 0)]
    assert sorted(validation[-2:], reverse=True) == sorted(proportional_split(9, planned), reverse=True)


@pytest.mark.slow
def test_drift_re_plans_and_noise_does_not() -> None:
    class Drifting(_Paced):
        """Device 1 gets 2.5x slower from step 12 on; before that, up to 20 % noise on every chunk's time."""

        def training_step(self, batch: Any, batch_idx: int) -> Any:
            factor = 1.0 + 0.1 * ((batch_idx * 7 + batch[0].device.index * 3) % 3)  # +0, +10, +20 %
            if batch_idx >= 12 and batch[0].device.index == 1:
                factor = 2.5
            time.sleep(SLEEP_PER_SAMPLE_S * len(batch[0]) * (factor - 1))  # on top of _Paced's sleep
            return super().training_step(batch, batch_idx)

    policy = _Recording(profile_steps=3, drift_window=4, drift_tolerance=0.3)
    replans: list[int] = []

    class Count(pl.Callback):
        def on_train_batch_end(self, *args: Any) -> None:
            replans.append(policy.replans)

    model = _fit(policy, [EmulatedDevice(), EmulatedDevice()], steps=20, model=Drifting(), callbacks=[Count()])
    assert replans[11] == 1  # profiled once, the noise never re-planned
    assert replans[-1] >= 2  # the drift did
    assert isinstance(model, _Paced)
    _assert_within_one_sample(_last_plan(model, 19), [21, 9])  # 2.5 : 1 of 30 = 21.4 : 8.6


def _peak_for(model: pl.LightningModule, batch_size: int) -> int:
    """The memory a virtual device measures for ``model``'s training step on ``batch_size`` samples."""
    x, y = _data(batch_size)[:]
    resident = sum(t.numel() * t.element_size() for t in (*model.parameters(), *model.buffers()))
    with emulated_step(torch.device("cpu", 0), resident, measure_memory=True) as step:
        F.mse_loss(model(x), y)
    return step.peak_bytes


@pytest.mark.slow
def test_the_memory_cap_binds_and_no_planned_chunk_exceeds_it() -> None:
    # Speeds 3:1 would give device 0 about 22 of 30 samples; its memory holds 15 at the default 0.9 of capacity.
    capacity = int(_peak_for(_Paced(), 15) / 0.9) + 1
    free = AutoSplit(profile_steps=3)
    _fit(free, [EmulatedDevice(), EmulatedDevice(slowdown=3.0)], steps=4)
    capped = _Recording(profile_steps=3)
    model = _fit(capped, [EmulatedDevice(capacity_bytes=capacity), EmulatedDevice(slowdown=3.0)], steps=6)
    assert free.plan(30, 2)[0] >= 20
    assert capped.plan(30, 2)[0] <= 15
    assert isinstance(model, _Paced)
    assert _last_plan(model, 5)[0] == max(capped.plan(30, 2))
    # Every step after the plan stayed within 0.9 of the capacity on device 0 (and none ran out of memory).
    for sizes, peaks in capped.observed[3:]:
        assert peaks is not None and peaks[0] is not None and peaks[0] <= 0.9 * capacity, (sizes, peaks)


def test_a_batch_that_fits_no_split_raises_naming_the_devices_capacities_and_need() -> None:
    # Each device holds its 15 samples of the even split, but at memory_fraction 0.5 they hold fewer than 30 together.
    capacity = int(_peak_for(_Paced(), 15) * 1.5)
    policy = AutoSplit(profile_steps=2, warmup_steps=0, memory_fraction=0.5)
    device = rf"capacity {capacity} B x memory_fraction 0\.5, predicted 0 B \+ \d+ B/sample: at most \d+ samples"
    message = (
        r"AutoSplit: a batch of 30 does not fit in the devices' memory whatever the split: they hold at most \d+"
        rf" samples \(device 0: {device}; device 1: {device}\); the whole batch on the cheapest device would need \d+"
        r" B\. Lower the batch size, raise `memory_fraction`, or add devices"
    )
    with pytest.raises(ValueError, match=f"^{message}$"):
        _fit(policy, [EmulatedDevice(capacity_bytes=capacity)] * 2, steps=3)


def test_gradients_stay_exact_across_a_re_plan() -> None:
    # float64 BatchNorm net, BatchNorm synchronized: the plan changes after step 2 (even -> about 2:1), and every
    # step still equals the single-device step on the whole batch (tolerance: see EXACT).
    torch.manual_seed(0)
    reference = BatchNormNet(2, momentum=0.1, affine=True)
    model = copy.deepcopy(reference)
    dataset = _image_data(2, 120)
    quiet_trainer("auto", 1, max_steps=4).fit(reference, DataLoader(dataset, batch_size=30))
    policy = AutoSplit(profile_steps=2, warmup_steps=0)

    class PacedNet(BatchNormNet):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            time.sleep(SLEEP_PER_SAMPLE_S * len(batch[0]))
            return super().training_step(batch, batch_idx)

    model.__class__ = PacedNet
    strategy = BalancedDataParallelStrategy(split=policy, sync_batchnorm=True)
    with emulate_devices([EmulatedDevice(), EmulatedDevice(slowdown=2.0)]):
        quiet_trainer(strategy, 2, max_steps=4).fit(model, DataLoader(dataset, batch_size=30))
    assert policy.replans == 1 and policy.plan(30, 2) != [15, 15]
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, reference.state_dict()[name], **EXACT, msg=name)
    for loss, expected in zip(model.losses, reference.losses, strict=True):
        torch.testing.assert_close(loss, expected, **EXACT)


# ---- replicas that share one GPU: AutoSplit's pure logic on synthetic observations ----------------------------------

_ONE_GPU_TWICE = [torch.device("cuda", 0)] * 2  # device descriptors only: nothing runs on a GPU here


def _shared_gpu_seconds(sizes: list[int], device_per_sample: float, first_ends_at: float) -> list[float]:
    """Two replicas on one GPU whose streams start together: the device works ``sum(sizes) * device_per_sample`` s on
    both chunks, and the replica whose events close last times all of it, the other ``first_ends_at`` of it."""
    device_time = sum(sizes) * device_per_sample
    return [device_time, first_ends_at * device_time]


def test_identical_replicas_on_one_gpu_plan_equal_chunks_whatever_their_events_say(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # On an H100 (2026-11-26) two identical replicas on one GPU measured 1.11e-5 and 1.73e-5 s/sample: each replica's
    # CUDA events span the other's work too, so they tell which replica's events closed first, not a speed. Planned
    # as one device, the replicas get equal chunks, whichever of them looks slower in a step.
    for first_ends_at in (0.64, 1.5):
        blind, told = AutoSplit(profile_steps=3), AutoSplit(profile_steps=3)
        told.set_devices(_ONE_GPU_TWICE)
        assert told.shared_devices == [[0, 1]] and blind.shared_devices == []
        for policy in (blind, told):
            for _ in range(4):
                sizes = policy.plan(256, 2)
                policy.observe(sizes, _shared_gpu_seconds(sizes, 1e-5, first_ends_at))
        assert told.plan(256, 2) == [128, 128]
        assert abs(blind.plan(256, 2)[0] - 128) > 128 * 0.05  # the replica timing alone is off by more than 5 %
    told = AutoSplit(profile_steps=1, warmup_steps=0)
    told.set_devices(["cuda:0", "cuda:0"])
    caplog.clear()
    with caplog.at_level("INFO"):
        told.observe([128, 128], [2.56e-3, 1.64e-3])
    (message,) = [m for m in caplog.messages if m.startswith("AutoSplit plan")]
    assert message.splitlines()[1:3] == [
        "  device 0: 128 samples, 2e-05 s/sample, one device with devices [0, 1]",
        "  device 1: 128 samples, 2e-05 s/sample, one device with devices [0, 1]",
    ]


def test_a_gpu_shared_by_two_replicas_gets_its_speed_s_share_next_to_a_gpu_of_its_own() -> None:
    # Two GPUs of one model, 1e-5 s per sample each; GPU 0 runs replicas 0 and 1, GPU 1 replica 2. Balanced, each GPU
    # takes half the batch, and GPU 0 splits its half between its replicas.
    policy = AutoSplit(profile_steps=3)
    policy.set_devices([torch.device("cuda", 0), torch.device("cuda", 0), torch.device("cuda", 1)])
    assert policy.shared_devices == [[0, 1]]
    for _ in range(4):
        sizes = policy.plan(30, 3)
        policy.observe(sizes, [*_shared_gpu_seconds(sizes[:2], 1e-5, 0.7), sizes[2] * 1e-5])
    sizes = policy.plan(30, 3)
    assert sizes[2] == 15 and sorted(sizes[:2]) == [7, 8]


@pytest.mark.parametrize(
    "devices", [[torch.device("cuda", 0), torch.device("cuda", 1)], [torch.device("cpu", 0), torch.device("cpu", 1)]]
)
def test_distinct_devices_are_timed_each_on_its_own(devices: list[torch.device]) -> None:
    policy = AutoSplit(profile_steps=3)
    policy.set_devices(devices)
    assert policy.shared_devices == []
    for _ in range(4):
        sizes = policy.plan(30, 2)
        policy.observe(sizes, [sizes[0] * 0.02, sizes[1] * 0.01])
    assert policy.plan(30, 2) == [10, 20]


def test_a_shared_gpu_s_memory_is_its_peak_against_all_its_replicas_samples_and_its_whole_capacity() -> None:
    # The strategy gives each replica its share of the GPU (2000 B / 2) and the GPU's peak, which holds both chunks:
    # here 100 B + 10 B per sample of the two together. At memory_fraction 0.5 the GPU holds (1000 - 100) / 10 = 90.
    def fed(batches: list[int], told: bool) -> AutoSplit:
        policy = AutoSplit(profile_steps=len(batches), warmup_steps=0, memory_fraction=0.5)
        policy.set_capacities([1000, 1000])
        if told:
            policy.set_devices(_ONE_GPU_TWICE)
        for batch in batches:
            sizes = [batch // 2, batch // 2]
            peak = 100 + 10 * batch
            policy.observe(sizes, [batch * 1e-5, batch * 1e-5], peak_bytes=[peak, peak])
        return policy

    assert fed([40, 80], told=True).plan(80, 2) == [40, 40]
    # Blind to the sharing, each replica's chunk seemed to cost 20 B per sample of a 1000 B capacity: 20 each.
    with pytest.raises(ValueError, match="they hold at most 40 samples"):
        fed([40, 80], told=False)
    with raises_exactly(
        ValueError,
        "AutoSplit: a batch of 100 does not fit in the devices' memory whatever the split: they hold at most 90 samples"
        " (device 0: capacity 2000 B (one device with devices [0, 1]) x memory_fraction 0.5, predicted 100 B + 10"
        " B/sample: at most 45 samples; device 1: capacity 2000 B (one device with devices [0, 1]) x memory_fraction"
        " 0.5, predicted 100 B + 10 B/sample: at most 45 samples); the whole batch on the cheapest device would need"
        " 1100 B. Lower the batch size, raise `memory_fraction`, or add devices",
    ):
        fed([40, 100], told=True)


def test_auto_with_gpu0_bsz_raises() -> None:
    with raises_exactly(
        ValueError, "Give at most one of `gpu0_bsz`, `chunk_sizes` and `weights`, got gpu0_bsz and chunk_sizes"
    ):
        BalancedDataParallelStrategy(gpu0_bsz=4, chunk_sizes="auto")
    with raises_exactly(TypeError, "`chunk_sizes` must be a sequence of integers or 'auto', got 'fast'"):
        BalancedDataParallelStrategy(chunk_sizes="fast")  # type: ignore[arg-type]
    assert isinstance(BalancedDataParallelStrategy(chunk_sizes="auto").split, AutoSplit)


# ---- the testing aid itself ----------------------------------------------------------------------------------------


class FakeClock:
    """``time.perf_counter`` and ``time.sleep`` of the emulation, on a clock that only sleeping moves: exact times."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    import lightning_balanced.data_parallel.virtual_device as virtual_device

    fake = FakeClock()
    monkeypatch.setattr(virtual_device, "time", fake)
    return fake


def test_a_slowdown_stretches_the_step_on_its_device_only(clock: FakeClock) -> None:
    with emulate_devices([EmulatedDevice(), EmulatedDevice(slowdown=3.0)]):
        took = []
        for index in (0, 1):
            began = clock.perf_counter()
            with emulated_step(torch.device("cpu", index)):
                clock.sleep(0.05)  # the step method's own 50 ms on the host
            took.append(clock.perf_counter() - began)
    assert took == pytest.approx([0.05, 0.15], abs=1e-12)  # device 1 three times as long


def test_a_step_over_the_emulated_capacity_runs_out_of_memory() -> None:
    weight = torch.randn(4, 4, requires_grad=True)
    with (
        emulate_devices([EmulatedDevice(capacity_bytes=100)]),
        pytest.raises(EmulatedOutOfMemoryError) as info,
        emulated_step(torch.device("cpu", 0), resident_bytes=64),
    ):
        (torch.ones(2, 4) @ weight).tanh().sum()
    # Saved for backward: the matmul's input (32 B; the weight's gradient needs it) and tanh's output (32 B).
    assert str(info.value) == (
        "virtual device cpu:0 out of memory (CPU emulation): the step needs 128 B (64 B resident + 64 B of"
        " activations), its emulated capacity is 100 B"
    )


def test_device_work_per_sample_is_done_before_the_stretch(clock: FakeClock) -> None:
    devices = [EmulatedDevice(seconds_per_sample=0.01), EmulatedDevice(slowdown=2.0, seconds_per_sample=0.01)]
    took = []
    with emulate_devices(devices):
        reported = []
        for index in (0, 1):
            began = clock.perf_counter()
            with emulated_step(torch.device("cpu", index), samples=5) as step:
                pass
            took.append(clock.perf_counter() - began)
            reported.append(step.seconds)
    # 5 samples of 10 ms of device work; device 1 stretches the whole (work included) by its slowdown of 2.
    assert took == pytest.approx([0.05, 0.1], abs=1e-12)
    # The device's own time: the nominal 50 ms of work (the empty step method takes no time here), times the slowdown.
    assert reported == pytest.approx([0.05, 0.1], abs=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "error", "message"),
    [
        ({"slowdown": 0.5}, ValueError, "`slowdown` must be >= 1.0 and finite, got 0.5"),
        ({"seconds_per_sample": -1.0}, ValueError, "`seconds_per_sample` must be >= 0.0 and finite, got -1.0"),
        ({"capacity_bytes": 0}, ValueError, "`capacity_bytes` must be >= 1, got 0"),
        ({"capacity_bytes": 1.5}, TypeError, "`capacity_bytes` must be an integer, got 1.5 of type float"),
    ],
)
def test_emulated_device_argument_errors(kwargs: dict[str, Any], error: type[Exception], message: str) -> None:
    with raises_exactly(error, message):
        EmulatedDevice(**kwargs)


def test_emulation_blocks_do_not_nest() -> None:
    with (
        emulate_devices([EmulatedDevice()]),
        raises_exactly(RuntimeError, "emulate_devices() blocks do not nest: another one is active"),
        emulate_devices([EmulatedDevice()]),
    ):
        pass
    with (
        raises_exactly(TypeError, "`devices[0]` must be an EmulatedDevice, got 2.0 of type float"),
        emulate_devices([2.0]),  # type: ignore[list-item]
    ):
        pass


# ---- on CUDA ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("devices", CUDA_DEVICE_LISTS)
def test_on_cuda_each_device_is_timed_and_its_memory_read_against_its_share_of_the_gpu(
    devices: list[torch.device],
) -> None:
    policy = _Recording(profile_steps=2)
    strategy = BalancedDataParallelStrategy(split=policy, parallel_devices=devices)
    trainer = quiet_trainer(strategy, gpu_ids(devices), accelerator="cuda", max_steps=4)
    trainer.fit(_Paced(), DataLoader(_data(120), batch_size=30))
    assert policy.replans == 1
    if devices[0] == devices[1]:
        # Replicas on one GPU are planned as that GPU: their CUDA events span each other's work, so timed one by one
        # they would be planned by which one's events closed first (issue #25).
        assert policy.shared_devices == [[0, 1]]
        assert policy.plan(30, 2) == [15, 15]
    else:
        assert policy.shared_devices == []
        _assert_within_one_sample(policy.plan(30, 2), [15, 15])  # the same model of GPU, the same speed
    shares = [torch.cuda.get_device_properties(d).total_memory // devices.count(d) for d in devices]
    assert policy._capacities == shares
    for _, peaks in policy.observed:
        assert peaks is not None and all(p is not None and 0 < p <= s for p, s in zip(peaks, shares, strict=True))
