"""One traceback per failure of a 2-process run: the failing rank prints its own, the other one line naming it.

The job (tests/strategies/failing_job.py) runs as a user runs it, ``python failing_job.py <strategy>``: Lightning's
script launcher starts rank 1, both processes print to the same stderr, and rank 1 raises in its second step.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from torch.torch_version import TorchVersion

from lightning_balanced.strategies.balanced_fsdp import FSDP2_CPU_TORCH

JOB = Path(__file__).with_name("failing_job.py")
CPU_FSDP2 = pytest.mark.skipif(
    TorchVersion(torch.__version__) < FSDP2_CPU_TORCH, reason=f"FSDP2 on CPU ranks needs torch >= {FSDP2_CPU_TORCH}"
)

# What rank 0 prints instead of a traceback, up to the backend's own words.
LOST = {
    "ddp_lr_linear": "rank 0 stopped: it lost its connection to another rank; rank 1 stopped on ValueError: a mistake"
    " on rank 1 (the backend said: ",
    "balanced_ddp": "rank 0 stopped: it lost its connection to another rank; rank 1 stopped on ValueError: a mistake"
    " on rank 1 (the backend said: ",
    "balanced_fsdp": "rank 0 stopped: it lost its connection to another rank; rank 1 stopped on ValueError: a"
    " mistake on rank 1 (the backend said: ",
    "pipeline": "PeerStopped: strategy='pipeline': rank 0 lost its connection to another rank in a training step:"
    " rank 1 stopped on ValueError: a mistake on rank 1 (its traceback is in that process's output). The backend"
    " said: ",
    # rank 1 fails in validation while rank 0 waits for it in gather_eval_outputs (a store exchange, no backend error)
    "gather": "PeerStopped: gather_eval_outputs: rank 0 stopped waiting for the other ranks: rank 1 stopped on"
    " ValueError: a mistake on rank 1",
}


def _run_job(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    env.pop("LOCAL_RANK", None)  # the launcher starts rank 1 itself
    began = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(JOB), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    return done, time.monotonic() - began


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy",
    [pytest.param(name, marks=CPU_FSDP2) if name == "balanced_fsdp" else name for name in LOST if name != "gather"],
)
def test_a_failing_rank_prints_the_one_traceback_and_the_other_rank_one_line(strategy: str, tmp_path: Path) -> None:
    done, _ = _run_job(tmp_path, strategy)
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    # Rank 1's traceback (Python's own format, or the condensed one some torch releases install): one.
    assert output.count("Traceback (most recent call last)") <= 1, output[-6000:]
    assert 'raise ValueError("a mistake on rank 1")' in output, output[-3000:]
    # Rank 0's one line, and nothing else of its error: the backend's words appear in that line only.
    assert any(line.startswith(LOST[strategy]) for line in output.splitlines()), output[-3000:]
    assert output.count("Connection closed by peer") == 1, output[-6000:]


@pytest.mark.slow
def test_a_rank_waiting_in_the_mixins_gather_names_the_failed_rank_in_one_line_at_once(tmp_path: Path) -> None:
    done, seconds = _run_job(tmp_path, "ddp_lr_linear", "gather")
    output = done.stdout + done.stderr
    assert done.returncode != 0, output[-3000:]
    assert output.count("Traceback (most recent call last)") <= 1, output[-6000:]
    assert 'raise ValueError("a mistake on rank 1")' in output, output[-3000:]
    assert any(line == LOST["gather"] for line in output.splitlines()), output[-3000:]
    assert seconds < 60, seconds  # not the gather's 120 s deadline
