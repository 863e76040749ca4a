"""A forward pass through a pipeline whose stages live on several processes: point-to-point, stage after stage.

For evaluation (``validation_step``, ``test_step``, ``predict_step``), for the shapes that ``PipelineStage`` is built
with, and wherever the whole output is needed on every rank: each rank runs its own stages in stage order, hands the
activation to the rank of the next stage (``send``/``recv``, with a small header of dtype and shape so the receiver
can allocate), and the last stage's output is broadcast to every rank of the pipeline. Every rank of the pipeline calls
it with the same input; on CPU/gloo and GPU/NCCL alike (the tensors travel on the stage's ``device``).

Between stages a single tensor travels, as ``torch.distributed.pipelining`` requires of a sequential pipeline.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["StageExamples", "pipelined_forward"]

_DTYPES = (
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
)
_MAX_DIMS = 8


@dataclass
class StageExamples:
    """What one stage of this rank took and gave in a forward pass: example tensors for ``PipelineStage``."""

    inputs: dict[int, Tensor]
    outputs: dict[int, Tensor]


def _header(tensor: Tensor, device: torch.device) -> Tensor:
    if tensor.dtype not in _DTYPES or tensor.dim() > _MAX_DIMS:
        raise TypeError(
            f"a pipeline stage passed a {tensor.dtype} tensor of {tensor.dim()} dims to the next; the stages of"
            f" strategy='pipeline' exchange tensors of up to {_MAX_DIMS} dims of dtypes {[str(d) for d in _DTYPES]}"
        )
    values = [_DTYPES.index(tensor.dtype), tensor.dim(), *tensor.shape] + [0] * (_MAX_DIMS - tensor.dim())
    return torch.tensor(values, dtype=torch.int64, device=device)


def _empty_from(header: Tensor, device: torch.device) -> Tensor:
    values = header.tolist()
    return torch.empty(values[2 : 2 + values[1]], dtype=_DTYPES[values[0]], device=device)


def _send(tensor: Tensor, to: int, group: dist.ProcessGroup, device: torch.device) -> None:
    peer = dist.get_global_rank(group, to)
    dist.send(_header(tensor, device), peer, group=group)
    dist.send(tensor.detach().contiguous(), peer, group=group)


def _recv(source: int, group: dist.ProcessGroup, device: torch.device) -> Tensor:
    peer = dist.get_global_rank(group, source)
    header = torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=device)
    dist.recv(header, peer, group=group)
    tensor = _empty_from(header, device)
    dist.recv(tensor, peer, group=group)
    return tensor


def _broadcast(tensor: Tensor | None, source: int, group: dist.ProcessGroup, device: torch.device) -> Tensor:
    peer = dist.get_global_rank(group, source)
    header = (
        _header(tensor, device) if tensor is not None else torch.empty(2 + _MAX_DIMS, dtype=torch.int64, device=device)
    )
    dist.broadcast(header, peer, group=group)
    out = tensor.detach().contiguous() if tensor is not None else _empty_from(header, device)
    dist.broadcast(out, peer, group=group)
    return out


def pipelined_forward(
    x: Tensor,
    stages: Mapping[int, nn.Module],
    owners: Sequence[int],
    rank: int,
    group: dist.ProcessGroup,
    device: torch.device,
    examples: StageExamples | None = None,
) -> Tensor:
    """Run ``x`` through every stage of the pipeline; the last stage's output, on ``device``, on every rank.

    Args:
        x (Tensor): the pipeline's input, the same on every rank (only the rank of stage 0 reads it).
        stages (dict[int, nn.Module]): this rank's stages by stage index, on ``device``.
        owners (Sequence[int]): for each stage index, the rank (in ``group``) that holds it.
        rank (int): this rank in ``group``.
        group (ProcessGroup): the pipeline's ranks.
        device (torch.device): this rank's device (where the tensors travel: CPU for gloo, the GPU for NCCL).
        examples (StageExamples, optional): filled with each of this rank's stages' input and output.

    Returns:
        Tensor: the output of the last stage, detached when it travelled.

    Raises:
        TypeError: a stage returned something other than a tensor, or a tensor the header cannot describe.
    """
    value: Tensor | None = x.to(device) if owners[0] == rank else None
    for stage, owner in enumerate(owners):
        following = owners[stage + 1] if stage + 1 < len(owners) else None
        if owner == rank:
            assert value is not None
            if examples is not None:
                examples.inputs[stage] = value.detach().clone()
            value = stages[stage](value)
            if not isinstance(value, Tensor):
                raise TypeError(
                    f"pipeline stage {stage} returned {type(value).__name__}; the stages of strategy='pipeline' pass"
                    " one tensor to the next"
                )
            if examples is not None:
                examples.outputs[stage] = value.detach().clone()
            if following is not None and following != rank:
                _send(value, following, group, device)
                value = None
        elif following == rank:
            value = _recv(owner, group, device)
    return _broadcast(value if owners[-1] == rank else None, owners[-1], group, device)
