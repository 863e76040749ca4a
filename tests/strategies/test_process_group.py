"""The default process group: ``ProcessGroupStrategy`` launched as DDP is (the pipelines' base), and
``end_process_group``, the group of a finished run ended on every rank, on 2 real gloo ranks."""

from __future__ import annotations

import os
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.strategies import DDPStrategy, ParallelStrategy
from lightning.pytorch.strategies.launchers import _MultiProcessingLauncher, _SubprocessScriptLauncher

from lightning_balanced import PipelineStrategy
from lightning_balanced.strategies.process_group import ProcessGroupStrategy, end_process_group
from tests.distributed import run_distributed


@pytest.mark.parametrize(
    ("start_method", "launcher"), [("popen", _SubprocessScriptLauncher), ("spawn", _MultiProcessingLauncher)]
)
def test_the_pipeline_is_a_parallel_strategy_launched_as_ddp_without_its_wrapper(
    start_method: str, launcher: type
) -> None:
    assert issubclass(PipelineStrategy, ParallelStrategy) and not issubclass(PipelineStrategy, DDPStrategy)
    strategy = PipelineStrategy(start_method=start_method, process_group_backend="gloo")  # type: ignore[arg-type]
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=3, num_nodes=2, logger=False)
    assert trainer.strategy is strategy and isinstance(strategy.launcher, launcher)
    assert (strategy.num_processes, strategy.num_nodes, strategy.world_size) == (3, 2, 6)
    assert strategy.is_distributed and strategy.process_group_backend == "gloo"
    assert strategy.root_device == torch.device("cpu")


def _group_rank(rank: int, world_size: int) -> dict[str, Any]:
    """The default group's collectives through the strategy, as Lightning's connectors set it up on each rank."""
    os.environ["LOCAL_RANK"] = str(rank)  # what Lightning's launcher sets for each process it starts
    strategy = ProcessGroupStrategy(parallel_devices=[torch.device("cpu")] * world_size)
    strategy.cluster_environment = LightningEnvironment()
    strategy.setup_distributed()  # the group is already there (run_distributed made it): ranks set, nothing else
    reduced = strategy.reduce(torch.tensor(float(rank + 1)), reduce_op="sum")
    strategy.barrier()
    broadcast = strategy.broadcast(f"from {rank}", src=1)
    return {"rank": strategy.global_rank, "reduced": float(reduced), "broadcast": broadcast}


@pytest.mark.slow
def test_reduce_barrier_and_broadcast_run_on_the_default_group() -> None:
    expected = {"reduced": 3.0, "broadcast": "from 1"}
    assert run_distributed(_group_rank, 2) == [{"rank": 0, **expected}, {"rank": 1, **expected}]


def _end_rank(rank: int, world_size: int) -> tuple[bool, bool]:
    before = dist.is_initialized()
    end_process_group(timeout_s=30)
    return before, dist.is_initialized()


@pytest.mark.slow
def test_every_rank_ends_its_group() -> None:
    assert run_distributed(_end_rank, 2) == [(True, False), (True, False)]


def _rank_1_absent(rank: int, world_size: int) -> str:
    if rank == 1:
        return "absent"  # never reaches the barrier
    try:
        end_process_group(timeout_s=2)
    except RuntimeError as error:
        return str(error).splitlines()[0]
    return "no error"


@pytest.mark.slow
def test_a_rank_that_never_arrives_is_named_in_an_error_after_the_timeout() -> None:
    rank_0, rank_1 = run_distributed(_rank_1_absent, 2)
    assert rank_1 == "absent"
    # torch's monitored_barrier names the missing rank (the same first line on torch 2.4.1 and 2.13).
    assert rank_0 == "[Rank 0]: Ranks 1 failed to pass monitoredBarrier in 2000 ms"


def test_without_a_group_it_does_nothing() -> None:
    assert not dist.is_initialized()
    end_process_group()
    assert not dist.is_initialized()
