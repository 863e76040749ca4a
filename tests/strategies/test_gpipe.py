"""strategy="gpipe" through Lightning's Trainer on CPU devices: exact against the unpipelined run; errors."""

from __future__ import annotations

import logging
from collections import Counter
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import StrategyRegistry
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from lightning_balanced import GPipeStrategy
from lightning_balanced.gpipe import Pipe
from lightning_balanced.pipeline import DeferredBatchNorm
from tests.helpers import CUDA_DEVICE_LISTS, RunIf, gpu_ids, quiet_trainer, raises_exactly, whole_message

MODES = ["always", "except_last", "never"]


def layers(batchnorm: bool = False) -> nn.Sequential:
    torch.manual_seed(0)
    norm: nn.Module = nn.BatchNorm1d(16) if batchnorm else nn.Identity()
    return nn.Sequential(nn.Linear(5, 16), nn.Tanh(), norm, nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 3))


class SequentialModel(pl.LightningModule):
    def __init__(self, batchnorm: bool = False, manual: bool = False, lr: float = 0.1) -> None:
        super().__init__()
        self.sequential_module = layers(batchnorm)
        self.scale = nn.Parameter(torch.ones(()))  # outside the Sequential: lives on the root device
        self.automatic_optimization = not manual
        self.lr = lr
        self.output_dtypes: list[torch.dtype] = []

    def forward(self, x: Tensor) -> Tensor:
        out = self.sequential_module(x)
        self.output_dtypes.append(out.dtype)
        return out * self.scale

    def training_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor | None:
        x, y = batch
        loss = nn.functional.mse_loss(self(x).to(y.dtype), y)
        self.log("train_loss", loss)
        if self.automatic_optimization:
            return loss
        optimizer = self.optimizers()
        assert isinstance(optimizer, pl.core.optimizer.LightningOptimizer)
        optimizer.zero_grad()
        self.manual_backward(loss)
        self.clip_gradients(optimizer, gradient_clip_val=0.5, gradient_clip_algorithm="norm")
        optimizer.step()
        return None

    def validation_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> None:
        x, y = batch
        self.log("val_loss", nn.functional.mse_loss(self(x).to(y.dtype), y), batch_size=len(x))

    def predict_step(self, batch: tuple[Tensor, Tensor], batch_idx: int) -> Tensor:
        return self(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=self.lr)


def data(n: int = 27, batch_size: int = 9, dtype: torch.dtype = torch.float64) -> DataLoader:
    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, 5, generator=generator, dtype=dtype), torch.randn(n, 3, generator=generator, dtype=dtype)
    return DataLoader(TensorDataset(x, y), batch_size=batch_size)


class RecordStates(Callback):
    def __init__(self) -> None:
        self.states: list[dict[str, Tensor]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self.states.append({k: v.detach().clone() for k, v in module.state_dict().items()})


def fit(strategy: Any, devices: int = 2, model: SequentialModel | None = None, **kwargs: Any) -> RecordStates:
    record = RecordStates()
    model = model or SequentialModel()
    settings: dict[str, Any] = {"precision": "64-true", "max_steps": 2, "callbacks": [record]}
    ckpt_path = kwargs.pop("ckpt_path", None)
    settings.update(kwargs)
    quiet_trainer(strategy=strategy, devices=devices, **settings).fit(model, data(), ckpt_path=ckpt_path)
    return record


def assert_same_states(actual: list[dict[str, Tensor]], expected: list[dict[str, Tensor]], atol: float) -> None:
    assert len(actual) == len(expected) > 0
    for a, e in zip(actual, expected, strict=True):
        assert a.keys() == e.keys()
        for key in e:
            torch.testing.assert_close(a[key], e[key], rtol=0, atol=atol, msg=key)


@pytest.fixture(scope="module")
def single_device_steps() -> list[dict[str, Tensor]]:
    return fit("auto", devices=1).states


@pytest.mark.parametrize("chunks", [1, 2, 4, 7])
@pytest.mark.parametrize("checkpoint", MODES)
def test_one_and_two_steps_equal_the_unpipelined_model(
    chunks: int, checkpoint: str, single_device_steps: list[dict[str, Tensor]]
) -> None:
    # float64, no dropout; a batch of 9 that 2, 4 and 7 do not divide. Only the summation order of the weight
    # gradients over the batch differs from one device, so 1e-10 holds with a wide margin (measured ~1e-16).
    record = fit(GPipeStrategy(balance=[2, 1, 3], chunks=chunks, checkpoint=checkpoint), devices=3)
    assert_same_states(record.states, single_device_steps, atol=1e-10)


def test_manual_optimization_with_clipping_equals_the_unpipelined_model() -> None:
    expected = fit("auto", devices=1, model=SequentialModel(manual=True), max_steps=3).states
    actual = fit(GPipeStrategy(chunks=3), model=SequentialModel(manual=True), max_steps=3).states
    assert_same_states(actual, expected, atol=1e-10)


def test_gradient_accumulation_and_clipping_equal_the_unpipelined_model() -> None:
    kwargs = {"accumulate_grad_batches": 2, "gradient_clip_val": 0.3, "max_steps": 2}
    expected = fit("auto", devices=1, **kwargs).states
    actual = fit(GPipeStrategy(chunks=4, checkpoint="always"), **kwargs).states
    assert_same_states(actual, expected, atol=1e-10)


def test_validate_test_and_predict_equal_the_unpipelined_model() -> None:
    model = SequentialModel()
    expected_val = quiet_trainer(precision="64-true").validate(model, data(), verbose=False)
    expected_pred = torch.cat(quiet_trainer(precision="64-true").predict(model, data()))  # type: ignore[arg-type]
    trainer = quiet_trainer(strategy=GPipeStrategy(chunks=4), devices=2, precision="64-true")
    val = trainer.validate(model, data(), verbose=False)
    pred = trainer.predict(model, data())
    assert isinstance(model.sequential_module, nn.Sequential) and not isinstance(model.sequential_module, Pipe)
    assert val[0]["val_loss"] == pytest.approx(expected_val[0]["val_loss"], abs=1e-12)
    assert pred is not None
    predictions = torch.cat(pred)  # type: ignore[arg-type]
    assert not predictions.requires_grad  # predict ran under inference mode, on the partition threads too
    torch.testing.assert_close(predictions, expected_pred, rtol=0, atol=1e-12)


def test_bf16_mixed_output_dtype_and_training() -> None:
    model = SequentialModel()
    trainer = quiet_trainer(strategy=GPipeStrategy(chunks=3), devices=2, precision="bf16-mixed", max_steps=2)
    trainer.fit(model, data(dtype=torch.float32))
    assert model.output_dtypes and set(model.output_dtypes) == {torch.bfloat16}
    assert all(p.dtype == torch.float32 for p in model.parameters())


def test_the_strategy_wraps_the_sequential_and_puts_it_back() -> None:
    model = SequentialModel(batchnorm=True)
    original = model.sequential_module
    seen: dict[str, Any] = {}

    class Inspect(Callback):
        def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
            pipe = module.sequential_module
            seen.update(pipe=pipe, balance=pipe.balance, bn=type(pipe[2]), keys=list(module.state_dict()))

    fit(GPipeStrategy(balance=[3, 3], chunks=3), model=model, callbacks=[Inspect()], max_steps=1)
    assert isinstance(seen["pipe"], Pipe) and seen["balance"] == [3, 3] and seen["bn"] is DeferredBatchNorm
    assert model.sequential_module is original and type(original[2]) is nn.BatchNorm1d
    assert seen["keys"] == list(model.state_dict())  # the plain layout while training, too
    assert int(original[2].num_batches_tracked) == 1  # one update per batch, not per micro-batch


def test_registered_as_gpipe() -> None:
    assert "gpipe" in StrategyRegistry
    trainer = quiet_trainer(strategy="gpipe", devices=2, precision="64-true", max_steps=1)
    trainer.fit(SequentialModel(), data())
    assert isinstance(trainer.strategy, GPipeStrategy) and trainer.strategy.world_size == 1


# ---- checkpoints ---------------------------------------------------------------------------------------------------
def test_checkpoints_load_across_balances_and_into_the_plain_model(tmp_path: Path) -> None:
    one_epoch = {"precision": "64-true", "max_steps": -1, "max_epochs": 1}  # 3 steps; end-of-epoch checkpoints
    path = tmp_path / "gpipe.ckpt"
    trainer = quiet_trainer(strategy=GPipeStrategy(balance=[3, 3], chunks=2), devices=2, **one_epoch)
    trainer.fit(SequentialModel(), data())
    trainer.save_checkpoint(path)
    checkpoint = torch.load(path, weights_only=False)
    plain = SequentialModel()
    plain.load_state_dict(checkpoint["state_dict"])  # strict: the keys of the plain nn.Sequential
    assert list(checkpoint["state_dict"]) == list(plain.state_dict())

    # Resumed with another balance, the run continues exactly as the unpipelined model resumed from the same file
    # (optimizer state included; the tolerance is that of the steps, see above).
    two_epochs: dict[str, Any] = {"max_steps": -1, "max_epochs": 2}
    expected = fit("auto", devices=1, ckpt_path=str(path), **two_epochs).states
    resumed = fit(GPipeStrategy(balance=[1, 5], chunks=3), ckpt_path=str(path), **two_epochs).states
    assert len(resumed) == 3
    assert_same_states(resumed, expected, atol=1e-10)

    # And the reverse: a single-device checkpoint resumed under gpipe.
    single = tmp_path / "single.ckpt"
    trainer = quiet_trainer(**one_epoch)
    trainer.fit(SequentialModel(), data())
    trainer.save_checkpoint(single)
    expected = fit("auto", devices=1, ckpt_path=str(single), **two_epochs).states
    resumed = fit(GPipeStrategy(balance=[4, 2], chunks=2), ckpt_path=str(single), **two_epochs).states
    assert_same_states(resumed, expected, atol=1e-10)


# ---- balance ---------------------------------------------------------------------------------------------------------
def gpipe_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [line for r in caplog.records for line in r.getMessage().splitlines() if "gpipe" in r.getMessage()]


@pytest.mark.parametrize(("balance", "method"), [("auto", "(time)"), ("parameters", "(parameters)"), (None, "even")])
def test_balance_is_reported_once_one_line_per_partition(
    balance: Any, method: str, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        fit(GPipeStrategy(balance=balance, chunks=2), devices=3, max_steps=3)
    lines = gpipe_lines(caplog)
    assert len(lines) == 4 and method in lines[0]
    assert [line.split("):")[0].strip() for line in lines[1:]] == [f"partition {j} (cpu:{j}" for j in range(3)]
    if balance == "parameters":  # deterministic: 96+1+1 | 272 | 1+51 parameters (+1 per layer)
        assert "balance [3, 1, 2]" in lines[0]


def test_auto_balance_falls_back_to_parameter_counts(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    import lightning_balanced.pipeline.balance as balance  # where the strategy's balance is chosen

    def fail(*args: Any, **kwargs: Any) -> list[float]:
        raise RuntimeError("out of memory while profiling")

    monkeypatch.setattr(balance, "layer_times", fail)
    with caplog.at_level(logging.INFO):
        record = fit(GPipeStrategy(balance="auto", chunks=2), devices=3)
    lines = gpipe_lines(caplog)
    assert "balance [3, 1, 2] (parameters (measuring time failed: out of memory while profiling))" in lines[0]
    assert len(record.states) == 2


def test_auto_balance_steps_equal_the_unpipelined_model(single_device_steps: list[dict[str, Tensor]]) -> None:
    record = fit(GPipeStrategy(balance="auto", chunks=4), devices=2)  # measured during the sanity check / 1st step
    assert_same_states(record.states, single_device_steps, atol=1e-10)


# ---- errors ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"chunks": 0}, ValueError, whole_message("`chunks` must be >= 1, got 0")),
        ({"chunks": "4"}, TypeError, whole_message("`chunks` must be an integer, got '4' of type str")),
        ({"checkpoint": "except_first"}, ValueError, "`checkpoint` must be one of"),
        ({"balance": "fast"}, ValueError, "`balance` must be a list of ints, None or one of"),
        ({"balance": [3, -3]}, ValueError, "`balance` must hold"),
        ({"balance": 6}, TypeError, "`balance` must be a list of ints"),
        ({"deferred_batch_norm": "yes"}, TypeError, "`deferred_batch_norm` must be a bool"),
        ({"module_name": 3}, TypeError, "`module_name` must be the name of an attribute"),
    ],
)
def test_argument_errors(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        GPipeStrategy(**kwargs)


class NotSequential(SequentialModel):
    def __init__(self) -> None:
        super().__init__()
        self.sequential_module = nn.ModuleList(list(self.sequential_module))  # type: ignore[assignment]


class SharedWeights(SequentialModel):
    def __init__(self) -> None:
        super().__init__()
        self.sequential_module[5].weight = self.sequential_module[0].weight  # tied, in different partitions
        self.sequential_module[5] = nn.Linear(16, 16)
        self.sequential_module[0] = self.sequential_module[3]


@pytest.mark.parametrize(
    ("strategy", "devices", "model", "error", "match"),
    [
        (GPipeStrategy(module_name="body"), 2, SequentialModel, ValueError, "has no attribute 'body'"),
        (GPipeStrategy(), 2, NotSequential, TypeError, "must be an nn.Sequential, got ModuleList"),
        (
            GPipeStrategy(balance=[2, 2]),
            2,
            SequentialModel,
            ValueError,
            r"covers 4 layers, but the nn.Sequential has 6",
        ),
        (GPipeStrategy(balance=[2, 2, 2]), 2, SequentialModel, ValueError, "3 partitions but there are only 2 devices"),
        (GPipeStrategy(balance=[3, 3]), 2, SharedWeights, ValueError, r"share a parameter .* change `balance`"),
        (GPipeStrategy(balance="memory"), 2, SequentialModel, ValueError, "`balance`='memory' measures CUDA memory"),
        (GPipeStrategy(), 7, SequentialModel, ValueError, "the nn.Sequential has only 6 layers"),
    ],
)
def test_setup_errors(strategy: GPipeStrategy, devices: int, model: type, error: type[Exception], match: str) -> None:
    module = model()
    before = module.sequential_module
    with pytest.raises(error, match=match):
        quiet_trainer(strategy=strategy, devices=devices, max_steps=1).fit(module, data(dtype=torch.float32))
    assert module.sequential_module is before  # nothing left wrapped


def test_sync_batchnorm_is_refused() -> None:
    with pytest.raises(ValueError, match="sync_batchnorm=True"):
        quiet_trainer(strategy=GPipeStrategy(), devices=2, sync_batchnorm=True, max_steps=1).fit(
            SequentialModel(), data(dtype=torch.float32)
        )


def test_layer_returning_a_non_tensor_fails_the_step_with_a_type_error() -> None:
    class Pair(nn.Module):
        def forward(self, x: Tensor) -> tuple[Tensor, Tensor]:
            return x, x

    model = SequentialModel()
    model.sequential_module[2] = Pair()
    with pytest.raises(TypeError, match=r"`sequential_module\[3\]` \(Linear\) cannot take the tuple"):
        quiet_trainer(strategy=GPipeStrategy(), devices=2, max_steps=1).fit(model, data(dtype=torch.float32))
    assert not isinstance(model.sequential_module, Pipe)


# ---- CUDA ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("devices", CUDA_DEVICE_LISTS)
@pytest.mark.parametrize("precision", ["64-true", "16-mixed"])
def test_cuda_partitions_stay_on_their_devices(precision: str, devices: list[torch.device]) -> None:
    model = SequentialModel()
    placement: dict[str, Any] = {}

    class Inspect(Callback):
        def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
            placement.update({n: p.device for n, p in module.named_parameters()})
            optimizer = trainer.optimizers[0]
            placement["states"] = {
                s["exp_avg"].device == p.device for p, s in optimizer.state.items() if "exp_avg" in s
            }

    trainer = quiet_trainer(
        strategy=GPipeStrategy(balance=[3, 3], chunks=3, parallel_devices=devices),
        accelerator="cuda",
        devices=gpu_ids(devices),
        precision=precision,
        max_steps=2,
        callbacks=[Inspect()],
    )
    trainer.fit(model, data(dtype=torch.float32 if precision == "16-mixed" else torch.float64))
    assert placement["sequential_module.0.weight"] == devices[0]
    assert placement["sequential_module.5.weight"] == devices[1]
    assert placement["scale"] == torch.device("cuda:0") and placement["states"] == {True}


@pytest.mark.parametrize("devices", CUDA_DEVICE_LISTS)
def test_cuda_memory_balance(devices: list[torch.device]) -> None:
    strategy = GPipeStrategy(balance="memory", chunks=2, parallel_devices=devices)
    trainer = quiet_trainer(strategy=strategy, accelerator="cuda", devices=gpu_ids(devices), max_steps=1)
    model = SequentialModel()
    trainer.fit(model, data(dtype=torch.float32))
    # Balanced by measured memory (not a fallback to parameter counts): every partition holds layers, all of them.
    assert strategy._balance_method == "memory"
    balance = strategy._reported_balance
    assert balance is not None and len(balance) == len(devices) and all(n > 0 for n in balance)
    assert sum(balance) == len(model.sequential_module)


# ---- placement: the pipelined model never sits whole on the root device ----------------------------------------------
@pytest.mark.parametrize("balance", [[4, 2], "auto"])
def test_no_device_move_takes_the_pipelined_layers_along_with_the_rest_of_the_model(
    balance: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    # All devices are `cpu` here, so record the moves instead: a `.to(device)` of any module that holds pipelined
    # layers but is not one of them (the root's, Lightning's) would put the whole model on one device.
    model = SequentialModel()
    layer_ids = {id(layer) for layer in model.sequential_module}
    whole_moves: list[str] = []
    layer_moves: Counter[int] = Counter()
    to = nn.Module.to

    def recorded(self: nn.Module, *args: Any, **kwargs: Any) -> Any:
        if torch._C._nn._parse_to(*args, **kwargs)[0] is not None:
            if id(self) in layer_ids:
                layer_moves[id(self)] += 1
            elif any(id(m) in layer_ids for m in self.modules()):
                whole_moves.append(type(self).__name__)
        return to(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "to", recorded)
    fit(GPipeStrategy(balance=balance, chunks=2), max_steps=1, model=model)
    assert whole_moves == []
    assert set(layer_moves) == layer_ids  # each layer moved to its partition's device on its own


@pytest.mark.parametrize("devices", CUDA_DEVICE_LISTS)
def test_init_module_makes_layers_in_host_memory_not_on_device_0(devices: list[torch.device]) -> None:
    class Placement(Callback):
        """Where the first and last layers train (read before teardown moves the module back to the host)."""

        def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            layers = module.sequential_module
            self.devices = [layers[0].weight.device, layers[5].weight.device]

    placement = Placement()
    strategy = GPipeStrategy(balance=[4, 2], chunks=2, parallel_devices=devices)
    trainer = quiet_trainer(
        strategy=strategy,
        accelerator="cuda",
        devices=gpu_ids(devices),
        precision="64-true",
        max_steps=1,
        callbacks=[placement],
    )
    with trainer.init_module():
        model = SequentialModel()
    assert {p.device for p in model.parameters()} == {torch.device("cpu")}
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    trainer.fit(model, data())
    assert placement.devices == [devices[0], devices[1]]


# ---- the CPU emulation: partition j on virtual device cpu:j ---------------------------------------------------------
def test_partitions_run_on_virtual_devices_and_a_hook_mixing_in_a_root_tensor_fails_as_on_gpus() -> None:
    model = SequentialModel()
    seen: list[torch.device] = []
    model.sequential_module[0].register_forward_hook(lambda _, args, out: seen.append(out.device))
    model.sequential_module[5].register_forward_hook(lambda _, args, out: seen.append(out.device))
    fit(GPipeStrategy(balance=[4, 2], chunks=2), max_steps=1, model=model)
    assert set(seen) == {torch.device("cpu", 0), torch.device("cpu", 1)}

    model = SequentialModel()
    root_tensor = torch.ones(3, dtype=torch.float64)  # a root attribute: on device 0 (cuda:0 on GPUs)
    model.sequential_module[5].register_forward_hook(lambda _, args, out: out + root_tensor)
    with raises_exactly(
        RuntimeError,
        "Expected all tensors to be on the same device, but found at least two devices, cpu:0 and cpu:1!"
        " (lightning_balanced's CPU emulation: replica or partition i runs on virtual device cpu:i, the root is cpu:0"
        " and tensors made without a device are host tensors, cpu; this would fail on GPUs too. Move tensors to one"
        " device, e.g. `self.device`, before combining them)\n(raised in gpipe partition 1 on cpu:1, micro-batch 0)",
    ):
        fit(GPipeStrategy(balance=[4, 2], chunks=2), max_steps=1, model=model)


class SandwichModel(SequentialModel):
    """The Sequential between two other layers of the module: placement must keep the parameters' order."""

    def __init__(self) -> None:
        super().__init__()
        sequential = self.sequential_module
        del self.sequential_module
        self.pre = nn.Linear(5, 5).double()
        self.sequential_module = sequential
        self.post = nn.Linear(3, 3).double()

    def forward(self, x: Tensor) -> Tensor:
        return self.post(super().forward(self.pre(x)))


def test_placement_keeps_the_parameter_order_so_optimizer_states_fit_the_unpipelined_model() -> None:
    # The optimizer's state_dict refers to parameters by position: a placement that re-registered the Sequential at
    # the end of the module would make a gpipe checkpoint's optimizer state land on the wrong parameters elsewhere.
    model = SandwichModel()
    names = [name for name, _ in model.named_parameters()]
    assert names[-2:] == ["post.weight", "post.bias"]
    captured: list[list[str]] = []

    class CaptureOrder(Callback):
        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            by_id = {id(p): name for name, p in module.named_parameters()}
            captured.append([by_id[id(p)] for group in trainer.optimizers[0].param_groups for p in group["params"]])

    fit(GPipeStrategy(balance=[4, 2], chunks=2), max_steps=1, model=model, callbacks=[CaptureOrder()])
    assert captured == [names]
    assert [name for name, _ in model.named_parameters()] == names


def test_init_module_makes_the_layers_in_host_memory_whatever_the_root_device(monkeypatch: pytest.MonkeyPatch) -> None:
    # The root here is the host; stand in a root that is not (the meta device) to tell "made on the root" apart.
    strategy = GPipeStrategy(balance=[4, 2], parallel_devices=[torch.device("cpu")] * 2)
    monkeypatch.setattr(GPipeStrategy, "root_device", property(lambda self: torch.device("meta")))
    with strategy.tensor_init_context():
        model = SequentialModel()
    assert {t.device for t in [*model.parameters(), *model.buffers()]} == {torch.device("cpu")}


@pytest.mark.parametrize("balance", [[3, 3], "auto"])
def test_resumed_optimizer_state_is_not_moved_to_the_root_device(
    balance: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Lightning's default resume moves every optimizer state tensor to the root device (all partitions' state on
    # device 0). Record each move of a non-empty optimizer state until training starts (teardown's move to the host
    # comes later); `Optimizer.load_state_dict` puts each tensor on its parameter's device by itself.
    path = tmp_path / "gpipe.ckpt"
    one_epoch: dict[str, Any] = {"precision": "64-true", "max_steps": -1, "max_epochs": 1}  # an end-of-epoch checkpoint
    trainer = quiet_trainer(strategy=GPipeStrategy(balance=[3, 3]), devices=2, **one_epoch)
    trainer.fit(SequentialModel(), data())
    trainer.save_checkpoint(path)

    import lightning.fabric.utilities.optimizer as fabric_optimizer
    import lightning.pytorch.strategies.strategy as strategy_module

    moves: list[str] = []
    started: list[bool] = []
    original = fabric_optimizer._optimizer_to_device

    def recorded(optimizer: torch.optim.Optimizer, device: Any) -> None:
        if optimizer.state and not started:
            moves.append(str(device))
        original(optimizer, device)

    monkeypatch.setattr(fabric_optimizer, "_optimizer_to_device", recorded)
    monkeypatch.setattr(strategy_module, "_optimizer_to_device", recorded)

    class Started(Callback):
        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            started.append(True)
            assert trainer.optimizers[0].state  # the state was restored

    strategy = GPipeStrategy(balance=balance, chunks=2)
    fit(strategy, ckpt_path=str(path), callbacks=[Started()], max_steps=-1, max_epochs=2)
    assert started and moves == []


# ---- placement on a GPU: the host stands in for a second GPU ---------------------------------------------------------
GPU_AND_HOST = [torch.device("cuda", 0), torch.device("cpu")]


class WideModel(pl.LightningModule):
    """Eight 1024x1024 float32 layers, 4 MiB each (32 MiB together): big enough to see on the memory counter."""

    def __init__(self) -> None:
        super().__init__()
        self.sequential_module = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(8)])

    def forward(self, x: Tensor) -> Tensor:
        return self.sequential_module(x)

    def validation_step(self, batch: tuple[Tensor], batch_idx: int) -> None:
        self.log("val", self(batch[0]).square().mean(), batch_size=len(batch[0]))


@RunIf(min_cuda_gpus=1)
@pytest.mark.parametrize("balance", [[4, 4], "auto"])
def test_device_0_never_holds_the_whole_pipelined_model(balance: Any) -> None:
    # Partitions on cuda:0 and the host: cuda:0 should hold at most half of the layers (16 MiB) plus small activations;
    # putting the whole model there first, or measuring "auto" with every layer on it, peaks at 32 MiB or more. The
    # first matmul on a stream makes cuBLAS take a workspace from the caching allocator (32 MiB on sm_90): the one of
    # the partition's new compute stream counts on top, this thread's stream is warmed before the measurement.
    model = WideModel()
    whole = sum(p.numel() * p.element_size() for p in model.parameters())
    loader = DataLoader(TensorDataset(torch.randn(16, 1024)), batch_size=8)
    strategy = GPipeStrategy(balance=balance, chunks=2, parallel_devices=GPU_AND_HOST)
    trainer = quiet_trainer(strategy=strategy, accelerator="cuda", devices=[0])
    workspace = _cublas_workspace_bytes(torch.device("cuda", 0))
    torch.cuda.synchronize(0)
    torch.cuda.reset_peak_memory_stats(0)
    before = torch.cuda.memory_allocated(0)
    trainer.validate(model, loader, verbose=False)
    peak = torch.cuda.max_memory_allocated(0) - before
    budget = 0.75 * whole + workspace
    assert peak < budget, (
        f"cuda:0 peaked at {peak / 2**20:.1f} MiB for a {whole / 2**20:.1f} MiB model (budget {budget / 2**20:.1f} MiB,"
        f" {workspace / 2**20:.1f} MiB of it a stream's cuBLAS workspace)"
    )


def _cublas_workspace_bytes(device: torch.device) -> int:
    """What cuBLAS takes from the caching allocator for a stream's first matmul; warms this thread's stream too."""
    a = torch.ones(8, 8, device=device)
    (a @ a).sum().item()  # this thread's current stream has its workspace from now on
    stream = torch.cuda.Stream(device)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    with torch.cuda.stream(stream):
        product = a @ a
    torch.cuda.synchronize(device)
    grown = torch.cuda.memory_allocated(device) - before - product.numel() * product.element_size()
    return max(grown, 0)


@RunIf(min_cuda_gpus=1)
def test_resumed_optimizer_state_lands_on_each_partition_s_device(tmp_path: Path) -> None:
    path = tmp_path / "gpipe.ckpt"
    strategy = GPipeStrategy(balance=[3, 3], chunks=2, parallel_devices=GPU_AND_HOST)
    one_epoch: dict[str, Any] = {"precision": "64-true", "max_steps": -1, "max_epochs": 1}  # an end-of-epoch checkpoint
    trainer = quiet_trainer(strategy=strategy, accelerator="cuda", devices=[0], **one_epoch)
    trainer.fit(SequentialModel(), data())
    trainer.save_checkpoint(path)
    placed: list[set[bool]] = []

    class Inspect(Callback):
        def on_train_start(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
            states = trainer.optimizers[0].state
            placed.append({s["exp_avg"].device == p.device for p, s in states.items()})

    strategy = GPipeStrategy(balance=[3, 3], chunks=2, parallel_devices=GPU_AND_HOST)
    trainer = quiet_trainer(
        strategy=strategy, accelerator="cuda", devices=[0], **{**one_epoch, "max_epochs": 2}, callbacks=[Inspect()]
    )
    model = SequentialModel()
    trainer.fit(model, data(), ckpt_path=str(path))
    assert placed == [{True}]
    assert model.sequential_module[5].weight.device == torch.device("cpu")
