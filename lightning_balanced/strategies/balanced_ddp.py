"""DDP over one global batch, split unevenly over the ranks, each step equal to one process's step on that batch."""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import lightning.pytorch as pl
from lightning.fabric.strategies.registry import _StrategyRegistry
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer.states import TrainerFn
from torch import Tensor
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.parallel import DistributedDataParallel
from torch.optim import Optimizer
from typing_extensions import override

from lightning_balanced.arguments import check_bool
from lightning_balanced.batch_scaling.factor_check import LRScaleFactorCheckOnLoad
from lightning_balanced.nn.layer_sync import DeviceSyncBatchNorm
from lightning_balanced.rank_shares.carried_exchange import CarriedExchange
from lightning_balanced.rank_shares.engine import GlobalBatchShares, ShareEngine, gathered_gpu_capacities
from lightning_balanced.split_policies.split_policy import SplitOptions
from lightning_balanced.strategies.peer_failure import PeerFailureReporting
from lightning_balanced.strategies.process_group import end_process_group
from lightning_balanced.strategies.registration import RegisteredStrategy, register_variants

if TYPE_CHECKING:
    _StrategyBase = DDPStrategy
else:
    _StrategyBase = object

# The registered names and the `start_method` each stands for, as in Lightning's DDP names.
_LAUNCHES = (("balanced_ddp", "popen"), ("balanced_ddp_spawn", "spawn"), ("balanced_ddp_fork", "fork"))


class BalancedDDP(
    PeerFailureReporting, LRScaleFactorCheckOnLoad, RegisteredStrategy, SplitOptions, GlobalBatchShares, _StrategyBase
):
    """The implementation of :class:`BalancedDDPStrategy`, free of a Lightning base class.

    Combined with ``lightning.pytorch``'s ``DDPStrategy`` it is :class:`BalancedDDPStrategy`; combined with the
    standalone ``pytorch_lightning`` package's, it is the class that package's registry holds.
    """

    strategy_name = "balanced_ddp"
    #: The Lightning package of the base class: where ``TorchSyncBatchNorm`` comes from.
    _lightning_package: ClassVar[str] = "lightning.pytorch"

    @classmethod
    def register_strategies(cls, strategy_registry: _StrategyRegistry) -> None:
        """Register ``balanced_ddp`` and the ``balanced_ddp_spawn``/``balanced_ddp_fork`` variants.

        Args:
            strategy_registry (_StrategyRegistry): the registry to fill.
        """
        described = "DDP over one global batch split unevenly over the ranks, `start_method`"
        variants = [(name, f"{described} '{method}'", {"start_method": method}) for name, method in _LAUNCHES]
        register_variants(cls, strategy_registry, variants)

    def __init__(
        self,
        *args: Any,
        sync_batchnorm: bool = True,
        max_micro_batch: int | Sequence[int] | Literal["auto"] | None = None,
        log_shares: bool = True,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)  # the split options (SplitOptions: `gpu0_bsz` first), then DDPStrategy's
        self.shares = ShareEngine("balanced_ddp", self.split, self.loss_reduction, max_micro_batch, log_shares)
        self.shares.bind(self)
        self.sync_batchnorm = check_bool("sync_batchnorm", sync_batchnorm)

    @property
    def data_parallel_size(self) -> int:
        """1: the DataLoader's batch is already the global one, whatever the world size.

        What :func:`~lightning_balanced.batch_scaling.lr_scaling.data_parallel_size` reads: ``ScaleInvariance`` and
        ``ddp_lr``-style scaling see the effective batch ``batch_size x accumulate_grad_batches``, the same on any
        number of ranks.
        """
        return 1

    @property
    @override
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        """One replica: Lightning's ``DistributedSampler`` then gives every rank the same global order.

        Shuffled for training and seeded as under DDP (``seed_everything``'s seed), reshuffled each epoch
        (``set_epoch``); the strategy cuts each global batch into the ranks' shares (:meth:`process_dataloader`).
        """
        return {"num_replicas": 1, "rank": 0}

    # ---- setup -----------------------------------------------------------------------------------------------------
    @override
    def setup(self, trainer: pl.Trainer) -> None:
        self.shares.take_over_sampling(trainer)  # before `configure_optimizers` may read `estimated_stepping_batches`
        # As ddp_lr: the accelerator connector sets `_layer_sync` after __init__, and torch's SyncBatchNorm refuses
        # CPU tensors: ours on CPU, torch's on CUDA, both over uneven per-rank counts.
        layer_sync = importlib.import_module(f"{self._lightning_package}.plugins.layer_sync")
        if self.sync_batchnorm and (
            self._layer_sync is None or isinstance(self._layer_sync, layer_sync.TorchSyncBatchNorm)
        ):
            self._layer_sync = DeviceSyncBatchNorm(lambda: self.root_device.type)
        assert self.model is not None
        if self._layer_sync is None and trainer.state.fn == TrainerFn.FITTING:  # evaluation uses running statistics
            layers = [name for name, m in self.model.named_modules() if isinstance(m, _BatchNorm)]
            if layers:
                raise ValueError(
                    f"strategy='balanced_ddp' with `sync_batchnorm=False` cannot give the step of one process on the"
                    f" global batch: BatchNorm layers ({', '.join(layers[:3])}{', ...' if len(layers) > 3 else ''})"
                    " would normalize each rank's share on its own; keep `sync_batchnorm=True` (the default)"
                )
        self.shares.check_world_size(self.world_size)
        self.shares.refuse_micro_batches(
            self.lightning_module,  # type: ignore[arg-type]
            batchnorm=any(isinstance(m, _BatchNorm) for m in self.model.modules()),
        )
        super().setup(trainer)
        observes_gpus = self.shares.observes and self.root_device.type == "cuda"
        self.shares.attach(
            no_sync=lambda: self.model.no_sync(),  # type: ignore[union-attr, operator]
            backward=lambda loss: super(BalancedDDP, self).backward(loss, None),
            capacities=gathered_gpu_capacities(self) if observes_gpus else None,
        )

    @override
    def _register_ddp_hooks(self) -> None:
        """As DDP's; without a communication hook of the user's, the step's exchange rides in DDP's all-reduce."""
        super()._register_ddp_hooks()
        self.shares.carrier = None
        if self._ddp_comm_hook is None and self._model_averaging_period is None:
            assert isinstance(self.model, DistributedDataParallel)
            self.shares.carrier = CarriedExchange()
            self.model.register_comm_hook(self.model.process_group, self.shares.carrier.reduce)

    @override
    def backward(self, closure_loss: Tensor, optimizer: Optimizer | None, *args: Any, **kwargs: Any) -> Tensor:
        """DDP's backward on the loss weighted by ``world_size * share / global batch``.

        DDP averages the ranks' gradients; so weighted, the average is the gradient of the global batch's mean loss.
        A zero share's loss (a mean over no samples: NaN) is weighted by 0, which gives zero gradients.
        """
        self.shares.add_micro_batch_grads()  # before DDP's synchronized backward, which reduces them too
        loss = super().backward(closure_loss * self.shares.loss_weight, optimizer, *args, **kwargs)
        self.shares.finish_exchange_after_backward()  # overlapped with this backward pass, or carried in it
        return loss

    @override
    def teardown(self) -> None:
        """As DDP's; a spawned or forked worker then ends its process group (as ``ddp_lr`` does)."""
        self.shares.detach()
        super().teardown()
        if getattr(self, "_start_method", "popen") in ("spawn", "fork", "forkserver"):
            end_process_group()


class BalancedDDPStrategy(BalancedDDP, DDPStrategy):
    """DDP over one global batch split unevenly over the ranks: each step is one process's step on the whole batch.

    The DataLoader's ``batch_size`` is the **global** batch ``B``. Every rank walks the same global order (Lightning's
    ``DistributedSampler`` over one replica: shuffled for training, seeded as under DDP, reshuffled each epoch) and
    takes its share of each global batch, planned by a split policy over the ranks (``EvenSplit`` by default,
    ``ChunkSizes``, ``Weights``, ``Gpu0Budget`` for rank 0, ``chunk_sizes="auto"`` measured and re-planned as the
    ranks' speeds change, or a policy of your own). A rank may get 0 samples; the last, short global batch is split
    too, and ``drop_last`` applies to the global batches. Validation, test and predict split their batches by the
    same policy.

    The step: each rank's loss is weighted by ``world_size * share / B`` (the loss scale, so every precision plugin
    and DDP's own all-reduce stay as they are; a communication hook would have to learn ``B`` and the shares in the
    hook), so DDP's average of the gradients is the gradient of the global batch's mean loss. With
    ``sync_batchnorm=True`` (the default) BatchNorm normalizes over the whole global batch with uneven counts; without
    it a model with BatchNorm is refused at setup, since the step would differ from one process's. Gradient clipping by
    norm sees the all-reduced (global) gradient. What ``training_step`` (and the evaluation steps) log with
    ``self.log`` is combined over the ranks in one ``all_reduce`` per step, weighted by share, and logged once as the
    global batch's value on every rank (``reduce_fx`` ``"mean"`` or ``"sum"``; other reductions and metrics are logged
    as under DDP). Every rank must log the same names in a step. A zero share's step runs on an empty batch (its
    collectives, DDP's and SyncBatchNorm's, must still run): its loss (NaN for a mean over nothing) is weighted by 0.

    Because the step is a function of the global batch only, the same config trains the same on 1 or 64 processes,
    and a checkpoint saved on ``W1`` ranks resumes on ``W2`` at an epoch boundary with exactly the steps an
    uninterrupted run takes (no learning-rate rescaling: the effective batch does not change). A mid-epoch resume
    restarts the interrupted epoch's order, as Lightning does for a plain DataLoader under DDP.

    ``DistributedEvalMixin`` gathers exactly: each rank's share carries its sample indices to ``add_eval_outputs``.

    Args:
        gpu0_bsz: the most samples rank 0 takes of each global batch (:class:`~lightning_balanced.Gpu0Budget`).
        chunk_sizes: samples per rank for a global batch of their sum (:class:`~lightning_balanced.ChunkSizes`), or
            ``"auto"`` (:class:`~lightning_balanced.AutoSplit`: each rank's forward time per sample, measured over the
            first steps and gathered in the step's all_reduce, re-planned on lasting drift).
        weights: relative capacity per rank (:class:`~lightning_balanced.Weights`).
        split: a :class:`~lightning_balanced.SplitPolicy` over the ranks; at most one of these four.
        loss_reduction: how ``training_step``'s loss reduces over samples: ``"mean"`` (weighted by share) or ``"sum"``.
        sync_batchnorm: synchronize BatchNorm over the ranks (torch's ``SyncBatchNorm`` on CUDA, the package's on
            CPU/gloo).
        max_micro_batch: the most samples a rank runs in one forward pass (an int for every rank, or one per rank):
            a larger share runs as micro-batches of near-equal size, all but the last forward and backward under
            DDP's ``no_sync``, each weighted by its samples, so the step is the same. Automatic optimization only, and
            refused with BatchNorm (which normalizes over one forward pass's samples). ``"auto"``: on CUDA, each rank
            its own, from its steps' peak memory (``torch.cuda.max_memory_allocated``) fitted as fixed + per-sample
            bytes, so a micro-batch's step uses at most 90 % of the GPU (the first step runs the share whole); on
            other devices no cap.
        log_shares: log ``balanced_ddp/share_rank{r}``, ``balanced_ddp/step_s_rank{r}`` (the step method's seconds)
            and ``balanced_ddp/idle_s_rank{r}`` (behind the slowest rank) for every rank, on the training steps whose
            logs the loggers write (every ``log_every_n_steps``).
        **kwargs: what :class:`~lightning.pytorch.strategies.DDPStrategy` takes (``start_method``,
            ``process_group_backend``, ``timeout``, ``find_unused_parameters``, ...).

    Raises:
        TypeError, ValueError: a bad split option (:func:`~lightning_balanced.split_policies.split_policy.split_policy`)
            or ``loss_reduction``; at setup, a per-rank policy of the wrong length, or BatchNorm without
            ``sync_batchnorm``; when a DataLoader is set up, one the strategy cannot split
            (:func:`~lightning_balanced.rank_shares.loader.share_loader`), or several train DataLoaders.
        RuntimeError: in a step, when the ranks' plans disagree (a policy that is not the same on every rank).

    Source: Lightning's ``DDPStrategy``; uneven batches per worker as in LB-BSP (Chen et al., SoCC 2020), with the
    gradient weighted by share so that the step is exact.
    """
