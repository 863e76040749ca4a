"""CPU benchmark of lightning_balanced.ops.nms / batched_nms against a torchvision-equivalent kernel.

Baselines:
  * ``tv``: the classic loop of torchvision's CPU ``nms`` (stable sort, then each kept box suppresses the later
    ones via a flag), in ``benchmarks/tv_equivalent_nms.cpp``, compiled here with ``-O3``; for batched workloads,
    torchvision's ``batched_nms`` logic on top of it (coordinate-offset trick for ``N * 4 <= 4000``, one ``nms``
    per class otherwise);
  * ``ref``: the pure-PyTorch reference (``lightning_balanced.ops.nms_reference``), i.e. the fallback.
``ours`` is the public ``lightning_balanced.ops.nms`` / ``batched_nms`` (argument checks included). For batched
workloads ``ours+trick`` is our ``nms`` on coordinate-offset boxes, to compare with the native ``batched_nms``.

Run: ``python benchmarks/bench_nms.py`` (single thread), ``--threads 2`` for more, ``--quick`` for a smoke run.
The last lines are ``worst_ratio=...`` (ours / tv over N >= 1000) and ``worst_ratio_small_n=...`` (N < 1000).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch
from torch.utils.cpp_extension import load

from lightning_balanced.ops import batched_nms, has_compiled_ops, nms, nms_reference
from lightning_balanced.ops.nms_reference import batched_nms_reference

HERE = Path(__file__).resolve().parent


def load_tv_equivalent() -> Callable[..., torch.Tensor]:
    load(
        name="tv_equivalent_nms",
        sources=[str(HERE / "tv_equivalent_nms.cpp")],
        extra_cflags=["-O3"],
        is_python_module=False,
        verbose=False,
    )
    return torch.ops.tv_equivalent.nms


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


def tv_batched(tv_nms: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """torchvision's batched_nms logic on top of the classic kernel."""

    def run(boxes: torch.Tensor, scores: torch.Tensor, idxs: torch.Tensor, thr: float) -> torch.Tensor:
        if boxes.numel() > 4000:
            keep_mask = torch.zeros_like(scores, dtype=torch.bool)
            for class_id in torch.unique(idxs):
                curr = torch.where(idxs == class_id)[0]
                keep_mask[curr[tv_nms(boxes[curr], scores[curr], thr)]] = True
            keep = torch.where(keep_mask)[0]
            return keep[scores[keep].sort(descending=True)[1]]
        return tv_nms(offset_boxes(boxes, idxs), scores, thr)

    return run


def offset_boxes(boxes: torch.Tensor, idxs: torch.Tensor) -> torch.Tensor:
    if boxes.numel() == 0:
        return boxes
    offsets = idxs.to(boxes) * (boxes.max() + 1)
    return boxes + offsets[:, None]


def measure(fns: dict[str, Callable[[], torch.Tensor]], repeats: int, budget_s: float) -> dict[str, float]:
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


def run_workload(
    kind: str,
    classes: int,
    thr: float,
    n: int,
    gen: torch.Generator,
    repeats: int,
    tv_nms: Callable[..., torch.Tensor],
    with_ref: bool,
) -> float:
    """Time one workload, print its row, return ours / tv."""
    boxes, scores = (uniform_boxes if kind == "uniform" else clustered_boxes)(n, gen)
    idxs = torch.randint(0, classes, (n,), generator=gen)
    fns: dict[str, Callable[[], torch.Tensor]]
    if classes == 1:
        fns = {"ours": lambda: nms(boxes, scores, thr), "tv": lambda: tv_nms(boxes, scores, thr)}

        def ref() -> torch.Tensor:
            return nms_reference(boxes, scores, thr)

    else:
        tv_bnms = tv_batched(tv_nms)
        fns = {
            "ours": lambda: batched_nms(boxes, scores, idxs, thr),
            "tv": lambda: tv_bnms(boxes, scores, idxs, thr),
            "trick": lambda: nms(offset_boxes(boxes, idxs), scores, thr),
        }

        def ref() -> torch.Tensor:
            return batched_nms_reference(boxes, scores, idxs, thr)

    times = measure(fns, repeats, budget_s=0.004)
    ours_out = fns["ours"]()
    ref_ms, match = float("nan"), "-"
    if with_ref:
        ref_ms = measure({"ref": ref}, 1 if n >= 5000 else 3, budget_s=0.0)["ref"] * 1e3
        match = "yes" if torch.equal(ours_out, ref()) else "NO"
    ratio = times["ours"] / times["tv"]
    trick = f"{times['trick'] * 1e3:10.3f}" if "trick" in times else f"{'':>10}"
    print(
        f"{kind:<10}{n:>7}{thr:>5}{classes:>4}{ours_out.numel():>7}{times['ours'] * 1e3:10.3f}"
        f"{times['tv'] * 1e3:10.3f}{ratio:7.3f}{trick}{ref_ms:10.2f}  {match}",
        flush=True,
    )
    return ratio


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=1, help="torch.set_num_threads (default 1)")
    parser.add_argument("--repeats", type=int, default=7, help="interleaved repeats per workload (median)")
    parser.add_argument("--sizes", type=str, default="1,10,100,500,1000,5000,20000")
    parser.add_argument("--quick", action="store_true", help="small sizes and few repeats (smoke run)")
    parser.add_argument("--no-ref", action="store_true", help="skip the pure-PyTorch reference")
    args = parser.parse_args()
    if not has_compiled_ops():
        raise SystemExit("lightning_balanced._C is not built: pip install --no-build-isolation -e .")
    torch.set_num_threads(args.threads)
    sizes = [1, 100, 1000] if args.quick else [int(s) for s in args.sizes.split(",")]
    repeats = 3 if args.quick else args.repeats
    tv_nms = load_tv_equivalent()

    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, repeats={repeats} (median), float32, CPU")
    header = (
        f"{'workload':<10}{'N':>7}{'thr':>5}{'cls':>4}{'kept':>7}{'ours ms':>10}{'tv ms':>10}"
        f"{'ratio':>7}{'trick ms':>10}{'ref ms':>10}  match"
    )
    print(header)
    print("-" * len(header))
    worst_large = 0.0
    worst_small = 0.0
    gen = torch.Generator().manual_seed(0)
    for kind in ("uniform", "clustered"):
        for classes in (1, 80):
            for thr in (0.5, 0.7):
                for n in sizes:
                    ratio = run_workload(kind, classes, thr, n, gen, repeats, tv_nms, not args.no_ref)
                    if n >= 1000:
                        worst_large = max(worst_large, ratio)
                    else:
                        worst_small = max(worst_small, ratio)
    print(f"worst_ratio_small_n={worst_small:.3f}  (ours / tv, N < 1000)")
    print(f"worst_ratio={worst_large:.3f}  (ours / tv, N >= 1000)")


if __name__ == "__main__":
    main()
