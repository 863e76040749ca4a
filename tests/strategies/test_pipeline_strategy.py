"""strategy="pipeline": torch.distributed.pipelining under Lightning, on 2 (or 4) real gloo CPU ranks, against the
unpipelined model trained in one process.

float64 throughout: the runs differ only in how micro-batch gradients are summed (~1e-16 relative), so 1e-10 on the
weights after three SGD steps with momentum is wide, yet an unweighted micro-batch sum (x chunks) or a stale stage
would miss it by orders of magnitude.
"""

from __future__ import annotations

import os
import re
import signal
import socket
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, TensorDataset

import tests.distributed
from lightning_balanced import DistributedEvalMixin, GPipeStrategy, LRScaledPipelineStrategy, PipelineStrategy
from lightning_balanced.pipelining.runtime import StageModule as _Stage
from lightning_balanced.pipelining.sharded_checkpoint import (
    METADATA_FILENAME,
    consolidate_checkpoint,
    is_sharded_checkpoint,
)
from lightning_balanced.pipelining.stage_plan import SCHEDULES, stage_indices, stage_owners
from tests.distributed import DistributedRankError, run_distributed
from tests.helpers import quiet_trainer, raises_exactly
from tests.reference import reference_fit

EXACT = {"rtol": 0, "atol": 1e-10}
LR = 0.1


class PipelinedRegressor(pl.LightningModule):
    """A float64 MLP in an ``nn.Sequential`` of 6 layers, with its loss as the pipeline's hook."""

    def __init__(self, dropout: float = 0.0, deep: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        middle = [nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh()] if deep else []  # 10 layers: 8 stages
        self.sequential_module = nn.Sequential(
            nn.Linear(5, 16), nn.Tanh(), *middle, nn.Linear(16, 16), nn.Dropout(dropout), nn.Tanh(), nn.Linear(16, 3)
        ).double()
        self.val_losses: list[float] = []

    def compute_loss(self, output: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(output, target)

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        # What strategy="pipeline" does in its stead, so the module trains the same under any strategy.
        x, y = batch
        loss = self.compute_loss(self.sequential_module(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        loss = self.compute_loss(self.sequential_module(x), y)
        self.val_losses.append(loss.item())
        self.log("val_loss", loss)

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return self.sequential_module(batch[0])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=LR, momentum=0.9)


def _data(n: int = 24) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randn(n, 3, generator=g, dtype=torch.float64)
    )


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self.losses.append(trainer.callback_metrics["train_loss"].item())


class _NoLoss(PipelinedRegressor):
    compute_loss = None  # type: ignore[assignment]


class _Evaluated(DistributedEvalMixin, PipelinedRegressor):
    """Gathers every validation prediction (no indices: the sampler's order) at the epoch's end."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        super().validation_step(batch, batch_idx)
        self.add_eval_outputs(pred=self.sequential_module(batch[0]))

    def on_validation_epoch_end(self) -> None:
        self.gathered = self.gather_eval_outputs()["pred"]


def _fit_rank(rank: int, world_size: int, runs: list[dict[str, Any]]) -> list[Any]:
    results: list[Any] = []
    for run in runs:
        model = _NoLoss() if run.get("no_loss") else PipelinedRegressor(deep=run.get("deep", False))
        losses = _Losses()
        strategy_class = LRScaledPipelineStrategy if "lr_scaling" in run["strategy"] else PipelineStrategy
        strategy = strategy_class(**run["strategy"])
        trainer = quiet_trainer(strategy, world_size, max_steps=3, callbacks=[losses], **run.get("trainer", {}))
        loader = DataLoader(_data(), batch_size=8, shuffle=False)
        if run.get("no_loss"):
            with pytest.raises(ValueError) as info:
                trainer.fit(model, loader)
            results.append(str(info.value))
            continue
        trainer.fit(model, loader)
        val = trainer.validate(model, DataLoader(_data(8), batch_size=4), verbose=False)[0]["val_loss"]
        result = {
            "state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "losses": losses.losses,
            "val_loss": val,
            "stages_on_rank": sorted(strategy_stage_indices(strategy)),
            "lr_scale_factor": getattr(strategy, "lr_scale_factor", None),
        }
        if run.get("checkpoint"):  # one epoch, saved, resumed for a second under a new strategy; and two at once
            path = f"{run['checkpoint']}/pipeline.ckpt"
            first = quiet_trainer(PipelineStrategy(**run["strategy"]), world_size, max_epochs=1)
            first.fit(PipelinedRegressor(), DataLoader(_data(), batch_size=8))
            first.save_checkpoint(path)
            resumed = PipelinedRegressor()
            again = quiet_trainer(PipelineStrategy(**run["strategy"]), world_size, max_epochs=2)
            again.fit(resumed, DataLoader(_data(), batch_size=8), ckpt_path=path)
            uninterrupted = PipelinedRegressor()
            whole = quiet_trainer(PipelineStrategy(**run["strategy"]), world_size, max_epochs=2)
            whole.fit(uninterrupted, DataLoader(_data(), batch_size=8))
            result["resumed"] = {k: v.detach().clone() for k, v in resumed.state_dict().items()}
            result["uninterrupted"] = {k: v.detach().clone() for k, v in uninterrupted.state_dict().items()}
            result["steps"] = whole.global_step
            evaluated = _Evaluated()
            evaluated.load_state_dict(resumed.state_dict())
            tester = quiet_trainer(PipelineStrategy(**run["strategy"]), world_size)
            tester.validate(evaluated, DataLoader(_data(8), batch_size=4), verbose=False)
            result["gathered"] = evaluated.gathered
            result["predicted"] = torch.cat(tester.predict(evaluated, DataLoader(_data(8), batch_size=4)))
        results.append(result)
    return results


def strategy_stage_indices(strategy: PipelineStrategy) -> list[int]:
    return stage_indices(
        strategy.pipeline_rank, strategy.pipeline_size, strategy.stages_per_rank, strategy.schedule.placement
    )


def _available(name: str) -> bool:
    return SCHEDULES[name].available()


# A 1F1B schedule where the installed torch runs it, else GPipe (before torch 2.8: see stage_plan.RUNS_FROM).
ONE_F_ONE_B = "1F1B" if _available("1F1B") else "GPipe"

_SCHEDULE_RUNS = [
    {"strategy": {"schedule": name, "chunks": 4}}
    for name in ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")
    if _available(name)
] + [{"strategy": {"schedule": ONE_F_ONE_B, "chunks": 2, "balance": [2, 4], "activation_checkpointing": True}}]
_CLIPPED = {"strategy": {"schedule": "GPipe", "chunks": 4}, "trainer": {"gradient_clip_val": 0.05}}
_NO_LOSS = {"strategy": {"schedule": "GPipe", "chunks": 4}, "no_loss": True}


def _reference(
    steps: int, batch_size: int = 8, shards: int = 1, clip: float | None = None, lr: float = LR, deep: bool = False
) -> tuple[Any, list[float]]:
    """The unpipelined model in one process: SGD on each global batch, the ``shards`` data-parallel shards side by side.

    The samples come in the order of Lightning's ``DistributedSampler`` for training (shuffled with seed 0, epoch by
    epoch): one shard per pipeline.
    """
    model = PipelinedRegressor(deep=deep)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    loss_of = lambda x, y: F.mse_loss(model.sequential_module(x), y)  # noqa: E731
    return reference_fit(
        model, optimizer, loss_of, _data(), steps=steps, batch_size=batch_size, shards=shards, clip=clip
    )


def _assert_trained_as(
    ranks: list[dict[str, Any]], state: dict[str, torch.Tensor], losses: list[float], run: Any
) -> None:
    for rank in ranks:  # every rank holds the whole trained model and logged the same losses
        for name, value in rank["state"].items():
            torch.testing.assert_close(value, state[name], **EXACT, msg=f"{run} {name}")
        assert rank["losses"] == pytest.approx(losses, rel=1e-12), run


@pytest.mark.slow
def test_every_schedule_trains_as_the_unpipelined_model_on_two_ranks() -> None:
    runs = [*_SCHEDULE_RUNS, _CLIPPED, _NO_LOSS]
    results = run_distributed(_fit_rank, 2, runs, timeout_s=600)
    expected_state, expected_losses = _reference(3)
    x, y = _data(8)[:]
    with torch.no_grad():
        reference_model = PipelinedRegressor()
        reference_model.load_state_dict(expected_state)
        expected_val = F.mse_loss(reference_model.sequential_module(x), y).item()
    for index, run in enumerate(_SCHEDULE_RUNS):
        ranks = [results[rank][index] for rank in range(2)]
        _assert_trained_as(ranks, expected_state, expected_losses, run)
        assert [rank["val_loss"] for rank in ranks] == pytest.approx([expected_val] * 2, rel=1e-12), run
        stages = sorted(s for rank in ranks for s in rank["stages_on_rank"])
        assert stages == list(range(len(stages))), run  # each stage on one rank
    # Gradient clipping by norm: the global norm over both ranks' stages, as clip_grad_norm_ on the whole model.
    clipped_state, clipped_losses = _reference(3, clip=0.05)
    _assert_trained_as(
        [results[rank][len(_SCHEDULE_RUNS)] for rank in range(2)], clipped_state, clipped_losses, _CLIPPED
    )
    assert [results[rank][-1] for rank in range(2)] == [
        "strategy='pipeline' needs `_NoLoss.compute_loss(self, output, target) -> Tensor`: the loss of one"
        " micro-batch, which the last stage calls on each micro-batch"
    ] * 2


_FOUR_RANK_RUNS = [
    {"strategy": {"schedule": name, "chunks": 4}, "deep": True}
    for name in ("GPipe", "1F1B", "Interleaved1F1B", "LoopedBFS", "InterleavedZeroBubble", "ZBVZeroBubble")
    if _available(name)
]


@pytest.mark.slow
def test_every_schedule_trains_as_the_unpipelined_model_on_four_ranks() -> None:
    # p = 4: one stage per rank, or two (8 stages of a 10-layer model) for the looped and V-shaped schedules.
    results = run_distributed(_fit_rank, 4, _FOUR_RANK_RUNS, timeout_s=600)
    expected_state, expected_losses = _reference(3, deep=True)
    for index, run in enumerate(_FOUR_RANK_RUNS):
        ranks = [results[rank][index] for rank in range(4)]
        _assert_trained_as(ranks, expected_state, expected_losses, run)
        stages = sorted(s for rank in ranks for s in rank["stages_on_rank"])
        assert stages == list(range(len(stages))), run


def _check_checkpoint_and_evaluation(ranks: list[dict[str, Any]], checkpoint: Path, shards: int) -> None:
    # The checkpoint (after one epoch) holds the whole model in the plain layout: it loads into the unpipelined module.
    steps = ranks[0]["steps"]  # two epochs
    expected_state, _ = _reference(steps // 2, shards=shards)
    assert is_sharded_checkpoint(checkpoint)  # a directory of shards; one file after consolidation
    consolidate_checkpoint(checkpoint, checkpoint.with_name("consolidated.ckpt"))
    saved = torch.load(checkpoint.with_name("consolidated.ckpt"), map_location="cpu", weights_only=False)
    plain = PipelinedRegressor()
    plain.load_state_dict(saved["state_dict"])
    for name, value in plain.state_dict().items():
        torch.testing.assert_close(value, expected_state[name], **EXACT, msg=name)
    # Resumed for the second epoch (weights and every stage's momentum): as two epochs at once, and as one process.
    two_epochs, _ = _reference(steps, shards=shards)
    reference = PipelinedRegressor()
    reference.load_state_dict(two_epochs)
    x, _ = _data(8)[:]
    with torch.no_grad():
        expected_pred = reference.sequential_module(x)
    for index, rank in enumerate(ranks):
        for name, value in rank["resumed"].items():
            torch.testing.assert_close(value, rank["uninterrupted"][name], **EXACT, msg=name)
            torch.testing.assert_close(value, two_epochs[name], **EXACT, msg=name)
        # The mixin gathers over the data-parallel group: each validation sample once, in order, on every rank.
        torch.testing.assert_close(rank["gathered"], expected_pred, **EXACT)
        # Predictions are per data shard, as under DDP: pipeline k (ranks 2k, 2k + 1) predicts samples k, k + d, ...
        torch.testing.assert_close(rank["predicted"], expected_pred[index // (len(ranks) // shards) :: shards], **EXACT)


@pytest.mark.slow
def test_checkpoints_resume_and_evaluation_on_one_pipeline_of_two_ranks(tmp_path: Path) -> None:
    runs = [{"strategy": {"schedule": ONE_F_ONE_B, "chunks": 2}, "checkpoint": str(tmp_path)}]
    results = run_distributed(_fit_rank, 2, runs, timeout_s=600)
    _check_checkpoint_and_evaluation([rank[0] for rank in results], tmp_path / "pipeline.ckpt", shards=1)


@pytest.mark.slow
def test_two_pipelines_of_two_ranks_equal_one_process_on_the_global_batch(tmp_path: Path) -> None:
    mesh = {"schedule": ONE_F_ONE_B, "chunks": 2, "pipeline_parallel_size": 2}
    runs = [{"strategy": mesh, "checkpoint": str(tmp_path)}, {"strategy": {**mesh, "lr_scaling": "linear"}}]
    results = run_distributed(_fit_rank, 4, runs, timeout_s=600)
    expected_state, expected_losses = _reference(3, shards=2)
    _assert_trained_as([rank[0] for rank in results], expected_state, expected_losses, runs[0])
    _check_checkpoint_and_evaluation([rank[0] for rank in results], tmp_path / "pipeline.ckpt", shards=2)
    # strategy="pipeline_lr_linear": the factor is the data-parallel size d = 2, not the world size 4.
    assert [rank[1]["lr_scale_factor"] for rank in results] == [2.0] * 4
    scaled_state, scaled_losses = _reference(3, shards=2, lr=2 * LR)
    _assert_trained_as([rank[1] for rank in results], scaled_state, scaled_losses, runs[1])


# ---- a checkpoint moves between pipeline sizes and to gpipe and back ----------------------------------------------
def _one_epoch_rank(rank: int, world_size: int, resume: str | None, save: str, strategy: dict[str, Any]) -> Any:
    model = PipelinedRegressor()
    if resume is None:
        epochs = 1
    else:  # one more epoch than the checkpoint holds
        meta = Path(resume) / METADATA_FILENAME if Path(resume).is_dir() else Path(resume)
        epochs = int(torch.load(meta, weights_only=False)["epoch"]) + 1
    trainer = quiet_trainer(PipelineStrategy(**strategy), world_size, max_epochs=epochs)
    trainer.fit(model, DataLoader(_data(8), batch_size=8), ckpt_path=resume)
    trainer.save_checkpoint(save)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.slow
def test_a_sharded_checkpoint_reshards_from_two_stages_to_four_then_consolidates_for_gpipe(tmp_path: Path) -> None:
    # One batch of all 8 samples per epoch, so the order of the samples does not matter: SGD with momentum, 3 steps,
    # saved and resumed at every step: 2 pipeline ranks (sharded: each rank writes its stages), then 4 ranks with
    # another schedule and balance (each reads its own stages' names: DCP reshards), then consolidated into one file
    # that gpipe in one process resumes (2 CPU partitions, its own cut); momentum buffers travel with the weights.
    first, second, third = (str(tmp_path / name) for name in ("p2.ckpt", "p4.ckpt", "gpipe.ckpt"))
    run_distributed(_one_epoch_rank, 2, None, first, {"schedule": ONE_F_ONE_B, "chunks": 2}, timeout_s=300)
    assert is_sharded_checkpoint(first)
    run_distributed(
        _one_epoch_rank, 4, first, second, {"schedule": "GPipe", "chunks": 2, "balance": [2, 1, 2, 1]}, timeout_s=300
    )
    consolidated = str(tmp_path / "p4_consolidated.ckpt")
    consolidate_checkpoint(second, consolidated)
    model = PipelinedRegressor()
    gpipe = quiet_trainer(GPipeStrategy(balance=[4, 2], chunks=2), 2, max_epochs=3, accelerator="cpu")
    gpipe.fit(model, DataLoader(_data(8), batch_size=8), ckpt_path=consolidated)
    gpipe.save_checkpoint(third)
    reference = PipelinedRegressor()
    optimizer = torch.optim.SGD(reference.parameters(), lr=LR, momentum=0.9)
    x, y = _data(8)[:]
    for _ in range(3):
        optimizer.zero_grad()
        F.mse_loss(reference.sequential_module(x), y).backward()
        optimizer.step()
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[name], value, **EXACT, msg=name)
    plain = PipelinedRegressor()
    plain.load_state_dict(torch.load(consolidated, weights_only=False)["state_dict"])  # the plain layout


class _SavedNames(Callback):
    """What the strategy hands Lightning's checkpoint as the model's state while training runs."""

    def __init__(self) -> None:
        self.names: list[str] = []

    def on_train_end(self, trainer: pl.Trainer, module: pl.LightningModule) -> None:
        self.names = sorted(trainer.strategy.lightning_module_state_dict())


def _saved_names_rank(rank: int, world_size: int, save: str, sharded: bool) -> list[str]:
    model = PipelinedRegressor()
    strategy = PipelineStrategy(schedule="GPipe", chunks=2, save_distributed_checkpoint=sharded)
    names = _SavedNames()
    trainer = quiet_trainer(strategy, world_size, max_epochs=1, callbacks=[names])
    trainer.fit(model, DataLoader(_data(8), batch_size=8))
    trainer.save_checkpoint(save)
    return names.names


@pytest.mark.slow
def test_each_rank_saves_its_stages_only_unless_asked_for_one_file(tmp_path: Path) -> None:
    # Layers 0-2 (two Linears) on rank 0, 3-5 (one Linear) on rank 1: a sharded save gathers nothing.
    names = run_distributed(_saved_names_rank, 2, str(tmp_path / "sharded.ckpt"), True, timeout_s=300)
    assert names == [
        [
            "sequential_module.0.bias",
            "sequential_module.0.weight",
            "sequential_module.2.bias",
            "sequential_module.2.weight",
        ],
        ["sequential_module.5.bias", "sequential_module.5.weight"],
    ]
    path = tmp_path / "full.ckpt"
    names = run_distributed(_saved_names_rank, 2, str(path), False, timeout_s=300)
    assert names[0] == names[1] == sorted(PipelinedRegressor().state_dict())  # every rank gathers every stage
    assert path.is_file()
    PipelinedRegressor().load_state_dict(torch.load(path, weights_only=False)["state_dict"])


# ---- pure parts: placements and arguments --------------------------------------------------------------------------
@pytest.mark.parametrize("layer", [nn.Identity(), nn.Dropout(0.0)], ids=["identity", "dropout-0"])
@pytest.mark.parametrize("checkpointed", [False, True], ids=["plain", "checkpointed"])
def test_a_stage_that_returns_its_input_gives_a_tensor_that_split_backward_can_detach(
    layer: nn.Module, checkpointed: bool
) -> None:
    # torch 2.11's stage_backward_input detaches the stage's outputs in place: an output that is the received input
    # itself detached the receive buffer, and the next micro-batch failed (seen with 4 ranks, InterleavedZeroBubble).
    received = torch.randn(4, 3, dtype=torch.float64).requires_grad_()
    output = _Stage(nn.Sequential(layer).train(), checkpointed)(received)
    assert output is not received and not output._is_view() and output.grad_fn is not None
    (grad,) = torch.autograd.grad(output, received, torch.full_like(output, 2.0), retain_graph=True)
    torch.testing.assert_close(grad, torch.full_like(received, 2.0), rtol=0, atol=0)
    output.detach_()
    assert received.requires_grad


def test_stage_placements_follow_the_schedules_conventions() -> None:
    assert [stage_indices(r, 4, 1, "single") for r in range(4)] == [[0], [1], [2], [3]]
    assert [stage_indices(r, 2, 3, "loop") for r in range(2)] == [[0, 2, 4], [1, 3, 5]]
    assert [stage_indices(r, 4, 2, "v") for r in range(4)] == [[0, 7], [1, 6], [2, 5], [3, 4]]
    assert stage_owners(2, 2, "v") == [0, 1, 1, 0]
    with raises_exactly(ValueError, "`stages_per_rank` must be 2 for a schedule with 'v' stage placement, got 3"):
        stage_indices(0, 2, 3, "v")


def test_bad_arguments_name_what_was_expected() -> None:
    with raises_exactly(ValueError, f"`schedule` must be one of {list(SCHEDULES)}, got 'PipeDream'"):
        PipelineStrategy(schedule="PipeDream")
    with raises_exactly(ValueError, "`stages_per_rank` must be 1 for a schedule with 'single' stage placement, got 2"):
        PipelineStrategy(schedule="GPipe", stages_per_rank=2)
    with raises_exactly(TypeError, "`activation_checkpointing` must be a bool, got 'yes'"):
        PipelineStrategy(activation_checkpointing="yes")  # type: ignore[arg-type]
    # It builds no DistributedDataParallel: DDP's options are not among its arguments (those of its process group are).
    with raises_exactly(
        TypeError, "ProcessGroupStrategy.__init__() got an unexpected keyword argument 'find_unused_parameters'"
    ):
        PipelineStrategy(find_unused_parameters=True)  # type: ignore[call-arg]


def test_a_schedule_the_installed_torch_lacks_names_the_release_that_adds_it(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch.distributed.pipelining as pipelining

    monkeypatch.delattr(pipelining, "ScheduleZBVZeroBubble", raising=False)
    with raises_exactly(
        ValueError,
        "`schedule`='ZBVZeroBubble' is torch.distributed.pipelining.ScheduleZBVZeroBubble, added in torch 2.6; the"
        f" installed torch is {torch.__version__}. Upgrade torch or choose another schedule",
    ):
        PipelineStrategy(schedule="ZBVZeroBubble")


def test_a_schedule_older_torch_cannot_run_names_the_release_it_runs_from(monkeypatch: pytest.MonkeyPatch) -> None:
    from lightning_balanced.pipelining.stage_plan import RUNS_FROM

    monkeypatch.setattr(torch, "__version__", "2.5.1")
    with raises_exactly(
        ValueError,
        f"`schedule`='1F1B' runs under strategy='pipeline' from torch {RUNS_FROM}: torch 2.5.1's Schedule1F1B fails"
        " in its point-to-point exchange (seen on gloo). Upgrade torch or use `schedule='GPipe'`",
    ):
        PipelineStrategy(schedule="1F1B")
    assert not SCHEDULES["1F1B"].available() and SCHEDULES["GPipe"].available()


# ---- a stage that returns no tensor: a named error on its rank, and no hang on the others ---------------------------
class _Pair(nn.Module):
    def forward(self, x: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"a": x, "b": x}


class _Sum(nn.Module):
    def forward(self, pair: dict[str, torch.Tensor]) -> torch.Tensor:
        return pair["a"] + pair["b"]


def _dict_stage_rank(rank: int, world_size: int) -> str:
    model = PipelinedRegressor()
    model.sequential_module = nn.Sequential(nn.Linear(5, 3), _Pair(), _Sum(), nn.Linear(3, 3)).double()
    trainer = quiet_trainer(PipelineStrategy(schedule="GPipe", chunks=2, balance=[1, 1, 2]), world_size, max_steps=1)
    try:
        trainer.fit(model, DataLoader(_data(8), batch_size=4))
    except Exception as error:  # what each rank ends with is the result
        return f"{type(error).__name__}: {error}"
    return "trained"


@pytest.mark.slow
def test_a_stage_that_returns_a_dict_is_named_and_its_peers_name_its_rank() -> None:
    first, second, third = run_distributed(_dict_stage_rank, 3, timeout_s=120)
    assert second == (
        "TypeError: pipeline stage 1 returned dict; the stages of strategy='pipeline' pass a tensor or a tuple of"
        " tensors to the next"
    )
    # Rank 0 waits for stage 1's gradients, rank 2 for its activation; when rank 1 stops, gloo ends their waits with an
    # error, not a hang, and the strategy names the rank that stopped and its error, read from the store.
    for rank, result in ((0, first), (2, third)):
        assert result.startswith(
            f"PeerStopped: strategy='pipeline': rank {rank} lost its connection to another rank in a training step:"
            f" rank 1 stopped on {second} (its traceback is in that process's output). The backend said: "
        ), result


class _KilledOnArm(nn.Module):
    """Identity until armed; then its forward kills its own process (SIGKILL: no Python code runs after it)."""

    armed = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.armed:
            os.kill(os.getpid(), signal.SIGKILL)
        return x


class _KilledInSecondStep(PipelinedRegressor):
    def __init__(self) -> None:
        super().__init__()
        self.sequential_module.append(_KilledOnArm())

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.sequential_module[-1].armed = batch_idx == 1 and self.global_rank == 1


def _killed_rank(rank: int, world_size: int) -> str:
    trainer = quiet_trainer(PipelineStrategy(schedule="GPipe", chunks=2), world_size, max_steps=3)  # on every torch
    trainer.fit(_KilledInSecondStep(), DataLoader(_data(24), batch_size=4))
    return "trained"


@pytest.mark.slow
def test_a_killed_rank_is_named_by_the_rank_that_lost_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(tests.distributed, "_ERROR_GRACE_S", 60.0)  # rank 0's error comes after rank 1's death
    with pytest.raises(DistributedRankError) as info:
        run_distributed(_killed_rank, 2, timeout_s=120)
    report = str(info.value)
    assert report.startswith("2 of 2 ranks failed:\n--- rank 0 ---\n"), report
    assert "--- rank 1 ---\nexited without a result (exit code " in report, report  # -9, or None if read before exit
    pid_and_host = r"\(process \d+ on host " + re.escape(socket.gethostname()) + r"\)"
    assert re.search(
        r"PeerStopped: strategy='pipeline': rank 0 lost its connection to another rank in a training step: rank 1 "
        + pid_and_host
        + r" no longer runs and reported no error: it was killed\."
        r" The backend said: ",
        report,
    ), report


# ---- a last batch that chunks does not divide: named before the first step ------------------------------------------
def _short_last_batch_rank(rank: int, world_size: int) -> str:
    trainer = quiet_trainer(PipelineStrategy(schedule="GPipe", chunks=4), world_size, max_epochs=1)
    model = PipelinedRegressor()
    try:
        trainer.fit(model, DataLoader(_data(26), batch_size=8))
    except ValueError as error:
        return f"{error} (after {trainer.global_step} steps)"
    return "trained"


@pytest.mark.slow
def test_a_last_batch_that_chunks_does_not_divide_is_named_before_the_first_step() -> None:
    assert (
        run_distributed(_short_last_batch_rank, 2, timeout_s=120)
        == [
            "strategy='pipeline' splits each batch into `chunks`=4 equal micro-batches, but the last training batch of"
            " each epoch would have 2 samples (26 samples per data-parallel rank in batches of 8): set `drop_last=True`"
            " on the DataLoader, or choose sizes that leave a multiple of 4 (after 0 steps)"
        ]
        * 2
    )
