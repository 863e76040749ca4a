"""Test helpers: one skip helper for hardware- and toolchain-dependent tests."""

from __future__ import annotations

import shutil

import pytest
import torch


def RunIf(*, min_cuda_gpus: int = 0, nvcc: bool = False, compiled_ops: bool = False) -> pytest.MarkDecorator:
    """A ``skipif`` mark whose reason says what is missing (model: Lightning's ``RunIf``)."""
    reasons = []
    if min_cuda_gpus and torch.cuda.device_count() < min_cuda_gpus:
        reasons.append(f"needs {min_cuda_gpus} CUDA GPU(s), found {torch.cuda.device_count()}")
    if nvcc and shutil.which("nvcc") is None:
        reasons.append("needs nvcc on PATH")
    if compiled_ops:
        from lightning_balanced.ops import has_compiled_ops

        if not has_compiled_ops():
            reasons.append("needs the compiled lightning_balanced._C extension")
    return pytest.mark.skipif(bool(reasons), reason="; ".join(reasons) or "runs here")
