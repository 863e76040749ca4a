"""strategy="pipeline": the measured bubble against the schedules' formula, and mixed precision, on 2 gloo CPU ranks."""

from __future__ import annotations

import statistics
import time
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins import MixedPrecision
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

from lightning_balanced import PipelineStrategy
from lightning_balanced.pipelining.saved_bytes import SavedTensorBytes
from lightning_balanced.pipelining.stage_plan import SCHEDULES
from tests.distributed import run_distributed
from tests.helpers import quiet_trainer

FORWARD_S = 0.05  # each stage's forward per micro-batch; its backward takes twice as long, as a matmul's does


class _Sleep(torch.autograd.Function):
    """A stand-in for a GPU kernel: the time passes without taking one of the machine's few cores."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, forward_s: float, backward_s: float) -> torch.Tensor:
        ctx.backward_s = backward_s
        time.sleep(forward_s)
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        time.sleep(ctx.backward_s)
        return grad, None, None


class _SleepyLayer(nn.Module):
    """Forward ``FORWARD_S``, backward twice that, all of it on the activations' path."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _Sleep.apply(self.linear(x), FORWARD_S, 2 * FORWARD_S)  # type: ignore[no-any-return]


class _SplitLayer(nn.Module):
    """``x @ W``: forward ``FORWARD_S``; backward ``FORWARD_S`` for the input's gradient and as much for the weight's,
    which the zero-bubble schedules defer into the bubble."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.eye(4) + 0.01 * torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        half = FORWARD_S / 2
        return _Sleep.apply(x, half, FORWARD_S) @ _Sleep.apply(self.weight, half, FORWARD_S)  # type: ignore[no-any-return]


class _Regressor(pl.LightningModule):
    def __init__(self, sequential: nn.Sequential) -> None:
        super().__init__()
        self.sequential_module = sequential

    def compute_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output.float(), target)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return self.compute_loss(self.sequential_module(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class _Metrics(Callback):
    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []

    def on_train_batch_end(self, trainer: pl.Trainer, *args: Any) -> None:
        self.steps.append({name: float(value) for name, value in trainer.callback_metrics.items()})


def _bubble_rank(
    rank: int, world_size: int, schedules: list[str], split: bool = False
) -> dict[str, list[dict[str, float]]]:
    results = {}
    for schedule in schedules:
        torch.manual_seed(0)
        layers = [_SplitLayer() for _ in range(4)] if split else [_SleepyLayer(), _SleepyLayer()]
        model = _Regressor(nn.Sequential(*layers))
        metrics = _Metrics()
        trainer = quiet_trainer(
            PipelineStrategy(schedule=schedule, chunks=4), world_size, max_steps=4, callbacks=[metrics]
        )
        data = TensorDataset(torch.randn(32, 4), torch.randn(32, 4))
        trainer.fit(model, DataLoader(data, batch_size=8))
        results[schedule] = metrics.steps
    return results


@pytest.mark.slow
def test_the_measured_bubble_is_the_schedules_formula_when_stages_are_equal() -> None:
    schedules = [name for name in ("GPipe", "1F1B") if SCHEDULES[name].available()]
    results = run_distributed(_bubble_rank, 2, schedules, timeout_s=300)
    theory = 1 / 5  # (p - 1) / (m + p - 1) for p = 2, m = 4
    for schedule in schedules:
        steps = results[0][schedule]
        assert [step["pipeline/bubble_theory"] for step in steps] == [pytest.approx(theory)] * 4
        # Every rank logs every rank's bubble, the same numbers: the ranks' times travel in one all_reduce.
        assert steps == results[1][schedule]
        for rank in range(2):
            # The first step builds the stages' buffers; the median of the rest: no schedule idles less than its
            # formula (3 points for the clock's noise), and the host's own work between the sleeps only adds idle time
            # on a busy machine (measured 0.22-0.24 there, 0.20-0.22 on a quiet one): 10 points above. A bubble
            # computed wrongly (the busy fraction, or against the rank's own step) is off by far more.
            measured = statistics.median(step[f"pipeline/bubble_rank{rank}"] for step in steps[1:])
            assert theory - 0.03 <= measured <= theory + 0.1, (schedule, rank, steps)


@pytest.mark.skipif(
    not (SCHEDULES["1F1B"].available() and SCHEDULES["ZBVZeroBubble"].available()),
    reason="1F1B runs under strategy='pipeline' from torch 2.8, ZBVZeroBubble from 2.13",
)
@pytest.mark.slow
def test_a_zero_bubble_schedule_measures_a_smaller_bubble_than_1f1b() -> None:
    # The same 4 layers on 2 ranks, each layer's backward half input gradient, half weight gradient: 1F1B runs both
    # halves together, ZBVZeroBubble (two stages per rank, V-shaped) moves weight gradients into the bubble.
    results = run_distributed(_bubble_rank, 2, ["1F1B", "ZBVZeroBubble"], True, timeout_s=300)
    measured = {
        name: statistics.median(step["pipeline/bubble"] for step in results[0][name][1:])
        for name in ("1F1B", "ZBVZeroBubble")
    }
    assert measured["ZBVZeroBubble"] < measured["1F1B"] - 0.03, measured
    assert "pipeline/bubble_theory" not in results[0]["ZBVZeroBubble"][-1]  # no formula for zero-bubble schedules


class _SavedBytes(Callback):
    """The peak of the activations saved for backward in each training step, on this rank (its stages only).

    The batch itself is left out with the parameters: stage 0's micro-batches are views of it, which it holds anyway.
    """

    def __init__(self) -> None:
        self.peaks: list[int] = []
        self._meter: SavedTensorBytes | None = None

    def on_train_batch_start(self, trainer: pl.Trainer, module: pl.LightningModule, batch: Any, *args: Any) -> None:
        self._meter = SavedTensorBytes(exclude=[*module.parameters(), *batch]).__enter__()

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        assert self._meter is not None
        self._meter.__exit__(None, None, None)
        self.peaks.append(self._meter.peak)


def _activation_memory_rank(rank: int, world_size: int, schedules: list[str]) -> dict[str, list[int]]:
    peaks = {}
    for schedule in schedules:
        torch.manual_seed(0)
        layers = [layer for _ in range(4) for layer in (nn.Linear(32, 32), nn.Tanh())]
        saved = _SavedBytes()
        trainer = quiet_trainer(
            PipelineStrategy(schedule=schedule, chunks=16, log_bubble=False), world_size, max_steps=2, callbacks=[saved]
        )
        data = TensorDataset(torch.randn(128, 32), torch.randn(128, 32))
        trainer.fit(_Regressor(nn.Sequential(*layers)), DataLoader(data, batch_size=64))
        peaks[schedule] = saved.peaks
    return peaks


@pytest.mark.skipif(not SCHEDULES["1F1B"].available(), reason="1F1B runs under strategy='pipeline' from torch 2.8")
@pytest.mark.slow
def test_1f1b_keeps_p_over_m_of_gpipes_activations_on_stage_0() -> None:
    # p = 4 ranks, m = 16 micro-batches: GPipe keeps all 16 micro-batches' activations on stage 0 until its backward,
    # 1F1B at most p = 4 of them (Narayanan et al., 2021).
    results = run_distributed(_activation_memory_rank, 4, ["GPipe", "1F1B"], timeout_s=300)
    gpipe, one_f_one_b = results[0]["GPipe"], results[0]["1F1B"]
    assert gpipe[0] == gpipe[1] > 0 and one_f_one_b[0] == one_f_one_b[1] > 0
    assert one_f_one_b[0] <= 4 / 16 * gpipe[0] * 1.1, (one_f_one_b, gpipe)


def _mixed_precision_rank(rank: int, world_size: int, plugin: str, one_stage: bool = False) -> dict[str, Any]:
    return _fit_mixed(PipelineStrategy(chunks=4), world_size, plugin, one_stage)


def _precision(plugin: str, init_scale: float = 2.0**24) -> dict[str, Any]:
    if plugin == "bf16-mixed":
        return {"precision": "bf16-mixed"}
    # 16-mixed with a GradScaler on CPU (Lightning's Trainer(precision="16-mixed") asks for a GPU); the initial scale
    # overflows float16 so that the first steps are skipped and the scale backs off, as on a GPU.
    return {"plugins": [MixedPrecision("16-mixed", "cpu", torch.amp.GradScaler("cpu", init_scale=init_scale))]}


def _fit_mixed(strategy: Any, devices: int, plugin: str, one_stage: bool = False) -> dict[str, Any]:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if one_stage:
        # Two stages of one Linear each, whose float16 gradients overflow on the last stage only: activations of ~1e3
        # into weights of ~1e-5 give the last weight's gradient ~1e3 x the scaled output gradient (inf), and the
        # first stage an input gradient 1e5 times smaller (finite).
        first, last = nn.Linear(5, 16), nn.Linear(16, 3)
        with torch.no_grad():
            first.weight.mul_(1e3)
            last.weight.mul_(1e-5)
        model = _Regressor(nn.Sequential(first, last))
        data = TensorDataset(torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g))
    else:
        model = _Regressor(nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3)))
        data = TensorDataset(torch.randn(8, 5, generator=g) * 1e3, torch.randn(8, 3, generator=g))  # one batch
    # one_stage: an initial scale that keeps the output's gradient finite in float16 (~1e3) and the last weight's not
    precision = _precision(plugin, init_scale=2.0**14 if one_stage else 2.0**24)
    trainer = quiet_trainer(strategy, devices, max_steps=4, accelerator="cpu", **precision)
    trainer.fit(model, DataLoader(data, batch_size=8))
    scaler = getattr(trainer.precision_plugin, "scaler", None)
    return {
        "state": {name: value.detach().clone() for name, value in model.state_dict().items()},
        "scale": None if scaler is None else scaler.get_scale(),
    }


@pytest.mark.parametrize("plugin", ["bf16-mixed", "16-mixed"])
@pytest.mark.slow
def test_mixed_precision_trains_as_one_process_does(plugin: str) -> None:
    if plugin == "16-mixed" and not hasattr(torch.amp, "GradScaler"):
        pytest.skip("torch.amp.GradScaler (for CPU) is in torch 2.3 and later")
    expected = _fit_mixed("auto", 1, plugin)
    ranks = run_distributed(_mixed_precision_rank, 2, plugin, timeout_s=300)
    for rank in ranks:
        # Micro-batches of 2 against the batch of 8: the same products, rounded to bfloat16/float16 in other sums.
        # Activations sent in float32 where autocast made them half (the bug this catches) differ by 0.06.
        for name, value in rank["state"].items():
            torch.testing.assert_close(value, expected["state"][name], rtol=0, atol=1e-3, msg=f"{plugin} {name}")
        assert rank["scale"] == expected["scale"]  # every rank skipped the same steps as one process did


@pytest.mark.skipif(
    not hasattr(torch.amp, "GradScaler"), reason="torch.amp.GradScaler (for CPU) is in torch 2.3 and later"
)
@pytest.mark.slow
def test_an_overflow_on_one_stage_skips_the_step_on_every_rank() -> None:
    expected = _fit_mixed("auto", 1, "16-mixed", one_stage=True)
    ranks = run_distributed(_mixed_precision_rank, 2, "16-mixed", True, timeout_s=300)
    assert expected["scale"] < 2.0**14  # the reference skipped steps: the case is what it claims
    for rank in ranks:
        assert rank["scale"] == expected["scale"]  # rank 0, whose gradients stayed finite, skipped them too
        for name, value in rank["state"].items():
            torch.testing.assert_close(value, expected["state"][name], rtol=0, atol=1e-3, msg=name)
