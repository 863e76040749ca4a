"""Pipeline parallelism across processes and machines, on ``torch.distributed.pipelining``, times data parallelism."""

from __future__ import annotations

import inspect
import logging
import os
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.model_helpers import is_overridden
from torch import Tensor, nn
from torch.optim import Optimizer
from torch.utils.data import DataLoader
from typing_extensions import override

from lightning_balanced.arguments import check_bool, check_int, check_module_name
from lightning_balanced.batch_scaling.factor_check import LRScaleFactorCheckOnLoad
from lightning_balanced.pipeline.balance import (
    BalanceChoice,
    balance_argument,
)
from lightning_balanced.pipeline.batchnorm import DeferredBatchNorm
from lightning_balanced.pipeline.sequential import find_sequential
from lightning_balanced.pipelining.balance_choice import pipeline_balance
from lightning_balanced.pipelining.bubble import BusyTimer, bubble
from lightning_balanced.pipelining.materialize import is_on_meta, materialize, materialize_layers
from lightning_balanced.pipelining.precision import with_global_norm_clipping
from lightning_balanced.pipelining.runtime import Activation, PipelineRuntime, StageModule, build_runtime, first_tensor
from lightning_balanced.pipelining.sharded_checkpoint import (
    flat_optimizer_state,
    is_sharded_checkpoint,
    keep_own_optimizer_state,
    load_sharded_checkpoint,
    merged_optimizer_state,
    owned_state_names,
    save_sharded_checkpoint,
    to_host,
)
from lightning_balanced.pipelining.stage_plan import (
    ScheduleSpec,
    schedule_spec,
    stage_indices,
    stage_layers,
    stage_owners,
)
from lightning_balanced.pipelining.step_exchange import (
    SharedGradients,
    clip_grad_by_global_norm,
    commit_running_statistics,
    mark_non_finite,
    non_finite,
)
from lightning_balanced.ranks.exchange import ExchangeLayout
from lightning_balanced.ranks.reports import counted, rank_zero_report
from lightning_balanced.ranks.stop_notices import StopNotices
from lightning_balanced.strategies.peer_failure import PeerFailureReporting
from lightning_balanced.strategies.placement import host_init_context, to_device_but
from lightning_balanced.strategies.registration import RegisteredStrategy

__all__ = ["PipelineStrategy"]

log = logging.getLogger(__name__)

#: What PipelineStrategy passes on to Lightning's DDPStrategy: the process group and the plugins, no DDP option.
_PROCESS_ARGUMENTS = frozenset(
    {
        "accelerator",
        "parallel_devices",
        "cluster_environment",
        "checkpoint_io",
        "precision_plugin",
        "process_group_backend",
        "timeout",
        "start_method",
    }
)


def _ddp_defaults() -> dict[str, Any]:
    """The default of each option of Lightning's ``DDPStrategy`` and torch's ``DistributedDataParallel``."""
    defaults: dict[str, Any] = {}
    for function in (DDPStrategy.__init__, torch.nn.parallel.DistributedDataParallel.__init__):
        for name, parameter in inspect.signature(function).parameters.items():
            if parameter.default is not parameter.empty:
                defaults[name] = parameter.default
    return defaults


#: The LightningModule hook the last stage calls on each micro-batch.
LOSS_HOOK = "compute_loss"
#: The optional LightningModule hook that splits a training batch into the first stage's input(s) and the target.
BATCH_HOOK = "pipeline_batch"


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


class PipelineStrategy(PeerFailureReporting, LRScaleFactorCheckOnLoad, RegisteredStrategy, DDPStrategy):
    """Pipeline parallelism across processes and machines: an ``nn.Sequential`` cut into stages, one process each.

    A multi-process strategy launched like DDP (Lightning's subprocess and spawn launchers, ``torchrun``, SLURM;
    ``devices=`` and ``num_nodes=``), on ``torch.distributed.pipelining``: the ``nn.Sequential`` at ``module_name`` on
    the LightningModule is cut into ``pipeline_parallel_size * stages_per_rank`` stages by ``balance``; each rank moves
    its own stages to its device (the other layers stay in host memory where they were made, and never go to a
    device), and every training batch runs through torch's ``schedule`` in ``chunks`` micro-batches.

    The contract of the LightningModule:

    * the batch is ``(input, target)``: the first stage takes ``input``, the last stage ``target``; for other batches
      define ``pipeline_batch(self, batch) -> (input, target)`` (``input`` a tensor or a tuple of tensors). A stage may
      pass a tuple of tensors to the next, which gets it as ``nn.Sequential`` hands a value on (one tuple);
    * ``compute_loss(self, output, target) -> Tensor``, the loss of one micro-batch (a mean over its samples, as
      ``F.cross_entropy`` gives by default): the last stage calls it on each micro-batch. The LightningModule's
      ``training_step`` is not called (Lightning still asks for one: write it as ``loss = self.compute_loss(
      self.sequential_module(x), y)``, so the module trains the same under any strategy); the strategy's runs the
      schedule, which does the forward and the backward pass itself, and logs the batch's loss as ``train_loss``
      (the mean of the micro-batches' losses, equal to the loss of the unpipelined model on the whole batch) on every
      rank. Do not ``self.log`` inside ``compute_loss`` (only the last stage's rank calls it);
    * ``validation_step``, ``test_step`` and ``predict_step`` run unchanged on every rank: calling the
      ``nn.Sequential`` runs a forward-only pass through the stages in ``chunks`` micro-batches (GPipe's forward) and
      returns the last stage's output on every rank, so their logs and outputs are the same on all ranks of a
      pipeline.

    Gradients equal the unpipelined model's: each micro-batch's loss is weighted by ``1 / chunks`` (torch's
    ``scale_grads`` is off), so the gradient is that of the mean over the batch, and by ``1 / accumulate_grad_batches``
    as Lightning's loop weights the loss, so gradient accumulation equals one process's (the schedule's gradients are
    handed over in ``backward``). Trainable parameters outside the ``nn.Sequential`` (a head or a loss weight used in
    ``compute_loss``) train as well: every rank keeps a copy, the last stage computes their gradients, and the step
    shares them over the pipeline and averages them over the data-parallel group. Gradient clipping by norm uses the
    global norm over all stages and those parameters. Checkpoints are sharded by default
    (``save_distributed_checkpoint=True``, as Lightning's ``ModelParallelStrategy``): a directory in the format of
    ``torch.distributed.checkpoint`` where each rank writes its own stages' weights and optimizer states, by their
    plain ``nn.Sequential`` names (:mod:`~lightning_balanced.pipelining.sharded_checkpoint`), so no rank gathers the
    model to save it, and a checkpoint loads under any ``pipeline_parallel_size``, ``balance`` or schedule;
    :func:`~lightning_balanced.pipelining.sharded_checkpoint.consolidate_checkpoint` makes one file of it for ``gpipe``,
    ``ddp`` or a plain module. With ``save_distributed_checkpoint=False`` a checkpoint is one file with the whole model
    (each stage's weights sent to every rank, the optimizer states gathered). A model built on the meta device (in
    ``configure_model``) is materialized stage by stage: each rank only its own layers (seeded per layer,
    :mod:`~lightning_balanced.pipelining.materialize`), and no rank ever holds the whole model; one built in host
    memory is held whole by every rank, and after ``fit`` every rank holds the whole trained model.

    Mixed precision: under ``bf16-mixed``/``16-mixed`` the stages run in autocast and exchange activations in its
    dtype; under ``16-mixed`` the schedule's backward runs on the ``GradScaler``-scaled loss, and an inf or NaN found on
    any stage skips the step on every rank.

    Data parallel x pipeline: with ``pipeline_parallel_size=p`` and a world of ``p * d`` processes, the ranks form a
    2-D ``DeviceMesh`` ``("dp", "pp")``: ``d`` pipelines, each of ``p`` consecutive ranks, each fed its own shard of the
    data (``DistributedSampler`` over the ``d`` replicas); after each batch the gradients of every stage are averaged
    over its ``d`` replicas with an ``all_reduce`` on the ``dp`` group, so a step equals the unpipelined model's on the
    global batch of ``d`` shards. The logged loss is averaged over the replicas too. (Not DDP or FSDP2: their gradient
    hooks do not follow the zero-bubble schedules' split of backward into input and weight passes; the explicit
    reduction works under every schedule, without overlapping backward.)

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
        log_bubble: log each step's measured bubble: ``pipeline/bubble`` (progress bar; the mean over the pipeline's
            ranks of the fraction of the step each rank's stages sat idle, in ``[0, 1]``), ``pipeline/bubble_rank{r}``
            and ``pipeline/bubble_theory``, the schedule's ``(p - 1) / (v * m + p - 1)`` (not for zero-bubble
            schedules). The step is the longest of the pipeline's ranks' step times, which travel in the step's
            all_reduce, so every rank logs the same values. On CUDA the stages are timed with events, and each step
            waits twice for the device: for its last kernel before the pipeline's all_reduce (the end of the rank's
            step), and for that all_reduce (reading the times).
        deferred_batch_norm: replace ``nn.BatchNorm1d/2d/3d`` in the Sequential by
            :class:`~lightning_balanced.pipeline.DeferredBatchNorm` while the strategy runs: each micro-batch is
            normalized on its own (GPipe), and the running statistics and ``num_batches_tracked`` are updated once
            per step from all micro-batches of the global batch (the data-parallel replicas' merged), as the
            unpipelined model would from the whole batch.
        save_distributed_checkpoint: save sharded checkpoints (a directory, each rank its part) rather than one file.
        **kwargs: the process group's and plugins' arguments of :class:`~lightning.pytorch.strategies.DDPStrategy`
            (``process_group_backend``, ``timeout``, ``start_method``, ``cluster_environment``, ``checkpoint_io``,
            ``precision_plugin``, ...); its DDP options (``find_unused_parameters``, ``ddp_comm_hook``,
            ``model_averaging_period``, ...) are refused by name.

    Raises:
        TypeError: ``chunks``, ``stages_per_rank`` or ``pipeline_parallel_size`` not an integer, ``schedule`` not a
            string, ``activation_checkpointing`` not a bool; in a step, a batch that is not ``(input, target)``.
        ValueError: an unknown ``schedule``, or one the installed torch lacks (naming the release that adds it);
            ``chunks`` or ``pipeline_parallel_size`` below 1; ``stages_per_rank`` that the schedule does not take; at
            setup, a world size that ``pipeline_parallel_size`` does not divide, a missing ``nn.Sequential``, a
            ``balance`` that does not cover its layers, a measured ``balance`` without ``example_input_array`` or for a
            model on the meta device, a meta-device layer without ``reset_parameters()``, a model on the meta device
            with ``save_distributed_checkpoint=False``, fewer layers than stages, manual optimization,
            ``sync_batchnorm=True``, or no ``compute_loss``; in a step, a batch size that ``chunks`` does not divide.
        PeerStopped: (a ``RuntimeError``) in any collective of the strategy (the step, a forward pass, clipping,
            sharing the stages, a checkpoint, a barrier or broadcast), when another rank stopped (an error there, or
            killed): the backend's broken connection, said for what it is, instead of a hang; the
            process then ends with that one line, not a traceback
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
        defaults = _ddp_defaults()  # what LightningCLI fills in for every DDP option: not a choice of the user's
        ignored = [
            name
            for name, value in kwargs.items()
            if name not in _PROCESS_ARGUMENTS
            and (name not in defaults or value != defaults[name])
            and value is not None
        ]
        if ignored:
            raise ValueError(
                "strategy='pipeline' builds no DistributedDataParallel (the schedule runs the stages; gradients are"
                " averaged over the data-parallel group explicitly), so"
                f" {', '.join(f'`{name}`' for name in ignored)} would do nothing: remove them"
            )
        super().__init__(**kwargs)
        self.deferred_batch_norm = check_bool("deferred_batch_norm", deferred_batch_norm)
        self.save_distributed_checkpoint = check_bool("save_distributed_checkpoint", save_distributed_checkpoint)
        self._loaded_sharded = False
        if schedule is None:
            schedule = "1F1B" if schedule_spec("1F1B").available() else "GPipe"
        self.schedule: ScheduleSpec = schedule_spec(schedule)
        self.schedule.schedule_class()  # a schedule the installed torch lacks fails here, naming its release
        self.chunks = check_int("chunks", chunks, minimum=1)
        default_stages = 1 if self.schedule.placement == "single" else 2
        self.stages_per_rank = (
            default_stages if stages_per_rank is None else check_int("stages_per_rank", stages_per_rank, minimum=1)
        )
        stage_indices(0, 1, self.stages_per_rank, self.schedule.placement)  # the schedule takes this many
        self.balance = balance_argument(balance)
        self.pipeline_parallel_size = None
        if pipeline_parallel_size is not None:
            self.pipeline_parallel_size = check_int("pipeline_parallel_size", pipeline_parallel_size, minimum=1)
        self.activation_checkpointing = check_bool("activation_checkpointing", activation_checkpointing)
        self.module_name = check_module_name(module_name)
        self.log_bubble = check_bool("log_bubble", log_bubble)
        self._timer: BusyTimer | None = None
        self._pp_group: dist.ProcessGroup | None = None
        self._stop_notices: StopNotices | None = None
        self._dp_group: dist.ProcessGroup | None = None
        self._pipelined: _PipelinedSequential | None = None
        self._runtime: PipelineRuntime | None = None  # this rank's stages and schedules, built at setup
        self._owners: list[int] = []
        self._step_grads: list[tuple[Tensor, Tensor]] = []
        self._micro_batch_losses: list[Tensor] = []
        self._loss_weight = 1.0 / self.chunks
        self._loss_parameters: list[nn.Parameter] = []
        self._loss_parameter_grads: list[Tensor | None] = []
        self._built_on_meta = False  # the model came built on the meta device: each rank materializes its own stages
        self._balance_method = "given"  # how the balance was chosen, for the report

    # ---- topology --------------------------------------------------------------------------------------------------
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
        self._stop_notices = StopNotices.of_default_group()
        self._stop_notices.record_process()
        p = self.pipeline_size
        if self.world_size % p:
            raise ValueError(
                f"`pipeline_parallel_size`={p} must divide the world size {self.world_size} (devices x num_nodes)"
            )
        if self.data_parallel_size == 1:
            # One pipeline: a data-parallel group of one rank each (every rank calls new_group for every group).
            singles = [dist.new_group([rank]) for rank in range(self.world_size)]
            self._pp_group, self._dp_group = dist.group.WORLD, singles[self.global_rank]
            return
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh(self.root_device.type, (self.data_parallel_size, p), mesh_dim_names=("dp", "pp"))
        self._pp_group, self._dp_group = mesh.get_group("pp"), mesh.get_group("dp")

    @property
    def data_parallel_group(self) -> dist.ProcessGroup | None:
        """The ranks that hold the same stages, one per pipeline: where each shard of the data is gathered.

        :class:`~lightning_balanced.evaluation.DistributedEvalMixin` gathers over it by default: the ranks of one
        pipeline hold the same outputs, so gathering over the world would count each sample ``p`` times.
        """
        return self._dp_group

    # ---- placement -------------------------------------------------------------------------------------------------
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

    # ---- setup and teardown ----------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.accelerator is not None and self.model is not None
        module = self.lightning_module
        assert module is not None
        if self._layer_sync is not None:
            raise ValueError("`Trainer(sync_batchnorm=True)` is not supported with strategy='pipeline'")
        fitting = trainer.state.fn == TrainerFn.FITTING
        if fitting and not module.automatic_optimization:
            raise ValueError(
                "strategy='pipeline' runs the forward and backward pass itself (torch's pipeline schedule):"
                " manual optimization (`automatic_optimization = False`) is not supported"
            )
        if fitting and not callable(getattr(module, LOSS_HOOK, None)):
            raise ValueError(
                f"strategy='pipeline' needs `{type(module).__name__}.{LOSS_HOOK}(self, output, target) -> Tensor`:"
                " the loss of one micro-batch, which the last stage calls on each micro-batch"
            )
        self.accelerator.setup(trainer)
        self._build_stages(module)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        if fitting:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        self.precision_plugin = with_global_norm_clipping(self.precision_plugin, self._clip_grad_by_global_norm)
        self._report()

    def _build_stages(self, module: pl.LightningModule) -> None:
        sequential = find_sequential(module, self.module_name, "pipeline")
        p, k = self.pipeline_size, self.stages_per_rank
        num_stages = p * k
        if not isinstance(self.balance, list) and len(sequential) < num_stages:
            raise ValueError(
                f"`{self.module_name}` has {len(sequential)} layers, fewer than the {num_stages} stages"
                f" ({p} ranks x {k} stages per rank)"
            )
        balance, self._balance_method = pipeline_balance(
            self.balance,
            sequential,
            num_stages,
            example=getattr(module, "example_input_array", None),
            chunks=self.chunks,
            device=self.root_device,
            global_rank=self.global_rank,
            module_name=self.module_name,
            owner=type(module).__name__,
        )
        if len(balance) != num_stages:
            raise ValueError(
                f"`balance` {balance} must hold one entry per stage: {num_stages} ({p} ranks x {k} stages per rank)"
            )
        self._balance = balance
        self._owners = stage_owners(p, k, self.schedule.placement)
        mine = stage_indices(self.pipeline_rank, p, k, self.schedule.placement)
        self._built_on_meta = is_on_meta(module)
        if self._built_on_meta:
            self._materialize_own_layers(module, sequential, mine)
        if self.deferred_batch_norm:  # in place: the stages and the wrapper below hold the converted layers
            DeferredBatchNorm.convert_deferred_batch_norm(sequential)
        in_sequential = {id(param) for param in sequential.parameters()}
        self._loss_parameters = [param for param in module.parameters() if id(param) not in in_sequential]
        assert self._pp_group is not None
        self._runtime = build_runtime(
            sequential,
            balance,
            self._owners,
            mine,
            self.pipeline_rank,
            self._pp_group,
            self.root_device,
            self.activation_checkpointing,
        )
        self._timer = BusyTimer(self.root_device) if self.log_bubble else None
        self._pipelined = _PipelinedSequential(sequential, self)
        setattr(module, self.module_name, self._pipelined)

    def _materialize_own_layers(self, module: pl.LightningModule, sequential: nn.Sequential, mine: list[int]) -> None:
        """A model built on the meta device: this rank's stages' layers, and what is outside the Sequential, get memory.

        Layer ``i`` is initialized from ``seed + i`` (``seed_everything``'s seed, else 0), what is outside the
        ``nn.Sequential`` from ``seed - 1`` (:mod:`~lightning_balanced.pipelining.materialize`), so the model is the
        same whatever the balance and the ranks. The other ranks' layers stay on the meta device.
        """
        if not self.save_distributed_checkpoint:
            raise ValueError(
                "strategy='pipeline' got a model built on the meta device: no rank holds the whole model, so a"
                " checkpoint cannot be one file; keep `save_distributed_checkpoint=True` (the default)"
            )
        seed = int(os.environ.get("PL_GLOBAL_SEED", 0))
        owned = [layer for stage in mine for layer in stage_layers(self._balance, stage)]
        materialize_layers(sequential, owned, self.root_device, seed)
        module._modules[self.module_name] = None  # the rest of the LightningModule, without the Sequential
        try:
            materialize(module, self.root_device, seed - 1, f"{type(module).__name__} (outside `{self.module_name}`)")
        finally:
            module._modules[self.module_name] = sequential

    def _report(self) -> None:
        lines = [
            f"pipeline: schedule {self.schedule.name}, {counted(self.chunks, 'micro-batch', 'micro-batches')},"
            f" {counted(len(self._balance), 'stage')} over {counted(self.pipeline_size, 'rank')} x"
            f" {counted(self.data_parallel_size, 'data-parallel replica')};"
            f" balance {self._balance} ({self._balance_method})"
        ]
        start = 0
        for stage, size in enumerate(self._balance):
            lines.append(f"  stage {stage}: layers {start}..{start + size - 1} on pipeline rank {self._owners[stage]}")
            start += size
        rank_zero_report("\n".join(lines))

    @override
    def on_train_start(self) -> None:
        super().on_train_start()
        self._check_batch_sizes()

    def _check_batch_sizes(self) -> None:
        """Before the first step: every training batch that will run splits into ``chunks`` equal micro-batches."""
        module = self.lightning_module
        assert module is not None
        trainer = module.trainer
        loader = trainer.train_dataloader
        if not isinstance(loader, DataLoader) or not isinstance(loader.batch_size, int):
            return  # the step checks each batch
        if loader.batch_size % self.chunks:
            raise ValueError(
                f"strategy='pipeline' splits each batch into `chunks`={self.chunks} equal micro-batches, but the"
                f" DataLoader's `batch_size` is {loader.batch_size}: use a multiple of {self.chunks}"
            )
        try:
            samples = len(loader.sampler)  # type: ignore[arg-type]  # this rank's: DistributedSampler's share
        except TypeError:
            return
        last = samples % loader.batch_size
        reached = trainer.num_training_batches >= len(loader)
        if last and last % self.chunks and not loader.drop_last and reached:
            raise ValueError(
                f"strategy='pipeline' splits each batch into `chunks`={self.chunks} equal micro-batches, but the last"
                f" training batch of each epoch would have {last} samples ({samples} samples per data-parallel rank in"
                f" batches of {loader.batch_size}): set `drop_last=True` on the DataLoader, or choose sizes that leave"
                f" a multiple of {self.chunks}"
            )

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
        self._step_grads = []
        sequential = None if module is None else module._modules.get(self.module_name)
        if not self._built_on_meta or module is None or sequential is None:
            super().teardown()
            return
        # Lightning's teardown moves the module to the CPU, which a layer on the meta device cannot do: this rank's
        # own layers go one by one, the others stay where they are.
        for layer in sequential.children():
            if not is_on_meta(layer):
                layer.cpu()
        module._modules[self.module_name] = None
        try:
            super().teardown()
        finally:
            module._modules[self.module_name] = sequential

    # ---- the steps -------------------------------------------------------------------------------------------------
    @override
    def _setup_model(self, model: nn.Module) -> nn.Module:  # type: ignore[override]
        return model  # the schedule does the stages' communication; gradients are averaged over `dp` explicitly

    @property
    def _stages(self) -> dict[int, StageModule]:
        """This rank's stages by stage index (none before setup and after teardown)."""
        return {} if self._runtime is None else self._runtime.stages

    def _own_parameters(self) -> list[nn.Parameter]:
        """The parameters of this rank's stages (each once)."""
        return [] if self._runtime is None else self._runtime.own_parameters()

    def _shared_parameters(self) -> list[nn.Parameter]:
        """The trainable parameters outside the ``nn.Sequential`` (a loss's or a head's): every rank holds a copy.

        Only the last stage's rank uses them (in ``compute_loss``), so their gradients are summed over the pipeline
        (the other ranks add nothing) and averaged over the data-parallel group: every rank then steps its copy alike.
        """
        return [param for param in self._loss_parameters if param.requires_grad]

    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        batch = args[0] if args else kwargs["batch"]
        x, y = self._input_and_target(batch)
        batch_size = first_tensor(x).shape[0]
        if batch_size % self.chunks:
            raise ValueError(
                f"strategy='pipeline' splits each batch into `chunks`={self.chunks} equal micro-batches, but a batch"
                f" has {batch_size} samples: use a batch size that is a multiple of {self.chunks} (and"
                " `drop_last=True` for a short last batch)"
            )
        x, y = _to(x, self.root_device), y.to(self.root_device)
        batch_idx = args[1] if len(args) > 1 else kwargs.get("batch_idx")
        with self.naming_a_lost_peer("a training step"):
            return self._train_on(x, y, batch_size, self._zeroes_gradients(batch_idx))

    def _zeroes_gradients(self, batch_idx: int | None) -> bool:
        """Whether Lightning's loop zeroes the gradients after this batch's ``training_step``.

        So on the first batch of an accumulation window, with the default ``optimizer_zero_grad``: the last step's
        gradients may go before the schedule runs, so a rank never holds two steps' gradients at once.
        """
        module = self.lightning_module
        if module is None or batch_idx is None or is_overridden("optimizer_zero_grad", module):
            return False
        return batch_idx % module.trainer.accumulate_grad_batches == 0

    def _input_and_target(self, batch: Any) -> tuple[Activation, Tensor]:
        """The first stage's input(s) and the target: ``pipeline_batch(batch)`` where the LightningModule defines it."""
        module = self.lightning_module
        hook = getattr(module, BATCH_HOOK, None)
        split = hook(batch) if callable(hook) else batch
        if (
            isinstance(split, (tuple, list))
            and len(split) == 2
            and isinstance(split[1], Tensor)
            and (isinstance(split[0], Tensor) or _is_tensor_tuple(split[0]))
        ):
            return (split[0] if isinstance(split[0], Tensor) else tuple(split[0])), split[1]
        if callable(hook):
            raise TypeError(
                f"`{type(module).__name__}.{BATCH_HOOK}(batch)` must return `(input, target)`: `input` a tensor or a"
                f" tuple of tensors (the first stage's arguments), `target` a tensor; got {_described(split)}"
            )
        raise TypeError(
            "strategy='pipeline' takes batches of `(input, target)` tensors: the first stage reads `input`, the last"
            f" stage's `compute_loss` gets `target`; got {_described(batch)}. For other batches define"
            f" `{BATCH_HOOK}(self, batch) -> (input, target)` on the LightningModule"
        )

    def _train_on(self, x: Activation, y: Tensor, batch_size: int, zeroed: bool = False) -> Tensor:
        assert self._runtime is not None
        schedule = self._runtime.schedule_for(
            x, self.schedule, self.chunks, self._loss, self.precision_plugin.train_step_context, self._timer
        )
        own, shared = self._own_parameters(), self._shared_parameters()
        trained = [*own, *shared]
        # What the schedule computes goes to `backward`; the gradients there now are put back after it, unless
        # Lightning's loop is about to zero them (`zeroed`).
        previous = [None if zeroed else param.grad for param in trained]
        for param in trained:
            param.grad = None
        self._micro_batch_losses = []
        # Lightning divides the closure's loss by `accumulate_grad_batches`; the schedule's backward must do the same.
        trainer = self.lightning_module.trainer  # type: ignore[union-attr]
        self._loss_weight = 1.0 / (self.chunks * trainer.accumulate_grad_batches)
        step_args: tuple[Any, ...] = (x if isinstance(x, tuple) else (x,)) if 0 in self._stages else ()
        step_kwargs: dict[str, Any] = {"target": y} if len(self._owners) - 1 in self._stages else {}
        if self._timer is not None:
            self._timer.start_step()
        deferred = self._runtime.deferred
        for layer in deferred:
            layer.reset_accumulator()
        self._loss_parameter_grads = [None] * len(shared)
        with self.precision_plugin.train_step_context():
            schedule.step(*step_args, **step_kwargs)
        for param, grad in zip(shared, self._loss_parameter_grads, strict=True):
            param.grad = grad  # what _loss took, not what the schedule's backward may have added
        self._loss_parameter_grads = []
        commit_running_statistics(deferred, self._dp_group, self.data_parallel_size, self.root_device)
        # One all_reduce over the pipeline carries each rank's compute time, the loss (float64 on every rank: only the
        # last stage's rank knows the loss's own dtype), each rank's step time, whether its stages' gradients hold an
        # inf or NaN (16-mixed), and the gradients of the parameters outside the nn.Sequential with a flag each for
        # "has a gradient": [busy | loss | step | non-finite | flags | gradients]. The others' slots are zeros, so
        # the sums are exact (a float32 or float16 gradient round-trips through float64 unchanged), and every rank
        # derives the same bubbles, the same shared gradients and the same decision to skip the step.
        p, rank = self.pipeline_size, self.pipeline_rank
        fields = {"busy_s": p, "loss": 1, "step_s": p, "non_finite": 1}
        shared_grads = SharedGradients(shared, offset=sum(fields.values()))
        layout = ExchangeLayout(fields, extra=shared_grads.end - shared_grads.flags)
        report = layout.new_buffer(self.root_device)
        if self._timer is not None:
            layout.set(report, "busy_s", rank, self._timer.busy_seconds())
            layout.set(report, "step_s", rank, self._timer.step_seconds())
        for micro_batch_loss in self._micro_batch_losses:
            layout.field(report, "loss").add_(micro_batch_loss.to(report))
        scaled = getattr(self.precision_plugin, "scaler", None) is not None
        if scaled:
            layout.set(report, "non_finite", 0, non_finite([param.grad for param in own]))
        shared_grads.pack(report)
        assert self._pp_group is not None
        dist.all_reduce(report, group=self._pp_group)
        if self.data_parallel_size > 1:
            for param in own:
                if param.grad is not None:
                    dist.all_reduce(param.grad, group=self._dp_group)
                    param.grad /= self.data_parallel_size
            dist.all_reduce(report, group=self._dp_group)
            report /= self.data_parallel_size
        # One read from the device, for the bubbles, the non-finite flag and the shared gradients' flags.
        head = report[: shared_grads.values].tolist() if self._timer is not None or shared or scaled else []
        shared_grads.unpack(report, head)
        read = layout.unpack(head) if head else {}
        if scaled and read["non_finite"][0] > 0:
            mark_non_finite(own)
        self._step_grads = [(param, param.grad) for param in trained if param.grad is not None]
        for param, grad in zip(trained, previous, strict=True):
            param.grad = grad
        module = self.lightning_module
        assert module is not None
        loss = layout.field(report, "loss")[0]
        module.log("train_loss", loss, prog_bar=True, batch_size=batch_size)
        if self._timer is not None:
            # The step ends when the last rank of the pipeline is done: a rank that finishes early waits in the bubble.
            step_s = max(read["step_s"])
            self._log_bubble(module, [bubble(busy_s, step_s) for busy_s in read["busy_s"]], batch_size)
        return loss

    def _log_bubble(self, module: pl.LightningModule, bubbles: list[float], batch_size: int) -> None:
        """Each pipeline rank's idle fraction of the step, their mean (progress bar) and the schedule's formula."""
        module.log("pipeline/bubble", sum(bubbles) / len(bubbles), prog_bar=True, batch_size=batch_size)
        for rank, value in enumerate(bubbles):
            module.log(f"pipeline/bubble_rank{rank}", value, batch_size=batch_size)
        theory = self.schedule.theoretical_bubble(self.pipeline_size, self.chunks, self.stages_per_rank)
        if theory is not None:
            module.log("pipeline/bubble_theory", theory, batch_size=batch_size)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """Hand over the gradients the schedule computed in ``training_step`` (added to ``.grad``, as backward does)."""
        module = self.lightning_module
        assert module is not None
        self.pre_backward(closure_loss)
        closure_loss = self.precision_plugin.pre_backward(closure_loss, module)
        for param, grad in self._step_grads:
            param.grad = grad if param.grad is None else param.grad + grad
        self._step_grads = []
        closure_loss = self.precision_plugin.post_backward(closure_loss, module)
        self.post_backward(closure_loss)
        return closure_loss

    def _loss(self, output: Tensor, target: Tensor) -> Tensor:
        """The micro-batch's loss weighted by ``1 / (chunks * accumulate_grad_batches)``, scaled by the ``GradScaler``.

        The weight is what Lightning's loop gives the whole batch's loss (the mean over the micro-batches, divided by
        ``accumulate_grad_batches``). The schedule's backward is the one ``16-mixed`` would have scaled; the loss
        weighted by ``1 / chunks`` only is kept for the log.
        """
        module = self.lightning_module
        assert module is not None
        loss: Tensor = getattr(module, LOSS_HOOK)(output, target) / self.chunks
        self._micro_batch_losses.append(loss.detach())
        weighted = loss * (self._loss_weight * self.chunks)  # 1 / chunks and Lightning's 1 / accumulate_grad_batches
        scaler = getattr(self.precision_plugin, "scaler", None)
        scaled = weighted if scaler is None else scaler.scale(weighted)
        # The gradients of the parameters outside the stages (a head's, a loss weight's) are taken here, through the
        # loss alone: torch's schedules differ in what their backward computes for parameters a stage does not hold
        # (the zero-bubble ones' weight pass covers the stage's own only, and torch 2.11's InterleavedZeroBubble got
        # them wrong), so the strategy computes them itself, the same way under every schedule.
        params = self._shared_parameters()
        if params and scaled.requires_grad:
            grads = torch.autograd.grad(scaled, params, retain_graph=True, allow_unused=True)
            for index, grad in enumerate(grads):
                if grad is not None:
                    held = self._loss_parameter_grads[index]
                    self._loss_parameter_grads[index] = grad if held is None else held + grad
        return scaled

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

    # ---- gradient clipping -----------------------------------------------------------------------------------------
    def _clip_grad_by_global_norm(self, optimizer: Optimizer, clip_val: float) -> None:
        """``clip_grad_norm_`` with the norm over every stage's gradients (each rank holds its stages' only)."""
        with self.naming_a_lost_peer("clipping the gradients"):
            own, shared = self._own_parameters(), self._shared_parameters()
            first = self.pipeline_rank == 0
            clip_grad_by_global_norm(own, shared, first, self._pp_group, clip_val, self.root_device)

    # ---- checkpoints -----------------------------------------------------------------------------------------------
    def _share_stages(self) -> None:
        """Every stage's parameters and buffers from the rank that trains it to every rank of the pipeline."""
        if self._pp_group is None or self._pipelined is None or not dist.is_initialized():
            return
        with self.naming_a_lost_peer("sharing the stages"):
            self._broadcast_stages()

    def _broadcast_stages(self) -> None:
        sequential = self._pipelined
        assert sequential is not None and self._pp_group is not None
        start = 0
        for stage, size in enumerate(self._balance):
            source = dist.get_global_rank(self._pp_group, self._owners[stage])
            for layer in list(sequential)[start : start + size]:
                for tensor in [*layer.parameters(), *layer.buffers()]:
                    moved = tensor.detach().to(self.root_device)
                    dist.broadcast(moved, source, group=self._pp_group)
                    if moved is not tensor:
                        with torch.no_grad():
                            tensor.copy_(moved)
            start += size

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
        if self._pp_group is None or not dist.is_initialized():
            return state
        own_state: dict[int, Any] = state["state"]  # type: ignore[assignment]
        local = {index: to_host(value) for index, value in own_state.items()}
        gathered: list[dict[int, Any] | None] = [None] * self.pipeline_size
        with self.naming_a_lost_peer("gathering the optimizer state"):
            dist.all_gather_object(gathered, local, group=self._pp_group)
        return {**state, "state": merged_optimizer_state(gathered)}

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


def _is_tensor_tuple(value: Any) -> bool:
    return isinstance(value, (tuple, list)) and len(value) > 0 and all(isinstance(t, Tensor) for t in value)


def _described(value: Any) -> str:
    if isinstance(value, (tuple, list)):
        return f"a {type(value).__name__} of {len(value)}: ({', '.join(type(v).__name__ for v in value)})"
    return type(value).__name__


def _to(x: Activation, device: torch.device) -> Activation:
    return tuple(t.to(device) for t in x) if isinstance(x, tuple) else x.to(device)
