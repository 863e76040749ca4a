"""The gpipe example config runs with LightningCLI on 2 CPU devices, on a trimmed budget."""

from __future__ import annotations

import logging
import re
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch
from lightning.pytorch.accelerators import CPUAccelerator
from torch import nn

from lightning_balanced import GPipeStrategy
from lightning_balanced.gpipe import Pipe
from tests.helpers import ON_CPU
from tests.test_examples import EXAMPLES, _load_example

# These tests build CPU Trainers through LightningCLI: on a machine with a GPU, Lightning's warning that it is not
# used is expected.
pytestmark = ON_CPU


@pytest.fixture(scope="module")
def digits() -> ModuleType:
    pytest.importorskip("sklearn")
    return _load_example("digits")


def test_digits_cli_fits_with_gpipe_on_two_cpu_devices(
    digits: ModuleType,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(sys, "argv", ["digits.py"])  # LightningCLI warns when given both `args` and sys.argv[1:]
    monkeypatch.setenv("JSONARGPARSE_DEPRECATION_WARNINGS", "off")  # as in test_examples.py
    with caplog.at_level(logging.INFO):
        cli = digits.main(
            [
                "fit",
                "--config",
                str(EXAMPLES / "configs" / "gpipe_digits.yaml"),
                "--trainer.max_epochs=1",
                "--trainer.limit_train_batches=3",
                "--trainer.limit_val_batches=2",
                "--trainer.enable_progress_bar=false",
                "--trainer.enable_model_summary=false",
                f"--trainer.logger.init_args.save_dir={tmp_path}",
            ]
        )

    strategy = cli.trainer.strategy
    assert isinstance(strategy, GPipeStrategy) and isinstance(cli.trainer.accelerator, CPUAccelerator)
    assert strategy.parallel_devices == [torch.device("cpu")] * 2
    assert (strategy.balance, strategy.chunks, strategy.module_name) == ([3, 4], 4, "net")
    assert cli.trainer.global_step == 3
    report = [r.getMessage() for r in caplog.records if r.getMessage().startswith("gpipe: balance [3, 4]")]
    assert len(report) == 1 and len(report[0].splitlines()) == 3  # once, one line per partition
    net = cli.model.net
    assert isinstance(net, nn.Sequential) and not isinstance(net, Pipe)  # put back after fit
    assert type(net[0][1]) is nn.BatchNorm2d and int(net[0][1].num_batches_tracked) == 3  # once per batch
    final = re.search(r"^final: val_acc=(\S+) val_loss=(\S+) epochs=1", capsys.readouterr().out, re.M)
    assert final is not None and 0.0 <= float(final.group(1)) <= 1.0
