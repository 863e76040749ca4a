"""Materialize layers built on the meta device: each rank of a pipeline gives memory to its own stages only.

A model too large for one host is built under ``torch.device("meta")`` (shapes, no storage), as torch's pipelining
examples, torchtitan and Lightning's ``ModelParallelStrategy`` do; each rank then allocates and initializes the layers
it holds. The initialization is seeded per layer (layer ``i`` of the ``nn.Sequential`` from ``seed + i``), so it does
not depend on which rank holds a layer or on the balance, and one process that materializes every layer with
:func:`materialize_layers` builds the very same model (the reference a pipelined run is compared with).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

__all__ = [
    "is_on_meta",
    "materialize",
    "materialize_layers",
    "materialize_own_part",
    "to_cpu_but_meta",
    "without_child",
]


def is_on_meta(module: nn.Module) -> bool:
    """Whether any parameter or buffer of ``module`` (recursively) is on the meta device."""
    return any(t.is_meta for t in (*module.parameters(), *module.buffers()))


def materialize(module: nn.Module, device: torch.device | str, seed: int, where: str) -> None:
    """Give ``module``'s meta tensors storage on ``device`` and initialize them by ``reset_parameters()``, seeded.

    Every submodule with parameters or buffers of its own on the meta device must define ``reset_parameters()``
    (torch's layers do; for BatchNorm it also resets the running statistics), as under Lightning's
    ``ModelParallelStrategy``. Tensors already materialized are left as they are.

    Args:
        module (nn.Module): a module some of whose parameters or buffers may be on the meta device.
        device (torch.device or str): where the storage goes.
        seed (int): the seed of torch's CPU generator while the submodules reset (restored afterwards).
        where (str): how to name ``module`` in an error (e.g. ``"layer 3 of `sequential_module`"``).

    Raises:
        ValueError: a submodule with meta tensors of its own has no ``reset_parameters()``: it would keep the
            uninitialized memory ``to_empty`` gives.
    """
    pending = [m for m in module.modules() if _own_meta(m)]
    if not pending:
        return
    missing = [type(m).__name__ for m in pending if not callable(getattr(m, "reset_parameters", None))]
    if missing:
        raise ValueError(
            f"{where} was built on the meta device, but {', '.join(sorted(set(missing)))} has no `reset_parameters()`"
            " to initialize its parameters or buffers after they get memory: define one, or build that module on a"
            " real device"
        )
    for m in pending:
        m.to_empty(device=device, recurse=False)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        for m in pending:
            m.reset_parameters()  # type: ignore[operator]


def materialize_layers(
    layers: nn.Sequential | Sequence[nn.Module], indices: Iterable[int], device: torch.device | str, seed: int = 0
) -> None:
    """Materialize layers ``indices`` of an ``nn.Sequential`` built on the meta device, layer ``i`` seeded ``seed + i``.

    What ``strategy="pipeline"`` does on each rank for its own stages' layers (``seed``: Lightning's
    ``seed_everything`` seed, else 0). Call it with every index to build, in one process, the model a pipelined run
    starts from.

    Args:
        layers: the ``nn.Sequential`` (or its layers, in order).
        indices: which layers to materialize.
        device: where their storage goes.
        seed: the base seed.

    Raises:
        ValueError: as :func:`materialize`.
    """
    layers = list(layers)
    for index in indices:
        materialize(layers[index], device, seed + index, f"layer {index}")


def materialize_own_part(
    module: nn.Module, module_name: str, indices: Iterable[int], device: torch.device | str, seed: int
) -> None:
    """Materialize a rank's part of a module built on the meta device.

    That is layers ``indices`` of the ``nn.Sequential`` at ``module_name`` (layer ``i`` seeded ``seed + i``) and
    everything outside it (seeded ``seed - 1``). So the model is the same whatever the balance and the ranks; the
    other layers stay on the meta device.

    Args:
        module (nn.Module): the LightningModule.
        module_name (str): the attribute holding the ``nn.Sequential``.
        indices: the layers this rank holds.
        device: where their storage goes.
        seed (int): the base seed (Lightning's ``seed_everything`` seed, else 0).

    Raises:
        ValueError: as :func:`materialize`.
    """
    with without_child(module, module_name) as sequential:
        materialize_layers(list(sequential.children()), indices, device, seed)
        materialize(module, device, seed - 1, f"{type(module).__name__} (outside `{module_name}`)")


def to_cpu_but_meta(sequential: nn.Module) -> None:
    """Move ``sequential``'s layers to the CPU one by one, leaving those on the meta device (other ranks') there."""
    for layer in sequential.children():
        if not is_on_meta(layer):
            layer.cpu()


@contextmanager
def without_child(module: nn.Module, name: str) -> Iterator[nn.Module]:
    """``module`` without its child ``name`` for the block (yielded), as what ``.to()`` or materializing must skip.

    The child comes back in its place afterwards, also on an error.
    """
    child = module._modules[name]
    assert child is not None
    module._modules[name] = None
    try:
        yield child
    finally:
        module._modules[name] = child


def _own_meta(module: nn.Module) -> bool:
    return any(t.is_meta for t in (*module.parameters(recurse=False), *module.buffers(recurse=False)))
