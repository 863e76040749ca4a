"""LRScaledDDPStrategy on real gloo process groups (2 CPU ranks), compared with single-process references."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.strategies import StrategyRegistry
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning_balanced
from lightning_balanced import BalancedDataParallelStrategy, LRScaledDDPStrategy
from lightning_balanced.batch_scaling.factor_check import LRScaleFactorCheck, LRScaleFactorWarning
from tests.distributed import run_distributed
from tests.helpers import quiet_trainer, whole_message

# float64 models: the only difference between 2 ranks and one process on the concatenated batch is the summation
# order of the gradient all_reduce and of the BN statistics, ~1e-16 relative; 1e-10 leaves a wide margin yet catches
# any missing or doubled factor.
EXACT = {"rtol": 0, "atol": 1e-10}
BASE_LR = 0.1
SCRIPT = Path(__file__).parents[1] / "scripts" / "lr_scaled_job.py"


def _data(n: int = 16, seed: int = 0) -> TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return TensorDataset(
        torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randn(n, 2, generator=g, dtype=torch.float64)
    )


class Net(pl.LightningModule):
    """A float64 MLP with BatchNorm that records the learning rate the optimizer used at every step."""

    def __init__(self, scheduler: str = "none", lr: float = BASE_LR) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 2)).double()
        self.scheduler = scheduler
        self.lr = lr
        self.lrs_used: list[list[float]] = []
        self.bn_types: list[str] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.bn_types.append(type(self.net[1]).__name__)
        x, y = batch
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        self.log("constant", 1.0)  # never improves: ReduceLROnPlateau halves the LR at every epoch end after the first
        return loss

    def on_fit_start(self) -> None:
        def record(optimizer: Any, args: Any, kwargs: Any) -> None:
            self.lrs_used.append([group["lr"] for group in optimizer.param_groups])

        self.trainer.optimizers[0].register_step_pre_hook(record)

    def configure_optimizers(self) -> Any:
        optimizer = torch.optim.SGD(
            [
                {"params": self.net[0].parameters(), "lr": self.lr},
                {"params": self.net[1:].parameters(), "lr": self.lr / 10},
            ],
            lr=self.lr,
        )
        if self.scheduler == "none":
            return optimizer
        if self.scheduler == "onecycle":
            scheduler = torch.optim.lr_scheduler.OneCycleLR(
                optimizer, max_lr=[4 * self.lr, 0.4 * self.lr], total_steps=8
            )
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}
        if self.scheduler == "plateau":
            scheduler = torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, min_lr=1e-3)
            return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "monitor": "constant"}}
        raise ValueError(self.scheduler)


def _trainer(world_size: int, **kwargs: Any) -> pl.Trainer:
    strategy = kwargs.pop("strategy", None) or LRScaledDDPStrategy()
    return quiet_trainer(strategy, world_size, **kwargs)


def _state(module: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


# ---- one SGD update: 2 ranks x batch b with linear scaling and SyncBN == one process on batch 2b
# run_distributed creates the process group and sets RANK/LOCAL_RANK/WORLD_SIZE: Lightning sees an externally
# launched world, as under torchrun, and reuses the group.
def _one_update_rank(rank: int, world_size: int) -> dict[str, Any]:
    model = Net()
    trainer = _trainer(world_size, max_steps=1)
    trainer.fit(model, DataLoader(_data(8), batch_size=4))
    return {
        "state": _state(model),
        "bn_types": model.bn_types,
        "bn_after": type(model.net[1]).__name__,
        "lrs_used": model.lrs_used,
    }


@pytest.mark.slow
def test_first_sgd_update_matches_one_process_on_the_concatenated_batch() -> None:
    results = run_distributed(_one_update_rank, 2)
    reference = Net()
    optimizer = torch.optim.SGD(
        [
            {"params": reference.net[0].parameters(), "lr": 2 * BASE_LR},
            {"params": reference.net[1:].parameters(), "lr": 2 * BASE_LR / 10},
        ],
    )
    x, y = _data(8)[:]
    F.mse_loss(reference.net(x), y).backward()  # plain BatchNorm over all 8 samples
    optimizer.step()
    expected = _state(reference)
    for result in results:
        assert result["bn_types"] == ["SyncBatchNorm"]  # synchronized while fitting ...
        assert result["bn_after"] == "BatchNorm1d"  # ... and the user's class again after teardown
        assert result["lrs_used"] == [[2 * BASE_LR, 2 * BASE_LR / 10]]  # factor = world_size = 2, ratios kept
        for name, value in result["state"].items():
            torch.testing.assert_close(value, expected[name], **EXACT, msg=name)


# ---- the learning rate used at step 0 and after k steps, per scheduler and policy
def _schedules_rank(rank: int, world_size: int) -> dict[str, list[list[float]]]:
    used = {}
    for scheduler in ("onecycle", "plateau"):
        for policy in ("linear", "sqrt"):
            model = Net(scheduler)
            trainer = _trainer(
                world_size,
                strategy=LRScaledDDPStrategy(lr_scaling=policy, reference_batch_size=2),
                max_epochs=4,
                limit_train_batches=2,
            )
            trainer.fit(model, DataLoader(_data(8), batch_size=2))
            used[f"{scheduler}-{policy}"] = model.lrs_used
    return used


def _unscaled_lrs_used(scheduler: str, steps: int) -> list[list[float]]:
    """What a single process without scaling uses, stepping the scheduler the way Lightning does."""
    model = Net(scheduler)
    config = model.configure_optimizers()
    optimizer = config if isinstance(config, torch.optim.Optimizer) else config["optimizer"]
    lr_scheduler = None if isinstance(config, torch.optim.Optimizer) else config["lr_scheduler"]["scheduler"]
    used = []
    for step in range(steps):
        used.append([group["lr"] for group in optimizer.param_groups])
        optimizer.step()
        if isinstance(lr_scheduler, torch.optim.lr_scheduler.OneCycleLR):
            lr_scheduler.step()
        elif lr_scheduler is not None and step % 2 == 1:  # epoch end (2 steps per epoch)
            lr_scheduler.step(1.0)
    return used


@pytest.mark.slow
def test_lr_at_step_zero_and_after_k_steps_is_factor_times_unscaled() -> None:
    results = run_distributed(_schedules_rank, 2)
    # effective batch = 2 per device x 2 ranks = 4 against reference 2: linear factor 2, sqrt factor sqrt(2)
    for key, used in results[0].items():
        scheduler, policy = key.split("-")
        factor = 2.0 if policy == "linear" else math.sqrt(2.0)
        expected = _unscaled_lrs_used(scheduler, steps=len(used))
        assert len(used) == 8
        for step, (got, want) in enumerate(zip(used, expected, strict=True)):
            assert got == pytest.approx([factor * lr for lr in want], rel=1e-12), f"{key} step {step}"
    assert results[0] == results[1]


# ---- resume
def _resume_rank(rank: int, world_size: int, checkpoint_dir: str) -> dict[str, Any]:
    loader = DataLoader(_data(16), batch_size=2)
    # 4 steps per epoch; the checkpoint is taken at the epoch boundary (Lightning restarts a dataloader from its start)
    uninterrupted = Net("onecycle")
    _trainer(world_size, max_epochs=2).fit(uninterrupted, loader)

    first = Net("onecycle")
    trainer = _trainer(world_size, max_epochs=1)
    trainer.fit(first, loader)
    path = os.path.join(checkpoint_dir, "two_ranks.ckpt")
    trainer.save_checkpoint(path)
    resumed = Net("onecycle")
    _trainer(world_size, max_epochs=2).fit(resumed, loader, ckpt_path=path)
    return {
        "uninterrupted": (_state(uninterrupted), uninterrupted.lrs_used),
        "resumed": (_state(resumed), first.lrs_used + resumed.lrs_used),
    }


def _resume_single_rank(rank: int, world_size: int, checkpoint_dir: str) -> list[list[float]]:
    resumed = Net("onecycle")
    _trainer(world_size, max_steps=6).fit(
        resumed, DataLoader(_data(16), batch_size=2), ckpt_path=os.path.join(checkpoint_dir, "two_ranks.ckpt")
    )
    return resumed.lrs_used


@pytest.fixture(scope="module")
def two_rank_resume(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    """The results of ``_resume_rank`` on 2 ranks, and the checkpoint they wrote after one epoch (factor 2)."""
    checkpoint_dir = tmp_path_factory.mktemp("two_ranks")
    return run_distributed(_resume_rank, 2, str(checkpoint_dir)), checkpoint_dir / "two_ranks.ckpt"


@pytest.mark.slow
def test_resume_equals_uninterrupted_and_rescales_on_another_world_size(
    two_rank_resume: tuple[list[dict[str, Any]], Path],
) -> None:
    results, checkpoint = two_rank_resume
    for result in results:
        state, lrs = result["uninterrupted"]
        resumed_state, resumed_lrs = result["resumed"]
        assert resumed_lrs == lrs  # no double scaling after the restore
        for name, value in state.items():
            torch.testing.assert_close(resumed_state[name], value, rtol=0, atol=0, msg=name)

    # the same checkpoint resumed by a single process: factor 2 -> 1, so every learning rate halves
    single = run_distributed(_resume_single_rank, 1, str(checkpoint.parent))[0]
    two_ranks_lrs = results[0]["uninterrupted"][1]
    assert len(single) == 2
    for got, two_ranks in zip(single, two_ranks_lrs[4:6], strict=True):
        assert got == pytest.approx([lr / 2 for lr in two_ranks], rel=1e-12)


class UnscaledOnResume(Net):
    """Takes the advice of the warning: back to the base learning rates once the optimizer state is restored."""

    def on_train_start(self) -> None:
        schedulers = [config.scheduler for config in self.trainer.lr_scheduler_configs]
        for optimizer in self.trainer.optimizers:
            lightning_balanced.unscale_learning_rates(optimizer, schedulers)


# Resumed in this process at 4 samples per step (balanced_dp splits them [2, 2]) up to step 6: steps 4 and 5 run.
# Unmanaged, they use the checkpoint's learning rates, 2x the base schedule; after unscaling, the base schedule itself,
# computed by a single process without any scaling (_unscaled_lrs_used). 1e-12: the same float operations in the same
# order, up to the factor's exact power-of-two multiplication.
# Under balanced_dp the strategy checks; under Lightning's single-device strategy the explicit LRScaleFactorCheck does
# (added under balanced_dp too, it stays quiet: one warning, not two).
@pytest.mark.slow  # its fixture trains on 2 spawned ranks
@pytest.mark.parametrize("strategy", ["single_device", "balanced_dp", "balanced_dp+callback"])
def test_resume_under_a_strategy_that_ignores_the_factor_warns_once_and_can_be_undone(
    strategy: str, two_rank_resume: tuple[list[dict[str, Any]], Path]
) -> None:
    _, checkpoint = two_rank_resume
    base = _unscaled_lrs_used("onecycle", steps=6)[4:6]
    for model, expected in (
        (Net("onecycle"), [[2 * lr for lr in lrs] for lrs in base]),
        (UnscaledOnResume("onecycle"), base),
    ):
        balanced = strategy.startswith("balanced_dp")
        trainer = quiet_trainer(
            BalancedDataParallelStrategy() if balanced else "auto",
            2 if balanced else 1,
            max_steps=6,
            callbacks=[] if strategy == "balanced_dp" else [LRScaleFactorCheck()],
        )
        with pytest.warns(LRScaleFactorWarning) as warned:
            trainer.fit(model, DataLoader(_data(16), batch_size=4), ckpt_path=checkpoint)
        messages = [str(w.message) for w in warned if issubclass(w.category, LRScaleFactorWarning)]
        assert len(messages) == 1
        assert "optimizer 0: 2" in messages[0] and "unscale_learning_rates" in messages[0]
        assert len(model.lrs_used) == 2
        for got, want in zip(model.lrs_used, expected, strict=True):
            assert got == pytest.approx(want, rel=1e-12)


# ---- warmup and lr_find
def _warmup_and_lr_find_rank(rank: int, world_size: int) -> dict[str, Any]:
    loader = DataLoader(_data(32), batch_size=2)
    warm = Net()
    _trainer(world_size, strategy=LRScaledDDPStrategy(warmup_steps=4), max_steps=6).fit(warm, loader)
    warm_lrs_after = [g["lr"] for g in warm.trainer.optimizers[0].param_groups]

    from lightning.pytorch.tuner import Tuner

    tuned = Net()
    trainer = _trainer(world_size, max_steps=3)
    finder = Tuner(trainer).lr_find(tuned, train_dataloaders=loader, num_training=8, min_lr=1e-4, max_lr=1.0)
    suggestion = tuned.lr
    trainer = _trainer(world_size, max_steps=1)
    trainer.fit(tuned, loader)
    return {
        "warm": warm.lrs_used,
        "warm_after": warm_lrs_after,
        "suggestion": suggestion,
        "tuned_used": tuned.lrs_used,
        "finder_lrs": finder.results["lr"] if finder else None,
    }


@pytest.mark.slow
def test_warmup_rises_to_the_scaled_lr_and_lr_find_is_not_scaled_twice() -> None:
    result = run_distributed(_warmup_and_lr_find_rank, 2)[0]
    # factor 2 (world size 2), 4 warmup steps: the multiplier on the scaled LR goes 1/2 -> 1 in equal steps of 1/8
    # (Goyal et al.'s gradual warmup), then stays 1.
    multipliers = [0.5, 0.625, 0.75, 0.875, 1.0, 1.0]
    assert len(result["warm"]) == len(multipliers)
    for used, multiplier in zip(result["warm"], multipliers, strict=True):
        assert used == pytest.approx([2 * BASE_LR * multiplier, 2 * BASE_LR / 10 * multiplier], rel=1e-12)
    assert result["warm"][0] == pytest.approx([BASE_LR, BASE_LR / 10])  # warmup starts at the unscaled base
    assert result["warm_after"] == pytest.approx([2 * BASE_LR, 2 * BASE_LR / 10])  # the schedule's own value kept
    # the finder swept its own absolute range, and its suggestion is used as is (it was found at this batch)
    assert result["finder_lrs"][0] == pytest.approx(1e-4, rel=1e-6)
    assert result["tuned_used"][0][0] == pytest.approx(result["suggestion"], rel=1e-12)


# ---- launching
def test_registered_names_pick_policy_and_launcher() -> None:
    assert "ddp_lr_linear" in lightning_balanced.register_strategies()
    for name, policy, start_method in [
        ("ddp_lr_linear", "linear", "popen"),
        ("ddp_spawn_lr_sqrt", "sqrt", "spawn"),
        ("ddp_fork_lr_linear", "linear", "fork"),
    ]:
        strategy = StrategyRegistry.get(name)
        assert isinstance(strategy, LRScaledDDPStrategy)
        assert (strategy.lr_scaling, strategy._start_method) == (policy, start_method)


class LoggedLR(Net):
    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"])
        return super().training_step(batch, batch_idx)


@pytest.mark.slow
def test_ddp_spawn_launcher_scales_the_lr() -> None:
    trainer = quiet_trainer("ddp_spawn_lr_sqrt", 2, max_steps=1)
    trainer.fit(LoggedLR(), DataLoader(_data(8), batch_size=4))
    assert trainer.callback_metrics["lr"].item() == pytest.approx(BASE_LR * math.sqrt(2), rel=1e-6)


@pytest.mark.parametrize("launcher", ["lightning_subprocess", "torchrun"])
@pytest.mark.slow
def test_script_launchers_scale_the_lr(launcher: str, tmp_path: Path) -> None:
    output = tmp_path / "result.json"
    if launcher == "torchrun":
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            str(SCRIPT),
            str(output),
        ]
    else:
        command = [sys.executable, str(SCRIPT), str(output)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    for key in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "MASTER_PORT", "MASTER_ADDR", "NODE_RANK"):
        env.pop(key, None)
    try:
        completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240, cwd=tmp_path)
    except subprocess.TimeoutExpired as err:  # say where it stopped
        stderr = err.stderr.decode(errors="replace") if isinstance(err.stderr, bytes) else str(err.stderr or "")
        raise AssertionError(f"{launcher} job did not end within 240 s:\n{stderr[-3000:]}") from err
    assert completed.returncode == 0, completed.stderr[-3000:]
    result = json.loads(output.read_text())
    assert result["world_size"] == 2
    assert result["lr"] == pytest.approx(2 * BASE_LR, rel=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "error", "match"),
    [
        ({"lr_scaling": "cubic"}, ValueError, "lr_scaling"),
        ({"reference_batch_size": 0}, ValueError, whole_message("`reference_batch_size` must be >= 1, got 0")),
        ({"reference_batch_size": -4}, ValueError, whole_message("`reference_batch_size` must be >= 1, got -4")),
        (
            {"reference_batch_size": 2.5},
            TypeError,
            whole_message("`reference_batch_size` must be an integer, got 2.5 of type float"),
        ),
        ({"warmup_steps": -1}, ValueError, whole_message("`warmup_steps` must be >= 0, got -1")),
        ({"warmup_steps": True}, TypeError, whole_message("`warmup_steps` must be an integer, got True of type bool")),
    ],
)
def test_bad_arguments_raise_naming_them(kwargs: dict[str, Any], error: type[Exception], match: str) -> None:
    with pytest.raises(error, match=match):
        LRScaledDDPStrategy(**kwargs)


# ---- an optimizer without a learning rate: named before the first step ---------------------------------------------
class _NoLearningRate(torch.optim.Optimizer):
    """An optimizer whose param groups have no `lr` (it sets its own step size)."""

    def __init__(self, params: Any) -> None:
        super().__init__(params, {})

    def step(self, closure: Any = None) -> Any:
        return closure() if closure is not None else None


class _NoLearningRateNet(Net):
    def configure_optimizers(self) -> Any:
        return _NoLearningRate(self.parameters())


def _no_lr_rank(rank: int, world_size: int) -> str:
    trainer = _trainer(world_size, max_steps=1)
    try:
        trainer.fit(_NoLearningRateNet(), DataLoader(_data(), batch_size=4))
    except ValueError as error:
        return f"{error} (after {trainer.global_step} steps)"
    return "trained"


@pytest.mark.slow
def test_an_optimizer_without_a_learning_rate_is_named_before_the_first_step() -> None:
    assert run_distributed(_no_lr_rank, 1) == [
        "strategy='ddp_lr_linear' scales each param group's learning rate, but optimizer 0 (_NoLearningRate) has a"
        " param group without an 'lr' key: give every param group an `lr`, or use strategy='ddp' with an optimizer"
        " that sets its own step size (after 0 steps)"
    ]
