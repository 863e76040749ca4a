"""A map-style dataset whose items carry their index, for exact evaluation across ranks."""

from __future__ import annotations

from typing import Any

from torch.utils.data import Dataset

__all__ = ["IndexedDataset"]


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
