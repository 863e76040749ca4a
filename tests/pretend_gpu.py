"""A pytest plugin that makes Lightning believe a CUDA GPU is present: checks the suite for a GPU machine on a CPU.

Run ``python -m pytest -p tests.pretend_gpu``. Lightning's ``CUDAAccelerator.is_available()`` then answers ``True``
(torch itself is untouched, so ``RunIf(min_cuda_gpus=...)`` still skips), which shows the two ways a CPU test breaks
on a machine with a GPU:

* a ``Trainer`` built for the CPU warns "GPU available but not used", an error under ``filterwarnings = error``
  unless the test says it runs on the CPU on purpose (``tests.helpers.quiet_trainer``, ``tests.helpers.ON_CPU``);
* a ``Trainer`` that leaves ``accelerator="auto"`` picks CUDA and fails, so a test meant for the CPU must say so.

Ranks spawned by :func:`tests.distributed.run_distributed` inherit the pretence through ``PRETEND_GPU_ENV``.
"""

from __future__ import annotations

import os
from typing import Any

PRETEND_GPU_ENV = "LIGHTNING_BALANCED_TESTS_PRETEND_GPU"


def install() -> None:
    """Patch every installed Lightning package's ``CUDAAccelerator.is_available`` to answer ``True``."""
    import importlib

    packages = ("lightning.fabric", "lightning.pytorch", "lightning_fabric", "pytorch_lightning")
    for name in (f"{package}.accelerators" for package in packages):
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        module.CUDAAccelerator.is_available = staticmethod(lambda: True)
    os.environ[PRETEND_GPU_ENV] = "1"


def pytest_collection_finish(session: Any) -> None:
    # Not at configure time: Lightning, imported while the root logger has no handler yet (before pytest's logging
    # plugin adds its own), stops propagating its records, and caplog would see none of them.
    install()
