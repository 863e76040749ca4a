"""The single-process reference the distributed tests compare with: one training loop, written once.

Lightning's loop on one device, over the global batches of Lightning's ``DistributedSampler`` (shuffled with the
seed the ranks use, reshuffled each epoch), the ``shards`` data-parallel shards of a step side by side: each batch's
loss divided by ``accumulate`` and backpropagated, an optimizer step (after clipping by norm) every ``accumulate``
batches and after an epoch's last batch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.utils.data import DistributedSampler, TensorDataset

from tests.distributed import lightning_sampler_seed

__all__ = ["epoch_batches", "reference_fit"]


def epoch_batches(data: TensorDataset, batch_size: int, epoch: int, shards: int = 1) -> list[Tensor]:
    """The sample indices of each global batch of ``epoch``: ``shards`` per-shard batches of ``batch_size``, side by
    side, in the order Lightning's ``DistributedSampler`` gives each shard."""
    orders = []
    for shard in range(shards):
        sampler = DistributedSampler(data, num_replicas=shards, rank=shard, shuffle=True, seed=lightning_sampler_seed())
        sampler.set_epoch(epoch)
        orders.append(list(sampler))
    return [
        torch.tensor([i for order in orders for i in order[start : start + batch_size]])
        for start in range(0, len(orders[0]), batch_size)
    ]


def reference_fit(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    loss_of: Callable[[Tensor, Tensor], Tensor],
    data: TensorDataset,
    *,
    steps: int,
    batch_size: int,
    shards: int = 1,
    accumulate: int = 1,
    clip: float | None = None,
) -> tuple[dict[str, Tensor], list[float]]:
    """Train ``model`` for ``steps`` optimizer steps as above; return its state and each batch's loss."""
    x, y = data[:]
    losses: list[float] = []
    done, epoch = 0, 0
    while done < steps:
        batches = epoch_batches(data, batch_size, epoch, shards)
        for index, batch in enumerate(batches):
            loss = loss_of(x[batch], y[batch])
            losses.append(loss.item())
            (loss / accumulate).backward()
            if (index + 1) % accumulate == 0 or index == len(batches) - 1:
                if clip is not None:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
                optimizer.step()
                optimizer.zero_grad()
                done += 1
                if done == steps:
                    break
        epoch += 1
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, losses
