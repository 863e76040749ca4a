"""The build's choice of CUDA toolkit and architectures (setup.py), on toolkit layouts made up inside the tests."""

from __future__ import annotations

import importlib.util
import os
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import pytest
import torch

from tests.helpers import RunIf

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def build(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """setup.py as a module (its ``setup()`` call runs only as ``__main__``), with no build variables set."""
    for var in ("CUDA_HOME", "CUDA_PATH", "TORCH_CUDA_ARCH_LIST", "LIGHTNING_BALANCED_CUDA", "FORCE_CUDA"):
        monkeypatch.delenv(var, raising=False)
    spec = importlib.util.spec_from_file_location("lightning_balanced_setup", ROOT / "setup.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _real_toolkit() -> Path | None:
    """The toolkit of the ``nvcc`` on PATH, found without the code under test (the standard locations)."""
    for home in (Path(os.environ.get("CUDA_HOME", "/nonexistent")), Path("/usr/local/cuda")):
        if (home / "bin" / "nvcc").exists() and (home / "include" / "cuda_runtime.h").exists():
            return home.resolve()
    return None


def _executable(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return path


needs_toolkit = pytest.mark.skipif(
    _real_toolkit() is None, reason="needs a CUDA toolkit in /usr/local/cuda or CUDA_HOME"
)


@pytest.mark.parametrize(
    ("values", "expected"),
    [
        ({}, "auto"),
        ({"FORCE_CUDA": "1"}, "1"),
        ({"LIGHTNING_BALANCED_CUDA": "0", "FORCE_CUDA": "1"}, "0"),
        ({"LIGHTNING_BALANCED_CUDA": "AUTO"}, "auto"),
        ({"LIGHTNING_BALANCED_CUDA": "1"}, "1"),
    ],
)
def test_cuda_switch_reads_the_variable_and_the_force_cuda_alias(
    build: ModuleType, monkeypatch: pytest.MonkeyPatch, values: dict[str, str], expected: str
) -> None:
    for var, value in values.items():
        monkeypatch.setenv(var, value)
    assert build._cuda_mode() == expected


def test_cuda_switch_refuses_an_unknown_value(build: ModuleType, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LIGHTNING_BALANCED_CUDA", "yes")
    with pytest.raises(SystemExit, match="LIGHTNING_BALANCED_CUDA must be auto, 0 or 1, got 'yes'"):
        build._cuda_mode()


@RunIf(nvcc=True)
@needs_toolkit
@pytest.mark.parametrize("kind", ["wrapper script", "symlink"])
def test_toolkit_is_found_through_an_nvcc_outside_it(
    build: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, kind: str
) -> None:
    # The layout of issue 8: nvcc on the PATH in a bin directory outside the toolkit, whose parent has no libcudart.
    # torch's own guess (the parent of that bin directory) is tmp_path, which is not a toolkit.
    toolkit = _real_toolkit()
    assert toolkit is not None
    nvcc = tmp_path / "bin" / "nvcc"
    if kind == "symlink":
        nvcc.parent.mkdir()
        nvcc.symlink_to(toolkit / "bin" / "nvcc")
    else:
        _executable(nvcc, f'#!/bin/sh\nexec {toolkit / "bin" / "nvcc"} "$@"\n')
    monkeypatch.setenv("PATH", f"{nvcc.parent}{os.pathsep}{os.environ['PATH']}")
    assert shutil.which("nvcc") == str(nvcc)
    home, version = build._find_toolkit(build._check_toolkit(toolkit))
    assert home.resolve() == toolkit
    assert version == build._check_toolkit(toolkit)


def test_an_explicit_cuda_home_without_the_runtime_library_is_refused_naming_it(
    build: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _executable(tmp_path / "bin" / "nvcc", "#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "cuda_runtime.h").write_text("")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    with pytest.raises(build.ToolkitError, match="no CUDA runtime library \\(libcudart\\)"):
        build._find_toolkit("13.0")


def test_a_toolkit_of_another_major_version_than_torch_is_refused(
    build: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    _executable(tmp_path / "bin" / "nvcc", "#!/bin/sh\necho 'Cuda compilation tools, release 11.8, V11.8.89'\n")
    (tmp_path / "include").mkdir()
    (tmp_path / "include" / "cuda_runtime.h").write_text("")
    (tmp_path / "lib64").mkdir()
    (tmp_path / "lib64" / "libcudart.so").write_text("")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))
    assert build._check_toolkit(tmp_path) == "11.8"
    with pytest.raises(build.ToolkitError, match=r"CUDA 11\.8, but torch was built with CUDA 13\.0"):
        build._find_toolkit("13.0")


def test_cpu_build_of_torch_builds_cpu_kernels_in_auto_mode_and_refuses_mode_1(
    build: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(torch.version, "cuda", None)
    assert build._plan_cuda("auto") is False
    assert build._plan_cuda("0") is False
    with pytest.raises(SystemExit, match=r"is a CPU build.*LIGHTNING_BALANCED_CUDA=0"):
        build._plan_cuda("1")


def test_without_a_gpu_or_an_arch_list_auto_builds_cpu_kernels_and_says_how_to_build_cuda_ones(
    build: ModuleType, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 0)
    monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    monkeypatch.setenv("CUDA_HOME", "/nonexistent")  # never looked at: nothing to build for
    assert build._plan_cuda("auto") is False
    assert capsys.readouterr().err == (
        f"lightning_balanced: building CPU kernels only: no GPU is visible and TORCH_CUDA_ARCH_LIST is not set (torch"
        f" {torch.__version__}). To build the CUDA kernels here anyway, for a GPU machine elsewhere, set"
        " LIGHTNING_BALANCED_CUDA=1 (or FORCE_CUDA=1; every architecture torch supports, minutes) or"
        " TORCH_CUDA_ARCH_LIST (those only)\n"
    )


def test_broken_toolkit_gives_a_cpu_build_with_a_warning_in_auto_mode_and_an_error_in_mode_1(
    build: ModuleType, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setenv("CUDA_HOME", str(tmp_path))  # an empty directory: no nvcc
    monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", "9.0")  # something to build for, GPU or not
    with pytest.warns(UserWarning, match=r"building CPU kernels only.*no nvcc at"):
        assert build._plan_cuda("auto") is False
    with pytest.raises(SystemExit, match=r"no nvcc at.*LIGHTNING_BALANCED_CUDA=0"):
        build._plan_cuda("1")


@RunIf(nvcc=True)
@needs_toolkit
@pytest.mark.skipif(not torch.cuda.get_arch_list(), reason="needs a CUDA build of torch (it lists its architectures)")
def test_default_architectures_are_torchs_own_that_nvcc_compiles(build: ModuleType) -> None:
    toolkit = _real_toolkit()
    assert toolkit is not None
    arch_list = build._default_arch_list(toolkit / "bin" / "nvcc").split(";")
    assert arch_list[-1].endswith("+PTX")
    expected = [f"{a[3:-1]}.{a[-1]}" for a in torch.cuda.get_arch_list() if a.startswith("sm_")]
    assert [a.removesuffix("+PTX") for a in arch_list] == expected


# ---- libstdc++ ---------------------------------------------------------------------------------------------------
# A GPU machine's g++ linked libstdc++ statically: the extension held a private copy, and TORCH_CHECK messages came
# out truncated ("got [") or crashed the process. One build (the slow part, ~25 s on 2 cores) stands for three causes
# at once: -static-libstdc++ in LDFLAGS, a compiler (CXX and LDSHARED wrappers) that adds it itself, and a GCC install
# that ships only libstdc++.a, so that every -lstdc++, even after -Wl,-Bdynamic, resolves to the archive (the default
# g++ of the GPU machines seen on 2026-11-26; reproduced with a `libstdc++.so` linker script naming the archive, found
# first through -L). A fix that handles only some of them still gives a private copy. Tests that need another link
# reuse its objects (ninja).
needs_linux_cxx = pytest.mark.skipif(
    not sys.platform.startswith("linux") or shutil.which("c++") is None, reason="needs Linux and c++"
)
# Such a g++. With DROP_SHARED_LIBSTDCXX=1 it also drops the build's explicit shared -lstdc++ (defeats the fix), for
# the check after the link to catch; an environment variable, so ninja sees the same compile commands. -O0 last: the
# link is under test, not the code's speed (the compile takes 30 s instead of 50 on 2 cores).
_STATIC_CXX = """#!/bin/sh
if [ -n "$DROP_SHARED_LIBSTDCXX" ]; then
  for arg do
    shift
    case "$arg" in -lstdc++|-l:libstdc++.so*|*/libstdc++.so*|-Wl,-Bdynamic) ;; *) set -- "$@" "$arg" ;; esac
  done
fi
exec c++ -L"$ARCHIVE_ONLY_LIBSTDCXX" "$@" -static-libstdc++ -O0
"""
_NMS_OF_1D_BOXES = """
import importlib.util, sys, torch
spec = importlib.util.spec_from_file_location("lightning_balanced._C", sys.argv[1])
spec.loader.exec_module(importlib.util.module_from_spec(spec))
try:
    torch.ops.lightning_balanced.nms(torch.zeros(4), torch.zeros(4), 0.5, 0)
except ValueError as err:
    print(repr(str(err)))
"""


def _build_ext(env: dict[str, str], out: Path, build_temp: Path) -> subprocess.CompletedProcess[str]:
    """``setup.py build_ext`` of the CPU kernels from the repository root into ``out`` (nothing in the tree)."""
    command = [sys.executable, "setup.py", "build_ext", "--build-lib", str(out), "--build-temp", str(build_temp)]
    return subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


@dataclass
class StaticBuild:
    """One ``build_ext`` under a compiler that links libstdc++ statically: its result, environment and folder."""

    result: subprocess.CompletedProcess[str]
    env: dict[str, str]
    tmp: Path

    def check_succeeded(self) -> None:
        assert self.result.returncode == 0, self.result.stdout[-2000:] + self.result.stderr[-2000:]


@pytest.fixture(scope="module")
def static_libstdcxx_build(tmp_path_factory: pytest.TempPathFactory) -> StaticBuild:
    """The build under a compiler that links libstdc++ statically, run once per session."""
    tmp = tmp_path_factory.mktemp("static_libstdcxx")
    unset = ("CUDA_HOME", "CUDA_PATH", "FORCE_CUDA", "LIGHTNING_BALANCED_NO_EXT", "CXX", "CC", "LDSHARED")
    env = {k: v for k, v in os.environ.items() if k not in unset}
    compiler = _executable(tmp / "bin" / "g++", _STATIC_CXX)
    archive = subprocess.run(["c++", "-print-file-name=libstdc++.a"], capture_output=True, text=True, check=True)
    (tmp / "archive_only").mkdir()
    (tmp / "archive_only" / "libstdc++.so").write_text(f"INPUT({archive.stdout.strip()})\n")
    env.update(
        ARCHIVE_ONLY_LIBSTDCXX=str(tmp / "archive_only"),
        LIGHTNING_BALANCED_CUDA="0",
        LDFLAGS=(env.get("LDFLAGS", "") + " -static-libstdc++").strip(),
        CXX=str(compiler),
        LDSHARED=f"{compiler} -shared",
    )
    return StaticBuild(_build_ext(env, tmp / "lib", tmp / "temp"), env, tmp)


@needs_linux_cxx
@pytest.mark.slow
def test_a_compiler_that_links_libstdcxx_statically_still_gives_the_shared_one(
    static_libstdcxx_build: StaticBuild, build: ModuleType
) -> None:
    static_libstdcxx_build.check_succeeded()
    built = static_libstdcxx_build.result
    assert "-static-libstdc++" in built.stdout + built.stderr  # the flag really reached the link
    (so,) = (static_libstdcxx_build.tmp / "lib" / "lightning_balanced").glob("_C*.so")
    checked = subprocess.run([sys.executable, "-c", _NMS_OF_1D_BOXES, str(so)], capture_output=True, text=True)
    assert checked.returncode == 0, checked.stderr[-2000:]  # a private libstdc++ could crash here (SIGSEGV)
    assert checked.stdout == repr("nms: boxes must have shape (N, 4), got [4]") + "\n"  # whole: not cut at "got ["
    assert "libstdc++.so.6" in build.needed_libraries(so)


@needs_linux_cxx
@pytest.mark.slow
def test_a_link_that_still_gives_a_private_libstdcxx_fails_naming_it_and_leaves_no_so(
    static_libstdcxx_build: StaticBuild,
) -> None:
    static_libstdcxx_build.check_succeeded()
    tmp = static_libstdcxx_build.tmp
    out = tmp / "relinked"
    env = {**static_libstdcxx_build.env, "DROP_SHARED_LIBSTDCXX": "1"}
    relinked = _build_ext(env, out, tmp / "temp")  # the same objects: ninja compiles nothing, only links
    assert relinked.returncode != 0
    assert "lightning_balanced: the linked _C.abi3.so needs no libstdc++.so (it needs " in relinked.stderr
    assert "the compiler linked libstdc++ statically" in relinked.stderr
    assert "Remove -static-libstdc++ from LDFLAGS" in relinked.stderr
    assert not list(out.rglob("_C*.so")), "a statically linked _C was left where it would be installed"


def test_the_link_names_the_shared_libstdcxx_torch_loaded_by_its_file(build: ModuleType, tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text(
        "7f00-7f01 r--p 00000000 fe:01 11 /opt/py/lib/python3.12/site-packages/torch/lib/libtorch_cpu.so\n"
        "7f02-7f03 r-xp 00000000 fe:01 12 /usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.33\n"
        "7f04-7f05 rw-p 00000000 00:00 0 \n"
    )
    loaded = build.loaded_libstdcxx(maps)
    assert loaded == Path("/usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.33")
    assert build.libstdcxx_link_args("linux", loaded) == ["-Wl,-Bdynamic", str(loaded)]
    maps.write_text("7f00-7f01 r--p 00000000 fe:01 11 /usr/lib/libc.so.6\n")
    assert build.loaded_libstdcxx(maps) is None
    assert build.loaded_libstdcxx(tmp_path / "missing") is None
    assert build.libstdcxx_link_args("linux", None) == ["-Wl,-Bdynamic", "-l:libstdc++.so.6"]
    assert build.libstdcxx_link_args("darwin", loaded) == []
    if sys.platform.startswith("linux"):  # this process imported torch, which loaded it
        found = build.loaded_libstdcxx()
        assert found is not None and found.name.startswith("libstdc++.so") and found.exists()


@pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("cc") is None, reason="needs Linux and cc")
def test_a_shared_object_without_the_shared_libstdcxx_is_deleted_and_named(build: ModuleType, tmp_path: Path) -> None:
    source = tmp_path / "plain.c"
    source.write_text('#include <stdio.h>\nvoid hello(void) { puts("hello"); }\n')
    so = tmp_path / "_C.abi3.so"
    subprocess.run(["cc", "-shared", "-fPIC", str(source), "-o", str(so)], check=True)
    assert build.needed_libraries(so) is not None and not any("libstdc++" in n for n in build.needed_libraries(so))
    build.check_shared_libstdcxx(so, platform="darwin")  # checked on Linux only
    assert so.exists()
    with pytest.raises(SystemExit) as info:
        build.check_shared_libstdcxx(so)
    assert str(info.value) == (
        "lightning_balanced: the linked _C.abi3.so needs no libstdc++.so (it needs libc.so.6): the compiler linked "
        "libstdc++ statically, so the extension would carry a private copy beside torch's, and TORCH_CHECK messages "
        "would come out truncated or crash the process. Remove -static-libstdc++ from LDFLAGS, or build with a "
        "compiler that links the shared libstdc++ (e.g. CXX=/usr/bin/g++). The file was deleted."
    )
    assert not so.exists()
    assert build.needed_libraries(ROOT / "setup.py") is None  # not ELF: nothing to check


# ---- sources ------------------------------------------------------------------------------------------------------
def test_sources_are_found_so_a_new_op_is_its_own_files(build: ModuleType, tmp_path: Path) -> None:
    """A made-up op ``roi_align`` added as files only: its schema, CPU, CUDA (host and device) and autocast parts."""
    for name in (
        "module.cpp",
        "ops/nms.cpp",
        "ops/cpu/nms_kernel.cpp",
        "ops/cuda/nms_kernel.cu",
        "ops/roi_align.cpp",
        "ops/roi_align_checks.h",
        "ops/cpu/roi_align_kernel.cpp",
        "ops/cuda/roi_align_launch.cpp",
        "ops/cuda/roi_align_kernel.cu",
        "ops/autocast/roi_align_autocast.cpp",
    ):
        (tmp_path / "csrc" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "csrc" / name).touch()
    cpu, cuda = build.extension_sources(tmp_path)
    assert cpu == [
        "csrc/module.cpp",
        "csrc/ops/autocast/roi_align_autocast.cpp",
        "csrc/ops/cpu/nms_kernel.cpp",
        "csrc/ops/cpu/roi_align_kernel.cpp",
        "csrc/ops/nms.cpp",
        "csrc/ops/roi_align.cpp",
    ]
    assert cuda == [
        "csrc/ops/cuda/nms_kernel.cu",
        "csrc/ops/cuda/roi_align_kernel.cu",
        "csrc/ops/cuda/roi_align_launch.cpp",
    ]


def test_the_repository_sources_are_the_module_and_every_op_file(build: ModuleType) -> None:
    cpu, cuda = build.extension_sources(ROOT)
    assert cpu[0] == "csrc/module.cpp"
    assert set(cpu[1:]) == {str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "ops").rglob("*.cpp")} - set(cuda)
    assert set(cuda) == {str(p.relative_to(ROOT)) for p in (ROOT / "csrc" / "ops").rglob("*.cu")}
