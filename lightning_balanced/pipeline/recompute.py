"""The recompute mode: whether this thread is recomputing a checkpointed partition in backward.

:class:`~lightning_balanced.gpipe.checkpoint.Checkpointing` enters it around a recomputation (:func:`recomputing`);
:class:`~lightning_balanced.pipeline.DeferredBatchNorm` asks :func:`is_recomputing` so that a micro-batch run again in
backward is not counted twice in its running statistics. The flag is thread-local: the autograd engine's threads and
the partitions' worker threads each have their own.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["is_recomputing", "recomputing"]

_state = threading.local()


def is_recomputing() -> bool:
    """Whether the current thread is recomputing a checkpointed partition in backward."""
    return bool(getattr(_state, "recomputing", False))


@contextmanager
def recomputing() -> Iterator[None]:
    """Mark the current thread as recomputing until the block ends (nests; the previous mode comes back)."""
    previous = is_recomputing()
    _state.recomputing = True
    try:
        yield
    finally:
        _state.recomputing = previous
