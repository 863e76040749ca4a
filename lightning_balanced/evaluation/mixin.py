"""Exact evaluation across ranks: every sample once, in sample order, identically on every rank.

``DistributedSampler`` pads the ranks with repeated samples, which metrics silently count (5 samples on 2 ranks:
``[0, 2, 4]`` and ``[1, 3, 0]``, an accuracy of 1/5 reported as 2/6). :class:`DistributedEvalMixin` buffers per-sample
outputs on the root device, with no collective inside steps. At epoch end, ``gather_eval_outputs``:

1. exchanges each rank's fields, counts, problems, Python objects and whether its indices follow
   ``DistributedSampler``'s layout through the store, with a deadline (``store_all_gather_object``): every rank
   checks the same list, so all raise the same error, or none;
2. gathers the fields one at a time with torchmetrics' ``gather_all_tensors`` (3 collectives per tensor: one per tensor
   field, two per ragged field), and the indices only when the ranks' samples are not the sampler's interleave;
3. keeps each sample index once, ordered by index (``_sample_order``). ``preds`` and ``target``: 6 collectives per
   epoch, 9 with a shuffled loader.

Why torchmetrics' gather: in ``benchmarks/bench_gather.py``'s setting, our own variable-length ``all_gather`` (no
barrier, no zero-filled receive buffers) took 0.72, 0.87 and 0.90 of the time at 1e5 samples but 1.10, 1.02 and 1.05
at 1e6 (three runs): not at least 10 % faster at both sizes, so not worth its code.
Anchors: HF accelerate's ``gather_for_metrics``, Composer's exact eval, torchmetrics' ``gather_all_tensors``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import Tensor
from torchmetrics.utilities.distributed import gather_all_tensors

import lightning_balanced.evaluation.fields as per_sample
import lightning_balanced.evaluation.sample_order as sample_order
from lightning_balanced.evaluation.indexed_dataset import IndexedDataset
from lightning_balanced.evaluation.missing_indices import EVALUATION_STEPS, naming_missing_indices
from lightning_balanced.evaluation.store_gather import store_all_gather_object

__all__ = ["DistributedEvalMixin", "IndexedDataset"]


#: The attribute through which ``balanced_dp`` tells each replica of the LightningModule where its chunk stands:
#: ``(step, replica index)``, the chunks of a batch in batch order. Calls from the replicas' threads arrive in any
#: order; the gather puts them back in this one (a call outside the replicas goes after its step's chunks).
REPLICA_POSITION = "_lightning_balanced_replica_position"

#: The attribute through which ``balanced_ddp`` tells the LightningModule the dataset indices of the rank's share of the
#: current batch (a list of ints): a call without ``indices`` that adds the whole share uses them, since the shares of
#: a global batch are not DistributedSampler's interleave. They are not returned by the gather (the user gave none).
BATCH_INDICES = "_lightning_balanced_batch_indices"


class _Call(NamedTuple):
    """One ``add_eval_outputs`` call with samples: structure (interned), leaf values, indices, place in the order."""

    structure: Any
    values: list[Any]
    indices: Tensor | None
    samples: int
    position: tuple[int, int]
    user_indices: bool  # given by the user (returned by the gather), not by the strategy (BATCH_INDICES)


class _Meta(NamedTuple):
    """What a rank tells the others: a problem, its (structure, indices given) or None, samples, tail, objects."""

    problem: str | None
    signature: tuple[Any, bool, bool] | None  # (structure, indices known, indices given by the user)
    samples: int
    tail: int | None  # see sampler_tail
    objects: list[list[Any]]
    dataset_size: int | None  # used without indices only


_structures: dict[Any, Any] = {}  # one object per distinct structure: most calls compare by identity at the gather


def _problem(calls: list[_Call], index: Tensor | None) -> str | None:
    for number, call in enumerate(calls[1:], start=2):
        if call.structure is not calls[0].structure and call.structure != calls[0].structure:
            where = ("in the first call with samples", f"in call {number} with samples")
            return (
                f"the fields changed between calls: {per_sample.difference(calls[0].structure, call.structure, *where)}"
            )
    if len({call.indices is None for call in calls}) > 1:
        return "`indices` was given in some calls and not in others"
    negative = index is not None and index.numel() > 0 and int(index.min()) < 0  # indices added on an accelerator
    return f"`indices` must be >= 0, got {int(index.min())}" if negative else None  # type: ignore[union-attr]


def _mismatch(metas: list[_Meta]) -> str | None:
    """Why the ranks' calls cannot be gathered together: the first field that differs, with both versions."""
    signed = [(r, m, m.signature) for r, m in enumerate(metas) if m.signature is not None]
    if not signed:
        return None
    first, reference, (structure, given, _) = signed[0]
    for rank, meta, (other, other_given, _) in signed[1:]:
        difference = per_sample.difference(structure, other, f"on rank {first}", f"on rank {rank}")
        if difference:
            return difference
        if given != other_given:
            return f"`indices` was given on rank {first if given else rank} but not on rank {rank if given else first}"
        if not given and meta.dataset_size != reference.dataset_size:
            return (
                f"without `indices`, `dataset_size` is {reference.dataset_size} on rank {first}"
                f" but {meta.dataset_size} on rank {rank}"
            )
    return None


def _gather(calls: list[_Call], dataset_size: int | None, group: Any, device: torch.device, timeout_s: float) -> Any:
    """Gather the calls buffered on every rank (see the module)."""
    distributed = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
    rank, world_size = (dist.get_rank(group), dist.get_world_size(group)) if distributed else (0, 1)
    pieces = [call.indices for call in calls if call.indices is not None]
    given = len(pieces) == len(calls)  # a rank without calls has an empty index
    index = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.int64, device=device)
    index_cpu = index.cpu() if given else None  # one host sync here, none in the steps
    problem, count = _problem(calls, index_cpu), sum(call.samples for call in calls)
    kinds = per_sample.leaves(calls[0].structure) if calls and not problem else []
    meta = _Meta(
        problem,
        (calls[0].structure, calls[0].indices is not None, calls[0].user_indices) if calls and not problem else None,
        count,
        None if problem else sample_order.sampler_tail(index_cpu, count, rank, world_size, dataset_size),
        [kind.objects([call.values[k] for call in calls]) for k, kind in enumerate(kinds)],
        dataset_size,
    )
    metas = [meta]
    if distributed:
        metas = store_all_gather_object(meta, caller="gather_eval_outputs", timeout_s=timeout_s, group=group)
    problems: list[str | None] = [f"rank {r}: {m.problem}" for r, m in enumerate(metas) if m.problem]
    problems = problems or [_mismatch(metas)]
    if problems != [None]:  # every rank holds the same metas: every rank raises the same error, none is left waiting
        raise ValueError("Cannot gather the evaluation outputs: " + "; ".join(map(str, problems)))
    signed = next((m for m in metas if m.signature), None)
    if signed is None or signed.signature is None:
        return {}
    reference, dataset_size = signed.signature, signed.dataset_size  # every rank's, as checked

    def gather(tensor: Tensor) -> list[Tensor]:
        return gather_all_tensors(tensor, group) if distributed else [tensor]

    counts = [m.samples for m in metas]
    n = sample_order.interleave_size(counts, [m.tail for m in metas])
    if n is not None:  # the sampler's interleave: the indices need no gather
        blocks: Sequence[Tensor] = ()
    else:  # sorted by the indices, gathered or generated
        blocks = gather(index) if reference[1] else sample_order.sampler_positions(counts, dataset_size)
    kept = sample_order.KeptRows(counts, device, n, blocks)
    values = (  # one field at a time: its gathered copies are freed before the next one arrives
        kind.unpack(
            [gather(t) for t in kind.pack([c.values[k] for c in calls], device)],
            [o for m in metas if m.signature for o in m.objects[k]],
            kept,
        )
        for k, kind in enumerate(per_sample.leaves(reference[0]))
    )
    result: dict[str, Any] = per_sample.rebuild(reference[0], values)
    return {**result, "indices": kept.indices} if reference[2] else result


class DistributedEvalMixin:
    """A LightningModule mixin for exact evaluation across ranks: every sample once, the same result on every rank.

    In a step, hand over per-sample outputs with their sample indices: nothing is communicated there. At epoch end,
    :meth:`gather_eval_outputs` returns, identically on every rank, the outputs of the whole evaluation set, each sample
    exactly once and ordered by sample index; compute any metric on them (a torchmetrics functional, or a metric
    module with ``sync_on_compute=False``: every rank already holds everything)::

        class LitModel(DistributedEvalMixin, pl.LightningModule):
            def validation_step(self, batch, batch_idx):
                indices, (x, y) = batch                      # from IndexedDataset
                self.add_eval_outputs(indices, preds=self(x).argmax(1), target=y)

            def on_validation_epoch_end(self):
                out = self.gather_eval_outputs()             # on every rank
                self.log("val_acc", (out["preds"] == out["target"]).float().mean())

    Per-sample fields are tensors (dim 0 = samples, any dtype), lists with one entry per sample (tensors of varying
    length such as per-image detections, 0-dim tensors, or Python objects such as image ids), or dicts/tuples of
    those. Tensors are detached and moved to the root device (``trainer.strategy.root_device``) when added, and copied
    when they view a larger tensor; those inside Python objects are detached, travel on the CPU and come back on the
    root device. Do not modify an added tensor in place. Ranks may hold zero samples and may have run different
    numbers of batches.

    Without ``indices``, rank ``r``'s ``j``-th sample is taken as the sampler's position ``j * world_size + r``. This
    is exact when each rank adds its samples in loader order, the sampler is a ``DistributedSampler`` with
    ``drop_last=False`` (Lightning's default for evaluation) and the dataset size is known (from the evaluation
    dataloader, or ``dataset_size``); the result is then in sampler order. Under ``balanced_dp`` the replicas add
    their chunks from their own threads, in any order: the gather puts them back in batch order (``balanced_dp`` marks
    each replica's chunk), so indices are not needed there either. Works the same on one device, with ``balanced_dp``,
    ``ddp``, ``ddp_lr_*`` and the pipelines.
    """

    _eval_buffer: list[_Call]
    _eval_last_step: list[int]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in EVALUATION_STEPS:  # an error on a first batch without indices names IndexedDataset
            step = getattr(cls, name, None)
            if callable(step) and not getattr(step, "__qualname__", "").startswith("LightningModule."):
                setattr(cls, name, naming_missing_indices(step, name))

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Created eagerly: balanced_dp's replicas copy the module's __dict__, so they append to this same list.
        self._eval_buffer = []
        self._eval_last_step = [0]  # shared with the replicas the same way: the step of the latest replica call

    def add_eval_outputs(self, indices: Tensor | Sequence[int] | None = None, **fields: Any) -> None:
        """Buffer per-sample outputs of this rank (no communication).

        Args:
            indices (Tensor[N] or Sequence[int], optional): the dataset indices of the ``N`` samples (integers >= 0).
            **fields: per-sample outputs, each with ``N`` samples: a tensor ``(N, ...)``, a list of ``N`` entries, or a
                dict/tuple of those. ``N = 0`` adds nothing, whatever the fields' kinds.

        Raises:
            ValueError: fields of different lengths (the message lists them), non-integer or negative indices, a 0-dim
                tensor field, or no field at all.
            TypeError: a field of another type.
        """
        if not fields:
            raise ValueError("Give at least one per-sample field: add_eval_outputs(indices, preds=..., target=...)")
        leaves: list[tuple[str, per_sample.FieldKind, Any]] = []
        structure, device = per_sample.flatten(fields, "", leaves), self._root_device()
        counts = {path: len(value) for path, _, value in leaves}
        if not counts:
            raise ValueError(f"The per-sample fields hold no tensor or list, only empty dicts/tuples: {list(fields)}")
        if len(set(counts.values())) > 1:
            raise ValueError(f"Per-sample fields disagree on the number of samples: {counts}")
        count = next(iter(counts.values()))
        user_indices = indices is not None
        if indices is None and BATCH_INDICES in self.__dict__:  # balanced_ddp: this rank's share of the batch
            indices = self.__dict__[BATCH_INDICES]
            if len(indices) != count:
                raise ValueError(
                    f"add_eval_outputs got {count} samples without `indices`, but this rank's share of the batch has"
                    f" {len(indices)} under strategy='balanced_ddp': pass `indices` (the dataset indices of the samples"
                    " added) when adding a part of the batch"
                )
        index = None if indices is None else sample_order.sample_indices(indices, count, device)
        if count:  # list.append is thread-safe: balanced_dp's replicas add from their threads
            values = [kind.keep(value, device) for _, kind, value in leaves]
            if len(_structures) > 1024:  # fields that change every call: an error at the gather, but bounded here
                _structures.clear()
            structure = _structures.setdefault(structure, structure)  # one hash per call
            self._eval_buffer.append(_Call(structure, values, index, count, self._eval_position(), user_indices))

    def gather_eval_outputs(
        self, *, dataset_size: int | None = None, group: Any | None = None, timeout_s: float = 60.0
    ) -> dict[str, Any]:
        """Gather the buffered outputs of every rank; every rank gets the same result. Clears the buffer.

        Every rank of ``group`` must call it, at the same point: it runs collectives.

        Args:
            dataset_size (int, optional): number of samples in the evaluation set, needed only without indices;
                by default the length of the current evaluation dataloader's dataset.
            group (ProcessGroup, optional): the ranks to gather over; by default the strategy's
                ``data_parallel_group`` where it has one (``strategy="pipeline"``: the ranks of a pipeline hold the same
                outputs), else the world.
            timeout_s (float): how long, in seconds, to wait for the other ranks to call it.

        Returns:
            dict: each field, with the whole evaluation set along dim 0 (lists for list fields), each sample once,
            ordered by sample index; plus ``"indices"`` (Tensor[N] int64, sorted) when indices were given. Empty if no
            rank added anything.

        Raises:
            ValueError: on every rank, when a rank repeated a sample index, added a negative one on an accelerator,
                changed its fields between calls, mixed calls with and without indices, held Python objects that do not
                pickle, or (without indices) more samples than ``DistributedSampler`` gives it; or when ranks collected
                different fields or, without indices, saw different ``dataset_size`` (named, with both versions).
                ``timeout_s`` not > 0.
            RuntimeError: on every rank that called it, when another did not within ``timeout_s`` (named).
        """
        if not timeout_s > 0:
            raise ValueError(f"`timeout_s` must be > 0 seconds, got {timeout_s}")
        buffer, self._eval_buffer = self._eval_buffer, []
        buffer.sort(key=lambda call: call.position)  # balanced_dp's chunks in batch order (stable: else unchanged)
        if dataset_size is None and (not buffer or buffer[0].indices is None):  # needed without indices only
            dataset_size = self._eval_dataset_size()
        if group is None:
            trainer = getattr(self, "_trainer", None)
            group = getattr(trainer.strategy, "data_parallel_group", None) if trainer is not None else None
        return _gather(buffer, dataset_size, group, self._root_device(), timeout_s)  # type: ignore[no-any-return]

    def _eval_position(self) -> tuple[int, int]:
        position: tuple[int, int] | None = self.__dict__.get(REPLICA_POSITION)
        if position is not None:  # in a replica of balanced_dp: remember the step for calls made outside the replicas
            self._eval_last_step[0] = position[0]
            return position
        return (self._eval_last_step[0], 1 << 30)

    def _root_device(self) -> torch.device:
        trainer = getattr(self, "_trainer", None)
        device = trainer.strategy.root_device if trainer is not None else getattr(self, "device", None)
        return device if isinstance(device, torch.device) else torch.device("cpu")

    def _eval_dataset_size(self) -> int | None:
        trainer = getattr(self, "_trainer", None)
        return None if trainer is None else sample_order.sampler_dataset_size(sample_order.current_loader(trainer))
