"""One table: the package's strategies come from its entry points, each registering its names as Lightning's do."""

from __future__ import annotations

import importlib
import importlib.metadata
import importlib.util
import pickle
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
from lightning_balanced.strategies import registration
from lightning_balanced.strategies.registration import (
    DISTRIBUTION,
    ENTRY_POINT_GROUP,
    RegisteredStrategy,
    pytorch_lightning_variant,
    register_strategies,
    strategy_classes,
)
from tests.fake_distribution import write_distribution
from tests.helpers import ON_CPU

ROOT = Path(__file__).resolve().parents[2]


def _resolve(target: str) -> Any:
    module, _, attribute = target.partition(":")
    return getattr(importlib.import_module(module), attribute)


def _names(strategy: Any) -> dict[str, tuple[str, dict[str, Any]]]:
    """What ``strategy.register_strategies`` registers: name -> (description, init_params)."""
    registry = _StrategyRegistry()
    strategy.register_strategies(registry)
    assert {entry["strategy"] for entry in registry.values()} == {strategy}
    return {name: (entry["description"], entry["init_params"]) for name, entry in registry.items()}


def _installed_entries() -> dict[str, str]:
    entry_points = importlib.metadata.distribution(DISTRIBUTION).entry_points
    return {ep.name: ep.value for ep in entry_points if ep.group == ENTRY_POINT_GROUP}


# ---- the table
def test_the_strategies_are_the_entry_points_of_pyproject_in_order() -> None:
    tomllib = pytest.importorskip("tomllib", reason="needs Python 3.11's tomllib")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    declared = project["entry-points"][ENTRY_POINT_GROUP]
    assert _installed_entries() == declared, "the installed metadata is stale: reinstall (`pip install -e .`)"
    assert strategy_classes() == tuple(_resolve(target) for target in declared.values())
    assert [c.__name__ for c in strategy_classes()] == [
        "BalancedDDPStrategy",
        "BalancedDataParallelStrategy",
        "BalancedFSDPStrategy",
        "LRScaledDDPStrategy",
        "GPipeStrategy",
        "PipelineStrategy",
        "LRScaledPipelineStrategy",
    ]
    for name, strategy in zip(declared, strategy_classes(), strict=True):
        assert strategy.strategy_name == name  # the entry is named after the strategy
    # pytorch_lightning_compat names each variant after its class
    assert len({c.__name__ for c in strategy_classes()}) == len(strategy_classes())


def test_the_pytorch_lightning_variants_are_derived_from_the_table() -> None:
    compat = pytest.importorskip("lightning_balanced.strategies.pytorch_lightning_compat")
    from lightning_balanced.strategies.pytorch_lightning_compat import STRATEGIES as VARIANTS

    assert (
        VARIANTS
        == compat.STRATEGIES
        == (compat.BalancedDDPStrategy, compat.BalancedDataParallelStrategy, compat.LRScaledDDPStrategy)
    )
    assert compat.__all__ == [
        "STRATEGIES",
        "BalancedDDPStrategy",
        "BalancedDataParallelStrategy",
        "LRScaledDDPStrategy",
    ]
    assert {"STRATEGIES", "BalancedDDPStrategy", "BalancedDataParallelStrategy", "LRScaledDDPStrategy"} <= set(
        dir(compat)
    )


def test_a_variant_registers_the_names_of_its_class() -> None:
    pytest.importorskip("pytorch_lightning")
    for strategy in strategy_classes():
        assert issubclass(strategy, RegisteredStrategy)
        variant = pytorch_lightning_variant(strategy)
        if variant is not None:
            assert _names(variant) == _names(strategy)


def test_each_class_registers_its_names() -> None:
    names = {s.__name__: _names(s) for s in strategy_classes()}
    assert names["BalancedDataParallelStrategy"] == {
        "balanced_dp": (
            "Single-process data parallel over several devices, each taking a chunk of the batch you choose.",
            {},
        )
    }
    assert [(name, params) for name, (_, params) in names["BalancedDDPStrategy"].items()] == [
        ("balanced_ddp", {"start_method": "popen"}),
        ("balanced_ddp_spawn", {"start_method": "spawn"}),
        ("balanced_ddp_fork", {"start_method": "fork"}),
    ]
    ((gpipe, (description, init_params)),) = names["GPipeStrategy"].items()
    assert (gpipe, init_params) == ("gpipe", {})
    assert description.startswith("Pipeline parallelism in one process")
    assert [(name, params) for name, (_, params) in names["LRScaledDDPStrategy"].items()] == [
        (f"{prefix}_lr_{policy}", {"lr_scaling": policy, "start_method": start_method})
        for prefix, start_method in [
            ("ddp", "popen"),
            ("ddp_spawn", "spawn"),
            ("ddp_fork", "fork"),
            ("ddp_notebook", "fork"),
        ]
        for policy in ("linear", "sqrt")
    ]
    for name, (description, params) in names["LRScaledDDPStrategy"].items():
        policy, start_method = params["lr_scaling"], params["start_method"]
        assert description == f"DDP with {policy} learning-rate scaling and `start_method` '{start_method}'"
        assert StrategyRegistry[name]["description"] == description
    assert [(name, params) for name, (_, params) in names["LRScaledPipelineStrategy"].items()] == [
        ("pipeline_lr_linear", {"lr_scaling": "linear"}),
        ("pipeline_lr_sqrt", {"lr_scaling": "sqrt"}),
    ]


def test_a_class_without_a_docstring_is_described_by_nothing() -> None:
    class Bare(lightning_balanced.BalancedDataParallelStrategy):
        pass

    assert _names(Bare) == {"balanced_dp": ("", {})}


# ---- a new strategy: one module and one entry
NEW_STRATEGIES_SOURCE = '''
from lightning.pytorch.strategies import SingleDeviceStrategy

from lightning_balanced.strategies.registration import RegisteredStrategy


class OnCPU(RegisteredStrategy):
    """The implementation, free of a Lightning base class."""

    strategy_name = "test_on_cpu"

    @classmethod
    def register_strategies(cls, strategy_registry):
        description = cls.__doc__.strip().splitlines()[0]
        strategy_registry.register("test_on_cpu", cls, description=description, device="cpu")
        strategy_registry.register("test_on_cpu_too", cls, description="the same, under another name", device="cpu")


class OnCPUStrategy(OnCPU, SingleDeviceStrategy):
    """One CPU device: a strategy added with one file and one entry."""


class OwnCodeStrategy(RegisteredStrategy, SingleDeviceStrategy):
    """A strategy whose class holds its own code: no pytorch_lightning variant."""

    strategy_name = "test_own_code"
'''
NEW_NAMES = ("test_on_cpu", "test_on_cpu_too", "test_own_code")


@pytest.fixture
def one_more_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Any:
    """This distribution with two more entries (shadowing the installed metadata); yields the new strategies' module."""
    entries = {
        **_installed_entries(),
        "test_on_cpu": "new_test_strategies:OnCPUStrategy",
        "test_own_code": "new_test_strategies:OwnCodeStrategy",
    }
    site = write_distribution(
        tmp_path / "site", DISTRIBUTION, {ENTRY_POINT_GROUP: entries}, {"new_test_strategies": NEW_STRATEGIES_SOURCE}
    )
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.delitem(sys.modules, "new_test_strategies", raising=False)
    variants_before = set(registration._VARIANTS)
    yield importlib.import_module("new_test_strategies")
    registries = [StrategyRegistry]
    if importlib.util.find_spec("pytorch_lightning") is not None:
        registries.append(importlib.import_module("pytorch_lightning.strategies").StrategyRegistry)
    for registry in registries:
        for name in NEW_NAMES:
            registry.pop(name, None)
    for strategy in set(registration._VARIANTS) - variants_before:
        del registration._VARIANTS[strategy]


def _fit_one_step(trainer: Any, module_class: Any) -> None:
    class Net(module_class):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return F.mse_loss(self.layer(batch[0]), batch[1])

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer.fit(Net(), DataLoader(TensorDataset(torch.randn(4, 2), torch.randn(4, 1)), batch_size=4))


_QUIET = {
    "accelerator": "cpu",
    "devices": 1,
    "max_steps": 1,
    "logger": False,
    "enable_checkpointing": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
}


@ON_CPU
def test_a_new_strategy_class_and_one_entry_are_registered(one_more_entry: Any) -> None:
    import lightning.pytorch as pl

    new = one_more_entry
    assert strategy_classes()[-2:] == (new.OnCPUStrategy, new.OwnCodeStrategy)
    ours = register_strategies()
    assert {*NEW_NAMES, "balanced_dp", "ddp_lr_sqrt", "gpipe"} <= set(ours)
    assert StrategyRegistry["test_on_cpu"]["strategy"] is new.OnCPUStrategy
    assert (
        StrategyRegistry["test_on_cpu"]["description"]
        == "One CPU device: a strategy added with one file and one entry."
    )
    assert StrategyRegistry["test_on_cpu_too"]["description"] == "the same, under another name"
    assert StrategyRegistry["test_own_code"]["strategy"] is new.OwnCodeStrategy
    assert register_strategies() == ours  # idempotent
    trainer = pl.Trainer(strategy="test_on_cpu", **_QUIET)
    assert type(trainer.strategy) is new.OnCPUStrategy
    _fit_one_step(trainer, pl.LightningModule)

    ptl = pytest.importorskip("pytorch_lightning")
    from lightning_balanced.strategies import pytorch_lightning_compat as compat

    standalone_registry = ptl.strategies.StrategyRegistry
    variant = compat.OnCPUStrategy
    assert variant.__bases__ == (new.OnCPU, ptl.strategies.SingleDeviceStrategy)
    assert (variant.__module__, variant.__doc__) == (compat.__name__, new.OnCPUStrategy.__doc__)
    assert pickle.loads(pickle.dumps(variant)) is variant
    assert compat.STRATEGIES[-1] is variant
    for name in ("test_on_cpu", "test_on_cpu_too"):
        assert standalone_registry[name]["strategy"] is variant
        assert standalone_registry[name]["init_params"] == StrategyRegistry[name]["init_params"]
    assert "test_own_code" not in standalone_registry
    with pytest.raises(AttributeError, match="OwnCodeStrategy has no pytorch_lightning variant"):
        compat.OwnCodeStrategy  # noqa: B018
    trainer = ptl.Trainer(strategy="test_on_cpu", **_QUIET)
    assert type(trainer.strategy) is variant
    _fit_one_step(trainer, ptl.LightningModule)


def test_an_entry_that_is_not_a_registered_strategy_class_is_an_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    entries = {**_installed_entries(), "plain": "lightning.pytorch.strategies:SingleDeviceStrategy"}
    monkeypatch.syspath_prepend(str(write_distribution(tmp_path, DISTRIBUTION, {ENTRY_POINT_GROUP: entries})))
    with pytest.raises(TypeError, match=r"entry point 'plain' .* must name a lightning.pytorch Strategy class with"):
        strategy_classes()


def test_without_the_distribution_metadata_nothing_is_registered_and_a_warning_says_why(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def not_installed(name: str) -> Any:
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "distribution", not_installed)
    with pytest.warns(UserWarning, match=r"lightning_balanced is not installed .*`pip install -e \.`"):
        assert strategy_classes() == ()
