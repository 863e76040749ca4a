"""One traceback per failure of a multi-process run: the failing rank prints its own, every other rank one line.

When one rank of a DDP-style run fails, the ranks waiting for it in a collective get the backend's transport error
(gloo: ``Connection closed by peer``), each with a full traceback of its own: 47 to 202 lines per rank, of which
the useful line is the last of one block. Here every rank leaves the reason it stops in the process group's store
(:class:`~lightning_balanced.ranks.stop_notices.StopNotices`); a rank whose error is only a lost connection names
the rank that failed and why, and its process ends with that one line instead of a traceback (a ``sys.excepthook``
that handles only these errors; any other error prints as usual). Under Lightning's script launcher and torchrun each
rank is a process of its own, so the run prints the failing rank's traceback and one line per other rank.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from types import TracebackType
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from typing_extensions import override

from lightning_balanced.ranks.stop_notices import StopNotices

if TYPE_CHECKING:
    from lightning.pytorch.strategies import ParallelStrategy

    _StrategyBase = ParallelStrategy
else:
    _StrategyBase = object

__all__ = ["PeerFailureReporting", "PeerStopped", "is_lost_connection", "print_peer_failures_in_one_line"]

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


class PeerFailureReporting(_StrategyBase):
    """A base-free strategy mixin: each rank tells the others why it stops; one that only lost a peer says so in a line.

    The line names the rank that failed and why.
    ``setup_environment`` records the rank's process in the store and installs :func:`print_peer_failures_in_one_line`;
    ``on_exception`` (Lightning calls it on every rank that raises) leaves this rank's error for the others, or, for a
    lost connection, marks the exception with ``"rank R stopped: rank K stopped on ValueError: ..."``.
    """

    _stop_notices: StopNotices | None = None

    @override
    def setup_environment(self) -> None:
        super().setup_environment()
        if dist.is_available() and dist.is_initialized():
            self._stop_notices = StopNotices.of_default_group()
            self._stop_notices.record_process()
            print_peer_failures_in_one_line()

    @override
    def on_exception(self, exception: BaseException) -> None:
        super().on_exception(exception)
        notices = self._stop_notices
        if notices is None:
            return
        lost = is_lost_connection(exception)
        notices.report(exception, lost=lost)
        if lost and not isinstance(exception, PeerStopped):
            cause = notices.who_stopped(range(self.world_size))
            text = str(exception).strip().splitlines()
            said = f" (the backend said: {text[0]})" if text else ""
            message = f"rank {self.global_rank} stopped: it lost its connection to another rank; {cause}{said}"
            _mark(exception, message)

    @contextlib.contextmanager
    def naming_a_lost_peer(self, what: str) -> Iterator[None]:
        """A broken connection to another rank inside the block, raised as what it is: that rank stopped, named.

        When a rank fails (an error, or killed), the ranks exchanging with it get a transport error from the backend
        (gloo: ``Connection closed by peer``) instead of waiting out the process group's timeout. Each rank leaves its
        reason in the store before its error leaves the block, so the rank that stopped first is named, in a
        :class:`PeerStopped` that also says where (``what``: ``"a training step"``, ``"a barrier"``, ...). Other
        errors pass unchanged. For collectives Lightning does not see fail inside ``fit`` (a checkpoint saved after
        it, a barrier), where :meth:`on_exception` is not called.
        """
        try:
            yield
        except Exception as error:
            lost = is_lost_connection(error)
            notices = self._stop_notices
            if notices is not None:
                notices.report(error, lost=lost)
            if not lost or isinstance(error, PeerStopped):
                raise
            cause = "another rank stopped" if notices is None else notices.who_stopped(range(self.world_size))
            # a rank that raised printed its traceback; a killed one has none
            where = " (its traceback is in that process's output)" if " stopped on " in cause else ""
            text = str(error)
            name = getattr(self, "strategy_name", type(self).__name__)
            raise PeerStopped(
                f"strategy='{name}': rank {self.global_rank} lost its connection to another rank in {what}: {cause}"
                f"{where}. The backend said: {text.splitlines()[0] if text else type(error).__name__}"
            ) from error

    @override
    def barrier(self, name: str | None = None) -> None:
        """As the base strategy's; a peer lost meanwhile is named (:meth:`naming_a_lost_peer`)."""
        with self.naming_a_lost_peer("a barrier" if name is None else f"a barrier ({name})"):
            super().barrier(name)  # type: ignore[safe-super]  # the concrete strategy's

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """As the base strategy's; a peer lost meanwhile is named (:meth:`naming_a_lost_peer`)."""
        with self.naming_a_lost_peer("a broadcast"):
            return super().broadcast(obj, src)  # type: ignore[safe-super]  # the concrete strategy's


def _mark(exception: BaseException, line: str) -> None:
    with contextlib.suppress(AttributeError):  # an exception type with __slots__: printed as usual
        setattr(exception, _ONE_LINE, line)
