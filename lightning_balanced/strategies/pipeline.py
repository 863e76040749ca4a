"""Pipeline parallelism across processes and machines, on ``torch.distributed.pipelining``, times data parallelism."""

from __future__ import annotations

import logging
import os
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch.distributed as dist
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.optim import Optimizer
from typing_extensions import override

from lightning_balanced.arguments import check_bool, check_int, check_module_name
from lightning_balanced.batch_scaling.factor_check import LRScaleFactorCheckOnLoad
from lightning_balanced.pipeline.balance import BalanceChoice, balance_argument
from lightning_balanced.pipeline.batchnorm import DeferredBatchNorm
from lightning_balanced.pipeline.sequential import find_sequential
from lightning_balanced.pipelining.balance_choice import pipeline_balance
from lightning_balanced.pipelining.batches import (
    check_batch_size,
    check_loader_batch_sizes,
    input_and_target,
    to_device,
)
from lightning_balanced.pipelining.bubble import BusyTimer, bubble_logs
from lightning_balanced.pipelining.materialize import is_on_meta, materialize_own_part, to_cpu_but_meta, without_child
from lightning_balanced.pipelining.mesh import PipelineMesh, pipeline_mesh
from lightning_balanced.pipelining.precision import with_global_norm_clipping
from lightning_balanced.pipelining.runtime import Activation, PipelineRuntime, StageModule, build_runtime, first_tensor
from lightning_balanced.pipelining.sharded_checkpoint import (
    broadcast_stages,
    flat_optimizer_state,
    gathered_optimizer_state,
    is_sharded_checkpoint,
    keep_own_optimizer_state,
    load_sharded_checkpoint,
    owned_state_names,
    save_sharded_checkpoint,
)
from lightning_balanced.pipelining.stage_plan import (
    ScheduleSpec,
    describe_plan,
    schedule_and_stages,
    stage_indices,
    stage_layers,
    stage_owners,
)
from lightning_balanced.pipelining.train_step import PipelineTrainStep, check_trainable, zeroes_gradients_after
from lightning_balanced.ranks.reports import rank_zero_report
from lightning_balanced.strategies.peer_failure import PeerFailureReporting
from lightning_balanced.strategies.placement import host_init_context, to_device_but
from lightning_balanced.strategies.process_group import ProcessGroupStrategy
from lightning_balanced.strategies.registration import RegisteredStrategy

__all__ = ["PipelineStrategy"]

log = logging.getLogger(__name__)


class _PipelinedSequential(nn.Sequential):
    """The ``nn.Sequential`` while the strategy runs: the same layers, names and ``state_dict``.

    Its forward runs the input through every stage of the pipeline and returns the last stage's output on every rank
    (evaluation).
    """

    def __init__(self, original: nn.Sequential, strategy: PipelineStrategy) -> None:
        super().__init__(OrderedDict(original._modules))
        self.train(original.training)
        self.__dict__["_original"] = original  # not a child: the layers are registered once, under their names
        self.__dict__["_strategy"] = strategy

    def forward(self, input: Activation) -> Activation:
        strategy: PipelineStrategy = self.__dict__["_strategy"]
        return strategy._forward(input)

    def unwrap(self) -> nn.Sequential:
        original: nn.Sequential = self.__dict__["_original"]
        original.train(self.training)
        return original


class PipelineStrategy(PeerFailureReporting, LRScaleFactorCheckOnLoad, RegisteredStrategy, ProcessGroupStrategy):
    """Pipeline parallelism across processes and machines: an ``nn.Sequential`` cut into stages, one process each.

    A multi-process strategy launched like DDP
    (:class:`~lightning_balanced.strategies.process_group.ProcessGroupStrategy`), on ``torch.distributed.pipelining``:
    the ``nn.Sequential`` at ``module_name`` on the LightningModule is cut into ``pipeline_parallel_size *
    stages_per_rank`` stages by ``balance``; each rank moves its own stages to its device (the others stay in host
    memory), and every training batch runs through torch's ``schedule`` in ``chunks`` micro-batches.

    The contract of the LightningModule:

    * the batch is ``(input, target)``, or ``pipeline_batch(self, batch) -> (input, target)`` makes one
      (:mod:`~lightning_balanced.pipelining.batches`). A stage may pass a tuple of tensors to the next;
    * ``compute_loss(self, output, target) -> Tensor``, the loss of one micro-batch (a mean over its samples): the last
      stage calls it on each micro-batch. The LightningModule's ``training_step`` is not called (write it as ``loss =
      self.compute_loss(self.sequential_module(x), y)``, so the module trains the same under any strategy); the
      strategy's runs the schedule and logs the batch's loss as ``train_loss`` (the unpipelined model's loss on the
      whole batch) on every rank. Do not ``self.log`` inside ``compute_loss`` (only the last stage's rank calls it);
    * ``validation_step``, ``test_step`` and ``predict_step`` run unchanged on every rank: calling the
      ``nn.Sequential`` runs a forward-only pass through the stages in ``chunks`` micro-batches (GPipe's forward) and
      returns the last stage's output on every rank, so their logs and outputs are the same on all ranks of a
      pipeline.

    Gradients equal the unpipelined model's, gradient accumulation included
    (:class:`~lightning_balanced.pipelining.train_step.PipelineTrainStep`; the schedule's gradients are handed over in
    ``backward``). Trainable parameters outside the ``nn.Sequential`` (a head or a loss weight used in
    ``compute_loss``) train as well: every rank keeps a copy, the last stage computes their gradients, and the step
    shares them over the pipeline and averages them over the data-parallel group. Gradient clipping by norm uses the
    global norm over all stages and those parameters.

    Checkpoints are sharded by default (``save_distributed_checkpoint=True``, as Lightning's
    ``ModelParallelStrategy``): each rank writes its own stages by their plain ``nn.Sequential`` names, and a checkpoint
    loads under any ``pipeline_parallel_size``, ``balance`` or schedule
    (:mod:`~lightning_balanced.pipelining.sharded_checkpoint`, whose ``consolidate_checkpoint`` makes one file of it).
    A model built on the meta device (in ``configure_model``) is materialized stage by stage, each rank its own layers
    (:mod:`~lightning_balanced.pipelining.materialize`); one built in host memory is held whole by every rank, and
    after ``fit`` every rank holds the whole trained model.

    Mixed precision: under ``bf16-mixed``/``16-mixed`` the stages run in autocast and exchange activations in its
    dtype; under ``16-mixed`` the schedule's backward runs on the ``GradScaler``-scaled loss, and an inf or NaN found on
    any stage skips the step on every rank.

    Data parallel x pipeline: with ``pipeline_parallel_size=p`` and ``p * d`` processes, ``d`` pipelines of ``p``
    consecutive ranks (:mod:`~lightning_balanced.pipelining.mesh`) each read their own shard of the data; each step
    averages every stage's gradients and the logged loss over the ``d`` replicas, so it equals the unpipelined model's
    step on the global batch.

    Args:
        schedule: the name of a ``torch.distributed.pipelining`` schedule: ``"GPipe"``, ``"1F1B"`` (one stage per
            rank), ``"Interleaved1F1B"``, ``"LoopedBFS"``, ``"InterleavedZeroBubble"`` (``stages_per_rank >= 2``,
            looped), ``"ZBVZeroBubble"``, ``"DualPipeV"`` (two stages per rank, V-shaped), each where the installed
            torch has and runs it (1F1B-style schedules from torch 2.8, V-shaped ones from 2.13: older releases fail on
            gloo). ``None``: ``"1F1B"``, or ``"GPipe"`` where torch does not run 1F1B.
        chunks: micro-batches per batch; the batch size must be a multiple of it.
        balance: layers per stage (``pipeline_parallel_size * stages_per_rank`` entries); ``None`` to spread them
            evenly by count; or a cost to even out, as ``gpipe`` chooses
            (:func:`~lightning_balanced.pipeline.balance.choose_balance`): ``"parameters"`` (counted, the same on
            every rank), ``"time"`` or ``"memory"`` (CUDA), measured on the global rank 0 one layer at a time with one
            micro-batch of the LightningModule's ``example_input_array`` and broadcast, ``"auto"`` (memory on CUDA,
            time elsewhere; parameters for a model on the meta device or without ``example_input_array``).
        stages_per_rank: stages each rank holds; ``None``: 1 for single-stage schedules, 2 for the others.
        pipeline_parallel_size: ranks per pipeline, ``p``; ``None``: the whole world (no data parallelism).
        activation_checkpointing: recompute each stage's activations in backward instead of keeping them
            (``torch.utils.checkpoint``, non-reentrant).
        module_name: the attribute of the LightningModule that holds the ``nn.Sequential``.
        log_bubble: log each step's measured bubble, the same on every rank: ``pipeline/bubble`` (progress bar; the
            mean over the pipeline's ranks of the fraction of the step each rank's stages sat idle, in ``[0, 1]``),
            ``pipeline/bubble_rank{r}`` and ``pipeline/bubble_theory``, the schedule's ``(p - 1) / (v * m + p - 1)``
            (not for zero-bubble schedules); timed as :class:`~lightning_balanced.pipelining.bubble.BusyTimer` says.
        deferred_batch_norm: replace ``nn.BatchNorm1d/2d/3d`` in the Sequential by
            :class:`~lightning_balanced.pipeline.DeferredBatchNorm` while the strategy runs: each micro-batch is
            normalized on its own (GPipe), and the running statistics and ``num_batches_tracked`` are updated once
            per step from all micro-batches of the global batch (the data-parallel replicas' merged), as the
            unpipelined model would from the whole batch.
        save_distributed_checkpoint: save sharded checkpoints (a directory, each rank its part) rather than one file.
        **kwargs: the process group's and plugins' arguments
            (:class:`~lightning_balanced.strategies.process_group.ProcessGroupStrategy`: ``process_group_backend``,
            ``timeout``, ``start_method``, ``cluster_environment``, ``checkpoint_io``, ``precision_plugin``, ...).

    Raises:
        TypeError: ``chunks``, ``stages_per_rank`` or ``pipeline_parallel_size`` not an integer, ``schedule`` not a
            string, ``activation_checkpointing`` not a bool, an argument the strategy does not take (a DDP option: no
            ``DistributedDataParallel`` is built); in a step, a batch that is not ``(input, target)``.
        ValueError: an unknown ``schedule``, or one the installed torch lacks (naming the release that adds it);
            ``chunks`` or ``pipeline_parallel_size`` below 1; ``stages_per_rank`` that the schedule does not take; at
            setup, a world size that ``pipeline_parallel_size`` does not divide, a missing ``nn.Sequential``, a
            ``balance`` that does not cover its layers, a measured ``balance`` without ``example_input_array`` or for a
            model on the meta device, a meta-device layer without ``reset_parameters()``, a model on the meta device
            with ``save_distributed_checkpoint=False``, fewer layers than stages, manual optimization,
            ``sync_batchnorm=True``, or no ``compute_loss``; in a step, a batch size that ``chunks`` does not divide.
        PeerStopped: (a ``RuntimeError``) in any collective of the strategy when another rank stopped (an error
            there, or killed), instead of a hang; the process then ends with that one line
            (:mod:`~lightning_balanced.strategies.peer_failure`).

    Source: ``torch.distributed.pipelining`` (PyTorch 2.4+): ``PipelineStage`` and its schedules; GPipe (Huang et
    al., NeurIPS 2019), 1F1B (PipeDream-Flush, Narayanan et al., 2021), zero-bubble schedules (Qi et al., ICLR 2024);
    torchtitan's ``("dp", "pp")`` device mesh; Lightning 1.x's ``DDPSequentialPlugin`` for ``module_name``.
    """

    strategy_name = "pipeline"

    def __init__(
        self,
        schedule: str | None = None,
        chunks: int = 4,
        balance: Sequence[int] | BalanceChoice | None = None,
        stages_per_rank: int | None = None,
        pipeline_parallel_size: int | None = None,
        activation_checkpointing: bool = False,
        module_name: str = "sequential_module",
        log_bubble: bool = True,
        deferred_batch_norm: bool = True,
        save_distributed_checkpoint: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.schedule: ScheduleSpec
        self.schedule, self.stages_per_rank = schedule_and_stages(schedule, stages_per_rank)
        self.chunks = check_int("chunks", chunks, minimum=1)
        self.balance = balance_argument(balance)
        self.pipeline_parallel_size = None
        if pipeline_parallel_size is not None:
            self.pipeline_parallel_size = check_int("pipeline_parallel_size", pipeline_parallel_size, minimum=1)
        self.activation_checkpointing = check_bool("activation_checkpointing", activation_checkpointing)
        self.module_name = check_module_name(module_name)
        self.log_bubble = check_bool("log_bubble", log_bubble)
        self.deferred_batch_norm = check_bool("deferred_batch_norm", deferred_batch_norm)
        self.save_distributed_checkpoint = check_bool("save_distributed_checkpoint", save_distributed_checkpoint)
        self._mesh: PipelineMesh | None = None
        self._pipelined: _PipelinedSequential | None = None
        self._runtime: PipelineRuntime | None = None  # this rank's stages and schedules, built at setup
        self._step: PipelineTrainStep | None = None
        self._balance: list[int] = []
        self._owners: list[int] = []
        self._loss_parameters: list[nn.Parameter] = []  # the LightningModule's outside the nn.Sequential
        self._built_on_meta = False  # the model came built on the meta device: each rank materializes its own stages
        self._balance_method = "given"  # how the balance was chosen, for the report
        self._loaded_sharded = False

    @property
    def pipeline_size(self) -> int:
        """Ranks per pipeline, ``p``."""
        return self.pipeline_parallel_size or self.world_size

    @property
    def data_parallel_size(self) -> int:
        """Pipelines, ``d = world_size / p``: the data-parallel world size."""
        return self.world_size // self.pipeline_size

    @property
    def pipeline_rank(self) -> int:
        """This rank within its pipeline: the stage position (``global_rank % p``)."""
        return self.global_rank % self.pipeline_size

    @property
    def data_parallel_rank(self) -> int:
        """Which pipeline this rank is in (``global_rank // p``): its data shard."""
        return self.global_rank // self.pipeline_size

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """One shard per pipeline: the ranks of a pipeline read the same batches."""
        return {"num_replicas": self.data_parallel_size, "rank": self.data_parallel_rank}

    @override
    def setup_distributed(self) -> None:
        super().setup_distributed()
        self._mesh = pipeline_mesh(self.world_size, self.global_rank, self.pipeline_size, self.root_device.type)

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """The ranks that hold the same stages, one per pipeline: where each shard of the data is gathered.

        :class:`~lightning_balanced.evaluation.DistributedEvalMixin` gathers over it by default: the ranks of one
        pipeline hold the same outputs, so gathering over the world would count each sample ``p`` times.
        """
        return None if self._mesh is None else self._mesh.data_parallel_group

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """Tensors made under ``trainer.init_module()`` go to host memory: each rank moves only its own stages."""
        with host_init_context(self.precision_plugin, empty_init):
            yield

    @override
    def model_to_device(self) -> None:
        """This rank's stages and the rest of the LightningModule to the device; other stages stay in host memory."""
        module = self.lightning_module
        assert self.model is not None and module is not None
        pipelined = self._pipelined
        if pipelined is None or module._modules.get(self.module_name) is not pipelined:
            self.model.to(self.root_device)
            return
        to_device_but(self.model, module, self.module_name, pipelined, self.root_device)
        for stage in self._stages.values():
            stage.to(self.root_device)

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        module = self.lightning_module
        assert module is not None
        if self._layer_sync is not None:
            raise ValueError("`Trainer(sync_batchnorm=True)` is not supported with strategy='pipeline'")
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting:
            check_trainable(module)
        self.accelerator.setup(trainer)
        self._build_stages(module)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self.precision_plugin = with_global_norm_clipping(self.precision_plugin, self._clip_grad_by_global_norm)
        d, method = self.data_parallel_size, self._balance_method
        rank_zero_report(describe_plan(self.schedule.name, self.chunks, self._balance, self._owners, d, method))

    def _build_stages(self, module: pl.LightningModule) -> None:
        sequential = find_sequential(module, self.module_name, "pipeline")
        p, k, mesh = self.pipeline_size, self.stages_per_rank, self._mesh
        assert mesh is not None
        self._balance, self._balance_method = pipeline_balance(
            self.balance, sequential, p, k, module, self.module_name, self.chunks, self.root_device, self.global_rank
        )
        self._owners = stage_owners(p, k, self.schedule.placement)
        mine = stage_indices(self.pipeline_rank, p, k, self.schedule.placement)
        self._built_on_meta = is_on_meta(module)
        if self._built_on_meta:
            if not self.save_distributed_checkpoint:
                raise ValueError(
                    "strategy='pipeline' got a model built on the meta device: no rank holds the whole model, so a"
                    " checkpoint cannot be one file; keep `save_distributed_checkpoint=True` (the default)"
                )
            layers = [layer for stage in mine for layer in stage_layers(self._balance, stage)]
            materialize_own_part(module, self.module_name, layers, self.root_device, _seed())
        if self.deferred_batch_norm:  # in place: the stages and the wrapper below hold the converted layers
            DeferredBatchNorm.convert_deferred_batch_norm(sequential)
        in_sequential = {id(param) for param in sequential.parameters()}
        self._loss_parameters = [param for param in module.parameters() if id(param) not in in_sequential]
        self._runtime = build_runtime(
            sequential, self._balance, self._owners, mine, mesh, self.root_device, self.activation_checkpointing
        )
        timer = BusyTimer(self.root_device) if self.log_bubble else None
        shared = self._loss_parameters
        self._step = PipelineTrainStep(self._runtime, self.schedule, self.chunks, module, shared, mesh, timer)
        self._pipelined = _PipelinedSequential(sequential, self)
        setattr(module, self.module_name, self._pipelined)

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        assert self.lightning_module is not None
        check_loader_batch_sizes(self.lightning_module.trainer, self.chunks)

    @override
    def on_train_end(self) -> None:
        if not self._built_on_meta:
            self._share_stages()  # every rank holds the whole trained model after fit (unless built on meta)

    @override
    def teardown(self) -> None:
        module = self.lightning_module
        if self._pipelined is not None and module is not None:
            setattr(module, self.module_name, DeferredBatchNorm.revert_deferred_batch_norm(self._pipelined.unwrap()))
        self._pipelined = None
        self._runtime = None
        self._step = None
        if not self._built_on_meta or module is None or module._modules.get(self.module_name) is None:
            super().teardown()
            return
        # Lightning's teardown moves the module to the CPU, which the layers on the meta device cannot do.
        with without_child(module, self.module_name) as sequential:
            to_cpu_but_meta(sequential)
            super().teardown()

    @property
    def _stages(self) -> dict[int, StageModule]:
        """This rank's stages by stage index (none before setup and after teardown)."""
        return {} if self._runtime is None else self._runtime.stages

    def _own_parameters(self) -> list[nn.Parameter]:
        """The parameters of this rank's stages (each once)."""
        return [] if self._runtime is None else self._runtime.own_parameters()

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """Run the batch through the schedule (:class:`PipelineTrainStep`); log and return its loss."""
        module = self.lightning_module
        assert module is not None and self._step is not None
        x, y = input_and_target(module, args[0] if args else kwargs["batch"])
        batch_size = first_tensor(x).shape[0]
        check_batch_size(batch_size, self.chunks)
        x, y = to_device(x, self.root_device), y.to(self.root_device)
        zeroed = zeroes_gradients_after(module, args[1] if len(args) > 1 else kwargs.get("batch_idx"))
        with self.naming_a_lost_peer("a training step"):
            outcome = self._step.run(x, y, self.precision_plugin, module.trainer.accumulate_grad_batches, zeroed)
        module.log("train_loss", outcome.loss, prog_bar=True, batch_size=batch_size)
        if outcome.bubbles is not None:
            theory = self.schedule.theoretical_bubble(self.pipeline_size, self.chunks, self.stages_per_rank)
            for name, value in bubble_logs(outcome.bubbles, theory).items():
                module.log(name, value, prog_bar=name == "pipeline/bubble", batch_size=batch_size)
        return outcome.loss

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Hand over the gradients the schedule computed in ``training_step`` (added to ``.grad``, as backward does)."""
        module = self.lightning_module
        assert module is not None and self._step is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        self._step.hand_over()
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _forward(self, x: Activation) -> Activation:
        """The ``nn.Sequential``'s forward while the strategy runs: the last stage's output on every rank.

        In ``chunks`` micro-batches (GPipe's forward), so a stage's rank works on one micro-batch while the next works
        on the previous one. On NCCL with a looped or V-shaped placement in one micro-batch: two ranks that exchange
        in both directions post their sends in different orders there, which NCCL does not reorder.
        """
        chunks = self.chunks if self.schedule.placement == "single" or self.root_device.type == "cpu" else 1
        with self.naming_a_lost_peer("a forward pass"):
            assert self._runtime is not None
            return self._runtime.forward(x, chunks=chunks)

    def _clip_grad_by_global_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        """``clip_grad_norm_`` with the norm over every stage's gradients (each rank holds its stages' only)."""
        assert self._step is not None
        with self.naming_a_lost_peer("clipping the gradients"):
            self._step.clip_grad_by_global_norm(clip_val)

    def _share_stages(self) -> None:
        """Every stage's parameters and buffers from the rank that trains it to every rank of the pipeline."""
        if self._mesh is None or self._pipelined is None or not dist.is_initialized():
            return
        with self.naming_a_lost_peer("sharing the stages"):
            layers = list(self._pipelined)
            broadcast_stages(layers, self._balance, self._owners, self._mesh.pipeline_group, self.root_device)

    @property
    @override
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # a sharded checkpoint loads into the stages, which setup builds

    @property
    @override
    def lightning_restore_optimizer(self) -> bool:
        return not self._loaded_sharded  # load_checkpoint already restored a sharded checkpoint's optimizer states

    def _owned_state_names(self) -> set[str]:
        """The ``state_dict`` names this rank saves in a sharded checkpoint: its stages' and what is outside them.

        After ``fit`` (no stages any more) every rank holds the whole trained model (:meth:`on_train_end`), so each
        saves every name and DCP writes each once.
        """
        module = self.lightning_module
        assert module is not None
        layers = {layer for stage in self._stages for layer in stage_layers(self._balance, stage)}
        return owned_state_names(module.state_dict(), self.module_name, layers if self._stages else None)

    def _parameter_names(self) -> dict[int, str]:
        module = self.lightning_module
        assert module is not None
        return {id(param): name for name, param in module.named_parameters(remove_duplicate=False)}

    @override
    def lightning_module_state_dict(self) -> dict[str, Any]:
        """Sharded: this rank's stages and the parameters outside them. Else the whole model, every stage's weights
        from the rank that trains it."""
        if self.save_distributed_checkpoint:
            owned = self._owned_state_names()
            return {k: v for k, v in super().lightning_module_state_dict().items() if k in owned}
        self._share_stages()
        return super().lightning_module_state_dict()

    @override
    def optimizer_state(self, optimizer: Optimizer) -> dict[str, Any]:
        """Sharded: this rank's parameters' state by name (:func:`flat_optimizer_state`). Else every stage's
        parameters' state, gathered from the ranks of the pipeline."""
        if self.save_distributed_checkpoint:  # a rank holds the state of its stages' and the shared parameters only
            return flat_optimizer_state(optimizer, self._parameter_names(), {id(p) for p in optimizer.state})
        state = super().optimizer_state(optimizer)
        if self._mesh is None or not dist.is_initialized():
            return state
        with self.naming_a_lost_peer("gathering the optimizer state"):
            return gathered_optimizer_state(state, self._mesh.pipeline_group)

    @override
    def save_checkpoint(
        self, checkpoint: dict[str, Any], filepath: str | Path, storage_options: Any | None = None
    ) -> None:
        """Sharded (``save_distributed_checkpoint=True``): a directory at ``filepath``, each rank writing its part
        (:func:`~lightning_balanced.pipelining.sharded_checkpoint.save_sharded_checkpoint`).

        Else one file from rank 0.
        """
        if not self.save_distributed_checkpoint:
            super().save_checkpoint(checkpoint, filepath, storage_options)
            return
        if storage_options is not None:
            raise TypeError(
                "`PipelineStrategy.save_checkpoint(..., storage_options=...)` is not supported with"
                " `save_distributed_checkpoint=True`: the shards are written by torch.distributed.checkpoint"
            )
        with self.naming_a_lost_peer("saving a checkpoint"):
            path = Path(self.broadcast(str(filepath)))
            if self.is_global_zero and path.is_file():
                path.unlink()  # a full checkpoint of an earlier run under the same name
            self.barrier("pipeline.save_checkpoint")
            save_sharded_checkpoint(path, checkpoint, self.global_rank)

    @override
    def load_checkpoint(self, checkpoint_path: str | Path, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """A sharded checkpoint: this rank's stages' weights and optimizer states, loaded here (any pipeline size,
        balance or schedule can have written it). A file: Lightning's checkpoint, loaded as usual."""
        with self.naming_a_lost_peer("loading a checkpoint"):
            path = Path(self.broadcast(str(checkpoint_path)))
        self._loaded_sharded = is_sharded_checkpoint(path)
        if not self._loaded_sharded:
            return super().load_checkpoint(checkpoint_path, *args, **kwargs)
        module = self.lightning_module
        assert module is not None
        owned = self._owned_state_names()
        tensors = {name: tensor for name, tensor in module.state_dict().items() if name in owned}
        names = self._parameter_names()
        own = {id(p) for p in [*self._own_parameters(), *self._loss_parameters]}
        optimizers = [(optimizer, {i: n for i, n in names.items() if i in own}) for optimizer in self.optimizers]
        with self.naming_a_lost_peer("loading a checkpoint"):
            return load_sharded_checkpoint(path, tensors, optimizers)

    @override
    def load_model_state_dict(self, checkpoint: Mapping[str, Any], strict: bool = True) -> None:
        if not self._loaded_sharded:  # a sharded checkpoint's weights were loaded by load_checkpoint
            super().load_model_state_dict(checkpoint, strict=strict)

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Each optimizer's state, kept for this rank's stages only, on their device."""
        own = {id(p) for p in self._own_parameters()}
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=False):
            keep_own_optimizer_state(optimizer, state, own)


def _seed() -> int:
    """``seed_everything``'s seed, else 0: what a model built on the meta device is initialized from."""
    return int(os.environ.get("PL_GLOBAL_SEED", 0))
