"""One line, not a traceback, for an error that only reports another rank's failure.

When one rank of a multi-process run fails, the ranks waiting for it get an error of their own (the backend's lost
connection, a gather that gave up). Such an error is a :class:`PeerStopped`, or another exception marked with its
one-line message (:func:`mark_one_line`); :func:`print_peer_failures_in_one_line` installs a ``sys.excepthook`` that
prints those as that line and every other error as before, so a run prints the failing rank's traceback only.
"""

from __future__ import annotations

import contextlib
import sys
from types import TracebackType

import torch.distributed as dist

__all__ = ["PeerStopped", "is_lost_connection", "mark_one_line", "print_peer_failures_in_one_line"]

#: An exception that only reports another rank's failure carries its one-line message in this attribute.
_ONE_LINE = "_lightning_balanced_one_line"

# The words of the backends' transport errors when a peer's process ends.
_LOST = ("Connection closed by peer", "Connection reset by peer", "Broken pipe")


class PeerStopped(RuntimeError):
    """This rank stopped because another rank did: its error is the other rank's, named in the message."""


def is_lost_connection(error: BaseException) -> bool:
    """Whether ``error`` reports a peer that went away (the backend's transport error), not an error of this rank."""
    if isinstance(error, PeerStopped):
        return True
    if not isinstance(error, RuntimeError):
        return False
    return isinstance(error, getattr(dist, "DistBackendError", ())) or any(sign in str(error) for sign in _LOST)


def _excepthook(kind: type[BaseException], error: BaseException, traceback: TracebackType | None) -> None:
    line = getattr(error, _ONE_LINE, None)
    if line is None and isinstance(error, PeerStopped):
        line = f"{type(error).__name__}: {error}"
    if line is None:
        _previous_hook(kind, error, traceback)
        return
    sys.stderr.write(f"{line}\n")
    sys.stderr.flush()


_previous_hook = sys.excepthook


def print_peer_failures_in_one_line() -> None:
    """Print a peer's failure that ends this process as one line; every other error as before. Idempotent.

    A peer's failure is a :class:`PeerStopped`, or an error :class:`PeerFailureReporting` marked.
    """
    global _previous_hook
    if sys.excepthook is not _excepthook:
        _previous_hook = sys.excepthook
        sys.excepthook = _excepthook


def mark_one_line(exception: BaseException, line: str) -> None:
    """Have :func:`print_peer_failures_in_one_line`'s hook print ``exception`` as ``line``."""
    with contextlib.suppress(AttributeError):  # an exception type with __slots__: printed as usual
        setattr(exception, _ONE_LINE, line)
