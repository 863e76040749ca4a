"""Activation checkpointing for pipeline tasks: ``Checkpoint`` now, ``Recompute`` in backward.

``Checkpoint`` runs a partition without keeping its activations; ``Recompute`` runs it again in backward, just before
its gradient is needed.

The pair shares one :class:`Checkpointing` per task. ``Recompute`` hangs off the checkpoint's output through a
fork/join edge, so the autograd engine runs it before ``Checkpoint``'s backward, which then backpropagates through the
recomputed graph. The recomputation re-enters the task's autocast (thread-local, and the engine's threads have none),
replays the task's random numbers (same dropout masks), leaves plain BatchNorm running statistics alone and enters
the recompute mode (:mod:`lightning_balanced.pipeline.recompute`), which tells
:class:`~lightning_balanced.pipeline.DeferredBatchNorm` not to count the micro-batch twice.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any

import torch
from torch import Tensor

from lightning_balanced.gpipe.dependency import fork, join, phony
from lightning_balanced.gpipe.modes import ThreadModes
from lightning_balanced.gpipe.partition import Partition
from lightning_balanced.gpipe.rng import seeded
from lightning_balanced.pipeline.microbatch import flatten
from lightning_balanced.pipeline.recompute import is_recomputing, recomputing

# ``is_recomputing`` stays importable from here, where it was defined before it moved to ``pipeline.recompute``.
__all__ = ["Checkpointing", "is_recomputing"]


class Checkpointing:
    """The state one checkpointed task shares between its ``Checkpoint`` and ``Recompute`` nodes.

    Args:
        partition: the layers to run.
        modes: the task's grad/inference/autocast modes (autocast is re-entered by the recomputation).
        seed: the task's random seed, or ``None`` when the partition draws no random numbers.
    """

    def __init__(self, partition: Partition, modes: ThreadModes, seed: int | None) -> None:
        self.partition = partition
        self.modes = modes
        self.seed = seed
        self.recomputed: list[tuple[list[Tensor], list[Tensor]]] = []
        self.rebuild_output: Callable[[Sequence[Tensor]], Any] | None = None

    def run(self, value: Any, *, recompute: bool = False) -> Any:
        """Run the partition on ``value``, with the task's random numbers."""
        with ExitStack() as stack:
            if self.seed is not None:
                stack.enter_context(seeded(self.partition.device, self.seed))
            if recompute:
                stack.enter_context(self.modes.for_recompute().enter())
                stack.enter_context(recomputing())
                stack.enter_context(self.partition.frozen_batchnorm_statistics())
            return self.partition(value)

    def checkpoint(self, value: Any) -> Any:
        """Run the partition on ``value`` without keeping activations; returns its output, differentiable."""
        tensors, rebuild = flatten(value)
        # A phony that requires grad keeps Checkpoint in the graph even when no input requires grad.
        edge = phony(self.partition.device, requires_grad=True)
        outputs = _Checkpoint.apply(edge, self, rebuild, *tensors)
        assert self.rebuild_output is not None
        return self.rebuild_output(outputs)

    def recompute(self, value: Any, output: Any) -> Any:
        """Hang ``Recompute`` (of the partition on ``value``) off ``output``; returns ``output`` to be used instead."""
        tensors, rebuild = flatten(value)
        out_tensors, rebuild_output = flatten(output)
        lane = next((k for k, t in enumerate(out_tensors) if t.requires_grad), 0)
        out_tensors[lane], edge = fork(out_tensors[lane])
        edge = _Recompute.apply(edge, self, rebuild, *tensors)
        out_tensors[lane] = join(out_tensors[lane], edge)
        return rebuild_output(out_tensors)


class _Checkpoint(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, edge: Tensor, state: Checkpointing, rebuild: Callable[[Sequence[Tensor]], Any], *inputs: Tensor
    ) -> tuple[Tensor, ...]:
        ctx.state = state
        with torch.no_grad():
            output = state.run(rebuild(inputs))
        tensors, state.rebuild_output = flatten(output)
        return tuple(tensors)

    @staticmethod
    def backward(ctx: Any, *grad_outputs: Tensor) -> tuple[Tensor | None, ...]:
        state: Checkpointing = ctx.state
        if not state.recomputed:
            raise RuntimeError("gpipe: a checkpointed partition was not recomputed before its backward")
        outputs, leaves = state.recomputed.pop()
        pairs = [(o, g) for o, g in zip(outputs, grad_outputs, strict=True) if o.requires_grad and g is not None]
        if pairs:
            # Autograd keeps gradients on their tensors' devices itself; the CPU emulation's device tags (which the
            # engine does not carry through) are not checked here.
            with torch._C.DisableTorchFunctionSubclass():
                torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads = tuple(leaf.grad if leaf.requires_grad else None for leaf in leaves)
        return (None, None, None, *grads)


class _Recompute(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any, edge: Tensor, state: Checkpointing, rebuild: Callable[[Sequence[Tensor]], Any], *inputs: Tensor
    ) -> Tensor:
        ctx.state, ctx.rebuild = state, rebuild
        ctx.save_for_backward(*inputs)
        return edge.detach()

    @staticmethod
    def backward(ctx: Any, grad_edge: Tensor) -> tuple[None, ...]:
        state: Checkpointing = ctx.state
        inputs = ctx.saved_tensors
        leaves = [x.detach().requires_grad_(x.requires_grad) for x in inputs]
        output = state.run(ctx.rebuild(leaves), recompute=True)
        state.recomputed.append((flatten(output)[0], leaves))
        return (None, None, None, *([None] * len(inputs)))
