"""Strategy registration: our strategies in both Lightning registries, and third-party plugins from entry points."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import StrategyRegistry
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning_balanced
from lightning_balanced.entry_points import ENTRY_POINT_GROUP, StrategyPluginWarning, load_strategy_plugins
from lightning_balanced.strategies.registration import StrategyNameConflict, register_strategy, strategy_classes
from tests.distributed import run_distributed
from tests.fake_distribution import write_distribution
from tests.helpers import ON_CPU

ROOT = Path(__file__).resolve().parents[1]

# A plugin package as a third party would ship it: one good strategy whose register_strategies does not guard
# against registering twice, and four broken entries of different kinds.
PLUGIN_SOURCE = '''
from lightning.pytorch.strategies import SingleDeviceStrategy


class TinyStrategy(SingleDeviceStrategy):
    """A third-party strategy."""

    @classmethod
    def register_strategies(cls, strategy_registry):
        strategy_registry.register("tiny_single", cls, description="a tiny plugin strategy", device="cpu")


class Raising(SingleDeviceStrategy):
    @classmethod
    def register_strategies(cls, strategy_registry):
        raise RuntimeError("boom in register_strategies")


class TakesDDP(SingleDeviceStrategy):
    @classmethod
    def register_strategies(cls, strategy_registry):
        strategy_registry.register("ddp", cls)


def not_a_strategy():
    pass
'''
PLUGIN_ENTRY_POINTS = {
    "tiny": "tiny_strategy_plugin:TinyStrategy",
    "missing_module": "tiny_strategy_plugin_gone:Strategy",
    "not_a_strategy": "tiny_strategy_plugin:not_a_strategy",
    "raising": "tiny_strategy_plugin:Raising",
    "takes_ddp": "tiny_strategy_plugin:TakesDDP",
}
BROKEN = {
    "missing_module": "ModuleNotFoundError: No module named 'tiny_strategy_plugin_gone'",
    "not_a_strategy": "TypeError: `strategy` must be a Strategy class",
    "raising": "RuntimeError: boom in register_strategies",
    "takes_ddp": "StrategyNameConflict: TakesDDP registers names already taken: 'ddp' (held by DDPStrategy)",
}


@pytest.fixture
def tiny_plugin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The tiny plugin distribution installed on ``sys.path``; yields its module; its names leave the registry after."""
    site = write_distribution(
        tmp_path / "site",
        "tiny-strategy-plugin",
        {ENTRY_POINT_GROUP: PLUGIN_ENTRY_POINTS},
        {"tiny_strategy_plugin": PLUGIN_SOURCE},
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "tiny_strategy_plugin", raising=False)
    yield importlib.import_module("tiny_strategy_plugin")
    StrategyRegistry.pop("tiny_single", None)


def _copy_of_lightnings_registry() -> _StrategyRegistry:
    registry = _StrategyRegistry()
    registry.update(StrategyRegistry)
    return registry


def test_plugins_load_once_and_a_broken_one_is_reported_by_name_and_skipped(tiny_plugin: Any) -> None:
    registry = _copy_of_lightnings_registry()
    with pytest.warns(StrategyPluginWarning) as warned:
        assert load_strategy_plugins(registry) == ["tiny_single"]
    assert registry["tiny_single"]["strategy"] is tiny_plugin.TinyStrategy
    assert registry["tiny_single"]["init_params"] == {"device": "cpu"}
    assert registry["ddp"] == StrategyRegistry["ddp"]  # the conflicting plugin changed nothing
    messages = [str(w.message) for w in warned]
    assert len(messages) == len(BROKEN)
    for name, error in BROKEN.items():
        assert any(f"Strategy plugin {name!r}" in m and error in m for m in messages), (name, messages)

    with pytest.warns(StrategyPluginWarning):  # the broken ones are reported again, and nothing is added twice
        assert load_strategy_plugins(registry) == []
    assert registry["tiny_single"]["strategy"] is tiny_plugin.TinyStrategy


def test_plugins_go_to_lightnings_registry_by_default(tiny_plugin: Any) -> None:
    assert "tiny_single" not in StrategyRegistry
    with pytest.warns(StrategyPluginWarning):
        assert load_strategy_plugins() == ["tiny_single"]
    assert isinstance(StrategyRegistry.get("tiny_single"), tiny_plugin.TinyStrategy)


def test_registering_a_class_is_idempotent_and_a_taken_name_raises() -> None:
    registry = _StrategyRegistry()
    assert register_strategy(lightning_balanced.BalancedDataParallelStrategy, registry) == ["balanced_dp"]
    assert register_strategy(lightning_balanced.BalancedDataParallelStrategy, registry) == []

    class Impostor(lightning_balanced.BalancedDataParallelStrategy):
        pass

    with pytest.raises(StrategyNameConflict, match=r"'balanced_dp' \(held by BalancedDataParallelStrategy\)"):
        register_strategy(Impostor, registry)
    assert registry["balanced_dp"]["strategy"] is lightning_balanced.BalancedDataParallelStrategy
    with pytest.raises(TypeError, match="`strategy` must be a Strategy class"):
        register_strategy(object(), registry)


def test_pyproject_declares_every_strategy_and_the_console_script_and_no_callbacks_factory() -> None:
    tomllib = pytest.importorskip("tomllib", reason="needs Python 3.11's tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def resolve(target: str) -> Any:
        module, _, attribute = target.partition(":")
        return getattr(importlib.import_module(module), attribute)

    declared = {resolve(target) for target in project["entry-points"][ENTRY_POINT_GROUP].values()}
    assert declared == set(strategy_classes())
    assert resolve(project["scripts"]["lightning-balanced"]) is lightning_balanced.cli.main
    # Lightning adds a callbacks_factory's callbacks to every Trainer of the environment: the package declares none.
    assert set(project["entry-points"]) == {ENTRY_POINT_GROUP}


def test_import_registers_our_strategies_in_both_registries() -> None:
    ours = lightning_balanced.register_strategies()  # already done on import: idempotent
    assert {"balanced_dp", "ddp_lr_linear", "ddp_lr_sqrt", "ddp_spawn_lr_sqrt"} <= set(ours)
    standalone_registry = pytest.importorskip("pytorch_lightning.strategies").StrategyRegistry
    from lightning_balanced.strategies import pytorch_lightning_compat

    # gpipe, the pipelines and balanced_fsdp have no standalone variant (README); every other name is registered in
    # both, alike.
    own_code = {"gpipe", "pipeline", "pipeline_lr_linear", "pipeline_lr_sqrt", "balanced_fsdp"}
    for name in own_code:
        assert name in ours and name not in standalone_registry
    for name in set(ours) - own_code:
        assert standalone_registry[name]["strategy"] in pytorch_lightning_compat.STRATEGIES
        assert standalone_registry[name]["init_params"] == StrategyRegistry[name]["init_params"]


# ---- the standalone pytorch_lightning variants train
def _standalone_fit(strategy: str, devices: int, batch_size: int) -> dict[str, Any]:
    import pytorch_lightning as ptl

    class Net(ptl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4), torch.nn.Linear(4, 1))
            self.bn_types: list[str] = []
            self.lrs: list[float] = []

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            self.bn_types.append(type(self.net[1]).__name__)
            self.lrs.append(self.trainer.optimizers[0].param_groups[0]["lr"])
            return F.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    model = Net()
    trainer = ptl.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=devices,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    data = TensorDataset(torch.randn(16, 3, generator=torch.Generator().manual_seed(0)), torch.randn(16, 1))
    trainer.fit(model, DataLoader(data, batch_size=batch_size))
    return {"strategy": type(trainer.strategy).__module__, "bn": model.bn_types, "lrs": model.lrs}


def _standalone_ddp_rank(rank: int, world_size: int) -> dict[str, Any]:
    return _standalone_fit("ddp_lr_sqrt", world_size, 4)


@ON_CPU
@pytest.mark.slow
def test_standalone_pytorch_lightning_trains_with_its_own_variants() -> None:
    pytest.importorskip("pytorch_lightning")
    balanced = _standalone_fit("balanced_dp", 2, 8)
    assert balanced["strategy"] == "lightning_balanced.strategies.pytorch_lightning_compat"
    assert balanced["lrs"] == [0.1] * 4  # 2 steps x 2 replicas; balanced_dp leaves the LR alone
    for ddp in run_distributed(_standalone_ddp_rank, 2):
        assert ddp["strategy"] == "lightning_balanced.strategies.pytorch_lightning_compat"
        assert ddp["bn"] == ["SyncBatchNorm"] * 2  # our CPU SyncBatchNorm replaced pytorch_lightning's choice
        assert ddp["lrs"] == pytest.approx([0.1 * 2**0.5] * 2, rel=1e-12)  # scaled by sqrt(world_size 2)


@ON_CPU
def test_standalone_balanced_dp_step_equals_the_single_device_step() -> None:
    ptl = pytest.importorskip("pytorch_lightning")
    from lightning_balanced.strategies import pytorch_lightning_compat

    class Tiny(ptl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.layer = torch.nn.Linear(5, 3).double()

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return F.mse_loss(self.layer(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.5)

    g = torch.Generator().manual_seed(1)
    dataset = TensorDataset(
        torch.randn(10, 5, generator=g, dtype=torch.float64), torch.randn(10, 3, generator=g).double()
    )
    model = Tiny()
    reference = Tiny().layer
    F.mse_loss(reference(dataset[:][0]), dataset[:][1]).backward()
    torch.optim.SGD(reference.parameters(), lr=0.5).step()
    trainer = ptl.Trainer(
        strategy=pytorch_lightning_compat.BalancedDataParallelStrategy(chunk_sizes=[7, 3]),
        accelerator="cpu",
        devices=2,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, DataLoader(dataset, batch_size=10))
    # float64: chunk-weighted mean of the two chunks' losses vs. the mean over all 10 samples, ~1e-16 apart
    for got, expected in zip(model.layer.parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)


_PLAIN_TRAINER = """
import logging, sys, warnings
warnings.simplefilter("ignore")
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
if sys.argv[1] == "imported":
    import lightning_balanced
import lightning.pytorch as pl
trainer = pl.Trainer(accelerator="cpu", logger=False, enable_progress_bar=False)
print("callbacks:", sorted(type(c).__name__ for c in trainer.callbacks))
print("package loaded:", "lightning_balanced" in sys.modules)
"""


@pytest.mark.parametrize("imported", [False, True])
@pytest.mark.slow
def test_a_plain_trainer_gets_no_callback_and_no_log_line_from_the_installed_package(imported: bool) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PLAIN_TRAINER, "imported" if imported else "not imported"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    # Lightning's own defaults only (RichModelSummary where `rich` is installed, as on the GPU machines)
    assert re.search(r"^callbacks: \['ModelCheckpoint', '(Rich)?ModelSummary'\]$", done.stdout, re.MULTILINE)
    assert f"package loaded: {imported}" in done.stdout  # Lightning itself loads nothing of the package
    assert "lightning_balanced" not in done.stdout + done.stderr
    assert "entry point" not in done.stdout + done.stderr
