"""The multi-process pipeline's parts (``strategy="pipeline"``), on ``torch.distributed.pipelining``.

``stage_plan`` (schedules, which stages a rank holds, the cut), ``materialize`` (a model built on the meta device,
each rank its own layers), ``p2p_forward`` (the forward-only pass of evaluation, micro-batched), ``sharded_checkpoint``
(each rank writes its stages with ``torch.distributed.checkpoint``), ``bubble`` and ``saved_bytes`` (telemetry).
"""
