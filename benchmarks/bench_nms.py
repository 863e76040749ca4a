"""CPU benchmark of lightning_balanced.ops.nms / batched_nms against the greedy kernel, torchvision and OpenCV.

Anchors, each timed in the same run on the same inputs:
  * ``greedy``: the textbook loop of torchvision's CPU ``nms`` (stable sort, then each kept box suppresses the later
    ones via a flag), in ``benchmarks/tv_equivalent_nms.cpp``, compiled here with ``-O3``; for batched workloads,
    torchvision's ``batched_nms`` logic on top of it (coordinate-offset trick for ``N * 4 <= 4000``, one ``nms``
    per class otherwise). It is quadratic, so on large inputs it runs under a time budget (``--greedy-budget``):
    a run over budget is printed as ``>budget`` and its ratio as ``<ours/budget``.
  * ``tv``: real ``torchvision.ops.nms`` / ``batched_nms``, when torchvision imports (up to ``--anchor-max-n``).
  * ``cv2``: OpenCV's ``cv2.dnn.NMSBoxes`` (boxes as ``(x, y, w, h)``; score threshold 0, which OpenCV 5 requires
    to be >= 0 and which keeps every box here), when installed (up to ``--anchor-max-n``); ``NMSBoxesBatched`` for
    batched workloads. Its IoU convention differs, so only its time is compared.
  * ``ref``: the pure-PyTorch reference (``lightning_balanced.ops.nms_reference``), i.e. the fallback; ``match``
    says whether our output equals it (N <= ``--ref-max-n``), or else equals the greedy kernel's (``yes(g)``, or
    ``set(g)``: the same set, ordered differently among tied scores by torchvision's unstable per-class merge).
``ours`` is the public ``lightning_balanced.ops.nms`` / ``batched_nms`` (argument checks included).

Two tables:
  1. ``uniform``/``clustered`` boxes at N = 1 ... 20000, 1 or 80 classes, thresholds 0.5 and 0.7;
  2. mixed box sizes at the density of 2M boxes on a 20000 x 20000 canvas (N boxes on a canvas of side
     ``20000 * sqrt(N / 2e6)``): ``fixed`` 15 x 15 px, ``uniform`` sides in [5, 25] px, ``logu`` sides log-uniform
     in [2, 200] px (width and height drawn independently, so also long thin boxes), ``fewlarge`` 5-25 px boxes
     with 0.1% of 500-2000 px boxes; N = 20k, 400k, 2M; 1 and 80 classes; threshold 0.5. It prints the
     mixed/fixed time ratio per N and class count (target at 400k: <= 3).

Run: ``python benchmarks/bench_nms.py`` (single thread); ``--quick`` for a smoke run. The last lines are
``worst_ratio_small_n=`` and ``worst_ratio=`` (ours / greedy, N < 1000 and N >= 1000, over both tables; greedy
over budget counts as the budget), ``worst_ratio_vs_torchvision=`` and ``worst_ratio_vs_opencv=``.
"""

from __future__ import annotations

import argparse
import importlib
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import torch
from torch.utils.cpp_extension import load

from lightning_balanced.ops import batched_nms, has_compiled_ops, nms, nms_reference
from lightning_balanced.ops.nms_reference import batched_nms_reference

HERE = Path(__file__).resolve().parent
Fn = Callable[[], torch.Tensor]


def _optional(name: str) -> ModuleType | None:
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def load_greedy() -> Callable[..., torch.Tensor]:
    load(
        name="tv_equivalent_nms",
        sources=[str(HERE / "tv_equivalent_nms.cpp")],
        extra_cflags=["-O3"],
        is_python_module=False,
        verbose=False,
    )
    return torch.ops.tv_equivalent.nms


# --------------------------------------------------------------------------------------------------------------
# Workloads
# --------------------------------------------------------------------------------------------------------------


def uniform_boxes(n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Boxes anywhere in a 1000 x 1000 image, sides in [10, 110)."""
    xy = torch.rand(n, 2, generator=gen) * 1000
    wh = torch.rand(n, 2, generator=gen) * 100 + 10
    return torch.cat([xy, xy + wh], dim=1), torch.rand(n, generator=gen)


def clustered_boxes(n: int, gen: torch.Generator, objects: int = 100) -> tuple[torch.Tensor, torch.Tensor]:
    """Detector-like proposals: ``objects`` ground-truth boxes, each with jittered proposals around it."""
    centers = torch.rand(objects, 2, generator=gen) * 1000
    sizes = torch.rand(objects, 2, generator=gen) * 180 + 20
    owner = torch.randint(0, objects, (n,), generator=gen)
    jitter = torch.randn(n, 4, generator=gen) * 0.12
    c = centers[owner] + jitter[:, :2] * sizes[owner]
    s = sizes[owner] * torch.exp(jitter[:, 2:])
    boxes = torch.cat([c - s / 2, c + s / 2], dim=1)
    scores = (1 - jitter.abs().mean(dim=1)).clamp(min=0) * torch.rand(n, generator=gen).sqrt()
    return boxes, scores


def mixed_size_boxes(kind: str, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``n`` boxes at the density of 2M boxes on a 20000 x 20000 canvas; sides as named by ``kind``."""
    side = 20000 * math.sqrt(n / 2e6)
    xy = torch.rand(n, 2, generator=gen) * side
    if kind == "fixed":
        wh = torch.full((n, 2), 15.0)
    elif kind == "uniform":
        wh = torch.rand(n, 2, generator=gen) * 20 + 5
    elif kind == "logu":
        wh = torch.exp(math.log(2) + torch.rand(n, 2, generator=gen) * math.log(100))
    elif kind == "fewlarge":
        wh = torch.rand(n, 2, generator=gen) * 20 + 5
        large = torch.rand(n, generator=gen) < 0.001
        wh[large] = torch.rand(int(large.sum()), 2, generator=gen) * 1500 + 500
    else:
        raise ValueError(kind)
    return torch.cat([xy, xy + wh], dim=1), torch.rand(n, generator=gen)


def offset_boxes(boxes: torch.Tensor, idxs: torch.Tensor) -> torch.Tensor:
    if boxes.numel() == 0:
        return boxes
    offsets = idxs.to(boxes) * (boxes.max() + 1)
    return boxes + offsets[:, None]


def greedy_batched(greedy: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """torchvision's batched_nms logic on top of the greedy kernel (budget shared by the classes)."""

    def run(boxes: torch.Tensor, scores: torch.Tensor, idxs: torch.Tensor, thr: float, budget: float) -> torch.Tensor:
        if boxes.numel() > 4000:
            t0 = time.perf_counter()
            keep_mask = torch.zeros_like(scores, dtype=torch.bool)
            for class_id in torch.unique(idxs):
                left = budget - (time.perf_counter() - t0) if budget > 0 else 0.0
                if budget > 0 and left <= 0:
                    return torch.empty(0, dtype=torch.int64)
                curr = torch.where(idxs == class_id)[0]
                kept = greedy(boxes[curr], scores[curr], thr, left)
                if kept.numel() == 0:
                    return kept
                keep_mask[curr[kept]] = True
            keep = torch.where(keep_mask)[0]
            return keep[scores[keep].sort(descending=True)[1]]
        return greedy(offset_boxes(boxes, idxs), scores, thr, budget)

    return run


def cv2_nms(cv2: ModuleType, boxes: torch.Tensor, scores: torch.Tensor, idxs: torch.Tensor | None, thr: float) -> Fn:
    """OpenCV's NMSBoxes (per class when ``idxs`` is given), inputs converted once outside the timing."""
    xywh = torch.cat([boxes[:, :2], boxes[:, 2:] - boxes[:, :2]], dim=1).double().numpy()
    sc = scores.double().numpy()
    if idxs is None:
        return lambda: torch.as_tensor(cv2.dnn.NMSBoxes(xywh, sc, 0.0, thr))
    return lambda: torch.as_tensor(cv2.dnn.NMSBoxesBatched(xywh, sc, idxs.numpy(), 0.0, thr))


# --------------------------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------------------------


def measure(fns: dict[str, Fn], repeats: int, budget_s: float) -> dict[str, float]:
    """Median seconds per call of each function, over interleaved repeats."""
    loops: dict[str, int] = {}
    for name, fn in fns.items():
        fn()  # warm-up
        t0 = time.perf_counter()
        fn()
        dt = max(time.perf_counter() - t0, 1e-7)
        loops[name] = max(1, min(10_000, int(budget_s / dt)))
    samples: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            t0 = time.perf_counter()
            for _ in range(loops[name]):
                fn()
            samples[name].append((time.perf_counter() - t0) / loops[name])
    return {name: statistics.median(v) for name, v in samples.items()}


def once(fn: Fn) -> tuple[float, torch.Tensor]:
    t0 = time.perf_counter()
    out = fn()
    return time.perf_counter() - t0, out


class Bench:
    """Times one workload at a time against every available anchor and keeps the worst ratios."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.greedy = load_greedy()
        self.greedy_batched = greedy_batched(self.greedy)
        self.tv = _optional("torchvision")
        self.cv2 = _optional("cv2") if args.opencv else None
        self.worst: dict[str, float] = {"small": 0.0, "large": 0.0, "tv": 0.0, "cv2": 0.0}

    def header(self) -> None:
        cols = ["workload", "N", "thr", "cls", "kept", "ours ms", "greedy ms", "/greedy", "tv ms", "/tv", "cv2 ms"]
        widths = [10, 8, 5, 4, 8, 10, 11, 8, 10, 7, 10]
        line = "".join(
            f"{c:<{w}}" if i == 0 else f"{c:>{w}}" for i, (c, w) in enumerate(zip(cols, widths, strict=True))
        )
        line += f"{'/cv2':>7}{'ref ms':>10}  match"
        print(line)
        print("-" * len(line), flush=True)

    def run(
        self, name: str, boxes: torch.Tensor, scores: torch.Tensor, classes: int, thr: float, gen: torch.Generator
    ) -> float:
        """Time one workload, print its row, return our time in seconds."""
        a = self.args
        n = boxes.shape[0]
        idxs = torch.randint(0, classes, (n,), generator=gen)
        big = n >= a.single_run_from
        budget = a.greedy_budget if big else 0.0
        ours: Fn
        anchors: dict[str, Fn] = {}
        if classes == 1:
            ours = lambda: nms(boxes, scores, thr)  # noqa: E731
            greedy: Fn = lambda: self.greedy(boxes, scores, thr, budget)  # noqa: E731
            ref: Fn = lambda: nms_reference(boxes, scores, thr)  # noqa: E731
            if self.tv is not None:
                anchors["tv"] = lambda: self.tv.ops.nms(boxes, scores, thr)  # type: ignore[union-attr]
            if self.cv2 is not None:
                anchors["cv2"] = cv2_nms(self.cv2, boxes, scores, None, thr)
        else:
            ours = lambda: batched_nms(boxes, scores, idxs, thr)  # noqa: E731
            greedy = lambda: self.greedy_batched(boxes, scores, idxs, thr, budget)  # noqa: E731
            ref = lambda: batched_nms_reference(boxes, scores, idxs, thr)  # noqa: E731
            if self.tv is not None:
                anchors["tv"] = lambda: self.tv.ops.batched_nms(boxes, scores, idxs, thr)  # type: ignore[union-attr]
            if self.cv2 is not None:
                anchors["cv2"] = cv2_nms(self.cv2, boxes, scores, idxs, thr)
        if n > a.anchor_max_n:
            anchors = {}
        if big:  # single runs: seconds each
            t_ours, out = once(ours)
            t_greedy, greedy_out = once(greedy)
            over = greedy_out.numel() == 0
            times = {"ours": t_ours, "greedy": max(t_greedy, budget) if over else t_greedy}
            times.update({k: once(f)[0] for k, f in anchors.items()})
        else:
            times = measure({"ours": ours, "greedy": greedy, **anchors}, a.repeats, budget_s=0.004)
            out, over = ours(), False
        ref_ms, match = float("nan"), "-"
        if a.ref and n <= a.ref_max_n:
            t_ref, ref_out = once(ref)
            ref_ms, match = t_ref * 1e3, ("yes" if torch.equal(out, ref_out) else "NO")
        elif big and not over:  # the greedy kernel's output instead: same set; same order up to tied scores
            same_set = torch.equal(torch.sort(out).values, torch.sort(greedy_out).values)
            match = "yes(g)" if torch.equal(out, greedy_out) else ("set(g)" if same_set else "NO(g)")
        ratio = times["ours"] / times["greedy"]
        self.worst["large" if n >= 1000 else "small"] = max(self.worst["large" if n >= 1000 else "small"], ratio)
        cells = [
            f"{name:<10}{n:>8}{thr:>5}{classes:>4}{out.numel():>8}{times['ours'] * 1e3:10.2f}",
            f"{'>' if over else ''}{times['greedy'] * 1e3:.2f}".rjust(11),
            f"{'<' if over else ''}{ratio:.3f}".rjust(8),
        ]
        for key, width in (("tv", 10), ("cv2", 10)):
            if key in times:
                r = times["ours"] / times[key]
                self.worst[key] = max(self.worst[key], r)
                cells.append(f"{times[key] * 1e3:{width}.2f}{r:7.3f}")
            else:
                cells.append(f"{'-':>{width}}{'-':>7}")
        cells.append(f"{ref_ms:10.2f}  {match}")
        print("".join(cells), flush=True)
        return times["ours"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved repeats per workload (median)")
    parser.add_argument("--sizes", type=str, default="1,10,100,500,1000,5000,20000", help="table 1 sizes")
    parser.add_argument("--mixed-sizes", type=str, default="20000,400000,2000000", help="table 2 sizes")
    parser.add_argument("--single-run-from", type=int, default=20000, help="time one run (not a median) from this N")
    parser.add_argument("--greedy-budget", type=float, default=20.0, help="seconds for greedy in single runs")
    parser.add_argument("--ref-max-n", type=int, default=5000, help="largest N checked against the reference")
    parser.add_argument("--anchor-max-n", type=int, default=20000, help="largest N timed with torchvision/OpenCV")
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats (smoke run)")
    parser.add_argument("--no-ref", dest="ref", action="store_false", help="skip the pure-PyTorch reference")
    parser.add_argument("--no-opencv", dest="opencv", action="store_false", help="skip OpenCV")
    args = parser.parse_args()
    if not has_compiled_ops():
        raise SystemExit("lightning_balanced._C is not built: pip install --no-build-isolation -e .")
    torch.set_num_threads(args.threads)
    sizes = [1, 100, 1000] if args.quick else [int(s) for s in args.sizes.split(",")]
    mixed_sizes = [20000] if args.quick else [int(s) for s in args.mixed_sizes.split(",")]
    if args.quick:
        args.repeats = 3
    bench = Bench(args)
    tv_version = bench.tv.__version__ if bench.tv is not None else "not installed"
    cv2_version = bench.cv2.__version__ if bench.cv2 is not None else "not installed"
    print(
        f"torch {torch.__version__}, torchvision {tv_version}, opencv {cv2_version}, "
        f"threads={torch.get_num_threads()}, repeats={args.repeats} (median; one run from N = {args.single_run_from}), "
        "float32, CPU"
    )
    bench.header()
    gen = torch.Generator().manual_seed(0)
    for kind in ("uniform", "clustered"):
        for classes in (1, 80):
            for thr in (0.5, 0.7):
                for n in sizes:
                    boxes, scores = (uniform_boxes if kind == "uniform" else clustered_boxes)(n, gen)
                    bench.run(kind, boxes, scores, classes, thr, gen)

    print("\nmixed box sizes at the density of 2M boxes on 20000 x 20000 px")
    bench.header()
    ratios: list[str] = []
    for n in mixed_sizes:
        for classes in (1, 80):
            t: dict[str, float] = {}
            for kind in ("fixed", "uniform", "logu", "fewlarge"):
                boxes, scores = mixed_size_boxes(kind, n, gen)
                t[kind] = bench.run(kind, boxes, scores, classes, 0.5, gen)
            ratios.append(
                f"mixed/fixed N={n} classes={classes}: "
                + ", ".join(f"{k} {t[k] / t['fixed']:.2f}" for k in ("uniform", "logu", "fewlarge"))
            )
    print()
    for line in ratios:
        print(line)
    print(f"worst_ratio_small_n={bench.worst['small']:.3f}  (ours / greedy, N < 1000)")
    print(f"worst_ratio={bench.worst['large']:.3f}  (ours / greedy, N >= 1000)")
    if bench.tv is not None:
        print(f"worst_ratio_vs_torchvision={bench.worst['tv']:.3f}  (ours / torchvision, N <= {args.anchor_max_n})")
    if bench.cv2 is not None:
        print(f"worst_ratio_vs_opencv={bench.worst['cv2']:.3f}  (ours / cv2.dnn.NMSBoxes, N <= {args.anchor_max_n})")


if __name__ == "__main__":
    main()
