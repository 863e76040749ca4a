"""The ranks of ``strategy="pipeline"`` as a 2-D ``("dp", "pp")`` mesh: ``d`` pipelines of ``p`` consecutive ranks."""

from __future__ import annotations

from dataclasses import dataclass

import torch.distributed as dist

__all__ = ["PipelineMesh", "pipeline_mesh"]


@dataclass(frozen=True)
class PipelineMesh:
    """This rank's two process groups and its place in them.

    Args:
        pipeline_group (ProcessGroup): the ``p`` ranks of this rank's pipeline (``"pp"``): the schedule's group.
        data_parallel_group (ProcessGroup): the ``d`` ranks holding the same stages, one per pipeline (``"dp"``):
            where gradients, the loss and BatchNorm moments are averaged.
        pipeline_size (int): ``p``.
        data_parallel_size (int): ``d``.
        pipeline_rank (int): this rank within its pipeline, ``global_rank % p``.
    """

    pipeline_group: dist.ProcessGroup
    data_parallel_group: dist.ProcessGroup
    pipeline_size: int
    data_parallel_size: int
    pipeline_rank: int


def pipeline_mesh(world_size: int, global_rank: int, pipeline_size: int, device_type: str) -> PipelineMesh:
    """Build this rank's groups; every rank of the default group must call it (``new_group`` is collective).

    One pipeline (``pipeline_size == world_size``): the world and a group of one rank. Else torch's
    ``init_device_mesh`` over ``(world_size / p, p)`` with dimension names ``("dp", "pp")``, as torchtitan lays out
    pipeline x data parallelism.

    Args:
        world_size (int): ranks in the default group.
        global_rank (int): this rank.
        pipeline_size (int): ranks per pipeline, ``p``.
        device_type (str): ``"cuda"``, ``"cpu"``, ...: the mesh's device type.

    Raises:
        ValueError: ``pipeline_size`` does not divide ``world_size``.
    """
    if world_size % pipeline_size:
        raise ValueError(
            f"`pipeline_parallel_size`={pipeline_size} must divide the world size {world_size} (devices x num_nodes)"
        )
    data_parallel_size = world_size // pipeline_size
    rank = global_rank % pipeline_size
    if data_parallel_size == 1:
        singles = [dist.new_group([member]) for member in range(world_size)]  # every rank calls new_group for each
        return PipelineMesh(dist.group.WORLD, singles[global_rank], pipeline_size, 1, rank)  # type: ignore[arg-type]
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device_type, (data_parallel_size, pipeline_size), mesh_dim_names=("dp", "pp"))
    return PipelineMesh(mesh.get_group("pp"), mesh.get_group("dp"), pipeline_size, data_parallel_size, rank)
