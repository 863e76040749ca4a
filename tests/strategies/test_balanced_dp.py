"""balanced_dp through Lightning's Trainer, on the CPU emulation (and on CUDA where GPUs exist)."""

from __future__ import annotations

import copy
import logging
import threading
from collections import namedtuple
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torchmetrics
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, Dataset, TensorDataset

import lightning_balanced
from lightning_balanced import BalancedDataParallelStrategy
from tests.helpers import CUDA_DEVICE_LISTS, gpu_ids, quiet_trainer

# float64 everywhere the step is compared with a single-device step: the only differences are the summation order of
# the per-chunk losses and of the gradient contributions, ~1e-16 relative, so 1e-10 has a wide margin yet would catch
# an unweighted mean (off by a factor of order chunk_size / batch_size).
EXACT = {"rtol": 0, "atol": 1e-10}


def _trainer(strategy: Any = "balanced_dp", devices: int = 3, **kwargs: Any) -> pl.Trainer:
    return quiet_trainer(strategy, devices, **kwargs)


class Regressor(pl.LightningModule):
    """A float64 MLP whose SGD step can be compared exactly with a single-device step."""

    def __init__(self, batchnorm: bool = False, manual: bool = False, lr: float = 0.5) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers: list[nn.Module] = [nn.Linear(5, 7)]
        if batchnorm:
            layers.append(nn.BatchNorm1d(7))
        layers += [nn.Tanh(), nn.Linear(7, 3)]
        self.net = nn.Sequential(*layers).double()
        self.lr = lr
        self.automatic_optimization = not manual
        self.logged_from: list[str] = []
        self.train_outputs: list[dict[str, torch.Tensor]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def log(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:  # type: ignore[override]
        self.logged_from.append(threading.current_thread().name)
        super().log(name, value, *args, **kwargs)

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        pred = self(x)
        loss = F.mse_loss(pred, y)
        self.log("train_loss", loss)
        if not self.automatic_optimization:
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(loss)
            opt.step()
        return {"loss": loss, "pred": pred.detach(), "x": x}

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.train_outputs.append(outputs)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", F.mse_loss(self(x), y))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        self.log("test_loss", F.mse_loss(self(x), y))

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def _data(n: int = 24, seed: int = 1) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randn(n, 3, generator=g, dtype=torch.float64)
    )


def _single_device_step(model: Regressor, dataset: TensorDataset, batch_size: int) -> dict[str, torch.Tensor]:
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(reference.parameters(), lr=reference.lr)
    x, y = dataset[:batch_size]
    F.mse_loss(reference(x), y).backward()
    opt.step()
    return {k: v.detach() for k, v in reference.state_dict().items()}


def test_strategy_name_is_registered_on_import() -> None:
    assert "balanced_dp" in StrategyRegistry
    assert "balanced_dp" in lightning_balanced.register_strategies()  # idempotent: a second call does not raise
    trainer = _trainer(devices=2)
    assert isinstance(trainer.strategy, BalancedDataParallelStrategy)
    assert trainer.world_size == 1
    assert trainer.num_devices == 2


@pytest.mark.parametrize(
    ("strategy_kwargs", "devices"),
    [
        ({"chunk_sizes": [2, 9, 5]}, 3),
        ({"gpu0_bsz": 1}, 4),
        ({"weights": [1.0, 3.0]}, 2),
        ({"gpu0_bsz": 0}, 3),
        ({"chunk_sizes": [16]}, 1),
    ],
)
@pytest.mark.parametrize("manual", [False, True], ids=["automatic", "manual"])
def test_uneven_chunks_match_single_device_step(strategy_kwargs: dict[str, Any], devices: int, manual: bool) -> None:
    dataset = _data(16)
    model = Regressor(manual=manual)
    expected = _single_device_step(model, dataset, batch_size=16)
    trainer = _trainer(BalancedDataParallelStrategy(**strategy_kwargs), devices=devices, max_steps=1)
    trainer.fit(model, DataLoader(dataset, batch_size=16))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[name], **EXACT)


def test_sum_loss_reduction_matches_single_device_sum_loss() -> None:
    class SumLoss(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            x, y = batch
            return F.mse_loss(self(x), y, reduction="sum")

    dataset = _data(12)
    model = SumLoss(lr=0.01)
    reference = copy.deepcopy(model)
    F.mse_loss(reference(dataset[:12][0]), dataset[:12][1], reduction="sum").backward()
    torch.optim.SGD(reference.parameters(), lr=0.01).step()
    trainer = _trainer(BalancedDataParallelStrategy(chunk_sizes=[3, 4, 5], loss_reduction="sum"), max_steps=1)
    trainer.fit(model, DataLoader(dataset, batch_size=12))
    for (name, value), expected in zip(model.state_dict().items(), reference.state_dict().values(), strict=True):
        torch.testing.assert_close(value, expected, **EXACT, msg=name)


def test_step_outputs_are_gathered_in_batch_order() -> None:
    dataset = _data(15)
    model = Regressor(lr=0.0)  # no update, so every batch sees the same weights
    trainer = _trainer(BalancedDataParallelStrategy(gpu0_bsz=2), max_epochs=1)
    trainer.fit(model, DataLoader(dataset, batch_size=6))  # batches of 6, 6 and a short 3
    xs, _ = dataset[:]
    assert [len(o["x"]) for o in model.train_outputs] == [6, 6, 3]
    torch.testing.assert_close(torch.cat([o["x"] for o in model.train_outputs]), xs, rtol=0, atol=0)
    torch.testing.assert_close(torch.cat([o["pred"] for o in model.train_outputs]), model(xs).detach(), **EXACT)
    for output in model.train_outputs:
        assert output["loss"].dim() == 0


def test_log_is_the_chunk_weighted_mean_logged_once_from_the_main_thread() -> None:
    dataset = _data(10)
    model = Regressor(lr=0.0)
    trainer = _trainer(BalancedDataParallelStrategy(chunk_sizes=[1, 2, 7]), max_steps=1)
    trainer.fit(model, DataLoader(dataset, batch_size=10))
    x, y = dataset[:]
    full_batch_loss = F.mse_loss(model(x), y).detach()
    torch.testing.assert_close(trainer.callback_metrics["train_loss"].double(), full_batch_loss, rtol=1e-6, atol=0)
    assert model.logged_from == [threading.main_thread().name]


def test_validate_test_and_predict_equal_single_device() -> None:
    dataset = _data(13)
    model = Regressor()
    loader = DataLoader(dataset, batch_size=13)
    single = _trainer("auto", devices=1)
    balanced = _trainer(BalancedDataParallelStrategy(weights=[2, 1, 1]))
    for stage in ("validate", "test"):
        expected = getattr(single, stage)(model, loader, verbose=False)[0]
        got = getattr(balanced, stage)(model, loader, verbose=False)[0]
        assert got.keys() == expected.keys()
        for key in expected:
            assert got[key] == pytest.approx(expected[key], rel=1e-6)
    predictions = balanced.predict(model, DataLoader(dataset, batch_size=5))
    assert predictions is not None
    torch.testing.assert_close(torch.cat(predictions), model(dataset[:][0]).detach(), **EXACT)  # type: ignore[arg-type]


Pair = namedtuple("Pair", ["inputs", "targets"])


class _StructuredData(Dataset):
    def __init__(self, n: int, kind: str) -> None:
        self.data = _data(n)
        self.kind = kind

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> Any:
        x, y = self.data[i]
        if self.kind == "dict":
            return {"inputs": x, "targets": y, "name": "constant"}
        return Pair(x, y)


@pytest.mark.parametrize("kind", ["dict", "namedtuple"])
def test_dict_and_namedtuple_batches_are_split(kind: str) -> None:
    class Structured(Regressor):
        def training_step(self, batch: Any, batch_idx: int) -> Any:
            inputs = batch["inputs"] if kind == "dict" else batch.inputs
            targets = batch["targets"] if kind == "dict" else batch.targets
            if kind == "dict":  # non-tensor leaves are given whole to every replica, as torch's scatter does
                assert batch["name"] == ["constant"] * 9
            return F.mse_loss(self(inputs), targets)

    dataset = _StructuredData(9, kind)
    model = Structured()
    expected = _single_device_step(model, dataset.data, batch_size=9)
    _trainer(BalancedDataParallelStrategy(chunk_sizes=[2, 3, 4]), max_steps=1).fit(
        model, DataLoader(dataset, batch_size=9)
    )
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[name], **EXACT)


def test_batch_smaller_than_device_count_runs_one_replica_per_chunk() -> None:
    dataset = _data(2)
    model = Regressor()
    expected = _single_device_step(model, dataset, batch_size=2)
    _trainer(devices=4, max_steps=1).fit(model, DataLoader(dataset, batch_size=2))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value, expected[name], **EXACT)


def test_checkpoint_holds_plain_module_state_both_ways(tmp_path: Any) -> None:
    dataset = _data(12)
    loader = DataLoader(dataset, batch_size=6)
    model = Regressor()
    balanced = _trainer(BalancedDataParallelStrategy(gpu0_bsz=1), max_epochs=1)
    balanced.fit(model, loader)
    path = tmp_path / "balanced.ckpt"
    balanced.save_checkpoint(path)
    state = torch.load(path, weights_only=False)["state_dict"]
    assert set(state) == set(Regressor().state_dict())  # no wrapper prefix

    restored = Regressor.load_from_checkpoint(path)
    for name, value in model.state_dict().items():
        torch.testing.assert_close(restored.state_dict()[name], value, rtol=0, atol=0)

    # plain single-device checkpoint resumed under balanced_dp, and the reverse
    single = _trainer("auto", devices=1, max_epochs=1)
    single.fit(Regressor(), loader)
    single_path = tmp_path / "single.ckpt"
    single.save_checkpoint(single_path)
    resumed = Regressor()
    _trainer(BalancedDataParallelStrategy(gpu0_bsz=1), max_epochs=2).fit(resumed, loader, ckpt_path=single_path)
    continued = Regressor()
    _trainer("auto", devices=1, max_epochs=2).fit(continued, loader, ckpt_path=path)
    assert resumed.trainer.global_step == continued.trainer.global_step == 4


def test_chunk_of_one_with_batchnorm_names_the_split_setting() -> None:
    model = Regressor(batchnorm=True)
    trainer = _trainer(BalancedDataParallelStrategy(gpu0_bsz=1), max_steps=1)
    with pytest.raises(ValueError, match=r"gpu0_bsz=1.*drop_last") as info:
        trainer.fit(model, DataLoader(_data(9), batch_size=9))
    assert "Expected more than 1 value per channel" in str(info.value.__cause__)


def test_batchnorm_keeps_replica_zero_running_stats() -> None:
    dataset = _data(12)
    model = Regressor(batchnorm=True, lr=0.0)
    bn = model.net[1]
    expected = copy.deepcopy(bn)
    with torch.no_grad():
        expected(model.net[0](dataset[:4][0]))  # replica 0's chunk: the first 4 samples
    _trainer(BalancedDataParallelStrategy(chunk_sizes=[4, 4, 4]), max_steps=1).fit(
        model, DataLoader(dataset, batch_size=12)
    )
    torch.testing.assert_close(bn.running_mean, expected.running_mean, **EXACT)
    torch.testing.assert_close(bn.running_var, expected.running_var, **EXACT)
    assert int(bn.num_batches_tracked) == 1


def test_mixed_precision_is_re_entered_in_each_replica() -> None:
    seen: list[tuple[bool, torch.dtype]] = []

    class Probe(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = nn.Linear(4, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            seen.append((torch.is_autocast_enabled("cpu"), torch.get_autocast_dtype("cpu")))
            out = self.layer(batch[0])
            assert out.dtype == torch.bfloat16
            return out.float().mean()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    dataset = TensorDataset(torch.randn(8, 4))
    _trainer(devices=2, precision="bf16-mixed", max_steps=1).fit(Probe(), DataLoader(dataset, batch_size=8))
    assert seen == [(True, torch.bfloat16)] * 2


def test_torchmetrics_metric_updated_in_replicas_sees_every_sample() -> None:
    class Classifier(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer = nn.Linear(5, 4)
            self.accuracy = torchmetrics.classification.MulticlassAccuracy(num_classes=4, average="micro")

        def validation_step(self, batch: Any, batch_idx: int) -> None:
            x, y = batch
            self.accuracy(self.layer(x), y)
            self.log("val_acc", self.accuracy)

    g = torch.Generator().manual_seed(3)
    dataset = TensorDataset(torch.randn(37, 5, generator=g), torch.randint(0, 4, (37,), generator=g))
    model = Classifier()
    x, y = dataset[:]
    expected = (model.layer(x).argmax(1) == y).float().mean().item()
    result = _trainer(BalancedDataParallelStrategy(gpu0_bsz=2)).validate(
        model, DataLoader(dataset, batch_size=8), verbose=False
    )
    assert result[0]["val_acc"] == pytest.approx(expected, abs=1e-7)


def test_plan_is_reported_once_at_fit_start(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        _trainer(BalancedDataParallelStrategy(gpu0_bsz=1), max_epochs=2).fit(
            Regressor(), DataLoader(_data(12), batch_size=6)
        )
    reports = [r.getMessage() for r in caplog.records if "balanced_dp: a batch of" in r.getMessage()]
    assert len(reports) == 1
    assert reports[0].splitlines() == [  # the summary and one line per device, each by its virtual device's name
        "balanced_dp: a batch of 6 samples is split over 3 devices as [1, 3, 2]",
        "  device 0 (cpu:0): 1 sample (16.7%)",
        "  device 1 (cpu:1): 3 samples (50.0%)",
        "  device 2 (cpu:2): 2 samples (33.3%)",
    ]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"gpu0_bsz": 2, "weights": [1, 1]}, "at most one of"),
        ({"gpu0_bsz": -1}, "gpu0_bsz"),
        ({"chunk_sizes": [2, -1]}, r"chunk_sizes\[1\]"),
        ({"weights": [1.0, 0.0]}, r"weights\[1\]"),
        ({"loss_reduction": "median"}, "loss_reduction"),
    ],
)
def test_bad_arguments_raise_value_error_naming_them(kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        BalancedDataParallelStrategy(**kwargs)


def test_setup_rejects_a_plan_for_another_device_count() -> None:
    loader = DataLoader(_data(6), batch_size=6)
    with pytest.raises(ValueError, match=r"chunk_sizes.*one entry per device \(3\)"):
        _trainer(BalancedDataParallelStrategy(chunk_sizes=[3, 3]), max_steps=1).fit(Regressor(), loader)


class _ChunkRecorder(Regressor):
    """Records the chunk size every replica ran on, per loop."""

    lock = threading.Lock()

    def __init__(self) -> None:
        super().__init__(lr=0.0)
        self.chunks: dict[str, list[int]] = {"fit": [], "validate": [], "test": [], "predict": []}

    def _record(self, loop: str, batch: Any) -> None:
        with self.lock:
            self.chunks[loop].append(len(batch[0]))

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self._record("fit", batch)
        return super().training_step(batch, batch_idx)

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self._record("validate", batch)

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self._record("test", batch)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self._record("predict", batch)
        return self(batch[0])


@pytest.mark.parametrize(
    ("strategy_kwargs", "expected"),
    [
        ({"gpu0_bsz": 8}, [2, 2, 2]),  # a budget above the batch is a budget, not an error
        ({"gpu0_bsz": 0}, [3, 3]),
        ({"chunk_sizes": [1, 2, 9]}, [1, 1, 4]),  # another batch size: the same proportions
        ({"weights": [1.0, 1.0, 4.0]}, [1, 1, 4]),
    ],
)
def test_the_split_is_the_same_in_all_four_loops(strategy_kwargs: dict[str, Any], expected: list[int]) -> None:
    loader = DataLoader(_data(6), batch_size=6)
    model = _ChunkRecorder()
    trainer = _trainer(BalancedDataParallelStrategy(**strategy_kwargs), max_steps=1)
    trainer.fit(model, loader)
    trainer.validate(model, loader, verbose=False)
    trainer.test(model, loader, verbose=False)
    trainer.predict(model, loader)
    assert lightning_balanced.plan_chunk_sizes(6, 3, **strategy_kwargs) == [*([0] * (3 - len(expected))), *expected]
    for loop, chunks in model.chunks.items():
        assert sorted(chunks) == sorted(expected), loop


@pytest.mark.parametrize(
    "options", [{}, {"gpu0_bsz": 3}, {"gpu0_bsz": 0}, {"chunk_sizes": [2, 4, 6]}, {"weights": [0.5, 2.0, 1.0]}]
)
def test_the_strategy_plans_with_the_public_planner(options: dict[str, Any]) -> None:
    strategy = BalancedDataParallelStrategy(**options)
    strategy.parallel_devices = [torch.device("cpu")] * 3
    for batch_size in range(30):
        assert strategy.plan(batch_size) == lightning_balanced.plan_chunk_sizes(batch_size, 3, **options)
    if "chunk_sizes" in options:
        assert strategy.plan(12) == [2, 4, 6]
        assert strategy.plan(6) == [1, 2, 3]


@pytest.mark.parametrize("devices", CUDA_DEVICE_LISTS)
def test_uneven_chunks_match_single_device_step_on_cuda(devices: list[torch.device]) -> None:
    dataset = _data(16)
    model = Regressor()
    expected = _single_device_step(model, dataset, batch_size=16)
    strategy = BalancedDataParallelStrategy(chunk_sizes=[3, 13], parallel_devices=devices)
    trainer = _trainer(strategy, devices=gpu_ids(devices), accelerator="cuda", max_steps=1)
    trainer.fit(model, DataLoader(dataset, batch_size=16))
    for name, value in model.state_dict().items():
        torch.testing.assert_close(value.cpu(), expected[name], **EXACT)


@pytest.mark.parametrize("devices", CUDA_DEVICE_LISTS)
def test_cuda_mixed_precision_and_memory_report(devices: list[torch.device], caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        strategy = BalancedDataParallelStrategy(gpu0_bsz=2, parallel_devices=devices)
        trainer = _trainer(strategy, devices=gpu_ids(devices), accelerator="cuda", max_steps=4, precision="16-mixed")
        float_data = TensorDataset(*(t.float() for t in _data(32).tensors))
        trainer.fit(Regressor().float(), DataLoader(float_data, batch_size=8))
    report = next(r.getMessage() for r in caplog.records if "peak GPU memory" in r.getMessage())
    # Replicas on one GPU are reported as sharing it (one peak for both), not as two devices.
    assert ("(shared by devices [0, 1])" in report) == (devices[0] == devices[1])


class _DivergentManual(Regressor):
    """Manual optimization where only replicas with more than 3 samples call the optimizer, or replica 1 fails."""

    def __init__(self, failure: str) -> None:
        super().__init__(manual=True)
        self.failure = failure

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        if self.failure == "raise" and len(x) == 2:
            raise KeyError("replica with 2 samples fails")
        loss = F.mse_loss(self(x), y)
        if len(x) > 3:
            self.manual_backward(loss)
        return loss


@pytest.mark.parametrize("failure", ["diverge", "raise"])
@pytest.mark.slow
def test_manual_optimization_never_hangs_when_replicas_diverge(failure: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import lightning_balanced.data_parallel.runner as runner_module

    monkeypatch.setattr(runner_module, "REPLICA_TIMEOUT_S", 2.0)
    trainer = _trainer(BalancedDataParallelStrategy(chunk_sizes=[4, 2, 4]), max_steps=1)
    expected = r"waited 2s \(the timeout\) at `manual_backward` for replicas \[1\]" if failure == "diverge" else "fails"
    with pytest.raises((RuntimeError, KeyError), match=expected) as info:
        trainer.fit(_DivergentManual(failure), DataLoader(_data(10), batch_size=10))
    if failure == "raise":  # released at once, with the failing replica's error as the cause
        error = info.value if isinstance(info.value, KeyError) else info.value.__cause__
        assert isinstance(error, KeyError)


class _NormalizesOnTheDevice(Regressor):
    """GPU augmentation in Lightning's batch hook: the batch must already be on the root device there."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("mean", torch.full((5,), 0.5, dtype=torch.float64))
        self.hook_devices: list[torch.device] = []

    def on_after_batch_transfer(self, batch: Any, dataloader_idx: int) -> Any:
        x, y = batch
        self.hook_devices.append(x.device)
        return x - self.mean, y


@pytest.mark.parametrize("devices", CUDA_DEVICE_LISTS)
def test_batch_hooks_see_the_batch_on_the_root_device_on_cuda(devices: list[torch.device]) -> None:
    model = _NormalizesOnTheDevice()
    strategy = BalancedDataParallelStrategy(chunk_sizes=[3, 5], parallel_devices=devices)
    _trainer(strategy, devices=gpu_ids(devices), accelerator="cuda", max_steps=2).fit(
        model, DataLoader(_data(16), batch_size=8)
    )
    assert model.hook_devices == [devices[0]] * 2


def test_one_device_warns_that_nothing_runs_in_parallel() -> None:
    dataset = _data(8)
    with pytest.warns(UserWarning, match=r"^balanced_dp runs on 1 device: nothing runs in parallel\. Give it several"):
        _trainer(devices=1, max_steps=1).fit(Regressor(), DataLoader(dataset, batch_size=8))
