"""Exact evaluation across ranks: every sample once, in sample order, identically on every rank.

Under DDP, ``DistributedSampler`` pads the ranks with repeated samples so they all run the same number of steps, and
metrics silently count the repeats (5 samples on 2 ranks: ``[0, 2, 4]`` and ``[1, 3, 0]``, an accuracy of 1/5
reported as 2/6). :class:`DistributedEvalMixin` buffers per-sample outputs locally during the evaluation epoch, with
no collective inside steps, and at epoch end makes one variable-length gather, drops the repeats by sample index and
orders by it. Any metric computed on the result is then exact, on every rank.

Anchors: HF accelerate's ``gather_for_metrics`` (trims the padded tail), Composer's exact eval, torchmetrics'
``gather_all_tensors`` (sizes first, pad, gather, trim). One difference from the latter: every field of the epoch
travels in one metadata exchange plus one ``all_gather`` per dtype, instead of three collectives per tensor.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.utils.data import Dataset

__all__ = ["DistributedEvalMixin", "IndexedDataset"]

_INDICES = "indices"


class IndexedDataset(Dataset):
    """Wraps a map-style dataset so each item is ``(index, sample)``; the index then travels in the batch.

    Args:
        dataset (Dataset): any map-style dataset with ``__len__``.
    """

    def __init__(self, dataset: Any) -> None:
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[int, Any]:
        return index, self.dataset[index]


# ---- flattening one call's fields into leaves ---------------------------------------------------------------------
# A field is a tensor (per-sample along dim 0), a list (one Python object or tensor per sample), or a dict/tuple of
# those (structure). Each leaf is stored as one of:
#   ("tensor", tensor)             rows = samples
#   ("ragged", cat, lengths)       a list of tensors with equal trailing shapes: rows of `cat` grouped by `lengths`
#   ("objects", list)              anything else per sample, moved with all_gather_object


@dataclass(frozen=True)
class _Leaf:
    path: str
    kind: str  # "tensor", "ragged", "objects"


def _flatten(value: Any, path: str, out: list[tuple[_Leaf, Any]]) -> Any:
    """Return the structure of ``value`` (hashable) and append its leaves to ``out``."""
    if isinstance(value, Tensor):
        out.append((_Leaf(path, "tensor"), value))
        return "tensor"
    if isinstance(value, Mapping):
        return ("dict", tuple((k, _flatten(v, f"{path}.{k}", out)) for k, v in value.items()))
    if isinstance(value, tuple):
        kind = ("namedtuple", type(value)) if hasattr(value, "_fields") else ("tuple", None)
        return (*kind, tuple(_flatten(v, f"{path}[{i}]", out) for i, v in enumerate(value)))
    if isinstance(value, list):
        ragged = all(isinstance(v, Tensor) and v.dim() > 0 for v in value)
        if value and ragged and len({(v.shape[1:], v.dtype) for v in value}) == 1:
            lengths = torch.tensor([v.shape[0] for v in value], dtype=torch.int64)
            out.append((_Leaf(path, "ragged"), (torch.cat(value), lengths)))
            return "ragged"
        out.append((_Leaf(path, "objects"), list(value)))
        return "objects"
    raise TypeError(
        f"Per-sample field `{path}` must be a tensor, a list with one entry per sample, or a dict/tuple of those;"
        f" got {type(value).__name__}"
    )


def _rebuild(structure: Any, leaves: dict[str, Any], path: str) -> Any:
    if structure in ("tensor", "ragged", "objects"):
        return leaves[path]
    kind = structure[0]
    if kind == "dict":
        return {k: _rebuild(s, leaves, f"{path}.{k}") for k, s in structure[1]}
    items = [_rebuild(s, leaves, f"{path}[{i}]") for i, s in enumerate(structure[2])]
    return structure[1](*items) if kind == "namedtuple" else tuple(items)


def _num_samples(leaf: _Leaf, value: Any) -> int:
    if leaf.kind == "tensor":
        if value.dim() == 0:
            raise ValueError(f"Per-sample field `{leaf.path}` is a 0-dim tensor; it needs one row per sample")
        return int(value.shape[0])
    if leaf.kind == "ragged":
        return int(value[1].numel())
    return len(value)


def _as_indices(indices: Any, count: int) -> Tensor:
    if isinstance(indices, Tensor):
        if indices.is_floating_point() or indices.is_complex() or indices.dtype == torch.bool:
            raise ValueError(f"`indices` must hold integers, got a tensor of dtype {indices.dtype}")
        index_tensor = indices.detach().to("cpu", torch.int64).reshape(-1)
    else:
        values = list(indices)
        if any(isinstance(v, bool) or not isinstance(v, numbers.Integral) for v in values):
            raise ValueError(f"`indices` must hold integers, got {values[:5]}...")
        index_tensor = torch.tensor(values, dtype=torch.int64)
    if index_tensor.numel() != count:
        raise ValueError(f"`indices` has {index_tensor.numel()} entries but the fields have {count} samples")
    if index_tensor.numel() and int(index_tensor.min()) < 0:
        raise ValueError(f"`indices` must be >= 0, got {int(index_tensor.min())}")
    if torch.unique(index_tensor).numel() != index_tensor.numel():
        raise ValueError("`indices` holds the same sample index twice in one call")
    return index_tensor


class _Buffer:
    """One rank's per-sample outputs of the current evaluation epoch."""

    def __init__(self) -> None:
        self.calls: list[tuple[Any, list[tuple[_Leaf, Any]], Tensor | None]] = []

    def add(self, fields: dict[str, Any], indices: Any) -> None:
        if not fields:
            raise ValueError(
                "Give at least one per-sample field, e.g. add_eval_outputs(indices, preds=..., target=...)"
            )
        leaves: list[tuple[_Leaf, Any]] = []
        structure = tuple((name, _flatten(value, name, leaves)) for name, value in fields.items())
        counts = {leaf.path: _num_samples(leaf, value) for leaf, value in leaves}
        if len(set(counts.values())) > 1:
            raise ValueError(f"Per-sample fields disagree on the number of samples: {counts}")
        count = next(iter(counts.values()))
        index_tensor = None if indices is None else _as_indices(indices, count)
        detached = [(leaf, _detach(value)) for leaf, value in leaves]
        self.calls.append((structure, detached, index_tensor))  # list.append: safe from balanced_dp's replica threads


def _detach(value: Any) -> Any:
    if isinstance(value, Tensor):
        return value.detach()
    if isinstance(value, tuple):
        return tuple(v.detach() for v in value)
    return value


def _local_problem(buffer: _Buffer) -> str | None:
    signatures = {
        (structure, tuple((leaf, _leaf_meta(leaf, value)) for leaf, value in leaves))
        for structure, leaves, _ in buffer.calls
    }
    if len(signatures) > 1:
        return "the per-sample fields (names, dtypes or trailing shapes) changed between calls on one rank"
    with_indices = {indices is not None for _, _, indices in buffer.calls}
    if len(with_indices) > 1:
        return "`indices` was given in some calls and not in others"
    if with_indices == {True}:
        local = torch.cat([i for _, _, i in buffer.calls if i is not None])
        if torch.unique(local).numel() != local.numel():
            return "`indices` holds the same sample index twice on one rank (across calls)"
    return None


def _pack_rows(values: list[Tensor], widths: list[int]) -> Tensor:
    """Concatenate same-dtype leaves of shape (rows, ...) into one (rows, sum(widths)) tensor; bool travels as uint8."""
    flat = [
        (v.to(torch.uint8) if v.dtype == torch.bool else v).reshape(v.shape[0], width)
        for v, width in zip(values, widths, strict=True)
    ]
    return torch.cat(flat, dim=1) if len(flat) > 1 else flat[0]


def _all_gather_rows(local: Tensor, rows_per_rank: list[int], group: Any) -> list[Tensor]:
    """Variable-length ``all_gather`` along dim 0: pad to the longest rank, gather, trim."""
    longest = max(rows_per_rank)
    padded = local
    if local.shape[0] < longest:
        padded = torch.cat([local, local.new_zeros((longest - local.shape[0], *local.shape[1:]))])
    gathered = [torch.empty_like(padded) for _ in rows_per_rank]
    dist.all_gather(gathered, padded.contiguous(), group=group)
    return [g[:rows] for g, rows in zip(gathered, rows_per_rank, strict=True)]


def _is_distributed(group: Any) -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1


def _gather(
    buffer: _Buffer, *, dataset_size: int | None, group: Any | None, device: torch.device | None
) -> dict[str, Any]:
    """Gather per-sample outputs from every rank: each sample once, ordered by sample index (see the mixin).

    Collectives: one ``all_gather_object`` (what each rank holds, any problem it found, its Python-object fields),
    then one ``all_gather`` per dtype of the tensor leaves. Every rank takes the same path, so an error found on one
    rank is raised on all of them instead of leaving the others in a collective.
    """
    problem = _local_problem(buffer)
    structure = buffer.calls[0][0] if buffer.calls else None
    leaf_meta = [] if not buffer.calls else [(leaf, _leaf_meta(leaf, value)) for leaf, value in buffer.calls[0][1]]
    has_indices = None if not buffer.calls else buffer.calls[0][2] is not None
    local_leaves = _concat_calls(buffer) if problem is None and buffer.calls else {}
    objects = {path: value for path, (kind, value) in local_leaves.items() if kind == "objects"}

    distributed = _is_distributed(group)
    world_size = dist.get_world_size(group) if distributed else 1
    meta = {
        "problem": problem,
        "structure": structure,
        "leaves": leaf_meta,
        "has_indices": has_indices,
        "rows": {path: _rows(kind, value) for path, (kind, value) in local_leaves.items()},
        "samples": _samples(buffer),
        "objects": objects,
    }
    metas: list[dict[str, Any]] = [meta]
    if distributed:
        metas = [{} for _ in range(world_size)]
        dist.all_gather_object(metas, meta, group=group)  # one exchange: what every rank holds, and its objects

    problems = [f"rank {r}: {m['problem']}" for r, m in enumerate(metas) if m["problem"]]
    if problems:
        raise ValueError("Cannot gather the evaluation outputs: " + "; ".join(problems))
    holders = [m for m in metas if m["structure"] is not None]
    if not holders:
        return {}
    reference = holders[0]
    for r, m in enumerate(metas):
        if m["structure"] is not None and (
            m["structure"] != reference["structure"] or m["leaves"] != reference["leaves"]
        ):
            raise ValueError(f"Rank {r} collected different per-sample fields than rank {metas.index(reference)}")
    if len({m["has_indices"] for m in holders}) > 1:
        raise ValueError("Some ranks gave `indices` and others did not")

    # one all_gather per dtype of the tensor leaves (indices included)
    gathered: dict[str, list[Tensor]] = {}
    by_dtype: dict[str, list[str]] = {}
    for leaf, (dtype, _) in reference["leaves"]:
        if leaf.kind == "tensor":
            by_dtype.setdefault(dtype, []).append(leaf.path)
        elif leaf.kind == "ragged":
            by_dtype.setdefault(dtype, []).append(leaf.path)
            by_dtype.setdefault("torch.int64", []).append(leaf.path + "#lengths")
    if reference["has_indices"]:
        by_dtype.setdefault("torch.int64", []).append(_INDICES)
    for dtype_name, paths in by_dtype.items():
        _gather_dtype(paths, dtype_name, local_leaves, metas, reference, gathered, distributed, group, device)

    # per rank, then in order: positions of the kept samples
    samples = [m["samples"] for m in metas]
    if reference["has_indices"]:
        indices = torch.cat(gathered[_INDICES]).reshape(-1).cpu()
        keep = _first_occurrence_by_index(indices)
        result_indices: Tensor | None = indices[keep]
    else:
        keep = _sampler_order(samples, dataset_size)
        result_indices = None

    leaves_out: dict[str, Any] = {}
    for leaf, (dtype, trailing) in reference["leaves"]:
        if leaf.kind == "objects":
            merged = [obj for m in metas if m["structure"] is not None for obj in m["objects"][leaf.path]]
            leaves_out[leaf.path] = [merged[i] for i in keep.tolist()]
        elif leaf.kind == "tensor":
            rows = torch.cat(gathered[leaf.path])
            leaves_out[leaf.path] = _unpack(rows, dtype, trailing)[keep.to(rows.device)]
        else:
            cat = _unpack(torch.cat(gathered[leaf.path]), dtype, trailing)
            lengths = torch.cat(gathered[leaf.path + "#lengths"]).reshape(-1)
            pieces = list(torch.split(cat, lengths.tolist()))
            leaves_out[leaf.path] = [pieces[i] for i in keep.tolist()]

    result = {name: _rebuild(s, leaves_out, name) for name, s in reference["structure"]}
    if result_indices is not None:
        result[_INDICES] = result_indices
    return result


def _leaf_meta(leaf: _Leaf, value: Any) -> tuple[str, tuple[int, ...]]:
    if leaf.kind == "tensor":
        return str(value.dtype), tuple(value.shape[1:])
    if leaf.kind == "ragged":
        return str(value[0].dtype), tuple(value[0].shape[1:])
    return "object", ()


def _concat_calls(buffer: _Buffer) -> dict[str, tuple[str, Any]]:
    out: dict[str, tuple[str, Any]] = {}
    for position, (leaf, _) in enumerate(buffer.calls[0][1]):
        values = [leaves[position][1] for _, leaves, _ in buffer.calls]
        if leaf.kind == "tensor":
            out[leaf.path] = ("tensor", torch.cat(values))
        elif leaf.kind == "ragged":
            out[leaf.path] = ("ragged", (torch.cat([v[0] for v in values]), torch.cat([v[1] for v in values])))
        else:
            out[leaf.path] = ("objects", [obj for value in values for obj in value])
    if buffer.calls[0][2] is not None:
        out[_INDICES] = ("tensor", torch.cat([i for _, _, i in buffer.calls if i is not None]))
    return out


def _rows(kind: str, value: Any) -> int:
    if kind == "ragged":
        return int(value[0].shape[0])
    return int(value.shape[0]) if kind == "tensor" else len(value)


def _samples(buffer: _Buffer) -> int:
    return sum(_num_samples(*leaves[0]) for _, leaves, _ in buffer.calls)


def _gather_dtype(
    paths: list[str],
    dtype_name: str,
    local_leaves: dict[str, tuple[str, Any]],
    metas: list[dict[str, Any]],
    reference: dict[str, Any],
    gathered: dict[str, list[Tensor]],
    distributed: bool,
    group: Any,
    device: torch.device | None,
) -> None:
    """Pack the leaves of one dtype that share a row count, gather them in one call, and unpack per rank."""
    by_rows: dict[str, list[str]] = {}
    for path in paths:
        by_rows.setdefault(_row_key(path, reference), []).append(path)
    for row_key, group_paths in by_rows.items():
        locals_ = [_local_rows(path, local_leaves) for path in group_paths]
        widths = [_width(path, reference) for path in group_paths]
        if locals_[0] is None:  # this rank holds nothing
            target_device = device or torch.device("cpu")
            packed_dtype = torch.uint8 if dtype_name == "torch.bool" else getattr(torch, dtype_name.split(".")[1])
            local = torch.empty((0, sum(widths)), dtype=packed_dtype, device=target_device)
        else:
            local = _pack_rows([v for v in locals_ if v is not None], widths)
            if device is not None:
                local = local.to(device)
        rows_per_rank = [_meta_rows(m, row_key) for m in metas]
        per_rank = _all_gather_rows(local, rows_per_rank, group) if distributed else [local]
        start = 0
        for path, width in zip(group_paths, widths, strict=True):
            gathered[path] = [block[:, start : start + width] for block in per_rank]
            start += width


def _row_key(path: str, reference: dict[str, Any]) -> str:
    """Leaves with the same row count: per-sample tensors and indices share 'samples'; each ragged leaf has its own."""
    if path.endswith("#lengths") or path == _INDICES:
        return "samples"
    kinds = {leaf.path: leaf.kind for leaf, _ in reference["leaves"]}
    return path if kinds[path] == "ragged" else "samples"


def _local_rows(path: str, local_leaves: dict[str, tuple[str, Any]]) -> Tensor | None:
    if path.endswith("#lengths"):
        entry = local_leaves.get(path[: -len("#lengths")])
        return None if entry is None else entry[1][1].reshape(-1, 1)
    entry = local_leaves.get(path)
    if entry is None:
        return None
    rows: Tensor = entry[1][0] if entry[0] == "ragged" else entry[1]
    return rows


def _width(path: str, reference: dict[str, Any]) -> int:
    if path.endswith("#lengths") or path == _INDICES:
        return 1
    for leaf, (_, trailing) in reference["leaves"]:
        if leaf.path == path:
            width = 1
            for size in trailing:
                width *= size
            return width
    raise KeyError(path)


def _meta_rows(meta: dict[str, Any], row_key: str) -> int:
    if meta["structure"] is None:
        return 0
    return int(meta["samples"]) if row_key == "samples" else int(meta["rows"][row_key])


def _unpack(rows: Tensor, dtype_name: str, trailing: tuple[int, ...]) -> Tensor:
    out = rows.reshape(rows.shape[0], *trailing)
    return out.to(torch.bool) if dtype_name == "torch.bool" else out


def _first_occurrence_by_index(indices: Tensor) -> Tensor:
    """Positions that keep each sample index once (its first occurrence in rank order), ordered by index.

    A table over the index range with a deterministic ``amin`` scatter: O(N + max index), no sort; for sparse indices
    (max index much larger than N) a sort-based ``unique`` instead.
    """
    count = indices.numel()
    if count == 0:
        return torch.zeros(0, dtype=torch.int64)
    positions = torch.arange(count, dtype=torch.int64)
    span = int(indices.max()) + 1
    if span <= 4 * count + 1024:
        table = torch.full((span,), count, dtype=torch.int64)
        table.scatter_reduce_(0, indices, positions, reduce="amin")
        return table[table < count]
    unique, inverse = torch.unique(indices, return_inverse=True)
    first = torch.full((unique.numel(),), count, dtype=torch.int64)
    return first.scatter_reduce_(0, inverse, positions, reduce="amin")


def _sampler_order(samples_per_rank: list[int], dataset_size: int | None) -> Tensor:
    """Positions in rank-major gathered order of the samples in ``DistributedSampler`` order, padding removed.

    Rank ``r``'s ``j``-th sample is the sampler's global position ``j * world_size + r``; positions at or past the
    dataset size are the padding ``DistributedSampler`` repeats.
    """
    world_size = len(samples_per_rank)
    offsets = [0]
    for count in samples_per_rank[:-1]:
        offsets.append(offsets[-1] + count)
    longest = max(samples_per_rank, default=0)
    keep = []
    for j in range(longest):
        for r in range(world_size):
            global_position = j * world_size + r
            if j < samples_per_rank[r] and (dataset_size is None or global_position < dataset_size):
                keep.append(offsets[r] + j)
    return torch.tensor(keep, dtype=torch.int64)


class DistributedEvalMixin:
    """A LightningModule mixin for exact evaluation across ranks: every sample once, the same result on every rank.

    In a step, hand over per-sample outputs with their sample indices: nothing is communicated there. At epoch end,
    :meth:`gather_eval_outputs` returns, identically on every rank, the outputs of the whole evaluation set, each sample
    exactly once and ordered by sample index; compute any metric on them (a torchmetrics functional, or a metric
    module with ``sync_on_compute=False``, since every rank already holds everything)::

        class LitModel(DistributedEvalMixin, pl.LightningModule):
            def validation_step(self, batch, batch_idx):
                indices, (x, y) = batch                      # from IndexedDataset
                self.add_eval_outputs(indices, preds=self(x).argmax(1), target=y)

            def on_validation_epoch_end(self):
                out = self.gather_eval_outputs()
                self.log("val_acc", (out["preds"] == out["target"]).float().mean())

    Per-sample fields are tensors (dim 0 = samples, any dtype, bool included), lists with one entry per sample
    (Python objects such as image ids, or tensors of varying length such as per-image detections), or dicts/tuples of
    those. Ranks may hold zero samples and may have run different numbers of batches.

    Without ``indices``, the padding ``DistributedSampler`` adds is removed by count: rank ``r``'s ``j``-th sample is
    the sampler's position ``j * world_size + r``, and positions past the dataset size are dropped. This is exact only
    when each rank adds its samples in loader order, the sampler is a ``DistributedSampler`` with ``drop_last=False``
    (Lightning's default for evaluation) and the dataset size is known (read from the evaluation dataloader or passed
    as ``dataset_size``); the result is then in sampler order (dataset order when ``shuffle=False``). With
    ``balanced_dp`` the chunks of one batch may be added in any order, so pass indices there.

    Works the same on a single device, with ``balanced_dp``, Lightning's ``ddp`` and ``LRScaledDDPStrategy``. All ranks
    must call :meth:`gather_eval_outputs` (it runs collectives); it relies on the process group's timeout so a rank
    that never arrives fails instead of hanging forever.
    """

    _eval_buffer: _Buffer

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # Created eagerly: balanced_dp's replicas copy the module's __dict__, so they append to this same buffer.
        self._eval_buffer = _Buffer()

    def add_eval_outputs(self, indices: Tensor | Sequence[int] | None = None, **fields: Any) -> None:
        """Buffer per-sample outputs of this rank (no communication).

        Args:
            indices (Tensor[N] or Sequence[int], optional): the dataset indices of the ``N`` samples (integers >= 0).
            **fields: per-sample outputs, each with ``N`` samples: a tensor ``(N, ...)``, a list of ``N`` entries, or a
                dict/tuple of those. Tensors are detached.

        Raises:
            ValueError: fields of different lengths (the message lists them), non-integer or negative indices, an index
                repeated within the call, or no field at all.
            TypeError: a field of another type.
        """
        self._eval_buffer.add(fields, indices)

    def gather_eval_outputs(self, *, dataset_size: int | None = None, group: Any | None = None) -> dict[str, Any]:
        """Gather the buffered outputs of every rank; every rank gets the same result. Clears the buffer.

        Args:
            dataset_size (int, optional): number of samples in the evaluation set, needed only without indices;
                by default the length of the current evaluation dataloader's dataset.
            group (ProcessGroup, optional): the ranks to gather over (default: the world).

        Returns:
            dict: each field, with the whole evaluation set along dim 0 (lists for list fields), each sample once,
            ordered by sample index; plus ``"indices"`` (Tensor[N] int64, sorted) when indices were given. Empty if no
            rank added anything.

        Raises:
            ValueError: on every rank, when any rank repeated a sample index, changed its fields between calls, or mixed
                calls with and without indices, or when ranks collected different fields.
        """
        buffer, self._eval_buffer = self._eval_buffer, _Buffer()
        if dataset_size is None:
            dataset_size = self._eval_dataset_size()
        device = getattr(self, "device", None)
        if device is not None and device.type == "cpu":
            device = None
        return _gather(buffer, dataset_size=dataset_size, group=group, device=device)

    def _eval_dataset_size(self) -> int | None:
        trainer = getattr(self, "_trainer", None)
        if trainer is None:
            return None
        loaders = None
        if trainer.validating or trainer.sanity_checking or (trainer.training and trainer.val_dataloaders is not None):
            loaders = trainer.val_dataloaders
        elif trainer.testing:
            loaders = trainer.test_dataloaders
        elif trainer.predicting:
            loaders = trainer.predict_dataloaders
        if isinstance(loaders, (list, tuple)):
            loaders = loaders[0] if loaders else None
        dataset = getattr(loaders, "dataset", None)
        try:
            return len(dataset) if dataset is not None else None
        except TypeError:
            return None
