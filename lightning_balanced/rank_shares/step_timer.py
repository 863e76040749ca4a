"""A rank's step time and peak memory: a :class:`~lightning_balanced.timing.SpanTimer` a step, and the step's peak."""

from __future__ import annotations

import torch

from lightning_balanced.timing import SpanTimer

__all__ = ["StepTimer"]


class StepTimer:
    """This rank's step-method seconds (forward passes and losses) and peak memory of a training step.

    Several spans (micro-batches) add up (:class:`~lightning_balanced.timing.SpanTimer`). On CUDA the events are read
    at the next step's exchange (by then the step has long been queued, so the read waits at most for the previous
    optimizer step). The peak, on CUDA, is ``torch.cuda.max_memory_allocated`` from the start of one step to the
    start of the next: forward, backward and optimizer step. On other devices the strategy may report a peak it
    measured itself (:meth:`record_peak`, e.g. the bytes a step saved for backward plus the rank's fixed state); else
    none.

    Args:
        device (torch.device): the rank's device.
    """

    def __init__(self, device: torch.device) -> None:
        self._device = device
        self._cuda = device.type == "cuda"
        self._spans = SpanTimer(device)
        self._done: SpanTimer | None = None
        self._done_peak: int | None = None
        self._host_peak: int | None = None

    def new_step(self) -> None:
        """Close the last step's spans for :meth:`take`, and start measuring the peak memory of this one."""
        self._done = self._spans if self._spans.recorded() else None
        self._spans = SpanTimer(self._device)
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
        self._spans.start()

    def stop(self) -> None:
        """Close the span :meth:`start` opened."""
        self._spans.stop()

    def last_peak(self) -> int | None:
        """The peak bytes of the step before the current one; ``None`` where it was not measured."""
        return self._done_peak

    def take(self) -> tuple[float, int | None] | None:
        """The last timed step's seconds and peak bytes (``None``: no step was timed since the last take)."""
        done, self._done = self._done, None
        if done is None:
            return None
        return done.seconds(), self._done_peak
