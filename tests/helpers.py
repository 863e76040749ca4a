"""Test helpers: one skip helper for hardware- and toolchain-dependent tests, and one quiet CPU ``Trainer``."""

from __future__ import annotations

import re
import shutil
import warnings
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
    # `needs_cuda` (ignored by skipif) lets `pytest --cuda-only` (tests/conftest.py) pick the GPU tests.
    needs_cuda = bool(min_cuda_gpus or nvcc)
    return pytest.mark.skipif(bool(reasons), reason="; ".join(reasons) or "runs here", needs_cuda=needs_cuda)


# Lightning warns "GPU available but not used" for every CPU Trainer on a machine with a GPU. A test that runs on the
# CPU on purpose expects it: ON_CPU marks the tests that build such a Trainer themselves (e.g. through LightningCLI);
# quiet_trainer applies the same filter to its own construction.
GPU_UNUSED_WARNING = r"GPU available but not used\."
ON_CPU = pytest.mark.filterwarnings(f"ignore:{GPU_UNUSED_WARNING}:UserWarning")


# The CUDA devices of a multi-device test: two GPUs, and one GPU used twice (replicas or partitions sharing it, each on
# its own stream), the form that runs on a one-GPU machine.
CUDA_DEVICE_LISTS = [
    pytest.param([torch.device("cuda", 0), torch.device("cuda", 1)], id="two-gpus", marks=RunIf(min_cuda_gpus=2)),
    pytest.param([torch.device("cuda", 0)] * 2, id="one-gpu-twice", marks=RunIf(min_cuda_gpus=1)),
]


def gpu_ids(devices: list[torch.device]) -> list[int]:
    """The GPU indices in ``devices``, once each: the Trainer's ``devices=`` for a strategy's ``parallel_devices``."""
    return sorted({d.index or 0 for d in devices})


def whole_message(message: str) -> str:
    """A ``match=`` pattern for exactly ``message``: a truncated or garbled message does not match."""
    return f"^{re.escape(message)}$"


def raises_exactly(error: type[BaseException], message: str) -> Any:
    """``pytest.raises`` that matches the **whole** message, so a truncated or garbled message fails the test."""
    return pytest.raises(error, match=whole_message(message))


def quiet_trainer(strategy: Any = "auto", devices: Any = 1, **kwargs: Any) -> pl.Trainer:
    """A CPU ``Trainer`` without logger, checkpoints, progress bar or model summary; ``kwargs`` override any of it.

    With ``accelerator="cpu"`` (the default) Lightning's "GPU available but not used" warning is expected, so it is
    silenced for the construction of this one Trainer.
    """
    settings: dict[str, Any] = {
        "accelerator": "cpu",
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    settings.update(kwargs)
    with warnings.catch_warnings():
        if settings["accelerator"] == "cpu":
            warnings.filterwarnings("ignore", GPU_UNUSED_WARNING, UserWarning)
        return pl.Trainer(strategy=strategy, devices=devices, **settings)
