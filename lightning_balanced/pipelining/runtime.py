r"""The multi-process pipeline's runtime on one rank: its stages, who holds every stage, and their schedules.

:func:`build_runtime` cuts the ``nn.Sequential`` by the balance and wraps this rank's stages (as torchtitan's
``pipeline_llm`` returns the model parts and the schedule); :class:`PipelineRuntime` runs the forward-only pass of
evaluation (:func:`~lightning_balanced.pipelining.p2p_forward.pipelined_forward`) and builds, per input shape, torch's
schedule over this rank's ``PipelineStage``\ s. The strategy keeps the mesh, Lightning's hooks, the step's reductions
and the logs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint as activation_checkpoint

from lightning_balanced.pipeline.batchnorm import DeferredBatchNorm
from lightning_balanced.pipeline.recompute import recomputing
from lightning_balanced.pipelining.bubble import BusyTimer
from lightning_balanced.pipelining.mesh import PipelineMesh
from lightning_balanced.pipelining.p2p_forward import Activation, StageExamples, pipelined_forward
from lightning_balanced.pipelining.stage_plan import ScheduleSpec, check_several_tensors, cut_sequential

__all__ = ["Activation", "PipelineRuntime", "StageModule", "build_runtime", "first_tensor"]


class StageModule(nn.Module):
    """One stage as torch's ``PipelineStage`` runs it: its layers, recomputed in backward when checkpointed.

    Checkpointing is ``torch.utils.checkpoint``, non-reentrant. An output tensor that is a leaf (the stage's own input,
    returned by a stage of only ``nn.Identity`` or ``nn.Dropout(0.0)``) leaves as a copy: torch 2.11's split backward
    (``stage_backward_input``, the zero-bubble schedules) detaches the stage's outputs in place, which then detached the
    receive buffer of the next micro-batch ("element 0 of tensors does not require grad and does not have a grad_fn").
    A copy, not a view: a view cannot be detached in place. Only such a stage pays for it.
    """

    def __init__(self, layers: nn.Module, checkpointed: bool) -> None:
        super().__init__()
        self.layers = layers
        self.checkpointed = checkpointed

    def forward(self, *inputs: Tensor) -> Any:
        """The stage's layers on ``inputs`` (one tensor, or the tensors of the previous stage's tuple)."""
        # torch's PipelineStage calls a stage with the previous stage's tensors as arguments; the layers take them as
        # nn.Sequential passes a value on: one tensor, or the tuple the previous layer returned
        x: Activation = inputs[0] if len(inputs) == 1 else inputs
        if self.checkpointed:  # the recomputation in backward is marked, so DeferredBatchNorm counts it once
            output = activation_checkpoint(
                self.layers, x, use_reentrant=False, context_fn=lambda: (nullcontext(), recomputing())
            )
        else:
            output = self.layers(x)
        return with_grad_fn(output)


def with_grad_fn(output: Any) -> Any:
    """``output`` with each leaf tensor that requires grad replaced by a copy of itself (in tuples and lists too)."""
    if isinstance(output, Tensor):
        return output.clone() if output.requires_grad and output.grad_fn is None else output
    if isinstance(output, (tuple, list)) and not hasattr(output, "_fields"):
        return type(output)(with_grad_fn(item) for item in output)
    return output


def first_tensor(x: Activation) -> Tensor:
    """``x``, or its first tensor: where the batch size is read."""
    return x[0] if isinstance(x, tuple) else x


def example_requires_grad(example: Activation, requires_grad: bool) -> None:
    for tensor in example if isinstance(example, tuple) else (example,):
        tensor.requires_grad_(requires_grad and (tensor.is_floating_point() or tensor.is_complex()))


@dataclass
class PipelineRuntime:
    """This rank's part of a pipeline: its stages, every stage's owner, the balance, and the schedules built so far.

    Args:
        stages (dict[int, StageModule]): this rank's stages by stage index.
        owners (list[int]): for each stage, its rank in the pipeline's group.
        balance (list[int]): layers per stage.
        rank (int): this rank in the pipeline's group.
        group (ProcessGroup): the pipeline's ranks.
        device (torch.device): this rank's device.
    """

    stages: dict[int, StageModule]
    owners: list[int]
    balance: list[int]
    rank: int
    group: dist.ProcessGroup
    device: torch.device
    schedules: dict[tuple[Any, ...], Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        #: This rank's DeferredBatchNorm layers, in stage order (found once).
        self.deferred = [
            m for _, stage in sorted(self.stages.items()) for m in stage.modules() if isinstance(m, DeferredBatchNorm)
        ]

    def own_parameters(self) -> list[nn.Parameter]:
        """The parameters of this rank's stages (each once)."""
        seen: dict[int, nn.Parameter] = {}
        for stage in self.stages.values():
            for param in stage.layers.parameters():
                seen.setdefault(id(param), param)
        return list(seen.values())

    def forward(self, x: Activation, examples: StageExamples | None = None, chunks: int = 1) -> Activation:
        """The last stage's output on every rank of the pipeline (evaluation; see ``pipelined_forward``)."""
        output = pipelined_forward(
            x, self.stages, self.owners, self.rank, self.group, self.device, examples, chunks=chunks
        )
        assert output is not None  # every rank gets the output
        return output

    def schedule_for(
        self,
        x: Activation,
        spec: ScheduleSpec,
        chunks: int,
        loss_fn: Callable[[Any, Tensor], Tensor],
        precision_context: Callable[[], AbstractContextManager[Any]] = nullcontext,
        timer: BusyTimer | None = None,
    ) -> Any:
        """Torch's schedule ``spec`` over this rank's stages for batches shaped as ``x``, built on the first such batch.

        The stages' example tensors come from a forward pass of one micro-batch in eval mode (shapes only: no running
        statistics updated, no random numbers drawn), under ``precision_context`` (with autocast the activations
        travel in its dtype). ``loss_fn`` is the schedule's; ``scale_grads`` is off where torch has it.
        """
        size = first_tensor(x).shape[0] // chunks
        micro: Activation = tuple(t[:size] for t in x) if isinstance(x, tuple) else x[:size]
        key = tuple((tuple(t.shape), t.dtype) for t in (micro if isinstance(micro, tuple) else (micro,)))
        if key in self.schedules:
            return self.schedules[key]
        from torch.distributed.pipelining import PipelineStage

        examples = StageExamples({}, {})
        training = {m: m.training for stage in self.stages.values() for m in stage.modules()}
        try:
            for stage in self.stages.values():
                stage.eval()
            with torch.no_grad(), precision_context():
                self.forward(micro, examples)
        finally:
            for m, mode in training.items():
                m.training = mode
        for index in self.stages:  # a tuple across a stage boundary: both of its ranks refuse it alike
            if index > 0 and isinstance(examples.inputs[index], tuple):
                check_several_tensors(f"stage {index - 1}")
            if index < len(self.owners) - 1 and isinstance(examples.outputs[index], tuple):
                check_several_tensors(f"stage {index}")
        # What travels in training: activations that take part in autograd (the stage's input from the previous stage
        # and its output), so the schedule sends and receives their gradients; the data (stage 0's input) does not.
        for index in self.stages:
            example_requires_grad(examples.inputs[index], index > 0)
            example_requires_grad(examples.outputs[index], True)
        stages = [
            PipelineStage(
                stage,
                index,
                len(self.owners),
                self.device,
                input_args=examples.inputs[index],
                output_args=examples.outputs[index],
                group=self.group,
            )
            for index, stage in sorted(self.stages.items())
        ]
        if timer is not None:
            for pipeline_stage in stages:
                timer.wrap(pipeline_stage)
        schedule_class = spec.schedule_class()
        options: dict[str, Any] = {"n_microbatches": chunks, "loss_fn": loss_fn}
        if "scale_grads" in inspect.signature(schedule_class).parameters:
            options["scale_grads"] = False  # the loss is weighted by 1 / chunks instead, on every torch
        schedule = schedule_class(stages[0] if spec.placement == "single" else stages, **options)
        self.schedules[key] = schedule
        return schedule


def build_runtime(
    sequential: nn.Sequential,
    balance: list[int],
    owners: list[int],
    mine: list[int],
    mesh: PipelineMesh,
    device: torch.device,
    activation_checkpointing: bool = False,
) -> PipelineRuntime:
    """Cut ``sequential`` by ``balance`` and keep this rank's stages (``mine``), checkpointed or not.

    Args:
        sequential (nn.Sequential): the whole model's layers (stages not in ``mine`` may be on the meta device).
        balance (list[int]): layers per stage.
        owners (list[int]): for each stage, its rank in ``group``.
        mine (list[int]): this rank's stage indices.
        mesh (PipelineMesh): this rank's groups (the pipeline's is the stages').
        device (torch.device): this rank's device.
        activation_checkpointing (bool): recompute each stage's activations in backward.
    """
    stages = cut_sequential(sequential, balance)
    own = {index: StageModule(stages[index], activation_checkpointing) for index in mine}
    return PipelineRuntime(own, owners, balance, mesh.pipeline_rank, mesh.pipeline_group, device)
