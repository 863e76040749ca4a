"""A forward pass through a pipeline whose stages live on several processes: point-to-point, micro-batch by micro-batch.

For evaluation (``validation_step``, ``test_step``, ``predict_step``), for the shapes that ``PipelineStage`` is built
with, and wherever the whole output is needed on every rank. The input is split into micro-batches along dim 0 and run
in GPipe's forward order: each rank runs its own stages in increasing stage index, and each stage every micro-batch in
turn; an output that goes on to another rank's stage leaves with ``isend`` (a small header of dtypes and shapes first,
so the receiver can allocate), and a rank receives a stage's input with a blocking ``recv`` just before it runs it.
The last stage's output is then broadcast to every rank of the pipeline, or kept on its own rank. Every rank of the
pipeline calls it; on CPU/gloo and GPU/NCCL alike (the tensors travel on the stage's ``device``).

Between stages a tensor or a tuple of tensors travels; a tuple is passed unpacked to the next stage, as
``torch.distributed.pipelining``'s ``PipelineStage`` does with its ``args``.

Why it cannot deadlock, whatever the placement: the only waits are the ``recv`` of a stage's input and, at the end,
the waits for this rank's sends and the broadcast. Order the work by (stage, micro-batch). The ``recv`` of
micro-batch ``m`` of stage ``s`` waits for the ``isend`` of micro-batch ``m`` of stage ``s - 1``, and the rank that
sends it has before it only work of a lower (stage, micro-batch), whose own waits are such receives; by induction
over that order every ``recv`` returns, and then every send has met its ``recv``. The messages of one stage boundary
carry the tag of the stage that receives them, so those of two boundaries between the same two ranks (loop and V
placements) cannot be taken for each other; within a boundary both sides go micro-batch by micro-batch, and gloo
matches sends and receives of one (peer, tag) in order. On NCCL the argument needs one more thing that gloo gives and
NCCL does not promise: ProcessGroupNCCL queues the sends and receives between two ranks on one stream, in the order
posted, and ignores tags. With one micro-batch both ranks post in the same order (as the stage-by-stage pass did); with
several, two ranks that exchange in both directions (loop and V placements) post in different orders, and a send larger
than NCCL's buffers could wait for a receive queued behind it.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeAlias

import torch
import torch.distributed as dist
from torch import Tensor, nn

__all__ = ["Activation", "StageExamples", "pipelined_forward"]

Activation: TypeAlias = "Tensor | tuple[Tensor, ...]"
"""What one stage gives the next: a tensor, or a tuple of tensors passed unpacked to the next stage."""

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
_META = 3  # micro-batches of the stage, tensors in the activation, 1 if they are a tuple
_FIELDS = 2 + _MAX_DIMS  # per tensor: dtype index, dims, shape padded with zeros
_OUTPUT_TO = ("all", "last")


@dataclass
class StageExamples:
    """What each stage of this rank took and gave for the first micro-batch: examples for ``PipelineStage``."""

    inputs: dict[int, Tensor | tuple[Tensor, ...]]
    outputs: dict[int, Tensor | tuple[Tensor, ...]]


def _tensors(value: Activation) -> tuple[Tensor, ...]:
    return value if isinstance(value, tuple) else (value,)


def _what(value: object) -> str:
    if isinstance(value, tuple):
        if not value:
            return "an empty tuple"
        position = next(i for i, item in enumerate(value) if not isinstance(item, Tensor))
        return f"a tuple whose item {position} is of type {type(value[position]).__name__}"
    return type(value).__name__


def _checked(value: object, stage: int) -> Activation:
    """``value`` if it is an activation the header can describe (a tuple subclass becomes a tuple), else TypeError."""
    if isinstance(value, Tensor):
        checked: Activation = value
    elif isinstance(value, tuple) and value and all(isinstance(item, Tensor) for item in value):
        checked = tuple(value)
    else:
        raise TypeError(
            f"pipeline stage {stage} returned {_what(value)}; the stages of strategy='pipeline' pass a tensor or a"
            " tuple of tensors to the next"
        )
    tensors = _tensors(checked)
    for position, tensor in enumerate(tensors):
        if tensor.dtype not in _DTYPES or tensor.dim() > _MAX_DIMS:
            where = f" as item {position} of a tuple" if isinstance(checked, tuple) else ""
            raise TypeError(
                f"pipeline stage {stage} returned a {tensor.dtype} tensor of {tensor.dim()} dims{where}; the stages of"
                f" strategy='pipeline' exchange tensors of up to {_MAX_DIMS} dims of dtypes {[str(d) for d in _DTYPES]}"
            )
    return checked


def _cloned(value: Activation) -> Activation:
    if isinstance(value, tuple):
        return tuple(tensor.detach().clone() for tensor in value)
    return value.detach().clone()


def _micro_batches(x: Activation, chunks: int, device: torch.device) -> list[Activation]:
    """``x`` on ``device``, split along dim 0 into ``min(chunks, batch)`` micro-batches (at least one)."""
    if not (isinstance(x, Tensor) or (isinstance(x, tuple) and x and all(isinstance(t, Tensor) for t in x))):
        raise TypeError(f"the pipeline's input is {_what(x)}; pass a tensor or a tuple of tensors")
    tensors = tuple(tensor.to(device) for tensor in _tensors(x))
    if chunks == 1:
        return [tensors if isinstance(x, tuple) else tensors[0]]
    sizes = [tuple(tensor.shape[:1]) for tensor in tensors]
    if any(size != sizes[0] for size in sizes) or sizes[0] == ():
        raise ValueError(
            f"with chunks={chunks} the pipeline's input is split along dim 0, which needs every tensor to have the"
            f" same size there; got shapes {[tuple(tensor.shape) for tensor in tensors]}"
        )
    pieces = [torch.tensor_split(tensor, max(1, min(chunks, sizes[0][0]))) for tensor in tensors]
    return [micro if isinstance(x, tuple) else micro[0] for micro in zip(*pieces, strict=True)]


def _concatenated(outputs: list[Activation], stage: int) -> Activation:
    """The micro-batch outputs of the last stage joined along dim 0 (the one output itself when there is one)."""
    if len(outputs) == 1:
        return outputs[0]
    if any(tensor.dim() == 0 for tensor in _tensors(outputs[0])):
        raise ValueError(
            f"pipeline stage {stage}, the last, returned a 0-dim tensor; with several micro-batches the last stage's"
            " outputs are joined along dim 0, so each must have one"
        )
    joined = tuple(torch.cat(parts) for parts in zip(*(_tensors(output) for output in outputs), strict=True))
    return joined if isinstance(outputs[0], tuple) else joined[0]


def _headers(value: Activation, micro_batches: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The two header messages: (micro-batches, tensors, is a tuple), then dtype, dims and shape per tensor."""
    tensors = _tensors(value)
    meta = torch.tensor([micro_batches, len(tensors), int(isinstance(value, tuple))], dtype=torch.int64, device=device)
    # dtypes and dims were checked by _checked when the stage returned them
    fields = [[_DTYPES.index(t.dtype), t.dim(), *t.shape, *[0] * (_MAX_DIMS - t.dim())] for t in tensors]
    return meta, torch.tensor(fields, dtype=torch.int64, device=device).reshape(-1)


def _empty_header(meta: Tensor, device: torch.device) -> Tensor:
    return torch.empty(int(meta[1]) * _FIELDS, dtype=torch.int64, device=device)


def _empties(header: Tensor, device: torch.device) -> list[Tensor]:
    fields = header.reshape(-1, _FIELDS).tolist()
    return [torch.empty(f[2 : 2 + f[1]], dtype=_DTYPES[f[0]], device=device) for f in fields]


def _assembled(meta: Tensor, tensors: list[Tensor]) -> Activation:
    return tuple(tensors) if int(meta[2]) else tensors[0]


class _Outbox:
    """This rank's sends in flight: each tensor is kept until its send is waited for."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device) -> None:
        self.group = group
        self.device = device
        self.pending: list[tuple[dist.Work, Tensor]] = []

    def send(self, value: Activation, micro_batches: int, to: int, tag: int) -> None:
        peer = dist.get_global_rank(self.group, to)
        headers = _headers(value, micro_batches, self.device)
        for tensor in (*headers, *(t.detach().contiguous() for t in _tensors(value))):
            work = dist.isend(tensor, peer, group=self.group, tag=tag)
            if work is not None:
                self.pending.append((work, tensor))

    def wait(self) -> None:
        for work, _ in self.pending:
            work.wait()
        self.pending.clear()


def _recv(source: int, tag: int, group: dist.ProcessGroup, device: torch.device) -> tuple[Activation, int]:
    """One micro-batch's activation from rank ``source`` of ``group``, and the number of micro-batches of its stage."""
    peer = dist.get_global_rank(group, source)
    meta = torch.empty(_META, dtype=torch.int64, device=device)
    dist.recv(meta, peer, group=group, tag=tag)
    header = _empty_header(meta, device)
    dist.recv(header, peer, group=group, tag=tag)
    tensors = _empties(header, device)
    for tensor in tensors:
        dist.recv(tensor, peer, group=group, tag=tag)
    return _assembled(meta, tensors), int(meta[0])


def _received(
    source: int, tag: int, group: dist.ProcessGroup, device: torch.device
) -> tuple[int, Iterator[Activation]]:
    """A stage's number of micro-batches and its inputs from rank ``source``, each received when asked for.

    The first is received at once: it carries the number.
    """
    first, count = _recv(source, tag, group, device)
    rest = (_recv(source, tag, group, device)[0] for _ in range(count - 1))
    return count, itertools.chain([first], rest)


def _broadcast(value: Activation | None, source: int, group: dist.ProcessGroup, device: torch.device) -> Activation:
    peer = dist.get_global_rank(group, source)
    if value is not None:
        meta, header = _headers(value, 1, device)
        dist.broadcast(meta, peer, group=group)
        dist.broadcast(header, peer, group=group)
        tensors = [tensor.detach().contiguous() for tensor in _tensors(value)]
    else:
        meta = torch.empty(_META, dtype=torch.int64, device=device)
        dist.broadcast(meta, peer, group=group)
        header = _empty_header(meta, device)
        dist.broadcast(header, peer, group=group)
        tensors = _empties(header, device)
    for tensor in tensors:
        dist.broadcast(tensor, peer, group=group)
    return _assembled(meta, tensors)


def pipelined_forward(
    x: Activation,
    stages: Mapping[int, nn.Module],
    owners: Sequence[int],
    rank: int,
    group: dist.ProcessGroup,
    device: torch.device,
    examples: StageExamples | None = None,
    *,
    chunks: int = 1,
    output_to: str = "all",
) -> Activation | None:
    """Run ``x`` through every stage of the pipeline, in micro-batches; the last stage's output.

    The work is GPipe's forward (Huang et al., 2019, "GPipe: Efficient Training of Giant Neural Networks using
    Pipeline Parallelism"): ``x`` is split along dim 0 into ``min(chunks, batch)`` micro-batches, sizes as even as
    ``torch.tensor_split`` makes them (the first ones one larger), at least one; each rank runs its stages in increasing
    index, each on every micro-batch in turn, and sends each output on as soon as it is computed. The result is the
    concatenation along dim 0 of the last stage's micro-batch outputs: equal to running the micro-batches one after
    another through the layers in one process (bitwise), and so to running the whole batch for layers that treat each
    sample alone (``BatchNorm`` in eval mode is such a layer; in training mode it would normalize over each
    micro-batch), up to the kernels' own dependence on the batch size (a float64 ``nn.Linear`` on MKL can differ in
    the last bit between batch sizes).

    A stage returns a tensor or a tuple of tensors; the next stage is called with them unpacked (``stage(*tensors)``),
    as ``torch.distributed.pipelining.PipelineStage`` passes its ``args``.

    Args:
        x (Tensor or tuple of Tensors): the pipeline's input, passed unpacked to stage 0; only the rank of stage 0
            reads it (the others learn the number of micro-batches from the messages). With ``chunks > 1`` each tensor
            is split along dim 0, so all must have the same size there.
        stages (dict[int, nn.Module]): this rank's stages by stage index, on ``device``.
        owners (Sequence[int]): for each stage index, the rank (in ``group``) that holds it; any placement (single,
            loop, V, several consecutive stages on one rank).
        rank (int): this rank in ``group``.
        group (ProcessGroup): the pipeline's ranks; every one of them calls this function.
        device (torch.device): this rank's device (where the tensors travel: CPU for gloo, the GPU for NCCL).
        examples (StageExamples, optional): filled with the input and output of the first micro-batch of each of this
            rank's stages (a tuple where several tensors), detached copies.
        chunks (int): the number of micro-batches, >= 1; a batch smaller than ``chunks`` gives one micro-batch per
            sample, an empty batch one micro-batch.
        output_to (str): ``"all"``: the last stage's output is broadcast to every rank of ``group`` and returned
            there, detached. ``"last"``: returned only on the rank of the last stage (as computed, not detached),
            ``None`` on the others; no broadcast.

    Returns:
        Tensor or tuple of Tensors or None: the last stage's output on ``device``, of its shape with the micro-batches
        joined along dim 0 (a tuple when the last stage returns one), or ``None`` per ``output_to``. Tensors of dtype
        float32/64, float16, bfloat16, int64/32/16/8, uint8 or bool with up to 8 dims travel.

    Raises:
        ValueError: ``chunks`` is not a positive int or ``output_to`` is neither ``"all"`` nor ``"last"`` (on every
            rank, before any message); the tensors of ``x`` differ in their size along dim 0 or one has no dims
            while ``chunks > 1``; the last stage returned a 0-dim tensor while there are several micro-batches.
        TypeError: ``x`` or a stage's output is not a tensor or a non-empty tuple of tensors (the stage is named), or
            a stage returned a tensor of another dtype or of more than 8 dims, wherever its next stage lives. The
            error is raised on the rank that ran the stage; its peers' waits then end per the backend (gloo: an error
            once the connection closes, or the group's timeout).
    """
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"`chunks` must be an int >= 1, got {chunks!r}")
    if output_to not in _OUTPUT_TO:
        raise ValueError(f"`output_to` must be one of {_OUTPUT_TO}, got {output_to!r}")
    last = len(owners) - 1
    outbox = _Outbox(group, device)
    held: list[Activation] = []  # the micro-batch outputs of the stage this rank ran last, when they stay here
    for stage in (s for s, owner in enumerate(owners) if owner == rank):
        inputs: Iterator[Activation]
        if stage == 0:
            split = _micro_batches(x, chunks, device)
            count, inputs = len(split), iter(split)
        elif owners[stage - 1] == rank:  # the previous stage ran just before, here
            count, inputs = len(held), iter(held)
        else:
            count, inputs = _received(owners[stage - 1], stage, group, device)
        following = owners[stage + 1] if stage < last else rank
        outputs: list[Activation] = []
        for micro, value in enumerate(inputs):
            if examples is not None and micro == 0:
                examples.inputs[stage] = _cloned(value)
            output = _checked(stages[stage](*_tensors(value)), stage)
            if examples is not None and micro == 0:
                examples.outputs[stage] = _cloned(output)
            if following == rank:
                outputs.append(output)
            else:
                outbox.send(output, count, following, tag=stage + 1)
        held = outputs
    outbox.wait()
    result = _concatenated(held, last) if owners[last] == rank else None
    if output_to == "last":
        return result
    return _broadcast(result, owners[last], group, device)
