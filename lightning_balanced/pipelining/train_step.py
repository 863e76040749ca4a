"""One training step of ``strategy="pipeline"`` on one rank: torch's schedule, then one all_reduce.

The all_reduce gives every rank of the pipeline the same loss, bubbles, shared gradients and decision to skip.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, NamedTuple

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn

from lightning_balanced.pipelining.bubble import BusyTimer, bubble
from lightning_balanced.pipelining.mesh import PipelineMesh
from lightning_balanced.pipelining.p2p_forward import Activation
from lightning_balanced.pipelining.runtime import PipelineRuntime
from lightning_balanced.pipelining.stage_plan import ScheduleSpec
from lightning_balanced.pipelining.step_exchange import (
    SharedGradients,
    clip_grad_by_global_norm,
    commit_running_statistics,
    mark_non_finite,
    non_finite,
)
from lightning_balanced.ranks.exchange import ExchangeLayout

__all__ = ["LOSS_HOOK", "PipelineTrainStep", "StepOutcome", "check_trainable", "zeroes_gradients_after"]

#: The LightningModule hook the last stage calls on each micro-batch.
LOSS_HOOK = "compute_loss"


def check_trainable(module: pl.LightningModule) -> None:
    """Raise a ``ValueError`` unless the strategy can train ``module``: automatic optimization and ``compute_loss``."""
    if not module.automatic_optimization:
        raise ValueError(
            "strategy='pipeline' runs the forward and backward pass itself (torch's pipeline schedule):"
            " manual optimization (`automatic_optimization = False`) is not supported"
        )
    if not callable(getattr(module, LOSS_HOOK, None)):
        raise ValueError(
            f"strategy='pipeline' needs `{type(module).__name__}.{LOSS_HOOK}(self, output, target) -> Tensor`:"
            " the loss of one micro-batch, which the last stage calls on each micro-batch"
        )


def zeroes_gradients_after(module: pl.LightningModule, batch_idx: int | None) -> bool:
    """Whether Lightning's loop zeroes the gradients after the ``training_step`` of batch ``batch_idx``.

    So on the first batch of an accumulation window, with the default ``optimizer_zero_grad``: the last step's
    gradients may go before the schedule runs, so a rank never holds two steps' gradients at once.
    """
    if batch_idx is None or is_overridden("optimizer_zero_grad", module):
        return False
    return batch_idx % module.trainer.accumulate_grad_batches == 0


class StepOutcome(NamedTuple):
    """What a step gives every rank of the pipeline alike.

    Args:
        loss (Tensor): the batch's loss, a float64 scalar: the mean of the micro-batches' (averaged over the
            data-parallel replicas), equal to the unpipelined model's loss on the whole batch.
        bubbles (list[float] | None): each pipeline rank's idle fraction of the step, in ``[0, 1]``; ``None`` untimed.
    """

    loss: Tensor
    bubbles: list[float] | None


@dataclass(eq=False)
class PipelineTrainStep:
    """Runs a batch through torch's schedule and keeps the gradients it computed for Lightning's ``backward``.

    Gradients equal the unpipelined model's: each micro-batch's loss is weighted by ``1 / chunks`` (torch's
    ``scale_grads`` off) and by Lightning's ``1 / accumulate_grad_batches``, and scaled by the ``GradScaler`` under
    ``16-mixed``. The gradients of the trainable parameters outside the stages (a head's or a loss weight's, every rank
    holding a copy, the last stage using them) are taken from each micro-batch's loss alone: torch's schedules differ
    in what their backward computes for parameters a stage does not hold (the zero-bubble ones' weight pass covers the
    stage's own only), so they are computed the same way under every schedule.

    After the schedule, one float64 all_reduce over the pipeline carries ``[busy | loss | step | non-finite | flags |
    gradients]``: each rank's compute time, the loss (only the last stage's rank knows it), each rank's step time,
    whether its gradients hold an inf or NaN, and the shared parameters' gradients with a "has a gradient" flag each.
    The other ranks' slots are zeros, so the sums are exact (float32 and float16 round-trip through float64) and every
    rank derives the same values. With ``d > 1`` data-parallel replicas, the stages' gradients and that buffer are
    then averaged over the ``dp`` group, and the deferred BatchNorm layers commit the global batch's statistics.

    Args:
        runtime (PipelineRuntime): this rank's stages and schedules.
        spec (ScheduleSpec): the schedule.
        chunks (int): micro-batches per batch.
        module (LightningModule): the module whose ``compute_loss(output, target)`` gives one micro-batch's loss.
        loss_parameters (list[nn.Parameter]): the LightningModule's parameters outside the ``nn.Sequential``.
        mesh (PipelineMesh): this rank's groups.
        timer (BusyTimer | None): the stages' compute timer, for the bubble; ``None``: untimed.

    Source: ``torch.distributed.pipelining``'s schedules (``step``, ``loss_fn``, ``scale_grads``); the loss weighting
    of Lightning's automatic optimization loop; GPipe's mean over micro-batches (Huang et al., NeurIPS 2019).
    """

    runtime: PipelineRuntime
    spec: ScheduleSpec
    chunks: int
    module: pl.LightningModule
    loss_parameters: list[nn.Parameter]
    mesh: PipelineMesh
    timer: BusyTimer | None
    # A step's state: the micro-batches' losses for the log, their weight, the GradScaler, the shared parameters'
    # gradients as the losses give them, and the gradients handed over in backward.
    _micro_batch_losses: list[Tensor] = field(default_factory=list, init=False)
    _loss_weight: float = field(default=1.0, init=False)
    _scaler: Any = field(default=None, init=False)
    _loss_parameter_grads: list[Tensor | None] = field(default_factory=list, init=False)
    _step_grads: list[tuple[nn.Parameter, Tensor]] = field(default_factory=list, init=False)

    def shared_parameters(self) -> list[nn.Parameter]:
        """The trainable parameters outside the ``nn.Sequential``.

        Their gradients are summed over the pipeline (only the last stage's rank adds any) and averaged over the
        data-parallel group, so every copy steps alike.
        """
        return [param for param in self.loss_parameters if param.requires_grad]

    def run(
        self, x: Activation, y: Tensor, precision_plugin: Any, accumulate_grad_batches: int, zeroed: bool
    ) -> StepOutcome:
        """Run one batch (already on the device) through the schedule and exchange what the ranks must agree on.

        Args:
            x (Activation): the first stage's input(s), ``(batch, ...)``, the batch a multiple of ``chunks``.
            y (Tensor): the target, ``(batch, ...)``.
            precision_plugin (Precision): Lightning's plugin: its ``train_step_context`` and ``GradScaler``.
            accumulate_grad_batches (int): Lightning's, which weights the loss.
            zeroed (bool): Lightning's loop zeroes the gradients after this step, so those held now may go.
        """
        runtime = self.runtime
        schedule = runtime.schedule_for(
            x, self.spec, self.chunks, self.loss, precision_plugin.train_step_context, self.timer
        )
        own, shared = runtime.own_parameters(), self.shared_parameters()
        trained = [*own, *shared]
        previous = [None if zeroed else param.grad for param in trained]  # put back after the step
        for param in trained:
            param.grad = None
        self._micro_batch_losses = []
        self._loss_weight = 1.0 / (self.chunks * accumulate_grad_batches)
        self._scaler = getattr(precision_plugin, "scaler", None)
        step_args: tuple[Any, ...] = (x if isinstance(x, tuple) else (x,)) if 0 in runtime.stages else ()
        step_kwargs: dict[str, Any] = {"target": y} if len(runtime.owners) - 1 in runtime.stages else {}
        if self.timer is not None:
            self.timer.start_step()
        for layer in runtime.deferred:
            layer.reset_accumulator()
        self._loss_parameter_grads = [None] * len(shared)
        with precision_plugin.train_step_context():
            schedule.step(*step_args, **step_kwargs)
        for param, grad in zip(shared, self._loss_parameter_grads, strict=True):
            param.grad = grad  # what `loss` took, not what the schedule's backward may have added
        self._loss_parameter_grads = []
        mesh = self.mesh
        commit_running_statistics(runtime.deferred, mesh.data_parallel_group, mesh.data_parallel_size, runtime.device)
        outcome = self._exchange(own, shared)
        self._step_grads = [(param, param.grad) for param in trained if param.grad is not None]
        for param, grad in zip(trained, previous, strict=True):
            param.grad = grad
        return outcome

    def _exchange(self, own: list[nn.Parameter], shared: list[nn.Parameter]) -> StepOutcome:
        """The step's all_reduce over the pipeline (and the data-parallel average); sets the gradients it carries."""
        mesh, p = self.mesh, self.mesh.pipeline_size
        fields = {"busy_s": p, "loss": 1, "step_s": p, "non_finite": 1}
        shared_grads = SharedGradients(shared, offset=sum(fields.values()))
        layout = ExchangeLayout(fields, extra=shared_grads.end - shared_grads.flags)
        report = layout.new_buffer(self.runtime.device)
        if self.timer is not None:
            layout.set(report, "busy_s", mesh.pipeline_rank, self.timer.busy_seconds())
            layout.set(report, "step_s", mesh.pipeline_rank, self.timer.step_seconds())
        for micro_batch_loss in self._micro_batch_losses:
            layout.field(report, "loss").add_(micro_batch_loss.to(report))
        scaled = self._scaler is not None
        if scaled:
            layout.set(report, "non_finite", 0, non_finite([param.grad for param in own]))
        shared_grads.pack(report)
        dist.all_reduce(report, group=mesh.pipeline_group)
        if mesh.data_parallel_size > 1:
            for param in own:
                if param.grad is not None:
                    dist.all_reduce(param.grad, group=mesh.data_parallel_group)
                    param.grad /= mesh.data_parallel_size
            dist.all_reduce(report, group=mesh.data_parallel_group)
            report /= mesh.data_parallel_size
        # One read from the device, for the bubbles, the non-finite flag and the shared gradients' flags.
        head = report[: shared_grads.values].tolist() if self.timer is not None or shared or scaled else []
        shared_grads.unpack(report, head)
        read = layout.unpack(head) if head else {}
        if scaled and read["non_finite"][0] > 0:
            mark_non_finite(own)
        bubbles = None
        if self.timer is not None:
            # The step ends when the last rank of the pipeline is done: a rank that finishes early waits in the bubble.
            step_s = max(read["step_s"])
            bubbles = [bubble(busy_s, step_s) for busy_s in read["busy_s"]]
        return StepOutcome(layout.field(report, "loss")[0], bubbles)

    def loss(self, output: Activation, target: Tensor) -> Tensor:
        """The schedule's ``loss_fn``: one micro-batch's loss, weighted and scaled; shared gradients taken here.

        The weight is ``1 / (chunks * accumulate_grad_batches)``, the scale the ``GradScaler``'s. The loss weighted by
        ``1 / chunks`` only is kept for the step's logged loss.
        """
        loss: Tensor = getattr(self.module, LOSS_HOOK)(output, target) / self.chunks
        self._micro_batch_losses.append(loss.detach())
        weighted = loss * (self._loss_weight * self.chunks)
        scaled = weighted if self._scaler is None else self._scaler.scale(weighted)
        params = self.shared_parameters()
        if params and scaled.requires_grad:
            grads = torch.autograd.grad(scaled, params, retain_graph=True, allow_unused=True)
            for index, grad in enumerate(grads):
                if grad is not None:
                    held = self._loss_parameter_grads[index]
                    self._loss_parameter_grads[index] = grad if held is None else held + grad
        return scaled

    def clip_grad_by_global_norm(self, clip_val: float) -> None:
        """``clip_grad_norm_`` with the norm over every stage's gradients and the shared parameters' (counted once)."""
        own, shared, mesh = self.runtime.own_parameters(), self.shared_parameters(), self.mesh
        first = mesh.pipeline_rank == 0
        clip_grad_by_global_norm(own, shared, first, mesh.pipeline_group, clip_val, self.runtime.device)

    def hand_over(self) -> None:
        """Add the last step's gradients to ``.grad``, as a backward pass would (Lightning's ``backward``)."""
        for param, grad in self._step_grads:
            param.grad = grad if param.grad is None else param.grad + grad
        self._step_grads = []
