"""Per-step module replicas: torch's broadcast on CUDA, an autograd-aware emulation elsewhere."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from typing import TypeVar, cast

import torch
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import replicate as cuda_replicate

from lightning_balanced.data_parallel.virtual_device import VirtualDeviceTensor, on_device

__all__ = ["check_replicable", "parameter_copies", "record_device", "refresh_parameter_copies", "replicate"]

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


def _host_copies(tensor: Tensor, devices: Sequence[torch.device], *, detach: bool, is_buffer: bool) -> list[Tensor]:
    """What ``Broadcast`` gives each replica, emulated in host memory.

    Replica 0 aliases the original tensor (a view when it takes part in autograd); the other replicas get copies, which
    pass gradients back to the original as torch's ``Broadcast`` does. So in-place updates (BatchNorm running
    statistics, a write to a parameter) persist from replica 0 only, exactly as on CUDA. Each copy carries its
    replica's virtual device.
    """
    if tensor.requires_grad and not detach:
        # Replica 0 aliases the leaf (torch's broadcast hands the source device its own tensor back); the others get
        # copies whose gradients flow back to it, as Broadcast's do, so an in-place write reaches the leaf from
        # replica 0 only, as on GPUs.
        return [on_device(tensor.view_as(tensor) if i == 0 else tensor.clone(), d) for i, d in enumerate(devices)]
    base = tensor.detach()
    return [on_device(base if i == 0 else base.clone(), device) for i, device in enumerate(devices)]


def _replicate_on_host(
    modules: list[Module],
    parameters: Sequence[Tensor],
    buffers: Sequence[Tensor],
    devices: Sequence[torch.device],
    detach: bool,
) -> list[Module]:
    index = {module: i for i, module in enumerate(modules)}
    params = {param: _host_copies(param, devices, detach=detach, is_buffer=False) for param in parameters}
    buffer_copies = {buffer: _host_copies(buffer, devices, detach=detach, is_buffer=True) for buffer in buffers}

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


def parameter_copies(network: Module, replicas: Sequence[Module]) -> list[tuple[Tensor, Tensor]]:
    """``(parameter, copy)`` for every parameter of ``network`` that a replica holds as a copy of its own.

    Broadcast gives each replica but the one on the source device a copy of every parameter (torch's ``replicate``
    on CUDA, a replica on a repeated GPU included, and the emulation alike); a change of the parameter in place
    (``optimizer.step()``) does not reach the copies. Call before anything replaces a replica's submodules: the
    replicas are walked side by side with ``network``.

    Args:
        network (Module): the module the replicas were made from.
        replicas (Sequence[Module]): from :func:`replicate` of ``network``.

    Returns:
        list[tuple[Tensor, Tensor]]: pairs to hand to :func:`refresh_parameter_copies`; copies that share their
        parameter's memory (replica 0's) are left out.
    """
    pairs: list[tuple[Tensor, Tensor]] = []
    for replica in replicas:
        for module, copied in zip(network.modules(), replica.modules(), strict=True):
            for key, param in module._parameters.items():
                copy = copied.__dict__.get("_former_parameters", {}).get(key)
                if param is not None and copy is not None and copy.data_ptr() != param.data_ptr():
                    pairs.append((param, copy))
    return pairs


def refresh_parameter_copies(pairs: Sequence[tuple[Tensor, Tensor]]) -> None:
    """Copy each parameter's current value into its replicas' copies (after ``optimizer.step()`` within a step).

    Without it, a replica's later forward pass in the same step (a GAN's discriminator pass after the generator's
    step) would read the values from before the step, on GPUs as in the emulation. Autograd does not see the copy.
    """
    with torch.no_grad():
        for param, copy in pairs:
            copy.copy_(param)


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
