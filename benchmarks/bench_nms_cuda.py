"""CUDA benchmark of lightning_balanced.ops.nms / batched_nms / batched_nms_padded against torchvision's CUDA kernel.

Anchors, each run in the same process on the same tensors:
  * ``tv``: ``torchvision.ops.nms`` / ``batched_nms`` on CUDA, when torchvision imports and has CUDA kernels, timed
    interleaved with ours. Its suppression mask takes ``N * ceil(N / 64) * 8`` bytes per ``nms`` call (on the GPU,
    then copied to the host); torchvision 0.29's ``batched_nms`` on CUDA runs one ``nms`` per class above 5000 boxes
    (20000 coordinates), over all boxes (coordinate trick) below. A row whose mask would exceed ``--tv-max-gib``
    (8 GiB), or half the free GPU memory, or that runs out of memory, prints ``oom/skipped`` and is left out of the
    worst ratio.
  * ``cpu``: our CPU kernel on the same tensors copied to the host (``nms(boxes.cpu(), scores.cpu(), ...)``); our
    CUDA kept indices must equal it exactly, in the same order (``exact=yes/NO``; float16 inputs are compared with
    the CPU result on the same float16 tensors). Its time (one call) is printed for reference.
``ours`` is the public ``lightning_balanced.ops`` function (argument checks included).

Workloads (boxes drawn in float32 on the CPU, then cast to the dtype and moved to the GPU; threshold ``--iou``, 0.5):
  * ``uniform``: sides 10-110 px, uniform positions on a canvas of side ``1000 * sqrt(N / 1000)`` (fixed density);
  * ``clustered``: detector-like, ``N / 50`` objects (sides 20-200 px, centres on a canvas of side
    ``1000 * sqrt(objects / 100)``), each with about 50 jittered proposals: many heavy overlaps;
  * ``mixed``: sides log-uniform in 2-200 px, width and height independent, at the density of 2M boxes on a
    20000 x 20000 canvas;
  * ``duplicates``: ``uniform`` boxes each repeated 4 times (shuffled), scores from 8 distinct values (ties).
float32 and float16 (at N = 1M the canvases reach 14000-32000 px, where float16 steps are 8-32 px: small boxes
collapse to zero width, which NMS always keeps); N = 100, 1k, 5k, 20k, 100k, 1M; ``nms`` and ``batched_nms`` (80
classes, ids random).

Timing: CUDA events around each call (after ``--warmup`` calls), medians of ``--repeats`` calls, ours and
torchvision's alternating; a row whose calls take long gets fewer repeats (at least 3; ``--row-budget``). Peak
memory of one call: ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``, minus the memory
allocated before the call (the output included).

The padded form: ``batched_nms_padded`` on B = 8 clustered images of N = 1000 boxes (80 classes, ``max_output``
100) against a Python loop of ``batched_nms`` per image (time; each image's row must equal the loop's result
truncated to 100, then ``-1``), then captured in a CUDA graph (warm-up on a side stream, ``torch.cuda.graph``),
replayed on two batches copied into its inputs, and each replay compared with the eager call.

Printed: a table per dtype and workload (``ratio`` = ours / torchvision), the padded lines, then
``mixed_1m_time_s=... mixed_1m_peak_gib=...`` (``nms``, float32, 1M ``mixed4000`` boxes, below) and, as the last line,
``worst_ratio_vs_torchvision_cuda=`` (the largest ratio over the rows where torchvision ran; ``n/a`` without
torchvision). The exit status is 1 if an exactness check failed (listed on a ``FAILED:`` line before the summary).

By default the script prints the goal table of issue #26 instead of the sweep (about a minute on an H100): each
row's cases (every workload, float32), ours beside torchvision and our CPU kernel, the worst case against the goal
(and the stretch goal), and ``PASS``/``FAIL``; 1M boxes are the issue's ``mixed`` case on a 4000 x 4000 canvas
(``mixed4000``), the padded row is ``batched_nms_padded`` on B = 64 clustered images of N = 5000 (80 classes,
``max_output`` 300), eager and captured in a CUDA graph. It ends with ``goal_table: K/6 rows pass``, the
``mixed_1m_time_s=`` line (from that 1M row) and the worst ratio. ``--full`` runs the sweep (every N up to 1M, every
workload, float32 and float16), ``--quick`` the sweep at N = 100, 1k, 20k, ``--sizes 1000,20000`` the sweep at those
N. ``--cost-model`` needs no GPU: the CPU emulation of what the CUDA ops run (``_nms_tiled``, with the kernels'
1024-row tiles and 8192 step-2 warps) prints, per case, the launches (torch's sorts counted as one each), the
critical path (serial steps of all launches one after another) and the longest serial loop of any thread or warp.

Run on a GPU machine from the repository root: ``python benchmarks/bench_nms_cuda.py``. Without a GPU it prints why
it skipped and exits 0.
``--device cpu`` runs the same code on the CPU as a smoke test (torchvision's CPU kernel as the anchor,
``perf_counter`` times, no memory figures, no graph capture); its last line is ``worst_ratio_vs_torchvision_cpu=``.
"""

from __future__ import annotations

import argparse
import functools
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import bench_cuda  # the same folder: the script runs with it on sys.path
import torch

from lightning_balanced.ops import batched_nms, batched_nms_padded, nms

Fn = Callable[[], object]
WORKLOADS = ("uniform", "clustered", "mixed", "duplicates")
DTYPES = {"float32": torch.float32, "float16": torch.float16}
CLASSES = 80


# --------------------------------------------------------------------------------------------------------------
# Workloads (float32, on the CPU)
# --------------------------------------------------------------------------------------------------------------


def uniform_boxes(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sides in [10, 110) px on a canvas of side ``1000 * sqrt(n / 1000)``."""
    side = 1000 * math.sqrt(n / 1000)
    xy = torch.rand(n, 2, generator=gen) * side
    wh = torch.rand(n, 2, generator=gen) * 100 + 10
    return torch.cat([xy, xy + wh], dim=1), torch.rand(n, generator=gen)


def clustered_boxes(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """About 50 jittered proposals around each of ``n / 50`` objects (sides 20-200 px)."""
    objects = max(1, n // 50)
    side = 1000 * math.sqrt(objects / 100)
    centers = torch.rand(objects, 2, generator=gen) * side
    sizes = torch.rand(objects, 2, generator=gen) * 180 + 20
    owner = torch.randint(0, objects, (n,), generator=gen)
    jitter = torch.randn(n, 4, generator=gen) * 0.12
    c = centers[owner] + jitter[:, :2] * sizes[owner]
    s = sizes[owner] * torch.exp(jitter[:, 2:])
    scores = (1 - jitter.abs().mean(dim=1)).clamp(min=0) * torch.rand(n, generator=gen).sqrt()
    return torch.cat([c - s / 2, c + s / 2], dim=1), scores


def mixed_boxes(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Sides log-uniform in [2, 200] px (width and height independent), density of 2M boxes on 20000 x 20000."""
    side = 20000 * math.sqrt(n / 2e6)
    xy = torch.rand(n, 2, generator=gen) * side
    wh = torch.exp(math.log(2) + torch.rand(n, 2, generator=gen) * math.log(100))
    return torch.cat([xy, xy + wh], dim=1), torch.rand(n, generator=gen)


def duplicate_boxes(n: int, gen: torch.Generator, copies: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """``uniform`` boxes each repeated ``copies`` times, shuffled; scores from 8 distinct values."""
    base, _ = uniform_boxes(-(-n // copies), gen)
    boxes = base.repeat_interleave(copies, dim=0)[:n]
    boxes = boxes[torch.randperm(n, generator=gen)]
    scores = torch.randint(1, 9, (n,), generator=gen).float() / 8
    return boxes, scores


MAKERS: dict[str, Callable[[int, torch.Generator], tuple[torch.Tensor, torch.Tensor]]] = {
    "uniform": uniform_boxes,
    "clustered": clustered_boxes,
    "mixed": mixed_boxes,
    "duplicates": duplicate_boxes,
}


def mixed4000_boxes(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The goal table's 1M case: sides log-uniform in [2, 200] px on a 4000 x 4000 canvas, whatever ``n``."""
    xy = torch.rand(n, 2, generator=gen) * 4000
    wh = torch.exp(math.log(2) + torch.rand(n, 2, generator=gen) * math.log(100))
    return torch.cat([xy, xy + wh], dim=1), torch.rand(n, generator=gen)


MAKERS["mixed4000"] = mixed4000_boxes


def workload(kind: str, n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Boxes, scores (float32) and class ids of one workload, on the CPU."""
    gen = torch.Generator().manual_seed(seed)
    boxes, scores = MAKERS[kind](n, gen)
    return boxes, scores, torch.randint(0, CLASSES, (n,), generator=gen)


# --------------------------------------------------------------------------------------------------------------
# Measuring
# --------------------------------------------------------------------------------------------------------------


class Clock(bench_cuda.Clock):
    """``bench_cuda.Clock`` (seconds of one call: CUDA events on a GPU, ``perf_counter`` elsewhere), plus the peak
    memory of one call on a GPU."""

    def __init__(self, device: torch.device) -> None:
        super().__init__(device)
        self.device = device

    def peak_bytes(self, fn: Fn) -> int | None:
        """Memory one call adds at its peak (its output included); ``None`` off the GPU."""
        if not self.cuda:
            return None
        torch.cuda.synchronize(self.device)
        base = torch.cuda.memory_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)
        out = fn()
        torch.cuda.synchronize(self.device)
        peak = torch.cuda.max_memory_allocated(self.device) - base
        del out
        return peak

    def sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)


def measure(clock: Clock, fns: dict[str, Fn], warmup: int, repeats: int, budget_s: float) -> dict[str, float]:
    """Median seconds per call of each function, calls alternating; fewer repeats (>= 3) when they are slow."""
    one_round = 0.0
    for fn in fns.values():
        for _ in range(max(0, warmup - 1)):
            fn()
        one_round += clock.time(fn)  # the last warm-up call, timed to size the repeats
    repeats = max(3, min(repeats, int(budget_s / max(one_round, 1e-9))))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            samples[name].append(clock.time(fn))
    return {name: statistics.median(values) for name, values in samples.items()}


def tv_mask_bytes(op: str, n: int, idxs: torch.Tensor) -> int:
    """Bytes of torchvision's largest suppression mask for this call (0.29: one ``nms`` per class above 5000 boxes)."""
    m = n
    if op == "batched_nms" and n * 4 > 20000:
        m = int(torch.bincount(idxs.cpu()).max())
    return m * ((m + 63) // 64) * 8


def _calls(
    op: str,
    boxes: torch.Tensor,
    scores: torch.Tensor,
    idxs: torch.Tensor,
    boxes_cpu: torch.Tensor,
    scores_cpu: torch.Tensor,
    idxs_cpu: torch.Tensor,
    thr: float,
    tv: ModuleType | None,
) -> tuple[Fn, Callable[[], torch.Tensor], Fn | None]:
    """(ours on the device, ours on the CPU copies, torchvision's on the device or ``None``) for ``op``."""
    if op == "nms":
        return (
            lambda: nms(boxes, scores, thr),
            lambda: nms(boxes_cpu, scores_cpu, thr),
            (lambda: tv.nms(boxes, scores, thr)) if tv is not None else None,
        )
    return (
        lambda: batched_nms(boxes, scores, idxs, thr),
        lambda: batched_nms(boxes_cpu, scores_cpu, idxs_cpu, thr),
        (lambda: tv.batched_nms(boxes, scores, idxs, thr)) if tv is not None else None,
    )


def _describe(err: BaseException) -> str:
    lines = str(err).splitlines()
    return f"{type(err).__name__}: {lines[0]}" if lines else type(err).__name__


def _fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.3f}"


def _fmt_mib(nbytes: int | None) -> str:
    return "-" if nbytes is None else f"{nbytes / 2**20:.1f}"


@dataclass
class Case:
    """One op on one workload: seconds per call (ours, torchvision's or ``None``, our CPU kernel's), peak bytes of
    one call on a GPU, and whether the kept indices equal the CPU kernel's (``exact``) and torchvision's."""

    kept: int
    ours_s: float
    tv_s: float | None
    tv_text: str  # torchvision's time in ms, "oom/skipped", or "-" (not run)
    cpu_s: float
    peak_ours: int | None
    peak_tv: int | None
    exact: bool
    tv_same: str  # "yes", "no" or "-"


class Bench:
    """Runs the table rows; keeps the worst ratio, the failures and the 1M mixed-size figures."""

    def __init__(self, args: argparse.Namespace, device: torch.device, tv: ModuleType | None) -> None:
        self.args = args
        self.device = device
        self.clock = Clock(device)
        self.tv = tv
        self.worst: float | None = None
        self.failures: list[str] = []
        self.mixed_1m: tuple[float, int | None] | None = None

    def header(self, kind: str, dtype: str) -> None:
        print(f"\n== {kind}, {dtype}, IoU {self.args.iou} ==", flush=True)
        print(
            f"{'op':<12}{'N':>9}{'kept':>9}{'ours ms':>11}{'tv ms':>13}{'ratio':>8}{'cpu ms':>11}"
            f"{'ours MiB':>10}{'tv MiB':>10}  exact  tv_same",
            flush=True,
        )

    def _tv_fits(self, op: str, n: int, idxs: torch.Tensor) -> bool:
        mask = tv_mask_bytes(op, n, idxs)
        if mask > self.args.tv_max_gib * 2**30:
            return False
        if self.clock.cuda:
            free, _ = torch.cuda.mem_get_info(self.device)
            return 2 * mask < free
        return True

    def _tv_first_call(self, anchor: Fn) -> str | None:
        """Call torchvision once: ``None`` if it ran, ``"oom"``; other errors turn torchvision off (``"error"``)."""
        try:
            anchor()
            self.clock.sync()
            return None
        except torch.cuda.OutOfMemoryError:
            torch.cuda.empty_cache()
            return "oom"
        except Exception as err:  # e.g. a CPU-only torchvision: no CUDA kernel
            print(f"torchvision failed ({_describe(err)}); timing ours only", flush=True)
            self.tv = None
            return "error"

    def case(
        self, op: str, label: str, boxes_cpu: torch.Tensor, scores_cpu: torch.Tensor, idxs_cpu: torch.Tensor
    ) -> Case | None:
        """``op`` on one workload: ours timed against torchvision's (when it fits), both peaks, our CPU kernel's
        time; our kept indices must equal the CPU kernel's. Records failures and the worst ratio; ``None`` when a
        call runs out of memory."""
        n = boxes_cpu.shape[0]
        boxes, scores, idxs = boxes_cpu.to(self.device), scores_cpu.to(self.device), idxs_cpu.to(self.device)
        ours, cpu, tv_fn = _calls(op, boxes, scores, idxs, boxes_cpu, scores_cpu, idxs_cpu, self.args.iou, self.tv)
        tv_status = None
        if tv_fn is not None:
            tv_status = None if self._tv_fits(op, n, idxs_cpu) else "skipped"
            tv_status = tv_status or self._tv_first_call(tv_fn)
        fns: dict[str, Fn] = {"ours": ours}
        if tv_fn is not None and tv_status is None:
            fns["tv"] = tv_fn
        try:
            times = measure(self.clock, fns, self.args.warmup, self.args.repeats, self.args.row_budget)
            peak_ours = self.clock.peak_bytes(ours)
            peak_tv = self.clock.peak_bytes(fns["tv"]) if "tv" in fns else None
            kept = ours()
        except torch.cuda.OutOfMemoryError as err:
            torch.cuda.empty_cache()
            self.failures.append(f"{label}: out of memory ({_describe(err)})")
            return None
        assert isinstance(kept, torch.Tensor)
        start = time.perf_counter()
        expected = cpu()
        t_cpu = time.perf_counter() - start
        kept_cpu = kept.cpu()
        exact = torch.equal(kept_cpu, expected)
        if not exact:
            self.failures.append(f"{label}: CUDA kept indices differ from the CPU kernel's")
        tv_same = "-"
        if "tv" in fns:
            tv_kept = fns["tv"]()
            assert isinstance(tv_kept, torch.Tensor)
            tv_kept = tv_kept.cpu()
            # batched_nms: torchvision orders tied scores of different classes in any order
            same = torch.equal(tv_kept, kept_cpu) if op == "nms" else set(tv_kept.tolist()) == set(kept_cpu.tolist())
            tv_same = "yes" if same else "no"
            ratio = times["ours"] / times["tv"]
            self.worst = ratio if self.worst is None else max(self.worst, ratio)
        tv_text = (
            _fmt_ms(times.get("tv")) if "tv" in fns else ("oom/skipped" if tv_status in ("oom", "skipped") else "-")
        )
        return Case(
            kept_cpu.numel(), times["ours"], times.get("tv"), tv_text, t_cpu, peak_ours, peak_tv, exact, tv_same
        )

    def row(self, kind: str, dtype_name: str, n: int) -> None:
        boxes32, scores32, idxs_cpu = workload(kind, n, seed=n + WORKLOADS.index(kind))
        dtype = DTYPES[dtype_name]
        boxes_cpu, scores_cpu = boxes32.to(dtype), scores32.to(dtype)
        for op in ("nms", "batched_nms"):
            case = self.case(op, f"{op} {kind} {dtype_name} N={n}", boxes_cpu, scores_cpu, idxs_cpu)
            if case is None:
                print(f"{op:<12}{n:>9}  out of memory (ours, or torchvision after its first call)", flush=True)
                continue
            ratio_text = "-" if case.tv_s is None else f"{case.ours_s / case.tv_s:.3f}"
            print(
                f"{op:<12}{n:>9}{case.kept:>9}{_fmt_ms(case.ours_s):>11}{case.tv_text:>13}{ratio_text:>8}"
                f"{_fmt_ms(case.cpu_s):>11}{_fmt_mib(case.peak_ours):>10}{_fmt_mib(case.peak_tv):>10}  "
                f"{'yes' if case.exact else 'NO':<5}  {case.tv_same}",
                flush=True,
            )

    def measure_mixed_1m(self) -> tuple[float, int | None]:
        """``nms`` on the goal table's 1M float32 mixed-size boxes (when the table did not include them)."""
        if self.mixed_1m is not None:
            return self.mixed_1m
        boxes, scores, _ = workload("mixed4000", 1_000_000, seed=1_000_000 + 7)
        boxes, scores = boxes.to(self.device), scores.to(self.device)
        thr = self.args.iou

        def ours() -> torch.Tensor:
            return nms(boxes, scores, thr)

        seconds = measure(self.clock, {"ours": ours}, self.args.warmup, self.args.repeats, self.args.row_budget)
        return seconds["ours"], self.clock.peak_bytes(ours)


# --------------------------------------------------------------------------------------------------------------
# The padded form and its CUDA graph
# --------------------------------------------------------------------------------------------------------------


def _padded_batch(
    batch: int, n: int, dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    images = [workload("clustered", n, seed=seed + b) for b in range(batch)]
    boxes = torch.stack([b for b, _, _ in images]).to(dtype)
    scores = torch.stack([s for _, s, _ in images]).to(dtype)
    idxs = torch.stack([i for _, _, i in images])
    return boxes.to(device), scores.to(device), idxs.to(device)


def _padded_matches_loop(
    keep: torch.Tensor, num_kept: torch.Tensor, per_image: list[torch.Tensor], max_output: int
) -> bool:
    keep, num_kept = keep.cpu(), num_kept.cpu()
    for b, kept in enumerate(per_image):
        expected = kept.cpu()[:max_output]
        k = expected.numel()
        if int(num_kept[b]) != k or not torch.equal(keep[b, :k], expected) or bool((keep[b, k:] != -1).any()):
            return False
    return True


def bench_padded(
    bench: Bench, batch: int = 8, n: int = 1000, max_output: int = 100, goal_ms: float | None = None
) -> bool:
    """Print ``batched_nms_padded`` against a loop of ``batched_nms``, and its CUDA graph's replay; with ``goal_ms``,
    the goal row's verdict (eager time within the goal, exact, captured, replay equal to eager). Returns it."""
    device, clock, thr = bench.device, bench.clock, bench.args.iou
    boxes, scores, idxs = _padded_batch(batch, n, torch.float32, device, seed=2024)

    def padded() -> tuple[torch.Tensor, torch.Tensor]:
        return batched_nms_padded(boxes, scores, idxs, thr, max_output)

    def loop() -> list[torch.Tensor]:
        return [batched_nms(boxes[b], scores[b], idxs[b], thr) for b in range(batch)]

    times = measure(clock, {"padded": padded, "loop": loop}, bench.args.warmup, bench.args.repeats, 2.0)
    same = _padded_matches_loop(*padded(), loop(), max_output)
    if not same:
        bench.failures.append("batched_nms_padded differs from the loop of batched_nms")
    print(
        f"\npadded: batched_nms_padded B={batch} N={n} max_output={max_output} (clustered, float32, {CLASSES} classes) "
        f"{_fmt_ms(times['padded'])} ms, loop of batched_nms {_fmt_ms(times['loop'])} ms, "
        f"ratio {times['padded'] / times['loop']:.3f}, exact={'yes' if same else 'NO'}",
        flush=True,
    )
    graph_same = False
    if not clock.cuda:
        print("padded_graph: skipped (no CUDA graphs off the GPU)", flush=True)
        return _padded_verdict(goal_ms, times["padded"], same and graph_same)
    try:
        graph_same, replay_s = _graph_replay(bench, boxes, scores, idxs, max_output)
    except Exception as err:
        bench.failures.append(f"CUDA graph capture of batched_nms_padded failed ({type(err).__name__})")
        print(f"padded_graph: capture FAILED ({_describe(err)})", flush=True)
        return _padded_verdict(goal_ms, times["padded"], False)
    if not graph_same:
        bench.failures.append("the CUDA graph's replay of batched_nms_padded differs from the eager call")
    print(
        f"padded_graph: captured, replayed on 2 new batches, equal to eager={'yes' if graph_same else 'NO'}; "
        f"replay {_fmt_ms(replay_s)} ms vs eager {_fmt_ms(times['padded'])} ms",
        flush=True,
    )
    return _padded_verdict(goal_ms, times["padded"], same and graph_same)


def _padded_verdict(goal_ms: float | None, seconds: float, correct: bool) -> bool:
    if goal_ms is None:
        return correct
    passed = correct and seconds * 1e3 <= goal_ms
    print(
        f"GOAL batched_nms_padded B=64 N=5000: {seconds * 1e3:.3f} ms (goal <= {goal_ms:g}, stretch 0.5), exact and "
        f"captured in a CUDA graph: {'yes' if correct else 'NO'}: {'PASS' if passed else 'FAIL'}",
        flush=True,
    )
    return passed


def _graph_replay(
    bench: Bench, boxes: torch.Tensor, scores: torch.Tensor, idxs: torch.Tensor, max_output: int
) -> tuple[bool, float]:
    """Capture ``batched_nms_padded`` on static inputs; replay it on new batches; (equal to eager, replay seconds)."""
    device, thr = bench.device, bench.args.iou
    static_boxes, static_scores, static_idxs = boxes.clone(), scores.clone(), idxs.clone()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):  # warm-up on a side stream before capture, as torch's docs ask
        for _ in range(3):
            batched_nms_padded(static_boxes, static_scores, static_idxs, thr, max_output)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_keep, static_num = batched_nms_padded(static_boxes, static_scores, static_idxs, thr, max_output)
    same = True
    for seed in (3033, 4044):
        new_boxes, new_scores, new_idxs = _padded_batch(boxes.shape[0], boxes.shape[1], boxes.dtype, device, seed)
        static_boxes.copy_(new_boxes)
        static_scores.copy_(new_scores)
        static_idxs.copy_(new_idxs)
        graph.replay()
        torch.cuda.synchronize(device)
        keep, num_kept = batched_nms_padded(new_boxes, new_scores, new_idxs, thr, max_output)
        same = same and torch.equal(static_keep, keep) and torch.equal(static_num, num_kept)
    replay = measure(bench.clock, {"replay": graph.replay}, bench.args.warmup, bench.args.repeats, 2.0)
    return same, replay["replay"]


# --------------------------------------------------------------------------------------------------------------
# The goal table (issue #26) and the cost model
# --------------------------------------------------------------------------------------------------------------

# (row, op, N, workloads, goal ms, stretch ms, goal MiB of peak memory or None)
GOALS = [
    ("nms 1k", "nms", 1000, WORKLOADS, 0.10, 0.05, None),
    ("nms 20k", "nms", 20_000, WORKLOADS, 1.0, 0.3, None),
    ("nms 100k", "nms", 100_000, WORKLOADS, 5.0, 1.0, 32.0),
    ("nms 1M mixed", "nms", 1_000_000, ("mixed4000",), 30.0, 10.0, 256.0),
    ("batched_nms 100k", "batched_nms", 100_000, WORKLOADS, 3.0, 1.0, None),
]


def goal_row(
    bench: Bench, row: str, op: str, n: int, kinds: tuple[str, ...], goal: float, stretch: float, goal_mib: float | None
) -> bool:
    """One row of the goal table: every workload timed (ours, torchvision, our CPU kernel), the worst against the
    goal; exactness against the CPU kernel is required."""
    worst_ms, worst_mib, exact = 0.0, 0, True
    for kind in kinds:
        boxes_cpu, scores_cpu, idxs_cpu = workload(kind, n, seed=n + 7)
        case = bench.case(op, f"{row} {kind}", boxes_cpu, scores_cpu, idxs_cpu)
        if case is None:
            print(f"  {row:<18}{kind:<12}out of memory", flush=True)
            exact = False
            continue
        exact = exact and case.exact
        if op == "nms" and n == 1_000_000:
            bench.mixed_1m = (case.ours_s, case.peak_ours)
        worst_ms = max(worst_ms, case.ours_s * 1e3)
        worst_mib = max(worst_mib, case.peak_ours or 0)
        print(
            f"  {row:<18}{kind:<12}ours {_fmt_ms(case.ours_s)} ms  tv {case.tv_text} ms  cpu {_fmt_ms(case.cpu_s)} ms"
            f"  peak {_fmt_mib(case.peak_ours)} MiB  exact={'yes' if case.exact else 'NO'}  tv_same={case.tv_same}",
            flush=True,
        )
    memory_ok = goal_mib is None or not bench.clock.cuda or worst_mib / 2**20 <= goal_mib
    passed = exact and worst_ms <= goal and memory_ok
    memory = (
        "" if goal_mib is None or not bench.clock.cuda else f", peak {worst_mib / 2**20:.1f} MiB (goal <= {goal_mib:g})"
    )
    print(
        f"GOAL {row}: worst {worst_ms:.3f} ms (goal <= {goal:g}, stretch {stretch:g}){memory}: "
        f"{'PASS' if passed else 'FAIL'}{'' if worst_ms > stretch or not passed else ' (stretch met)'}",
        flush=True,
    )
    return passed


def goal_table(bench: Bench) -> int:
    """Runs every goal row and the padded row, then the A/B of the chain and of the single launch; returns how many
    rows pass."""
    passed = sum(goal_row(bench, *goal) for goal in GOALS)
    print("  (padded row)", flush=True)
    passed += bench_padded(bench, batch=64, n=5000, max_output=300, goal_ms=2.0)
    print(f"goal_table: {passed}/{len(GOALS) + 1} rows pass", flush=True)
    chain_ab(bench)
    small_ab(bench)
    return passed


#: The opt-in switch of the CUDA ops' persistent chain (csrc/ops/cuda/nms_kernel.cu), read at each call.
CHAIN_SWITCH = "LIGHTNING_BALANCED_NMS_CHAIN"
#: The single-launch path's limit in boxes per image (same file; 0 turns it off), read at each call.
SMALL_ROWS_SWITCH = "LIGHTNING_BALANCED_NMS_SMALL_ROWS"


def switch_ab(
    bench: Bench, label: str, switch: str, settings: dict[str, str], cases: list[tuple[str, int, str]]
) -> float | None:
    """Each case (op, N, workload) timed under both ``settings`` of the environment variable ``switch`` (name ->
    value, the first the default path) in the same run, calls alternating: one ``{label}`` line per case, with the
    second's time over the first's, and the geometric mean of those ratios (returned). Both must keep the CPU
    kernel's indices."""
    if not bench.clock.cuda:
        print(f"{label}: skipped (no GPU)", flush=True)
        return None
    (first, _), (second, _) = settings.items()
    previous = os.environ.get(switch)

    def under(value: str, call: Callable[[], torch.Tensor]) -> Callable[[], torch.Tensor]:
        def timed() -> torch.Tensor:
            os.environ[switch] = value
            return call()

        return timed

    ratios = []
    try:
        for op, n, kind in cases:
            boxes_cpu, scores_cpu, idxs_cpu = workload(kind, n, seed=n + 7)
            device = bench.clock.device
            boxes, scores, idxs = boxes_cpu.to(device), scores_cpu.to(device), idxs_cpu.to(device)
            if op == "nms":
                expected = nms(boxes_cpu, scores_cpu, bench.args.iou)
                call: Callable[[], torch.Tensor] = functools.partial(nms, boxes, scores, bench.args.iou)
            else:
                expected = batched_nms(boxes_cpu, scores_cpu, idxs_cpu, bench.args.iou)
                call = functools.partial(batched_nms, boxes, scores, idxs, bench.args.iou)
            calls = {name: under(value, call) for name, value in settings.items()}
            exact = all(torch.equal(fn().cpu(), expected) for fn in calls.values())
            fns: dict[str, Fn] = dict(calls)
            times = measure(bench.clock, fns, bench.args.warmup, bench.args.repeats, bench.args.row_budget)
            ratios.append(times[second] / times[first])
            print(
                f"{label} {op} {n} {kind}: {first} {_fmt_ms(times[first])} ms, {second} {_fmt_ms(times[second])} ms,"
                f" {second}/{first} {ratios[-1]:.3f}, exact={'yes' if exact else 'NO'}",
                flush=True,
            )
            if not exact:
                bench.failures.append(f"{label} {op} {n} {kind}: not the CPU kernel's indices")
    finally:
        if previous is None:
            os.environ.pop(switch, None)
        else:
            os.environ[switch] = previous
    return math.exp(sum(map(math.log, ratios)) / len(ratios))


def chain_ab(bench: Bench) -> float | None:
    """``nms`` above the single-launch path with the per-tile launches (the default) and with the persistent chain
    (opted in): ``chain_ab`` lines and ``chain_over_per_tile`` (below 1: the chain is faster)."""
    cases = [("nms", 20_000, "uniform"), ("nms", 100_000, "clustered"), ("nms", 1_000_000, "mixed4000")]
    geomean = switch_ab(bench, "chain_ab", CHAIN_SWITCH, {"per_tile": "0", "chain": "1"}, cases)
    if geomean is not None:
        print(f"chain_over_per_tile={geomean:.3f} (below 1: the persistent chain is faster)", flush=True)
    return geomean


def small_ab(bench: Bench) -> float | None:
    """The single launch (the default up to 4096 boxes) against the tiles (its limit set to 0) from 1k to 4k boxes,
    where it has not been timed above 2k: ``small_ab`` lines and ``tiles_over_single`` (above 1: the single launch
    is faster). A case where the tiles win says where its limit should be."""
    cases = [(op, n, kind) for n in (1000, 2000, 3000, 4000) for kind in ("uniform", "mixed") for op in ("nms",)]
    cases += [("batched_nms", 4000, "uniform")]
    geomean = switch_ab(bench, "small_ab", SMALL_ROWS_SWITCH, {"single": "4096", "tiles": "0"}, cases)
    if geomean is not None:
        print(f"tiles_over_single={geomean:.3f} (above 1: the single launch is faster)", flush=True)
    return geomean


def cost_model() -> None:
    """The CPU emulation's cost model of what the CUDA ``nms`` / ``batched_nms`` run (``_nms_tiled``), IoU 0.5: per
    call, the kernels launched (torch's own sorts and gathers not included), the host-side torch ops (allocations,
    sorts, gathers, the read of the kept count), the critical path (serial steps of the launches, one after another;
    the persistent chain's phases and grid barriers included) and the longest loop of one launch, for the persistent
    chain (opt-in on a GPU: ``LIGHTNING_BALANCED_NMS_CHAIN=1``); last, the launches and critical path of the per-tile
    launches (the GPU's default above the single-launch path)."""
    emulation = torch.ops.lightning_balanced._nms_tiled
    torch_op = 2  # the kind of a host-side torch op's row (csrc/ops/cpu/nms_tiled_schedule.cpp)
    print(
        f"{'case':<34}{'launches':>9}{'host ops':>9}{'critical path':>15}{'longest loop':>14}{'kept':>9}"
        f"{'per-tile launches':>19}{'per-tile path':>15}",
        flush=True,
    )
    cases = [(n, kind) for n in (1000, 20_000, 100_000) for kind in WORKLOADS] + [(1_000_000, "mixed4000")]
    for n, kind in cases:
        boxes, scores, idxs = workload(kind, n, seed=n + 7)
        for op in ("nms", "batched_nms") if n in (1000, 100_000) else ("nms",):
            classes = idxs if op == "batched_nms" else None
            keep, steps = emulation(boxes, scores, classes, 0.5, 0)
            _, per_tile = emulation(boxes, scores, classes, 0.5, 0, 1024, 8192, 4096, False)
            kinds, depth = steps[:, 0], steps[:, 2]
            print(
                f"{op + ' ' + kind + ' ' + str(n):<34}{int((kinds != torch_op).sum()):>9}"
                f"{int((kinds == torch_op).sum()):>9}{int(depth.sum()):>15}{int(depth.max()):>14}{keep.numel():>9}"
                f"{int((per_tile[:, 0] != torch_op).sum()):>19}{int(per_tile[:, 2].sum()):>15}",
                flush=True,
            )


# --------------------------------------------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------------------------------------------


def _import_torchvision() -> ModuleType | None:
    try:
        import torchvision.ops

        return torchvision.ops
    except Exception as err:  # missing, or built for another torch
        print(f"torchvision does not import ({type(err).__name__}: {err}); timing ours only", flush=True)
        return None


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--full", action="store_true", help="the sweep: every N up to 1M, every workload and dtype")
    parser.add_argument("--cost-model", action="store_true", help="the CPU emulation's cost model (no GPU needed)")
    parser.add_argument("--quick", action="store_true", help="the sweep at N = 100, 1k, 20k, fewer repeats")
    parser.add_argument("--sizes", type=str, default=None, help="comma-separated N (default 100,...,1000000)")
    parser.add_argument("--workloads", type=str, default=",".join(WORKLOADS), help="comma-separated workloads")
    parser.add_argument("--iou", type=float, default=0.5, help="IoU threshold")
    parser.add_argument("--repeats", type=int, default=None, help="timed calls per function (15; --quick 5)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed calls before timing")
    parser.add_argument("--row-budget", type=float, default=None, help="seconds of timed calls per row (3; goals 0.5)")
    parser.add_argument("--tv-max-gib", type=float, default=8.0, help="skip torchvision above this mask size")
    parser.add_argument("--device", default="cuda", help=argparse.SUPPRESS)  # cpu: a smoke run without a GPU
    args = parser.parse_args()
    if args.cost_model:
        cost_model()
        return 0
    sweep = args.full or args.quick or args.sizes is not None
    args.row_budget = args.row_budget or (3.0 if sweep else 0.5)
    if args.sizes:
        sizes = [int(s) for s in args.sizes.split(",")]
    else:
        sizes = [100, 1000, 20000] if args.quick else [100, 1000, 5000, 20000, 100_000, 1_000_000]
    args.repeats = args.repeats or (15 if args.full else 5)
    workloads = [w for w in args.workloads.split(",") if w]
    for name in workloads:
        if name not in MAKERS:
            parser.error(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")

    device = torch.device(args.device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            print(
                f"bench_nms_cuda: skipped, no CUDA GPU visible to torch {torch.__version__} (CUDA "
                f"{torch.version.cuda}); run it on a GPU machine (a CPU smoke run: --device cpu)",
                flush=True,
            )
            return 0
        device = torch.device("cuda", torch.cuda.current_device())
        print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, CUDA {torch.version.cuda}", flush=True)
    else:
        print(f"smoke run on {device}, torch {torch.__version__}: CPU kernels, perf_counter times", flush=True)
    tv = _import_torchvision()
    if tv is not None:
        print(f"torchvision {sys.modules['torchvision'].__version__}", flush=True)

    bench = Bench(args, device, tv)
    if not sweep:
        if device.type != "cuda":
            print("(the goals are for one H100; on the CPU this is a smoke run of the table)", flush=True)
        goal_table(bench)
    else:
        for dtype_name in DTYPES:
            for kind in workloads:
                bench.header(kind, dtype_name)
                for n in sizes:
                    bench.row(kind, dtype_name, n)
        bench_padded(bench)
    seconds, peak = bench.measure_mixed_1m()
    if bench.failures:
        print("FAILED: " + "; ".join(bench.failures), flush=True)
    peak_text = "n/a" if peak is None else f"{peak / 2**30:.4f}"
    print(f"mixed_1m_time_s={seconds:.5f} mixed_1m_peak_gib={peak_text} (nms, float32, IoU {args.iou})", flush=True)
    worst = "n/a" if bench.worst is None else f"{bench.worst:.3f}"
    print(f"worst_ratio_vs_torchvision_{device.type}={worst}", flush=True)
    return 1 if bench.failures else 0


if __name__ == "__main__":
    sys.exit(main())
