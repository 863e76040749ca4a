"""What a strategy that drives several devices from one process tells Lightning: one rank, identity collectives."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import Tensor
from typing_extensions import override

from lightning_balanced.batch_scaling.factor_check import LRScaleFactorCheckOnLoad
from lightning_balanced.strategies.registration import RegisteredStrategy

if TYPE_CHECKING:
    from lightning.pytorch.strategies import ParallelStrategy

    _StrategyBase = ParallelStrategy
else:
    _StrategyBase = object

__all__ = ["SingleProcess", "parallel_devices_argument"]


# What one entry of `parallel_devices` holds, for messages.
_UNIT = {"balanced_dp": "replica", "gpipe": "partition"}


def parallel_devices_argument(
    devices: Sequence[torch.device | str] | None, *, strategy: str, one_type: bool
) -> list[torch.device] | None:
    """A strategy's ``parallel_devices`` argument as a list of ``torch.device``, checked; ``None`` stays ``None``.

    A device may repeat: ``[torch.device("cuda", 0)] * 2`` puts two replicas (partitions) on one GPU, each computing on
    a CUDA stream of its own, and ``[torch.device("cpu")] * 3`` is what ``Trainer(accelerator="cpu", devices=3)``
    gives (virtual devices ``cpu:0``, ``cpu:1``, ...). Strings become devices (``"cuda:0"``), and a CUDA device
    without an index (``"cuda"``) is the current CUDA device, as everywhere in torch; Lightning reads the list before
    the strategy's setup (its first device picks the accelerator) and needs indexed GPUs (without CUDA, ``"cuda"`` is
    left as it is, and Lightning refuses the accelerator).

    Args:
        devices: the argument, or ``None`` (the Trainer fills it in from ``accelerator=`` and ``devices=``).
        strategy (str): the strategy's name, for messages.
        one_type (bool): refuse a list that mixes device types (``balanced_dp`` replicates over GPUs or over the
            CPU, not both; ``gpipe`` may keep a partition in host memory).

    Returns:
        list[torch.device] | None: a new list, or ``None``.

    Raises:
        TypeError: ``devices`` is not a list or tuple of ``torch.device`` or ``str``.
        ValueError: an empty list, a string that is not a device, or (``one_type``) devices of several types.
    """
    if devices is None:
        return None
    unit = _UNIT.get(strategy, "device")
    if not isinstance(devices, (list, tuple)) or not all(isinstance(d, (torch.device, str)) for d in devices):
        raise TypeError(
            f"`parallel_devices` must be a list of torch.device (one per {unit}, repeats allowed), got {devices!r}"
        )
    if not devices:
        raise ValueError(f"`parallel_devices` must name at least one device for strategy={strategy!r}, got []")
    try:
        parsed = [torch.device(d) for d in devices]
    except RuntimeError as err:
        raise ValueError(f"`parallel_devices` {list(devices)!r} holds a string that is not a device: {err}") from err
    if any(d.type == "cuda" and d.index is None for d in parsed) and torch.cuda.is_available():
        # Without CUDA an unindexed "cuda" stays as it is: Lightning then refuses the CUDA accelerator itself.
        current = torch.device("cuda", torch.cuda.current_device())
        parsed = [current if d.type == "cuda" and d.index is None else d for d in parsed]
    types = list(dict.fromkeys(d.type for d in parsed))
    if one_type and len(types) > 1:
        raise ValueError(
            f"`parallel_devices` mixes device types {types} ({[str(d) for d in parsed]}): strategy={strategy!r}"
            f" runs its {unit}s on devices of one type. For several {unit}s on one GPU, repeat it:"
            " `[torch.device('cuda', 0)] * 2`"
        )
    return parsed


class SingleProcess(LRScaleFactorCheckOnLoad, RegisteredStrategy, _StrategyBase):
    """The rank, world size and collectives of a ``ParallelStrategy`` that runs all its devices in one process.

    Free of a Lightning base class, so ``lightning.pytorch``'s and the standalone ``pytorch_lightning``'s
    ``ParallelStrategy`` can both be joined to it (``balanced_dp``, ``gpipe``). World size 1 and rank 0 everywhere, so
    Lightning adds no ``DistributedSampler`` and the dataloader's batch is the whole batch; the root device is the
    first of ``parallel_devices``; ``reduce``, ``all_gather``, ``broadcast`` and ``reduce_boolean_decision`` are the
    identity and ``barrier`` does nothing. Registered like every strategy of the package (:class:`RegisteredStrategy`:
    a subclass declares its ``strategy_name``).

    Args:
        accelerator, checkpoint_io, precision_plugin: as for Lightning's ``ParallelStrategy``.
        parallel_devices: one device per replica or partition (:func:`parallel_devices_argument`); no cluster
            environment (one process).
    """

    #: Whether ``parallel_devices`` must hold one device type (``balanced_dp``) or may mix them (``gpipe``).
    one_device_type: ClassVar[bool] = True

    def __init__(
        self,
        accelerator: Any = None,
        parallel_devices: Sequence[torch.device | str] | None = None,
        checkpoint_io: Any = None,
        precision_plugin: Any = None,
    ) -> None:
        super().__init__(
            accelerator=accelerator,
            parallel_devices=parallel_devices_argument(
                parallel_devices, strategy=self.strategy_name, one_type=self.one_device_type
            ),
            cluster_environment=None,
            checkpoint_io=checkpoint_io,
            precision_plugin=precision_plugin,
        )

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
