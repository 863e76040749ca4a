"""Check a GPU machine in one command: the environment, the compiled CUDA kernels, the CUDA benchmarks, the GPU tests.

Run from the repository root, after ``pip install --no-build-isolation -e ".[test]"`` (this command builds nothing):

    python tools/gpu_check.py [--full] [--workers N] [--no-tests] [--no-benchmarks] [--budget S] [--dry-run]

By default the whole check fits a time budget (``--budget``, 290 s: within 5 minutes on one H100 with 16 cores, the
extension built). The steps, in order, each printed as it runs and copied to ``--log`` (``gpu_check.log``):

1. ``environment``: Python, torch and its CUDA, the GPUs, Lightning, torchmetrics, torchvision. Without a CUDA GPU
   the check stops here: it says so and exits with status 1 (every other step ``SKIPPED``), in a few seconds;
2. ``extension``: ``lightning_balanced._C`` loads, every op has a CUDA kernel registered, and the ``.so`` links the
   shared libstdc++ (a private static copy breaks ``TORCH_CHECK`` messages);
3. ``tests``: ``pytest --cuda-only``, every test that needs a GPU or nvcc (``tests.helpers.RunIf``), with
   ``-rfEs --tb=short`` (each failure's traceback, each skip's reason), in parallel with pytest-xdist when installed
   (``-p no:benchmark``: pytest-benchmark refuses xdist), each test limited to ``--test-timeout`` seconds when
   pytest-timeout is installed. The tests run first: their tracebacks are what a short GPU loan is for;
4. the CUDA benchmarks, each in a form that fits the rest of the budget: ``bench_nms_cuda`` (the goal table of issue
   #26: the CUDA NMS against torchvision's CUDA kernel and our CPU kernel from 1k to 1M boxes, and the padded batch
   in a CUDA graph; its verdict ``goal_table: K/6 rows pass`` is quoted, with ``chain_over_per_tile`` and
   ``tiles_over_single``, the A/B of the persistent chain and of the single launch), ``bench_cuda --quick`` (balanced_dp
   and gpipe on one GPU against one device) and ``bench_auto_split --device cuda --quick`` (``chunk_sizes="auto"``
   against the even split: the cost of profiling).

Every step runs in its own process group with a wall-clock limit: the smaller of its own limit and what the budget
has left after keeping the later steps' share. At the limit the step gets SIGINT (pytest then prints the failures it
has so far), then its whole process group SIGKILL, and it is reported as ``TIMEOUT``. The output ends with a table
of the steps (status, seconds, the step's own summary) and one line, ``gpu_check: PASSED`` or
``gpu_check: FAILED (<steps>)`` (exit status 1).

``--full``: no overall budget, the whole test suite (not only ``--cuda-only``, a longer per-test limit) and every
benchmark in its full form (``bench_nms_cuda --full``: up to 1M boxes in every table): tens of minutes. ``--dry-run``
prints the plan (commands, time limits) and runs nothing; it needs no GPU.
"""

from __future__ import annotations

import argparse
import codecs
import contextlib
import importlib
import importlib.util
import os
import re
import shlex
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TextIO

ROOT = Path(__file__).resolve().parents[1]

PASSED, FAILED, TIMEOUT, SKIPPED, NOT_RUN = "PASSED", "FAILED", "TIMEOUT", "SKIPPED", "NOT RUN"

#: The default budget of the whole check, seconds (the issue asks for at most 5 minutes).
DEFAULT_BUDGET_S = 290.0
#: A step is not started with less than this left to it (it is ``NOT RUN``, and the check fails).
MIN_STEP_S = 10.0


class Tee:
    """Writes to the terminal and the log as things happen, flushing both; safe to call from a reader thread."""

    def __init__(self, log: TextIO | None, out: TextIO | None = None) -> None:
        self.log = log
        self.out = out if out is not None else sys.stdout
        self._lock = threading.Lock()
        self._at_line_start = True

    def write(self, text: str) -> None:
        if not text:
            return
        with self._lock:
            for stream in (self.out, self.log):
                if stream is not None:
                    stream.write(text)
                    stream.flush()
            self._at_line_start = text.endswith("\n")

    def say(self, text: str) -> None:
        """One or more whole lines (a child's unfinished line is ended first)."""
        self.write(("" if self._at_line_start else "\n") + text + "\n")

    def heading(self, title: str) -> None:
        self.say(f"\n==== {title} ====")


@dataclass
class Result:
    """One step's verdict: its status, wall seconds, a short note (its own summary) and what went wrong."""

    name: str
    status: str
    seconds: float = 0.0
    note: str = ""
    problems: list[str] = field(default_factory=list)

    @property
    def failed(self) -> bool:
        return self.status in (FAILED, TIMEOUT, NOT_RUN)


# ---------------------------------------------------------------------------------------------------------------
# Running a child command
# ---------------------------------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """How a child command ended: its exit status (``None`` if it was killed), whether it ran out of time, the last
    part of its output."""

    returncode: int | None
    timed_out: bool
    tail: str
    seconds: float


def _pump(fd: int, tee: Tee, tail: list[str], tail_chars: int) -> None:
    """Copy a child's output to ``tee`` as it comes (bytes, not lines: a progress line shows before its end); keep
    its last ``tail_chars`` characters in ``tail[0]``."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    while True:
        try:
            chunk = os.read(fd, 65536)
        except OSError:
            break
        text = decoder.decode(chunk, final=not chunk)
        tee.write(text)
        tail[0] = (tail[0] + text)[-tail_chars:]
        if not chunk:
            break


def _signal_group(pid: int, sig: int) -> None:
    """Send ``sig`` to the process group this check started for a step (``start_new_session``); gone is fine."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


def run_command(
    tee: Tee,
    command: list[str],
    timeout_s: float,
    grace_s: float = 5.0,
    env: dict[str, str] | None = None,
    tail_chars: int = 65536,
) -> Outcome:
    """Run ``command`` from the repository root in a new process group, streaming its output to ``tee``.

    At ``timeout_s`` the command gets SIGINT (its process group leader only: pytest then prints what it has, and
    stops its xdist workers), ``grace_s`` later its whole process group SIGKILL. Whatever the command leaves behind in
    its group (xdist workers, DataLoader workers) is killed when it ends, so nothing holds the GPU into the next step.
    """
    tee.say(f"+ {shlex.join(command)}    # time limit {timeout_s:.0f} s")
    child_env = dict(os.environ if env is None else env)
    child_env.setdefault("PYTHONUNBUFFERED", "1")  # a child's prints reach the log as they happen
    child_env.setdefault("PYTHONFAULTHANDLER", "1")  # a crash in native code still prints the Python stack
    started = time.monotonic()
    process = subprocess.Popen(
        command,
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=child_env,
        start_new_session=True,
    )
    assert process.stdout is not None
    tail = [""]
    reader = threading.Thread(target=_pump, args=(process.stdout.fileno(), tee, tail, tail_chars), daemon=True)
    reader.start()
    timed_out = False
    returncode: int | None
    try:
        returncode = process.wait(timeout=max(timeout_s, 0.0))
    except subprocess.TimeoutExpired:
        timed_out = True
        tee.say(f"[gpu_check] time limit of {timeout_s:.0f} s reached: SIGINT, then SIGKILL in {grace_s:.0f} s")
        try:
            process.send_signal(signal.SIGINT)
            returncode = process.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            returncode = None
    finally:  # also on KeyboardInterrupt: leave nothing running
        _signal_group(process.pid, signal.SIGKILL)
        process.wait()
        reader.join(timeout=5.0)  # a grandchild in its own session may still hold the pipe: do not wait for it
        if not reader.is_alive():  # else the reader still reads that descriptor: closing it could hand it on
            process.stdout.close()
    return Outcome(None if timed_out else returncode, timed_out, tail[0], time.monotonic() - started)


# ---------------------------------------------------------------------------------------------------------------
# The steps run in this process: the environment and the extension
# ---------------------------------------------------------------------------------------------------------------


def _version(name: str) -> str:
    try:
        return str(importlib.import_module(name).__version__)
    except Exception as err:  # a package missing, or built for another torch
        return f"not importable ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"


def check_environment(tee: Tee, result: Result) -> None:
    import torch

    tee.say(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda})")
    for name in ("lightning", "torchmetrics", "torchvision"):
        tee.say(f"{name} {_version(name)}")
    if not torch.cuda.is_available():
        result.problems.append(
            f"no CUDA GPU visible to torch {torch.__version__} (CUDA {torch.version.cuda}): nothing to check on this "
            "machine; run it on a GPU machine (--dry-run shows the plan)"
        )
        result.note = "no CUDA GPU"
        return
    names = []
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        names.append(props.name)
        tee.say(
            f"cuda:{index}: {props.name}, {props.total_memory / 2**30:.1f} GiB, compute capability "
            f"{props.major}.{props.minor}"
        )
    result.note = f"{', '.join(names)}; torch {torch.__version__}"


def _needed_libraries(path: Path) -> list[str] | None:
    """The ``.so``'s dynamic dependencies, read by the build's own check (``setup.needed_libraries``)."""
    spec = importlib.util.spec_from_file_location("lightning_balanced_setup", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)  # setup() itself runs only as __main__
    return build.needed_libraries(path)  # type: ignore[no-any-return]


def check_extension(tee: Tee, result: Result) -> None:
    from lightning_balanced import ops

    if not ops.has_compiled_ops():
        result.problems.append(
            "lightning_balanced._C did not load; build it with `pip install --no-build-isolation -e .` on this machine"
        )
        return
    spec = importlib.util.find_spec("lightning_balanced._C")
    so = Path(spec.origin) if spec is not None and spec.origin else None
    tee.say(f"lightning_balanced._C: {so}")
    # every op the extension defined (its schemas, read from the dispatcher), so a new op is checked here too
    kernels = ops.registered_kernels()
    for op, device_types in kernels.items():
        for device_type in ("cpu", "cuda"):
            registered = device_type in device_types
            tee.say(f"lightning_balanced::{op} {device_type} kernel: {'registered' if registered else 'MISSING'}")
            if not registered:
                result.problems.append(f"no {device_type} kernel for lightning_balanced::{op}; rebuild with nvcc")
    result.note = f"{len(kernels)} ops"
    if so is not None:
        needed = _needed_libraries(so)
        if needed is None:
            return  # not ELF
        tee.say(f"links: {', '.join(needed)}")
        libstdcxx = [name for name in needed if name.startswith("libstdc++.so")]
        if not libstdcxx:
            result.problems.append(f"{so.name} does not link the shared libstdc++ (a private static copy); rebuild it")
        else:
            result.note += f", links {libstdcxx[0]}"


def run_in_process(tee: Tee, name: str, check: Callable[[Tee, Result], None]) -> Result:
    """Run a check of this process; an exception is that step's failure (with its traceback), not the command's."""
    tee.heading(name)
    result = Result(name, PASSED)
    started = time.monotonic()
    try:
        check(tee, result)
    except Exception as err:
        tee.say(traceback.format_exc().rstrip())
        result.problems.append(f"{type(err).__name__}: {err}")
    result.seconds = time.monotonic() - started
    if result.problems:
        result.status = FAILED
        for problem in result.problems:
            tee.say(f"FAILED: {problem}")
    return result


# ---------------------------------------------------------------------------------------------------------------
# The steps run as child commands: the benchmarks and the tests
# ---------------------------------------------------------------------------------------------------------------

# pytest's last line: "==== 2 failed, 75 passed, 4 skipped in 45.12s ====" (a "(0:01:02)" after the seconds)
_PYTEST_SUMMARY = re.compile(r"^=+ (?P<text>.*\b(?:passed|failed|errors?|skipped|deselected|no tests ran)\b.*?) =+$")
_PYTEST_PROBLEM = re.compile(r"^(?:FAILED|ERROR) \S+")


@dataclass
class Step:
    """A child command: its limit, the time earlier steps keep for it, and how its output is read."""

    name: str
    command: list[str]
    limit_s: float  # its own wall-clock limit
    reserve_s: float  # what earlier steps leave for it out of the budget
    quote: tuple[str, ...] = ()  # regular expressions of the lines its note quotes (the last match of each)
    required: str | None = None  # a line it must print to pass (its summary)
    grace_s: float = 5.0  # between SIGINT and SIGKILL at its limit
    is_pytest: bool = False

    def judge(self, outcome: Outcome) -> Result:
        lines = [line.strip() for line in outcome.tail.splitlines() if line.strip()]
        result = Result(self.name, PASSED, outcome.seconds)
        if self.is_pytest:
            summaries = [m.group("text") for m in map(_PYTEST_SUMMARY.match, lines) if m]
            result.note = summaries[-1] if summaries else ""
            result.problems += [line for line in lines if _PYTEST_PROBLEM.match(line)]
        else:
            quoted = []
            for pattern in self.quote:
                matches = [m.group(0) for m in map(re.compile(pattern).search, lines) if m]
                if matches:
                    quoted.append(matches[-1])
            result.note = " ".join(quoted)
            result.problems += [line for line in lines if line.startswith("FAILED:")]
        if outcome.timed_out:
            result.status = TIMEOUT
            result.problems.insert(0, f"{self.name}: time limit reached ({outcome.seconds:.0f} s)")
            result.note = f"time limit reached; {result.note}" if result.note else "time limit reached"
            return result
        missing = self.required is not None and not any(re.search(self.required, line) for line in lines)
        if outcome.returncode != 0 or missing:
            result.status = FAILED
            last = lines[-1] if lines else ""
            result.problems.insert(0, f"{self.name}: exit status {outcome.returncode}, last line {last!r}")
            if not result.note:
                result.note = f"exit status {outcome.returncode}"
        return result


def _have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def pytest_command(full: bool, workers: int, test_timeout_s: float) -> list[str]:
    """The GPU tests (all tests with ``full``): tracebacks of failures, reasons of skips, one line per test."""
    command = [sys.executable, "-m", "pytest", "-v", "-rfEs", "--tb=short", "-p", "no:cacheprovider"]
    if not full:
        command.insert(3, "--cuda-only")
    xdist = workers > 1 and _have("xdist")
    if xdist:
        command += ["-n", str(workers)]
        if _have("pytest_benchmark"):
            command += ["-p", "no:benchmark"]  # pytest-benchmark refuses xdist
    if test_timeout_s > 0:
        dump_s = test_timeout_s
        if _have("pytest_timeout"):
            # thread: also ends a test stuck in native code (a CUDA sync); it ends the process, which xdist reports
            # as that test's failure ("worker crashed while running ...") and replaces. Without xdist that would end
            # the whole run, so the signal method there.
            command += [f"--timeout={test_timeout_s:g}", f"--timeout-method={'thread' if xdist else 'signal'}"]
            dump_s = max(1.0, 0.9 * test_timeout_s)
        # pytest's own faulthandler prints every thread's stack of a test running this long, to the real stderr:
        # it reaches the log from an xdist worker too (pytest-timeout's thread method prints its dump to the
        # worker's stdout, which xdist drops), and before pytest-timeout ends the test
        command += ["-o", f"faulthandler_timeout={dump_s:g}"]
    return command


def plan_steps(args: argparse.Namespace) -> list[Step]:
    """The child commands, in the order they run."""
    python, bench = sys.executable, ROOT / "benchmarks"
    steps: list[Step] = []
    # The tests first: their tracebacks are what a short GPU loan is for; the benchmarks get the rest of the budget.
    if not args.no_tests:
        test_timeout = args.test_timeout if args.test_timeout is not None else (300.0 if args.full else 60.0)
        steps.append(
            Step(
                "tests",
                pytest_command(args.full, args.workers, test_timeout),
                limit_s=3600.0 if args.full else 150.0,
                reserve_s=90.0,
                grace_s=20.0,  # xdist stops its workers, then pytest prints the failures so far
                is_pytest=True,
            )
        )
    if not args.no_benchmarks:
        if args.full:
            nms_args: list[str] = ["--full"]
            limits = {"bench_nms_cuda": 1800.0, "bench_cuda": 600.0, "bench_auto_split": 600.0}
            quick: list[str] = []
        else:
            # the goal table of issue #26 (1k to 1M boxes, the padded batch), a few calls per case
            nms_args = ["--warmup", "1", "--repeats", "5"]
            limits = {"bench_nms_cuda": 100.0, "bench_cuda": 45.0, "bench_auto_split": 35.0}
            quick = ["--quick"]
        steps += [
            Step(
                "bench_nms_cuda",
                [python, str(bench / "bench_nms_cuda.py"), *nms_args],
                limits["bench_nms_cuda"],
                limits["bench_nms_cuda"] if args.full else 60.0,
                quote=(
                    r"^goal_table: \S+ rows pass",
                    r"^chain_over_per_tile=\S+",
                    r"^tiles_over_single=\S+",
                    r"^mixed_1m_time_s=\S+ mixed_1m_peak_gib=\S+",
                    r"^worst_ratio_vs_torchvision_cuda=\S+",
                ),
                required=r"^worst_ratio_vs_torchvision_cuda=",
            ),
            Step(
                "bench_cuda",
                [python, str(bench / "bench_cuda.py"), *quick],
                limits["bench_cuda"],
                limits["bench_cuda"] if args.full else 30.0,
                quote=(r"(?<=^bench_cuda: ).*",),
                required=r"^bench_cuda: ",
            ),
            Step(
                "bench_auto_split",
                [python, str(bench / "bench_auto_split.py"), "--device", "cuda", *quick],
                limits["bench_auto_split"],
                limits["bench_auto_split"] if args.full else 25.0,
                quote=(r"^auto_over_even_throughput_cuda=\S+", r"^auto_plan_skew_cuda=\S+"),
                required=r"^auto_over_even_throughput_cuda=",
            ),
        ]
    return steps


def _time_for(step: Step, later: list[Step], deadline: float | None) -> float:
    """The step's wall-clock limit: its own, or less if the budget would not then keep the later steps' share."""
    if deadline is None:
        return step.limit_s
    return min(step.limit_s, deadline - time.monotonic() - sum(s.reserve_s for s in later))


def run_step(tee: Tee, step: Step, later: list[Step], deadline: float | None) -> Result:
    tee.heading(step.name)
    limit = _time_for(step, later, deadline)
    if limit < MIN_STEP_S:
        tee.say(f"NOT RUN: {limit:.0f} s left for it in the budget")
        return Result(step.name, NOT_RUN, note="no time left in the budget", problems=[f"{step.name}: not run"])
    # the grace after SIGINT is part of the step's time
    outcome = run_command(tee, step.command, timeout_s=max(limit - step.grace_s, 1.0), grace_s=step.grace_s)
    result = step.judge(outcome)
    note = f" ({result.note})" if result.note else ""
    tee.say(f"[gpu_check] {step.name}: {result.status} in {result.seconds:.0f} s{note}")
    return result


# ---------------------------------------------------------------------------------------------------------------
# Main
# ---------------------------------------------------------------------------------------------------------------


def summary_line(results: list[Result]) -> str:
    """``gpu_check: PASSED`` or ``gpu_check: FAILED (<steps>)``, a step that did not fail outright annotated."""
    failed = [r.name if r.status == FAILED else f"{r.name} {r.status.lower()}" for r in results if r.failed]
    return f"gpu_check: FAILED ({', '.join(failed)})" if failed else "gpu_check: PASSED"


def print_table(tee: Tee, results: list[Result], total_s: float, budget_s: float | None) -> None:
    width = max([len(r.name) for r in results] + [len("step")])
    tee.say(f"{'step':<{width}}  {'status':<8} {'seconds':>8}  note")
    for r in results:
        tee.say(f"{r.name:<{width}}  {r.status:<8} {r.seconds:>8.1f}  {r.note}".rstrip())
    budget = f" (budget {budget_s:.0f} s)" if budget_s is not None else ""
    tee.say(f"{'total':<{width}}  {'':<8} {total_s:>8.1f}{budget}")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description=__doc__.splitlines()[0], epilog="See the module docstring (tools/gpu_check.py) for the steps."
    )
    parser.add_argument("--full", action="store_true", help="the whole suite and the full benchmarks: no budget")
    parser.add_argument(
        "--budget",
        type=float,
        default=None,
        help=f"seconds for the whole check (default {DEFAULT_BUDGET_S:.0f}; with --full none; 0: none)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=None,
        help="pytest-xdist workers (default 8, with --full the cores less 2; 1: no xdist)",
    )
    parser.add_argument(
        "--test-timeout",
        type=float,
        default=None,
        help="seconds per test when pytest-timeout is installed (default 60, with --full 300; 0: none)",
    )
    parser.add_argument("--no-tests", action="store_true", help="skip the tests")
    parser.add_argument("--no-benchmarks", action="store_true", help="skip the CUDA benchmarks")
    parser.add_argument("--quick", action="store_true", help="accepted for old command lines: the default is quick")
    parser.add_argument("--dry-run", action="store_true", help="print the plan, run nothing (needs no GPU)")
    parser.add_argument("--log", type=Path, default=ROOT / "gpu_check.log", help="copy of everything printed")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cores = os.cpu_count() or 1
    if args.workers is None:
        args.workers = max(1, cores - 2) if args.full else min(8, cores)
    budget_s = args.budget if args.budget is not None else (None if args.full else DEFAULT_BUDGET_S)
    if budget_s is not None and budget_s <= 0:
        budget_s = None
    steps = plan_steps(args)
    started = time.monotonic()
    deadline = None if budget_s is None else started + budget_s

    if args.dry_run:
        tee = Tee(None)
        tee.say(f"gpu_check plan ({'no budget' if budget_s is None else f'budget {budget_s:.0f} s'}):")
        tee.say("  environment, extension (in this process)")
        for step in steps:
            kept = f", {step.reserve_s:.0f} s kept for it" if budget_s is not None else ""
            tee.say(f"  {step.name} (limit {step.limit_s:.0f} s{kept}): {shlex.join(step.command)}")
        for module, missing in (
            ("xdist", "pytest-xdist not installed: the tests run in one process"),
            ("pytest_timeout", "pytest-timeout not installed: no per-test time limit (the step's own limit holds)"),
        ):
            if not args.no_tests and not _have(module):
                tee.say(f"note: {missing}")
        return 0

    sys.path.insert(0, str(ROOT))
    with args.log.open("w") as log:
        tee = Tee(log)
        budget = "no budget" if budget_s is None else f"budget {budget_s:.0f} s"
        tee.say(f"gpu_check {time.strftime('%Y-%m-%d %H:%M:%S')}: {cores} cores, {budget}, log {args.log}")
        results = [run_in_process(tee, "environment", check_environment)]
        if results[0].failed:
            why = results[0].note or "the environment failed"
            results += [Result(name, SKIPPED, note=why) for name in ["extension", *(s.name for s in steps)]]
        else:
            results.append(run_in_process(tee, "extension", check_extension))
            for index, step in enumerate(steps):
                try:
                    results.append(run_step(tee, step, steps[index + 1 :], deadline))
                except KeyboardInterrupt:
                    results.append(Result(step.name, FAILED, note="interrupted", problems=["interrupted"]))
                    results += [Result(s.name, SKIPPED, note="interrupted") for s in steps[index + 1 :]]
                    break
                except Exception as err:  # this check's own error, reported as the step's failure
                    tee.say(traceback.format_exc().rstrip())
                    why = f"{type(err).__name__}: {err}"
                    results.append(Result(step.name, FAILED, note=why, problems=[f"{step.name}: {why}"]))
        for name, reason in (("tests", args.no_tests), ("benchmarks", args.no_benchmarks)):
            if reason:
                results.append(Result(name, SKIPPED, note=f"--no-{name}"))

        tee.heading("summary")
        problems = [p for r in results if r.failed for p in r.problems]
        if problems:
            shown = problems[:40]
            more = f"\n  ... and {len(problems) - len(shown)} more (above)" if len(problems) > len(shown) else ""
            tee.say("failures:\n  " + "\n  ".join(shown) + more)
        print_table(tee, results, time.monotonic() - started, budget_s)
        tee.say(summary_line(results))
    return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
