"""A strategy's argument given to the Trainer names the strategy class (``strategies/trainer_arguments.py``)."""

from __future__ import annotations

import inspect
import re
from typing import Any

import lightning.pytorch as pl
import pytest

import lightning_balanced  # registers the strategies, and wraps Trainer.__init__
from tests.helpers import quiet_trainer


def test_a_registered_name_with_an_argument_of_its_strategy_names_the_class() -> None:
    with pytest.raises(TypeError) as raised:
        pl.Trainer(strategy="balanced_dp", chunk_sizes=[6, 10])
    assert str(raised.value) == (
        "Trainer(strategy='balanced_dp') got `chunk_sizes`, an argument of the strategy, not of the Trainer: pass it to"
        " the strategy's class, Trainer(strategy=BalancedDataParallelStrategy(chunk_sizes=...)), with"
        " `from lightning_balanced import BalancedDataParallelStrategy`"
    )
    assert raised.value.__cause__ is None and raised.value.__suppress_context__


@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (  # the registered arguments of the name are kept in the suggestion
            {"strategy": "ddp_lr_sqrt", "reference_batch_size": 256},
            "Trainer(strategy='ddp_lr_sqrt') got `reference_batch_size`, an argument of the strategy, not of the"
            " Trainer: pass it to the strategy's class, Trainer(strategy=LRScaledDDPStrategy(lr_scaling='sqrt',"
            " start_method='popen', reference_batch_size=...)), with `from lightning_balanced import"
            " LRScaledDDPStrategy`",
        ),
        (  # another strategy with an argument of ours: the classes that take it
            {"strategy": "ddp", "gpu0_bsz": 4},
            "Trainer got `gpu0_bsz`, which is not an argument of the Trainer but of the strategy BalancedDDPStrategy"
            " or BalancedDataParallelStrategy or BalancedFSDPStrategy: pass it to the strategy's class,"
            " Trainer(strategy=BalancedDDPStrategy(gpu0_bsz=...)), with `from lightning_balanced import"
            " BalancedDDPStrategy`",
        ),
    ],
    ids=["registered_arguments_kept", "another_strategy"],
)
def test_the_message_names_the_class_that_takes_the_argument(arguments: dict[str, Any], message: str) -> None:
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        pl.Trainer(**arguments)


def test_other_unexpected_arguments_keep_pythons_message() -> None:
    with pytest.raises(TypeError, match=r"^Trainer.__init__\(\) got an unexpected keyword argument 'chunk_size'$"):
        pl.Trainer(strategy="balanced_dp", chunk_size=4)


def test_the_trainer_keeps_its_signature_and_works() -> None:
    lightning_balanced.register_strategies()  # a second call wraps nothing more
    assert "strategy" in inspect.signature(pl.Trainer).parameters
    assert inspect.unwrap(pl.Trainer.__init__).__qualname__ == "Trainer.__init__"
    trainer = quiet_trainer("balanced_dp")  # pl.Trainer, without the "GPU available but not used" warning
    assert type(trainer.strategy).__name__ == "BalancedDataParallelStrategy"


def test_the_standalone_package_names_its_own_variant() -> None:
    standalone = pytest.importorskip("pytorch_lightning")
    message = (
        "Trainer(strategy='balanced_dp') got `gpu0_bsz`, an argument of the strategy, not of the Trainer: pass it to"
        " the strategy's class, Trainer(strategy=BalancedDataParallelStrategy(gpu0_bsz=...)), with"
        " `from lightning_balanced.strategies.pytorch_lightning_compat import BalancedDataParallelStrategy`"
    )
    with pytest.raises(TypeError, match=f"^{re.escape(message)}$"):
        standalone.Trainer(strategy="balanced_dp", gpu0_bsz=4)


def test_arguments_passed_on_through_kwargs_are_the_strategys_for_lightning_cli_and_the_trainer() -> None:
    """The split options (SplitOptions) and pipeline_lr's LR options travel through ``**kwargs`` along the MRO."""
    from jsonargparse import ArgumentParser

    from lightning_balanced import BalancedDDPStrategy, BalancedFSDPStrategy, LRScaledPipelineStrategy
    from lightning_balanced.strategies.trainer_arguments import init_parameters

    fsdp = [p.name for p in init_parameters(BalancedFSDPStrategy)]
    assert {"gpu0_bsz", "chunk_sizes", "weights", "split", "loss_reduction", "data_parallel_size"} <= set(fsdp)
    names = {p.name for p in init_parameters(LRScaledPipelineStrategy)}
    assert {"lr_scaling", "warmup_steps", "schedule", "start_method"} <= names and "sync_batchnorm" not in names

    parser = ArgumentParser()
    parser.add_class_arguments(BalancedDDPStrategy, "ddp")
    parser.add_class_arguments(LRScaledPipelineStrategy, "pipe")
    config = parser.parse_args(["--ddp.gpu0_bsz=4", "--ddp.start_method=spawn", "--pipe.warmup_steps=3"])
    ddp = BalancedDDPStrategy(**config.ddp.as_dict())  # every parsed option, defaults included, is taken
    pipe = LRScaledPipelineStrategy(**config.pipe.as_dict())
    assert (repr(ddp.split), ddp._start_method, pipe.warmup_steps, pipe.sync_batchnorm) == (
        "Gpu0Budget(4)",
        "spawn",
        3,
        False,
    )
    with pytest.raises(SystemExit):  # fixed by the class: not an option (jsonargparse prints why)
        parser.parse_args(["--pipe.sync_batchnorm=true"])
