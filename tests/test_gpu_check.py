"""tools/gpu_check.py without a GPU: its child commands' limits, its verdicts, its summary line, its no-GPU exit."""

from __future__ import annotations

import argparse
import importlib.util
import io
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location("gpu_check", ROOT / "tools" / "gpu_check.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


gpu_check = _load_tool()


def _python(code: str) -> list[str]:
    return [sys.executable, "-c", code]


def _alive(pid: int) -> bool:
    """Whether ``pid`` still runs (a zombie waiting for a reaper does not)."""
    try:
        status = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return False
    return "\nState:\tZ" not in status


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.slow
def test_a_command_past_its_limit_is_a_timeout_and_its_whole_process_group_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "grandchild"
    code = (
        "import subprocess, sys, time\n"
        f"child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid))\n"
        "print('started', flush=True)\n"
        "time.sleep(60)\n"
    )
    out = io.StringIO()
    started = time.monotonic()
    outcome = gpu_check.run_command(gpu_check.Tee(None, out), _python(code), timeout_s=2.0, grace_s=1.0)
    assert time.monotonic() - started < 15
    assert outcome.timed_out and outcome.returncode is None
    assert "started" in outcome.tail  # streamed while it ran, not only at its end
    assert "started" in out.getvalue() and "time limit of 2 s reached" in out.getvalue()
    deadline = time.monotonic() + 5
    while _alive(int(pid_file.read_text())) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(int(pid_file.read_text()))


def test_a_command_that_ends_gives_its_status_and_output() -> None:
    out = io.StringIO()
    outcome = gpu_check.run_command(
        gpu_check.Tee(None, out), _python("print('partial', end=''); raise SystemExit(3)"), timeout_s=30
    )
    assert (outcome.returncode, outcome.timed_out) == (3, False)
    assert outcome.tail == "partial"
    assert out.getvalue().endswith("partial")


def _outcome(tail: str, returncode: int | None = 0, timed_out: bool = False) -> Any:
    return gpu_check.Outcome(returncode, timed_out, tail, 1.5)


def test_a_benchmark_passes_with_its_summary_line_and_the_note_quotes_it() -> None:
    step = gpu_check.plan_steps(_args())[1]
    assert step.name == "bench_nms_cuda"
    tail = (
        "GOAL nms 1k: ...\ngoal_table: 4/6 rows pass\n"
        "chain_over_per_tile=1.368 (below 1: the persistent chain is faster)\n"
        "tiles_over_single=1.250 (above 1: the single launch is faster)\n"
        "mixed_1m_time_s=4.12345 mixed_1m_peak_gib=0.1300 (nms, float32, IoU 0.5)\n"
        "worst_ratio_vs_torchvision_cuda=6.618\n"
    )
    result = step.judge(_outcome(tail))
    assert result.status == gpu_check.PASSED
    assert result.note == (
        "goal_table: 4/6 rows pass chain_over_per_tile=1.368 tiles_over_single=1.250 mixed_1m_time_s=4.12345 "
        "mixed_1m_peak_gib=0.1300 worst_ratio_vs_torchvision_cuda=6.618"
    )
    assert step.judge(_outcome("padded: ...\n")).status == gpu_check.FAILED  # exit 0, but no summary (a skip)
    failed = step.judge(_outcome("FAILED: nms uniform float32 N=1000: ...\nworst_ratio_vs_torchvision_cuda=1\n", 1))
    assert failed.status == gpu_check.FAILED
    assert "FAILED: nms uniform float32 N=1000: ..." in failed.problems
    timed_out = step.judge(_outcome("== uniform, float32 ==\n", None, timed_out=True))
    assert timed_out.status == gpu_check.TIMEOUT and timed_out.failed


def test_the_tests_step_quotes_pytests_summary_and_lists_each_failure() -> None:
    step = gpu_check.plan_steps(_args())[0]
    assert step.name == "tests"
    tail = (
        "=========================== short test summary info ============================\n"
        "FAILED tests/ops/test_nms.py::test_a - AssertionError: no\n"
        "ERROR tests/ops/test_nms.py::test_b - RuntimeError: CUDA\n"
        "SKIPPED [2] tests/helpers.py:40: needs 2 CUDA GPUs\n"
        "============= 1 failed, 75 passed, 2 skipped, 1 error in 45.12s =============\n"
    )
    result = step.judge(_outcome(tail, 1))
    assert result.status == gpu_check.FAILED
    assert result.note == "1 failed, 75 passed, 2 skipped, 1 error in 45.12s"
    assert result.problems[1:] == [
        "FAILED tests/ops/test_nms.py::test_a - AssertionError: no",
        "ERROR tests/ops/test_nms.py::test_b - RuntimeError: CUDA",
    ]
    passed = step.judge(_outcome("==== 79 passed in 30.01s ====\n"))
    assert (passed.status, passed.note) == (gpu_check.PASSED, "79 passed in 30.01s")


def test_pytest_runs_the_cuda_tests_with_tracebacks_and_each_plugin_it_finds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gpu_check, "_have", lambda module: True)
    command = gpu_check.pytest_command(full=False, workers=8, test_timeout_s=60)
    assert command[1:5] == ["-m", "pytest", "--cuda-only", "-v"]
    assert {"-rfEs", "--tb=short", "--timeout=60", "--timeout-method=thread"} <= set(command)
    assert command[command.index("-n") + 1] == "8"
    assert "no:benchmark" in command  # pytest-benchmark refuses xdist
    monkeypatch.setattr(gpu_check, "_have", lambda module: False)
    command = gpu_check.pytest_command(full=True, workers=8, test_timeout_s=60)
    assert "--cuda-only" not in command and "-n" not in command and "no:benchmark" not in command
    assert not any(arg.startswith("--timeout") for arg in command)
    assert command[-2:] == ["-o", "faulthandler_timeout=60"]  # the stack of a hung test, without pytest-timeout


def _args(*argv: str) -> argparse.Namespace:
    args: argparse.Namespace = gpu_check._parser().parse_args(list(argv))
    args.workers = 8
    return args


def test_the_default_plan_fits_five_minutes_and_runs_1m_boxes() -> None:
    steps = gpu_check.plan_steps(_args())
    assert [s.name for s in steps] == ["tests", "bench_nms_cuda", "bench_cuda", "bench_auto_split"]
    # the tests within their limit, and each benchmark with at least what the budget keeps for it
    assert steps[0].limit_s + sum(s.reserve_s for s in steps[1:]) + 20 <= gpu_check.DEFAULT_BUDGET_S <= 300
    nms = steps[1].command
    assert "--sizes" not in nms and "--full" not in nms  # the goal table, its 1M row included
    assert [s.name for s in gpu_check.plan_steps(_args("--no-tests"))] == [s.name for s in steps[1:]]
    assert [s.name for s in gpu_check.plan_steps(_args("--no-benchmarks"))] == ["tests"]
    full = gpu_check.plan_steps(_args("--full"))
    assert "--full" in full[1].command and "--quick" not in full[1].command


def test_a_step_gets_its_own_limit_or_what_the_budget_leaves_after_the_later_steps_share() -> None:
    step = gpu_check.Step("a", [], limit_s=100, reserve_s=100)
    later = [gpu_check.Step("b", [], limit_s=50, reserve_s=30), gpu_check.Step("c", [], limit_s=50, reserve_s=20)]
    assert gpu_check._time_for(step, later, deadline=None) == 100
    assert gpu_check._time_for(step, later, deadline=time.monotonic() + 500) == 100
    assert 49 < gpu_check._time_for(step, later, deadline=time.monotonic() + 100) <= 50


def test_without_a_gpu_it_says_so_and_fails_at_once(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(gpu_check, "run_command", None)  # nothing may be started
    assert gpu_check.main(["--log", str(tmp_path / "log")]) == 1
    printed = capsys.readouterr().out
    assert "no CUDA GPU visible to torch" in printed
    assert printed.splitlines()[-1] == "gpu_check: FAILED (environment)"
    assert (tmp_path / "log").read_text() == printed


def test_dry_run_prints_the_plan_and_runs_nothing(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    monkeypatch.setattr(gpu_check, "run_command", None)
    assert gpu_check.main(["--dry-run", "--log", str(tmp_path / "log")]) == 0
    printed = capsys.readouterr().out
    assert (
        "budget 290 s" in printed and "bench_nms_cuda.py --warmup 1 --repeats 5" in printed and "--cuda-only" in printed
    )
    assert not (tmp_path / "log").exists()


@pytest.mark.slow
def test_each_step_is_in_the_table_and_the_last_line_names_the_steps_that_failed(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    def passes(tee: Any, result: Any) -> None:
        result.note = "fine"

    monkeypatch.setattr(gpu_check, "check_environment", passes)
    monkeypatch.setattr(gpu_check, "check_extension", passes)
    steps = [
        gpu_check.Step(
            "good", _python("print('good_ratio=1.0')"), 30, 30, quote=(r"good_ratio=\S+",), required="^good"
        ),
        gpu_check.Step("bad", _python("raise SystemExit(2)"), 30, 30),
        gpu_check.Step("hangs", _python("import time; time.sleep(60)"), 2, 2, grace_s=1),
    ]
    monkeypatch.setattr(gpu_check, "plan_steps", lambda args: steps)
    monkeypatch.setattr(gpu_check, "MIN_STEP_S", 1.0)
    started = time.monotonic()
    assert gpu_check.main(["--log", str(tmp_path / "log")]) == 1
    assert time.monotonic() - started < 20
    lines = capsys.readouterr().out.splitlines()
    assert lines[-1] == "gpu_check: FAILED (bad, hangs timeout)"
    table = lines[lines.index(next(line for line in lines if line.startswith("step "))) :]
    assert [line.split()[:2] for line in table[1:6]] == [
        ["environment", "PASSED"],
        ["extension", "PASSED"],
        ["good", "PASSED"],
        ["bad", "FAILED"],
        ["hangs", "TIMEOUT"],
    ]
    assert table[3].endswith("good_ratio=1.0")
    assert gpu_check.summary_line([gpu_check.Result("a", gpu_check.PASSED)]) == "gpu_check: PASSED"
