"""Spans of work on one device that add up: the one timer of every strategy that times steps.

On CUDA two events on the current stream per span (the stream the work was queued on: a replica's, a stage's), read
when the seconds are asked for (the host then waits for the span's last event); elsewhere the host clock.
``balanced_ddp`` and ``balanced_fsdp`` time a rank's step method
(:class:`~lightning_balanced.rank_shares.step_timer.StepTimer`), ``balanced_dp`` each replica's, ``pipeline`` its
stages' compute within a step (the measured bubble).

Source: ``torch.cuda.Event(enable_timing=True)`` and ``Event.elapsed_time`` (milliseconds), as torch's own
benchmark utilities time device work.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

__all__ = ["SpanTimer"]


class SpanTimer:
    """The seconds of the spans timed since the last :meth:`clear`, summed.

    Args:
        device (torch.device): where the work runs; CUDA devices are timed with events on the current stream.
    """

    def __init__(self, device: torch.device) -> None:
        self.cuda = device.type == "cuda"
        self._events: list[tuple[Any, Any]] = []
        self._host_s = 0.0
        self._closed = 0
        self._began: Any = None

    def recorded(self) -> bool:
        """Whether a span was closed (or seconds added) since the last :meth:`clear`."""
        return self._closed > 0

    def start(self) -> None:
        """Open a span."""
        if self.cuda:
            self._began = torch.cuda.Event(enable_timing=True)
            self._began.record()
        else:
            self._began = time.perf_counter()

    def stop(self) -> None:
        """Close the span :meth:`start` opened."""
        if self.cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self._events.append((self._began, end))
        else:
            self._host_s += time.perf_counter() - self._began
        self._began = None
        self._closed += 1

    @contextmanager
    def span(self) -> Iterator[None]:
        """A span around the block, closed even when it raises."""
        self.start()
        try:
            yield
        finally:
            self.stop()

    def add_seconds(self, seconds: float) -> None:
        """Seconds measured by other means (an emulated device's own time), added to the spans'."""
        self._host_s += seconds
        self._closed += 1

    def seconds(self) -> float:
        """The spans' seconds, summed (on CUDA the host waits for the spans' end events)."""
        for _, end in self._events:
            end.synchronize()
        return self._host_s + sum(float(began.elapsed_time(end)) for began, end in self._events) / 1000.0

    def clear(self) -> None:
        """Forget every span."""
        self._events, self._host_s, self._began, self._closed = [], 0.0, None, 0
