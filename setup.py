"""Build of the compiled operators ``lightning_balanced._C``; all metadata lives in pyproject.toml.

Build against the installed torch: ``pip install --no-build-isolation -e ".[test]"``. One switch picks the build:

* ``LIGHTNING_BALANCED_CUDA=auto`` (default): CPU kernels always; CUDA kernels too when torch is a CUDA build, a GPU
  is visible or ``TORCH_CUDA_ARCH_LIST`` is set (torchvision's and mmcv's rule), *and* a usable CUDA toolkit is found
  (``nvcc`` runs, the toolkit has the CUDA runtime library and headers, and its major version is torch's). A toolkit
  that looks broken gives a CPU-only build and a warning, never a failed install.
* ``LIGHTNING_BALANCED_CUDA=1`` (``FORCE_CUDA=1`` is an alias): CPU + CUDA kernels, or fail naming what is missing.
* ``LIGHTNING_BALANCED_CUDA=0``: CPU kernels only.
* ``LIGHTNING_BALANCED_NO_EXT=1``: no extension at all; the ops fall back to pure PyTorch (and warn once).

The extension always links the shared libstdc++, the very file torch loaded, even when the compiler links it
statically (``-static-libstdc++`` in ``LDFLAGS`` or in its specs) or ships only ``libstdc++.a``: a private copy breaks
the C++ streams ``TORCH_CHECK`` formats its messages with (truncated messages, or a crash). After linking, the
``.so``'s dynamic section is read; one that still needs no ``libstdc++.so`` is deleted and the build fails naming the
cause (on Linux).

The toolkit is ``CUDA_HOME`` (or ``CUDA_PATH``) when set, else the directory of ``nvcc``'s real executable (symlinks
and wrapper scripts followed, as ``nvcc`` itself reports it), else ``/usr/local/cuda``. torch's own guess, the parent
of the directory holding ``nvcc`` on the PATH, is wrong when that is a symlink or wrapper outside the toolkit.
Architectures: ``TORCH_CUDA_ARCH_LIST`` when set, else the visible GPUs' (torch's rule), else, with no GPU visible,
the architectures the installed torch was built for that this ``nvcc`` can compile (as torchvision and mmcv fall back
to a default list).
"""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import sys
import warnings
from pathlib import Path
from typing import Any

from setuptools import setup

ROOT = Path(__file__).parent
PY_LIMITED_API = "cp310"  # the stable-ABI floor, matching requires-python
PY_LIMITED_API_HEX = "0x030A0000"
SWITCH = "LIGHTNING_BALANCED_CUDA"


class ToolkitError(Exception):
    """The CUDA toolkit is missing or unusable; the message names the missing piece."""


def _say(message: str) -> None:
    print(f"lightning_balanced: {message}", file=sys.stderr, flush=True)


def _cuda_mode() -> str:
    """``"auto"``, ``"0"`` or ``"1"`` from ``LIGHTNING_BALANCED_CUDA`` (``FORCE_CUDA=1`` is an alias of ``1``)."""
    mode = os.environ.get(SWITCH, "").strip().lower()
    if not mode:
        return "1" if os.environ.get("FORCE_CUDA", "0") == "1" else "auto"
    if mode not in ("auto", "0", "1"):
        raise SystemExit(f"lightning_balanced: {SWITCH} must be auto, 0 or 1, got {mode!r}")
    return mode


def _run(*cmd: str) -> str:
    """The output (stdout, then stderr) of a command that must succeed within a minute."""
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True)
    return done.stdout + done.stderr


def _nvcc_reported_home(nvcc: str) -> Path | None:
    """The toolkit directory as ``nvcc`` itself reports it (``_HERE_`` of a dry run is its real ``bin``)."""
    try:
        out = _run(nvcc, "--dryrun", "-v", "-x", "cu", "-c", os.devnull, "-o", os.devnull)
    except (OSError, subprocess.SubprocessError):
        return None
    found = re.search(r"^#\$ _HERE_=(.+)$", out, re.MULTILINE)
    return Path(found.group(1).strip()).parent if found else None


def _toolkit_candidates() -> list[tuple[Path, str]]:
    """Where the toolkit may be, in order, each with where that guess comes from."""
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            return [(Path(os.environ[var]), var)]  # an explicit choice is the only candidate
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc is not None:
        candidates.append((Path(os.path.realpath(nvcc)).parent.parent, f"the real path of {nvcc}"))
        reported = _nvcc_reported_home(nvcc)
        if reported is not None:
            candidates.append((reported, f"{nvcc} --dryrun"))
    candidates.append((Path("/usr/local/cuda"), "the default location"))
    return candidates


def _check_toolkit(home: Path) -> str:
    """The toolkit's ``major.minor`` version; raises :class:`ToolkitError` naming what is missing."""
    nvcc = home / "bin" / ("nvcc.exe" if os.name == "nt" else "nvcc")
    if not nvcc.exists():
        raise ToolkitError(f"no nvcc at {nvcc}")
    if not (home / "include" / "cuda_runtime.h").exists():
        raise ToolkitError(f"no CUDA runtime headers (include/cuda_runtime.h) in {home}")
    lib_dirs = [home / "lib64", home / "lib", home / "lib" / "x64"]
    if not any(p.name.startswith(("libcudart.so", "cudart.lib")) for d in lib_dirs if d.is_dir() for p in d.iterdir()):
        raise ToolkitError(f"no CUDA runtime library (libcudart) in {', '.join(str(d) for d in lib_dirs)}")
    try:
        version = re.search(r"release (\d+\.\d+)", _run(str(nvcc), "--version"))
    except (OSError, subprocess.SubprocessError) as err:
        raise ToolkitError(f"{nvcc} --version failed: {err}") from err
    if version is None:
        raise ToolkitError(f"{nvcc} --version printed no release number")
    return version.group(1)


def _find_toolkit(torch_cuda: str) -> tuple[Path, str]:
    """The first usable toolkit whose major version is torch's; raises :class:`ToolkitError` saying why none is."""
    problems = []
    for home, source in _toolkit_candidates():
        try:
            version = _check_toolkit(home)
        except ToolkitError as err:
            problems.append(f"{home} (from {source}): {err}")
            continue
        if version.split(".")[0] != torch_cuda.split(".")[0]:
            problems.append(f"{home} (from {source}): CUDA {version}, but torch was built with CUDA {torch_cuda}")
            continue
        return home, version
    raise ToolkitError("no usable CUDA toolkit: " + "; ".join(problems))


def _default_arch_list(nvcc: Path) -> str:
    """The architectures of torch's build that ``nvcc`` can compile, as ``TORCH_CUDA_ARCH_LIST`` (newest also PTX)."""
    import torch

    try:
        supported = set(re.findall(r"compute_(\d+)", _run(str(nvcc), "--list-gpu-arch")))
    except (OSError, subprocess.SubprocessError):
        supported = set()
    archs = []
    for arch in torch.cuda.get_arch_list():
        number = re.fullmatch(r"sm_(\d+)([a-z]?)", arch)
        if number is None or (supported and number.group(1) not in supported):
            continue
        digits, suffix = number.groups()
        archs.append(f"{digits[:-1]}.{digits[-1]}{suffix}")
    if not archs:
        raise ToolkitError(
            f"none of torch's CUDA architectures {torch.cuda.get_arch_list()} can be compiled by {nvcc}; "
            "set TORCH_CUDA_ARCH_LIST"
        )
    return ";".join([*archs[:-1], archs[-1] + "+PTX"])


def _plan_cuda(mode: str) -> bool:
    """Decide on the CUDA kernels; set ``CUDA_HOME`` and ``TORCH_CUDA_ARCH_LIST`` for torch when building them."""
    import torch

    if mode == "0":
        _say(f"building CPU kernels only ({SWITCH}=0; torch {torch.__version__})")
        return False
    if torch.version.cuda is None:
        if mode == "1":
            raise SystemExit(
                f"lightning_balanced: {SWITCH}=1 (or FORCE_CUDA=1) asks for CUDA kernels, but torch "
                f"{torch.__version__} is a CPU build. Install a CUDA build of torch, or set {SWITCH}=0."
            )
        _say(f"building CPU kernels only (torch {torch.__version__} is a CPU build)")
        return False
    if mode == "auto" and not os.environ.get("TORCH_CUDA_ARCH_LIST") and torch.cuda.device_count() == 0:
        # As torchvision and mmcv decide: no GPU to build for. A GPU image built on a CPU node says so explicitly.
        _say(
            f"building CPU kernels only: no GPU is visible and TORCH_CUDA_ARCH_LIST is not set (torch"
            f" {torch.__version__}). To build the CUDA kernels here anyway, for a GPU machine elsewhere, set {SWITCH}=1"
            " (or FORCE_CUDA=1; every architecture torch supports, minutes) or TORCH_CUDA_ARCH_LIST (those only)"
        )
        return False
    try:
        home, version = _find_toolkit(torch.version.cuda)
        if not os.environ.get("TORCH_CUDA_ARCH_LIST") and torch.cuda.device_count() == 0:
            os.environ["TORCH_CUDA_ARCH_LIST"] = _default_arch_list(home / "bin" / "nvcc")
    except ToolkitError as err:
        if mode == "1":
            raise SystemExit(
                f"lightning_balanced: {SWITCH}=1 (or FORCE_CUDA=1) asks for CUDA kernels, but {err}. Set CUDA_HOME "
                f"to the toolkit directory, or {SWITCH}=0 for the CPU kernels only."
            ) from err
        warnings.warn(
            f"lightning_balanced: building CPU kernels only: torch {torch.__version__} has CUDA, but {err}. "
            f"Set CUDA_HOME to a CUDA {torch.version.cuda.split('.')[0]}.x toolkit to build the CUDA kernels, or "
            f"{SWITCH}=0 to silence this.",
            stacklevel=1,
        )
        return False
    os.environ["CUDA_HOME"] = str(home)  # read by torch.utils.cpp_extension on import
    archs = os.environ.get("TORCH_CUDA_ARCH_LIST") or "those of the visible GPUs"
    _say(f"building CPU + CUDA kernels (torch {torch.__version__}, CUDA {version} at {home}, archs {archs})")
    return True


def needed_libraries(path: Path) -> list[str] | None:
    """The ``DT_NEEDED`` entries (dynamic dependencies) of an ELF shared object; ``None`` when it is not ELF.

    Read with the standard library (no ``readelf``): the section headers give the ``SHT_DYNAMIC`` section and its
    string table, whose entries the ``DT_NEEDED`` tags index.
    """
    data = path.read_bytes()
    if data[:4] != b"\x7fELF":
        return None
    wide, order = data[4] == 2, "<" if data[5] == 1 else ">"
    header = struct.Struct(order + ("HHIQQQIHHHHHH" if wide else "HHIIIIIHHHHHH"))
    shoff, shentsize, shnum = (header.unpack_from(data, 16)[i] for i in (5, 10, 11))
    section = struct.Struct(order + ("IIQQQQIIQQ" if wide else "IIIIIIIIII"))
    sections = [section.unpack_from(data, shoff + i * shentsize) for i in range(shnum)]
    entry = struct.Struct(order + ("qQ" if wide else "iI"))
    needed = []
    for _, kind, _, _, offset, size, link, _, _, _ in sections:
        if kind != 6:  # SHT_DYNAMIC
            continue
        strings = sections[link][4]
        for tag, value in entry.iter_unpack(data[offset : offset + size - size % entry.size]):
            if tag == 1:  # DT_NEEDED
                end = data.index(b"\0", strings + value)
                needed.append(data[strings + value : end].decode())
    return needed


def loaded_libstdcxx(maps: Path = Path("/proc/self/maps")) -> Path | None:
    """The shared libstdc++ this process has loaded (torch's own, once torch is imported); ``None`` when none is.

    Read from the memory maps of the process (Linux); ``None`` elsewhere or when they cannot be read.
    """
    try:
        text = maps.read_text()
    except OSError:
        return None
    for line in text.splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and re.search(r"/libstdc\+\+\.so(\.[0-9]+)*$", fields[5]):
            return Path(fields[5])
    return None


def libstdcxx_link_args(platform: str = sys.platform, loaded: Path | None = None) -> list[str]:
    """The arguments that make the link take the shared libstdc++, whatever the compiler does on its own.

    The shared library is named by its file: the one torch loaded in this process (:func:`loaded_libstdcxx`, so the
    extension uses the same library as torch), else ``-l:libstdc++.so.6``. A plain ``-lstdc++`` is not enough: a
    compiler may link it statically (``-static-libstdc++`` in ``LDFLAGS`` or in its specs: the driver appends
    ``-Bstatic -lstdc++ -Bdynamic``), or ship only ``libstdc++.a``, so that every ``-lstdc++``, even after
    ``-Wl,-Bdynamic``, resolves to the archive (a GCC install seen on a GPU machine). With the shared library on the
    link line first, every libstdc++ symbol is resolved from it, and nothing is taken from an archive the driver adds.
    Nothing on other platforms (macOS and Windows builds of torch do not use libstdc++).
    """
    if not platform.startswith("linux"):
        return []
    return ["-Wl,-Bdynamic", str(loaded) if loaded is not None else "-l:libstdc++.so.6"]


def check_shared_libstdcxx(path: Path, platform: str = sys.platform) -> None:
    """Raise ``SystemExit`` (after deleting ``path``) when an ELF ``path`` carries its own static libstdc++.

    Linux only, as torch's Linux builds use libstdc++; elsewhere (macOS, Windows, a BSD's libc++) nothing is checked.
    """
    if not platform.startswith("linux"):
        return
    needed = needed_libraries(path)
    if needed is None or any(name.startswith("libstdc++.so") for name in needed):
        return
    path.unlink()
    dependencies = ", ".join(needed) or "none"
    raise SystemExit(
        f"lightning_balanced: the linked {path.name} needs no libstdc++.so (it needs {dependencies}): the "
        "compiler linked libstdc++ statically, so the extension would carry a private copy beside torch's, and "
        "TORCH_CHECK messages would come out truncated or crash the process. Remove -static-libstdc++ from LDFLAGS, "
        "or build with a compiler that links the shared libstdc++ (e.g. CXX=/usr/bin/g++). The file was deleted."
    )


def extension_sources(root: Path) -> tuple[list[str], list[str]]:
    """The sources of ``_C``, relative to ``root``: the C++ ones, and those that need a CUDA build.

    ``csrc/module.cpp`` and every ``.cpp`` under ``csrc/ops/``, except that the ``.cu`` files and anything in a
    ``cuda/`` folder compile only with the CUDA kernels. A new op is its own files: nothing here names one.
    """
    csrc = root / "csrc"
    found = sorted(p for suffix in ("*.cpp", "*.cu") for p in (csrc / "ops").rglob(suffix))
    cuda = [p for p in found if p.suffix == ".cu" or "cuda" in p.relative_to(csrc).parts]
    cpu = [csrc / "module.cpp", *(p for p in found if p not in cuda)]
    return [str(p.relative_to(root)) for p in cpu], [str(p.relative_to(root)) for p in cuda]


def _extensions() -> tuple[list, dict]:
    if os.environ.get("LIGHTNING_BALANCED_NO_EXT", "0") == "1":
        _say("building no extension (LIGHTNING_BALANCED_NO_EXT=1); the ops will run a pure-PyTorch fallback")
        return [], {}
    use_cuda = _plan_cuda(_cuda_mode())
    from torch.utils import cpp_extension

    sources, cuda_sources = extension_sources(ROOT)
    cxx_flags = ["-O3", "-ffp-contract=off", f"-DPy_LIMITED_API={PY_LIMITED_API_HEX}"]
    extra_compile_args = {"cxx": cxx_flags}
    extension = cpp_extension.CppExtension
    if use_cuda:
        cpp_extension.CUDA_HOME = os.environ["CUDA_HOME"]  # in case cpp_extension was imported before we chose
        sources += cuda_sources
        # --threads 0: nvcc compiles the architectures in parallel, one per core
        extra_compile_args["nvcc"] = ["-O3", "--fmad=false", "--threads", "0", "-DLIGHTNING_BALANCED_WITH_CUDA"]
        cxx_flags.append("-DLIGHTNING_BALANCED_WITH_CUDA")
        extension = cpp_extension.CUDAExtension
    extra_link_args = libstdcxx_link_args(loaded=loaded_libstdcxx())  # torch, imported above, loaded it
    # Measured on 2 cores (torch 2.13.0 CPU, 2026-11-28): 35 s for the C++ sources from scratch; the CUDA kernels for
    # every architecture torch supports take minutes more. A second install recompiles only what changed.
    _say(
        f"compiling {len(sources)} source file(s) with ninja on {os.cpu_count()} core(s): about 35 s on 2 cores"
        + (", then the CUDA kernels (minutes for every architecture)" if use_cuda else "")
    )
    ext = extension(
        "lightning_balanced._C",
        sources,
        include_dirs=[str(ROOT / "csrc")],
        extra_compile_args=extra_compile_args,
        extra_link_args=extra_link_args,
        py_limited_api=True,
    )

    import torch

    # Object files in build/ under the repository, one folder per torch release and kernel set: pip's editable install
    # hands setuptools a fresh temporary folder each time, so every reinstall compiled everything again (minutes with
    # CUDA kernels); here ninja recompiles only what changed.
    objects = ROOT / "build" / f"objects-torch{torch.__version__}-{'cuda' if use_cuda else 'cpu'}"

    class BuildExtension(cpp_extension.BuildExtension):
        """torch's ``BuildExtension``, objects kept in ``build/``; then the check that the ``.so`` uses libstdc++.so."""

        def finalize_options(self) -> None:
            super().finalize_options()
            self.build_temp = str(objects)

        def build_extension(self, ext: Any) -> None:
            super().build_extension(ext)
            check_shared_libstdcxx(Path(self.get_ext_fullpath(ext.name)))

    return [ext], {"build_ext": BuildExtension}


if __name__ == "__main__":  # setuptools runs this file as __main__; tests import its functions without building
    ext_modules, cmdclass = _extensions()
    setup(
        ext_modules=ext_modules,
        cmdclass=cmdclass,
        options={"bdist_wheel": {"py_limited_api": PY_LIMITED_API}} if ext_modules else {},
    )
