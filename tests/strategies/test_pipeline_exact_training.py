"""strategy="pipeline" with gradient accumulation and with parameters outside the ``nn.Sequential``, on real gloo
CPU ranks, against the unpipelined model trained by Lightning's own loop semantics in one process.

float64: the runs differ only in how micro-batch gradients are summed (~1e-16 relative), so 1e-12 on the weights after
three SGD steps with momentum is wide, while the bugs this guards against (the sum of N batch means instead of their
mean; a loss parameter that never trains) are off by 1e-2 and more.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler

from lightning_balanced import PipelineStrategy
from lightning_balanced.pipelining.stage_plan import SCHEDULES
from tests.distributed import lightning_sampler_seed, run_distributed
from tests.helpers import quiet_trainer
from tests.reference import reference_fit
from tests.strategies.test_pipeline_strategy import LR, PipelinedRegressor, _data, _Losses

EXACT = {"rtol": 0, "atol": 1e-12}
SAMPLES = 24


class _WithLossParameters(PipelinedRegressor):
    """A head and a learned loss scale outside the ``nn.Sequential``, used by ``compute_loss`` only (as in
    Kendall et al.'s uncertainty weighting: ``mse * exp(-s) + s``)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(2)
        self.head = nn.Linear(3, 3).double()
        self.log_scale = nn.Parameter(torch.zeros((), dtype=torch.float64))

    def compute_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(self.head(output), target) * torch.exp(-self.log_scale) + self.log_scale


def _model(kind: str) -> PipelinedRegressor:
    return _WithLossParameters() if kind == "loss_parameters" else PipelinedRegressor()


def _fit_rank(rank: int, world_size: int, runs: list[dict[str, Any]]) -> list[Any]:
    results = []
    for run in runs:
        model = _model(run["model"])
        losses = _Losses()
        trainer = quiet_trainer(
            PipelineStrategy(**run["strategy"]), world_size, max_steps=3, callbacks=[losses], **run["trainer"]
        )
        trainer.fit(model, DataLoader(_data(SAMPLES), batch_size=run["batch_size"], shuffle=False))
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}
        results.append({"state": state, "losses": losses.losses, "steps": trainer.global_step})
    return results


def _reference(
    kind: str, batch_size: int, shards: int, accumulate: int, clip: float | None = None, steps: int = 3
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process, as Lightning's loop runs it: each batch's mean loss divided by ``accumulate`` and backpropagated,
    a step after every ``accumulate`` batches and after an epoch's last batch. A batch is the ``shards`` data-parallel
    shards side by side, in the order of Lightning's ``DistributedSampler`` (seeded, reshuffled each epoch)."""
    model = _model(kind)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    loss_of = lambda x, y: model.compute_loss(model.sequential_module(x), y)  # noqa: E731
    return reference_fit(
        model,
        optimizer,
        loss_of,
        _data(SAMPLES),
        steps=steps,
        batch_size=batch_size,
        shards=shards,
        accumulate=accumulate,
        clip=clip,
    )


def _assert_trained_as(ranks: list[dict[str, Any]], reference: tuple[dict[str, torch.Tensor], list[float]]) -> None:
    state, losses = reference
    for rank in ranks:
        assert rank["steps"] == 3
        for name, value in state.items():
            torch.testing.assert_close(rank["state"][name], value, **EXACT, msg=lambda m, name=name: f"{name}: {m}")
        assert rank["losses"] == pytest.approx(losses, rel=1e-12)


_SCHEDULES = [
    name
    for name in ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")
    if SCHEDULES[name].available()
]
# 24 samples in batches of 8: 3 batches an epoch, so accumulating 2 gives windows of 2, then 1 (the epoch's end).
_TWO_RANK_RUNS = [
    *(
        {
            "strategy": {"schedule": name, "chunks": 4},
            "trainer": {"accumulate_grad_batches": 2},
            "batch_size": 8,
            "model": "loss_parameters",
        }
        for name in _SCHEDULES
    ),
    {
        "strategy": {"schedule": "GPipe", "chunks": 2},
        "trainer": {"gradient_clip_val": 0.05},
        "batch_size": 8,
        "model": "loss_parameters",
    },
]


@pytest.mark.slow
def test_accumulation_and_loss_parameters_train_as_one_process_under_every_schedule() -> None:
    results = run_distributed(_fit_rank, 2, _TWO_RANK_RUNS, timeout_s=600)
    accumulated = _reference("loss_parameters", batch_size=8, shards=1, accumulate=2)
    # The parameters outside the Sequential moved (they never did before: Lightning's zero_grad erased them).
    start = _WithLossParameters()
    assert abs(accumulated[0]["log_scale"].item() - start.log_scale.item()) > 1e-2
    for index in range(len(_SCHEDULES)):
        _assert_trained_as([results[rank][index] for rank in range(2)], accumulated)
    # Clipping by norm counts the head's and the loss scale's gradients, once.
    _assert_trained_as(
        [results[rank][-1] for rank in range(2)],
        _reference("loss_parameters", batch_size=8, shards=1, accumulate=1, clip=0.05),
    )


@pytest.mark.slow
def test_accumulation_and_loss_parameters_with_two_pipelines_equal_one_process_on_the_global_batch() -> None:
    # 2 pipelines x 2 stages: each pipeline's shard of 12 samples in batches of 4 (3 a epoch), the global batch 8.
    schedule = "1F1B" if SCHEDULES["1F1B"].available() else "GPipe"
    run = {
        "strategy": {"schedule": schedule, "chunks": 2, "pipeline_parallel_size": 2},
        "trainer": {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05},
        "batch_size": 4,
        "model": "loss_parameters",
    }
    results = run_distributed(_fit_rank, 4, [run], timeout_s=600)
    reference = _reference("loss_parameters", batch_size=4, shards=2, accumulate=2, clip=0.05)
    _assert_trained_as([rank[0] for rank in results], reference)


# ---- BatchNorm as GPipe defines it -----------------------------------------------------------------------------------
class _WithBatchNorm(PipelinedRegressor):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.sequential_module = nn.Sequential(
            nn.Linear(5, 16),
            nn.BatchNorm1d(16),
            nn.Tanh(),
            nn.Linear(16, 16),
            nn.BatchNorm1d(16),
            nn.Tanh(),
            nn.Linear(16, 3),
        ).double()


def _batchnorm_rank(rank: int, world_size: int, runs: list[dict[str, Any]]) -> list[Any]:
    results = []
    for run in runs:
        model = _WithBatchNorm()
        trainer = quiet_trainer(PipelineStrategy(**run["strategy"]), world_size, max_steps=3)
        trainer.fit(model, DataLoader(_data(SAMPLES), batch_size=run["batch_size"], shuffle=False))
        results.append({k: v.detach().clone() for k, v in model.state_dict().items()})
        assert type(model.sequential_module[1]) is nn.BatchNorm1d  # the user's layers come back after fit
    return results


def _batchnorm_reference(batch_size: int, shards: int, chunks: int, steps: int = 3) -> dict[str, torch.Tensor]:
    """One process: each micro-batch normalized on its own (GPipe), the loss the mean over the global batch's
    micro-batches, running statistics updated once per step from all of them (gpipe's DeferredBatchNorm)."""
    from lightning_balanced.pipeline import DeferredBatchNorm

    model = _WithBatchNorm()
    DeferredBatchNorm.convert_deferred_batch_norm(model.sequential_module)
    layers = [m for m in model.modules() if isinstance(m, DeferredBatchNorm)]
    optimizer = torch.optim.SGD(model.parameters(), lr=LR, momentum=0.9)
    data = _data(SAMPLES)
    x, y = data[:]
    for step in range(steps):
        orders = []
        for shard in range(shards):
            sampler = DistributedSampler(
                data, num_replicas=shards, rank=shard, shuffle=True, seed=lightning_sampler_seed()
            )
            sampler.set_epoch(0)
            orders.append(list(sampler)[step * batch_size : (step + 1) * batch_size])
        optimizer.zero_grad()
        loss = torch.zeros((), dtype=torch.float64)
        for order in orders:
            for micro in torch.tensor(order).chunk(chunks):
                loss = loss + F.mse_loss(model.sequential_module(x[micro]), y[micro]) / (chunks * shards)
        for layer in layers:
            layer.commit()
        loss.backward()
        optimizer.step()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_batchnorm_normalizes_each_micro_batch_and_tracks_the_whole_batch_once_per_step() -> None:
    zero_bubble = "ZBVZeroBubble" if SCHEDULES["ZBVZeroBubble"].available() else "GPipe"
    runs = [
        {"strategy": {"schedule": "GPipe", "chunks": 4, "activation_checkpointing": True}, "batch_size": 8},
        {"strategy": {"schedule": zero_bubble, "chunks": 2}, "batch_size": 8},
    ]
    results = run_distributed(_batchnorm_rank, 2, runs, timeout_s=600)
    expected = [_batchnorm_reference(8, 1, 4), _batchnorm_reference(8, 1, 2)]
    for index, reference in enumerate(expected):
        for rank in range(2):
            for name, value in reference.items():
                torch.testing.assert_close(
                    results[rank][index][name],
                    value,
                    **EXACT,
                    msg=lambda m, name=name, run=runs[index]: f"{run} {name}: {m}",
                )
        assert int(results[0][index]["sequential_module.1.num_batches_tracked"]) == 3  # once per step


@pytest.mark.slow
def test_batchnorm_running_statistics_merge_the_data_parallel_replicas() -> None:
    schedule = "1F1B" if SCHEDULES["1F1B"].available() else "GPipe"
    run = {"strategy": {"schedule": schedule, "chunks": 2, "pipeline_parallel_size": 2}, "batch_size": 4}
    results = run_distributed(_batchnorm_rank, 4, [run], timeout_s=600)
    reference = _batchnorm_reference(4, 2, 2)
    for rank in range(4):
        for name, value in reference.items():
            torch.testing.assert_close(results[rank][0][name], value, **EXACT, msg=lambda m, name=name: f"{name}: {m}")
