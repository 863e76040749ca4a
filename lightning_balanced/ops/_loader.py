"""Loading of the compiled operators ``lightning_balanced._C`` and the one warning when they are missing."""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType

import torch

__all__ = ["CompiledOpsMissingWarning", "has_compiled_ops", "has_kernel", "warn_fallback_once"]


class CompiledOpsMissingWarning(UserWarning):
    """The compiled operators are not available; a slower pure-PyTorch fallback runs instead."""


def _load() -> tuple[ModuleType | None, str | None]:
    try:
        # Importing the extension runs its TORCH_LIBRARY registrations (torch.ops.lightning_balanced.*).
        return importlib.import_module("lightning_balanced._C"), None
    except (ImportError, OSError) as err:  # not built, or built against another torch
        return None, f"{type(err).__name__}: {err}"


_C, _LOAD_ERROR = _load()

# Which devices have a compiled kernel (the CUDA one exists only in CUDA builds of the extension).
_KERNELS: dict[str, bool] = {
    device_type: _C is not None and bool(torch._C._dispatch_has_kernel_for_dispatch_key("lightning_balanced::nms", key))
    for device_type, key in (("cpu", "CPU"), ("cuda", "CUDA"))
}

_warned = False


def has_compiled_ops() -> bool:
    """Whether ``lightning_balanced._C`` loaded, i.e. ``torch.ops.lightning_balanced.nms`` is registered."""
    return _C is not None


def has_kernel(device_type: str) -> bool:
    """Whether the compiled operators have a kernel for ``device_type`` (``"cpu"``, ``"cuda"``)."""
    return _KERNELS.get(device_type, False)


def warn_fallback_once(device_type: str) -> None:
    """Warn, once per process, that the pure-PyTorch fallback runs and how to get the compiled ops."""
    global _warned
    if _warned:
        return
    _warned = True
    if _C is None:
        why = f"lightning_balanced._C could not be imported ({_LOAD_ERROR})"
    else:
        why = f"lightning_balanced._C was built without a kernel for {device_type!r} tensors"
    warnings.warn(
        f"{why}. lightning_balanced.ops.nms and batched_nms now run a pure-PyTorch fallback (one Python step "
        "per kept box; much slower on large inputs, same results). To build the compiled ops, run "
        "`pip install --no-build-isolation -e .` in the source tree with a C++ compiler available "
        "(without LIGHTNING_BALANCED_NO_EXT=1; for the CUDA kernels, a CUDA build of torch and a CUDA toolkit, or "
        "LIGHTNING_BALANCED_CUDA=1 to fail loudly when one is missing).",
        CompiledOpsMissingWarning,
        stacklevel=3,
    )
