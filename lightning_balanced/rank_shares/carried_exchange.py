"""A DDP communication hook that carries a few values of the step in DDP's own gradient all-reduce.

``balanced_ddp`` sums a handful of numbers over the ranks every step (each rank's share, its step time, the logged
values). A collective of its own costs a round trip per step (about 1 ms on gloo, 3-4 % of a small step, measured by
``benchmarks/bench_balanced_ddp.py``); appended to the first gradient bucket DDP reduces, the values cost a copy of
that bucket (at most DDP's first-bucket cap, 1 MiB by default) and no collective.
"""

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch._C._distributed_c10d import GradBucket
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

__all__ = ["CarriedExchange"]

# Bucket dtypes that hold the values well enough: counts exactly up to 2**24, times and losses to float32 rounding.
_CARRIER_DTYPES = (torch.float32, torch.float64)


class CarriedExchange:
    """DDP's default gradient all-reduce, with values summed over the ranks in the same all-reduce.

    Register :meth:`reduce` with ``DistributedDataParallel.register_comm_hook(process_group, carrier.reduce)``. Each
    bucket is reduced as torch's :func:`~torch.distributed.algorithms.ddp_comm_hooks.default_hooks.allreduce_hook`
    reduces it (divided by the group's size, then summed), the same arithmetic as DDP without a hook. Values given
    to :meth:`send` before a backward pass that synchronizes are appended to its bucket 0 (the first DDP reduces,
    capped at DDP's ``_DEFAULT_FIRST_BUCKET_BYTES``) and summed, not divided; :meth:`receive` returns their sum after
    that backward.

    Every rank must :meth:`send` before the same backward passes (the ranks decide alike), or none does. A bucket 0
    whose gradients are sparse or in a half dtype carries nothing: :meth:`receive` then returns ``None`` on every
    rank alike, and the caller reduces the values on its own.
    """

    def __init__(self) -> None:
        self._outgoing: Tensor | None = None
        self._received: Tensor | None = None

    def send(self, values: Tensor) -> None:
        """Carry ``values`` (a 1-D tensor on the gradients' device) in the next synchronizing backward pass."""
        self._outgoing, self._received = values, None

    def receive(self) -> Tensor | None:
        """The sum over the ranks of the values last sent, in the gradients' dtype; ``None`` if none was carried."""
        received, self._received, self._outgoing = self._received, None, None
        return received

    # Real annotations (this module has no `from __future__ import annotations`): DDP's register_comm_hook compares
    # them with dist.GradBucket and Future[Tensor].
    def reduce(self, process_group: Any, bucket: GradBucket) -> torch.futures.Future[torch.Tensor]:
        """The hook: reduce one of DDP's gradient buckets, bucket 0 with the values sent."""
        grads = bucket.buffer()
        values = self._outgoing
        if values is None or bucket.index() != 0 or grads.layout != torch.strided or grads.dtype not in _CARRIER_DTYPES:
            return allreduce_hook(process_group, bucket)
        self._outgoing = None
        group = process_group if process_group is not None else dist.group.WORLD
        count = grads.numel()
        combined = torch.cat([grads, values.to(grads.dtype)])
        combined[:count].div_(dist.get_world_size(group))  # as allreduce_hook divides the bucket before the sum
        future: torch.futures.Future[list[Tensor]] = dist.all_reduce(combined, group=group, async_op=True).get_future()

        def unpack(done: torch.futures.Future[list[Tensor]]) -> Tensor:
            reduced = done.value()[0]
            self._received = reduced[count:]
            return reduced[:count]

        return future.then(unpack)
