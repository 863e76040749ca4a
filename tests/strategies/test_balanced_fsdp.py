"""strategy="balanced_fsdp": a model sharded with FSDP2, one global batch split unevenly over real gloo CPU ranks,
against one process (a plain single-device Trainer on the same loader, ``shuffle=False``: the dataset's order).

float64: the runs differ only in how the ranks' weighted gradients are summed by the reduce-scatter (~1e-16
relative), so 1e-12 after a few steps of SGD with momentum or Adam is wide, while an unweighted mean over uneven
shares or a lost sample is off by 1e-3 and more.
"""

from __future__ import annotations

import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from torch import nn
from torch.nn import functional as F
from torch.torch_version import TorchVersion
from torch.utils.data import DataLoader, TensorDataset

from lightning_balanced import AutoSplit, BalancedFSDPStrategy, DistributedEvalMixin, EvenSplit
from lightning_balanced.rank_shares.engine import ShareEngine
from lightning_balanced.rank_shares.loader import RankShare
from lightning_balanced.strategies.balanced_fsdp import FSDP2_CPU_TORCH, FSDP2_TORCH
from tests.distributed import run_distributed
from tests.helpers import quiet_trainer, raises_exactly

EXACT = {"rtol": 0, "atol": 1e-12}
SAMPLES = 24
CPU_FSDP2 = pytest.mark.skipif(
    TorchVersion(torch.__version__) < FSDP2_CPU_TORCH, reason=f"FSDP2 on CPU ranks needs torch >= {FSDP2_CPU_TORCH}"
)


class Block(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x))


class Regressor(DistributedEvalMixin, pl.LightningModule):
    """Two sharded blocks, a head and a parameter outside the blocks (sharded with the root); gathers its validation
    predictions with the mixin."""

    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__()
        torch.manual_seed(0)
        self.blocks = nn.Sequential(nn.Linear(5, 8), Block(8), Block(8), nn.Linear(8, 3)).double()
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float64))
        self.optimizer = optimizer
        self.gathered: dict[str, Any] = {}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.blocks(x) * self.scale

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        prediction = self(x)
        self.log("val_loss", F.mse_loss(prediction, y))
        self.add_eval_outputs(pred=prediction)

    def on_validation_epoch_end(self) -> None:
        self.gathered = self.gather_eval_outputs()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


class CallsItsBlocks(Regressor):
    """A training_step that calls the blocks, not ``self(x)``: the root's own parameters still train."""

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = F.mse_loss(self.blocks(x) * self.scale, y)
        self.log("train_loss", loss)
        return loss


class ManualOptimization(Regressor):
    """The optimizer stepped in ``training_step``: ``manual_backward`` sees the share's weight from step 0 on."""

    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__(optimizer)
        self.automatic_optimization = False

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        optimizer = self.optimizers()
        assert isinstance(optimizer, pl.core.optimizer.LightningOptimizer)
        x, y = batch
        loss = F.mse_loss(self(x), y)
        optimizer.zero_grad()
        self.manual_backward(loss)
        optimizer.step()
        self.log("train_loss", loss)
        return loss


class ShardedInConfigureModel(Regressor):
    """Shards itself, as under Lightning's ModelParallelStrategy (with a mixed-precision policy, if given)."""

    mixed_precision = False

    def configure_model(self) -> None:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = self.device_mesh["data_parallel"]
        options: dict[str, Any] = {"mesh": mesh}
        if self.mixed_precision:  # bfloat16 parameters in the forward pass, float32 gradient reduction
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in self.blocks:
            if isinstance(block, Block):
                fully_shard(block, **options)
        fully_shard(self, **options)


class MixedPrecision(ShardedInConfigureModel):
    mixed_precision = True

    def __init__(self, optimizer: str = "sgd") -> None:
        super().__init__(optimizer)
        self.float()  # float32 parameters, bfloat16 compute


def _data(n: int = SAMPLES, dtype: torch.dtype = torch.float64) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(torch.randn(n, 5, generator=g, dtype=dtype), torch.randn(n, 3, generator=g, dtype=dtype))


def _full_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The whole (unsharded) parameters, on every rank."""
    state = {}
    for name, value in model.state_dict().items():
        full = value.full_tensor() if hasattr(value, "full_tensor") else value
        state[name] = full.detach().clone()
    return state


_RUNS: list[dict[str, Any]] = [
    {"strategy": {"chunk_sizes": [3, 5]}},
    {"strategy": {"chunk_sizes": [0, 8]}, "optimizer": "adam"},  # a rank with no samples, every step
    {"strategy": {"chunk_sizes": [1, 7]}, "trainer": {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}},
    {"strategy": {"chunk_sizes": [2, 6], "max_micro_batch": 4}, "optimizer": "adam"},
    {"strategy": {"chunk_sizes": [5, 3]}, "model": "configure_model"},
    {"strategy": {"chunk_sizes": [3, 5], "max_micro_batch": "auto"}},  # no cap measured on CPU ranks: whole shares
    {"strategy": {"chunk_sizes": [6, 2]}, "model": "blocks"},
    {"strategy": {"chunk_sizes": [3, 5]}, "model": "manual", "optimizer": "adam"},
    {"strategy": {"chunk_sizes": [1, 7]}, "samples": 20},  # a short last batch of 4: shares [1, 3] by proportion
]


def _fit(strategy: Any, devices: int, run: dict[str, Any], checkpoint: str | None = None) -> dict[str, Any]:
    models = {
        "configure_model": ShardedInConfigureModel,
        "mixed": MixedPrecision,
        "blocks": CallsItsBlocks,
        "manual": ManualOptimization,
    }
    model_class = models.get(run.get("model", ""))
    model = (model_class or Regressor)(run.get("optimizer", "sgd"))
    options = {"max_steps": 3, **run.get("trainer", {})}
    trainer = quiet_trainer(strategy, devices, **options)
    dtype = next(model.parameters()).dtype
    data = _data(run.get("samples", SAMPLES), dtype=dtype)
    trainer.fit(model, DataLoader(data, batch_size=8), ckpt_path=checkpoint)
    result = {"state": _full_state(model), "train_loss": float(trainer.callback_metrics["train_loss"])}
    if run.get("validate"):
        result["val_loss"] = trainer.validate(model, DataLoader(_data(10), batch_size=4), verbose=False)[0]["val_loss"]
        result["gathered"] = model.gathered
    return result


def _fit_rank(rank: int, world_size: int, runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    results = []
    for run in runs:
        shard = () if run.get("model") in ("configure_model", "mixed") else (Block,)
        results.append(_fit(BalancedFSDPStrategy(shard_modules=shard, **run["strategy"]), world_size, run))
    return results


def _assert_trained_as(result: dict[str, Any], reference: dict[str, Any]) -> None:
    for name, value in reference["state"].items():
        torch.testing.assert_close(result["state"][name], value, **EXACT, msg=lambda m, n=name: f"{n}: {m}")
    assert result["train_loss"] == pytest.approx(reference["train_loss"], rel=1e-12)


@CPU_FSDP2
@pytest.mark.slow
def test_uneven_shares_train_as_one_process_on_the_global_batch() -> None:
    ranks = run_distributed(_fit_rank, 2, _RUNS, timeout_s=600)
    for index, run in enumerate(_RUNS):
        reference = _fit("auto", 1, {k: v for k, v in run.items() if k != "model" or v in ("blocks", "manual")})
        for rank in ranks:
            _assert_trained_as(rank[index], reference)


@CPU_FSDP2
@pytest.mark.slow
def test_three_ranks_with_a_zero_share_train_as_one_process_and_evaluate_every_sample_once() -> None:
    run = {"strategy": {"chunk_sizes": [4, 0, 4]}, "validate": True}
    three = run_distributed(_fit_rank, 3, [run], timeout_s=300)
    reference = _fit("auto", 1, {"validate": True})
    x, y = _data(10).tensors
    model = Regressor()
    model.load_state_dict(reference["state"])
    with torch.no_grad():
        expected = model(x)
    for rank in three:
        _assert_trained_as(rank[0], reference)
        # Every validation sample once, in order, on every rank, with uneven and zero shares.
        torch.testing.assert_close(rank[0]["gathered"]["pred"], expected, **EXACT)
        # The logged loss is the global batches' mean, whatever the shares (3 batches of 4, 4, 2).
        assert rank[0]["val_loss"] == pytest.approx(F.mse_loss(expected, y).item(), rel=1e-12)


# bfloat16 forward passes over shares of 3 and 5 round differently from one pass over 8 (~2**-8 relative per op); the
# gradients are reduced in float32. Measured after 3 SGD steps (torch 2.13, 2026-12-07): max |difference| 3.5e-4 from
# one process under the same policy; with the shares' losses unweighted (the bug this guards against) 3.5e-2.
MIXED_PRECISION = {"rtol": 0, "atol": 3e-3}


@CPU_FSDP2
@pytest.mark.slow
def test_mixed_precision_matches_one_process_under_the_same_policy_within_bfloat16_rounding() -> None:
    run = {"strategy": {"chunk_sizes": [3, 5]}, "model": "mixed"}
    two = run_distributed(_fit_rank, 2, [run], timeout_s=300)
    one = run_distributed(_fit_rank, 1, [{"strategy": {}, "model": "mixed"}], timeout_s=300)
    for rank in two:
        for name, value in one[0][0]["state"].items():
            torch.testing.assert_close(
                rank[0]["state"][name], value, **MIXED_PRECISION, msg=lambda m, n=name: f"{n}: {m}"
            )
        assert rank[0]["train_loss"] == pytest.approx(one[0][0]["train_loss"], rel=2e-2)


def _memory_rank(rank: int, world_size: int, capacities: list[int]) -> str:
    policy = AutoSplit(profile_steps=2, warmup_steps=0)
    strategy = BalancedFSDPStrategy(split=policy, capacities=capacities, shard_modules=(Block,))
    try:
        quiet_trainer(strategy, world_size, max_steps=6).fit(Regressor(), DataLoader(_data(), batch_size=8))
    except ValueError as error:
        return str(error)
    return f"trained: {policy.plan(8, world_size)}"


@CPU_FSDP2
@pytest.mark.slow
def test_a_global_batch_no_plan_fits_stops_with_the_bytes_of_every_rank() -> None:
    results = run_distributed(_memory_rank, 2, [2_000, 2_000], timeout_s=300)
    for message in results:
        # The bytes are measured (the rank's fixed bytes and what its forward pass saved for backward): matched as
        # numbers, every other word whole.
        device = (
            r"device {}: capacity 2000 B x memory_fraction 0\.9, predicted \d+ B \+ \d+ B/sample: at most \d+ samples"
        )
        assert re.fullmatch(
            r"AutoSplit: a batch of 8 does not fit in the devices' memory whatever the split: they hold at most \d+"
            rf" samples \({device.format(0)}; {device.format(1)}\); the whole batch on the cheapest device would need"
            r" \d+ B\. Lower the batch size, raise `memory_fraction`, or add devices",
            message,
        ), message


def _resume_rank(rank: int, world_size: int, checkpoint: str, resume: bool, chunk_sizes: list[int]) -> Any:
    model = Regressor("adam")
    trainer = quiet_trainer(
        BalancedFSDPStrategy(chunk_sizes=chunk_sizes, shard_modules=(Block,)), world_size, max_epochs=2 if resume else 1
    )
    trainer.fit(model, DataLoader(_data(), batch_size=8), ckpt_path=checkpoint if resume else None)
    if not resume:
        trainer.save_checkpoint(checkpoint)  # sharded: a folder written by torch.distributed.checkpoint
    return _full_state(model)


@CPU_FSDP2
@pytest.mark.slow
def test_a_sharded_checkpoint_from_two_ranks_resumes_on_three_as_one_uninterrupted_process(tmp_path: Path) -> None:
    checkpoint = str(tmp_path / "two_ranks.ckpt")
    run_distributed(_resume_rank, 2, checkpoint, False, [5, 3], timeout_s=300)
    assert (tmp_path / "two_ranks.ckpt").is_dir()
    resumed = run_distributed(_resume_rank, 3, checkpoint, True, [2, 0, 6], timeout_s=300)
    reference = _fit("auto", 1, {"optimizer": "adam", "trainer": {"max_epochs": 2, "max_steps": -1}})
    for state in resumed:
        for name, value in reference["state"].items():
            torch.testing.assert_close(state[name], value, **EXACT, msg=lambda m, n=name: f"{n}: {m}")


def _error_rank(rank: int, world_size: int, cases: list[str]) -> list[str]:
    messages = []
    for case in cases:
        model: pl.LightningModule = Regressor()
        strategy = BalancedFSDPStrategy(shard_modules=(Block,))
        if case == "unsharded":
            strategy = BalancedFSDPStrategy()
        if case == "batchnorm":
            model.blocks.append(nn.BatchNorm1d(3).double())
        if case == "shares":
            strategy = BalancedFSDPStrategy(chunk_sizes=[1, 2, 5], shard_modules=(Block,))
        if case == "capacities":
            strategy = BalancedFSDPStrategy(chunk_sizes="auto", capacities=[10**9], shard_modules=(Block,))
        if case == "data_parallel_size":
            strategy = BalancedFSDPStrategy(data_parallel_size=3, shard_modules=(Block,))
        try:
            quiet_trainer(strategy, world_size, max_steps=1).fit(model, DataLoader(_data(), batch_size=8))
            messages.append("trained")
        except Exception as error:
            messages.append(f"{type(error).__name__}: {error}")
    return messages


@CPU_FSDP2
@pytest.mark.slow
def test_bad_setups_are_named_on_every_rank_before_a_step() -> None:
    cases = {
        "unsharded": (
            "ValueError: strategy='balanced_fsdp' found no module sharded with FSDP2 in Regressor: apply"
            " `fully_shard(..., mesh=self.device_mesh['data_parallel'])` in the LightningModule's `configure_model`,"
            " or pass `BalancedFSDPStrategy(shard_modules=(YourBlock,))`"
        ),
        "batchnorm": (
            "ValueError: strategy='balanced_fsdp' cannot give the step of one process on the global batch with"
            " BatchNorm layers (blocks.4): each rank would normalize its own share; use strategy='balanced_ddp'"
            " (synchronized BatchNorm over uneven shares), or a normalization over features (LayerNorm, GroupNorm)"
        ),
        "shares": "ValueError: `chunk_sizes` needs one entry per device (2), got 3: [1, 2, 5]",
        "capacities": "ValueError: `capacities` needs one entry per rank (2), got 1: [1000000000]",
        "data_parallel_size": (
            "ValueError: strategy='balanced_fsdp' shards over every rank: `data_parallel_size` must be the world size"
            " (2) or 'auto', got 3"
        ),
    }
    results = run_distributed(_error_rank, 2, list(cases), timeout_s=300)
    for index, (case, message) in enumerate(cases.items()):
        assert [results[rank][index] for rank in range(2)] == [message] * 2, case


def test_bad_arguments_name_what_was_expected() -> None:
    if TorchVersion(torch.__version__) < FSDP2_TORCH:
        with raises_exactly(
            ImportError,
            f"strategy='balanced_fsdp' needs torch >= 2.6 (FSDP2's public `torch.distributed.fsdp.fully_shard`),"
            f" found {torch.__version__}: upgrade torch, or use strategy='balanced_ddp' for a model that fits on"
            " every device",
        ):
            BalancedFSDPStrategy()
        return
    with raises_exactly(
        ValueError,
        "strategy='balanced_fsdp' plans one share per rank of the data-parallel group: `tensor_parallel_size` must"
        " be 1, got 2 (a tensor-parallel group would have to take one share)",
    ):
        BalancedFSDPStrategy(tensor_parallel_size=2)
    with raises_exactly(ValueError, "`capacities[1]` must be >= 1, got 0"):
        BalancedFSDPStrategy(capacities=[10, 0])
    with raises_exactly(TypeError, "`shard_modules[0]` must be an nn.Module subclass, got 'Block'"):
        BalancedFSDPStrategy(shard_modules=("Block",))  # type: ignore[arg-type]
    with raises_exactly(ValueError, "`loss_reduction` must be 'mean' or 'sum', got 'max'"):
        BalancedFSDPStrategy(loss_reduction="max")  # type: ignore[arg-type]


def test_registered_name() -> None:
    if TorchVersion(torch.__version__) < FSDP2_TORCH:
        pytest.skip(f"FSDP2 needs torch >= {FSDP2_TORCH}")
    trainer = quiet_trainer("balanced_fsdp", 2, max_steps=1)
    assert isinstance(trainer.strategy, BalancedFSDPStrategy)
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}


def test_every_rank_runs_as_many_micro_batches_as_the_rank_that_needs_most() -> None:
    """Each FSDP2 forward pass all-gathers the parameters: a rank with a smaller share runs smaller micro-batches."""
    engine = ShareEngine("balanced_fsdp", EvenSplit(), "mean", [4, 2], True)
    engine.equal_micro_batches = True
    share = RankShare(global_size=8, chunk_sizes=[3, 5], indices=[0, 1, 2], sequence=0)
    for rank, expected in ((0, [(0, 1), (1, 1), (2, 1)]), (1, [(0, 2), (2, 2), (4, 1)])):
        engine.bind(SimpleNamespace(world_size=2, global_rank=rank, root_device=torch.device("cpu")))
        mine = share if rank == 0 else RankShare(8, [3, 5], [3, 4, 5, 6, 7], 0)
        assert engine._pieces(mine) == expected  # rank 1's 5 samples need 3 micro-batches of at most 2
