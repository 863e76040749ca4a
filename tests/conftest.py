"""Suite-wide pytest options: ``--cuda-only`` runs just the tests that need a CUDA GPU or nvcc (tools/gpu_check.py).

A test that leaves ``torch.cuda``'s sync debug mode set fails, and the mode is reset: left at ``"error"``, it fails
every later test of the process at its first blocking copy (seen on a GPU machine on 2026-11-26).

Under pytest-xdist each worker process gets its share of the cores for torch's intra-op threads: with ``-n 15`` on
16 cores, every worker would otherwise start 16 threads, 240 in all, and oversubscribe the machine. The share also
goes into ``OMP_NUM_THREADS`` (unless set), so the processes a test starts (ranks, launchers, example jobs, the C++
compiler of inductor's kernels) inherit it: on a 16-core GPU machine with ``-n 15`` (2026-11-28), without it, the
example-config and multi-process tests took 3-4 times as long as on 2 cores with ``-n 2`` (detection_ddp_lr_linear
83 s against 22 s), and the suite 3 min 49 s.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch


def pytest_configure(config: pytest.Config) -> None:
    worker = getattr(config, "workerinput", None)  # set by pytest-xdist on its worker processes only
    if worker is not None and int(worker["workercount"]) > 1:
        share = max(1, (os.cpu_count() or 1) // int(worker["workercount"]))
        torch.set_num_threads(share)
        os.environ.setdefault("OMP_NUM_THREADS", str(share))


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--cuda-only",
        action="store_true",
        help="run only the tests marked by tests.helpers.RunIf(min_cuda_gpus=...) or RunIf(nvcc=True)",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not config.getoption("--cuda-only"):
        return
    selected, deselected = [], []
    for item in items:
        needs_cuda = any(mark.kwargs.get("needs_cuda") for mark in item.iter_markers("skipif"))
        (selected if needs_cuda else deselected).append(item)
    config.hook.pytest_deselected(items=deselected)
    items[:] = selected


@pytest.fixture(autouse=True)
def _sync_debug_mode_is_left_as_found() -> Iterator[None]:
    if not torch.cuda.is_available():
        yield
        return
    yield
    if torch.cuda.get_sync_debug_mode() != 0:
        torch.cuda.set_sync_debug_mode("default")
        pytest.fail("the test left torch.cuda's sync debug mode set; it was reset to 'default'")
