"""What a DDP user does every day, under strategy="balanced_ddp": each checked against one process (or "ddp").

The list (the closing note of issue 51 keeps it with what each check found):

* manual optimization (``automatic_optimization = False``): one optimizer and a GAN-style pair, uneven, zero and
  changing shares, a short last global batch: the same parameters as one process after every step;
* prediction writers (``BasePredictionWriter``, ``write_interval`` "batch" and "epoch"): each rank's dataset indices of
  its share, so the predictions reassemble in dataset order;
* ``trainer.train_dataloader.sampler``: the global ``DistributedSampler`` (one replica), as ``"ddp"`` users read it;
* ``trainer.estimated_stepping_batches``: the global batches' count, as one process counts it;
* ``self.log(..., sync_dist=True)``: the global batch's value;
* the loader's own order: ``shuffle=False`` and a seeded sampler of the user's own walked as one process walks them,
  and a sampler that differs between the ranks named before the first optimizer step;
* the launchers (``balanced_ddp``: Lightning's subprocess launcher; ``balanced_ddp_spawn``: the main process gets the
  trained weights back, and loads the best checkpoint after the fit): ``tests/scripts/balanced_ddp_job.py``.

float64 throughout: the runs differ only in how the ranks' weighted gradients are summed (~1e-16 relative), so 1e-12
after a few SGD steps is wide, while the bug this guards against (a step weighted by another step's share) is off by
1e-3 and more.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import BasePredictionWriter
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, DistributedSampler, RandomSampler, TensorDataset, WeightedRandomSampler

from lightning_balanced import BalancedDDPStrategy, ChunkSizes, SplitPolicy
from tests.distributed import run_distributed
from tests.helpers import quiet_trainer

EXACT = {"rtol": 0, "atol": 1e-12}
SAMPLES = 24
SCRIPT = Path(__file__).parents[1] / "scripts" / "balanced_ddp_job.py"


def _data(n: int = SAMPLES) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randn(n, 3, generator=g, dtype=torch.float64)
    )


def _loader(batch_size: int) -> DataLoader[Any]:
    """The global batches, in the same shuffled order on every rank and in one process (one replica, seed 0)."""
    data = _data()
    sampler = DistributedSampler(data, num_replicas=1, rank=0, shuffle=True, seed=0)
    return DataLoader(data, batch_size=batch_size, sampler=sampler)


class ManualRegressor(pl.LightningModule):
    """Manual optimization: one optimizer, or a generator and a critic stepped one after the other (a GAN's shape)."""

    def __init__(self, gan: bool = False) -> None:
        super().__init__()
        self.automatic_optimization = False
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).double()
        self.critic = nn.Linear(3, 1).double() if gan else None
        self.states: list[dict[str, torch.Tensor]] = []

    def training_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        if self.critic is None:
            optimizer = self.optimizers()
            optimizer.zero_grad()  # type: ignore[union-attr]
            loss = F.mse_loss(self.net(x), y)
            self.manual_backward(loss)
            optimizer.step()  # type: ignore[union-attr]
        else:
            generator, critic = self.optimizers()  # type: ignore[misc]
            out = self.net(x)
            loss = F.mse_loss(out, y) + self.critic(out).mean()
            generator.zero_grad()
            self.manual_backward(loss)
            generator.step()
            critic_loss = F.mse_loss(self.critic(self.net(x).detach()).squeeze(1), y[:, 0])
            critic.zero_grad()
            self.manual_backward(critic_loss)
            critic.step()
        self.log("train_loss", loss, sync_dist=True)
        self.states.append({k: v.detach().clone() for k, v in self.state_dict().items()})

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.net(batch[0])

    def configure_optimizers(self) -> Any:
        sgd = torch.optim.SGD(self.net.parameters(), lr=0.1, momentum=0.9)
        if self.critic is None:
            return sgd
        return sgd, torch.optim.Adam(self.critic.parameters(), lr=0.01)


class Alternating(SplitPolicy):
    """A plan that changes every global batch, alike on every rank: rank 0 takes 0, 1, 2, ... samples in turn."""

    def __init__(self) -> None:
        self.calls = 0

    def _plan(self, batch_size: int, num_devices: int) -> list[int]:
        first = self.calls % (batch_size + 1)
        self.calls += 1
        rest = batch_size - first
        return [first, *[rest // (num_devices - 1) + (r < rest % (num_devices - 1)) for r in range(num_devices - 1)]]

    def __repr__(self) -> str:
        return "Alternating()"


_MANUAL_RUNS: list[dict[str, Any]] = [
    {"split": ChunkSizes([3, 5]), "batch_size": 8},
    {"split": ChunkSizes([0, 8]), "batch_size": 8},  # rank 0 has no samples, every step
    {"split": Alternating(), "batch_size": 5},  # a new plan every step, and a short last global batch (24 = 4 x 5 + 4)
    {"split": ChunkSizes([5, 3]), "batch_size": 8, "gan": True},
]


def _manual_fit(strategy: Any, world_size: int, run: dict[str, Any]) -> dict[str, Any]:
    model = ManualRegressor(gan=run.get("gan", False))
    trainer = quiet_trainer(strategy, world_size, max_epochs=1)
    loader = _loader(run["batch_size"])
    trainer.fit(model, loader)
    return {
        "states": model.states,
        "train_loss": float(trainer.callback_metrics["train_loss"]),
        "estimated_stepping_batches": trainer.estimated_stepping_batches,
        "sampler": trainer.train_dataloader.sampler,  # type: ignore[union-attr]
    }


def _manual_rank(rank: int, world_size: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results = []
    for run in runs:
        # A GAN's second backward reaches only the critic: DDP must be told, as under strategy="ddp".
        strategy = BalancedDDPStrategy(split=run["split"], find_unused_parameters=run.get("gan", False))
        result = _manual_fit(strategy, world_size, run)
        sampler = result.pop("sampler")
        result["sampler"] = (type(sampler).__name__, sampler.num_replicas, sampler.shuffle, sampler.seed)
        results.append(result)
    return results


@pytest.mark.slow
def test_manual_optimization_takes_one_process_step_from_the_first_step_on() -> None:
    ranks = run_distributed(_manual_rank, 2, _MANUAL_RUNS, timeout_s=600)
    for index, run in enumerate(_MANUAL_RUNS):
        reference = _manual_fit("auto", 1, run)
        assert reference["estimated_stepping_batches"] == -(-SAMPLES // run["batch_size"])
        for rank in ranks:
            result = rank[index]
            assert len(result["states"]) == len(reference["states"]), index
            for step, (state, expected) in enumerate(zip(result["states"], reference["states"], strict=True)):
                for name, value in expected.items():
                    torch.testing.assert_close(
                        state[name], value, **EXACT, msg=lambda m, i=index, s=step, n=name: f"run {i} step {s} {n}: {m}"
                    )
            # sync_dist=True: the global batch's loss, as one process logs it
            assert result["train_loss"] == pytest.approx(reference["train_loss"], rel=1e-12, abs=1e-15)
            # the global batches, as one process counts them (not a rank's share of them, as under "ddp")
            assert result["estimated_stepping_batches"] == reference["estimated_stepping_batches"]
            # where "ddp" users look for the DistributedSampler
            assert result["sampler"] == ("DistributedSampler", 1, True, 0)


# ---- the order the user asked for ------------------------------------------------------------------------------------
class Regressor(pl.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(5, 16), nn.Tanh(), nn.Linear(16, 3)).double()

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _ordered_loader(case: str, rank: int) -> DataLoader[Any]:
    """``shuffle=False``, a seeded ``WeightedRandomSampler`` of the user's own, or a sampler seeded by rank."""
    data = _data()
    if case == "sequential":
        return DataLoader(data, batch_size=8)
    if case == "weighted":
        weights = torch.linspace(0.1, 1.0, SAMPLES, dtype=torch.float64)
        generator = torch.Generator().manual_seed(3)
        return DataLoader(data, batch_size=8, sampler=WeightedRandomSampler(weights, SAMPLES, generator=generator))
    return DataLoader(data, batch_size=8, sampler=RandomSampler(data, generator=torch.Generator().manual_seed(rank)))


def _ordered_fit(strategy: Any, world_size: int, case: str, rank: int = 0) -> Any:
    model = Regressor()
    quiet_trainer(strategy, world_size, max_epochs=2).fit(model, _ordered_loader(case, rank))
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _order_rank(rank: int, world_size: int, cases: list[str]) -> list[Any]:
    results = []
    for case in cases:
        try:
            results.append(_ordered_fit(BalancedDDPStrategy(chunk_sizes=[3, 5]), world_size, case, rank))
        except RuntimeError as error:
            results.append(str(error))
    return results


@pytest.mark.slow
def test_the_loaders_own_order_is_walked_as_one_process_walks_it() -> None:
    cases = ["sequential", "weighted", "seeded_by_rank"]
    ranks = run_distributed(_order_rank, 2, cases, timeout_s=300)
    for index, case in enumerate(cases[:2]):
        reference = _ordered_fit("auto", 1, case)
        for rank in ranks:
            for name, value in reference.items():
                torch.testing.assert_close(rank[index][name], value, **EXACT, msg=lambda m, c=case: f"{c}: {m}")
    for rank, results in enumerate(ranks):  # each rank shuffled by its own seed: named before the first step
        result = results[2]
        assert re.fullmatch(
            r"strategy='balanced_ddp': the ranks walked different global batches \(digests \[\d+, \d+\] of their"
            rf" sample indices, rank {rank}'s view\): every rank must walk the same global order\. A sampler of your"
            r" own must give the same order on every rank \(seed its `generator` alike on every rank\)",
            result,
        ), result


# ---- prediction writers ----------------------------------------------------------------------------------------------
class Collector(BasePredictionWriter):
    """Keeps what the writer is handed: per batch, or the epoch's lists at its end."""

    def __init__(self, write_interval: str) -> None:
        super().__init__(write_interval)  # type: ignore[arg-type]
        self.written: list[tuple[list[int], torch.Tensor]] = []

    def write_on_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        prediction: Any,
        batch_indices: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int,
    ) -> None:
        self.written.append((list(batch_indices), prediction.detach().clone()))

    def write_on_epoch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, predictions: Any, batch_indices: Any
    ) -> None:
        self.written += [(list(i), p.detach().clone()) for i, p in zip(batch_indices[0], predictions, strict=True)]


def _predict_rank(rank: int, world_size: int, chunk_sizes: list[int]) -> dict[str, Any]:
    written = {}
    for interval in ("batch", "epoch"):
        collector = Collector(interval)
        trainer = quiet_trainer(BalancedDDPStrategy(chunk_sizes=chunk_sizes), world_size, callbacks=[collector])
        trainer.predict(ManualRegressor(), DataLoader(_data(10), batch_size=sum(chunk_sizes)), return_predictions=False)
        written[interval] = collector.written
    return written


@pytest.mark.slow
@pytest.mark.parametrize("chunk_sizes", [[1, 3], [0, 4]])
def test_prediction_writers_get_each_ranks_dataset_indices(chunk_sizes: list[int]) -> None:
    ranks = run_distributed(_predict_rank, 2, chunk_sizes, timeout_s=300)
    model = ManualRegressor()
    with torch.no_grad():
        expected = model.net(_data(10).tensors[0])
    for interval in ("batch", "epoch"):
        predictions: dict[int, torch.Tensor] = {}
        for rank, written in enumerate(ranks):
            for indices, prediction in written[interval]:
                assert len(indices) == prediction.shape[0], (interval, rank, indices)
                for index, row in zip(indices, prediction, strict=True):
                    assert index not in predictions, f"sample {index} written twice"
                    predictions[index] = row
        assert sorted(predictions) == list(range(10)), interval  # every sample once
        torch.testing.assert_close(torch.stack([predictions[i] for i in range(10)]), expected, **EXACT)


# ---- the launchers, and the main process after the fit ---------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["balanced_ddp", "balanced_ddp_spawn"])
def test_a_launched_fit_trains_as_one_process_and_its_checkpoint_loads_in_the_main_process(
    strategy: str, tmp_path: Path
) -> None:
    out = tmp_path / "result.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[2]), *sys.path])}
    command = [sys.executable, str(SCRIPT), strategy, str(out)]
    completed = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["world_size"] == 2
    assert result["checkpoint_global_step"] == 6  # 2 epochs of 3 global batches
    assert result["trained_vs_one_process"] <= 1e-12
    assert result["best_checkpoint_vs_one_process"] <= 1e-12
