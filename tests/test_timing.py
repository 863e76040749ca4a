"""SpanTimer: the spans of one device add up, with seconds measured by other means; clear forgets them."""

from __future__ import annotations

import pytest
import torch

from lightning_balanced.timing import SpanTimer
from tests.helpers import RunIf


def test_spans_and_given_seconds_add_up_until_cleared() -> None:
    timer = SpanTimer(torch.device("cpu"))
    assert not timer.recorded() and timer.seconds() == 0.0
    with timer.span():
        pass
    first = timer.seconds()
    assert timer.recorded() and first >= 0.0
    timer.add_seconds(2.5)  # an emulated device's own time
    timer.start()
    timer.stop()
    assert timer.seconds() >= first + 2.5
    timer.clear()
    assert not timer.recorded() and timer.seconds() == 0.0


def test_a_span_is_closed_when_its_block_raises() -> None:
    timer = SpanTimer(torch.device("cpu"))
    with pytest.raises(RuntimeError, match=r"^inside$"), timer.span():
        raise RuntimeError("inside")
    assert timer.recorded()


@RunIf(min_cuda_gpus=1)
def test_cuda_spans_are_the_streams_time() -> None:
    timer = SpanTimer(torch.device("cuda", 0))
    x = torch.randn(1024, 1024, device="cuda")
    with timer.span():
        for _ in range(10):
            x = x @ x / 1024
    assert timer.recorded() and timer.seconds() > 0.0
