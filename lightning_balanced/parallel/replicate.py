"""Per-step module replicas: torch's broadcast on CUDA, an autograd-aware emulation elsewhere."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

import torch
from torch import Tensor
from torch.nn import Module
from torch.nn.parallel import replicate as cuda_replicate

__all__ = ["replicate"]

ModuleT = TypeVar("ModuleT", bound=Module)


def _host_copies(tensor: Tensor, num_replicas: int, *, detach: bool, is_buffer: bool) -> list[Tensor]:
    """What ``Broadcast`` gives each replica, emulated on one device.

    Tensors that take part in autograd become views (gradients flow back to the original leaf, as through torch's
    ``Broadcast``). Other parameters are aliased: nothing updates them in place during a forward. Other buffers alias
    the original for replica 0 and are cloned for the rest, so in-place updates (BatchNorm running statistics)
    persist from replica 0 only, exactly as on CUDA.
    """
    if tensor.requires_grad and not detach:
        return [tensor.view_as(tensor) for _ in range(num_replicas)]
    base = tensor.detach()
    return [base.clone() if (is_buffer and i > 0) else base for i in range(num_replicas)]


def _replicate_on_host(network: ModuleT, num_replicas: int, detach: bool) -> list[ModuleT]:
    modules = list(network.modules())
    index = {module: i for i, module in enumerate(modules)}
    params = {
        param: _host_copies(param, num_replicas, detach=detach, is_buffer=False) for param in network.parameters()
    }
    buffers = {
        buffer: _host_copies(buffer, num_replicas, detach=detach, is_buffer=True) for buffer in network.buffers()
    }

    copies = [[module._replicate_for_data_parallel() for module in modules] for _ in range(num_replicas)]
    for j, replica_modules in enumerate(copies):
        for module, replica in zip(modules, replica_modules, strict=True):
            # Same layout as torch.nn.parallel.replicate: non-leaf parameters live as plain attributes.
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
                replica._buffers[key] = None if buffer is None else buffers[buffer][j]
    return [replica_modules[0] for replica_modules in copies]


def replicate(network: ModuleT, devices: Sequence[torch.device], *, detach: bool = False) -> list[ModuleT]:
    """Make one replica of ``network`` per device for a single forward pass.

    Replicas share the parameters through autograd: gradients of every replica accumulate into ``network``'s leaves.
    Buffers are copied; only replica 0's in-place buffer updates (BatchNorm running statistics) reach ``network``, as
    with ``torch.nn.DataParallel``.

    Args:
        network (Module): the module on ``devices[0]``.
        devices (Sequence[torch.device]): one device per replica. On CUDA this is ``torch.nn.parallel.replicate``;
            otherwise every replica stays on the module's device and the broadcast is emulated.
        detach (bool): replicas do not take part in autograd (for evaluation under ``torch.no_grad``).

    Returns:
        list[Module]: ``len(devices)`` replicas; replica ``i`` belongs on ``devices[i]``.
    """
    if not devices:
        return []
    if devices[0].type == "cuda":
        return cuda_replicate(network, list(devices), detach=detach)
    return _replicate_on_host(network, len(devices), detach)
