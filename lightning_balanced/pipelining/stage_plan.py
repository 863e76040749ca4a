"""Where the stages of a multi-process pipeline live: torch's schedules by name, and the stages of each rank.

Pure functions, used by :class:`~lightning_balanced.strategies.pipeline.PipelineStrategy`: which
``torch.distributed.pipelining`` schedule a name stands for (and the torch release that added it), which stage
indices each rank of the pipeline holds for that schedule, and the cut of an ``nn.Sequential`` into stages.

Source: ``torch.distributed.pipelining`` (PyTorch 2.4+); the looped and V-shaped stage placements follow the
schedules' own conventions (Narayanan et al., SC 2021, for the interleaved schedule; Qi et al., ICLR 2024, "Zero
Bubble Pipeline Parallelism", for the zero-bubble and V schedules).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

import torch
from torch import nn
from torch.torch_version import TorchVersion

from lightning_balanced.arguments import check_int
from lightning_balanced.ranks.reports import counted

__all__ = [
    "SCHEDULES",
    "ScheduleSpec",
    "cut_sequential",
    "describe_plan",
    "schedule_and_stages",
    "schedule_spec",
    "stage_indices",
    "stage_layers",
    "stage_owners",
]

Placement = Literal["single", "loop", "v"]


@dataclass(frozen=True)
class ScheduleSpec:
    """One schedule of ``torch.distributed.pipelining``.

    Attributes:
        name (str): as ``PipelineStrategy(schedule=...)`` takes it, torch's class name without ``Schedule``.
        class_name (str): the class in ``torch.distributed.pipelining``.
        added_in (str): the first torch release that has it.
        runs_from (str): the first torch release on which ``strategy="pipeline"`` runs it (found on gloo: earlier
            releases fail in its point-to-point exchange).
        placement (str): ``"single"`` (one stage per rank), ``"loop"`` (rank ``r`` of ``p`` holds stages ``r``,
            ``r + p``, ``r + 2p``, ...) or ``"v"`` (two stages per rank, ``r`` and ``2p - 1 - r``).
        zero_bubble (bool): it splits backward into input and weight gradients to fill the bubble (Qi et al.).
    """

    name: str
    class_name: str
    added_in: str
    runs_from: str
    placement: Placement
    zero_bubble: bool = False

    def theoretical_bubble(self, pipeline_size: int, chunks: int, stages_per_rank: int) -> float | None:
        """The idle fraction of a step the schedule is designed for, with equal stages; ``None`` for zero-bubble ones.

        ``(p - 1) / (v * m + p - 1)`` for ``p`` ranks, ``m`` micro-batches and ``v`` stages per rank: GPipe and 1F1B
        (``v = 1``; Huang et al., 2019; Narayanan et al., 2021) and the looped schedules (Narayanan et al., SC 2021).
        The zero-bubble schedules' bubble depends on the split of backward into its input and weight halves.
        """
        if self.zero_bubble:
            return None
        p, m, v = pipeline_size, chunks, stages_per_rank
        return (p - 1) / (v * m + p - 1)

    def schedule_class(self) -> type:
        """The class, from the installed torch.

        Raises:
            ValueError: the installed torch does not have it, or has it but does not run it yet; the message names the
                release that added it, or the one it runs from.
        """
        import torch.distributed.pipelining as pipelining

        found = getattr(pipelining, self.class_name, None)
        if found is None:
            raise ValueError(
                f"`schedule`={self.name!r} is torch.distributed.pipelining.{self.class_name}, added in torch"
                f" {self.added_in}; the installed torch is {torch.__version__}. Upgrade torch or choose another"
                " schedule"
            )
        if TorchVersion(torch.__version__) < self.runs_from:
            raise ValueError(
                f"`schedule`={self.name!r} runs under strategy='pipeline' from torch {self.runs_from}: torch"
                f" {torch.__version__}'s {self.class_name} fails in its point-to-point exchange (seen on gloo)."
                " Upgrade torch or use `schedule='GPipe'`"
            )
        return found  # type: ignore[no-any-return]

    def available(self) -> bool:
        """Whether the installed torch has it and ``strategy="pipeline"`` runs it (:meth:`schedule_class`)."""
        try:
            self.schedule_class()
        except ValueError:
            return False
        return True


# The first torch release on which each kind of schedule trains under strategy="pipeline", found with 2 gloo ranks on
# 2026-11-26: GPipe on 2.4.1 and later; 1F1B-style ones time out in their batched exchange on 2.4.1, 2.5.1, 2.6.0 and
# 2.7.1 and run from 2.8.0; the V-shaped ones fail on 2.8.0, 2.10.0 and 2.11.0 ("Pair is not connected") and run on
# 2.13.0 and 2.14.1 (2.12 was not tried).
RUNS_FROM = "2.8"
RUNS_FROM_V = "2.13"
#: The first torch release on which a schedule was seen to train stages that pass several tensors (a tuple) to the
#: next: torch 2.4.1's GPipe waited forever in its exchange there (2026-11-28); 2.13 trains them exactly.
SEVERAL_TENSORS_FROM = "2.13"


def check_several_tensors(where: str) -> None:
    """Refuse, naming the release, a tuple of tensors between stages (``where``) under a torch that hangs on it.

    Raises:
        ValueError: the installed torch is older than :data:`SEVERAL_TENSORS_FROM`.
    """
    if TorchVersion(torch.__version__) < SEVERAL_TENSORS_FROM:
        raise ValueError(
            f"strategy='pipeline' trains stages that pass several tensors (a tuple) to the next from torch"
            f" {SEVERAL_TENSORS_FROM} (torch {torch.__version__} hangs in the schedule's exchange); {where} passes a"
            " tuple: upgrade torch, or pass one tensor (evaluation takes tuples on any torch)"
        )


#: The schedules by name.
SCHEDULES: dict[str, ScheduleSpec] = {
    spec.name: spec
    for spec in (
        ScheduleSpec("GPipe", "ScheduleGPipe", "2.4", "2.4", "single"),
        ScheduleSpec("1F1B", "Schedule1F1B", "2.4", RUNS_FROM, "single"),
        ScheduleSpec("Interleaved1F1B", "ScheduleInterleaved1F1B", "2.4", RUNS_FROM, "loop"),
        ScheduleSpec("LoopedBFS", "ScheduleLoopedBFS", "2.4", RUNS_FROM, "loop"),
        ScheduleSpec("InterleavedZeroBubble", "ScheduleInterleavedZeroBubble", "2.5", RUNS_FROM, "loop", True),
        ScheduleSpec("ZBVZeroBubble", "ScheduleZBVZeroBubble", "2.6", RUNS_FROM_V, "v", True),
        ScheduleSpec("DualPipeV", "ScheduleDualPipeV", "2.9", RUNS_FROM_V, "v", True),  # not in 2.8.0; in 2.10.0
    )
}


def schedule_spec(name: object) -> ScheduleSpec:
    """The :class:`ScheduleSpec` of ``name``.

    Raises:
        TypeError: ``name`` is not a string.
        ValueError: an unknown name; the message lists the known ones.
    """
    if not isinstance(name, str):
        raise TypeError(f"`schedule` must be the name of a schedule (a str), got {name!r}")
    if name not in SCHEDULES:
        raise ValueError(f"`schedule` must be one of {list(SCHEDULES)}, got {name!r}")
    return SCHEDULES[name]


def schedule_and_stages(schedule: object, stages_per_rank: object) -> tuple[ScheduleSpec, int]:
    """``PipelineStrategy``'s ``schedule`` and ``stages_per_rank`` checked, their defaults filled in.

    ``schedule=None``: ``"1F1B"``, or ``"GPipe"`` where the installed torch does not run 1F1B. ``stages_per_rank=None``:
    1 for single-stage schedules, 2 for the others.

    Raises:
        TypeError: ``schedule`` not a string, ``stages_per_rank`` not an integer.
        ValueError: an unknown schedule, or one the installed torch lacks (naming the release that adds it);
            ``stages_per_rank`` below 1 or one the schedule does not take.
    """
    if schedule is None:
        schedule = "1F1B" if SCHEDULES["1F1B"].available() else "GPipe"
    spec = schedule_spec(schedule)
    spec.schedule_class()  # a schedule the installed torch lacks fails here, naming its release
    default = 1 if spec.placement == "single" else 2
    stages = default if stages_per_rank is None else check_int("stages_per_rank", stages_per_rank, minimum=1)
    stage_indices(0, 1, stages, spec.placement)  # the schedule takes this many
    return spec, stages


def stage_indices(rank: int, pipeline_size: int, stages_per_rank: int, placement: Placement) -> list[int]:
    """The stage indices rank ``rank`` of a pipeline of ``pipeline_size`` ranks holds, in increasing order.

    Args:
        rank (int): the rank within the pipeline, ``0 .. pipeline_size - 1``.
        pipeline_size (int): ranks in the pipeline, ``p``.
        stages_per_rank (int): stages each rank holds, ``k``; ``pipeline_size * stages_per_rank`` stages in all.
        placement (str): see :class:`ScheduleSpec`.

    Raises:
        ValueError: ``stages_per_rank`` other than 1 for ``"single"``, other than 2 for ``"v"``, below 2 for
            ``"loop"``.
    """
    required = {"single": "1", "v": "2", "loop": "at least 2"}[placement]
    if (
        (placement == "single" and stages_per_rank != 1)
        or (placement == "v" and stages_per_rank != 2)
        or (placement == "loop" and stages_per_rank < 2)
    ):
        raise ValueError(
            f"`stages_per_rank` must be {required} for a schedule with {placement!r} stage placement, got"
            f" {stages_per_rank}"
        )
    if placement == "v":
        return [rank, 2 * pipeline_size - 1 - rank]
    return [rank + i * pipeline_size for i in range(stages_per_rank)]


def stage_owners(pipeline_size: int, stages_per_rank: int, placement: Placement) -> list[int]:
    """For each stage index, the rank of the pipeline that holds it (the inverse of :func:`stage_indices`)."""
    owners = [0] * (pipeline_size * stages_per_rank)
    for rank in range(pipeline_size):
        for stage in stage_indices(rank, pipeline_size, stages_per_rank, placement):
            owners[stage] = rank
    return owners


def stage_layers(balance: list[int], stage: int) -> range:
    """The indices in the ``nn.Sequential`` of stage ``stage``'s layers, under ``balance`` (layers per stage)."""
    start = sum(balance[:stage])
    return range(start, start + balance[stage])


def describe_plan(
    schedule: str, chunks: int, balance: list[int], owners: list[int], data_parallel_size: int, method: str
) -> str:
    """The report of a pipeline's plan: the schedule, the stages and which pipeline rank holds each.

    Args:
        schedule (str): the schedule's name.
        chunks (int): micro-batches per batch.
        balance (list[int]): layers per stage.
        owners (list[int]): for each stage, its rank in the pipeline.
        data_parallel_size (int): pipelines (data-parallel replicas).
        method (str): how the balance was chosen.
    """
    pipeline_size = max(owners) + 1
    lines = [
        f"pipeline: schedule {schedule}, {counted(chunks, 'micro-batch', 'micro-batches')},"
        f" {counted(len(balance), 'stage')} over {counted(pipeline_size, 'rank')} x"
        f" {counted(data_parallel_size, 'data-parallel replica')}; balance {balance} ({method})"
    ]
    for stage, owner in enumerate(owners):
        layers = stage_layers(balance, stage)
        lines.append(f"  stage {stage}: layers {layers.start}..{layers.stop - 1} on pipeline rank {owner}")
    return "\n".join(lines)


def cut_sequential(sequential: nn.Sequential, balance: list[int]) -> list[nn.Sequential]:
    """The stages: consecutive layers of ``sequential``, ``balance[s]`` of them in stage ``s``.

    The stages hold ``sequential``'s own layer objects under their own names (no copies); ``sequential`` is left as it
    is, so its ``state_dict`` keys do not change.

    Raises:
        ValueError: ``balance`` does not cover the layers exactly or holds an entry below 1.
    """
    if any(size < 1 for size in balance) or sum(balance) != len(sequential):
        raise ValueError(
            f"`balance` {balance} must hold one entry >= 1 per stage and sum to the {len(sequential)} layers of the"
            " nn.Sequential"
        )
    layers = list(sequential._modules.items())
    stages, start = [], 0
    for size in balance:
        stages.append(nn.Sequential(OrderedDict(layers[start : start + size])))
        start += size
    return stages
