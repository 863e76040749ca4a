"""ScaleInvariance: the rules as pure functions, and the callback on real Trainers (one process; CPU)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_balanced.batch_scaling.lr_scaling import warmup_in_samples
from lightning_balanced.batch_scaling.scale_invariance import (
    REFERENCE_KEY,
    SampleStepping,
    ScaleInvariance,
    ScalingPolicy,
    scaled_ema_momentum,
    scaled_hyperparameters,
)
from tests.helpers import quiet_trainer, raises_exactly

try:
    from lightning.pytorch.callbacks import EMAWeightAveraging
except ImportError:  # Lightning < 2.6
    EMAWeightAveraging = None


# ---- the rules -----------------------------------------------------------------------------------------------------
KAPPAS = st.sampled_from([0.25, 0.5, 1.0, 2.0, 3.0, 4.0]) | st.floats(0.25, 4.0)
RULES = st.sampled_from(["linear", "sqrt", "adam_sde"])
# Adam and RMSprop values whose decays stay above 0 at kappa up to 16 (two scalings of 4): 1 - beta <= 1/32.
REFERENCES = st.fixed_dictionaries(
    {
        "betas": st.tuples(st.floats(0.97, 0.9999), st.floats(0.97, 0.99999)),
        "alpha": st.floats(0.97, 0.9999),
        "eps": st.floats(1e-12, 1e-3),
    }
)


def _close(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return all(
        (tuple(a[k]) == pytest.approx(tuple(b[k]), rel=1e-9)) if k == "betas" else a[k] == pytest.approx(b[k], rel=1e-9)
        for k in a
    )


@settings(max_examples=200, deadline=None)
@given(RULES, KAPPAS, REFERENCES)
def test_every_rule_at_kappa_then_one_over_kappa_restores_every_value(rule: str, kappa: float, ref: Any) -> None:
    policy = ScalingPolicy(rule, ema=True)
    there = scaled_hyperparameters(ref, kappa, policy)
    assert _close(scaled_hyperparameters(there, 1 / kappa, policy), ref)
    assert policy.lr_factor(kappa) * policy.lr_factor(1 / kappa) == pytest.approx(1.0, rel=1e-12)
    momentum = 0.1
    assert scaled_ema_momentum(scaled_ema_momentum(momentum, kappa), 1 / kappa) == pytest.approx(momentum, rel=1e-9)


@settings(max_examples=200, deadline=None)
@given(RULES, KAPPAS, KAPPAS, REFERENCES, st.floats(1e-3, 0.5))
def test_every_rule_composes_kappa_one_then_two_as_their_product(
    rule: str, first: float, second: float, ref: Any, momentum: float
) -> None:
    policy = ScalingPolicy(rule, ema=True)
    twice = scaled_hyperparameters(scaled_hyperparameters(ref, first, policy), second, policy)
    assert _close(twice, scaled_hyperparameters(ref, first * second, policy))
    assert policy.lr_factor(first) * policy.lr_factor(second) == pytest.approx(policy.lr_factor(first * second))
    assert scaled_ema_momentum(scaled_ema_momentum(momentum, first), second) == pytest.approx(
        scaled_ema_momentum(momentum, first * second), rel=1e-9
    )


def test_adam_sde_rule_scales_one_minus_beta_by_kappa_and_eps_by_one_over_sqrt_kappa() -> None:
    policy = ScalingPolicy.parse("adam_sde")
    scaled = scaled_hyperparameters({"betas": (0.9, 0.999), "eps": 1e-8}, 4.0, policy)
    assert scaled["betas"] == pytest.approx((1 - 4 * 0.1, 1 - 4 * 0.001))
    assert scaled["eps"] == pytest.approx(1e-8 / 2)
    assert scaled_hyperparameters({"alpha": 0.99, "eps": 1e-8}, 0.5, policy)["alpha"] == pytest.approx(1 - 0.5 * 0.01)
    assert policy.lr_factor(4.0) == 2.0
    # the other learning-rate rules leave them alone
    assert scaled_hyperparameters({"betas": (0.9, 0.999)}, 4.0, ScalingPolicy.parse("sqrt")) == {"betas": (0.9, 0.999)}
    assert ScalingPolicy.parse("linear").lr_factor(4.0) == 4.0


def test_ema_rule_raises_the_decay_to_the_power_kappa() -> None:
    assert scaled_ema_momentum(0.1, 2.0) == pytest.approx(1 - 0.9**2)
    assert scaled_ema_momentum(0.1, 1.0) == pytest.approx(0.1)
    assert scaled_ema_momentum(0.1, 0.5) == pytest.approx(1 - 0.9**0.5)


def test_a_batch_too_large_for_beta_is_refused_naming_it() -> None:
    with raises_exactly(
        ValueError,
        "the adam_sde rule gives `betas[0]` = 1 - 20 x (1 - 0.9) = -1 for a batch 20 times the reference one; it"
        " must stay above 0: use a larger reference_batch_size, or a decay closer to 1",
    ):
        scaled_hyperparameters({"betas": (0.9, 0.999)}, 20.0, ScalingPolicy.parse("adam_sde"))


@pytest.mark.parametrize(
    ("policy", "message"),
    [
        (
            "ema",
            "`policy` must name exactly one learning-rate rule of ['linear', 'sqrt', 'adam_sde'], optionally with"
            " 'ema', got 'ema'",
        ),
        (
            ["linear", "sqrt"],
            "`policy` must name exactly one learning-rate rule of ['linear', 'sqrt', 'adam_sde'],"
            " optionally with 'ema', got ['linear', 'sqrt']",
        ),
        (
            "lars",
            "`policy` must name exactly one learning-rate rule of ['linear', 'sqrt', 'adam_sde'], optionally with"
            " 'ema', got 'lars'",
        ),
    ],
)
def test_bad_policies_are_refused_naming_the_rules(policy: Any, message: str) -> None:
    with raises_exactly(ValueError, message):
        ScaleInvariance(policy, reference_batch_size=8)


def test_bad_arguments_name_what_was_expected() -> None:
    with raises_exactly(ValueError, "`reference_batch_size` must be >= 1, got 0"):
        ScaleInvariance("linear", reference_batch_size=0)
    with raises_exactly(TypeError, "`schedules_in_samples` must be a bool, got 1"):
        ScaleInvariance("linear", reference_batch_size=8, schedules_in_samples=1)  # type: ignore[arg-type]


# ---- the callback --------------------------------------------------------------------------------------------------
class Net(pl.LightningModule):
    def __init__(self, optimizer: str = "adam", scheduler: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8, momentum=0.1), nn.Linear(8, 1)).double()
        self.optimizer_name, self.scheduler = optimizer, scheduler
        self.seen: list[dict[str, Any]] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        opt = self.optimizers().optimizer
        group = opt.param_groups[0]
        self.seen.append(
            {
                "lr": float(group["lr"]),
                "betas": group.get("betas"),
                "alpha": group.get("alpha"),
                "eps": group.get("eps"),
                "bn_momentum": self.net[1].momentum,
            }
        )
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> Any:
        params = self.parameters()
        optimizer: torch.optim.Optimizer = {
            "adam": lambda: torch.optim.Adam(params, lr=0.01, betas=(0.9, 0.999), eps=1e-8),
            "rmsprop": lambda: torch.optim.RMSprop(params, lr=0.01, alpha=0.99, eps=1e-8),
            "sgd": lambda: torch.optim.SGD(params, lr=0.1),
        }[self.optimizer_name]()
        if not self.scheduler:
            return optimizer
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=4, gamma=0.5)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}


def _data(n: int = 64) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(n, 4, generator=g, dtype=torch.float64), torch.randn(n, 1, generator=g, dtype=torch.float64)
    )


def _fit(model: Net, callbacks: list[Callback], batch_size: int, **kwargs: Any) -> pl.Trainer:
    settings: dict[str, Any] = {"max_steps": 2, "callbacks": callbacks}
    settings.update(kwargs)
    trainer = quiet_trainer("auto", 1, **settings)  # a CPU Trainer, also on a machine with a GPU
    trainer.fit(model, DataLoader(_data(), batch_size=batch_size))
    return trainer


def test_adam_sde_and_ema_at_four_times_the_batch(caplog: pytest.LogCaptureFixture) -> None:
    model = Net("adam")
    with caplog.at_level("INFO"):
        _fit(
            model,
            [ScaleInvariance(["adam_sde", "ema"], reference_batch_size=8)],
            batch_size=16,
            accumulate_grad_batches=2,
        )
    seen = model.seen[0]  # kappa = 16 x 2 accumulated / 8 = 4
    assert seen["lr"] == pytest.approx(0.01 * 2)
    assert seen["betas"] == pytest.approx((0.6, 0.996))
    assert seen["eps"] == pytest.approx(0.5e-8)
    assert seen["bn_momentum"] == pytest.approx(1 - 0.9**4)
    assert model.net[1].momentum == 0.1  # the reference again after fit
    log = caplog.text
    assert "scale invariance (adam_sde + ema): kappa 4 = effective batch 32 / reference 8" in log
    assert "optimizer 0 group 0 lr: 0.01 -> 0.02 (Malladi et al. 2022 (SDE rule for adaptive methods))" in log
    assert "net.1 BatchNorm momentum: 0.1 -> 0.3439 (Busbridge et al. 2023 (EMA rule))" in log


def test_rmsprop_alpha_and_eps_follow_the_sde_rule() -> None:
    model = Net("rmsprop")
    _fit(model, [ScaleInvariance("adam_sde", reference_batch_size=32)], batch_size=16)
    seen = model.seen[0]  # kappa = 1/2
    assert seen["lr"] == pytest.approx(0.01 / math.sqrt(2))
    assert seen["alpha"] == pytest.approx(1 - 0.5 * 0.01)
    assert seen["eps"] == pytest.approx(1e-8 * math.sqrt(2))
    assert seen["bn_momentum"] == 0.1  # no ema rule


def test_a_resume_on_another_scale_rescales_from_the_reference_without_compounding(tmp_path: Path) -> None:
    model = Net("adam")
    # One whole epoch (64 samples in batches of 32): an end-of-epoch checkpoint.
    trainer = _fit(
        model, [ScaleInvariance("adam_sde", reference_batch_size=8)], batch_size=32, max_steps=-1, max_epochs=1
    )
    path = tmp_path / "scaled.ckpt"
    trainer.save_checkpoint(path)
    saved = torch.load(path, weights_only=False)["optimizer_states"][0]["param_groups"][0]
    assert saved[REFERENCE_KEY] == {"betas": (0.9, 0.999), "eps": 1e-8}  # the reference travels with the checkpoint
    resumed = Net("adam")
    quiet_trainer("auto", 1, max_epochs=2, callbacks=[ScaleInvariance("adam_sde", reference_batch_size=8)]).fit(
        resumed, DataLoader(_data(), batch_size=16), ckpt_path=path
    )
    seen = resumed.seen[0]  # kappa 2 now, from the reference: not 4 x 2
    assert seen["lr"] == pytest.approx(0.01 * math.sqrt(2))
    assert seen["betas"] == pytest.approx((0.8, 0.998))
    assert seen["eps"] == pytest.approx(1e-8 / math.sqrt(2))


def test_schedules_count_reference_batches_and_warmup_counts_samples() -> None:
    model = Net("sgd", scheduler=True)
    callback = ScaleInvariance("linear", reference_batch_size=8, warmup_samples=64, schedules_in_samples=True)
    trainer = _fit(model, [callback], batch_size=16, max_steps=4)
    lrs = [seen["lr"] for seen in model.seen]
    # kappa 2: lr 0.2; step k consumes samples [16k, 16k + 16) and takes the ramp s / 64 at their middle;
    # StepLR(step_size=4) advances 2 of its steps per optimizer step, so it halves after 2 optimizer steps.
    warm = [(16 * step + 8) / 64 for step in range(4)]
    scheduled = [0.2, 0.2, 0.1, 0.1]
    assert lrs == pytest.approx([w * s for w, s in zip(warm, scheduled, strict=True)])
    assert isinstance(trainer.lr_scheduler_configs[0].scheduler, SampleStepping)
    assert trainer.lr_scheduler_configs[0].scheduler.last_epoch == 8  # 4 optimizer steps x kappa 2
    assert callback.samples_seen == 64


@pytest.mark.parametrize("batch_size", [8, 16, 32])
def test_the_warmup_gives_every_scale_the_same_learning_rate_per_sample(batch_size: int) -> None:
    # kappa 1, 2 and 4 over the same 128 samples: the warmup runs at kappa 1 too, and the sum of lr x batch over the
    # steps (the learning rate each sample saw) is the ramp's integral, the same on every scale.
    model = Net("sgd")
    callback = ScaleInvariance("linear", reference_batch_size=8, warmup_samples=96)
    _fit(model, [callback], batch_size=batch_size, max_steps=128 // batch_size)
    kappa = batch_size / 8
    per_sample = sum(seen["lr"] / kappa * batch_size for seen in model.seen)  # in units of the reference lr
    ramp = 0.1 * (96 / 2 + (128 - 96))  # the integral of 0.1 x min(1, s / 96) over s in [0, 128)
    assert per_sample == pytest.approx(ramp, rel=1e-12)
    assert model.seen[0]["lr"] == pytest.approx(0.1 * kappa * (batch_size / 2) / 96)


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 64), st.integers(1, 40), st.integers(0, 2000))
def test_warmup_in_samples_is_the_ramps_mean_over_each_steps_samples(batch: int, steps: int, warmup: int) -> None:
    total = sum(warmup_in_samples(step * batch, batch, warmup) * batch for step in range(steps))
    end = steps * batch
    integral = float(end) if warmup == 0 else min(end, warmup) ** 2 / (2 * warmup) + max(0, end - warmup)
    assert total == pytest.approx(integral, rel=1e-12)


def test_a_resume_on_another_scale_continues_the_warmup_where_it_was(tmp_path: Path) -> None:
    first = Net("sgd")
    trainer = _fit(first, [ScaleInvariance("linear", reference_batch_size=8, warmup_samples=64)], 8, max_steps=4)
    path = tmp_path / "warm.ckpt"
    trainer.save_checkpoint(path)
    assert torch.load(path, weights_only=False)["callbacks"]["ScaleInvariance"] == {"samples_seen": 32.0}
    resumed = Net("sgd")
    callback = ScaleInvariance("linear", reference_batch_size=8, warmup_samples=64)
    quiet_trainer("auto", 1, max_steps=6, callbacks=[callback]).fit(
        resumed, DataLoader(_data(), batch_size=16), ckpt_path=path
    )
    # kappa 2 now (lr 0.2): samples [32, 48) and [48, 64) of the same 64-sample ramp, not steps 4 and 5 x 16
    assert [seen["lr"] for seen in resumed.seen] == pytest.approx([0.2 * 40 / 64, 0.2 * 56 / 64])
    assert callback.samples_seen == 64


@pytest.mark.skipif(EMAWeightAveraging is None, reason="needs Lightning's EMAWeightAveraging (Lightning >= 2.6)")
def test_the_decay_of_lightnings_ema_weight_averaging_follows_the_ema_rule() -> None:
    ema = EMAWeightAveraging(decay=0.9)
    decays: list[float] = []

    class Probe(Callback):
        def on_train_batch_start(self, *args: Any) -> None:
            decays.append(ema._kwargs["avg_fn"].__wrapped__.__closure__[0].cell_contents)

    _fit(Net("sgd"), [ScaleInvariance(["linear", "ema"], reference_batch_size=8), ema, Probe()], batch_size=24)
    assert decays[0] == pytest.approx(0.9**3)
    assert ema._kwargs["avg_fn"].__wrapped__.__closure__[0].cell_contents == pytest.approx(0.9)  # back after fit


@pytest.mark.parametrize("factory", ["get_ema_multi_avg_fn", "get_ema_avg_fn"])
def test_the_decay_of_a_torch_averaged_model_follows_the_ema_rule(factory: str) -> None:
    # The EMA of Lightning < 2.6: torch's AveragedModel, held by the LightningModule and updated after each step.
    from torch.optim import swa_utils

    class WithEma(Net):
        def __init__(self) -> None:
            super().__init__("sgd")
            make = getattr(swa_utils, factory)
            option = "multi_avg_fn" if factory == "get_ema_multi_avg_fn" else "avg_fn"
            self.ema = swa_utils.AveragedModel(self.net, **{option: make(0.9)})
            self.option, self.decays = option, []

        def on_train_batch_end(self, *args: Any) -> None:
            update = getattr(self.ema, self.option)
            self.decays.append(getattr(update, "__wrapped__", update).__closure__[0].cell_contents)
            self.ema.update_parameters(self.net)

    model = WithEma()
    _fit(model, [ScaleInvariance(["linear", "ema"], reference_batch_size=8)], batch_size=24)
    assert model.decays == [pytest.approx(0.9**3)] * 2
    update = getattr(model.ema, model.option)
    assert getattr(update, "__wrapped__", update).__closure__[0].cell_contents == pytest.approx(0.9)  # back after fit


def test_with_an_lr_scaled_ddp_strategy_the_run_is_refused_never_scaled_twice() -> None:
    from types import SimpleNamespace

    from lightning_balanced import LRScaledDDPStrategy

    trainer = SimpleNamespace(strategy=LRScaledDDPStrategy(lr_scaling="linear"))  # what on_fit_start reads
    with raises_exactly(
        ValueError,
        "ScaleInvariance and LRScaledDDPStrategy(lr_scaling='linear') both scale the learning rate: use"
        " `strategy='ddp'` with the callback, or the strategy alone (a `ddp_lr_*` name is the shorthand of"
        " ScaleInvariance('linear' or 'sqrt') for the learning rate only)",
    ):
        ScaleInvariance("linear", reference_batch_size=8).on_fit_start(trainer, Net("sgd"))  # type: ignore[arg-type]
    ScaleInvariance("linear", reference_batch_size=8).on_fit_start(
        SimpleNamespace(strategy=LRScaledDDPStrategy(lr_scaling="none")),
        Net("sgd"),  # type: ignore[arg-type]
    )


# ---- several processes: the effective batch counts the data-parallel world ----------------------------------------
class Plain(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 1)).double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.01)


def _ddp_rank(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    from tests.helpers import quiet_trainer

    model = Plain()
    callback = ScaleInvariance("adam_sde", reference_batch_size=8, warmup_samples=64)
    quiet_trainer("ddp", world_size, max_steps=3, callbacks=[callback]).fit(model, DataLoader(_data(), batch_size=8))
    assert callback.kappa == 2.0  # 2 processes x 8
    assert callback.samples_seen == 48  # both ranks' samples
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _two_rank_replay(model: Plain) -> tuple[torch.optim.Optimizer, list[list[int]]]:
    """For a one-process replay of 2 DDP ranks at kappa 2: Adam with the SDE rule's values, and each rank's order."""
    from torch.utils.data import DistributedSampler

    from tests.distributed import lightning_sampler_seed

    optimizer = torch.optim.Adam(
        model.parameters(), lr=0.01 * math.sqrt(2), betas=(0.8, 0.998), eps=1e-8 / math.sqrt(2)
    )
    data = _data()
    orders = [
        list(DistributedSampler(data, num_replicas=2, rank=r, shuffle=True, seed=lightning_sampler_seed()))
        for r in range(2)
    ]
    return optimizer, orders


@pytest.mark.slow
def test_two_processes_train_as_one_process_on_their_joint_batch() -> None:
    from tests.distributed import run_distributed

    results = run_distributed(_ddp_rank, 2)
    # One process, batch 16 (kappa 2 too): the samples of both ranks' batches, in DDP's order; the warmup counts the
    # samples of both ranks: step k takes the 64-sample ramp at the middle of samples [16k, 16k + 16).
    model = Plain()
    optimizer, orders = _two_rank_replay(model)
    x, y = _data()[:]
    for step in range(3):
        rows = [order[step * 8 : (step + 1) * 8] for order in orders]
        optimizer.param_groups[0]["lr"] = 0.01 * math.sqrt(2) * (16 * step + 8) / 64
        optimizer.zero_grad()
        # DDP averages the two ranks' mean losses: the mean over the 16 samples.
        (sum(F.mse_loss(model.net(x[r]), y[r]) for r in rows) / 2).backward()
        optimizer.step()
    for rank in results:
        for name, value in rank.items():
            torch.testing.assert_close(value, model.state_dict()[name], rtol=0, atol=1e-12, msg=name)


class PlainBN(Plain):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        # No bias before BatchNorm: its gradient is zero up to rounding, which Adam would amplify to ~1e-11 steps.
        self.net = nn.Sequential(nn.Linear(4, 8, bias=False), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1)).double()


def _ddp_bn_rank(rank: int, world_size: int) -> dict[str, torch.Tensor]:
    from tests.helpers import quiet_trainer

    model = PlainBN()
    callback = ScaleInvariance(["adam_sde", "ema"], reference_batch_size=8)
    quiet_trainer("ddp", world_size, max_steps=3, callbacks=[callback]).fit(model, DataLoader(_data(), batch_size=8))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_with_the_ema_rule_batchnorm_running_statistics_average_every_ranks_batches() -> None:
    from tests.distributed import run_distributed

    results = run_distributed(_ddp_bn_rank, 2)
    # One process replays the 2 ranks' steps (kappa 2): the gradient of the mean of their losses, each rank's batch
    # normalized by its own statistics, and running statistics that are the EMA (momentum 1 - 0.9 ** 2) of the two
    # ranks' batch statistics averaged: each rank's update from the same start, then their mean.
    model = PlainBN()
    batchnorm = model.net[1]
    batchnorm.momentum = 1 - 0.9**2
    optimizer, orders = _two_rank_replay(model)
    x, y = _data()[:]
    for step in range(3):
        start = (batchnorm.running_mean.clone(), batchnorm.running_var.clone())
        updated = []
        optimizer.zero_grad()
        losses = []
        for order in orders:
            rows = order[step * 8 : (step + 1) * 8]
            batchnorm.running_mean = start[0].clone()  # new tensors: autograd saved the ones the last forward used
            batchnorm.running_var = start[1].clone()
            losses.append(F.mse_loss(model.net(x[rows]), y[rows]))
            updated.append((batchnorm.running_mean.clone(), batchnorm.running_var.clone()))
        (sum(losses) / 2).backward()
        optimizer.step()
        batchnorm.running_mean = (updated[0][0] + updated[1][0]) / 2
        batchnorm.running_var = (updated[0][1] + updated[1][1]) / 2
    # 1e-12: float64, the same operations up to the order of the two ranks' sums.
    for rank in results:
        for name, value in rank.items():
            if not name.endswith("num_batches_tracked"):
                torch.testing.assert_close(value, model.state_dict()[name], rtol=0, atol=1e-12, msg=name)
    torch.testing.assert_close(results[0]["net.1.running_mean"], results[1]["net.1.running_mean"], rtol=0, atol=0)
