"""The balance of ``strategy="pipeline"``: layers per stage, given, even, or chosen by name on rank 0 for every rank."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from lightning_balanced.pipeline.balance import (
    BalanceChoice,
    choose_balance,
    even_balance,
    layer_parameters,
    split_costs,
)
from lightning_balanced.pipelining.materialize import is_on_meta
from lightning_balanced.pipelining.runtime import first_tensor

__all__ = ["pipeline_balance"]


def pipeline_balance(
    setting: list[int] | str | None,
    sequential: nn.Sequential,
    pipeline_size: int,
    stages_per_rank: int,
    module: nn.Module,
    module_name: str,
    chunks: int,
    device: torch.device,
    global_rank: int,
) -> tuple[list[int], str]:
    """The layers of each stage and how they were chosen (for the report).

    ``None``: even by layer count. A list: as given (one entry per stage). A name, as ``gpipe`` chooses
    (:func:`~lightning_balanced.pipeline.balance.choose_balance`): ``"parameters"`` (and ``"auto"`` for a model on the
    meta device or without an example) from the layers' parameter counts, the same on every rank; a measured cost
    (``"time"``, ``"memory"``, ``"auto"``) on the global rank 0, on its device, one layer at a time with one
    micro-batch of the LightningModule's ``example_input_array``, then every rank uses rank 0's
    balance (one ``broadcast_object_list``).

    Args:
        setting: the strategy's ``balance``.
        sequential (nn.Sequential): the pipelined layers.
        pipeline_size (int): ranks per pipeline.
        stages_per_rank (int): stages each rank holds.
        module (LightningModule): the module (its ``example_input_array``: the first stage's input batch, if any).
        module_name (str): the LightningModule's attribute holding ``sequential``, for messages.
        chunks (int): micro-batches per batch (the measured micro-batch is ``1 / chunks`` of the example).
        device (torch.device): where rank 0 measures.
        global_rank (int): this process's rank.

    Raises:
        ValueError: a list of the wrong length; fewer layers than stages; a measured cost on a model on the meta
            device, or without ``example``; ``"memory"`` off CUDA.
    """
    num_stages = pipeline_size * stages_per_rank
    example, owner = getattr(module, "example_input_array", None), type(module).__name__
    per_rank = f"({pipeline_size} ranks x {stages_per_rank} stages per rank)"
    if isinstance(setting, list):
        if len(setting) != num_stages:
            raise ValueError(f"`balance` {setting} must hold one entry per stage: {num_stages} {per_rank}")
        return list(setting), "given"
    if len(sequential) < num_stages:
        raise ValueError(f"`{module_name}` has {len(sequential)} layers, fewer than the {num_stages} stages {per_rank}")
    if setting is None:
        return even_balance(len(sequential), num_stages), "even by layer count"
    choice: BalanceChoice = setting  # type: ignore[assignment]
    on_meta = is_on_meta(sequential)
    if choice == "parameters" or (choice == "auto" and (on_meta or example is None)):
        why = "" if choice == "parameters" else " (no example_input_array)" if example is None else " (meta device)"
        return split_costs(layer_parameters(list(sequential)), num_stages), "parameters" + why
    if on_meta:
        raise ValueError(
            f"`balance`={choice!r} measures each layer on a device, but `{module_name}` was built on the meta"
            " device: use `balance='parameters'` or a list"
        )
    if example is None:
        raise ValueError(
            f"`balance`={choice!r} measures each layer on a micro-batch: set `example_input_array` on"
            f" {owner} (an input batch of the first stage), or use `balance='parameters'` or a list"
        )
    if choice == "memory" and device.type != "cuda":
        raise ValueError(f"`balance`='memory' measures CUDA memory, but the device is {device}")
    chosen: list[Any] = [None, None]
    if global_rank == 0:
        size = max(first_tensor(example).shape[0] // chunks, 1)
        micro = tuple(t[:size] for t in example) if isinstance(example, tuple) else example[:size]
        chosen = list(choose_balance(list(sequential), micro, num_stages, device, choice))
    dist.broadcast_object_list(chosen, src=0)
    balance, method = chosen
    return list(balance), method
