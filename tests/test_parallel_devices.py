"""The ``parallel_devices`` argument of balanced_dp and gpipe: repeats kept (several replicas or partitions on one GPU),
strings and an unindexed ``"cuda"`` resolved, mixed types refused where they cannot work; and Lightning keeping the
user's list whatever ``devices=`` says."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_balanced import BalancedDataParallelStrategy, GPipeStrategy
from lightning_balanced.strategies.single_process import parallel_devices_argument
from tests.helpers import quiet_trainer, raises_exactly
from tests.test_balanced_dp import Regressor

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
