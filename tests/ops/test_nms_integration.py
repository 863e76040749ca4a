"""NMS operator plumbing: torch.library registration, torch.compile, CUDA, the nvcc build and the fallback."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch._inductor.config as inductor_config
from torch.torch_version import TorchVersion

from lightning_balanced.ops import (
    CompiledOpsMissingWarning,
    _loader,
    batched_nms,
    batched_nms_reference,
    nms,
    nms_reference,
)
from tests.helpers import RunIf, raises_exactly

ROOT = Path(__file__).resolve().parents[2]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


def _boxes(n: int, seed: int = 0, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    xy = torch.rand(n, 2, generator=gen) * 100
    wh = torch.rand(n, 2, generator=gen) * 40
    scores = torch.randint(0, 20, (n,), generator=gen).double()
    return torch.cat([xy, xy + wh], dim=1).round().to(dtype), scores.to(dtype)


# --------------------------------------------------------------------------------------------------------------
# torch.library: opcheck and torch.compile
# --------------------------------------------------------------------------------------------------------------


@RunIf(compiled_ops=True)
@pytest.mark.parametrize("n", [0, 1, 70, 300])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("offset", [0, 1])
@pytest.mark.slow
def test_opcheck_nms(n: int, dtype: torch.dtype, offset: int) -> None:
    boxes, scores = _boxes(n, dtype=dtype)
    torch.library.opcheck(torch.ops.lightning_balanced.nms.default, (boxes, scores, 0.5, offset))


@RunIf(compiled_ops=True)
@pytest.mark.parametrize("n", [0, 5, 200])
def test_opcheck_batched_nms(n: int) -> None:
    boxes, scores = _boxes(n, seed=1, dtype=torch.float64)
    idxs = torch.arange(n) % 3
    torch.library.opcheck(torch.ops.lightning_balanced.batched_nms.default, (boxes, scores, idxs, 0.4, 0))


@pytest.fixture
def keep_subnormals() -> Iterator[None]:
    """Give the process back its IEEE subnormals after a test that runs Inductor.

    Inductor of torch < 2.5 builds its CPU kernels with ``-ffast-math``; loading such a library runs gcc's
    ``crtfastmath``, which turns on flush-to-zero for the whole process, and later tests (hypothesis' float
    strategies refuse to run without subnormals) would inherit it.
    """
    yield
    torch.set_flush_denormal(False)


@RunIf(compiled_ops=True)
# Inductor itself touches torch.jit.script_method in torch 2.13, which warns; not our code.
@pytest.mark.filterwarnings("ignore:`torch.jit.script_method` is deprecated:DeprecationWarning")
@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.slow
def test_torch_compile_fullgraph_traces_through_nms(backend: str, keep_subnormals: None) -> None:
    torch._dynamo.reset()

    def keep_boxes(boxes: torch.Tensor, scores: torch.Tensor, idxs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        kept = nms(boxes, scores, 0.5)
        per_class = batched_nms(boxes, scores, idxs, 0.5, offset=1)
        return boxes[kept] * 2, scores[per_class]

    compiled = torch.compile(keep_boxes, fullgraph=True, backend=backend)
    # Inductor compiles in this process: its pool of compile workers (one per core, each importing torch) took over
    # 100 s to start on a 16-core machine running 15 test workers.
    with inductor_config.patch(compile_threads=1):
        for n, seed in ((50, 0), (120, 1)):
            boxes, scores = _boxes(n, seed)
            idxs = torch.arange(n) % 4
            got = compiled(boxes, scores, idxs)
            expected = keep_boxes(boxes, scores, idxs)
            assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


# --------------------------------------------------------------------------------------------------------------
# Bad input: the same ValueError/TypeError in eager mode and under torch.compile(fullgraph=True)
# --------------------------------------------------------------------------------------------------------------

_B = torch.tensor([[0, 0, 1, 1], [0, 0, 2, 2.0]])
_S = torch.tensor([0.5, 0.6])
_I = torch.tensor([0, 1])
# (boxes, scores, idxs, iou_threshold, offset), error, whole message ("{op}" is the op's name): each rule of
# csrc/ops/nms_checks.h.
TENSOR_BAD_INPUTS = {
    "boxes 1-D": ((_B[0], _S, _I, 0.5, 0), ValueError, "{op}: boxes must have shape (N, 4), got [4]"),
    "boxes (N, 3)": ((_B[:, :3], _S, _I, 0.5, 0), ValueError, "{op}: boxes must have shape (N, 4), got [2, 3]"),
    "scores 2-D": ((_B, _S[:, None], _I, 0.5, 0), ValueError, "{op}: scores must have shape (N,), got [2, 1]"),
    "lengths differ": (
        (_B, _S[:1], _I, 0.5, 0),
        ValueError,
        "{op}: boxes and scores must have the same length N, got 2 boxes and 1 scores",
    ),
    "integer boxes": (
        (_B.long(), _S.long(), _I, 0.5, 0),
        TypeError,
        "{op}: boxes must be float16, bfloat16, float32 or float64, got Long",
    ),
    "dtypes differ": (
        (_B, _S.double(), _I, 0.5, 0),
        TypeError,
        "{op}: scores must have the dtype of boxes (Float), got Double",
    ),
    "threshold NaN": ((_B, _S, _I, math.nan, 0), ValueError, "{op}: iou_threshold must be a number in [0, 1], got nan"),
    "threshold > 1": ((_B, _S, _I, 1.5, 0), ValueError, "{op}: iou_threshold must be a number in [0, 1], got 1.5"),
    "threshold < 0": ((_B, _S, _I, -0.1, 0), ValueError, "{op}: iou_threshold must be a number in [0, 1], got -0.1"),
    "offset 2": ((_B, _S, _I, 0.5, 2), ValueError, "{op}: offset must be 0 or 1, got 2"),
    "NaN coordinate": (
        (torch.tensor([[0, 0, math.nan, 1.0]]), _S[:1], _I[:1], 0.5, 0),
        ValueError,
        "{op}: box coordinates must be finite (no NaN or infinity)",
    ),
    "infinite score": (
        (_B, torch.tensor([0.5, -math.inf]), _I, 0.5, 0),
        ValueError,
        "{op}: scores must be finite (no NaN or infinity)",
    ),
    "float idxs": ((_B, _S, _I.float(), 0.5, 0), TypeError, "batched_nms: idxs must have an integer dtype, got Float"),
    "idxs too long": (
        (_B, _S, torch.zeros(3, dtype=torch.int64), 0.5, 0),
        ValueError,
        "batched_nms: idxs must have shape (N,) with N = 2, got [3]",
    ),
}


def _call(op: str, args: tuple) -> torch.Tensor:
    boxes, scores, idxs, thr, offset = args
    return nms(boxes, scores, thr, offset) if op == "nms" else batched_nms(boxes, scores, idxs, thr, offset)


@RunIf(compiled_ops=True)
@pytest.mark.parametrize(
    ("op", "args", "error", "message"),
    [
        pytest.param(op, *case, id=f"{op}-{name}")
        for op in ("nms", "batched_nms")
        for name, case in TENSOR_BAD_INPUTS.items()
        if op == "batched_nms" or "idxs" not in name
    ],
)
def test_bad_input_raises_the_same_error_in_eager_and_compiled_mode(op: str, args, error, message) -> None:
    with raises_exactly(error, message.format(op=op)):
        _call(op, args)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: _call(op, a), fullgraph=True, backend="aot_eager")
    with pytest.raises(error) as info:
        compiled(*args)
    # Our whole message is the first line: older torch (2.4) appends the FX node it ran ("While executing %nms ...").
    assert str(info.value).splitlines()[0] == message.format(op=op)


@RunIf(compiled_ops=True)
@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((_B.tolist(), _S, _I, 0.5, 0), "nms: boxes must be a torch.Tensor, got list"),
        ((_B, _S, _I, "0.5", 0), "nms: iou_threshold must be a real number, got str"),
        ((_B, _S, _I, 0.5, 1.0), "nms: offset must be an int (0 or 1), got float"),
    ],
)
def test_python_type_errors_under_torch_compile_are_reported_by_dynamo(args, message) -> None:
    """What the dispatcher cannot see (an argument that is not a tensor or a number) is checked in Python, so
    under torch.compile(fullgraph=True) the TypeError is raised while tracing and torch._dynamo reports it as
    an ``Unsupported`` "Observed exception" whose cause carries our message (a documented limitation)."""
    with raises_exactly(TypeError, message):
        _call("nms", args)
    torch._dynamo.reset()
    compiled = torch.compile(lambda *a: _call("nms", a), fullgraph=True, backend="aot_eager")
    with pytest.raises(torch._dynamo.exc.Unsupported, match="Observed exception") as info:
        compiled(*args)
    # Our whole message appears quoted in Dynamo's report, whose wording varies by torch version: in the cause's text
    # from torch 2.12 on ("raised exception TypeError('nms: ...')", pytorch#179001); only in the exception's own text
    # on torch 2.11 ("TypeError([ConstantVariable(str: 'nms: ...')])"). torch 2.4's report leaves it out.
    if TorchVersion(torch.__version__) >= "2.10":
        reported = f"{info.value}\n{info.value.__cause__}"
        assert repr(message) in reported, reported


@RunIf(compiled_ops=True)
def test_meta_and_fake_tensors_go_to_the_fake_kernel_without_warning(monkeypatch: pytest.MonkeyPatch) -> None:
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    monkeypatch.setattr(_loader, "_warned", False)
    boxes, scores = _boxes(30)
    idxs = torch.arange(30) % 3
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # CompiledOpsMissingWarning included
        with FakeTensorMode(shape_env=ShapeEnv()) as mode:
            fake_boxes, fake_scores, fake_idxs = (mode.from_tensor(t) for t in (boxes, scores, idxs))
            for out in (nms(fake_boxes, fake_scores, 0.5), batched_nms(fake_boxes, fake_scores, fake_idxs, 0.5)):
                assert out.dtype == torch.int64 and out.dim() == 1
        # Meta tensors reach the fake kernel too; a data-dependent output size has no meta value, so torch says so.
        for call in (
            lambda: nms(boxes.to("meta"), scores.to("meta"), 0.5),
            lambda: batched_nms(boxes.to("meta"), scores.to("meta"), idxs.to("meta"), 0.5),
        ):
            with pytest.raises(RuntimeError, match="data-dependent"):
                call()
    assert not _loader._warned  # the once-per-process warning is still unspent


# --------------------------------------------------------------------------------------------------------------
# CUDA (skipped without a GPU) and the CUDA source compile check (needs only nvcc)
# --------------------------------------------------------------------------------------------------------------


@RunIf(min_cuda_gpus=1, compiled_ops=True)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("offset", [0, 1])
def test_cuda_kernel_matches_the_reference(dtype: torch.dtype, offset: int) -> None:
    if not _loader.has_kernel("cuda"):
        pytest.skip("lightning_balanced._C was built without CUDA")
    for n, seed in ((0, 0), (1, 1), (63, 2), (64, 3), (65, 4), (1000, 5)):
        boxes, scores = _boxes(n, seed, dtype)
        for thr in (0.0, 0.3, 0.7, 1.0):
            expected = nms_reference(boxes, scores, thr, offset)
            assert torch.equal(nms(boxes.cuda(), scores.cuda(), thr, offset).cpu(), expected)
            idxs = torch.arange(n) % 5
            expected = batched_nms_reference(boxes, scores, idxs, thr, offset)
            assert torch.equal(batched_nms(boxes.cuda(), scores.cuda(), idxs.cuda(), thr, offset).cpu(), expected)


@RunIf(min_cuda_gpus=1, compiled_ops=True)
@pytest.mark.parametrize("layout", ["uniform", "clustered", "mixed_sizes", "few_large"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_cuda_kernel_on_many_tiles_and_class_chains_equals_the_cpu_kernel(layout: str, dtype: torch.dtype) -> None:
    """Every path of the CUDA schedule on a real GPU: 30,000 boxes (30 tiles of 1024 rows, step 2 through the spatial
    index), batched_nms with 80 classes (classes as independent chains, one tile each), with 3 classes (chains of
    10 tiles side by side) and with one class holding 90 % of the boxes (one chain, class ranges pruning)."""
    if not _loader.has_kernel("cuda"):
        pytest.skip("lightning_balanced._C was built without CUDA")
    from tests.ops.test_nms import _random_boxes

    n = 30_000
    boxes, scores = _random_boxes(5, n, layout, dtype)
    gen = torch.Generator().manual_seed(6)
    skewed = torch.randint(0, 80, (n,), generator=gen)
    skewed[: n * 9 // 10] = 0
    for thr in (0.3, 0.7):
        assert torch.equal(nms(boxes.cuda(), scores.cuda(), thr).cpu(), nms(boxes, scores, thr))
        for idxs in (torch.randint(0, 80, (n,), generator=gen), torch.randint(0, 3, (n,), generator=gen), skewed):
            expected = batched_nms(boxes, scores, idxs, thr)
            assert torch.equal(batched_nms(boxes.cuda(), scores.cuda(), idxs.cuda(), thr).cpu(), expected)
    scores[123] = float("-inf")  # a padding slot of the class rows looks the same: still an error
    with raises_exactly(ValueError, "batched_nms: scores must be finite (no NaN or infinity)"):
        batched_nms(boxes.cuda(), scores.cuda(), (torch.arange(n) % 80).cuda(), 0.5)


@RunIf(min_cuda_gpus=1, compiled_ops=True)
def test_cuda_kernel_rejects_non_finite_values_and_runs_under_autocast() -> None:
    if not _loader.has_kernel("cuda"):
        pytest.skip("lightning_balanced._C was built without CUDA")
    boxes, scores = _boxes(100, 3)
    boxes, scores = boxes.cuda(), scores.cuda()
    with raises_exactly(ValueError, "nms: scores must be finite (no NaN or infinity)"):
        nms(boxes, torch.full_like(scores, float("nan")), 0.5)
    with torch.autocast("cuda", dtype=torch.float16):
        assert torch.equal(nms(boxes.half(), scores.half(), 0.5), nms(boxes.half().float(), scores.half().float(), 0.5))


@RunIf(nvcc=True)
@pytest.mark.slow
def test_cuda_kernel_source_compiles_with_nvcc(tmp_path: Path) -> None:
    """Catches CUDA code that would not build, on machines without a GPU or a CUDA build of torch.

    To PTX (nvcc's front end and code generation: every C++ and CUDA error), not through ptxas: 11 s instead of 31 s
    on 2 cores. ptxas and every architecture run in CI's CUDA-build leg, which builds the extension with the kernels.
    """
    from torch.utils.cpp_extension import COMMON_NVCC_FLAGS, include_paths

    # CPU wheels ship the c10/cuda headers but not this generated one.
    stub = tmp_path / "stub" / "c10" / "cuda" / "impl" / "cuda_cmake_macros.h"
    stub.parent.mkdir(parents=True)
    stub.write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    nvcc = shutil.which("nvcc")
    assert nvcc is not None
    cmd = [
        nvcc,
        "-ptx",
        str(ROOT / "csrc" / "ops" / "cuda" / "nms_kernel.cu"),
        "-o",
        str(tmp_path / "nms_kernel.ptx"),
        "-std=c++20",
        "-O1",
        "--fmad=false",
        *COMMON_NVCC_FLAGS,
        f"-I{tmp_path / 'stub'}",
        f"-I{ROOT / 'csrc'}",
        *(f"-I{p}" for p in include_paths()),
    ]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=300, check=False)
    assert result.returncode == 0, result.stdout + result.stderr
    assert ".entry" in (tmp_path / "nms_kernel.ptx").read_text()  # kernels were generated


# --------------------------------------------------------------------------------------------------------------
# Missing compiled ops: one clear warning and the reference fallback
# --------------------------------------------------------------------------------------------------------------


@RunIf(compiled_ops=True)
def test_the_registered_kernels_are_read_from_the_dispatcher() -> None:
    """Every op the extension defined: the CPU kernel always, the CUDA one exactly when the dispatcher has it."""
    kernels = _loader.registered_kernels()
    assert {"nms", "batched_nms"} <= kernels.keys()
    for op, device_types in kernels.items():
        has_cuda = torch._C._dispatch_has_kernel_for_dispatch_key(f"lightning_balanced::{op}", "CUDA")
        assert device_types == ({"cpu", "cuda"} if has_cuda else {"cpu"})
        assert _loader.has_kernel("cpu", op)
    assert not _loader.has_kernel("cpu", "no_such_op")


def test_missing_kernel_warns_once_and_falls_back_to_the_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_loader, "_KERNELS", {})
    monkeypatch.setattr(_loader, "_warned", False)
    boxes, scores = _boxes(80, 4)
    idxs = torch.arange(80) % 3
    with pytest.warns(CompiledOpsMissingWarning, match="pip install --no-build-isolation") as record:
        first = nms(boxes, scores, 0.5)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        second = batched_nms(boxes, scores, idxs, 0.5)
        nms(boxes, scores, 0.5)
    assert len(record) == 1
    assert "pure-PyTorch fallback" in str(record[0].message)
    assert torch.equal(first, nms_reference(boxes, scores, 0.5))
    assert torch.equal(second, batched_nms_reference(boxes, scores, idxs, 0.5))


@pytest.mark.slow
def test_import_without_compiled_module_works_and_warns_once(tmp_path: Path) -> None:
    """A fresh interpreter where ``lightning_balanced._C`` cannot be imported."""
    script = tmp_path / "no_ext.py"
    script.write_text(
        "import sys, warnings\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'lightning_balanced._C':\n"
        "            raise ImportError('blocked for the test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch\n"
        "import lightning_balanced.ops as ops\n"
        "assert not ops.has_compiled_ops()\n"
        "boxes = torch.tensor([[0, 0, 2, 2], [0, 0, 2, 1.9], [5, 5, 6, 6]])\n"
        "scores = torch.tensor([0.9, 0.8, 0.7])\n"
        "with warnings.catch_warnings(record=True) as caught:\n"
        "    warnings.simplefilter('always')\n"
        "    assert ops.nms(boxes, scores, 0.5).tolist() == [0, 2]\n"
        "    assert ops.batched_nms(boxes, scores, torch.tensor([0, 1, 0]), 0.5).tolist() == [0, 1, 2]\n"
        "assert len(caught) == 1, [str(w.message) for w in caught]\n"
        "assert issubclass(caught[0].category, ops.CompiledOpsMissingWarning)\n"
        "print('ok')\n"
    )
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    result = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120, env=env, check=False
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stdout + result.stderr
