"""The ``lightning-balanced`` command: strategies by name or class from YAML, plugins, help, every example config."""

from __future__ import annotations

import os
import re
import runpy
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.strategies import StrategyRegistry

from lightning_balanced import BalancedDataParallelStrategy, LRScaledDDPStrategy
from lightning_balanced.cli import LightningBalancedCLI
from lightning_balanced.entry_points import ENTRY_POINT_GROUP
from lightning_balanced.pipelining.stage_plan import SCHEDULES
from lightning_balanced.split_policies import SplitPolicy, even_split
from tests.fake_distribution import write_distribution
from tests.helpers import ON_CPU

# These tests build CPU Trainers through LightningCLI: on a machine with a GPU, Lightning's warning that it is not
# used is expected.
pytestmark = ON_CPU

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "examples" / "configs").glob("*.yaml"))
BORING = [
    "--seed_everything=1",
    "--model=lightning.pytorch.demos.boring_classes.BoringModel",
    "--data=lightning.pytorch.demos.boring_classes.BoringDataModule",
]


@pytest.fixture(autouse=True)
def _quiet_cli(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["lightning-balanced"])  # LightningCLI warns when given both `args` and argv
    # Lightning 2.6's cli.py calls jsonargparse APIs deprecated in jsonargparse 4.49 (add_instantiator,
    # instantiate_classes, skip_none); not ours to fix, so use jsonargparse's own switch for these notices.
    monkeypatch.setenv("JSONARGPARSE_DEPRECATION_WARNINGS", "off")


STRATEGY_FORMS = {
    "balanced_dp by name": ("strategy: balanced_dp", BalancedDataParallelStrategy, {"gpu0_bsz": None}),
    "ddp_lr_sqrt by name": ("strategy: ddp_lr_sqrt", LRScaledDDPStrategy, {"lr_scaling": "sqrt"}),
    "balanced_dp by class": (
        "strategy:\n    class_path: lightning_balanced.BalancedDataParallelStrategy\n    init_args:\n      gpu0_bsz: 3",
        BalancedDataParallelStrategy,
        {"gpu0_bsz": 3},
    ),
    "balanced_dp with a split policy by its full class path": (
        "strategy:\n    class_path: lightning_balanced.BalancedDataParallelStrategy\n    init_args:\n      split:\n"
        "        class_path: lightning_balanced.split_policies.split_policy.Gpu0Budget\n"
        "        init_args:\n          gpu0_bsz: 14",
        BalancedDataParallelStrategy,
        {"gpu0_bsz": 14, "split": "Gpu0Budget(14)"},
    ),
    "balanced_dp with ChunkSizes by its exported path": (
        "strategy:\n    class_path: lightning_balanced.BalancedDataParallelStrategy\n    init_args:\n      split:\n"
        "        class_path: lightning_balanced.ChunkSizes\n        init_args:\n          chunk_sizes: [3, 5]",
        BalancedDataParallelStrategy,
        {"chunk_sizes": [3, 5], "split": "ChunkSizes([3, 5])"},
    ),
    "balanced_dp with Weights by its class name": (
        "strategy:\n    class_path: lightning_balanced.BalancedDataParallelStrategy\n    init_args:\n      split:\n"
        "        class_path: Weights\n        init_args:\n          weights: [2, 1]",
        BalancedDataParallelStrategy,
        {"weights": [2.0, 1.0], "split": "Weights([2.0, 1.0])"},
    ),
    "balanced_dp with EvenSplit, no init_args": (
        "strategy:\n    class_path: lightning_balanced.BalancedDataParallelStrategy\n    init_args:\n      split:\n"
        "        class_path: lightning_balanced.split_policies.split_policy.EvenSplit",
        BalancedDataParallelStrategy,
        {"gpu0_bsz": None, "split": "EvenSplit()"},
    ),
    "balanced_dp with a policy of the user's own": (
        "strategy:\n    class_path: lightning_balanced.BalancedDataParallelStrategy\n    init_args:\n      split:\n"
        "        class_path: tests.test_cli.LastDeviceFirst",
        BalancedDataParallelStrategy,
        {"split": "LastDeviceFirst()"},
    ),
    "LRScaledDDPStrategy by class": (
        "strategy:\n    class_path: lightning_balanced.LRScaledDDPStrategy\n"
        "    init_args:\n      lr_scaling: sqrt\n      warmup_steps: 7\n      start_method: spawn",
        LRScaledDDPStrategy,
        {"lr_scaling": "sqrt", "warmup_steps": 7, "_start_method": "spawn"},
    ),
}


class LastDeviceFirst(SplitPolicy):
    """A split policy of the user's own, named in a config by its class_path."""

    def _plan(self, batch_size: int, num_devices: int) -> list[int]:
        return even_split(batch_size, num_devices)[::-1]

    def __repr__(self) -> str:
        return "LastDeviceFirst()"


@pytest.mark.parametrize("form", list(STRATEGY_FORMS))
def test_strategy_by_name_or_by_class_from_yaml(form: str, tmp_path: Path) -> None:
    strategy_yaml, expected_type, attributes = STRATEGY_FORMS[form]
    config = tmp_path / "job.yaml"
    config.write_text(f"trainer:\n  accelerator: cpu\n  devices: 2\n  logger: false\n  {strategy_yaml}\n")
    cli = LightningBalancedCLI(args=["--config", str(config), *BORING], run=False)
    strategy = cli.trainer.strategy
    assert type(strategy) is expected_type
    for name, value in attributes.items():
        got = getattr(strategy, name)
        assert (repr(got) if name == "split" else got) == value, name
    assert type(cli.model).__name__ == "BoringModel" and type(cli.datamodule).__name__ == "BoringDataModule"


def test_split_and_a_shorthand_in_one_config_name_both(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 2\n  logger: false\n  strategy:\n"
        "    class_path: lightning_balanced.BalancedDataParallelStrategy\n    init_args:\n      gpu0_bsz: 3\n"
        "      split:\n        class_path: lightning_balanced.Gpu0Budget\n        init_args:\n          gpu0_bsz: 4\n"
    )
    message = (
        "`split` and `gpu0_bsz` cannot be given together: `gpu0_bsz=3` is short for `split=Gpu0Budget(3)`; give one of"
        " them"
    )
    with pytest.raises(ValueError) as info:
        LightningBalancedCLI(args=["--config", str(config), *BORING], run=False)
    # jsonargparse lists the strategy's error among those of the union `str | Strategy`, one per line.
    assert message in [line.strip().removeprefix("- ") for line in str(info.value).splitlines()]


def test_a_misspelt_strategy_name_is_refused_in_one_line_with_the_closest_names(tmp_path: Path) -> None:
    config = tmp_path / "job.yaml"
    config.write_text("trainer:\n  accelerator: cpu\n  devices: 2\n  logger: false\n  strategy: balanced-dp\n")
    with pytest.raises(SystemExit) as info:
        LightningBalancedCLI(args=["--config", str(config), *BORING], run=False)
    message = str(info.value)
    assert message.startswith(
        "lightning-balanced: error: unknown strategy 'balanced-dp'. Did you mean 'balanced_dp' or 'balanced_ddp' or"
        " 'balanced_fsdp'? Registered names: "
    )
    assert "\n" not in message and ", pipeline, " in message


def test_a_misspelt_strategy_argument_gets_a_suggestion_and_no_usage_block(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "job.yaml"
    config.write_text(
        "trainer:\n  accelerator: cpu\n  devices: 2\n  logger: false\n  strategy:\n"
        "    class_path: lightning_balanced.BalancedDataParallelStrategy\n    init_args:\n      gpu0_bs: 16\n"
    )
    with pytest.raises(SystemExit) as info:
        LightningBalancedCLI(args=["fit", "--config", str(config), *BORING])
    assert info.value.code == 2
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert lines[0] == 'error: Parser key "trainer.strategy":', err  # no usage block before the message
    assert "BalancedDataParallelStrategy takes no 'gpu0_bs': did you mean 'gpu0_bsz'?" in lines, err
    # jsonargparse >= 4.28 names the subcommand's parser ("lightning-balanced fit --help"), older ones the command's.
    assert re.fullmatch(r"tip: `lightning-balanced (fit )?--help` lists every option", lines[-1]), err
    assert len(lines) < 15, err


def test_a_class_path_module_not_found_says_where_class_paths_are_imported_from(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "configs" / "job.yaml"
    config.parent.mkdir()
    config.write_text("model:\n  class_path: my_project_examples.jobs.Model\ntrainer:\n  logger: false\n")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as info:
        LightningBalancedCLI(args=["fit", "--config", str(config)])
    assert info.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[-2] == (
        f"'my_project_examples.jobs.Model' is imported from the directory the command ran in ({tmp_path}) and"
        " PYTHONPATH, not from the config file's folder: run from the directory that holds the `my_project_examples`"
        " package (for this repository's examples, the repository root), or add that directory to PYTHONPATH"
    ), lines


def test_the_strategy_help_lists_the_split_policies(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(
        capsys,
        lambda: LightningBalancedCLI(
            args=["fit", "--trainer.strategy.help", "lightning_balanced.BalancedDataParallelStrategy"]
        ),
    )
    # jsonargparse < 4.28 spells the argument with its `init_args.` level.
    assert re.search(r"--trainer\.strategy\.(init_args\.)?splitSPLIT", text), text
    assert "knownsubclasses:lightning_balanced.EvenSplit,lightning_balanced.Gpu0Budget," in text


def _help(capsys: pytest.CaptureFixture[str], run: Any) -> str:
    with pytest.raises(SystemExit) as exited:
        run()
    assert exited.value.code == 0
    return "".join(capsys.readouterr().out.split())  # argparse wraps lines, even inside long words


def test_fit_help_lists_the_strategy_names_and_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    text = _help(capsys, lambda: LightningBalancedCLI(args=["fit", "--help"]))
    assert "--trainer.strategySTRATEGY" in text
    names = text.split("Registerednames:")[1].split(".")[0].split(",")
    assert {"balanced_dp", "ddp_lr_linear", "ddp_lr_sqrt", "ddp_spawn_lr_sqrt", "gpipe", "ddp", "fsdp"} <= set(names)
    assert (
        "BalancedDataParallelStrategy(gpu0_bsz=None,chunk_sizes=None,weights=None,split=None,loss_reduction='mean',"
        "sync_batchnorm=False)" in text
    )
    assert "GPipeStrategy(balance=None,chunks=None,checkpoint='except_last',deferred_batch_norm=True," in text
    assert "LRScaledDDPStrategy(lr_scaling='linear',reference_batch_size=None,warmup_steps=0," in text


def test_python_dash_m_runs_the_same_command(capsys: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["lightning_balanced", "fit", "--help"])
    monkeypatch.delitem(sys.modules, "lightning_balanced.__main__", raising=False)
    text = _help(capsys, lambda: runpy.run_module("lightning_balanced", run_name="__main__", alter_sys=True))
    assert "--trainer.strategySTRATEGY" in text and "LRScaledDDPStrategy(lr_scaling='linear'" in text


PLUGIN_SOURCE = '''
from lightning.pytorch.strategies import SingleDeviceStrategy


class PluginStrategy(SingleDeviceStrategy):
    """A strategy from another package."""

    @classmethod
    def register_strategies(cls, strategy_registry):
        strategy_registry.register("third_party_single", cls, description="from a plugin", device="cpu")
'''


def test_a_third_party_plugins_strategy_name_resolves_in_the_cli(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    site = write_distribution(
        tmp_path / "site",
        "third-party-strategy",
        {ENTRY_POINT_GROUP: {"third_party": "third_party_strategy:PluginStrategy"}},
        {"third_party_strategy": PLUGIN_SOURCE},
    )
    monkeypatch.syspath_prepend(str(site))
    assert "third_party_single" not in StrategyRegistry
    try:
        text = _help(capsys, lambda: LightningBalancedCLI(args=["fit", "--help"]))
        assert "third_party_single" in text and "third_party_strategy.PluginStrategy(" in text
        cli = LightningBalancedCLI(
            args=[
                "fit",
                *BORING,
                "--trainer.strategy=third_party_single",
                "--trainer.accelerator=cpu",
                "--trainer.max_steps=2",
                "--trainer.logger=false",
                "--trainer.enable_checkpointing=false",
                "--trainer.enable_progress_bar=false",
                "--trainer.enable_model_summary=false",
                f"--trainer.default_root_dir={tmp_path}",
            ]
        )
        assert type(cli.trainer.strategy).__qualname__ == "PluginStrategy"
        assert type(cli.trainer.strategy).__module__ == "third_party_strategy"
        assert cli.trainer.global_step == 2
    finally:
        StrategyRegistry.pop("third_party_single", None)


# What each example config must show in its output: the strategy at work and the job's final line.
EXPECTED_OUTPUT = {
    "digits_balanced_dp.yaml": [
        "balanced_dp: a batch of 64 samples is split over 2 devices as [16, 48]",
        "final: val_acc=",
    ],
    "digits_balanced_ddp.yaml": [
        "balanced_ddp: a global batch of 64 samples is split over 2 ranks as [24, 40] (chunk_sizes=[24, 40])",
        "final: val_acc=",
    ],
    "digits_balanced_dp_split.yaml": [
        "balanced_dp: a batch of 64 samples is split over 3 devices as [32, 16, 16]",
        "final: val_acc=",
    ],
    "digits_ddp_lr_sqrt.yaml": ["lr scaling (sqrt): factor 1.41421 from world_size 2", "final: val_acc="],
    "digits_scale_invariance.yaml": [
        "scale invariance (adam_sde + ema): kappa 2 = effective batch 64 / reference 32",
        "optimizer 0 group 0 betas: (0.9, 0.999) -> (0.8, 0.998)",
        "gradient noise scale: ",
        "final: val_acc=",
    ],
    "pipeline_digits.yaml": [
        "pipeline: schedule 1F1B, 8 micro-batches, 4 stages over 4 ranks x 1 data-parallel replica",
        "final: val_acc=",
    ],
    "detection_ddp_lr_linear.yaml": [
        "lr scaling (linear): factor 2 from world_size 2",
        "detection: map=",
        "lr_scale_factor=2 images=500",
    ],
}


def _command() -> list[str]:
    """The installed console script when it runs this checkout, else ``python -m lightning_balanced`` (the same)."""
    script = shutil.which("lightning-balanced")
    if script is not None and Path(script).read_text(errors="replace").find("lightning_balanced.cli") >= 0:
        return [script]
    return [sys.executable, "-m", "lightning_balanced"]


@pytest.mark.parametrize("config", CONFIGS, ids=[c.name for c in CONFIGS])
@pytest.mark.slow
def test_every_example_config_fits_with_the_command(config: Path, tmp_path: Path) -> None:
    # A few steps, one validation pass, nothing written outside tmp_path. Run from the repository root, where the
    # configs' class paths (examples.<job>.<Class>) import from.
    if config.name == "pipeline_digits.yaml" and not SCHEDULES["1F1B"].available():
        pytest.skip(f"its 1F1B schedule runs under strategy='pipeline' from torch {SCHEDULES['1F1B'].runs_from}")
    command = [
        *_command(),
        "fit",
        "--config",
        str(config),
        "--trainer.max_steps=3",
        "--trainer.limit_train_batches=3",
        "--trainer.check_val_every_n_epoch=1",
        "--trainer.limit_val_batches=1.0",
        "--trainer.logger=false",
        f"--trainer.default_root_dir={tmp_path}",
    ]
    env = {**os.environ, "JSONARGPARSE_DEPRECATION_WARNINGS": "off", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    for expected in EXPECTED_OUTPUT.get(config.name, []):
        assert expected in output, (expected, output[-4000:])
