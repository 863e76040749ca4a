"""How a batch is split: the split policies and their planning, for devices (``balanced_dp``) and ranks
(``balanced_ddp``, ``balanced_fsdp``) alike.

``split_policy`` (:class:`SplitPolicy`, the base of every policy, and ``EvenSplit``, ``Gpu0Budget``, ``ChunkSizes``,
``Weights``, ``split_policy``: the strategies' split options in one place) and ``auto_split`` (:class:`AutoSplit`:
measured speed and memory). **A new split policy** is one subclass of ``SplitPolicy`` (here, or in your own code).
"""

from lightning_balanced.split_policies.auto_split import AutoSplit
from lightning_balanced.split_policies.split_policy import (
    ChunkSizes,
    EvenSplit,
    Gpu0Budget,
    SplitPolicy,
    Weights,
    even_split,
    plan_chunk_sizes,
    split_policy,
)

__all__ = [
    "AutoSplit",
    "ChunkSizes",
    "EvenSplit",
    "Gpu0Budget",
    "SplitPolicy",
    "Weights",
    "even_split",
    "plan_chunk_sizes",
    "split_policy",
]
