"""The measured bubble of a pipeline rank: the fraction of a step its stages sit idle.

:class:`BusyTimer` wraps the compute calls of ``torch.distributed.pipelining``'s stages (``forward_one_chunk``,
``backward_one_chunk`` and, in the zero-bubble schedules, ``backward_weight_one_chunk``) and times them against the
whole ``schedule.step``; what is left is waiting for the neighbours' activations and gradients, the loss, and the
schedule's own bookkeeping. On CPU it reads ``time.perf_counter``; on CUDA it records events on the current stream
(the stages' stream) and waits for the step's last event when the step ends, so the times are the GPU's.

Source: the bubble as defined for GPipe (Huang et al., NeurIPS 2019) and 1F1B (Narayanan et al., SC 2021): the idle
fraction of a step; the theoretical values are
:meth:`~lightning_balanced.pipelining.stage_plan.ScheduleSpec.theoretical_bubble`.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch

from lightning_balanced.timing import SpanTimer

__all__ = ["COMPUTE_CALLS", "BusyTimer", "bubble", "bubble_logs"]

#: The methods of a ``PipelineStage`` that run its module (the ones each torch release has are wrapped).
COMPUTE_CALLS = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")


class BusyTimer:
    """Times the compute of a rank's pipeline stages within each step.

    Args:
        device (torch.device): the rank's device; CUDA devices are timed with events.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._cuda = device.type == "cuda"
        self._busy = SpanTimer(device)
        self._started = 0.0
        self._step_start: Any = None

    def wrap(self, stage: Any) -> None:
        """Time ``stage``'s compute calls from now on (instance attributes over its bound methods)."""
        for name in COMPUTE_CALLS:
            method = getattr(stage, name, None)
            if method is not None:
                setattr(stage, name, self._timed(method))

    def _timed(self, method: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(method)
        def timed(*args: Any, **kwargs: Any) -> Any:
            with self._busy.span():
                return method(*args, **kwargs)

        return timed

    def start_step(self) -> None:
        """The step begins: compute time counts from here."""
        self._busy.clear()
        if self._cuda:
            self._step_start = torch.cuda.Event(enable_timing=True)
            self._step_start.record()
        self._started = time.perf_counter()

    def busy_seconds(self) -> float:
        """Seconds the stages computed since :meth:`start_step` (on CUDA, waits for their last kernel)."""
        return self._busy.seconds()

    def step_seconds(self) -> float:
        """Seconds since :meth:`start_step` (on CUDA, of the current stream's work: waits for it)."""
        if self._cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            end.synchronize()
            return float(self._step_start.elapsed_time(end)) / 1e3
        return time.perf_counter() - self._started


def bubble(busy_s: float, step_s: float) -> float:
    """The idle fraction ``1 - busy_s / step_s`` of a step, in ``[0, 1]``."""
    return 0.0 if step_s <= 0 else min(max(1.0 - busy_s / step_s, 0.0), 1.0)


def bubble_logs(bubbles: list[float], theory: float | None) -> dict[str, float]:
    """What ``strategy="pipeline"`` logs of a step's bubbles, by name.

    ``pipeline/bubble`` (the mean over the pipeline's ranks), ``pipeline/bubble_rank{r}`` (each rank's) and
    ``pipeline/bubble_theory`` (the schedule's formula, where it has one).

    Args:
        bubbles (list[float]): each pipeline rank's idle fraction of the step, in ``[0, 1]``.
        theory (float | None): the schedule's theoretical bubble, or ``None``.
    """
    logs = {"pipeline/bubble": sum(bubbles) / len(bubbles)}
    logs.update({f"pipeline/bubble_rank{rank}": value for rank, value in enumerate(bubbles)})
    if theory is not None:
        logs["pipeline/bubble_theory"] = theory
    return logs
