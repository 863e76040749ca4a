"""Device identity for the CPU emulation: virtual devices ``cpu:0``, ``cpu:1``, ... that share the host's memory.

torch's CUDA data-parallel ops enforce rules that a single CPU device cannot break on its own: ``replicate`` requires
the module on ``devices[0]``, each replica's outputs live on the replica's GPU, and an operation refuses tensors on
two devices. So that a step which would break those rules on GPUs also breaks in CI on CPU, the emulation gives the
tensors of replica ``i`` the identity ``cpu:i``, carried by a tensor subclass (:class:`VirtualDeviceTensor`) that
propagates it through every torch operation, and :class:`VirtualDeviceMode`, active in replica ``i``'s thread, applies
CUDA's rule to every tensor there, as it would hold on GPU ``i``:

* the root is virtual device 0: a plain (untagged) tensor is the root's (its parameters, its attributes, what
  ``module.to(root)`` moved, torchmetrics' metric states included, the batch before the scatter, the gathered
  outputs); inside a replica its ``device`` reads ``cpu:0``, so ``x.to(y)`` or ``x.to(y.device)`` with such a ``y``
  moves ``x`` to ``cpu:0``, as ``y`` would be on ``cuda:0``;
* a tensor made or moved inside the step with ``device=cpu:j`` (``self.device``, ``x.device``) belongs to
  ``cpu:j``; one made without a device (``torch.ones(3)``, ``torch.tensor([1.0])``) or moved with ``.cpu()`` or
  ``.to("cpu")`` is a host tensor, ``cpu``, as it would be next to GPUs;
* an operation on tensors of two devices raises the ``RuntimeError`` torch raises for two GPUs ("Expected all
  tensors to be on the same device, but found at least two devices, cpu:0 and cpu:1!"); host tensors and the root's
  tensors count, except 0-dim ones, which combine with any device as 0-dim CPU tensors do on CUDA (the target of an
  in-place operation always counts: ``self.total += loss`` writes into the root's tensor);
* ``tensor.device`` is the virtual device, so ``torch.zeros(n, device=x.device)`` and ``x.to(y.device)`` work as on
  GPUs; ``.to("cpu:j")`` moves a tensor to virtual device ``j``; ``copy_`` copies between any devices, as on GPUs.

Outside a replica (no mode), tagged tensors of two virtual devices still refuse to combine, and plain tensors combine
with anything. Devices without an index (``torch.device("cpu")``) have no identity, and nothing is checked for them.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.overrides import TorchFunctionMode

from lightning_balanced.arguments import check_int, check_real

__all__ = [
    "HOST",
    "EmulatedDevice",
    "EmulatedOutOfMemoryError",
    "EmulatedStep",
    "VirtualDeviceMode",
    "VirtualDeviceTensor",
    "emulate_devices",
    "emulated_device",
    "emulated_step",
    "on_device",
    "virtual_devices",
]

HOST = -1
"""The index that tags a host tensor made inside a replica (shown as ``cpu``)."""


def virtual_devices(devices: Sequence[torch.device]) -> list[torch.device]:
    """The devices the data-parallel core runs on: CPU devices become ``cpu:0``, ``cpu:1``, ... in order.

    Other devices (CUDA) are returned as they are: they have their own identity.
    """
    return [torch.device("cpu", i) if d.type == "cpu" else d for i, d in enumerate(devices)]


def _index_of(value: object) -> int | None:
    return value._virtual_index if isinstance(value, VirtualDeviceTensor) else None


def _name(index: int) -> str:
    return "cpu" if index == HOST else f"cpu:{index}"


def _two_devices(first: int, second: int) -> RuntimeError:
    low, high = sorted((first, second))
    return RuntimeError(
        f"Expected all tensors to be on the same device, but found at least two devices, {_name(low)} and"
        f" {_name(high)}! (lightning_balanced's CPU emulation: replica or partition i runs on virtual device cpu:i,"
        " the root is cpu:0 and tensors made without a device are host tensors, cpu; this would fail on GPUs too. Move"
        " tensors to one device, e.g. `self.device`, before combining them)"
    )


def _tensor_args(args: Sequence[Any], kwargs: dict[str, Any]) -> list[Tensor]:
    """The tensors among the arguments, one level of lists and tuples looked into."""
    found = []
    for value in (*args, *kwargs.values()):
        if isinstance(value, Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found += [item for item in value if isinstance(item, Tensor)]
    return found


def _common_index(args: Sequence[Any], kwargs: dict[str, Any]) -> int | None:
    """The one virtual device of the tagged tensors among the arguments (one level of lists looked into)."""
    found: int | None = None
    for tensor in _tensor_args(args, kwargs):
        index = _index_of(tensor)
        if index is None or (index == HOST and _dim(tensor) == 0):
            continue  # a plain tensor, or a 0-dim host tensor, which combines with any device
        if found is None:
            found = index
        elif index != found:
            raise _two_devices(found, index)
    return found


def _dim(tensor: Tensor) -> int:
    with torch._C.DisableTorchFunctionSubclass():
        return tensor.dim()


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
            index = args[0]._virtual_index
            return torch.device("cpu") if index == HOST else torch.device("cpu", index)
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


# Functions whose tensors may sit on different devices on CUDA too.
_ANY_DEVICES: frozenset[Callable[..., Any]] = frozenset({Tensor.to, Tensor.cpu, Tensor.copy_, Tensor.__deepcopy__})


def _is_in_place(func: Callable[..., Any]) -> bool:
    name = getattr(func, "__name__", "")
    return (name.endswith("_") and not name.endswith("__")) or name.startswith("__i")


def _device_index(device: Any) -> int | None:
    """``HOST`` for the host (``"cpu"``, or no device), ``j`` for ``cpu:j``; ``None`` for any other device."""
    if device is None:
        return HOST
    device = torch.device(device)
    if device.type != "cpu":
        return None
    return HOST if device.index is None else device.index


class VirtualDeviceMode(TorchFunctionMode):
    """CUDA's device rule for every tensor in replica ``index``'s thread (see the module docstring).

    Args:
        index (int): the replica's virtual device, ``cpu:index``.
        owned (frozenset[int]): ``id``s of plain tensors that live on this device rather than the root's: a gpipe
            partition's own parameters and buffers (its layers are not replicated, so their tensors carry no tag).
            Results computed from them are tagged ``cpu:index``.
    """

    def __init__(self, index: int, owned: frozenset[int] = frozenset()) -> None:
        super().__init__()
        self.index = index
        self.owned = owned

    def __torch_function__(
        self,
        func: Callable[..., Any],
        types: Any,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
    ) -> Any:
        """Refuse tensors of two devices; tag what the replica makes or moves with the device it names."""
        kwargs = kwargs or {}
        if func == _DEVICE_GETTER and _index_of(args[0]) is None:
            # A plain tensor is the root's (what `module.to(root)` moved: parameters, buffers, metric states), or this
            # partition's own: its device says so, and `.to(x.device)`, `torch.zeros(n, device=x.device)` follow it.
            return torch.device("cpu", self.index if id(args[0]) in self.owned else 0)
        tensors = _tensor_args(args, kwargs)
        found = None
        if (len(tensors) > 1 or self.owned) and func not in _ANY_DEVICES:
            found = self._check(func, tensors)
        result = func(*args, **kwargs)
        if not isinstance(result, Tensor):
            return result
        if self.owned and found is not None and _index_of(result) is None:
            return _tag(result, found)  # made from this partition's own tensors: it lives on its device
        if not tensors:  # a factory: torch.ones(...), torch.tensor(...), torch.arange(...)
            index = _device_index(kwargs.get("device"))
            return result if index is None else _tag(result, index)
        if func is Tensor.cpu:
            return _tag(result, HOST)
        if func is Tensor.to:
            other = args[1] if len(args) > 1 else kwargs.get("other")
            if isinstance(other, Tensor):  # x.to(y): y's device; a plain y is the root's
                index = _index_of(other)
                return _tag(result, 0 if index is None else index)
            named, target = _target_index(args, kwargs)
            if named:
                return _tag(result, HOST if target is None else target)
        return result

    def _check(self, func: Callable[..., Any], tensors: list[Tensor]) -> int | None:
        """The one device of the tensors that count (see the module docstring); raise when there are two."""
        found: int | None = None
        in_place: bool | None = None  # worked out only when needed
        for position, tensor in enumerate(tensors):
            tagged = _index_of(tensor)
            # A 0-dim host tensor (or a plain one: maybe one) combines with any device, unless written into.
            if (tagged is None or tagged == HOST) and _dim(tensor) == 0:
                if position > 0:
                    continue
                in_place = _is_in_place(func) if in_place is None else in_place
                if not in_place:
                    continue
            # A plain tensor is the partition's own, else the root's, on cpu:0.
            index = tagged if tagged is not None else (self.index if id(tensor) in self.owned else 0)
            if found is None:
                found = index
            elif index != found:
                raise _two_devices(found, index)
        return found


def on_device(tensor: Tensor, device: torch.device) -> Tensor:
    """``tensor`` on ``device``: a virtual CPU device tags it (an alias, autograd-aware); others move it with ``to``."""
    if device.type == "cpu":
        return _tag(tensor, device.index)  # type: ignore[no-any-return]
    return tensor.to(device)


# ---- a testing aid: virtual devices of different speeds and memory capacities ---------------------------------------


@dataclass(frozen=True)
class EmulatedDevice:
    """How one virtual device of the CPU emulation differs from the host: a **testing aid**, not a user feature.

    Real mixed GPUs differ in speed and memory; virtual devices all share the host's cores and memory. So that the
    code that reacts to such differences (``chunk_sizes="auto"``, :class:`~lightning_balanced.AutoSplit`) can be
    tested and benchmarked without mixed GPUs, :func:`emulate_devices` gives each virtual device:

    Args:
        slowdown (float): how many times slower than the host the device runs its step method, >= 1: after the step
            method (the forward pass and the loss) ran for ``t`` seconds on the replica's thread, the thread sleeps
            ``(slowdown - 1) * t``, so the device is busy ``slowdown * t`` while the other replicas run. The backward
            pass, which the emulation runs on the host for all replicas, is not stretched.
        seconds_per_sample (float): device work per sample of the chunk, in seconds, >= 0, slept on the replica's
            thread during its step method (so ``t`` above includes it). It models a GPU-bound job, where the device
            works while the host only launches kernels and waits; without it the virtual devices' work is the
            host's own compute, which they share.
        capacity_bytes (int, optional): the device's memory in bytes. A step whose memory on the device
            (:func:`emulated_step`'s ``peak_bytes``) exceeds it raises ``torch.OutOfMemoryError``-like
            :class:`EmulatedOutOfMemoryError`, as a GPU would run out of memory. ``None``: unlimited.

    Raises:
        TypeError, ValueError: an argument of the wrong type or out of range, naming it.
    """

    slowdown: float = 1.0
    capacity_bytes: int | None = None
    seconds_per_sample: float = 0.0

    def __post_init__(self) -> None:
        check_real("slowdown", self.slowdown, minimum=1.0)
        check_real("seconds_per_sample", self.seconds_per_sample, minimum=0.0)
        if self.capacity_bytes is not None:
            check_int("capacity_bytes", self.capacity_bytes, minimum=1)


class EmulatedOutOfMemoryError(RuntimeError):
    """A virtual device of the CPU emulation ran out of its emulated memory (:class:`EmulatedDevice`)."""


_EMULATED: dict[int, EmulatedDevice] = {}


@contextmanager
def emulate_devices(devices: Sequence[EmulatedDevice]) -> Iterator[None]:
    """Within the block, virtual device ``cpu:i`` behaves as ``devices[i]``: a testing aid (:class:`EmulatedDevice`).

    Example: ``with emulate_devices([EmulatedDevice(), EmulatedDevice(slowdown=2.0)]): trainer.fit(model)`` trains
    on two virtual devices, the second half as fast as the first.

    Raises:
        TypeError: an entry is not an :class:`EmulatedDevice`.
        RuntimeError: another :func:`emulate_devices` block is active (they do not nest).
    """
    for i, device in enumerate(devices):
        if not isinstance(device, EmulatedDevice):
            raise TypeError(f"`devices[{i}]` must be an EmulatedDevice, got {device!r} of type {type(device).__name__}")
    if _EMULATED:
        raise RuntimeError("emulate_devices() blocks do not nest: another one is active")
    _EMULATED.update(enumerate(devices))
    try:
        yield
    finally:
        _EMULATED.clear()


def emulated_device(device: torch.device) -> EmulatedDevice | None:
    """The :class:`EmulatedDevice` that virtual device ``device`` emulates now, or ``None`` (any other device)."""
    if device.type != "cpu" or device.index is None:
        return None
    return _EMULATED.get(device.index)


@dataclass
class EmulatedStep:
    """What :func:`emulated_step` measured on the virtual device.

    Attributes:
        peak_bytes (int): the step's memory on the device, in bytes.
        seconds (float | None): with an :class:`EmulatedDevice`, the device's time for the step: the host compute of
            the step method, plus its ``seconds_per_sample`` work, times its ``slowdown``. The sleeps that make up
            the rest are not timed when they end but counted at their length, so the time the thread then waits for
            the GIL or a core (while other replicas run Python) is not charged to the device. ``None`` without one.
    """

    peak_bytes: int = 0
    seconds: float | None = None


@contextmanager
def emulated_step(
    device: torch.device, resident_bytes: int = 0, measure_memory: bool = False, samples: int = 0
) -> Iterator[EmulatedStep]:
    """Run a replica's step method on virtual device ``device`` as its :class:`EmulatedDevice` would.

    Its memory, ``peak_bytes``, is ``resident_bytes`` (what stays on the device: the replica's parameters and buffers)
    plus the bytes of the tensors autograd saves for the backward pass during the step (its activations, each tensor
    counted once), read with ``torch.autograd.graph.saved_tensors_hooks`` on the replica's thread; it is measured when
    ``measure_memory`` is set or the device has an emulated ``capacity_bytes`` (else it stays 0). With an emulated
    device, the step then does its ``seconds_per_sample * samples`` of device work and is stretched by its
    ``slowdown``, and a ``peak_bytes`` above its ``capacity_bytes`` raises :class:`EmulatedOutOfMemoryError`.
    """
    emulated = emulated_device(device)
    measure_memory = measure_memory or (emulated is not None and emulated.capacity_bytes is not None)
    measured = EmulatedStep()
    if emulated is None and not measure_memory:
        yield measured
        return
    seen: set[tuple[int, int]] = set()
    saved = 0

    def pack(tensor: Tensor) -> Tensor:
        nonlocal saved
        with torch._C.DisableTorchFunctionSubclass():
            key = (tensor.data_ptr(), tensor.numel())
            if key not in seen and tensor.device.type == "cpu":
                seen.add(key)
                saved += tensor.numel() * tensor.element_size()
        return tensor

    began = time.perf_counter()
    if measure_memory:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
            yield measured
        measured.peak_bytes = resident_bytes + saved
    else:
        yield measured
    if emulated is None:
        return
    host = time.perf_counter() - began
    work = emulated.seconds_per_sample * samples
    if work > 0.0:
        time.sleep(work)
    took = host + work  # the work at its nominal length
    measured.seconds = emulated.slowdown * took
    if emulated.capacity_bytes is not None and measured.peak_bytes > emulated.capacity_bytes:
        raise EmulatedOutOfMemoryError(
            f"virtual device {device} out of memory (CPU emulation): the step needs {measured.peak_bytes} B"
            f" ({resident_bytes} B resident + {saved} B of activations), its emulated capacity is"
            f" {emulated.capacity_bytes} B"
        )
    if emulated.slowdown > 1.0:
        time.sleep((emulated.slowdown - 1.0) * took)
