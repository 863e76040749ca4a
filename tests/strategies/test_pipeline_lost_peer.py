"""strategy="pipeline": a rank killed next to each collective of the strategy, and what the other ranks say.

Each test runs 3 real gloo CPU ranks and SIGKILLs rank 2 (no Python code runs after it, so it reports nothing) where
the others are about to enter one collective of the strategy: the all_reduce of gradient clipping, the broadcasts that
share the stages after ``fit``, the collectives of saving a checkpoint, and the step's all_reduce that carries the
``16-mixed`` found-inf flag. (The schedule's exchanges in a step and the forward pass are
covered in test_pipeline_strategy.py.) Each surviving rank must stop within seconds, not at the process group's
timeout (60 s here), in the collective the scenario aims at, and its process must print one line that names rank 2
and says it was killed.

Rank 2 writes the time and its process id to a file as it kills itself. Each survivor writes when its call raised,
where (the innermost function of the strategy and of ``torch.distributed`` in the backend error's traceback), and what
its process would print when the error ends it (its ``sys.excepthook``, which the strategy replaces at setup, into a
buffer): a killed rank makes ``run_distributed`` report that rank only and drop the others' results.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import socket
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from torch.utils.data import DataLoader

import tests.distributed
from lightning_balanced import PipelineStrategy
from tests.distributed import DistributedRankError, run_distributed
from tests.helpers import quiet_trainer
from tests.strategies.test_pipeline_strategy import PipelinedRegressor, _data

WORLD_SIZE = 3
KILLED = 2  # the last stage's rank; not rank 0, whose process hosts the store the ranks leave their notices in
PROMPT_S = 10.0  # "within seconds": the process group's timeout is run_distributed's timeout_s / 2 = 60 s


def _kill_this_rank(record: str) -> None:
    Path(record, "killed.json").write_text(json.dumps({"at": time.time(), "pid": os.getpid()}))
    os.kill(os.getpid(), signal.SIGKILL)


class _KilledInAHook(PipelinedRegressor):
    """Rank ``KILLED`` kills its process in the LightningModule hook ``hook`` (in the step ``at_step``, if given)."""

    def __init__(self, hook: str, record: str, at_step: int | None = None) -> None:
        super().__init__()
        self.hook, self.record, self.at_step = hook, record, at_step

    def _killed_in(self, hook: str) -> None:
        if hook == self.hook and self.global_rank == KILLED and self.at_step in (None, self.global_step):
            _kill_this_rank(self.record)

    def on_before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:  # Lightning clips right after it
        self._killed_in("on_before_optimizer_step")

    def on_train_end(self) -> None:  # Lightning calls the strategy's on_train_end (sharing the stages) after it
        self._killed_in("on_train_end")

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:  # before the strategy's save_checkpoint
        self._killed_in("on_save_checkpoint")


class _KilledAfterTheSchedule(MixedPrecision):
    """``16-mixed`` (a ``GradScaler`` on the CPU) whose rank ``KILLED`` kills its process where the pipeline schedule
    of an armed step ends: the others then finish their schedule and enter the step's all_reduce, which carries the
    found-inf flag (the strategy runs the schedule inside ``train_step_context`` and the all_reduce right after it).

    The layers are float64, which autocast leaves as they are: what matters here is the scaler, which puts the flag in
    the all_reduce.
    """

    def __init__(self, record: str) -> None:
        super().__init__("16-mixed", "cpu", torch.amp.GradScaler("cpu"))
        self.record = record
        self.armed = False

    @contextlib.contextmanager
    def train_step_context(self) -> Iterator[None]:
        with super().train_step_context():
            yield
        if self.armed:
            _kill_this_rank(self.record)


class _ArmsThePrecisionInTheSecondStep(PipelinedRegressor):
    def on_train_batch_start(self, batch: Any, batch_idx: int) -> None:
        self.trainer.precision_plugin.armed = self.global_rank == KILLED and batch_idx == 1  # type: ignore[attr-defined]


def _where(error: BaseException) -> list[str]:
    """The innermost function of the package and of ``torch.distributed`` where the backend's error was raised."""
    # the error as raised (the strategy's frames down to where a peer was named), then its cause (down to the backend)
    frames = traceback.extract_tb(error.__traceback__)
    if error.__cause__ is not None:
        frames += traceback.extract_tb(error.__cause__.__traceback__)
    ours = [  # the wrappers that name a lost peer and the process group's plumbing are not where it happened
        frame.name
        for frame in frames
        if f"lightning_balanced{os.sep}" in frame.filename
        and not frame.filename.endswith(("peer_failure.py", "process_group.py"))
    ]
    torch_distributed = [frame.name for frame in frames if frame.filename.endswith("distributed_c10d.py")]
    return [ours[-1] if ours else "", torch_distributed[-1] if torch_distributed else ""]


def _stop_with_a_killed_rank(rank: int, world_size: int, scenario: str, record: str) -> str:
    """Train (and save) until rank ``KILLED`` is killed; record when, where and how this rank stopped."""
    options: dict[str, Any] = {"max_steps": 3}
    if scenario == "clipping":
        model: PipelinedRegressor = _KilledInAHook("on_before_optimizer_step", record, at_step=1)
        options["gradient_clip_val"] = 1.0  # by norm: the strategy's all_reduce of the squared norm over the pipeline
    elif scenario == "sharing the stages":
        model = _KilledInAHook("on_train_end", record)
        options["max_steps"] = 1
    elif scenario == "saving a checkpoint after fit":
        model = _KilledInAHook("on_save_checkpoint", record)
        options["max_steps"] = 1
    else:
        assert scenario == "found-inf"
        model = _ArmsThePrecisionInTheSecondStep()
        options["plugins"] = [_KilledAfterTheSchedule(record)]
    trainer = quiet_trainer(PipelineStrategy(schedule="GPipe", chunks=2), world_size, **options)
    try:
        trainer.fit(model, DataLoader(_data(24), batch_size=4))
        if scenario == "saving a checkpoint after fit":
            trainer.save_checkpoint(Path(record, "checkpoint"))
    except Exception as error:
        stopped_at = time.time()
        printed = io.StringIO()
        with contextlib.redirect_stderr(printed):
            sys.excepthook(type(error), error, error.__traceback__)
        outcome = {"at": stopped_at, "where": _where(error), "printed": printed.getvalue()}
        Path(record, f"rank{rank}.json").write_text(json.dumps(outcome))
        return "stopped"
    return "finished"


def _one_line_naming_the_killed_rank(rank: int, pid: int) -> re.Pattern[str]:
    """What rank ``rank`` prints: the mark of ``on_exception``, or the strategy's ``PeerStopped`` (either names it)."""
    killed = re.escape(
        f"rank {KILLED} (process {pid} on host {socket.gethostname()}) no longer runs and reported no error:"
        " it was killed"
    )
    marked = re.escape(f"rank {rank} stopped: it lost its connection to another rank; ") + killed
    marked += re.escape(" (the backend said: ") + r"[^\n]+\)"
    peer_stopped = re.escape(f"PeerStopped: strategy='pipeline': rank {rank} lost its connection to another rank in ")
    peer_stopped += r"[^:\n]+: " + killed
    peer_stopped += re.escape(". The backend said: ") + r"[^\n]+"  # a killed rank left no traceback to point to
    return re.compile(rf"(?:{marked}|{peer_stopped})\n")


# scenario -> [the package's function, torch.distributed's function] where each survivor stops
SCENARIOS = {
    "clipping": ["clip_grad_by_global_norm", "all_reduce"],
    "sharing the stages": ["broadcast_stages", "broadcast"],
    "saving a checkpoint after fit": ["save_checkpoint", "broadcast"],
    "found-inf": ["_exchange", "all_reduce"],
}


@pytest.mark.slow
@pytest.mark.parametrize(
    "scenario",
    list(SCENARIOS),
)
def test_a_rank_killed_next_to_a_collective_is_named_by_the_others_in_one_line_within_seconds(
    scenario: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The survivors report after rank 2 is gone: wait for them past the process group's timeout, so a hang shows as
    # a late report rather than as a missing one.
    monkeypatch.setattr(tests.distributed, "_ERROR_GRACE_S", 90.0)
    with pytest.raises(DistributedRankError) as info:
        run_distributed(_stop_with_a_killed_rank, WORLD_SIZE, scenario, str(tmp_path), timeout_s=120)
    report = str(info.value)
    assert report.startswith(f"1 of {WORLD_SIZE} ranks failed:\n--- rank {KILLED} ---\nexited without a result"), report
    killed = json.loads((tmp_path / "killed.json").read_text())
    for rank in [rank for rank in range(WORLD_SIZE) if rank != KILLED]:
        record = tmp_path / f"rank{rank}.json"
        assert record.is_file(), f"rank {rank} did not stop within 90 s of rank {KILLED}'s death"
        survivor = json.loads(record.read_text())
        assert survivor["where"] == SCENARIOS[scenario], survivor
        assert survivor["at"] - killed["at"] < PROMPT_S, survivor
        assert _one_line_naming_the_killed_rank(rank, killed["pid"]).fullmatch(survivor["printed"]), survivor
