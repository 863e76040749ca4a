"""``Pipe``: an ``nn.Sequential`` whose forward pass runs as a GPipe pipeline over devices."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from contextlib import ExitStack
from typing import Any, Literal

import torch
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_balanced.arguments import check_int
from lightning_balanced.data_parallel import infer_batch_size
from lightning_balanced.data_parallel.stream_order import record_on
from lightning_balanced.data_parallel.virtual_device import VirtualDeviceMode
from lightning_balanced.gpipe.checkpoint import Checkpointing
from lightning_balanced.gpipe.dependency import depend
from lightning_balanced.gpipe.modes import ThreadModes
from lightning_balanced.gpipe.partition import Partition
from lightning_balanced.gpipe.rng import draw_step_seed, task_seed
from lightning_balanced.gpipe.schedule import clock_cycles
from lightning_balanced.gpipe.streams import CopyStreams, copy_to_device
from lightning_balanced.gpipe.worker import PartitionWorkers
from lightning_balanced.pipeline.balance import validate_balance
from lightning_balanced.pipeline.batchnorm import DeferredBatchNorm
from lightning_balanced.pipeline.microbatch import flatten, join, plan_micro_batches, split

__all__ = [
    "CHECKPOINT_MODES",
    "Balancer",
    "Pipe",
    "validate_checkpoint",
    "validate_chunks",
]

CheckpointMode = Literal["always", "except_last", "never"]
CHECKPOINT_MODES: tuple[str, ...] = ("always", "except_last", "never")
Balancer = Callable[["Pipe", Any], Sequence[int]]
"""Chooses the balance on the first forward pass: ``balancer(pipe, first_micro_batch) -> balance``."""


def validate_chunks(chunks: object) -> int:
    """``chunks`` (the number of micro-batches) as an int >= 1, or ``TypeError``/``ValueError`` naming it."""
    return check_int("chunks", chunks, minimum=1)


def validate_checkpoint(checkpoint: object) -> CheckpointMode:
    """``checkpoint`` as one of :data:`CHECKPOINT_MODES`, or ``ValueError`` naming it."""
    if checkpoint not in CHECKPOINT_MODES:
        raise ValueError(f"`checkpoint` must be one of {list(CHECKPOINT_MODES)}, got {checkpoint!r}")
    return checkpoint  # type: ignore[return-value]


class Pipe(nn.Sequential):
    """An ``nn.Sequential`` that runs its forward pass as a GPipe pipeline: micro-batches through partitions.

    The layers are those of ``module``, under the same names, so the ``state_dict`` is that of ``module`` whatever the
    balance. Each forward pass splits its input along dim 0 into micro-batches (:func:`plan_micro_batches`), runs
    micro-batch ``i`` on partition ``j`` at clock cycle ``i + j`` (:func:`clock_cycles`), each partition on its own
    worker thread and device, and concatenates the outputs on ``devices[0]``. Fork/join edges make backward run each
    partition's micro-batches in reverse order; with checkpointing (training with grad enabled only) a partition keeps
    just its input and recomputes its activations in backward, with the same dropout masks.

    The result equals ``module``'s up to floating-point summation order, for layers that treat samples independently;
    BatchNorm in training normalizes each micro-batch on its own (GPipe's semantics), while
    :class:`DeferredBatchNorm` keeps full-mini-batch running statistics.

    Args:
        module (nn.Sequential): the layers; it is not modified (its children are shared).
        balance (Sequence[int] | Balancer): layers per partition, in order; or a function that chooses it on the first
            forward pass from ``(pipe, first micro-batch)``.
        devices (Sequence[torch.device]): one per partition (the first ``len(balance)`` are used); equal devices are
            allowed: CPU partitions run on threads, and partitions that share a GPU each compute on a stream of their
            own (a pipeline on one GPU, as torchgpipe allows).
        chunks (int): the number of micro-batches per forward pass.
        checkpoint (str): ``"always"``, ``"except_last"`` (all micro-batches but the last) or ``"never"``.
        module_name (str): how errors name the Sequential.
        on_balanced (Callable, optional): called with the pipe after the partitions were placed.

    Raises:
        ValueError/TypeError: see :func:`validate_balance`, :func:`validate_chunks`, :func:`validate_checkpoint`; a
            parameter shared by layers of different partitions.
    """

    _original: nn.Sequential

    def __init__(
        self,
        module: nn.Sequential,
        balance: Sequence[int] | Balancer,
        devices: Sequence[torch.device],
        chunks: int = 1,
        checkpoint: str = "except_last",
        *,
        module_name: str = "module",
        on_balanced: Callable[[Pipe], None] | None = None,
    ) -> None:
        super().__init__(OrderedDict(module._modules))
        self.train(module.training)
        self.devices = [torch.device(d) for d in devices]
        self.chunks = validate_chunks(chunks)
        self.checkpoint = validate_checkpoint(checkpoint)
        self.module_name = module_name
        self.__dict__["_original"] = module  # not a child: the layers are registered once, under their names
        self._balancer: Balancer | None = None
        self._on_balanced = on_balanced
        self.balance: list[int] | None = None
        self.partitions: list[Partition] = []
        self._workers: PartitionWorkers | None = None
        self._copy_streams = CopyStreams()
        if callable(balance):
            self._balancer = balance
        else:
            self._set_balance(balance)

    # ---- partitions ------------------------------------------------------------------------------------------------
    def _set_balance(self, balance: Sequence[int]) -> None:
        balance = validate_balance(balance, len(self), len(self.devices))
        layers = list(self._modules.items())
        partitions, start = [], 0
        for j, size in enumerate(balance):
            indexed = [(start + k, module) for k, (_, module) in enumerate(layers[start : start + size])]
            assert all(m is not None for _, m in indexed)
            partitions.append(Partition(indexed, self.devices[j], self.module_name))
            start += size
        _check_no_shared_parameters(partitions, self.module_name, balance)
        self.balance, self.partitions = balance, partitions

    def place(self) -> None:
        """Move each partition's layers to its device (a no-op before the balance is chosen)."""
        for partition in self.partitions:
            for _, layer in partition.layers:
                layer.to(partition.device)

    def close(self) -> None:
        """Stop the worker threads (they are started again on the next forward pass)."""
        if self._workers is not None:
            self._workers.close()
            self._workers = None

    def unwrap(self) -> nn.Sequential:
        """The original ``nn.Sequential``, holding this pipe's layers (DeferredBatchNorm reverted to BatchNorm)."""
        self.close()
        for name, layer in list(self._modules.items()):
            assert layer is not None
            self._original._modules[name] = DeferredBatchNorm.revert_deferred_batch_norm(layer)
        self._original.train(self.training)
        return self._original

    def __getitem__(self, idx: Any) -> Any:
        if isinstance(idx, slice):
            return nn.Sequential(OrderedDict(list(self._modules.items())[idx]))
        return super().__getitem__(idx)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_workers"] = None
        state["_copy_streams"] = CopyStreams()
        return state

    # ---- the pipeline ----------------------------------------------------------------------------------------------
    def forward(self, input: Any) -> Any:
        """Run ``input`` (a tensor or any batch structure, split along dim 0) through the pipeline.

        Returns:
            the output of the last layer for the whole mini-batch, on ``devices[0]``, concatenated along dim 0.
        """
        batch_size = infer_batch_size(input)
        batchnorm_training = any(isinstance(m, _BatchNorm) and m.training for m in self.modules())
        sizes = plan_micro_batches(batch_size, self.chunks, batchnorm_training=batchnorm_training)
        batches = split(input, sizes, self.devices[0])
        if self.balance is None:
            assert self._balancer is not None
            self._set_balance(self._balancer(self, batches[0]))
            self.place()
            if self._on_balanced is not None:
                self._on_balanced(self)
        if self._workers is None:
            self._workers = PartitionWorkers([p.device for p in self.partitions])
        deferred = [layer for layer in self.modules() if isinstance(layer, DeferredBatchNorm)]
        for layer in deferred:
            layer.reset_accumulator()

        m, n = len(sizes), len(self.partitions)
        grad = torch.is_grad_enabled() and self.training
        checkpoint_stop = {"always": m, "except_last": m - 1, "never": 0}[self.checkpoint] if grad else 0
        modes = ThreadModes.capture(self.devices[0].type)
        stochastic = [p.draws_random_numbers() for p in self.partitions]
        step_seed = draw_step_seed() if any(stochastic) else None
        # The stream that made each micro-batch (CUDA): this thread's for the input, then its last partition's.
        first = torch.cuda.current_stream(self.devices[0]) if self.devices[0].type == "cuda" else None
        producers: list[torch.cuda.Stream | None] = [first] * m

        for schedule in clock_cycles(m, n):
            for i, _ in schedule:
                if i > 0:
                    batches[i - 1], batches[i] = _depend(batches[i - 1], batches[i])
            tasks = []
            for i, j in schedule:
                seed = task_seed(step_seed, i, j) if step_seed is not None and stochastic[j] else None
                checkpoint = i < checkpoint_stop
                task = _Task(self.partitions[j], batches[i], modes, seed, checkpoint, self._copy_streams, producers[i])
                tasks.append((i, j, task))
            for (i, j), output in zip(schedule, self._workers.run_cycle(tasks), strict=True):
                batches[i], producers[i] = output, self._workers.streams[j]

        # What follows on this thread (DeferredBatchNorm's commit, the join, the loss) runs on the current streams.
        for partition_stream, partition in zip(self._workers.streams, self.partitions, strict=True):
            if partition_stream is not None:
                torch.cuda.current_stream(partition.device).wait_stream(partition_stream)
        for batch, producer in zip(batches, producers, strict=True):
            if producer is not None:
                record_on(batch, torch.cuda.current_stream(producer.device))
        for layer in deferred:
            layer.commit()
        # On virtual CPU devices the output is the root's, a plain tensor, as everything else on the main thread.
        output_device = self.devices[0] if self.devices[0].type != "cpu" else torch.device("cpu")
        return join(batches, sizes, output_device)


class _Task:
    """Micro-batch ``i`` on partition ``j``: copy in, run (checkpointed or not), on the partition's thread."""

    def __init__(
        self,
        partition: Partition,
        value: Any,
        modes: ThreadModes,
        seed: int | None,
        checkpoint: bool,
        copy_streams: CopyStreams,
        source: torch.cuda.Stream | None,
    ) -> None:
        self.partition, self.value, self.modes = partition, value, modes
        self.seed, self.checkpoint, self.copy_streams, self.source = seed, checkpoint, copy_streams, source

    def __call__(self) -> Any:
        device = self.partition.device
        with ExitStack() as contexts:
            if device.type == "cpu" and device.index is not None:  # a virtual device: CUDA's rule for every tensor
                contexts.enter_context(VirtualDeviceMode(device.index, self.partition.tensor_ids()))
            return self._run(device)

    def _run(self, device: torch.device) -> Any:
        with self.modes.enter():
            value = copy_to_device(self.value, device, self.copy_streams, self.source)
            checkpointing = Checkpointing(self.partition, self.modes, self.seed)
            if not self.checkpoint:
                return checkpointing.run(value)
            output = checkpointing.checkpoint(value)
            return checkpointing.recompute(value, output)


def _lane(tensors: list[Tensor]) -> int:
    return next((k for k, t in enumerate(tensors) if t.requires_grad), 0)


def _depend(fork_from: Any, join_to: Any) -> tuple[Any, Any]:
    a, rebuild_a = flatten(fork_from)
    b, rebuild_b = flatten(join_to)
    ka, kb = _lane(a), _lane(b)
    a[ka], b[kb] = depend(a[ka], b[kb])
    return rebuild_a(a), rebuild_b(b)


def _check_no_shared_parameters(partitions: Sequence[Partition], module_name: str, balance: Sequence[int]) -> None:
    owner: dict[int, tuple[int, int]] = {}
    for j, partition in enumerate(partitions):
        for index, layer in partition.layers:
            for tensor in [*layer.parameters(), *layer.buffers()]:
                first = owner.setdefault(id(tensor), (j, index))
                if first[0] != j:
                    raise ValueError(
                        f"`{module_name}[{first[1]}]` and `{module_name}[{index}]` share a parameter but `balance`"
                        f" {list(balance)} puts them in partitions {first[0]} and {j}; a parameter lives on one"
                        " device, so change `balance` to keep them in one partition"
                    )
