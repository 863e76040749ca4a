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
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch.distributed as dist
from typing_extensions import override

from lightning_balanced.ranks.one_line import (
    PeerStopped,
    is_lost_connection,
    mark_one_line,
    print_peer_failures_in_one_line,
)
from lightning_balanced.ranks.stop_notices import StopNotices

if TYPE_CHECKING:
    from lightning.pytorch.strategies import ParallelStrategy

    _StrategyBase = ParallelStrategy
else:
    _StrategyBase = object

__all__ = ["PeerFailureReporting", "PeerStopped", "is_lost_connection", "print_peer_failures_in_one_line"]


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
            mark_one_line(exception, message)

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
