"""Test helpers: one skip helper for hardware- and toolchain-dependent tests, and one quiet ``Trainer``."""

from __future__ import annotations

import shutil
from typing import Any

import lightning.pytorch as pl
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


def quiet_trainer(strategy: Any = "auto", devices: Any = 1, **kwargs: Any) -> pl.Trainer:
    """A CPU ``Trainer`` without logger, checkpoints, progress bar or model summary; ``kwargs`` override any of it."""
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    settings.update(kwargs)
    return pl.Trainer(strategy=strategy, devices=devices, **settings)
