"""One global batch split over the ranks: what ``balanced_ddp`` and ``balanced_fsdp`` do per step, written once.

``loader`` (each rank's share of a global batch: the batch sampler and the DataLoader), ``exchange`` (the step's one
all_reduce, by named fields), ``carried_exchange`` (DDP's communication hook that carries it in the gradient
all-reduce), ``step_timer`` (a step's seconds and peak bytes) and ``engine`` (``ShareEngine``: the share a step runs,
its loss weight, micro-batches, the exchange and the split policy's ``observe``; ``ShareStep``: a strategy's step
methods through it). A strategy owns one engine and keeps Lightning's hooks.
"""
