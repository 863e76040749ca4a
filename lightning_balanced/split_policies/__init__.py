"""How a batch is split: the split policies and their planning, for devices (``balanced_dp``) and ranks
(``balanced_ddp``, ``balanced_fsdp``) alike.

``split_policy`` (:class:`SplitPolicy`, the base of every policy, and ``EvenSplit``, ``Gpu0Budget``, ``ChunkSizes``,
``Weights``, ``split_policy``: the strategies' split options in one place) and ``auto_split`` (:class:`AutoSplit`:
measured speed and memory). **A new split policy** is one subclass of ``SplitPolicy`` (here, or in your own code).
"""

from lightning_balanced.split_policies import split_policy as _split_policy
from lightning_balanced.split_policies.auto_split import AutoSplit
from lightning_balanced.split_policies.split_policy import *  # noqa: F403  (its __all__)

__all__ = ["AutoSplit", *_split_policy.__all__]
