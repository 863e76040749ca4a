"""What a strategy that drives several devices from one process tells Lightning: one rank, identity collectives."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor
from typing_extensions import override

if TYPE_CHECKING:
    from lightning.pytorch.strategies import ParallelStrategy

    _StrategyBase = ParallelStrategy
else:
    _StrategyBase = object

__all__ = ["SingleProcess"]


class SingleProcess(_StrategyBase):
    """The rank, world size and collectives of a ``ParallelStrategy`` that runs all its devices in one process.

    Free of a Lightning base class, so ``lightning.pytorch``'s and the standalone ``pytorch_lightning``'s
    ``ParallelStrategy`` can both be joined to it (``balanced_dp``, ``gpipe``). World size 1 and rank 0 everywhere, so
    Lightning adds no ``DistributedSampler`` and the dataloader's batch is the whole batch; the root device is the
    first of ``parallel_devices``; ``reduce``, ``all_gather``, ``broadcast`` and ``reduce_boolean_decision`` are the
    identity and ``barrier`` does nothing.
    """

    @property
    @override
    def root_device(self) -> torch.device:
        assert self.parallel_devices is not None, "parallel_devices are set by the Trainer"
        return self.parallel_devices[0]

    @property
    @override
    def global_rank(self) -> int:
        return 0

    @property
    @override
    def local_rank(self) -> int:
        return 0

    @property
    @override
    def node_rank(self) -> int:
        return 0

    @property
    @override
    def world_size(self) -> int:
        return 1

    @property
    def is_distributed(self) -> bool:
        """One process: Lightning adds no ``DistributedSampler``."""
        return False

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        return {"num_replicas": 1, "rank": 0}

    @override
    def reduce(self, tensor: Tensor | Any, group: Any | None = None, reduce_op: Any = "mean") -> Any:
        """Identity: there is one process (the step already combines what its devices computed)."""
        return tensor

    @override
    def all_gather(self, tensor: Tensor, group: Any | None = None, sync_grads: bool = False) -> Tensor:
        """Identity: there is one process."""
        return tensor

    @override
    def barrier(self, name: str | None = None) -> None:
        """Nothing to wait for in one process."""

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        """Identity: there is one process."""
        return obj

    @override
    def reduce_boolean_decision(self, decision: bool, all: bool = True) -> bool:
        """Identity: there is one process."""
        return decision
