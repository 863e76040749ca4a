"""CarriedExchange: DDP's gradient all-reduce carrying a few values, on a real gloo group of 2 CPU ranks.

The gradients must equal DDP's without a hook bit for bit (the same division before the same sum), and the values
must come back summed on every rank after a synchronizing backward, and not at all after one under ``no_sync``.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from lightning_balanced.rank_shares.carried_exchange import CarriedExchange
from tests.distributed import run_distributed


def _model(dtype: torch.dtype) -> nn.Module:
    torch.manual_seed(0)
    # 600 x 512 weights (1.2 MB in float32) exceed DDP's first-bucket cap (1 MiB): several buckets, bucket 0 one of them
    return nn.Sequential(nn.Linear(600, 512), nn.Tanh(), nn.Linear(512, 2)).to(dtype)


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def _exchange_rank(rank: int, world_size: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for dtype in (torch.float32, torch.float64):
        g = torch.Generator().manual_seed(rank)
        x = torch.randn(5, 600, generator=g, dtype=dtype)
        plain = DistributedDataParallel(_model(dtype))
        carrying = DistributedDataParallel(_model(dtype))
        carrier = CarriedExchange()
        carrying.register_comm_hook(None, carrier.reduce)
        plain(x).square().sum().backward()
        values = torch.tensor([rank + 1.0, 10.0 * rank, 0.25], dtype=torch.float64)
        carrier.send(values)
        carrying(x).square().sum().backward()
        received = carrier.receive()
        equal = all(torch.equal(a, b) for a, b in zip(_grads(plain), _grads(carrying), strict=True))
        with carrying.no_sync():
            carrier.send(values)
            carrying(x).sum().backward()
        results[str(dtype)] = {
            "equal": equal,
            "received": None if received is None else received.tolist(),
            "received_dtype": None if received is None else str(received.dtype),
            "after_no_sync": carrier.receive(),
        }
    dist.barrier()
    return results


@pytest.mark.slow
def test_gradients_equal_ddps_and_the_values_arrive_summed_after_a_synchronizing_backward() -> None:
    for result in run_distributed(_exchange_rank, 2):
        for dtype, seen in result.items():
            assert seen["equal"], dtype
            assert seen["received"] == [3.0, 10.0, 0.5], dtype
            assert seen["received_dtype"] == dtype
            assert seen["after_no_sync"] is None, dtype
