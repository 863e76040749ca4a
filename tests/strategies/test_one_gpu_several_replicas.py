"""Several replicas or partitions on one GPU, the parts that run without one.

The ``parallel_devices`` argument of balanced_dp and gpipe: repeats kept, strings and an unindexed ``"cuda"``
resolved, mixed types refused where they cannot work, and Lightning keeping the user's list whatever ``devices=``
says. And the stream order of ``parallel_apply`` on CUDA, with torch's stream API replaced by a recorder: a stream per
replica (not per device), each waiting for the caller's stream before its replica runs, the caller's stream waiting for
every replica's after. The GPU tests (``CUDA_DEVICE_LISTS``) run the real thing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_balanced import BalancedDataParallelStrategy, GPipeStrategy
from lightning_balanced.data_parallel import parallel_apply
from lightning_balanced.strategies.single_process import parallel_devices_argument
from tests.helpers import quiet_trainer, raises_exactly
from tests.strategies.test_balanced_dp import Regressor

CUDA0 = torch.device("cuda", 0)
CPU = torch.device("cpu")


@pytest.mark.parametrize("strategy_class", [BalancedDataParallelStrategy, GPipeStrategy])
def test_a_repeated_gpu_gives_one_replica_or_partition_per_entry(strategy_class: type) -> None:
    strategy = strategy_class(parallel_devices=[CUDA0] * 2)
    assert strategy.parallel_devices == [CUDA0, CUDA0]
    assert strategy.root_device == CUDA0
    # Strings too, as torch.device takes them; a tuple becomes a list of its own.
    devices = ("cuda:0", "cuda:0", "cuda:0")
    assert strategy_class(parallel_devices=devices).parallel_devices == [CUDA0] * 3


def test_an_unindexed_cuda_device_is_the_current_gpu(monkeypatch: pytest.MonkeyPatch) -> None:
    # Lightning sets the root device with torch.cuda.set_device, which refuses a device without an index.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    got = parallel_devices_argument(["cuda", torch.device("cuda")], strategy="balanced_dp", one_type=True)
    assert got == [CUDA0, CUDA0]
    assert all(d.index == 0 for d in got or [])


def test_without_cuda_an_unindexed_cuda_device_is_left_for_lightning_to_refuse(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    got = parallel_devices_argument(["cuda"] * 2, strategy="gpipe", one_type=False)
    assert got == [torch.device("cuda")] * 2


def test_none_is_left_for_the_trainer_to_fill_in() -> None:
    assert parallel_devices_argument(None, strategy="balanced_dp", one_type=True) is None
    assert BalancedDataParallelStrategy().parallel_devices is None


def test_balanced_dp_refuses_gpus_mixed_with_the_host_and_gpipe_takes_them() -> None:
    with raises_exactly(
        ValueError,
        "`parallel_devices` mixes device types ['cuda', 'cpu'] (['cuda:0', 'cpu']): strategy='balanced_dp' runs its"
        " replicas on devices of one type. For several replicas on one GPU, repeat it: `[torch.device('cuda', 0)] * 2`",
    ):
        BalancedDataParallelStrategy(parallel_devices=[CUDA0, CPU])
    # gpipe may keep a partition in host memory.
    assert GPipeStrategy(parallel_devices=[CUDA0, CPU]).parallel_devices == [CUDA0, CPU]


def test_parallel_devices_that_are_not_a_list_of_devices_are_refused() -> None:
    with raises_exactly(
        TypeError,
        "`parallel_devices` must be a list of torch.device (one per replica, repeats allowed), got device(type='cuda',"
        " index=0)",
    ):
        BalancedDataParallelStrategy(parallel_devices=CUDA0)  # type: ignore[arg-type]
    with raises_exactly(
        TypeError, "`parallel_devices` must be a list of torch.device (one per partition, repeats allowed), got [0, 0]"
    ):
        GPipeStrategy(parallel_devices=[0, 0])  # type: ignore[list-item]
    with raises_exactly(ValueError, "`parallel_devices` must name at least one device for strategy='gpipe', got []"):
        GPipeStrategy(parallel_devices=[])
    with pytest.raises(ValueError, match=r"^`parallel_devices` \['gpu0'\] holds a string that is not a device: "):
        BalancedDataParallelStrategy(parallel_devices=["gpu0"])


class _ChunkRecorder(Regressor):
    """Records the size of the chunk each replica's training step got (replicas share the root's list)."""

    def __init__(self) -> None:
        super().__init__()
        self.chunks: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.chunks.append(len(batch[0]))
        return super().training_step(batch, batch_idx)


def test_lightning_keeps_the_strategys_devices_whatever_devices_says() -> None:
    # The connector keeps a strategy's own parallel_devices: devices=1 with three replicas runs three replicas (on CPU
    # here; on a GPU, `[cuda:0] * 3` with accelerator="cuda", devices=1 goes the same way).
    strategy = BalancedDataParallelStrategy(chunk_sizes=[1, 2, 3], parallel_devices=[CPU] * 3)
    trainer = quiet_trainer(strategy, 1, max_steps=1)
    assert trainer.num_devices == 3 and trainer.strategy is strategy
    model = _ChunkRecorder()
    data = TensorDataset(torch.randn(6, 5, dtype=torch.float64), torch.randn(6, 3, dtype=torch.float64))
    trainer.fit(model, DataLoader(data, batch_size=6))
    assert sorted(model.chunks) == [1, 2, 3]


# --- the stream order of parallel_apply on CUDA, recorded ---------------------------------------------------------


class _RecordedStream:
    """Stands in for ``torch.cuda.Stream``: a name, a device, and its waits written to a shared log."""

    def __init__(self, name: str, device: torch.device, log: list[tuple[str, ...]]) -> None:
        self.name, self.device, self._log = name, device, log

    def wait_stream(self, other: _RecordedStream) -> None:
        self._log.append(("wait", self.name, other.name))


class _StreamRecorder:
    """``torch.cuda.current_stream``/``stream``/``device`` for one fake GPU: a current stream per thread."""

    def __init__(self) -> None:
        self.log: list[tuple[str, ...]] = []
        self.lock = threading.Lock()
        self.main = _RecordedStream("main", CUDA0, self.log)
        self._current = threading.local()

    def current_stream(self, device: Any = None) -> _RecordedStream:
        return getattr(self._current, "stream", self.main)  # type: ignore[no-any-return]

    @contextmanager
    def stream(self, stream: _RecordedStream) -> Iterator[None]:
        previous = self.current_stream()
        self._current.stream = stream
        try:
            yield
        finally:
            self._current.stream = previous

    @contextmanager
    def device(self, device: torch.device) -> Iterator[None]:
        yield


class _Replica(nn.Module):
    def __init__(self, index: int, recorder: _StreamRecorder) -> None:
        super().__init__()
        self.index, self.recorder = index, recorder

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        with self.recorder.lock:
            self.recorder.log.append(("run", str(self.index), torch.cuda.current_stream(CUDA0).name))
        return x * 2


@pytest.fixture
def recorder(monkeypatch: pytest.MonkeyPatch) -> _StreamRecorder:
    recorder = _StreamRecorder()
    monkeypatch.setattr(torch.cuda, "current_stream", recorder.current_stream)
    monkeypatch.setattr(torch.cuda, "stream", recorder.stream)
    monkeypatch.setattr(torch.cuda, "device", recorder.device)
    return recorder


def test_replicas_sharing_a_gpu_each_run_on_their_own_stream_between_two_waits(recorder: _StreamRecorder) -> None:
    devices = [CUDA0] * 3
    streams = [_RecordedStream(f"replica{i}", CUDA0, recorder.log) for i in range(3)]
    replicas = [_Replica(i, recorder) for i in range(3)]
    inputs = [(torch.full((2,), float(i)),) for i in range(3)]
    outputs = parallel_apply(replicas, inputs, [{}] * 3, devices, streams=streams)  # type: ignore[arg-type]
    assert [out.tolist() for out in outputs] == [[0.0, 0.0], [2.0, 2.0], [4.0, 4.0]]
    runs = [entry for entry in recorder.log if entry[0] == "run"]
    # Each replica on its own stream, though all three share cuda:0.
    assert sorted(runs) == [("run", "0", "replica0"), ("run", "1", "replica1"), ("run", "2", "replica2")]
    first_run = min(recorder.log.index(run) for run in runs)
    last_run = max(recorder.log.index(run) for run in runs)
    # Before any replica runs, its stream waits for what the caller queued (the scatter, the replication) ...
    assert sorted(recorder.log[:first_run]) == [("wait", f"replica{i}", "main") for i in range(3)]
    # ... and after all ran, the caller's stream waits for every replica's (the gather reads their outputs).
    assert sorted(recorder.log[last_run + 1 :]) == [("wait", "main", f"replica{i}") for i in range(3)]
    assert torch.cuda.current_stream(CUDA0) is recorder.main  # the caller's stream is current again


def test_replica_streams_must_be_on_their_replicas_devices(recorder: _StreamRecorder) -> None:
    streams = [_RecordedStream("a", CUDA0, recorder.log), _RecordedStream("b", torch.device("cuda", 1), recorder.log)]
    with raises_exactly(
        ValueError,
        "`streams` must hold one CUDA stream per replica, on its device ['cuda:0', 'cuda:0'], got ['cuda:0', 'cuda:1']",
    ):
        parallel_apply(
            [_Replica(0, recorder), _Replica(1, recorder)],
            [(torch.ones(1),), (torch.ones(1),)],
            [{}, {}],
            [CUDA0, CUDA0],
            streams=streams,  # type: ignore[arg-type]
        )
    assert recorder.log == []  # refused before anything was queued
