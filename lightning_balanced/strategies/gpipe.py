"""Single-process pipeline parallelism, GPipe-style: an ``nn.Sequential`` of the LightningModule cut over devices."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, Literal

import lightning.pytorch as pl
from lightning.pytorch.strategies import ParallelStrategy
from torch import Tensor
from typing_extensions import override

from lightning_balanced.arguments import check_bool, check_module_name
from lightning_balanced.data_parallel import virtual_devices
from lightning_balanced.gpipe import Pipe
from lightning_balanced.gpipe.pipe import validate_checkpoint, validate_chunks
from lightning_balanced.pipeline import DeferredBatchNorm
from lightning_balanced.pipeline.balance import (
    BalanceChoice,
    balance_argument,
    choose_balance,
    even_balance,
    validate_balance,
)
from lightning_balanced.pipeline.sequential import find_sequential
from lightning_balanced.ranks.reports import counted, rank_zero_report
from lightning_balanced.strategies.placement import host_init_context, to_device_but
from lightning_balanced.strategies.single_process import SingleProcess

__all__ = ["GPipeStrategy"]

log = logging.getLogger(__name__)


class GPipeStrategy(SingleProcess, ParallelStrategy):
    """Pipeline parallelism in one process: a LightningModule's ``nn.Sequential`` cut over devices, GPipe-style.

    The ``nn.Sequential`` is cut into one partition per device and each batch flows through them as micro-batches, on
    GPipe's schedule.

    At setup the ``nn.Sequential`` found at ``module_name`` on the LightningModule is wrapped, in place, in a
    :class:`~lightning_balanced.gpipe.Pipe` with the same layers under the same names; partition ``j`` (the next
    ``balance[j]`` layers) lives on ``devices[j]``, and everything else of the LightningModule (loss, metrics, heads
    outside the Sequential) on ``devices[0]``, the root device. ``training_step`` and the other steps run unchanged on
    the main thread: when they call the Sequential, the batch is split into ``chunks`` micro-batches that run through
    the partitions on one worker thread per partition (micro-batch ``i`` on partition ``j`` at clock cycle ``i + j``),
    and the output comes back whole, concatenated on the root device, so the loss is computed on the re-joined
    mini-batch and Lightning's loop (automatic or manual optimization, gradient accumulation and clipping, ``16-mixed``
    and ``bf16-mixed``, whose autocast each partition's thread re-enters) is unchanged. Teardown puts the plain
    ``nn.Sequential`` back. Checkpoints hold its plain layout (``<module_name>.<layer>.<param>``), so they load under
    any balance and into an unpipelined model.

    With ``accelerator="cpu", devices=N`` the partitions run on N CPU threads through the same schedule, the way
    ``balanced_dp`` emulates its devices.

    Args:
        balance: layers per partition, one partition per device (at most as many partitions as devices; extra
            devices stay unused); ``None``: layers spread as evenly as possible by count over all devices; ``"auto"``:
            measured on the first forward pass, by memory on CUDA and by forward+backward time elsewhere, falling back
            to parameter counts if the measurement fails; ``"time"``, ``"memory"`` (CUDA only) or ``"parameters"``
            (deterministic) to choose. The balance is logged once, one line per partition.
        chunks: micro-batches per batch (GPipe's ``m``); ``None``: 4 per partition, which keeps GPipe's idle share
            ``(n - 1) / (m + n - 1)`` of ``n`` partitions under 20%. A batch that ``chunks`` does not divide is split
            as evenly as possible; with a BatchNorm layer training, fewer micro-batches are used rather than one of a
            single sample, unless ``chunks`` is at least the batch size.
        checkpoint: which micro-batches are recomputed in backward instead of keeping their activations:
            ``"always"``, ``"except_last"`` (GPipe's default: the last one's backward comes right after its forward),
            or ``"never"``. Only in training with grad enabled.
        deferred_batch_norm: replace ``nn.BatchNorm1d/2d/3d`` in the Sequential by
            :class:`~lightning_balanced.pipeline.DeferredBatchNorm` while the strategy runs, so running statistics
            are those of the whole mini-batch (each micro-batch is still normalized with its own statistics).
        module_name: the attribute of the LightningModule that holds the ``nn.Sequential`` (Lightning 1.x's
            ``DDPSequentialPlugin`` used ``sequential_module``).
        parallel_devices: one device per partition, normally filled in by the ``Trainer`` from ``accelerator=`` and
            ``devices=``. A device may repeat: ``[torch.device("cuda", 0)] * 2`` with
            ``Trainer(accelerator="cuda", devices=1)`` runs two partitions on one GPU, each computing on a CUDA
            stream of its own (as torchgpipe allows), with a micro-batch handed from one partition's stream to the
            next by a GPU-side wait; ``[torch.device("cuda", 0), torch.device("cpu")]`` keeps the last partition in
            host memory. Strings (``"cuda:0"``) are accepted; ``"cuda"`` is the current GPU.
        accelerator, checkpoint_io, precision_plugin: as for Lightning's ``ParallelStrategy``.

    Raises:
        TypeError: ``balance`` not a list of ints or a method name, ``chunks`` not an int, ``module_name`` not a string,
            ``deferred_batch_norm`` not a bool, ``parallel_devices`` not a list of devices; at setup, the attribute is
            not an ``nn.Sequential``; in a step, a layer that returns a non-tensor where the next one expects a tensor.
        ValueError: ``chunks`` < 1, an unknown ``checkpoint`` or balance method, a ``balance`` entry < 1, an empty
            ``parallel_devices``; at setup, a missing attribute, ``sum(balance)`` other than the number of layers, more
            partitions than devices, fewer layers than devices (``balance=None``), a parameter shared by two
            partitions, ``sync_batchnorm=True``.

    Source: GPipe (Huang et al., NeurIPS 2019) and torchgpipe (Lee et al., 2020): micro-batches, the clock-cycle
    schedule, fork/join dependencies, copy streams, checkpoint/recompute, ``DeferredBatchNorm``, balancing by time and
    size; Lightning 1.x's ``DDPSequentialPlugin`` for ``module_name`` and ``balance``.
    """

    strategy_name = "gpipe"
    one_device_type = False  # a partition may stay in host memory

    def __init__(
        self,
        balance: Sequence[int] | Literal["auto", "time", "memory", "parameters"] | None = None,
        chunks: int | None = None,
        checkpoint: Literal["always", "except_last", "never"] = "except_last",
        deferred_batch_norm: bool = True,
        module_name: str = "sequential_module",
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)  # the plugins: SingleProcess's arguments
        self.balance: list[int] | str | None = balance_argument(balance)
        self.chunks: int | None = None if chunks is None else validate_chunks(chunks)
        self.checkpoint = validate_checkpoint(checkpoint)
        self.deferred_batch_norm = check_bool("deferred_batch_norm", deferred_batch_norm)
        self.module_name = check_module_name(module_name)
        self._pipe: Pipe | None = None
        self._balance_method = "given"
        self._reported_balance: list[int] | None = None

    # ---- placement -------------------------------------------------------------------------------------------------
    @override
    def model_to_device(self) -> None:
        """Each partition's layers straight onto its device, the rest of the module onto the root device.

        The pipelined Sequential never passes through the root device as a whole (the model gpipe exists for does not
        fit there): its slot in the module is emptied while the rest moves, and filled again in place, so the order of
        the parameters (which the optimizer's state_dict refers to by position) and of the state_dict keys is that of
        the unpipelined module. Before the balance is chosen (``balance="auto"``, measured on the first batch), its
        layers stay where they were made; the measurement moves one layer at a time.
        """
        assert self.model is not None
        pipe = self._pipe
        module = self.lightning_module
        if pipe is None or module is None or module._modules.get(self.module_name) is not pipe:
            self.model.to(self.root_device)
            return
        to_device_but(self.model, module, self.module_name, pipe, self.root_device)
        pipe.place()
        self._optimizer_states_to_parameter_devices()

    @contextmanager
    @override
    def tensor_init_context(self, empty_init: bool | None = None) -> Iterator[None]:
        """Tensors made under ``trainer.init_module()`` go to host memory, not to device 0, which may not hold them all.

        :meth:`model_to_device` then moves each partition's layers to its device and the rest to the root device.
        The precision's dtype and ``empty_init`` apply as with any strategy.
        """
        with host_init_context(self.precision_plugin, empty_init):
            yield

    @override
    def load_optimizer_state_dict(self, checkpoint: Mapping[str, Any]) -> None:
        """Each optimizer's state onto its own parameter's device, as ``Optimizer.load_state_dict`` places it.

        Lightning's default would then move every state tensor to the root device, all partitions' state at once.
        """
        for optimizer, state in zip(self.optimizers, checkpoint["optimizer_states"], strict=False):
            optimizer.load_state_dict(state)
        self._optimizer_states_to_parameter_devices()

    def _optimizer_states_to_parameter_devices(self) -> None:
        """Each optimizer state tensor onto its parameter's device, as ``Optimizer.load_state_dict`` places it.

        ``step`` stays where it is (on the host) unless the parameter's group is ``capturable`` or ``fused``, whose
        kernels read it on the parameter's device.
        """
        for optimizer in self.optimizers:
            on_device = {
                id(p): bool(group.get("capturable") or group.get("fused"))
                for group in optimizer.param_groups
                for p in group["params"]
            }
            for param, state in optimizer.state.items():
                if not isinstance(param, Tensor) or not isinstance(state, dict):
                    continue
                for key, value in state.items():
                    if key == "step" and not on_device.get(id(param), False):
                        continue
                    if isinstance(value, Tensor) and value.device != param.device:
                        state[key] = value.to(param.device)

    # ---- setup and teardown ----------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        assert self.parallel_devices, "parallel_devices are set by the Trainer"
        if self._layer_sync is not None:
            raise ValueError(
                "`Trainer(sync_batchnorm=True)` is not supported with strategy='gpipe': there is one process and one"
                " copy of each layer. Keep `deferred_batch_norm=True` for running statistics over the whole batch."
            )
        module = self.lightning_module
        assert module is not None
        sequential = find_sequential(module, self.module_name, "gpipe")
        devices = virtual_devices(self.parallel_devices)  # on CPU, partition j on virtual device cpu:j
        if isinstance(self.balance, list):
            balance: Any = validate_balance(self.balance, len(sequential), len(devices))
        elif self.balance is None:
            balance = even_balance(len(sequential), len(devices))
        elif self.balance == "memory" and devices[0].type != "cuda":
            raise ValueError(f"`balance`='memory' measures CUDA memory, but the devices are {devices}")
        else:
            balance = self._measure_balance
        if self.deferred_batch_norm:
            DeferredBatchNorm.convert_deferred_batch_norm(sequential)
        self._pipe = Pipe(
            sequential,
            balance,
            devices,
            self.chunks
            if self.chunks is not None
            else 4 * (len(balance) if isinstance(balance, list) else len(devices)),
            self.checkpoint,
            module_name=self.module_name,
            on_balanced=self._on_balanced,
        )
        setattr(module, self.module_name, self._pipe)
        try:
            super().setup(trainer)
        except BaseException:
            self._unwrap()
            raise
        if self._pipe.balance is not None:
            self._report()

    def _measure_balance(self, pipe: Pipe, sample: Any) -> list[int]:
        """Choose the balance on the first micro-batch (``balance`` "auto", "time", "memory" or "parameters")."""
        layers = [m for m in pipe._modules.values() if m is not None]
        partitions = min(len(pipe.devices), len(layers))
        choice: BalanceChoice = self.balance  # type: ignore[assignment]
        balance, self._balance_method = choose_balance(layers, sample, partitions, pipe.devices[0], choice)
        return balance

    def _on_balanced(self, pipe: Pipe) -> None:
        self._optimizer_states_to_parameter_devices()
        self._report()

    def _report(self) -> None:
        pipe = self._pipe
        assert pipe is not None and pipe.balance is not None
        if pipe.balance == self._reported_balance:
            return  # once, not again for each validate/test/predict unless the balance changed
        self._reported_balance = list(pipe.balance)
        method = "given" if isinstance(self.balance, list) else self._balance_method
        if self.balance is None:
            method = "even by layer count"
        lines = [
            f"gpipe: balance {pipe.balance} ({method}) over {counted(len(pipe.balance), 'partition')},"
            f" chunks={pipe.chunks}, checkpoint={self.checkpoint!r}"
        ]
        for j, partition in enumerate(pipe.partitions):
            first, last = partition.layers[0][0], partition.layers[-1][0]
            names = ", ".join(type(layer).__name__ for _, layer in partition.layers)
            params = sum(p.numel() for _, layer in partition.layers for p in layer.parameters())
            lines.append(
                f"  partition {j} ({partition.device}): layers {first}-{last} ({names}), {params:,} parameters"
            )
        rank_zero_report("\n".join(lines))

    def _unwrap(self) -> None:
        if self._pipe is None:
            return
        pipe, self._pipe = self._pipe, None
        module = self.lightning_module
        if module is not None and getattr(module, self.module_name, None) is pipe:
            setattr(module, self.module_name, pipe.unwrap())
        else:
            pipe.unwrap()

    @override
    def teardown(self) -> None:
        self._unwrap()
        super().teardown()
