"""The thread-local modes a pipeline task re-enters on its worker thread: grad, inference and autocast."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

__all__ = ["ThreadModes"]


@dataclass(frozen=True)
class ThreadModes:
    """Grad mode, inference mode and autocast of one thread, to be re-entered on another.

    These modes are thread-local in torch: a worker thread starts with grad enabled, inference mode off and autocast
    off, whatever the caller had. Precision plugins (``16-mixed``, ``bf16-mixed``) enter autocast on the main thread
    only, so each task enters the caller's modes again.
    """

    grad_enabled: bool
    inference_mode: bool
    device_type: str
    autocast_enabled: bool
    autocast_dtype: torch.dtype

    @classmethod
    def capture(cls, device_type: str) -> ThreadModes:
        """The current thread's modes, with autocast as set for ``device_type`` (``"cpu"``, ``"cuda"``, ...)."""
        return cls(
            grad_enabled=torch.is_grad_enabled(),
            inference_mode=torch.is_inference_mode_enabled(),
            device_type=device_type,
            autocast_enabled=torch.is_autocast_enabled(device_type),
            autocast_dtype=torch.get_autocast_dtype(device_type),
        )

    def for_recompute(self) -> ThreadModes:
        """The same autocast with grad enabled and inference mode off, as a recomputation in backward needs."""
        return replace(self, grad_enabled=True, inference_mode=False)

    @contextmanager
    def enter(self) -> Iterator[None]:
        """Enter these modes on the current thread."""
        with (
            torch.inference_mode(self.inference_mode),
            torch.set_grad_enabled(self.grad_enabled),
            torch.autocast(self.device_type, dtype=self.autocast_dtype, enabled=self.autocast_enabled),
        ):
            yield
