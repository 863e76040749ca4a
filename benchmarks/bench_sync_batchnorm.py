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
"""

from __future__ import annotations

import argparse
import os
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--shape", type=int, nargs=4, default=[32, 64, 16, 16], metavar=("N", "C", "H", "W"))
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = parser.parse_args()

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
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
