"""CPU benchmark: our SyncBatchNorm on 2 gloo processes against torch's plain BatchNorm2d on the same per-rank input.

Each of ``--world-size`` spawned ranks (one thread each by default: the CI machine has 2 cores) times, on its own
``(N, C, H, W)`` input, forward + backward of

  * ``plain``: ``torch.nn.BatchNorm2d`` (local statistics, no communication): the cost floor;
  * ``sync``: ``lightning_balanced.SyncBatchNorm`` over the gloo group (two ``all_reduce`` calls per step: ``(2C+1,)``
    floats forward, ``(2C,)`` backward).

Both run in the same processes, interleaved per repeat, each timed between barriers so that one rank's lag is not
counted as the other's compute. torch's own ``nn.SyncBatchNorm`` cannot be a baseline: it raises on CPU in training.

Run: ``python benchmarks/bench_sync_batchnorm.py`` (defaults: 2 ranks, (32, 64, 16, 16) float32 per rank, 50 repeats).
The last line is ``ratio=...``: median sync / median plain on rank 0.

``--accuracy`` measures precision instead of time: float32 input ``ratio + randn`` of shape (8, 4, 6, 6) split over
the ranks as 3 and 5 samples (2 ranks), for ``|mean| / std`` ratios 1e2, 1e3, 1e4; it prints the max absolute error of
the output, the input gradient and ``running_var`` against float64 ``BatchNorm2d`` on the whole batch, next to the
error of torch's float32 ``BatchNorm2d`` on the whole batch (the anchor), and their ratio.
"""

from __future__ import annotations

import argparse
import os
import pickle
import socket
import statistics
import time
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from lightning_balanced import SyncBatchNorm


def _step(module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> float:
    dist.barrier()
    start = time.perf_counter()
    x = x.detach().requires_grad_(True)
    module(x).backward(grad)
    return time.perf_counter() - start


def _worker(rank: int, world_size: int, port: int, args: argparse.Namespace, queue: mp.SimpleQueue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(args.threads)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    try:
        gen = torch.Generator().manual_seed(rank)
        x = torch.randn(*args.shape, generator=gen)
        grad = torch.randn(*args.shape, generator=gen)
        channels = args.shape[1]
        plain, sync = nn.BatchNorm2d(channels), SyncBatchNorm(channels)
        times: dict[str, list[float]] = {"plain": [], "sync": []}
        for i in range(args.warmup + args.repeats):
            t_plain, t_sync = _step(plain, x, grad), _step(sync, x, grad)
            if i >= args.warmup:
                times["plain"].append(t_plain)
                times["sync"].append(t_sync)
        queue.put((rank, {k: statistics.median(v) for k, v in times.items()}))
    finally:
        dist.destroy_process_group()


_ACCURACY_SIZES = (3, 5)
_ACCURACY_RATIOS = (1e2, 1e3, 1e4)


def _accuracy_data(ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(3)
    n = sum(_ACCURACY_SIZES)
    x = torch.randn(n, 4, 6, 6, generator=g, dtype=torch.float64) + ratio
    grad = torch.randn(n, 4, 6, 6, generator=g, dtype=torch.float64)
    return x.float(), grad.float()


def _forward_backward(module: nn.Module, x: torch.Tensor, grad: torch.Tensor) -> dict[str, torch.Tensor]:
    x = x.clone().requires_grad_(True)
    y = module(x)
    (y * grad).sum().backward()
    return {"output": y.detach(), "input grad": x.grad, "running_var": module.running_var.clone()}


def _accuracy_worker(rank: int, world_size: int, port: int, queue: mp.SimpleQueue) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size, timeout=timedelta(seconds=120))
    try:
        start = sum(_ACCURACY_SIZES[:rank])
        part = slice(start, start + _ACCURACY_SIZES[rank])
        results = {}
        for ratio in _ACCURACY_RATIOS:
            x, grad = _accuracy_data(ratio)
            results[ratio] = _forward_backward(SyncBatchNorm(4), x[part], grad[part])
        queue.put((rank, pickle.dumps(results)))  # by value: tensors in shared memory die with the rank
    finally:
        dist.destroy_process_group()


def _accuracy(port: int) -> None:
    world_size = len(_ACCURACY_SIZES)
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_accuracy_worker, args=(world_size, port, queue), nprocs=world_size, start_method="spawn")
    per_rank = {rank: pickle.loads(payload) for rank, payload in (queue.get() for _ in range(world_size))}
    print(
        f"torch {torch.__version__}, {world_size} gloo ranks with {list(_ACCURACY_SIZES)} samples of (4, 6, 6), float32"
        " ratio + randn; max |error| against float64 BatchNorm2d on the whole batch"
    )
    print("| |mean|/std | quantity | SyncBatchNorm | torch float32 BatchNorm2d | ratio |")
    print("|---|---|---|---|---|")
    worst = 0.0
    for ratio in _ACCURACY_RATIOS:
        x, grad = _accuracy_data(ratio)
        reference = _forward_backward(nn.BatchNorm2d(4, dtype=torch.float64), x.double(), grad.double())
        anchor = _forward_backward(nn.BatchNorm2d(4), x, grad)
        for key in reference:
            ours = (
                per_rank[0][ratio][key]
                if key == "running_var"
                else torch.cat([per_rank[r][ratio][key] for r in range(world_size)])
            )
            ours_error = (ours.double() - reference[key]).abs().max().item()
            anchor_error = (anchor[key].double() - reference[key]).abs().max().item()
            worst = max(worst, ours_error / anchor_error)
            print(f"| {ratio:.0e} | {key} | {ours_error:.2e} | {anchor_error:.2e} | {ours_error / anchor_error:.3g} |")
    print(f"worst_error_ratio={worst:.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--shape", type=int, nargs=4, default=[32, 64, 16, 16], metavar=("N", "C", "H", "W"))
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    parser.add_argument("--accuracy", action="store_true", help="measure float32 error at large |mean|/std instead")
    args = parser.parse_args()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    if args.accuracy:
        _accuracy(port)
        return
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.start_processes(_worker, args=(args.world_size, port, args, queue), nprocs=args.world_size, start_method="spawn")
    medians = dict(queue.get() for _ in range(args.world_size))

    print(
        f"torch {torch.__version__}, {args.world_size} gloo ranks x {args.threads} thread(s), per-rank input "
        f"{tuple(args.shape)} float32, forward+backward, median of {args.repeats}"
    )
    for rank in sorted(medians):
        m = medians[rank]
        print(
            f"rank {rank}: plain BatchNorm2d {m['plain'] * 1e3:.3f} ms, SyncBatchNorm {m['sync'] * 1e3:.3f} ms, "
            f"ratio sync/plain {m['sync'] / m['plain']:.2f}"
        )
    print(f"ratio={medians[0]['sync'] / medians[0]['plain']:.2f}")


if __name__ == "__main__":
    main()
