"""The multi-process pipeline's parts (``strategy="pipeline"``), on ``torch.distributed.pipelining``.

``stage_plan`` (schedules, which stages a rank holds, the cut), ``mesh`` (the ``("dp", "pp")`` groups), ``batches``
(what a training batch is), ``runtime`` (a rank's stages and schedules), ``train_step`` (one step and its exchange),
``materialize`` (a model built on the meta device, each rank its own layers), ``p2p_forward`` (the forward-only pass of
evaluation, micro-batched), ``sharded_checkpoint`` (each rank writes its stages with ``torch.distributed.checkpoint``),
``bubble`` and ``saved_bytes`` (telemetry).
"""
