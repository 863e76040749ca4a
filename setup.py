"""Build of the compiled operators ``lightning_balanced._C``; all metadata lives in pyproject.toml.

* default: a ``CppExtension`` (CPU kernels, autocast registration);
* a ``CUDAExtension`` (adds ``csrc/cuda/*.cu``) when torch was built with CUDA and ``CUDA_HOME`` is set,
  or when ``FORCE_CUDA=1``;
* ``LIGHTNING_BALANCED_NO_EXT=1`` builds no extension; the ops then fall back to pure PyTorch (and say so).

Build against the installed torch: ``pip install --no-build-isolation -e ".[test]"``.
"""

import os
from pathlib import Path

from setuptools import setup

ROOT = Path(__file__).parent
PY_LIMITED_API = "cp310"  # the stable-ABI floor, matching requires-python
PY_LIMITED_API_HEX = "0x030A0000"


def _extensions():
    if os.environ.get("LIGHTNING_BALANCED_NO_EXT", "0") == "1":
        return [], {}
    import torch
    from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension

    use_cuda = os.environ.get("FORCE_CUDA", "0") == "1" or (torch.version.cuda is not None and CUDA_HOME is not None)
    csrc = Path("csrc")
    sources = [str(csrc / "nms.cpp"), str(csrc / "cpu" / "nms_kernel.cpp"), str(csrc / "autocast" / "nms_autocast.cpp")]
    cxx_flags = ["-O3", "-ffp-contract=off", f"-DPy_LIMITED_API={PY_LIMITED_API_HEX}"]
    extra_compile_args = {"cxx": cxx_flags}
    extension = CppExtension
    if use_cuda:
        sources.append(str(csrc / "cuda" / "nms_kernel.cu"))
        extra_compile_args["nvcc"] = ["-O3", "--fmad=false", "-DLIGHTNING_BALANCED_WITH_CUDA"]
        cxx_flags.append("-DLIGHTNING_BALANCED_WITH_CUDA")
        extension = CUDAExtension
    ext = extension(
        "lightning_balanced._C",
        sources,
        extra_compile_args=extra_compile_args,
        py_limited_api=True,
    )
    return [ext], {"build_ext": BuildExtension}


ext_modules, cmdclass = _extensions()
setup(
    ext_modules=ext_modules,
    cmdclass=cmdclass,
    options={"bdist_wheel": {"py_limited_api": PY_LIMITED_API}} if ext_modules else {},
)
