"""FSDP2 over one global batch, split unevenly over the ranks, each step equal to one process's step on that batch."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any, Literal

import lightning.pytorch as pl
import torch
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.fabric.utilities.init import _materialize_distributed_module
from lightning.fabric.utilities.optimizer import _optimizers_to_device
from lightning.pytorch.strategies import ModelParallelStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor, nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.optim import Optimizer
from torch.torch_version import TorchVersion
from typing_extensions import override

from lightning_balanced.arguments import check_int
from lightning_balanced.batch_scaling.factor_check import LRScaleFactorCheckOnLoad
from lightning_balanced.pipelining.saved_bytes import SavedTensorBytes
from lightning_balanced.rank_shares.engine import GlobalBatchShares, ShareEngine, gathered_gpu_capacities
from lightning_balanced.split_policies.split_policy import SplitOptions
from lightning_balanced.strategies.peer_failure import PeerFailureReporting
from lightning_balanced.strategies.registration import RegisteredStrategy

__all__ = ["BalancedFSDPStrategy"]

#: The oldest torch whose FSDP2 is public (``torch.distributed.fsdp.fully_shard``).
FSDP2_TORCH = "2.6"
#: The oldest torch whose FSDP2 runs on CPU ranks over gloo, as this package has checked (2.6 fails there in
#: ``Stream.record_event``; 2.13 and 2.14 train exactly).
FSDP2_CPU_TORCH = "2.13"


# The precision plugin's context of each step method, as Lightning's Strategy enters it.
_STEP_CONTEXTS = {
    "training_step": "train_step_context",
    "validation_step": "val_step_context",
    "test_step": "test_step_context",
    "predict_step": "predict_step_context",
}


def _fsdp2() -> Any:
    """``torch.distributed.fsdp`` (FSDP2's ``fully_shard`` and ``FSDPModule``)."""
    import torch.distributed.fsdp as fsdp

    return fsdp


def _tensor_bytes(tensors: Iterator[Tensor]) -> int:
    total = 0
    for tensor in tensors:
        local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        total += local.numel() * local.element_size()
    return total


class BalancedFSDPStrategy(
    PeerFailureReporting,
    LRScaleFactorCheckOnLoad,
    RegisteredStrategy,
    SplitOptions,
    GlobalBatchShares,
    ModelParallelStrategy,
):
    """FSDP2 over one global batch split unevenly over the ranks: each step is one process's step on the whole batch.

    Lightning's ``ModelParallelStrategy`` (FSDP2 over a device mesh, sharded ``torch.distributed.checkpoint``
    checkpoints, every launcher) with ``balanced_ddp``'s share engine: **the DataLoader's ``batch_size`` is the global
    batch ``B``**; every rank walks the same global order (the loader's own: ``shuffle=False`` in dataset order,
    ``shuffle=True`` Lightning's one-replica permutation, seeded, reshuffled each epoch, a sampler of your own as it
    is) and takes its share of each global batch, planned by a split policy over the ranks (as ``balanced_ddp``). Each
    rank's loss is weighted by ``world_size * share / B``; FSDP2's reduce-scatter averages the ranks' gradients over
    the data-parallel group, so the sharded gradient is the global batch's mean loss's. Gradient clipping by norm sees
    the whole, sharded gradient (Lightning clips DTensor gradients by their global norm).

    The model is sharded as under ``ModelParallelStrategy``: the LightningModule's ``configure_model`` applies
    ``fully_shard`` over ``self.device_mesh["data_parallel"]``; or, for a module without it, ``shard_modules=(Block,)``
    applies ``fully_shard`` to every submodule of those classes and then to the root.

    Because the step is a function of the global batch only, a sharded checkpoint saved on ``W1`` ranks resumes on
    ``W2`` (other shares, the optimizer state resharded by ``torch.distributed.checkpoint``) at an epoch boundary with
    exactly the uninterrupted run's steps.

    Args:
        gpu0_bsz, chunk_sizes, weights, split: the split policy over the ranks, as ``BalancedDDPStrategy``'s
            (``chunk_sizes="auto"``: measured speeds, and memory: see ``capacities``). FSDP2's per-block collectives
            make a faster rank wait for the slowest inside its step, so the measured speeds come out nearly equal:
            for ranks of different speeds give ``weights`` or ``chunk_sizes``; ``"auto"`` still caps by memory.
        loss_reduction: how ``training_step``'s loss reduces over samples: ``"mean"`` (weighted by share) or ``"sum"``.
        max_micro_batch: the most samples a rank runs in one forward pass (an int, one per rank, or ``"auto"``: on
            CUDA each rank's cap measured from its peak memory as under ``balanced_ddp``, exchanged in the step's
            all_reduce and used from the next step on); every rank runs as many micro-batches as the rank that needs
            most (each forward pass all-gathers the parameters), its own share split evenly over them; all but the
            last run with FSDP2's gradient synchronization off (``set_requires_gradient_sync(False)``), each weighted
            by its samples, so the step is the same.
        capacities: each rank's memory in bytes, for ``chunk_sizes="auto"`` on devices without CUDA's allocator
            statistics; the plan then gives no rank more samples than its fixed bytes (its shard of the parameters,
            gradients and optimizer state, and the largest sharded block unsharded) plus the bytes its step saved for
            backward per sample fit in ``AutoSplit``'s ``memory_fraction`` of it. On CUDA each GPU's total memory
            and ``torch.cuda.max_memory_allocated`` are used.
        shard_modules: module classes to ``fully_shard`` (each submodule of those classes, then the root) when the
            LightningModule's ``configure_model`` does not shard the model itself.
        log_shares: log ``balanced_fsdp/share_rank{r}``, ``step_s_rank{r}`` and ``idle_s_rank{r}``.
        data_parallel_size: ``"auto"`` (the world size) or the world size.
        tensor_parallel_size: 1 (tensor parallelism with uneven shares is refused: each tensor-parallel group would
            have to take one share, which this strategy does not plan).
        save_distributed_checkpoint, process_group_backend, timeout: as ``ModelParallelStrategy``'s.

    Raises:
        ImportError: torch older than 2.6 (no public FSDP2), at construction.
        TypeError, ValueError: a bad split option, ``loss_reduction``, ``max_micro_batch``, ``capacities`` (wrong
            length at setup, non-positive), ``shard_modules`` (not module classes), ``data_parallel_size`` other than
            the world size or ``tensor_parallel_size`` other than 1; at setup, a model with no ``fully_shard``
            applied and no ``shard_modules``, BatchNorm layers (FSDP2 has no synchronized BatchNorm over uneven
            shares here), CPU ranks on a torch older than 2.13.
        RuntimeError: in a step, when the ranks' plans or global orders disagree.

    Source: Lightning's ``ModelParallelStrategy`` and torch's FSDP2 (``fully_shard``); uneven batches per worker as
    in Cephalo (ICS 2025) and LB-BSP (SoCC 2020), here with the gradient weighted by share so that the step is exact.
    """

    strategy_name = "balanced_fsdp"

    @classmethod
    @override
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``balanced_fsdp``.

        Args:
            strategy_registry (_StrategyRegistry): the registry to fill.
        """
        strategy_registry.register(
            cls.strategy_name, cls, description="FSDP2 over one global batch split unevenly over the ranks"
        )

    def __init__(
        self,
        *args: Any,
        max_micro_batch: int | Sequence[int] | Literal["auto"] | None = None,
        capacities: Sequence[int] | None = None,
        shard_modules: Sequence[type[nn.Module]] = (),
        log_shares: bool = True,
        data_parallel_size: Literal["auto"] | int = "auto",
        tensor_parallel_size: int = 1,
        save_distributed_checkpoint: bool = True,
        process_group_backend: str | None = None,
        timeout: timedelta | None = timedelta(minutes=30),
        **kwargs: Any,
    ) -> None:
        if TorchVersion(torch.__version__) < FSDP2_TORCH:
            raise ImportError(
                f"strategy='balanced_fsdp' needs torch >= {FSDP2_TORCH} (FSDP2's public"
                f" `torch.distributed.fsdp.fully_shard`), found {torch.__version__}: upgrade torch, or use"
                " strategy='balanced_ddp' for a model that fits on every device"
            )
        if tensor_parallel_size != 1:
            raise ValueError(
                "strategy='balanced_fsdp' plans one share per rank of the data-parallel group: `tensor_parallel_size`"
                f" must be 1, got {tensor_parallel_size!r} (a tensor-parallel group would have to take one share)"
            )
        if data_parallel_size != "auto":
            check_int("data_parallel_size", data_parallel_size, minimum=1)
        self.capacities = (
            None
            if capacities is None
            else [check_int(f"capacities[{i}]", c, minimum=1) for i, c in enumerate(capacities)]
        )
        for i, cls in enumerate(shard_modules):
            if not (isinstance(cls, type) and issubclass(cls, nn.Module)):
                raise TypeError(f"`shard_modules[{i}]` must be an nn.Module subclass, got {cls!r}")
        self.shard_modules = tuple(shard_modules)
        super().__init__(  # the split options (SplitOptions: positionally, `gpu0_bsz` first), then ModelParallel's
            *args,
            data_parallel_size=data_parallel_size,
            tensor_parallel_size=1,
            save_distributed_checkpoint=save_distributed_checkpoint,
            process_group_backend=process_group_backend,
            timeout=timeout,
            **kwargs,
        )
        self.shares = ShareEngine("balanced_fsdp", self.split, self.loss_reduction, max_micro_batch, log_shares)
        self.shares.bind(self)
        self.shares.overlap = False  # FSDP2's reduce-scatters share the process group with the step's exchange
        self.shares.equal_micro_batches = True  # each forward pass all-gathers the parameters on every rank

    @property
    def data_parallel_size(self) -> int:
        """1: the DataLoader's batch is already the global one (what ``ScaleInvariance`` and LR scaling read)."""
        return 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """One replica: every rank walks the same global order (the share engine keeps the loader's own)."""
        return {"num_replicas": 1, "rank": 0}

    # ---- setup -----------------------------------------------------------------------------------------------------
    @override
    def setup_environment(self) -> None:
        world_size = self.num_nodes * self.num_processes
        if self._data_parallel_size == "auto":
            self._data_parallel_size = world_size
        if self._data_parallel_size != world_size:
            raise ValueError(
                f"strategy='balanced_fsdp' shards over every rank: `data_parallel_size` must be the world size"
                f" ({world_size}) or 'auto', got {self._data_parallel_size}"
            )
        super().setup_environment()

    @override
    def setup(self, trainer: pl.Trainer) -> None:
        """As ``ModelParallelStrategy.setup``, with ``shard_modules`` applied and the share engine attached."""
        assert self.model is not None and self.accelerator is not None
        self._check_setup(trainer)
        self.shares.take_over_sampling(trainer)  # before `configure_optimizers` may read `estimated_stepping_batches`
        fsdp = _fsdp2()
        if self.shard_modules and not any(isinstance(m, fsdp.FSDPModule) for m in self.model.modules()):
            mesh = self.device_mesh["data_parallel"]
            for submodule in [m for m in self.model.modules() if isinstance(m, self.shard_modules)]:
                fsdp.fully_shard(submodule, mesh=mesh)
            fsdp.fully_shard(self.model, mesh=mesh)
        if not any(isinstance(m, fsdp.FSDPModule) for m in self.model.modules()):
            raise ValueError(
                f"strategy='balanced_fsdp' found no module sharded with FSDP2 in {type(self.model).__name__}: apply"
                " `fully_shard(..., mesh=self.device_mesh['data_parallel'])` in the LightningModule's"
                " `configure_model`, or pass `BalancedFSDPStrategy(shard_modules=(YourBlock,))`"
            )
        # ModelParallelStrategy.setup, whose `configure_model` check shard_modules replaces.
        self.accelerator.setup(trainer)
        _materialize_distributed_module(self.model, self.root_device)
        self.model = self.precision_plugin.convert_module(self.model)
        self.model_to_device()
        self.barrier()
        if trainer.state.fn == TrainerFn.FITTING:
            self.setup_optimizers(trainer)
        self.setup_precision_plugin()
        if trainer.state.fn == TrainerFn.FITTING:
            _optimizers_to_device(self.optimizers, self.root_device)
        self.shares.host_peak = None if self.root_device.type == "cuda" else self._host_peak
        self.shares.attach(
            no_sync=self._no_sync,
            backward=lambda loss: super(BalancedFSDPStrategy, self).backward(loss, None),
            capacities=self._capacities() if self.shares.observes else None,
        )

    def _check_setup(self, trainer: pl.Trainer) -> None:
        """The named errors of a bad setup, on every rank alike, before any collective."""
        assert self.model is not None
        if self.root_device.type == "cpu" and TorchVersion(torch.__version__) < FSDP2_CPU_TORCH:
            raise ValueError(
                f"strategy='balanced_fsdp' on CPU ranks needs torch >= {FSDP2_CPU_TORCH}"
                f" (FSDP2 over gloo), found {torch.__version__}"
            )
        if self.capacities is not None and len(self.capacities) != self.world_size:
            raise ValueError(
                f"`capacities` needs one entry per rank ({self.world_size}), got {len(self.capacities)}:"
                f" {self.capacities}"
            )
        self.shares.check_world_size(self.world_size)
        layers = [name for name, m in self.model.named_modules() if isinstance(m, _BatchNorm)]
        if layers and trainer.state.fn == TrainerFn.FITTING:
            raise ValueError(
                f"strategy='balanced_fsdp' cannot give the step of one process on the global batch with BatchNorm"
                f" layers ({', '.join(layers[:3])}{', ...' if len(layers) > 3 else ''}): each rank would normalize"
                " its own share; use strategy='balanced_ddp' (synchronized BatchNorm over uneven shares), or a"
                " normalization over features (LayerNorm, GroupNorm)"
            )
        self.shares.refuse_micro_batches(self.lightning_module, batchnorm=False)  # type: ignore[arg-type]

    def _capacities(self) -> list[int | None]:
        """Each rank's memory in bytes: ``capacities``, else on CUDA each GPU's (one all_reduce)."""
        return list(self.capacities) if self.capacities is not None else gathered_gpu_capacities(self)

    def _fixed_bytes(self) -> int:
        """This rank's memory that does not grow with its share, in bytes.

        Its shards of the parameters, gradients and optimizer state, and the largest sharded block's parameters
        unsharded (while it runs).
        """
        assert self.model is not None
        fsdp = _fsdp2()
        params = list(self.model.parameters())
        grads = (p.grad for p in params if p.grad is not None)
        states = (v for o in self.optimizers for s in o.state.values() for v in s.values() if isinstance(v, Tensor))
        largest = max(
            (
                sum(p.numel() * p.element_size() for p in m.parameters())
                for m in self.model.modules()
                if isinstance(m, fsdp.FSDPModule)
            ),
            default=0,
        )
        return _tensor_bytes(iter(params)) + _tensor_bytes(grads) + _tensor_bytes(states) + largest

    def _host_peak(self, run: Callable[[], Any]) -> tuple[Any, int]:
        """``run()`` and this rank's peak bytes in it: the fixed bytes plus the bytes its forward saved for backward."""
        meter = SavedTensorBytes()  # parameters (sharded DTensors, and unsharded while they run) are left out
        with meter:
            output = run()
        return output, self._fixed_bytes() + meter.peak

    @contextmanager
    def _no_sync(self) -> Iterator[None]:
        """FSDP2's gradient synchronization off: a backward pass accumulates unsharded gradients locally."""
        assert self.model is not None
        modules = [m for m in self.model.modules() if isinstance(m, _fsdp2().FSDPModule)]
        for module in modules:
            module.set_requires_gradient_sync(False, recurse=False)
        try:
            yield
        finally:
            for module in modules:
                module.set_requires_gradient_sync(True, recurse=False)

    def redirected_step(self, name: str, *args: Any, **kwargs: Any) -> Any:
        """The LightningModule's step method ``name`` inside a call of the root module, in its precision context.

        FSDP2 unshards the root's own parameters (those outside the sharded blocks) in the root module's forward
        hooks; a ``training_step`` that calls a submodule (``self.blocks(x)``) and not ``self(x)`` would meet them
        sharded. So the step runs as the root's forward (Lightning's forward redirection, which its ``FSDPStrategy``
        uses through its wrapper), and a ``self(x)`` inside it is a nested call FSDP2 lets through.
        """
        assert self.model is not None and self.lightning_module is not None
        with getattr(self.precision_plugin, _STEP_CONTEXTS[name])():
            return self._forward_redirection(self.model, self.lightning_module, name, *args, **kwargs)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """FSDP2's backward on the loss weighted by ``world_size * share / global batch``."""
        self.shares.add_micro_batch_grads()
        loss = super().backward(closure_loss * self.shares.loss_weight, optimizer, *args, **kwargs)
        return loss

    @override
    def teardown(self) -> None:
        self.shares.detach()
        super().teardown()
