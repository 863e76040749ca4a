"""End-of-epoch gather of DistributedEvalMixin against torchmetrics' ``gather_all_tensors``, one call per tensor.

Setup, per size ``N`` (the total over 2 ranks, odd on purpose): ``DistributedSampler(shuffle=False)`` splits the
sample indices over 2 gloo CPU processes, so each rank holds ``(N + 1) / 2`` samples and the last one of rank 1 is
the padding repeat of sample 0. Each rank buffered its evaluation outputs batch by batch (``--batch-size`` samples
per step): ``preds`` (int64 class labels), ``target`` (int64), ``scores`` (float32 logits, 10 classes) and the int64
sample ``indices``. Timed is what happens at epoch end, from the per-batch tensors to one tensor per field:

* ``ours``: ``DistributedEvalMixin.gather_eval_outputs``: the store exchange of metadata (five round trips per rank,
  no collective), each rank's check of its own indices against ``DistributedSampler``'s layout, then per field
  ``torch.cat`` the batches and torchmetrics' ``gather_all_tensors`` (3 collectives each: 9 here, as the layout holds
  and the indices need no gather; 12 with ``--shuffle``, which gathers and sorts them), then **keep each sample once,
  ordered by index**: its result holds ``N`` samples;
* ``torchmetrics``: what a user (or torchmetrics' own ``CatMetric`` sync) does with the same tensors: per field,
  ``torch.cat`` the batches, ``gather_all_tensors`` (a barrier, a gather of the shapes, the gather: 3 * 4 = 12
  collectives here), ``torch.cat`` the ranks. It does not dedupe: its result holds ``N + 1`` samples, the padding
  repeat included.

Time: the two paths alternate within one run (the order flips every repeat, after one warm-up each); a repeat's time
is the slowest rank's wall time (the epoch ends when the last rank leaves the gather), and the table prints medians.

Peak memory: torch has no CPU allocator statistics, and ``tracemalloc`` does not see tensor storage, so this
measures the resident set of the process. Each (size, path) runs in a fresh pair of processes started with
``MALLOC_MMAP_THRESHOLD_=65536``, so every large allocation is its own ``mmap`` and goes back to the OS when freed
(otherwise glibc reuses freed heap memory and the high-water mark hides what a call allocates). After one warm-up
gather, the peak counter is reset (``/proc/self/clear_refs``, value 5) and ``VmRSS`` read; after the measured gather
the printed figure is ``VmHWM - VmRSS before``: the extra memory the call had resident at its worst, its result
included (the result is what the caller asked for; its size is printed alongside). Rank 0's figure, in MiB.

``--shuffle`` uses ``DistributedSampler(shuffle=True)`` instead: the ranks' samples are then no longer a plain
interleave of the dataset (the layout Lightning's evaluation loaders have), which exercises the general dedupe.

Usage: ``python benchmarks/bench_gather.py [--sizes 100001 1000001] [--repeats 9] [--batch-size 256] [--shuffle]``.
The last line is ``ratio=...``: the worst, over sizes, of time(ours) / time(torchmetrics) (target <= 1.1).
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import statistics
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import Tensor
from torch.utils.data import DistributedSampler
from torchmetrics.utilities.distributed import gather_all_tensors

from lightning_balanced.evaluation import DistributedEvalMixin

WORLD_SIZE = 2
NUM_CLASSES = 10
PATHS = ("ours", "torchmetrics")


class _Holder(DistributedEvalMixin):
    """The mixin alone: what a LightningModule using it runs at epoch end, without a Trainer around it."""


def _local_batches(
    size: int, rank: int, batch_size: int, shuffle: bool = False
) -> tuple[list[Tensor], dict[str, list[Tensor]]]:
    """This rank's sample indices (DistributedSampler order) and per-field outputs, one tensor per step."""
    g = torch.Generator().manual_seed(0)  # values are a function of the sample index, so the repeat is consistent
    preds = torch.randint(0, NUM_CLASSES, (size,), generator=g)
    target = torch.randint(0, NUM_CLASSES, (size,), generator=g)
    scores = torch.randn(size, NUM_CLASSES, generator=g)
    sampler = DistributedSampler(range(size), num_replicas=WORLD_SIZE, rank=rank, shuffle=shuffle, seed=0)
    local = torch.tensor(list(sampler), dtype=torch.int64)
    indices = [chunk.clone() for chunk in local.split(batch_size)]
    fields = {
        "preds": [preds[i] for i in indices],
        "target": [target[i] for i in indices],
        "scores": [scores[i] for i in indices],
    }
    return indices, fields


def _run(
    path: str, holder: _Holder, indices: list[Tensor], fields: dict[str, list[Tensor]], size: int, on_start: Any = None
) -> tuple[dict[str, Tensor], float]:
    """One epoch-end gather by ``path``: (its result, seconds on this rank). ``on_start`` runs just before the clock."""
    if path == "ours":
        for step, index in enumerate(indices):  # what validation_step did, one call per batch (not timed)
            holder.add_eval_outputs(index, **{name: parts[step] for name, parts in fields.items()})
    dist.barrier()
    if on_start is not None:
        on_start()
    start = time.perf_counter()
    if path == "ours":
        out = holder.gather_eval_outputs(dataset_size=size)
    else:
        out = {
            name: torch.cat(gather_all_tensors(torch.cat(parts)))
            for name, parts in {**fields, "indices": indices}.items()
        }
    return out, time.perf_counter() - start


def _slowest(seconds: float) -> float:
    value = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(value, op=dist.ReduceOp.MAX)
    return float(value)


def _check(ours: dict[str, Tensor], theirs: dict[str, Tensor], size: int) -> None:
    """Both paths moved the same data; ours has each sample once, in index order."""
    assert torch.equal(ours["indices"], torch.arange(size)), "ours: not every sample exactly once"
    assert theirs["indices"].numel() == size + 1, "torchmetrics: expected the padding repeat to stay"
    order = torch.argsort(theirs["indices"], stable=True)
    keep = order[torch.cat([torch.tensor([True]), theirs["indices"][order][1:] != theirs["indices"][order][:-1]])]
    for name in ("preds", "target", "scores"):
        assert torch.equal(ours[name], theirs[name][keep]), f"{name}: the two paths disagree"


def _status_kib(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    raise KeyError(key)


def _init(rank: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(WORLD_SIZE))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE, timeout=timedelta(seconds=300))


def _time_rank(
    rank: int, port: int, sizes: list[int], repeats: int, batch_size: int, shuffle: bool, queue: Any
) -> None:
    _init(rank, port)
    holder = _Holder()
    report: dict[int, dict[str, list[float]]] = {}
    for size in sizes:
        indices, fields = _local_batches(size, rank, batch_size, shuffle)
        ours, _ = _run("ours", holder, indices, fields, size)  # warm-up, and the correctness check
        theirs, _ = _run("torchmetrics", holder, indices, fields, size)
        _check(ours, theirs, size)
        del ours, theirs
        times: dict[str, list[float]] = {path: [] for path in PATHS}
        for repeat in range(repeats):
            for path in PATHS if repeat % 2 == 0 else reversed(PATHS):
                out, seconds = _run(path, holder, indices, fields, size)
                del out
                times[path].append(_slowest(seconds))
        report[size] = times
    if rank == 0:
        queue.put(report)
    dist.destroy_process_group()


def _memory_rank(rank: int, port: int, size: int, path: str, batch_size: int, shuffle: bool, queue: Any) -> None:
    _init(rank, port)
    holder = _Holder()
    indices, fields = _local_batches(size, rank, batch_size, shuffle)
    out, _ = _run(path, holder, indices, fields, size)  # warm-up: one-time costs (gloo buffers, pickling) not counted
    del out
    gc.collect()
    before = 0

    def reset_peak() -> None:
        nonlocal before
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # VmHWM := the current VmRSS
        before = _status_kib("VmRSS")

    out, _ = _run(path, holder, indices, fields, size, on_start=reset_peak)
    peak = _status_kib("VmHWM")
    result_bytes = sum(t.numel() * t.element_size() for t in out.values())
    if rank == 0:
        queue.put(((peak - before) / 1024, result_bytes / 2**20))
    dist.destroy_process_group()


def _spawn(target: Any, *args: Any, env: dict[str, str] | None = None) -> Any:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    saved = {key: os.environ.get(key) for key in env or {}}
    os.environ.update(env or {})  # read by the children at start (glibc reads MALLOC_* once, at process start)
    try:
        queue = mp.get_context("spawn").Queue()
        mp.start_processes(target, args=(port, *args, queue), nprocs=WORLD_SIZE, start_method="spawn")
        return queue.get()
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[100_001, 1_000_001], help="total samples (odd)")
    parser.add_argument("--repeats", type=int, default=9, help="timed repeats of each path per size")
    parser.add_argument("--batch-size", type=int, default=256, help="samples per add_eval_outputs call")
    parser.add_argument("--shuffle", action="store_true", help="DistributedSampler(shuffle=True) instead of False")
    args = parser.parse_args()

    report = _spawn(_time_rank, args.sizes, args.repeats, args.batch_size, args.shuffle)
    memory = {
        (size, path): _spawn(
            _memory_rank, size, path, args.batch_size, args.shuffle, env={"MALLOC_MMAP_THRESHOLD_": "65536"}
        )
        for size in args.sizes
        for path in PATHS
    }

    print(
        f"End-of-epoch gather, 2 gloo CPU processes, fields preds/target (N,) int64, scores (N, {NUM_CLASSES}) float32,"
        f" indices (N,) int64; batch size {args.batch_size}; DistributedSampler(shuffle={args.shuffle});"
        f" median of {args.repeats} interleaved repeats."
    )
    print("ours INCLUDES the dedupe by sample index (N rows out); torchmetrics does not dedupe (N + 1 rows out).")
    print("peak = extra resident memory during the call on rank 0 (VmHWM - VmRSS before), result included.")
    header = (
        f"{'N':>9} | {'ours ms':>8} {'tm ms':>8} {'ratio':>6} | {'ours peak MiB':>13} {'tm peak MiB':>11}"
        f" | {'ours out MiB':>12} {'tm out MiB':>10}"
    )
    print(header)
    print("-" * len(header))
    worst = 0.0
    for size, times in report.items():
        ours, theirs = statistics.median(times["ours"]), statistics.median(times["torchmetrics"])
        worst = max(worst, ours / theirs)
        (ours_peak, ours_out), (tm_peak, tm_out) = memory[size, "ours"], memory[size, "torchmetrics"]
        print(
            f"{size:>9} | {1e3 * ours:8.2f} {1e3 * theirs:8.2f} {ours / theirs:6.3f}"
            f" | {ours_peak:13.1f} {tm_peak:11.1f} | {ours_out:12.1f} {tm_out:10.1f}"
        )
    print(f"ratio={worst:.3f}  (worst over sizes of time ours / torchmetrics; target <= 1.1)")


if __name__ == "__main__":
    main()
