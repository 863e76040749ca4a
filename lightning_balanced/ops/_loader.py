"""Loading of the compiled operators ``lightning_balanced._C`` and the one warning when they are missing."""

from __future__ import annotations

import importlib
import warnings
from types import ModuleType

import torch

__all__ = [
    "CompiledOpsMissingWarning",
    "has_compiled_ops",
    "has_kernel",
    "registered_kernels",
    "warn_fallback_once",
]


class CompiledOpsMissingWarning(UserWarning):
    """The compiled operators are not available; a slower pure-PyTorch fallback runs instead."""


def _load() -> tuple[ModuleType | None, str | None]:
    try:
        # Importing the extension runs its TORCH_LIBRARY registrations (torch.ops.lightning_balanced.*).
        return importlib.import_module("lightning_balanced._C"), None
    except (ImportError, OSError) as err:  # not built, or built against another torch
        return None, f"{type(err).__name__}: {err}"


_C, _LOAD_ERROR = _load()

NAMESPACE = "lightning_balanced"

# The dispatch keys whose kernels the ops may have, by device type.
_DISPATCH_KEYS = {"cpu": "CPU", "cuda": "CUDA"}


def _registered_kernels() -> dict[str, tuple[str, ...]]:
    """Each public op of the extension (its schema name, e.g. ``"nms"``) and the device types it has a kernel for.

    Read from the dispatcher, so the list follows the schemas the extension registered (``csrc/ops/<op>.cpp``) and
    the kernels it was built with (the CUDA ones exist only in CUDA builds); no op is named here. Private ops (a
    name starting with ``_``, e.g. the CPU emulation ``_nms_tiled_schedule`` that the tests call) are left out.
    """
    if _C is None:
        return {}
    prefix = f"{NAMESPACE}::"
    return {
        name.removeprefix(prefix): tuple(
            device_type
            for device_type, key in _DISPATCH_KEYS.items()
            if torch._C._dispatch_has_kernel_for_dispatch_key(name, key)
        )
        for name in sorted(torch._C._dispatch_get_all_op_names())
        if name.startswith(prefix) and not name.removeprefix(prefix).startswith("_")
    }


# Tuples, not frozensets: `has_kernel` runs inside `torch.compile`d code, and Dynamo before torch 2.5 cannot trace
# `frozenset` (tuple membership it can).
_KERNELS: dict[str, tuple[str, ...]] = _registered_kernels()

_warned = False


def has_compiled_ops() -> bool:
    """Whether ``lightning_balanced._C`` loaded, i.e. ``torch.ops.lightning_balanced.nms`` is registered."""
    return _C is not None


def has_kernel(device_type: str, op: str = "nms") -> bool:
    """Whether the compiled operator ``op`` has a kernel for ``device_type`` (``"cpu"``, ``"cuda"``)."""
    return device_type in _KERNELS.get(op, ())


def registered_kernels() -> dict[str, frozenset[str]]:
    """Each compiled op (``"nms"``, ``"batched_nms"``, ...) and its device types with a kernel; empty without ``_C``."""
    return {op: frozenset(device_types) for op, device_types in _KERNELS.items()}


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
