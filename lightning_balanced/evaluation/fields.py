"""Per-sample evaluation fields: one small class per kind, and the nesting of fields in dicts and tuples.

A field holds one entry per sample: a tensor (dim 0 = samples), a list of tensors of one dtype and trailing shape but
varying length (ragged, e.g. per-image boxes), a list of 0-dim tensors of one dtype (``list(scores)``), or a list of
Python objects (e.g. image ids, target dicts). Each kind keeps a value when it is added, packs a rank's values into
the tensors to gather, and unpacks the gathered tensors into the kept samples
(:class:`~lightning_balanced.evaluation.sample_order.KeptRows`). Kinds compare and hash by value, so a structure of
kinds tells two ranks' (or two calls') fields apart and names the difference (:func:`difference`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor
from typing_extensions import override

from lightning_balanced.evaluation.sample_order import KeptRows

__all__ = [
    "FieldKind",
    "PythonObjects",
    "RaggedTensors",
    "ScalarTensors",
    "TensorRows",
    "describe",
    "difference",
    "flatten",
    "leaves",
    "rebuild",
]


def _map_tensors(obj: Any, fn: Callable[[Tensor], Tensor]) -> Any:
    """``obj`` with ``fn`` applied to its tensors, through dicts (rebuilt as dicts), lists and tuples; others as is."""
    if isinstance(obj, Tensor):
        return fn(obj)
    if isinstance(obj, Mapping):
        return {key: _map_tensors(value, fn) for key, value in obj.items()}
    if isinstance(obj, (list, tuple)):
        items = [_map_tensors(value, fn) for value in obj]
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


def _own(tensor: Tensor) -> Tensor:
    """``tensor`` detached, and copied when it views a larger storage (``logits[:, -1]``) it would otherwise pin."""
    tensor = tensor.detach()
    return tensor.clone() if tensor.untyped_storage().nbytes() > tensor.nbytes else tensor


class FieldKind:
    """How a field's values are kept when added, packed to travel, and unpacked after the gather.

    The base class is the Python-object kind: values travel pickled, tensors inside them on the CPU.
    """

    def keep(self, value: Any, device: torch.device) -> Any:
        """The value to buffer: tensors detached and moved to ``device`` (in objects: detached only)."""
        return _map_tensors(value, _own)

    def objects(self, pieces: list[Any]) -> list[Any]:
        """A rank's Python objects to exchange (pickled), from its buffered values in call order."""
        objects: list[Any] = _map_tensors([obj for piece in pieces for obj in piece], Tensor.cpu)
        return objects

    def pack(self, pieces: list[Any], device: torch.device) -> list[Tensor]:
        """A rank's tensors to gather, from its buffered values in call order (none: empty tensors on ``device``)."""
        return []

    def unpack(self, gathered: list[list[Tensor]], objects: list[Any], kept: KeptRows) -> Any:
        """The kept samples. ``gathered[k][r]``: rank ``r``'s ``k``-th packed tensor; ``objects``: rank-major."""
        device = kept.indices.device
        return [_map_tensors(objects[i], lambda t: t.to(device)) for i in kept.positions()]


@dataclass(frozen=True)
class PythonObjects(FieldKind):
    """A list of Python objects, one per sample (ids, strings, dicts, tensors of mixed shapes): they travel pickled."""

    def __str__(self) -> str:
        return "a list of Python objects"


@dataclass(frozen=True)
class TensorRows(FieldKind):
    """A tensor with one row per sample along dim 0; bool travels as uint8 (gloo has no bool)."""

    dtype: torch.dtype
    trailing: tuple[int, ...]

    def __str__(self) -> str:
        return f"a {self.dtype} tensor of shape ({', '.join(['N', *map(str, self.trailing)])})"

    @override
    def keep(self, value: Any, device: torch.device) -> Any:
        return _own(value.to(device))

    @override
    def objects(self, pieces: list[Any]) -> list[Any]:
        return []

    @override
    def pack(self, pieces: list[Any], device: torch.device) -> list[Tensor]:
        rows = torch.cat(pieces) if pieces else torch.empty((0, *self.trailing), dtype=self.dtype, device=device)
        return [rows.view(torch.uint8) if self.dtype == torch.bool else rows]

    @override
    def unpack(self, gathered: list[list[Tensor]], objects: list[Any], kept: KeptRows) -> Any:
        return kept.take(gathered[0]).view(self.dtype)


@dataclass(frozen=True)
class ScalarTensors(TensorRows):
    """A list of 0-dim tensors of one dtype, one per sample (``list(scores)``): kept and gathered as one tensor."""

    def __str__(self) -> str:
        return f"a list of 0-dim {self.dtype} tensors"

    @override
    def keep(self, value: Any, device: torch.device) -> Any:
        return torch.stack(value).detach().to(device)

    @override
    def unpack(self, gathered: list[list[Tensor]], objects: list[Any], kept: KeptRows) -> Any:
        return list(super().unpack(gathered, objects, kept).unbind())


@dataclass(frozen=True)
class RaggedTensors(TensorRows):
    """A list of tensors, one per sample, of varying length (e.g. per-image boxes): their rows, and their lengths."""

    def __str__(self) -> str:
        return f"a list of {self.dtype} tensors of shape ({', '.join(['K_i', *map(str, self.trailing)])})"

    @override
    def keep(self, value: Any, device: torch.device) -> Any:
        return [_own(v.to(device)) for v in value]

    @override
    def pack(self, pieces: list[Any], device: torch.device) -> list[Tensor]:
        values = [v for piece in pieces for v in piece]
        return [*super().pack(values, device), torch.tensor([len(v) for v in values], dtype=torch.int64, device=device)]

    @override
    def unpack(self, gathered: list[list[Tensor]], objects: list[Any], kept: KeptRows) -> Any:
        samples = torch.cat(gathered[0]).view(self.dtype).split(torch.cat(gathered[1]).tolist())
        return [samples[i] for i in kept.positions()]


def _kind(value: Any, path: str) -> FieldKind:
    if isinstance(value, Tensor):
        if value.dim() == 0:
            raise ValueError(f"Per-sample field `{path}` is a 0-dim tensor; it needs one row per sample")
        return TensorRows(value.dtype, tuple(value.shape[1:]))
    if isinstance(value, list):  # an empty list is any kind: a call with no samples is never compared
        kinds = {(v.dim() > 0, v.dtype, tuple(v.shape[1:])) if isinstance(v, Tensor) else None for v in value}
        kind = kinds.pop() if len(kinds) == 1 else None
        if kind is None:
            return PythonObjects()
        return RaggedTensors(kind[1], kind[2]) if kind[0] else ScalarTensors(kind[1], ())
    raise TypeError(
        f"Per-sample field `{path}` must be a tensor, a list with one entry per sample, or a dict/tuple of those;"
        f" got {type(value).__name__}"
    )


def flatten(value: Any, path: str, found: list[tuple[str, FieldKind, Any]]) -> Any:
    """The structure of ``value``, appending each leaf's ``(path, kind, value)`` to ``found``.

    A structure is hashable and picklable, with kinds as leaves: ``(dict, keys, children)`` for a mapping,
    ``(tuple type, None, children)`` for a tuple or namedtuple.

    Raises:
        ValueError: a 0-dim tensor leaf. TypeError: a leaf of another type than a tensor or a list.
    """
    if isinstance(value, Mapping):
        keys = tuple(value)
        return (dict, keys, tuple(flatten(value[k], f"{path}.{k}".lstrip("."), found) for k in keys))
    if isinstance(value, tuple):
        return (type(value), None, tuple(flatten(v, f"{path}[{i}]", found) for i, v in enumerate(value)))
    found.append((path, _kind(value, path), value))
    return found[-1][1]


def leaves(structure: Any) -> list[FieldKind]:
    """The kinds of a structure's leaves, in :func:`flatten`'s order."""
    return [structure] if isinstance(structure, FieldKind) else [k for c in structure[2] for k in leaves(c)]


def rebuild(structure: Any, values: Iterator[Any]) -> Any:
    """The nested fields, taking the leaves' values from ``values`` in :func:`flatten`'s order."""
    if isinstance(structure, FieldKind):
        return next(values)
    container, keys, children = structure
    items = [rebuild(child, values) for child in children]
    if keys is not None:
        return dict(zip(keys, items, strict=True))
    return container(*items) if hasattr(container, "_fields") else container(items)


def describe(structure: Any) -> str:
    """A structure in words for error messages (``None``: "absent")."""
    if structure is None or isinstance(structure, FieldKind):
        return "absent" if structure is None else str(structure)
    container, keys, children = structure
    parts = [f"{k!r}: {describe(c)}" if keys else describe(c) for k, c in zip(keys or children, children)]  # noqa: B905
    return f"a {container.__name__} ({', '.join(parts)})"


def difference(a: Any, b: Any, where_a: str, where_b: str) -> str | None:
    """The first field that differs between two structures of fields, with both versions; None when they agree.

    Args:
        a: a structure from :func:`flatten` of keyword fields (a dict at the top).
        b: another such structure, compared with ``a``.
        where_a (str): where ``a`` comes from, for the message (``"on rank 0"``, ``"in call 3"``).
        where_b (str): where ``b`` comes from.

    Returns:
        str | None: the difference in words, or None.
    """
    mine, theirs = dict(zip(*a[1:], strict=True)), dict(zip(*b[1:], strict=True))
    for name in [*mine, *(name for name in theirs if name not in mine)]:
        if mine.get(name) != theirs.get(name):
            return (
                f"per-sample field `{name}` is {describe(mine.get(name))} {where_a}"
                f" but {describe(theirs.get(name))} {where_b}"
            )
    return f"the fields come in the order {list(mine)} {where_a} but {list(theirs)} {where_b}" if a != b else None
