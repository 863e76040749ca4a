"""Suite-wide pytest options: ``--cuda-only`` runs just the tests that need a CUDA GPU or nvcc (tools/gpu_check.py)."""

from __future__ import annotations

import pytest


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
