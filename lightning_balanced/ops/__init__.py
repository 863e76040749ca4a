"""Detection operators: :func:`nms`, :func:`batched_nms` and :func:`batched_nms_padded`.

The compiled kernels live in ``lightning_balanced._C`` (``torch.ops.lightning_balanced.*``); without them the
functions fall back to the pure-PyTorch reference and warn once (:class:`CompiledOpsMissingWarning`).
"""

from lightning_balanced.ops._loader import CompiledOpsMissingWarning, has_compiled_ops, registered_kernels
from lightning_balanced.ops.nms import batched_nms, batched_nms_padded, nms
from lightning_balanced.ops.nms_reference import batched_nms_padded_reference, batched_nms_reference, nms_reference

__all__ = [
    "CompiledOpsMissingWarning",
    "batched_nms",
    "batched_nms_padded",
    "batched_nms_padded_reference",
    "batched_nms_reference",
    "has_compiled_ops",
    "nms",
    "nms_reference",
    "registered_kernels",
]
