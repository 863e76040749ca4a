"""One step of a LightningModule over device replicas, in the shape of torch's ``DataParallel.forward``.

:class:`ReplicaRunner` runs ``scatter`` → ``replicate`` → ``parallel_apply`` → ``gather``, each a method a subclass
may override (as ``torch.nn.DataParallel``'s four); around them, what a LightningModule's step needs on replicas: the
step's one barrier, the replicas' ``self.log`` recorded and replayed once, torchmetrics shared, manual optimization's
lockstep calls, synchronized BatchNorm, and each replica's time and memory for a split policy that observes.
``balanced_dp`` keeps the plan and the Lightning hooks; the runner does the step.

Source: torch's ``nn/parallel/data_parallel.py`` (the flow and its four overridable methods); Lightning 1.9's
``DataParallelStrategy`` (the step dispatched by name on each replica).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack
from dataclasses import dataclass
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import Precision
from torch.nn import Module
from torchmetrics import Metric
from typing_extensions import override

from lightning_balanced.data_parallel.barrier import ReplicaBarrier
from lightning_balanced.data_parallel.gather import chunk_weights, gather
from lightning_balanced.data_parallel.parallel_apply import parallel_apply
from lightning_balanced.data_parallel.replica_batchnorm import SyncBatchNormLayers
from lightning_balanced.data_parallel.replica_context import (
    ReplicaLogRecorder,
    SharedStep,
    find_metrics,
    install_manual_optimization,
    replay_logs,
    share_metrics,
)
from lightning_balanced.data_parallel.replicate import ReplicaParameters, check_replicable, replicate
from lightning_balanced.data_parallel.scatter import scatter
from lightning_balanced.data_parallel.virtual_device import emulated_step
from lightning_balanced.evaluation.mixin import REPLICA_POSITION
from lightning_balanced.timing import SpanTimer

__all__ = ["ReplicaProfile", "ReplicaRunner", "ReplicaStep", "StepCall", "StepDispatcher"]

# Seconds a replica waits for the others at a meeting of the step's barrier (a lockstep call, a synchronized BatchNorm).
REPLICA_TIMEOUT_S = 120.0


class ReplicaProfile:
    """Each replica's step-method time and memory, for a split policy that observes (:meth:`SplitPolicy.observe`).

    A :class:`~lightning_balanced.timing.SpanTimer` per replica: on CUDA two events on the replica's stream (current
    in its thread), read after the step; elsewhere the host clock. ``peak_bytes`` is filled by the virtual CPU devices
    (:func:`emulated_step`); the strategy reads a GPU's.
    """

    def __init__(self, count: int, on_cuda: bool) -> None:
        device = torch.device("cuda" if on_cuda else "cpu")
        self._timers = [SpanTimer(device) for _ in range(count)]
        self.peak_bytes: list[int | None] = [None] * count

    def measure(self, index: int) -> AbstractContextManager[None]:
        """Time replica ``index``'s step method (a context around it)."""
        return self._timers[index].span()

    def set_seconds(self, index: int, seconds: float) -> None:
        """Replace the host clock's time of replica ``index`` (CPU) by ``seconds``: an emulated device's own time."""
        self._timers[index].clear()
        self._timers[index].add_seconds(seconds)

    def seconds(self) -> list[float]:
        """Each replica's time in seconds; on CUDA the host waits here for the replicas' step methods to finish."""
        return [timer.seconds() for timer in self._timers]


@dataclass(frozen=True)
class StepCall:
    """What a replica's dispatcher is told: the step method, its chunk, and the step's barrier and profile."""

    name: str
    inference_mode: bool
    barrier: ReplicaBarrier
    replica_index: int
    device: torch.device
    samples: int
    resident_bytes: int = 0
    profile: ReplicaProfile | None = None


class StepDispatcher(Module):
    """What each replica runs: the LightningModule's step method, inside the precision context.

    The step is chosen by an argument rather than by patching ``forward`` on the LightningModule, so replicas, which
    copy the module's ``__dict__``, never run the root's step. Autocast and inference mode are thread-local, so both
    are re-entered here, on the replica's thread (torch's ``parallel_apply`` forwards only autocast's ``enabled``).
    """

    def __init__(self, module: pl.LightningModule, precision_plugin: Precision) -> None:
        super().__init__()
        self.module = module
        self.precision_plugin = precision_plugin

    def _step_context(self, name: str) -> AbstractContextManager[Any]:
        contexts: dict[str, Callable[[], AbstractContextManager[Any]]] = {
            "training_step": self.precision_plugin.train_step_context,
            "validation_step": self.precision_plugin.val_step_context,
            "test_step": self.precision_plugin.test_step_context,
            "predict_step": self.precision_plugin.predict_step_context,
        }
        return contexts[name]()

    @override
    def forward(self, call: StepCall, *args: Any, **kwargs: Any) -> Any:
        profile = call.profile
        try:
            with torch.inference_mode(call.inference_mode), self._step_context(call.name), ExitStack() as measures:
                if profile is not None:
                    measures.enter_context(profile.measure(call.replica_index))
                # A virtual CPU device as emulated (a testing aid: speed, memory), its memory read for the profile.
                on_cpu = call.device.type == "cpu"
                emulated = (
                    measures.enter_context(
                        emulated_step(call.device, call.resident_bytes, profile is not None, call.samples)
                    )
                    if on_cpu
                    else None
                )
                result = getattr(self.module, call.name)(*args, **kwargs)
            if profile is not None and emulated is not None:
                profile.peak_bytes[call.replica_index] = emulated.peak_bytes
                if emulated.seconds is not None:  # an emulated device: its own time, not the thread's wake-up
                    profile.set_seconds(call.replica_index, emulated.seconds)
            return result
        except BaseException as err:
            call.barrier.abort(call.replica_index, err)  # releases the replicas waiting for this one
            raise


@dataclass
class ReplicaStep:
    """One step over replicas as it runs: which devices got samples, and what the replicas share."""

    name: str
    run: list[int]  # the indices of the devices that got samples (the root alone for a batch of 0)
    chunk_sizes: list[int]
    devices: list[torch.device]
    barrier: ReplicaBarrier
    recorders: list[ReplicaLogRecorder]
    streams: list[torch.cuda.Stream]
    profile: ReplicaProfile | None


class ReplicaRunner:
    """Runs a LightningModule's step methods over replicas on ``devices``: torch ``DataParallel``'s flow.

    Args:
        module (pl.LightningModule): the root module, on ``devices[0]``.
        precision_plugin (Precision): its context is re-entered on each replica's thread.
        devices (list[torch.device]): one per replica (virtual CPU devices on the CPU); a device may repeat.
        root_device (torch.device): where the outputs are gathered (the strategy's root device: ``cpu`` for the
            virtual ``cpu:0``).
        loss_reduction (str): ``"mean"`` or ``"sum"``: how the replicas' 0-dim losses combine (:func:`gather`).
        batchnorm_layers (SyncBatchNormLayers | None): the synchronized BatchNorm layers, or ``None``.
        executor (ThreadPoolExecutor | None): the threads of replicas 1..; ``None`` for one replica.
        streams (list[torch.cuda.Stream]): one CUDA stream per replica, ``[]`` off CUDA.
    """

    def __init__(
        self,
        module: pl.LightningModule,
        precision_plugin: Precision,
        devices: list[torch.device],
        root_device: torch.device,
        loss_reduction: Literal["mean", "sum"],
        batchnorm_layers: SyncBatchNormLayers | None,
        executor: ThreadPoolExecutor | None,
        streams: list[torch.cuda.Stream],
    ) -> None:
        self.module = module
        self.dispatcher = StepDispatcher(module, precision_plugin)
        self.devices = devices
        self.root_device = root_device
        self.loss_reduction = loss_reduction
        self.batchnorm_layers = batchnorm_layers
        self.executor = executor
        self.streams = streams
        self.metrics: dict[str, Metric] = find_metrics(module)  # found once; replicas share the originals
        self.metric_lock = threading.Lock()
        self.resident_bytes = sum(t.numel() * t.element_size() for t in (*module.parameters(), *module.buffers()))
        self.steps_run = 0  # dispatched steps: with the replica index, the order of DistributedEvalMixin's calls

    def __call__(
        self, name: str, chunk_plan: list[int], args: tuple[Any, ...], kwargs: dict[str, Any], profiled: bool
    ) -> tuple[Any, ReplicaStep]:
        """Run step method ``name`` with the batch split by ``chunk_plan`` (one size per device, 0 = left out).

        Returns:
            The gathered output (what one device returns for the whole batch) and the step (its replicas' profile).

        Raises:
            BaseException: a replica's own exception, with a note naming the replica and its device.
        """
        run = [i for i, size in enumerate(chunk_plan) if size > 0] or [0]
        chunk_sizes, devices = [chunk_plan[i] for i in run], [self.devices[i] for i in run]
        scattered = self.scatter((args, kwargs), chunk_sizes, devices)
        replicas = self.replicate(run, devices)
        step = self._prepare(name, replicas, run, chunk_sizes, devices, profiled)
        inputs = [(self._call(step, i), *a) for i, (a, _) in enumerate(scattered)]
        outputs = self.parallel_apply(replicas, inputs, [k for _, k in scattered], step)
        replay_logs(self.module, step.recorders, chunk_sizes)
        return self.gather(outputs, chunk_sizes), step

    # ---- the four steps of the flow, each overridable ----------------------------------------------------------------
    def scatter(self, inputs: Any, chunk_sizes: list[int], devices: list[torch.device]) -> list[tuple[Any, Any]]:
        """``inputs`` (``(args, kwargs)``) cut along dim 0 into ``chunk_sizes``, one chunk on each device."""
        return scatter(inputs, chunk_sizes, devices)

    def replicate(self, run: list[int], devices: list[torch.device]) -> list[Any]:
        """The step dispatcher replicated onto ``devices`` (from the root device, as torch's ``replicate`` must)."""
        # torch's replicate broadcasts from the module's device, devices[0]: replicate there even when device 0 has no
        # samples, and leave that replica unused.
        replicate_to = [self.devices[0], *devices[run[0] == 0 :]]
        try:
            replicas = replicate(self.dispatcher, replicate_to, detach=not torch.is_grad_enabled())
        except TypeError:
            # A module compiled after setup (in a hook): the setup's error, naming it in the LightningModule.
            check_replicable(self.module)
            raise
        return replicas[1:] if run[0] != 0 else replicas

    def parallel_apply(
        self, replicas: list[Any], inputs: list[tuple[Any, ...]], kwargs: list[Any], step: ReplicaStep
    ) -> list[Any]:
        """Each replica's step method on its chunk, side by side (a thread each; a CUDA stream each on a GPU)."""
        failure: BaseException | None = None
        try:
            return parallel_apply(
                replicas, inputs, kwargs, step.devices, executor=self.executor, streams=step.streams or None
            )
        except Exception as wrapped:
            failure = self._replica_error(wrapped, step)
        raise failure  # outside the handler: the replica's own exception, not chained to the wrapped copy

    def gather(self, outputs: list[Any], chunk_sizes: list[int]) -> Any:
        """The replicas' outputs combined on the root device, as one device returns them for the whole batch."""
        return gather(outputs, self.root_device, chunk_sizes, loss_reduction=self.loss_reduction)

    # ---- around the flow ---------------------------------------------------------------------------------------------
    def _prepare(
        self,
        name: str,
        replicas: list[Any],
        run: list[int],
        chunk_sizes: list[int],
        devices: list[torch.device],
        profiled: bool,
    ) -> ReplicaStep:
        """The step's barrier, log recorders, shared metrics, manual optimization and BatchNorm, on the replicas."""
        # The step's one barrier: the lockstep calls of manual optimization and the synchronized BatchNorm layers meet
        # there, and a failing replica aborts it, releasing the others wherever they wait.
        barrier = ReplicaBarrier(len(replicas), REPLICA_TIMEOUT_S)
        if self.batchnorm_layers is not None and sum(chunk_sizes) > 0:  # a batch of 0 normalizes as on one device
            self.batchnorm_layers.attach([replica.module for replica in replicas], barrier)
        streams = [self.streams[i] for i in run] if self.streams else []
        step = ReplicaStep(
            name, run, chunk_sizes, devices, barrier, [ReplicaLogRecorder() for _ in replicas], streams, None
        )
        manual = name == "training_step" and not self.module.automatic_optimization
        loss_weights = chunk_weights(chunk_sizes, self.loss_reduction) if manual else []
        shared = SharedStep(
            barrier,
            self.devices[0],
            torch.cuda.current_stream(self.root_device) if streams else None,
            streams,
            # Before share_metrics: the replicas are walked side by side with the dispatcher.
            ReplicaParameters.of(self.dispatcher, replicas) if manual else ReplicaParameters(),
        )
        self.steps_run += 1
        for i, replica in enumerate(replicas):
            replica_module = replica.module
            replica_module.__dict__[REPLICA_POSITION] = (self.steps_run, i)  # DistributedEvalMixin: the chunk order
            replica_module.log = step.recorders[i].log
            share_metrics(replica_module, self.metrics, self.metric_lock, shared)
            if manual:
                install_manual_optimization(replica_module, self.module, i, shared, loss_weights[i])
        if profiled:
            step.profile = ReplicaProfile(len(replicas), devices[0].type == "cuda")
            if devices[0].type == "cuda":
                for device in set(devices):
                    torch.cuda.reset_peak_memory_stats(device)
        return step

    def _call(self, step: ReplicaStep, index: int) -> StepCall:
        return StepCall(
            step.name,
            torch.is_inference_mode_enabled(),
            step.barrier,
            index,
            step.devices[index],
            step.chunk_sizes[index],
            self.resident_bytes,
            step.profile,
        )

    def _replica_error(self, wrapped: Exception, step: ReplicaStep) -> BaseException:
        """The exception to raise for a failed step: the failing replica's own, whatever path re-raised a copy.

        torch's CUDA ``parallel_apply`` (and the CPU emulation, which copies it) re-raises a new exception built from
        the message, so the original is taken from the step's barrier, where each replica's dispatcher left it.
        """
        found = step.barrier.failure()
        if found is None:
            return wrapped
        index, error = found
        if hasattr(error, "add_note"):
            error.add_note(f"(raised in balanced_dp replica {index} on {step.devices[index]})")
        return error
