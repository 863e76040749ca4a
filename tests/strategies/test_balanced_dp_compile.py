"""Compiled modules under balanced_dp are refused before anything is touched, and replication never changes the
user's modules."""

from __future__ import annotations

import re
from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader

from lightning_balanced import BalancedDataParallelStrategy
from tests.helpers import quiet_trainer
from tests.strategies.test_balanced_dp import Regressor, _data


def _snapshot(model: nn.Module) -> list[Any]:
    """The module tree by identity: every module's type and its own parameters, buffers and children, by object."""
    tree = []
    for name, module in model.named_modules(remove_duplicate=False):
        tree.append(
            (
                name,
                type(module),
                id(module),
                {k: id(v) for k, v in module._parameters.items()},
                {k: id(v) for k, v in module._buffers.items()},
                {k: id(v) for k, v in module._modules.items()},
                "forward" in module.__dict__,
            )
        )
    return tree


def _values(model: nn.Module, buffers: bool = True) -> dict[str, torch.Tensor]:
    state = model.state_dict() if buffers else dict(model.named_parameters())
    return {k: v.detach().clone() for k, v in state.items()}


def _assert_untouched(model: nn.Module, tree: list[Any], values: dict[str, torch.Tensor], buffers: bool = True) -> None:
    assert _snapshot(model) == tree
    after = _values(model, buffers)
    assert list(after) == list(values)
    for key, value in values.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0)


class _CompiledChild(Regressor):
    def __init__(self, how: str) -> None:
        super().__init__()
        self.head = nn.Linear(3, 1).double()
        if how == "torch.compile":
            self.head = torch.compile(self.head, backend="eager")  # type: ignore[assignment]
        else:
            self.head.compile(backend="eager")  # the backend does not matter: nothing is compiled

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        x, y = batch
        return F.mse_loss(self.head(self(x)), y[:, :1])


@pytest.mark.parametrize("how", ["torch.compile", "Module.compile()"])
@pytest.mark.parametrize("loop", ["fit", "validate"])
def test_a_compiled_submodule_is_refused_before_anything_is_touched(how: str, loop: str) -> None:
    model = _CompiledChild(how)
    tree, values = _snapshot(model), _values(model)
    trainer = quiet_trainer(BalancedDataParallelStrategy(), 2, max_steps=1)
    loader = DataLoader(_data(8), batch_size=8)
    with pytest.raises(TypeError, match=re.escape(f"`head` ({how})") + ".*Remove"):
        getattr(trainer, loop)(model, loader)
    _assert_untouched(model, tree, values)
    # What the error suggests works: the same module uncompiled trains.
    model.head = model.head._orig_mod if how == "torch.compile" else model.head  # type: ignore[assignment]
    model.head._compiled_call_impl = None
    quiet_trainer(BalancedDataParallelStrategy(), 2, max_steps=1).fit(model, loader)


class _CompiledDuringFit(Regressor):
    """Compiles its ``head`` in a hook after the strategy's setup, before the second training step."""

    def __init__(self, how: str, hook: str) -> None:
        super().__init__()
        self.head = nn.Linear(3, 1).double()
        self.how, self.hook = how, hook
        self.steps_run: list[int] = []  # a list: replicas copy the module's __dict__, so they append to this one
        self.at_compile: tuple[list[Any], dict[str, torch.Tensor]] | None = None

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.steps_run.append(batch_idx)  # by every replica: twice per step on 2 devices
        x, y = batch
        return F.mse_loss(self.head(self(x)), y[:, :1])

    def _compile(self) -> None:
        if self.how == "torch.compile":
            self.head = torch.compile(self.head, backend="eager")  # type: ignore[assignment]
        else:
            self.head.compile(backend="eager")
        self.at_compile = (_snapshot(self), _values(self))

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        if self.hook == "on_train_batch_start" and batch_idx == 1:
            self._compile()

    def on_validation_start(self) -> None:
        if self.hook == "on_validation_start":
            self._compile()


@pytest.mark.parametrize("hook", ["on_train_batch_start", "on_validation_start"])
@pytest.mark.parametrize("how", ["torch.compile", "Module.compile()"])
def test_a_submodule_compiled_during_fit_is_refused_at_the_next_step_with_the_same_error(how: str, hook: str) -> None:
    # A hook runs after the strategy's setup check, so the replication of every step checks again (without a second
    # walk of the tree): the user gets the setup's TypeError at the next step, never replicas running the original.
    model = _CompiledDuringFit(how, hook)
    loader = DataLoader(_data(16), batch_size=8)
    trainer = quiet_trainer(BalancedDataParallelStrategy(), 2, max_epochs=1, num_sanity_val_steps=0)
    with pytest.raises(TypeError, match=re.escape(f"`head` ({how})") + ".*Remove"):
        trainer.fit(model, loader, loader)
    assert model.steps_run == ([0, 0] if hook == "on_train_batch_start" else [0, 0, 1, 1])  # the steps before it ran
    assert model.at_compile is not None
    _assert_untouched(model, *model.at_compile)  # the refused step touched nothing


def test_a_compiled_lightning_module_is_refused_by_lightning_before_the_strategy_runs() -> None:
    model = Regressor()
    with pytest.raises(RuntimeError, match="compiled model is incompatible"):
        quiet_trainer(BalancedDataParallelStrategy(), 2, max_steps=1).fit(
            torch.compile(model, backend="eager"), DataLoader(_data(8), batch_size=8)
        )


def test_module_compile_on_the_lightning_module_itself_is_refused() -> None:
    model = Regressor()
    model.compile(backend="eager")
    with pytest.raises(TypeError, match=r"`Regressor` \(Module.compile\(\)\)"):
        quiet_trainer(BalancedDataParallelStrategy(), 2, max_steps=1).fit(model, DataLoader(_data(8), batch_size=8))


class _Failing(Regressor):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        super().training_step(batch, batch_idx)
        raise RuntimeError("step fails after the forward")


@pytest.mark.parametrize("outcome", ["success", "failure"])
@pytest.mark.parametrize("batchnorm", [False, True])
def test_a_step_leaves_the_users_module_tree_and_parameters_as_they_were(outcome: str, batchnorm: bool) -> None:
    model = (Regressor if outcome == "success" else _Failing)(batchnorm=batchnorm, lr=0.0)
    # In training, replica 0's forward updates BatchNorm's running statistics before the step fails, as one device's
    # would: compare the parameters there, and everything in validation.
    buffers = outcome == "success"
    tree, values = _snapshot(model), _values(model, buffers)
    trainer = quiet_trainer(BalancedDataParallelStrategy(chunk_sizes=[3, 5]), 2, max_steps=1)
    loader = DataLoader(_data(8), batch_size=8)
    if outcome == "success":
        trainer.validate(model, loader, verbose=False)
    else:
        with pytest.raises(RuntimeError, match="step fails"):
            trainer.fit(model, loader)
    _assert_untouched(model, tree, values, buffers)
    assert all(type(p) is nn.Parameter for p in model.parameters())
