"""Check a GPU machine in one command: the environment, the compiled CUDA kernels, the GPU tests, the CUDA benchmarks.

Run from the repository root, after ``pip install --no-build-isolation -e ".[test]"`` (this command builds nothing):

    python tools/gpu_check.py [--workers N] [--no-benchmarks] [--log gpu_check.log]

Steps, each printed as it runs (and copied to ``--log``):

1. the environment: Python, torch and its CUDA, the GPUs, Lightning, torchmetrics, torchvision;
2. the extension: ``lightning_balanced._C`` loads, every op has a CUDA kernel registered, and the ``.so`` links the
   shared libstdc++ (a private static copy breaks ``TORCH_CHECK`` messages);
3. the GPU tests: ``pytest --cuda-only``, every test that needs a GPU or nvcc (``tests.helpers.RunIf``), which includes
   the one-GPU form of balanced_dp, its synchronized BatchNorm, gpipe, the pipeline and the evaluation gather, and the
   CUDA NMS; in parallel with pytest-xdist when installed;
4. the CUDA benchmarks: ``benchmarks/bench_cuda.py`` (balanced_dp and gpipe on one GPU against one device) and
   ``benchmarks/bench_nms_cuda.py`` (the CUDA NMS against torchvision's CUDA kernel and our CPU kernel: time, memory,
   exact kept indices, the padded form in a CUDA graph) and ``benchmarks/bench_auto_split.py --device cuda``
   (``chunk_sizes="auto"`` against the even split with two replicas on the GPU: the cost of profiling); ``--quick``
   runs each in its quick form.

The last line is the summary: ``gpu_check: PASSED ...`` or ``gpu_check: FAILED ...`` (exit status 1). Designed to
finish in a few minutes on one GPU with 16 cores.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import TextIO

ROOT = Path(__file__).resolve().parents[1]


class Report:
    """Prints to the terminal and the log as things happen; collects each step's verdict for the summary."""

    def __init__(self, log: TextIO) -> None:
        self.log = log
        self.failures: list[str] = []
        self.notes: list[str] = []

    def say(self, text: str) -> None:
        print(text, flush=True)
        self.log.write(text + "\n")
        self.log.flush()

    def step(self, title: str) -> None:
        self.say(f"\n==== {title} ====")

    def fail(self, what: str) -> None:
        self.failures.append(what)
        self.say(f"FAILED: {what}")


def _version(name: str) -> str:
    try:
        return str(importlib.import_module(name).__version__)
    except Exception as err:  # a package missing, or built for another torch
        return f"not importable ({type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''})"


def check_environment(report: Report) -> bool:
    import torch

    report.step("environment")
    report.say(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda})")
    for name in ("lightning", "torchmetrics", "torchvision"):
        report.say(f"{name} {_version(name)}")
    if not torch.cuda.is_available():
        report.fail("no CUDA GPU visible to torch")
        return False
    for index in range(torch.cuda.device_count()):
        props = torch.cuda.get_device_properties(index)
        report.say(
            f"cuda:{index}: {props.name}, {props.total_memory / 2**30:.1f} GiB, compute capability "
            f"{props.major}.{props.minor}"
        )
    return True


def _needed_libraries(path: Path) -> list[str] | None:
    """The ``.so``'s dynamic dependencies, read by the build's own check (``setup.needed_libraries``)."""
    spec = importlib.util.spec_from_file_location("lightning_balanced_setup", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)  # setup() itself runs only as __main__
    return build.needed_libraries(path)  # type: ignore[no-any-return]


def check_extension(report: Report) -> None:
    report.step("extension")
    from lightning_balanced import ops

    if not ops.has_compiled_ops():
        report.fail(
            "lightning_balanced._C did not load; build it with `pip install --no-build-isolation -e .` on this machine"
        )
        return
    spec = importlib.util.find_spec("lightning_balanced._C")
    so = Path(spec.origin) if spec is not None and spec.origin else None
    report.say(f"lightning_balanced._C: {so}")
    # every op the extension defined (its schemas, read from the dispatcher), so a new op is checked here too
    for op, device_types in ops.registered_kernels().items():
        for device_type in ("cpu", "cuda"):
            registered = device_type in device_types
            report.say(f"lightning_balanced::{op} {device_type} kernel: {'registered' if registered else 'MISSING'}")
            if not registered:
                report.fail(f"no {device_type} kernel for lightning_balanced::{op}; rebuild with a CUDA toolkit")
    if so is not None:
        needed = _needed_libraries(so)
        if needed is None:
            return  # not ELF
        report.say(f"links: {', '.join(needed)}")
        if not any(name.startswith("libstdc++.so") for name in needed):
            report.fail(f"{so.name} does not link the shared libstdc++ (a private static copy); rebuild it")


def _pytest_command(workers: int) -> list[str]:
    command = [sys.executable, "-m", "pytest", "--cuda-only", "-q", "-rs", "-p", "no:cacheprovider"]
    if workers > 1 and importlib.util.find_spec("xdist") is not None:
        command += ["-n", str(workers)]
        if importlib.util.find_spec("pytest_benchmark") is not None:
            command += ["-p", "no:benchmark"]  # pytest-benchmark refuses xdist
    return command


def _run(report: Report, command: list[str], timeout_s: float) -> tuple[int, str]:
    """Run ``command`` from the repository root, streaming its output; its exit status and last line."""
    report.say("+ " + " ".join(command))
    last = ""
    with subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    ) as process:
        assert process.stdout is not None
        deadline = time.monotonic() + timeout_s
        for line in process.stdout:
            report.say(line.rstrip("\n"))
            if line.strip():
                last = line.strip()
            if time.monotonic() > deadline:
                process.kill()
                return 124, f"timed out after {timeout_s:.0f} s"
        return process.wait(), last


def run_tests(report: Report, workers: int) -> str:
    report.step("GPU tests (pytest --cuda-only)")
    status, last = _run(report, _pytest_command(workers), timeout_s=360)
    summary = re.sub(r"=+", "", last).strip()
    if status != 0:
        report.fail(f"GPU tests: {summary}")
    # Skips are expected for what this machine lacks (a second GPU for the two-GPU forms); -rs printed each reason.
    return summary


def run_benchmarks(report: Report, quick: bool) -> str:
    """Run each CUDA benchmark; their summary lines (the last line each prints), joined."""
    flags = ["--quick"] if quick else []
    summaries = []
    # (script, its arguments, how its summary line starts, whether the quoted summary keeps that start, time limit
    # in seconds)
    for script, arguments, prefix, keep_prefix, timeout_s in (
        ("bench_cuda.py", [], "bench_cuda:", False, 240),
        ("bench_nms_cuda.py", [], "worst_ratio_vs_torchvision_cuda=", True, 600),
        ("bench_auto_split.py", ["--device", "cuda"], "auto_over_even_throughput_cuda=", True, 240),
    ):
        report.step(f"CUDA benchmarks (benchmarks/{script})")
        command = [sys.executable, str(ROOT / "benchmarks" / script), *arguments, *flags]
        status, last = _run(report, command, timeout_s=timeout_s)
        if status != 0 or not last.startswith(prefix):
            report.fail(f"{script}: exit status {status}, last line {last!r}")
            summaries.append(f"{script} failed")
        else:
            summaries.append(last if keep_prefix else last.removeprefix(prefix).strip())
    return "; ".join(summaries)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=min(8, os.cpu_count() or 1), help="pytest-xdist workers")
    parser.add_argument("--no-tests", action="store_true", help="skip the GPU tests")
    parser.add_argument("--no-benchmarks", action="store_true", help="skip the CUDA benchmarks")
    parser.add_argument("--quick", action="store_true", help="the benchmarks' quick form")
    parser.add_argument("--log", type=Path, default=ROOT / "gpu_check.log", help="copy of everything printed")
    args = parser.parse_args()
    started = time.monotonic()
    sys.path.insert(0, str(ROOT))
    with args.log.open("w") as log:
        report = Report(log)
        tests = benchmarks = "not run"
        if check_environment(report):
            check_extension(report)
            if not args.no_tests:
                tests = run_tests(report, args.workers)
            if not args.no_benchmarks:
                benchmarks = run_benchmarks(report, args.quick)
        verdict = "FAILED" if report.failures else "PASSED"
        report.step("summary")
        if report.failures:
            report.say("failures:\n  " + "\n  ".join(report.failures))
        report.say(
            f"gpu_check: {verdict} in {time.monotonic() - started:.0f} s; tests: {tests}; benchmarks: {benchmarks}"
        )
    return 1 if report.failures else 0


if __name__ == "__main__":
    sys.exit(main())
