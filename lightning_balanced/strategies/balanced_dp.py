"""Single-process data parallel with an uneven, user-controlled split of each batch over the devices."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import lightning.pytorch as pl
import torch
from lightning.fabric.utilities.warnings import PossibleUserWarning
from lightning.pytorch.strategies import ParallelStrategy
from lightning.pytorch.utilities import rank_zero_warn
from typing_extensions import override

from lightning_balanced.data_parallel import (
    check_replicable,
    infer_batch_size,
    virtual_devices,
)
from lightning_balanced.data_parallel.replica_batchnorm import (
    SyncBatchNormLayers,
    convert_replica_batchnorm,
    revert_replica_batchnorm,
)
from lightning_balanced.data_parallel.runner import ReplicaProfile, ReplicaRunner
from lightning_balanced.data_parallel.virtual_device import emulated_device
from lightning_balanced.ranks.reports import counted, rank_zero_report
from lightning_balanced.split_policies.split_policy import (
    ChunkSizes,
    Gpu0Budget,
    SplitOptions,
    Weights,
    learns_from_steps,
    observes_peak_bytes,
)
from lightning_balanced.strategies.single_process import SingleProcess

_REPORT_MEMORY_AFTER_STEPS = 3
# The start of the message of torch.nn.functional._verify_batch_size: a training BatchNorm saw one value per channel.
_BATCHNORM_ONE_VALUE_ERROR = "Expected more than 1 value per channel when training"


def _one_value_per_channel(error: ValueError) -> bool:
    """Whether ``error`` is torch's: a training BatchNorm saw one value per channel (a chunk of 1 sample)."""
    return str(error).startswith(_BATCHNORM_ONE_VALUE_ERROR)


class BalancedDataParallel(SplitOptions, SingleProcess):
    """The implementation of :class:`BalancedDataParallelStrategy`, free of a Lightning base class.

    Combined with ``lightning.pytorch``'s ``ParallelStrategy`` it is :class:`BalancedDataParallelStrategy`; combined
    with the standalone ``pytorch_lightning`` package's, it is the class that package's registry holds.
    """

    strategy_name = "balanced_dp"

    def __init__(self, *args: Any, sync_batchnorm: bool = False, **kwargs: Any) -> None:
        # The split options (SplitOptions: positionally, `gpu0_bsz` first), then the plugins (SingleProcess).
        super().__init__(*args, **kwargs)
        if not isinstance(sync_batchnorm, bool):
            raise TypeError(f"`sync_batchnorm` must be a bool, got {sync_batchnorm!r}")
        # Only a policy that learns from the steps (overrides `observe`) has its replicas timed.
        self._split_observes = learns_from_steps(self.split)
        # ... and is given the devices' memory when its `observe` takes `peak_bytes` (a two-argument one still works).
        self._split_observes_memory = observes_peak_bytes(self.split)
        self.sync_batchnorm = sync_batchnorm
        self._batchnorm_synced = False
        self._devices: list[torch.device] = []
        self._runner: ReplicaRunner | None = None
        self._executor: ThreadPoolExecutor | None = None
        self._plan_reported = False
        self._training_steps = 0

    @property
    def gpu0_bsz(self) -> int | None:
        """The ``gpu0_bsz`` of a :class:`Gpu0Budget` split, or ``None`` when the split is another policy."""
        return self.split.gpu0_bsz if isinstance(self.split, Gpu0Budget) else None

    @property
    def chunk_sizes(self) -> list[int] | None:
        """The ``chunk_sizes`` of a :class:`ChunkSizes` split, or ``None`` when the split is another policy."""
        return self.split.chunk_sizes if isinstance(self.split, ChunkSizes) else None

    @property
    def weights(self) -> list[float] | None:
        """The ``weights`` of a :class:`Weights` split, or ``None`` when the split is another policy."""
        return self.split.weights if isinstance(self.split, Weights) else None

    @override
    def model_to_device(self) -> None:
        assert self.model is not None
        self.model.to(self.root_device)

    # ---- setup and teardown ----------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.parallel_devices, "parallel_devices are set by the Trainer"
        assert self.model is not None, "the LightningModule is connected before setup"
        num_devices = len(self.parallel_devices)
        self.split.check_devices(num_devices)
        check_replicable(self.model)
        self._devices = virtual_devices(self.parallel_devices)
        # `Trainer(sync_batchnorm=True)` reaches us as `_layer_sync`, which Lightning's accelerator connector sets
        # after __init__ (to torch's SyncBatchNorm plugin, which is for process groups): it asks for the same thing.
        if self.sync_batchnorm or self._layer_sync is not None:
            self.model = convert_replica_batchnorm(self.model)
            self._batchnorm_synced = True
        super().setup(trainer)
        assert self.lightning_module is not None
        if self._split_observes:
            self.split.set_capacities(self._capacities())
            self.split.set_devices(list(self._devices))
        if num_devices == 1:
            rank_zero_warn(
                "balanced_dp runs on 1 device: nothing runs in parallel. Give it several devices (`devices=2`, or"
                " `parallel_devices=[torch.device('cuda', 0)] * 2` for several replicas on one GPU), or use the"
                " default strategy on one device.",
                category=PossibleUserWarning,
            )
        if num_devices > 1 and self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=num_devices - 1, thread_name_prefix="balanced_dp")
        # On CUDA, a stream per replica (not per device), so replicas that share a GPU still run side by side.
        streams = [torch.cuda.Stream(d) for d in self._devices] if self.root_device.type == "cuda" else []
        self._runner = ReplicaRunner(
            self.lightning_module,
            self.precision_plugin,
            self._devices,
            self.root_device,
            self.loss_reduction,
            # Found once here; each step follows their paths in the replicas instead of searching the replicas' trees.
            SyncBatchNormLayers(self.lightning_module) if self._batchnorm_synced else None,
            self._executor,
            streams,
        )

    @override
    def teardown(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True)
            self._executor = None
        self._runner = None
        if self._batchnorm_synced and self.model is not None:
            self.model = revert_replica_batchnorm(self.model)  # the user's own BatchNorm objects, trained state
            self._batchnorm_synced = False
        on_cuda = self.parallel_devices is not None and self.root_device.type == "cuda"
        super().teardown()
        if on_cuda:
            torch.cuda.empty_cache()

    # ---- the steps -------------------------------------------------------------------------------------------------
    @override
    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.train_step_context():
            return self._data_parallel_step("training_step", args, kwargs)

    @override
    def validation_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.val_step_context():
            return self._data_parallel_step("validation_step", args, kwargs)

    @override
    def test_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.test_step_context():
            return self._data_parallel_step("test_step", args, kwargs)

    @override
    def predict_step(self, *args: Any, **kwargs: Any) -> Any:
        with self.precision_plugin.predict_step_context():
            return self._data_parallel_step("predict_step", args, kwargs)

    def plan(self, batch_size: int) -> list[int]:
        """The chunk sizes, one per device (``0`` = left out), for a batch of ``batch_size`` samples.

        What the split policy plans (:meth:`~lightning_balanced.data_parallel.SplitPolicy.plan`); every step of every
        loop asks it here.
        """
        assert self.parallel_devices is not None
        return self.split.plan(batch_size, len(self.parallel_devices))

    def _data_parallel_step(self, step_name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        runner = self._runner
        assert runner is not None
        batch_size = infer_batch_size((args, kwargs))
        planned = self.plan(batch_size)
        if step_name == "training_step":
            self._report_plan(batch_size, planned)
        observed = step_name == "training_step" and self._split_observes and batch_size > 0
        try:
            gathered, step = runner(step_name, planned, args, kwargs, profiled=observed)
        except ValueError as error:
            if self._batchnorm_synced or step_name != "training_step" or not _one_value_per_channel(error):
                raise
            raise ValueError(
                f"balanced_dp split a batch of {batch_size} as {planned}: a chunk of 1 sample cannot be"
                " batch-normalized in training (BatchNorm needs more than one value per channel). Use"
                f" `sync_batchnorm=True`, change the split ({self.split}), use a batch size of at least 2 per"
                " device, or `drop_last=True` in the DataLoader for a short last batch."
            ) from error
        if step.profile is not None:  # after the gather, so that device 0's peak includes the gathered outputs
            seconds = [0.0] * len(planned)
            for i, took in zip(step.run, step.profile.seconds(), strict=True):
                seconds[i] = took
            if self._split_observes_memory:
                self.split.observe(list(planned), seconds, peak_bytes=self._peak_bytes(step.profile, step.run))
            else:
                self.split.observe(list(planned), seconds)
        if step_name == "training_step":
            self._report_memory()
        return gathered

    def _capacities(self) -> list[int | None]:
        """Each device's memory in bytes: a GPU's total memory shared by its replicas; a virtual device's emulated."""
        if self.root_device.type == "cuda":
            return [torch.cuda.get_device_properties(d).total_memory // self._devices.count(d) for d in self._devices]
        return [None if (e := emulated_device(d)) is None else e.capacity_bytes for d in self._devices]

    def _peak_bytes(self, profile: ReplicaProfile, run: list[int]) -> list[int | None]:
        """Each device's memory in the step (``None`` for a device left out): a GPU's peak, a virtual device's own."""
        peaks: list[int | None] = [None] * len(self._devices)
        for k, i in enumerate(run):
            device = self._devices[i]
            peaks[i] = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else profile.peak_bytes[k]
        return peaks

    def _report_plan(self, batch_size: int, planned: list[int]) -> None:
        if self._plan_reported:
            return
        self._plan_reported = True
        assert self.parallel_devices is not None
        lines = [
            f"balanced_dp: a batch of {counted(batch_size, 'sample')} is split over {counted(len(planned), 'device')}"
            f" as {planned}"
        ]
        for index, (device, size) in enumerate(zip(self._devices, planned, strict=True)):
            share = 100.0 * size / batch_size if batch_size else 0.0
            left_out = "" if size else ", left out"
            lines.append(f"  device {index} ({device}): {counted(size, 'sample')} ({share:.1f}%){left_out}")
        rank_zero_report("\n".join(lines))

    def _report_memory(self) -> None:
        self._training_steps += 1
        if self._training_steps != _REPORT_MEMORY_AFTER_STEPS or self.root_device.type != "cuda":
            return
        assert self.parallel_devices is not None
        lines = [f"balanced_dp: peak GPU memory after {self._training_steps} training steps (tune gpu0_bsz with it)"]
        for index, device in enumerate(self.parallel_devices):
            peak = torch.cuda.max_memory_allocated(device) / 2**20
            shared = [i for i, d in enumerate(self.parallel_devices) if d == device]
            together = f" (shared by devices {shared})" if len(shared) > 1 else ""
            lines.append(f"  device {index} ({device}): {peak:.0f} MiB{together}")
        rank_zero_report("\n".join(lines))


class BalancedDataParallelStrategy(BalancedDataParallel, ParallelStrategy):
    """Single-process data parallel over several devices, each taking a chunk of the batch you choose.

    Every step, the batch is split along dim 0 by the chunk plan of the split policy (``split=``, the one rule for all
    four loops), the LightningModule
    is replicated from the root device (``devices[0]``) to the devices that got samples, the step (``training_step``,
    ``validation_step``, ``test_step`` or ``predict_step``) runs on those replicas at once, and the outputs are gathered
    on the root device in batch order. On CUDA these are torch's
    ``scatter``/``replicate``/``parallel_apply``/``gather``; on CPU the same code runs over virtual devices ``cpu:0``,
    ``cpu:1``, ... (one thread per replica) that keep the rules of GPUs: replica ``i`` computes on ``cpu:i``
    (``self.device`` in its step), and combining tensors of two replicas without moving them raises as on GPUs. So
    ``Trainer(accelerator="cpu", devices=N, strategy="balanced_dp")`` behaves like N GPUs would. A batch of 0 samples
    runs on the root device alone, as on one device.

    Step outputs are combined so that they equal what one device returns for the whole batch:

    ==================================================  =============================================================
    what each replica's step returns                    what the step returns under balanced_dp
    ==================================================  =============================================================
    tensor with a batch dimension                       concatenated along dim 0, in batch order, on the root device
    ``list`` with one item per sample of its chunk      concatenated in batch order (ids, per-image detections)
    0-dim floating tensor (the loss, a mean)            mean weighted by chunk size: the batch mean (the sum with
                                                        ``loss_reduction="sum"``)
    0-dim integer tensor (a count)                      summed, same dtype
    0-dim bool tensor                                   set when set on any replica (the sum in ``bool``)
    ``dict``, ``tuple``, namedtuple, dataclass, a       combined item by item with these rules
    ``list`` of other length or of batched tensors
    anything else (``str``, numbers, ``None``)          kept once when equal on every replica, else the list of the
                                                        replicas' values
    ==================================================  =============================================================

    So with the usual per-chunk mean loss, one step equals the single-device step on the whole batch. ``self.log``
    inside steps is recorded per replica and logged once per step from the main thread, as the chunk-weighted mean
    (or the sum/max/min for those ``reduce_fx``). torchmetrics metrics are not replicated: every replica's call
    (``update``, ``forward``) reaches the original metric, one at a time, with its inputs moved to the root device, so
    ``self.log(name, metric)`` gives the single-device value (``forward`` returns the value of the replica's chunk).
    Under ``torch.nn.DataParallel`` a replica's metric shares the root's state tensors without their device, so an
    update from another GPU fails or is lost. Manual optimization works: ``manual_backward`` runs once on the
    weighted sum of the replicas' losses, each ``optimizer.step()``, ``zero_grad()``, ``clip_gradients``,
    ``toggle_optimizer`` once for all replicas, and after each ``optimizer.step()`` the replicas' copies of the
    parameters are refreshed from the root's, so a second pass in the same step (a GAN's discriminator after the
    generator's step) sees the updated parameters, as on one device. A replica that fails surfaces its own exception
    (with a note naming the replica and device), on CUDA too, where torch's ``parallel_apply`` would re-raise a copy.

    What data parallelism changes, as with ``torch.nn.DataParallel``:

    * BatchNorm, by default, normalizes each chunk with that chunk's statistics, and only replica 0's
      running-statistics update persists (none when device 0 has no samples). A chunk of one sample cannot be
      batch-normalized in training: such a split raises a ``ValueError`` naming the setting to change. With
      ``sync_batchnorm=True`` (or ``Trainer(sync_batchnorm=True)``) every BatchNorm layer normalizes with the
      statistics of the whole batch instead, so training equals the single-device run, chunks of one sample included.
    * Inside a step, replicas' ``self.parameters()`` is empty (parameters are broadcast views); use the modules
      themselves.
    * Compiled modules (``torch.compile(module)`` or ``module.compile()`` anywhere in the LightningModule) are refused
      at setup with a ``TypeError``, and one compiled later (in a hook) at the next step with the same error: compiled
      code stays bound to the original module, so replicas would run the original. Train without compiling, or compile
      under a single device or DDP.
    * ``world_size`` is 1 and there is no ``DistributedSampler``: the dataloader's ``batch_size`` is the whole batch
      that is split.

    Args:
        split: how each batch is split over the devices, a :class:`~lightning_balanced.SplitPolicy`:

            * ``EvenSplit()`` (the default): sizes that differ by at most one.
            * ``Gpu0Budget(gpu0_bsz)``: the most samples device 0 takes per batch, a budget: device 0 takes
              ``min(gpu0_bsz, batch_size // num_devices)`` and the rest is spread evenly over the other devices (the
              classic ``BalancedDataParallel`` setting; device 0 also holds the gathered outputs). ``0`` leaves device
              0 to gathering only. A budget above the batch size (a short last batch, a larger validation batch) is
              not an error. On one device it must hold the batch.
            * ``ChunkSizes(chunk_sizes)``: explicit samples per device, one entry per device, for a batch of
              ``sum(chunk_sizes)``; a batch of another size (the last one, or another loop's) is split in the same
              proportions.
            * ``Weights(weights)``: relative capacity per device (e.g. memory of mixed GPUs); each batch is split
              proportionally with largest-remainder rounding.
            * ``AutoSplit(...)``: sizes by each device's speed and memory, measured during the first training steps
              and re-measured on drift (:class:`~lightning_balanced.AutoSplit`); validation, test and predict use the
              last plan's proportions.
            * a subclass of your own (see :class:`~lightning_balanced.SplitPolicy`).

            In a LightningCLI config: ``split: {class_path: lightning_balanced.Gpu0Budget, init_args: {gpu0_bsz:
            14}}``.
        gpu0_bsz: short for ``split=Gpu0Budget(gpu0_bsz)``.
        chunk_sizes: short for ``split=ChunkSizes(chunk_sizes)``; ``"auto"`` is short for ``split=AutoSplit()``:
            the sizes are chosen by each device's measured speed and memory (see
            :class:`~lightning_balanced.AutoSplit`), and each plan is logged with the ``chunk_sizes=[...]`` to pin it.
        weights: short for ``split=Weights(weights)``.
        loss_reduction: how the step's 0-dim floating outputs combine across replicas: ``"mean"`` (the step returns
            the mean over its chunk, the default) weights each by its chunk's share of the batch; ``"sum"`` (the step
            returns a sum over its chunk) adds them.
        parallel_devices: one device per replica, normally filled in by the ``Trainer`` from ``accelerator=`` and
            ``devices=``. Give it to run several replicas on one GPU: a device may repeat
            (``[torch.device("cuda", 0)] * 2`` with ``Trainer(accelerator="cuda", devices=1)``), and each replica then
            computes on a CUDA stream of its own (see below). Strings (``"cuda:0"``) are accepted; ``"cuda"`` is the
            current GPU. CUDA and CPU devices cannot be mixed.
        accelerator, checkpoint_io, precision_plugin: as for Lightning's ``ParallelStrategy``.

    One GPU, several replicas: with a GPU repeated in ``parallel_devices`` the step runs exactly as on that many GPUs
    (same chunk plan, same results as the single-device step), every replica on its own CUDA stream. Each hand-off
    between streams is ordered on the GPU, never by making the host wait: a replica's stream waits for the scatter and
    the replication queued on the root's stream before it starts, the root's stream waits for every replica's stream
    before the gather, and the synchronized-BatchNorm exchange waits on events recorded after each replica's moments
    and after their combination; tensors are recorded on the streams that use them. Replicas that share the root's
    GPU get copies of its buffers, so only replica 0's running-statistics update persists, as on several GPUs. It is no
    faster than one device; it is for trying a multi-GPU configuration (and running the multi-device code) on a
    one-GPU machine. The memory report lists each replica and says which share a GPU.

    Raises:
        ValueError: more than one of ``split``, ``gpu0_bsz``, ``chunk_sizes``, ``weights``; a negative size; weights
            that are not positive and finite; an unknown ``loss_reduction``; an empty ``parallel_devices`` or one
            mixing CUDA and CPU devices. At setup: ``chunk_sizes`` or ``weights`` whose length differs from the number
            of devices.
        TypeError: ``split`` not a ``SplitPolicy``; a non-integer size or non-real weight; ``parallel_devices`` not a
            list of devices; at setup (or at the next step, for one compiled in a hook), a compiled module.

    Source: Lightning 1.9's ``DataParallelStrategy`` (removed in 2.0) and the ``BalancedDataParallel`` of
    transformer-xl, with the loss weighted by chunk size instead of an unweighted mean.
    """
