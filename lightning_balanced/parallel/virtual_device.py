"""Device identity for the CPU emulation: virtual devices ``cpu:0``, ``cpu:1``, ... that share the host's memory.

torch's CUDA data-parallel ops enforce rules that a single CPU device cannot break on its own: ``replicate`` requires
the module on ``devices[0]``, each replica's outputs live on the replica's GPU, and ``torch.cat`` refuses tensors on
different GPUs. So that a step which would break those rules on GPUs also breaks in CI on CPU, the emulation gives
every tensor it hands to replica ``i`` (its chunk of the batch, its parameters and buffers) the identity
``cpu:i``. Identity is carried by a tensor subclass that propagates it through every torch operation:

* an operation on tensors of two different virtual devices raises the ``RuntimeError`` torch raises for two GPUs
  ("Expected all tensors to be on the same device, but found at least two devices, cpu:0 and cpu:1!");
* ``tensor.device`` is the virtual device, so ``torch.zeros(n, device=x.device)`` and ``x.to(y.device)`` work as on
  GPUs;
* ``.to("cpu:j")`` moves a tensor to virtual device ``j``; ``.to("cpu")`` and ``.cpu()`` return a plain tensor.

A plain tensor has no identity: it may be combined with a tensor of any virtual device (tensors a replica makes with
factory functions are plain). Plain tensors stand for the root device when a module's place is checked.
Devices without an index (``torch.device("cpu")``) have no identity either, and nothing is checked for them.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor

__all__ = ["VirtualDeviceTensor", "device_of", "on_device", "virtual_devices"]


def virtual_devices(devices: Sequence[torch.device]) -> list[torch.device]:
    """The devices the data-parallel core runs on: CPU devices become ``cpu:0``, ``cpu:1``, ... in order.

    Other devices (CUDA) are returned as they are: they have their own identity.
    """
    return [torch.device("cpu", i) if d.type == "cpu" else d for i, d in enumerate(devices)]


def _index_of(value: object) -> int | None:
    return value._virtual_index if isinstance(value, VirtualDeviceTensor) else None


def _common_index(args: Sequence[Any], kwargs: dict[str, Any]) -> int | None:
    """The one virtual device of the tagged tensors among the arguments (one level of lists looked into)."""
    found: int | None = None
    for value in (*args, *kwargs.values()):
        items = value if isinstance(value, (list, tuple)) else (value,)
        for item in items:
            index = _index_of(item)
            if index is None:
                continue
            if found is None:
                found = index
            elif index != found:
                low, high = sorted((found, index))
                raise RuntimeError(
                    "Expected all tensors to be on the same device, but found at least two devices,"
                    f" cpu:{low} and cpu:{high}! (balanced_dp's CPU emulation models each replica as its own device;"
                    " move tensors to one device, e.g. the root device, before combining them)"
                )
    return found


def _target_index(args: Sequence[Any], kwargs: dict[str, Any]) -> tuple[bool, int | None]:
    """For ``Tensor.to``: whether a device is named and, if so, its virtual index (``None`` for plain ``cpu``)."""
    device = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
    if device is None:
        return False, None
    return True, device.index if device.type == "cpu" else None


def _tag(value: Any, index: int | None) -> Any:
    if isinstance(value, Tensor):
        if index is None:
            return value.as_subclass(Tensor) if isinstance(value, VirtualDeviceTensor) else value
        if isinstance(value, VirtualDeviceTensor) and value._virtual_index == index:
            return value
        tagged = value.as_subclass(VirtualDeviceTensor)
        tagged._virtual_index = index
        return tagged
    if isinstance(value, tuple) and not hasattr(value, "_fields"):
        return tuple(_tag(v, index) for v in value)
    if isinstance(value, list):
        return [_tag(v, index) for v in value]
    return value


_DEVICE_GETTER = Tensor.device.__get__


class VirtualDeviceTensor(Tensor):
    """A CPU tensor that belongs to one virtual device (see the module docstring)."""

    _virtual_index: int
    _untagging: ClassVar[frozenset[Callable[..., Any]]] = frozenset({Tensor.cpu, Tensor.numpy, Tensor.tolist})

    @classmethod
    def __torch_function__(
        cls,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Check that the tagged arguments share one virtual device, run ``func`` on plain tensors, tag the result."""
        kwargs = kwargs or {}
        if func == _DEVICE_GETTER:
            return torch.device("cpu", args[0]._virtual_index)
        index = _common_index(args, kwargs)
        if func is Tensor.to:
            named, target = _target_index(args, kwargs)
            if named:
                index = target
        elif func in cls._untagging:
            index = None
        if func is Tensor.__deepcopy__:
            return _tag(copy.deepcopy(args[0].as_subclass(Tensor), args[1]), index)
        with torch._C.DisableTorchFunctionSubclass():
            result = func(*args, **kwargs)
        return _tag(result, index)


def on_device(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor`` on ``device``: a virtual CPU device tags it (an alias, autograd-aware); others move it with ``to``."""
    if device.type == "cpu":
        return _tag(tensor, device.index)  # type: ignore[no-any-return]
    return tensor.to(device)


def device_of(tensor: Tensor) -> torch.device:
    """The device ``tensor`` is on, virtual CPU devices included (a plain CPU tensor is on ``cpu``)."""
    return tensor.device
