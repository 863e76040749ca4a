"""A rank's step time and peak memory: CUDA events and ``torch.cuda.max_memory_allocated`` on a GPU, else the host."""

from __future__ import annotations

import time
from typing import Any

import torch

__all__ = ["StepTimer"]


class StepTimer:
    """This rank's step-method seconds (forward passes and losses) and peak memory of a training step.

    Several spans (micro-batches) add up. The host clock on the CPU; on CUDA events on the current stream, read at the
    next step's exchange (by then the step has long been queued, so the read waits at most for the previous optimizer
    step). The peak, on CUDA, is ``torch.cuda.max_memory_allocated`` from the start of one step to the start of the
    next: forward, backward and optimizer step. On other devices the strategy may report a peak it measured itself
    (:meth:`record_peak`, e.g. the bytes a step saved for backward plus the rank's fixed state); else none.

    Args:
        device (torch.device): the rank's device.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._cuda = device.type == "cuda"
        self._spans: list[Any] = []
        self._began: Any = None
        self._done: list[Any] | None = None
        self._done_peak: int | None = None
        self._host_peak: int | None = None

    def new_step(self) -> None:
        """Close the last step's spans for :meth:`take`, and start measuring the peak memory of this one."""
        self._done, self._spans = self._spans or None, []
        if self._cuda:
            self._done_peak = int(torch.cuda.max_memory_allocated(self._device))
            torch.cuda.reset_peak_memory_stats(self._device)
        else:
            self._done_peak, self._host_peak = self._host_peak, None

    def record_peak(self, peak_bytes: int) -> None:
        """A peak of the current step measured by the caller (devices other than CUDA), in bytes; the largest counts."""
        self._host_peak = max(self._host_peak or 0, int(peak_bytes))

    def start(self) -> None:
        """Open a span of the step method."""
        if self._cuda:
            self._began = torch.cuda.Event(enable_timing=True)
            self._began.record()
        else:
            self._began = time.perf_counter()

    def stop(self) -> None:
        """Close the span :meth:`start` opened."""
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._spans.append((self._began, end))
        else:
            self._spans.append(time.perf_counter() - self._began)

    def last_peak(self) -> int | None:
        """The peak bytes of the step before the current one; ``None`` where it was not measured."""
        return self._done_peak

    def take(self) -> tuple[float, int | None] | None:
        """The last timed step's seconds and peak bytes (``None``: no step was timed since the last take)."""
        spans, self._done = self._done, None
        if spans is None:
            return None
        if not self._cuda:
            return float(sum(spans)), self._done_peak
        for _, end in spans:
            end.synchronize()
        seconds = sum(float(began.elapsed_time(end)) for began, end in spans) / 1000.0
        return seconds, self._done_peak
