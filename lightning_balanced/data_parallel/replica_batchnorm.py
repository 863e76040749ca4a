"""Synchronized BatchNorm across the replicas of one process: one step's BatchNorm equals full-batch BatchNorm.

In single-process data parallel (``balanced_dp``, ``nn.DataParallel``) every replica's BatchNorm normally sees only
its own chunk. Here each replica's layer computes its chunk's per-channel ``(count, mean, M2)`` with autograd and hands
it to the step's :class:`~lightning_balanced.data_parallel.barrier.ReplicaBarrier`, one meeting per layer call (keyed by
the layer: the ``k``-th call of a layer meets the other replicas' ``k``-th call of the same layer). The last replica to
arrive combines all of them (Chan's parallel formula, :func:`~lightning_balanced.nn.moments.combine_moments`,
count-weighted, on the first replica's device) and every replica normalizes with the combined mean and variance. The
exchanged tensors belong to one autograd graph (``Tensor.to(device)`` is differentiable across devices), so the
backward pass, which the strategy runs once from the combined loss, needs no meeting: on CPU the autograd engine runs
all backward work in one thread, where any wait would deadlock.

The strategy's protocol:

1. at setup, ``model = convert_replica_batchnorm(model)``: every ``_BatchNorm`` becomes a :class:`ReplicaSyncBatchNorm`
   sharing its parameters and buffers (the state-dict keys stay those of plain BatchNorm);
2. per step, after replication: ``barrier = ReplicaBarrier(len(replicas))`` for the replicas that will run, then
   ``attach_step(replicas, barrier)``, or ``layers.attach(replicas, barrier)`` with
   ``layers = SyncBatchNormLayers(model)`` found once at setup (no walk of the replicas' trees per step); when a
   replica fails, ``barrier.abort(index, error)`` releases the others (with
   :class:`~lightning_balanced.data_parallel.barrier.ReplicaAborted`), and a replica that waits longer than the
   barrier's timeout at a layer raises a ``RuntimeError`` naming the layer;
3. at teardown, ``model = revert_replica_batchnorm(model)`` puts the user's own BatchNorm objects back, holding the
   current state.

Source: the design of Synchronized-BatchNorm-PyTorch (Jiayuan Mao and Tete Xiao, for ``nn.DataParallel``): a master
collects every replica's statistics, computes the batch statistics and hands them back, with autograd through the
exchange; here count-weighted and combined from centered moments.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

import torch
from torch import Tensor
from torch.nn import Module
from torch.nn.modules.batchnorm import _BatchNorm

from lightning_balanced.data_parallel.barrier import ReplicaBarrier
from lightning_balanced.data_parallel.stream_order import Ready, ready, use_on_current_stream
from lightning_balanced.nn.conversion import convert_batchnorm, revert_batchnorm
from lightning_balanced.nn.moments import (
    Moments,
    batch_moments,
    check_batchnorm_input,
    combine_moments,
    moments_dtype,
)

__all__ = [
    "ReplicaSyncBatchNorm",
    "SyncBatchNormLayers",
    "attach_step",
    "convert_replica_batchnorm",
    "revert_replica_batchnorm",
]


_TIMEOUT_HINT = (
    "With sync_batchnorm every replica must run the same BatchNorm layers the same number of times in each step; a"
    " BatchNorm inside a data-dependent branch cannot be synchronized."
)


class ReplicaSyncBatchNorm(_BatchNorm):
    r"""A BatchNorm layer whose batch statistics span the chunks of all replicas of a step.

    Made by :func:`convert_replica_batchnorm` from a user's ``_BatchNorm`` (1d/2d/3d or a subclass), sharing its
    parameters and buffers; :func:`revert_replica_batchnorm` gives the user's layer back. It behaves exactly like
    :class:`torch.nn.BatchNorm2d` (1d/3d), except in a replica that has a step's
    :class:`~lightning_balanced.data_parallel.barrier.ReplicaBarrier` attached (:func:`attach_step`) and normalizes
    with batch statistics (training, or ``track_running_stats=False``): then

    * the mean and biased variance are those of the concatenation of every participating replica's input, so
      outputs, input gradients and weight/bias gradients (summed over the replicas by the shared parameters) equal
      full-batch BatchNorm's on the whole batch, whatever the split; a chunk of one sample works, an empty one
      contributes nothing;
    * in training with ``track_running_stats``, the running statistics and ``num_batches_tracked`` of the original
      layer (the one in the user's model, not a replica's copy) are updated once per step from the full-batch
      statistics: ``momentum`` as in torch, ``None`` for a cumulative average.

    Eval mode with running statistics is plain ``F.batch_norm``, with no meeting.

    Statistics are computed in float32 (float64 for float64 input): float16/bfloat16 input is normalized in float32
    and cast back. Per-replica moments and the combination are float64 (float32 on MPS). On CUDA the combination runs on
    the first replica's device and the results are copied to each replica's device with ``Tensor.to``, inside
    autograd.

    Args:
        num_features, eps, momentum, affine, track_running_stats, device, dtype: as for :class:`torch.nn.BatchNorm2d`;
            normally the converter copies them from the user's layer.

    Shape:
        - Input: :math:`(N, C, *)` with 0 to 3 trailing dimensions; ``N`` may differ between replicas, even be 0.
        - Output: same shape and dtype as the input.

    Raises:
        ValueError: (in ``forward``) an input that is not 2D to 5D or whose channel dimension is not
            ``num_features``, or, with batch statistics, fewer than 2 values per channel over all replicas (raised in
            every replica alike).
        ReplicaAborted, RuntimeError: from the barrier: another replica failed, or the others did not come to this
            layer within the barrier's timeout (see :class:`~lightning_balanced.data_parallel.barrier.ReplicaBarrier`).

    Source: Ioffe & Szegedy, "Batch Normalization" (ICML 2015); torch's ``_BatchNorm`` running-statistics semantics;
    Chan, Golub & LeVeque's parallel variance formula for the combination.
    """

    # Set per replica by attach_step (replicas copy their original's __dict__; the original itself keeps None).
    _sync_barrier: ReplicaBarrier | None = None
    _replica_index: int = 0
    _sync_name: str = ""
    # The layer in the user's (converted) model; a replica's copy of __dict__ points to it. Set by the converter.
    _sync_origin: ReplicaSyncBatchNorm | None = None
    # The user's BatchNorm object that this layer stands in for. Set by the converter.
    _user_batchnorm: _BatchNorm | None = None
    # Layers of this class made other than by replication (constructed, copied, unpickled), ever: SyncBatchNormLayers
    # looks for the model's layers again when it changed, so a layer made after they were found is attached too.
    _layers_made: ClassVar[int] = 0

    def __init__(
        self,
        num_features: int,
        eps: float = 1e-5,
        momentum: float | None = 0.1,
        affine: bool = True,
        track_running_stats: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype)
        ReplicaSyncBatchNorm._layers_made += 1

    def __setstate__(self, state: dict[str, Any]) -> None:
        super().__setstate__(state)
        ReplicaSyncBatchNorm._layers_made += 1

    def _check_input_dim(self, input: Tensor) -> None:
        check_batchnorm_input(self, input)

    def forward(self, input: Tensor) -> Tensor:
        """Normalize ``input``: over all replicas' chunks when a barrier is attached, else as plain BatchNorm.

        Args:
            input (Tensor[N, C, *]): 2D to 5D, floating point.

        Returns:
            Tensor: same shape and dtype as ``input``.

        Raises:
            ValueError: bad input shape, or fewer than 2 values per channel over all replicas.
        """
        barrier = self._sync_barrier
        batch_statistics = self.training or (self.running_mean is None and self.running_var is None)
        if barrier is None or not batch_statistics:
            return super().forward(input)
        check_batchnorm_input(self, input)
        compute_dtype = torch.promote_types(input.dtype, torch.float32)
        x = input.to(compute_dtype)
        stats_dtype = moments_dtype(input.device)
        dims = [0, *range(2, input.dim())]
        local = batch_moments(x, dims, dtype=stats_dtype)
        count = input.numel() // input.shape[1] if input.shape[1] else 0
        origin = self._sync_origin if self._sync_origin is not None else self
        # On CUDA each replica computes on its own stream: the combiner waits (on the GPU) for the event recorded after
        # this replica's moments, and this replica waits for the one recorded after the combination.
        contribution = (count, local, ready(input.device), input.shape[0])
        mean, var, combined = barrier.call_once(
            self._replica_index,
            contribution,
            self._combine,
            key=origin,
            what=f"synchronized BatchNorm layer '{self._sync_name or type(self).__name__}'",
            hint=_TIMEOUT_HINT,
        )
        use_on_current_stream(combined, mean.device, (mean, var))
        mean = mean.to(device=input.device, dtype=compute_dtype)
        var = var.to(device=input.device, dtype=compute_dtype)
        shape = (1, -1, *([1] * (input.dim() - 2)))
        scale = torch.rsqrt(var + self.eps)
        if self.weight is not None:
            scale = scale * self.weight.to(compute_dtype)
        centered = x - mean.view(shape)
        if self.bias is not None:
            output = torch.addcmul(self.bias.to(compute_dtype).view(shape), centered, scale.view(shape))
        else:
            output = centered * scale.view(shape)
        return output.to(input.dtype)

    def _combine(self, contributions: list[tuple[int, Moments, Ready, int]]) -> tuple[Tensor, Tensor, Ready]:
        """Run once per meeting (by the last replica to arrive): the combined mean and biased variance.

        Each contribution is a replica's ``(values per channel, moments, event after them, samples)``. On the first
        replica's device, after waiting (on the GPU, not the host) for each replica's moments; returns with them an
        event that marks the combination done.
        """
        total_count = sum(count for count, _, _, _ in contributions)
        if total_count <= 1:
            raise ValueError(
                f"Expected more than 1 value per channel when training, got {total_count} over all replicas "
                f"(samples per replica {[samples for _, _, _, samples in contributions]})"
            )
        for _, moments, made, _ in contributions:
            use_on_current_stream(made, moments.mean.device, moments)
        device = contributions[0][1].mean.device
        dtype = contributions[0][1].mean.dtype
        total = combine_moments(
            torch.stack([m.count.to(device=device, dtype=dtype) for _, m, _, _ in contributions]),
            torch.stack([m.mean.to(device) for _, m, _, _ in contributions]),
            torch.stack([m.m2.to(device) for _, m, _, _ in contributions]),
        )
        var = total.m2 / total_count
        if self.training and self.track_running_stats:
            self._update_running_stats(total.mean.detach(), total.m2.detach() / (total_count - 1))
        return total.mean, var, ready(device)

    def _update_running_stats(self, mean: Tensor, unbiased_var: Tensor) -> None:
        """Once per step, on the original layer's buffers: torch's ``_BatchNorm`` update rule, without a host sync."""
        origin = self._sync_origin if self._sync_origin is not None else self
        with torch.no_grad():
            factor: float | Tensor = 0.0 if origin.momentum is None else origin.momentum
            tracked = origin.num_batches_tracked
            if tracked is not None:
                tracked.add_(1)
                if origin.momentum is None and tracked.device.type == "cpu":
                    factor = 1.0 / float(tracked)  # as torch's _BatchNorm; free on the host
                elif origin.momentum is None:
                    # float() of a GPU tensor makes the host wait for every kernel queued before it: the cumulative
                    # average's factor stays on the device (float64: 1/n and 1 - 1/n as Python computes them).
                    factor = tracked.to(torch.float64).reciprocal()
            for running, value in ((origin.running_mean, mean), (origin.running_var, unbiased_var)):
                if running is None:
                    continue
                if isinstance(factor, Tensor):
                    running.mul_(1.0 - factor).add_(value.to(running) * factor)
                else:
                    running.mul_(1.0 - factor).add_(value.to(running), alpha=factor)


def convert_replica_batchnorm(module: Module) -> Module:
    """Replace every ``_BatchNorm`` layer of ``module`` (recursively) by a :class:`ReplicaSyncBatchNorm`.

    The new layer shares the user's layer's parameters (so ``requires_grad`` and optimizer references carry over) and
    buffers, copies its hyperparameters and training flag, and keeps the user's object for
    :func:`revert_replica_batchnorm`. Its state-dict keys are those of plain BatchNorm, so checkpoints saved while
    converted load into the user's model. Converting twice is a no-op.

    Args:
        module (Module): a model, or a single BatchNorm layer.

    Returns:
        Module: ``module`` with its BatchNorm layers replaced in place, or the new layer if ``module`` is one.

    Raises:
        ValueError: a lazy BatchNorm layer that has not been initialized yet (run one forward pass first).
    """

    def build(user: _BatchNorm) -> ReplicaSyncBatchNorm:
        layer = ReplicaSyncBatchNorm(
            user.num_features, user.eps, user.momentum, user.affine, user.track_running_stats, device="meta"
        )
        object.__setattr__(layer, "_sync_origin", layer)
        object.__setattr__(layer, "_user_batchnorm", user)
        return layer

    return convert_batchnorm(module, build, ReplicaSyncBatchNorm)


def revert_replica_batchnorm(module: Module) -> Module:
    """Undo :func:`convert_replica_batchnorm`: put the user's own BatchNorm objects back, holding the current state.

    Each user layer gets the converted layer's current parameters and buffers (whatever ``.to()``, loading a
    checkpoint or training made of them), hyperparameters and training flag.

    Args:
        module (Module): a converted model, or a single converted layer.

    Returns:
        Module: ``module`` with its layers restored in place, or the user's layer if ``module`` is a converted one.
    """
    return revert_batchnorm(
        module, lambda layer: layer._user_batchnorm if isinstance(layer, ReplicaSyncBatchNorm) else None
    )


def attach_step(replicas: Sequence[Module], barrier: ReplicaBarrier) -> None:
    """Attach the step's ``barrier`` to the :class:`ReplicaSyncBatchNorm` layers of this step's replicas.

    Searches each replica's whole module tree; :class:`SyncBatchNormLayers` does the same from layers found once.

    Args:
        replicas (Sequence[Module]): the replicas that run the step (from ``replicate``); replica ``i`` contributes
            as index ``i``.
        barrier (ReplicaBarrier): the step's barrier, of ``len(replicas)`` parties.

    Raises:
        ValueError: ``len(replicas)`` differs from ``barrier.parties``, or a replica's layer is not a per-step copy
            (the user's model itself must never be attached: its layers would stay attached after the step).
    """
    _check_parties(replicas, barrier)
    for index, replica in enumerate(replicas):
        for name, layer in replica.named_modules():
            if isinstance(layer, ReplicaSyncBatchNorm):
                _attach_layer(layer, name, index, barrier)


def _check_parties(replicas: Sequence[Module], barrier: ReplicaBarrier) -> None:
    if len(replicas) != barrier.parties:
        raise ValueError(f"got {len(replicas)} replicas for a barrier of {barrier.parties} parties")


def _attach_layer(layer: ReplicaSyncBatchNorm, name: str, index: int, barrier: ReplicaBarrier) -> None:
    origin = layer._sync_origin
    if origin is None or origin is layer:
        raise ValueError(
            f"layer '{name}' of replica {index} is not a replica: attach_step takes the per-step copies "
            "made by replicate(), not the model"
        )
    object.__setattr__(layer, "_sync_barrier", barrier)
    object.__setattr__(layer, "_replica_index", index)
    object.__setattr__(layer, "_sync_name", name or type(layer).__name__)


class SyncBatchNormLayers:
    """The :class:`ReplicaSyncBatchNorm` layers of a converted model, found once; attaches each step to their copies.

    :func:`attach_step` searches every replica's whole module tree, every step. A strategy that replicates the same
    model every step makes this once, after :func:`convert_replica_batchnorm`, and per step :meth:`attach` follows only
    the recorded paths in each replica. It gives what :func:`attach_step` gives even when the model's tree changed
    between steps (say in a hook): when a path no longer leads to a copy of its layer (a synchronized layer was moved,
    replaced or removed), it searches the replicas as :func:`attach_step` does, and when a :class:`ReplicaSyncBatchNorm`
    was made since the layers were found (constructed, copied or unpickled: it may be in the model now), it finds the
    model's layers again first.

    Args:
        model (Module): the converted model that is replicated every step (its replicas are given to :meth:`attach`).
    """

    def __init__(self, model: Module) -> None:
        self.model = model
        self._find()

    def _find(self) -> None:
        self._layers_made = ReplicaSyncBatchNorm._layers_made
        self._layers = [
            (name, tuple(name.split(".")) if name else (), layer)
            for name, layer in self.model.named_modules()
            if isinstance(layer, ReplicaSyncBatchNorm)
        ]

    def attach(self, replicas: Sequence[Module], barrier: ReplicaBarrier) -> None:
        """Attach ``barrier`` to the copies of the model's synchronized layers in ``replicas``, as :func:`attach_step`.

        Args:
            replicas (Sequence[Module]): the replicas of ``model`` that run the step; replica ``i`` contributes as
                index ``i``.
            barrier (ReplicaBarrier): the step's barrier, of ``len(replicas)`` parties.

        Raises:
            ValueError: as :func:`attach_step`.
        """
        _check_parties(replicas, barrier)
        if ReplicaSyncBatchNorm._layers_made != self._layers_made:
            self._find()
        copies = [self._copies(replica) for replica in replicas]
        if any(found is None for found in copies):
            attach_step(replicas, barrier)
            self._find()
            return
        for index, found in enumerate(copies):
            assert found is not None
            for (name, _, _), layer in zip(self._layers, found, strict=True):
                _attach_layer(layer, name, index, barrier)

    def _copies(self, replica: Module) -> list[ReplicaSyncBatchNorm] | None:
        """The replica's copy of each recorded layer, or ``None`` when a path leads elsewhere (the tree changed)."""
        copies = []
        for _, atoms, origin in self._layers:
            module: Module | None = replica
            for atom in atoms:
                module = module._modules.get(atom) if module is not None else None
            if not isinstance(module, ReplicaSyncBatchNorm) or module._sync_origin is not origin:
                return None
            copies.append(module)
        return copies
