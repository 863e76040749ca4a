"""Per-step module replicas: torch's broadcast on CUDA, an autograd-aware emulation elsewhere."""

from __future__ import annotations

import functools
import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import torch
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import replicate as cuda_replicate

from lightning_balanced.data_parallel.virtual_device import VirtualDeviceTensor, on_device

__all__ = ["ReplicaParameters", "check_replicable", "record_device", "replicate"]

ModuleT = TypeVar("ModuleT", bound=Module)


def _compiled_kind(module: Module) -> str | None:
    """How ``module`` itself is compiled, or ``None``; instance attributes are read from ``__dict__`` (no hooks)."""
    if isinstance(module, torch._dynamo.eval_frame.OptimizedModule):
        return "torch.compile"
    state = module.__dict__
    if state.get("_compiled_call_impl") is not None:
        return "Module.compile()"
    if state.get("_compiler_ctx") is not None:
        return "lightning from_compiled"
    return None


def check_replicable(network: Module) -> None:
    """Refuse a module that a data-parallel replica cannot run correctly, before anything is touched.

    A module compiled with ``torch.compile(module)`` or ``module.compile()`` keeps its compiled code bound to the
    original module, so a replica would run the original's forward (its parameters, its device) instead of its own.
    :func:`replicate` makes the same check on every call, during the pass over the modules that replication makes
    anyway; call this one to refuse earlier (a strategy at setup).

    Raises:
        TypeError: ``network`` or one of its submodules is compiled; the message names them and what to do instead.
    """
    found = []
    for name, module in network.named_modules(remove_duplicate=False):
        kind = _compiled_kind(module)
        if kind is not None:
            found.append(f"`{name or type(module).__name__}` ({kind})")
    compiled = list(dict.fromkeys(found))
    if compiled:
        raise TypeError(
            f"Cannot replicate {type(network).__name__} for data parallel: {', '.join(compiled)} is compiled, and"
            " compiled code stays bound to the original module, so every replica would run the original. Remove the"
            " `torch.compile`/`.compile()` call when training with balanced_dp (its replicas are rebuilt every step"
            " and would recompile), or compile under a single device or DDP, where the module is not replicated."
        )


def _check_on_first_device(tensors: Iterable[Tensor], device: torch.device) -> None:
    """The emulation of ``broadcast_coalesced``'s rule: every tensor of the source module is on ``devices[0]``."""
    if device.type != "cpu" or device.index is None:
        return
    for tensor in tensors:
        index = tensor._virtual_index if isinstance(tensor, VirtualDeviceTensor) else 0
        if index != device.index:
            raise RuntimeError(
                f"All tensors must be on devices[0]: the module to replicate is on cpu:{index}, devices[0] is"
                f" {device} (torch's replicate broadcasts from devices[0]; replicate from the module's device to every"
                " device and leave the replicas without samples unused)"
            )


class _HostBroadcast(torch.autograd.Function):
    """``torch.nn.parallel._functions.Broadcast`` in host memory: one autograd function over all the parameters.

    Replica 0 gets the parameters themselves back. As on CUDA, autograd then makes them views from a function of
    several outputs, which it refuses to use once the parameter changed in place (``optimizer.step()`` within a step;
    :class:`ReplicaParameters` re-aliases them). The other replicas get copies. The backward pass sums each
    parameter's gradients over the replicas, in replica order, as ``ReduceAddCoalesced`` does.
    """

    @staticmethod
    def forward(ctx: Any, num_devices: int, *tensors: Tensor) -> tuple[Tensor, ...]:
        ctx.num_tensors = len(tensors)
        ctx.set_materialize_grads(False)
        return tuple(t if i == 0 else t.clone() for i in range(num_devices) for t in tensors)

    @staticmethod
    def backward(ctx: Any, *grads: Tensor | None) -> tuple[Tensor | None, ...]:
        k = ctx.num_tensors
        sums: list[Tensor | None] = []
        for j in range(k):
            found = [g for g in grads[j::k] if g is not None]
            sums.append(functools.reduce(torch.add, found) if found else None)
        return (None, *sums)


def _host_copies(
    tensors: Sequence[Tensor], devices: Sequence[torch.device], *, detach: bool
) -> dict[Tensor, list[Tensor]]:
    """What ``Broadcast`` gives each replica of each tensor, emulated in host memory, on its replica's virtual device.

    Replica 0 aliases the original tensor (a view from :class:`_HostBroadcast` when it takes part in autograd); the
    other replicas get copies, which pass gradients back to the original as torch's ``Broadcast`` does. So in-place
    updates (BatchNorm running statistics, a write to a parameter) persist from replica 0 only, exactly as on CUDA.
    """
    copies: dict[Tensor, list[Tensor]] = {}
    differentiable = [t for t in tensors if t.requires_grad and not detach]
    if differentiable:
        outputs = _HostBroadcast.apply(len(devices), *differentiable)
        for j, tensor in enumerate(differentiable):
            copies[tensor] = [on_device(outputs[i * len(differentiable) + j], d) for i, d in enumerate(devices)]
    for tensor in tensors:
        if tensor not in copies:
            base = tensor.detach()
            copies[tensor] = [on_device(base if i == 0 else base.clone(), d) for i, d in enumerate(devices)]
    return copies


def _replicate_on_host(
    modules: list[Module],
    parameters: Sequence[Tensor],
    buffers: Sequence[Tensor],
    devices: Sequence[torch.device],
    detach: bool,
) -> list[Module]:
    index = {module: i for i, module in enumerate(modules)}
    params = _host_copies(parameters, devices, detach=detach)
    buffer_copies = _host_copies(buffers, devices, detach=detach)

    copies = [[module._replicate_for_data_parallel() for module in modules] for _ in devices]
    for j, replica_modules in enumerate(copies):
        for module, replica in zip(modules, replica_modules, strict=True):
            # Same layout as torch.nn.parallel.replicate: non-leaf parameters live as plain attributes. Only the
            # replica's own dicts (copies made by _replicate_for_data_parallel) are written.
            replica._former_parameters = {}
            for key, child in module._modules.items():
                replica._modules[key] = None if child is None else replica_modules[index[child]]
            for key, param in module._parameters.items():
                if param is None:
                    replica._parameters[key] = None
                else:
                    setattr(replica, key, params[param][j])
                    replica._former_parameters[key] = params[param][j]
            for key, buffer in module._buffers.items():
                replica._buffers[key] = None if buffer is None else buffer_copies[buffer][j]
    replicas = [replica_modules[0] for replica_modules in copies]
    for replica, device in zip(replicas, devices, strict=True):
        record_device(replica, device)
    return replicas


def record_device(network: Module, device: torch.device) -> None:
    """Make every module of ``network`` that records its device report ``device``.

    Lightning's ``DeviceDtypeModuleMixin`` (LightningModules, nested ones included) and torchmetrics' ``Metric`` keep
    their device in ``_device``, which ``module.to`` sets from the tensors it moved; a CPU tensor reports ``cpu``
    whatever virtual device it stands for, so the emulation records the virtual device here (as Lightning 1.9's
    ``update_replica_device_attributes`` did for replicas).
    """
    for module in network.modules():
        if "_device" in module.__dict__:
            module.__dict__["_device"] = device


@dataclass(frozen=True)
class ReplicaParameters:
    """How the replicas of one step hold ``network``'s parameters, to refresh after ``optimizer.step()`` in the step.

    Broadcast (torch's ``replicate`` on CUDA, the emulation alike) gives the replica on the source device the
    parameters themselves, as views from one autograd function of many outputs, which autograd refuses to use once
    the parameter changed in place ("Output 0 of BroadcastBackward is a view and its base ... has been modified
    inplace"); it gives every other replica, one on a repeated GPU included, a copy, which the change does not reach.
    Without :meth:`refresh`, a replica's later forward pass in the same step (a GAN's discriminator pass after the
    generator's step) would fail on the source device and read the old values elsewhere.

    Attributes:
        copies (tuple[tuple[Tensor, Tensor], ...]): ``(parameter, copy)`` for each copy a replica holds.
        aliases (tuple[tuple[Module, str, Tensor], ...]): ``(replica's module, attribute, parameter)`` for each
            parameter a replica holds as a view of its own memory.
    """

    copies: tuple[tuple[Tensor, Tensor], ...] = ()
    aliases: tuple[tuple[Module, str, Tensor], ...] = ()

    @classmethod
    def of(cls, network: Module, replicas: Sequence[Module]) -> ReplicaParameters:
        """Read from ``replicas``, made by :func:`replicate` of ``network``.

        Call it before anything replaces a replica's submodules: the replicas are walked side by side with ``network``.
        """
        copies: list[tuple[Tensor, Tensor]] = []
        aliases: list[tuple[Module, str, Tensor]] = []
        for replica in replicas:
            for module, copied in zip(network.modules(), replica.modules(), strict=True):
                for key, param in module._parameters.items():
                    held = copied.__dict__.get("_former_parameters", {}).get(key)
                    if param is None or held is None:
                        continue
                    if held.data_ptr() != param.data_ptr():
                        copies.append((param, held))
                    elif held.requires_grad:
                        aliases.append((copied, key, param))
        return cls(tuple(copies), tuple(aliases))

    def refresh(self) -> None:
        """Bring the replicas up to date with the parameters, changed in place.

        Each copy gets the parameter's current value (autograd does not see the copy); each alias is replaced by a new
        view of the parameter, autograd's usual view, which allows later changes in place.
        """
        with torch.no_grad():
            for param, copy in self.copies:
                copy.copy_(param)
        for module, key, param in self.aliases:
            # Connected to the parameter as Broadcast's view was, whatever its requires_grad now (toggle_optimizer
            # turns it off between the steps of a GAN): autograd's accumulation reads it when the gradient arrives.
            requires_grad = param.requires_grad
            with torch.enable_grad():
                param.requires_grad_(True)
                try:
                    alias = on_device(param.view_as(param), module.__dict__[key].device)
                finally:
                    param.requires_grad_(requires_grad)
            module.__dict__[key] = alias
            former: dict[str, Tensor] = module.__dict__["_former_parameters"]
            former[key] = alias


def _unregister_parameters(module: Module) -> None:
    """Keep a replica's parameters as plain attributes, as everywhere else: ``self.parameters()`` is empty in replicas.

    With ``detach=True`` torch's replicate hands replica 0 the network's own ``Parameter`` objects, which
    ``setattr`` registers again; the replica gets detached aliases instead (in-place writes still reach the network).
    """
    for key, param in list(module._parameters.items()):
        del module._parameters[key]
        module.__dict__[key] = None if param is None else param.detach()


def _own_buffers(replica: Module) -> None:
    """Give a replica that shares ``devices[0]`` with the source copies of the source's buffers.

    torch's broadcast hands the source device its own tensors back, so a second replica on that device would alias
    the network's buffers: its in-place updates (BatchNorm running statistics) would reach the network too, racing
    replica 0's. With copies, only replica 0's updates persist, as with one replica per GPU.
    """
    copies: dict[int, Tensor] = {}
    for module in replica.modules():
        for key, buffer in module._buffers.items():
            if buffer is not None:
                module._buffers[key] = copies.setdefault(id(buffer), buffer.clone())


def replicate(network: ModuleT, devices: Sequence[torch.device], *, detach: bool = False) -> list[ModuleT]:
    """Make one replica of ``network`` per device for a single forward pass.

    Replicas share the parameters through autograd: gradients of every replica accumulate into ``network``'s leaves.
    Every module of a replica that records its device (Lightning's ``DeviceDtypeModuleMixin``: LightningModules, nested
    ones included, and torchmetrics metrics) reports the replica's device, as Lightning 1.9's
    ``update_replica_device_attributes`` did.
    Buffers are copied; only replica 0's in-place buffer updates (BatchNorm running statistics) reach ``network``, as
    with ``torch.nn.DataParallel``. ``network`` itself is never modified.

    Args:
        network (Module): the module, on ``devices[0]``.
        devices (Sequence[torch.device]): one device per replica, the module's own first. On CUDA this is
            ``torch.nn.parallel.replicate`` (a GPU may repeat: replicas on ``devices[0]`` after the first get copies
            of the buffers, as replicas on other GPUs do); otherwise every replica stays in host memory and the
            broadcast is emulated, each replica's tensors carrying the identity of its virtual device (``cpu:i``, see
            :mod:`~lightning_balanced.data_parallel.virtual_device`).
        detach (bool): replicas do not take part in autograd (for evaluation under ``torch.no_grad``).

    Returns:
        list[Module]: ``len(devices)`` replicas; replica ``i`` belongs on ``devices[i]``.

    Raises:
        TypeError: ``network`` holds a compiled module (see :func:`check_replicable`).
        RuntimeError: ``network`` is not on ``devices[0]`` (torch's broadcast raises "All tensors must be on
            devices[0]"; the emulation raises the same for virtual devices).
    """
    if not devices:
        return []
    # One walk of the tree: the compiled-module check rides on the list of modules that replication needs anyway (the
    # named walk of check_replicable runs only to word the error), so a module compiled after a strategy's setup (in a
    # hook, between steps) is refused at the next step; on the host, the tensors are gathered from the same list.
    modules = list(network.modules())
    if any(_compiled_kind(module) is not None for module in modules):
        check_replicable(network)
    if devices[0].type == "cuda":
        replicas = cuda_replicate(network, list(devices), detach=detach)
        for index, (replica, device) in enumerate(zip(replicas, devices, strict=True)):
            record_device(replica, device)
            if index == 0 and detach:
                for module in replica.modules():
                    _unregister_parameters(module)
            if index > 0 and device == devices[0]:
                _own_buffers(replica)
        return replicas
    # Each tensor once (dict keys: tensors hash by identity), as network.parameters() and network.buffers() give them.
    parameters = list(dict.fromkeys(p for module in modules for p in module._parameters.values() if p is not None))
    buffers = list(dict.fromkeys(b for module in modules for b in module._buffers.values() if b is not None))
    _check_on_first_device(itertools.chain(parameters, buffers), devices[0])
    return cast(list[ModuleT], _replicate_on_host(modules, parameters, buffers, devices, detach))
