"""Sharded checkpoints of ``strategy="pipeline"``: each rank saves and loads only what it trains.

A checkpoint is a directory in the format of ``torch.distributed.checkpoint`` (DCP), as Lightning's
``ModelParallelStrategy`` writes it: the tensors under flat keys, each written by one rank (DCP's planner keeps one
copy of a key several ranks save, such as a parameter outside the ``nn.Sequential``), and ``meta.pt``, written by
rank 0, with the rest of Lightning's checkpoint (epoch, loops, callbacks, schedulers) and each optimizer's
``param_groups`` and the names of its parameters in order. The keys:

* ``model.<name>``: the LightningModule's ``state_dict`` entries (the plain ``nn.Sequential`` names);
* ``optimizer_<i>.<name>.<key>``: optimizer ``i``'s state of parameter ``<name>`` (``<key>@py`` for a Python number,
  stored as a 0-dim float64 tensor).

Because tensors are found by name, a checkpoint loads under any ``pipeline_parallel_size``, ``balance`` or schedule:
each rank reads the names of its own stages (DCP reshards). :func:`consolidate_checkpoint` turns one into a single
file in Lightning's usual format, which ``gpipe``, ``ddp`` or a plain module load.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.optim import Optimizer

from lightning_balanced.pipelining.stage_plan import stage_layers

__all__ = [
    "METADATA_FILENAME",
    "broadcast_stages",
    "consolidate_checkpoint",
    "flat_optimizer_state",
    "gathered_optimizer_state",
    "is_sharded_checkpoint",
    "keep_own_optimizer_state",
    "load_sharded_checkpoint",
    "merged_optimizer_state",
    "owned_state_names",
    "save_sharded_checkpoint",
    "to_host",
]

#: The file of the non-tensor part, as Lightning's ``ModelParallelStrategy`` names it.
METADATA_FILENAME = "meta.pt"
_PYTHON = "@py"


def is_sharded_checkpoint(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding a sharded checkpoint (its ``meta.pt``)."""
    path = Path(path)
    return path.is_dir() and (path / METADATA_FILENAME).is_file()


def owned_state_names(state_dict: Mapping[str, Tensor], module_name: str, layers: set[int] | None) -> set[str]:
    """The ``state_dict`` names a rank saves in a sharded checkpoint: its layers' and what is outside the pipeline.

    Args:
        state_dict: the LightningModule's ``state_dict``.
        module_name (str): the attribute of the pipelined ``nn.Sequential`` (its entries are ``<module_name>.<i>...``).
        layers (set[int] | None): the indices of the rank's layers; ``None`` (no stages: after ``fit`` every rank holds
            the whole model) for every name not on the meta device.
    """
    if layers is None:
        return {name for name, tensor in state_dict.items() if not tensor.is_meta}
    prefix = f"{module_name}."
    return {
        name
        for name in state_dict
        if not name.startswith(prefix) or int(name[len(prefix) :].partition(".")[0]) in layers
    }


def broadcast_stages(
    layers: Sequence[nn.Module], balance: list[int], owners: list[int], group: dist.ProcessGroup, device: torch.device
) -> None:
    """Every stage's parameters and buffers from the rank that trains it to every rank of ``group``, in place.

    For a checkpoint in one file, and so that every rank holds the whole trained model after ``fit``.

    Args:
        layers: the ``nn.Sequential``'s layers, in order.
        balance (list[int]): layers per stage.
        owners (list[int]): for each stage, its rank in ``group``.
        group (ProcessGroup): the pipeline's ranks.
        device (torch.device): this rank's device (what the backend sends from).
    """
    for stage, owner in enumerate(owners):
        source = dist.get_global_rank(group, owner)
        for index in stage_layers(balance, stage):
            for tensor in [*layers[index].parameters(), *layers[index].buffers()]:
                moved = tensor.detach().to(device)
                dist.broadcast(moved, source, group=group)
                if moved is not tensor:
                    with torch.no_grad():
                        tensor.copy_(moved)


def gathered_optimizer_state(state: dict[str, Any], group: dist.ProcessGroup) -> dict[str, Any]:
    """An optimizer's ``state_dict`` whose ``state`` holds every pipeline rank's entries, on every rank of ``group``.

    Each rank's ``state`` (its stages' parameters', by their positional index) travels to the host and is merged.
    """
    local = {index: to_host(value) for index, value in state["state"].items()}
    gathered: list[dict[int, Any] | None] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, local, group=group)
    return {**state, "state": merged_optimizer_state(gathered)}


def merged_optimizer_state(gathered: Iterable[dict[int, Any] | None]) -> dict[int, Any]:
    """One optimizer ``state`` from the pipeline ranks' parts (each holds its stages' parameters' entries)."""
    merged: dict[int, Any] = {}
    for part in gathered:
        merged.update(part or {})
    return merged


def to_host(value: Any) -> Any:
    """``value`` with its tensors detached on the CPU (through dicts), to travel as an object."""
    if isinstance(value, Tensor):
        return value.detach().cpu()
    if isinstance(value, dict):
        return {k: to_host(v) for k, v in value.items()}
    return value


def keep_own_optimizer_state(optimizer: Optimizer, state: dict[str, Any], own: set[int]) -> None:
    """Load ``state`` into ``optimizer``, then keep only the entries of the parameters in ``own`` (by ``id``).

    A rank holds the optimizer state of its stages only; the kept tensors move to their parameters' devices.
    """
    optimizer.load_state_dict(state)
    for param in list(optimizer.state):
        if id(param) not in own:
            del optimizer.state[param]
            continue
        for key, value in optimizer.state[param].items():
            if isinstance(value, Tensor) and key != "step":
                optimizer.state[param][key] = value.to(param.device)


def flat_optimizer_state(optimizer: Optimizer, names: Mapping[int, str], owned: set[int]) -> dict[str, Any]:
    """``optimizer``'s state of the parameters in ``owned`` (by ``id``), by name, with its groups and names.

    Returns ``{"state": {"<name>.<key>": tensor}, "param_groups": ..., "param_names": [...]}``: the groups in
    ``torch.optim``'s positional form and each parameter's name in that order.

    Args:
        optimizer (Optimizer): the optimizer.
        names (Mapping[int, str]): each parameter's name in the LightningModule, by ``id``.
        owned (set[int]): the ``id`` of the parameters this rank trains.
    """
    state: dict[str, Tensor] = {}
    for param, values in optimizer.state.items():
        if id(param) not in owned:
            continue
        for key, value in values.items():
            if isinstance(value, Tensor):
                state[f"{names[id(param)]}.{key}"] = value.detach()
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                state[f"{names[id(param)]}.{key}{_PYTHON}"] = torch.tensor(float(value), dtype=torch.float64)
    groups = optimizer.state_dict()["param_groups"]
    order = [names[id(param)] for group in optimizer.param_groups for param in group["params"]]
    return {"state": state, "param_groups": groups, "param_names": order}


def save_sharded_checkpoint(path: Path, checkpoint: dict[str, Any], rank: int) -> None:
    """Save Lightning's ``checkpoint`` (this rank's ``state_dict``, :func:`flat_optimizer_state`'s) at ``path``.

    The tensors go through ``torch.distributed.checkpoint.save`` (a collective: every rank calls it), the rest to
    ``meta.pt`` from rank 0.
    """
    from torch.distributed.checkpoint.state_dict_saver import save

    path.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, Tensor] = {f"model.{k}": v for k, v in checkpoint.pop("state_dict").items()}
    groups = []
    for index, optimizer_state in enumerate(checkpoint.pop("optimizer_states", [])):
        tensors.update({f"optimizer_{index}.{k}": v for k, v in optimizer_state["state"].items()})
        groups.append({"param_groups": optimizer_state["param_groups"], "param_names": optimizer_state["param_names"]})
    save(tensors, checkpoint_id=path)
    if rank == 0:
        torch.save({**checkpoint, "optimizer_param_groups": groups}, path / METADATA_FILENAME)


def load_sharded_checkpoint(
    path: Path, model_tensors: Mapping[str, Tensor], optimizers: Iterable[tuple[Optimizer, Mapping[int, str]]]
) -> dict[str, Any]:
    """Load this rank's part of the sharded checkpoint at ``path``; return the rest of Lightning's checkpoint.

    Args:
        path (Path): the checkpoint directory.
        model_tensors (Mapping[str, Tensor]): the ``state_dict`` entries this rank holds, by name: loaded in place.
        optimizers: each optimizer with the names of the parameters it should load state for (by ``id``, this rank's
            own); in the order they were saved.

    Raises:
        KeyError: a name of ``model_tensors`` is not in the checkpoint.
    """
    from torch.distributed.checkpoint.filesystem import FileSystemReader
    from torch.distributed.checkpoint.state_dict_loader import load

    metadata = torch.load(path / METADATA_FILENAME, map_location="cpu", weights_only=False)
    saved = FileSystemReader(str(path)).read_metadata().state_dict_metadata
    missing = [name for name in model_tensors if f"model.{name}" not in saved]
    if missing:
        raise KeyError(f"the sharded checkpoint at {path} has no {missing[:5]}")
    targets: dict[str, Tensor] = {f"model.{name}": tensor for name, tensor in model_tensors.items()}
    wanted: list[tuple[Optimizer, dict[str, int], str]] = []
    for index, (optimizer, names) in enumerate(optimizers):
        prefix = f"optimizer_{index}."
        saved_names = metadata["optimizer_param_groups"][index]["param_names"]
        position = {name: i for i, name in enumerate(saved_names)}
        own = {
            names[id(p)]: position[names[id(p)]] for g in optimizer.param_groups for p in g["params"] if id(p) in names
        }
        for key, stored in saved.items():
            if key.startswith(prefix) and key[len(prefix) :].rpartition(".")[0] in own:
                targets[key] = torch.empty(stored.size, dtype=stored.properties.dtype)  # type: ignore[union-attr]
        wanted.append((optimizer, own, prefix))
    load(targets, checkpoint_id=path)
    for index, (optimizer, own, prefix) in enumerate(wanted):
        state: dict[int, dict[str, Any]] = {}
        for key, value in targets.items():
            if not key.startswith(prefix):
                continue
            name, _, entry = key[len(prefix) :].rpartition(".")
            if entry.endswith(_PYTHON):
                state.setdefault(own[name], {})[entry.removesuffix(_PYTHON)] = value.item()
            else:
                state.setdefault(own[name], {})[entry] = value
        optimizer.load_state_dict(
            {"state": state, "param_groups": metadata["optimizer_param_groups"][index]["param_groups"]}
        )
    metadata.pop("optimizer_param_groups")
    result: dict[str, Any] = metadata
    return result


def consolidate_checkpoint(directory: str | Path, output: str | Path) -> None:
    """Write the sharded checkpoint at ``directory`` as one file in Lightning's usual format, at ``output``.

    The file holds the whole ``state_dict`` (plain ``nn.Sequential`` names) and each optimizer's state in
    ``torch.optim``'s positional form, so ``gpipe``, ``ddp``, one device or a plain ``module.load_state_dict`` load it.
    It needs the whole model in this process's memory: run it where that fits (one process, no GPU needed).

    Raises:
        ValueError: ``directory`` is not a sharded checkpoint.
    """
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    directory = Path(directory)
    if not is_sharded_checkpoint(directory):
        raise ValueError(
            f"`directory` must be a sharded checkpoint (a folder with {METADATA_FILENAME}), got {directory}"
        )
    metadata = torch.load(directory / METADATA_FILENAME, map_location="cpu", weights_only=False)
    flat_file = Path(output).with_name(Path(output).name + ".tensors")
    dcp_to_torch_save(directory, flat_file)
    try:
        flat: dict[str, Tensor] = torch.load(flat_file, map_location="cpu", weights_only=True)
    finally:
        flat_file.unlink(missing_ok=True)
    checkpoint = dict(metadata)
    groups = checkpoint.pop("optimizer_param_groups")
    checkpoint["state_dict"] = {k.removeprefix("model."): v for k, v in flat.items() if k.startswith("model.")}
    checkpoint["optimizer_states"] = []
    for index, group in enumerate(groups):
        prefix = f"optimizer_{index}."
        position = {name: i for i, name in enumerate(group["param_names"])}
        state: dict[int, dict[str, Any]] = {}
        for key, value in flat.items():
            if key.startswith(prefix):
                name, _, entry = key[len(prefix) :].rpartition(".")
                target = state.setdefault(position[name], {})
                if entry.endswith(_PYTHON):
                    target[entry.removesuffix(_PYTHON)] = value.item()
                else:
                    target[entry] = value
        checkpoint["optimizer_states"].append({"state": state, "param_groups": group["param_groups"]})
    torch.save(checkpoint, output)
