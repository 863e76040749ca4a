"""strategy="balanced_ddp": one global batch split unevenly over real gloo CPU ranks, against one process trained on
the global batches.

float64: the runs differ only in how the ranks' weighted gradients are summed and in the order of BatchNorm's moment
merge (~1e-16 relative), so 1e-12 on weights and running statistics after three steps of SGD with momentum or Adam
is wide, while an unweighted mean over uneven shares, a lost or repeated sample, or per-rank BatchNorm statistics are
off by 1e-3 and more. The Linear before the BatchNorm has no bias: under Adam a bias whose true gradient is 0 turns
rounding noise of 1e-17 into a step of lr * 1e-17 / eps (DESIGN.md, 7b), under any strategy.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch import nn
from torch.nn import functional as F
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_balanced import AutoSplit, BalancedDDPStrategy, ChunkSizes, DistributedEvalMixin, EvenSplit
from lightning_balanced.rank_shares.engine import MeasuredMicroBatch
from lightning_balanced.rank_shares.loader import ShareBatchSampler, share_loader
from tests.distributed import run_distributed
from tests.helpers import quiet_trainer, raises_exactly
from tests.reference import reference_fit

EXACT = {"rtol": 0, "atol": 1e-12}
SAMPLES = 24


class Regressor(DistributedEvalMixin, pl.LightningModule):
    """A float64 MLP with BatchNorm; logs its loss; gathers its validation predictions with the mixin."""

    def __init__(self, optimizer: str = "sgd", batchnorm: bool = True, slow_rank: int | None = None) -> None:
        super().__init__()
        torch.manual_seed(0)
        norm = [nn.BatchNorm1d(16)] if batchnorm else []
        self.net = nn.Sequential(nn.Linear(5, 16, bias=not batchnorm), *norm, nn.Tanh(), nn.Linear(16, 3)).double()
        self.optimizer = optimizer
        self.slow_rank = slow_rank
        self.gathered: dict[str, Any] = {}

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        x, y = batch
        if self.slow_rank == self.global_rank:  # a stand-in for a slower GPU: 2 ms more per sample
            time.sleep(0.002 * x.shape[0])
        loss = F.mse_loss(self.net(x), y)
        self.log("train_loss", loss)
        return loss

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        x, y = batch
        prediction = self.net(x)
        self.log("val_loss", F.mse_loss(prediction, y), sync_dist=True)
        self.add_eval_outputs(pred=prediction)

    def on_validation_epoch_end(self) -> None:
        self.gathered = self.gather_eval_outputs()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        if self.optimizer == "adam":
            return torch.optim.Adam(self.parameters(), lr=0.01)
        return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)


def _data(n: int = SAMPLES) -> TensorDataset:
    g = torch.Generator().manual_seed(1)
    return TensorDataset(
        torch.randn(n, 5, generator=g, dtype=torch.float64), torch.randn(n, 3, generator=g, dtype=torch.float64)
    )


class _Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[float] = []

    def on_train_batch_end(self, trainer: pl.Trainer, module: pl.LightningModule, *args: Any) -> None:
        self.losses.append(trainer.callback_metrics["train_loss"].item())


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _fit_rank(rank: int, world_size: int, runs: list[dict[str, Any]]) -> list[Any]:
    results = []
    for run in runs:
        model = Regressor(run.get("optimizer", "sgd"), batchnorm=run.get("batchnorm", True))
        losses = _Losses()
        strategy = BalancedDDPStrategy(**run.get("strategy", {}))
        trainer = quiet_trainer(strategy, world_size, callbacks=[losses], **{"max_steps": 3, **run.get("trainer", {})})
        trainer.fit(model, DataLoader(_data(), batch_size=run.get("batch_size", 8), shuffle=True))
        result: dict[str, Any] = {"state": _state(model), "losses": losses.losses, "steps": trainer.global_step}
        if run.get("validate"):
            metrics = trainer.validate(model, DataLoader(_data(10), batch_size=4), verbose=False)[0]
            result["val_loss"] = metrics["val_loss"]
            result["gathered"] = model.gathered
        results.append(result)
    return results


def _reference(
    steps: int,
    batch_size: int = 8,
    optimizer: str = "sgd",
    accumulate: int = 1,
    clip: float | None = None,
    batchnorm: bool = True,
) -> tuple[dict[str, torch.Tensor], list[float]]:
    """One process on the global batches, in the order of Lightning's DistributedSampler over one replica (shuffled,
    seeded, reshuffled each epoch), stepping as Lightning's loop does with accumulation and clipping."""
    model = Regressor(optimizer, batchnorm=batchnorm)
    return reference_fit(
        model,
        model.configure_optimizers(),
        lambda x, y: F.mse_loss(model.net(x), y),
        _data(),
        steps=steps,
        batch_size=batch_size,
        accumulate=accumulate,
        clip=clip,
    )


def _assert_trained_as(ranks: list[dict[str, Any]], reference: tuple[dict[str, torch.Tensor], list[float]]) -> None:
    state, losses = reference
    for rank in ranks:
        for name, value in state.items():
            torch.testing.assert_close(
                rank["state"][name], value, **EXACT, msg=lambda m, name=name: f"{name}: {m}", check_dtype=False
            )
        assert rank["losses"] == pytest.approx(losses, rel=1e-12)


_TWO_RANK_RUNS = [
    {"strategy": {"chunk_sizes": [3, 5]}},
    {"strategy": {"chunk_sizes": [0, 8]}, "optimizer": "adam"},  # a rank with no samples, every step
    {"strategy": {"split": EvenSplit()}, "batch_size": 5},  # 24 = 4 x 5 + 4: a short last global batch, split too
    {"strategy": {"chunk_sizes": [1, 7]}, "trainer": {"accumulate_grad_batches": 2, "gradient_clip_val": 0.05}},
    # Rank 1's share of 7 in micro-batches of at most 3 (3, 2, 2), accumulated under no_sync, rank 0's 1 whole.
    {
        "strategy": {"chunk_sizes": [1, 7], "max_micro_batch": 3},
        "trainer": {"accumulate_grad_batches": 2},
        "batchnorm": False,
        "optimizer": "adam",
    },
    # 'auto' measures GPU memory: on CPU ranks each share runs whole, the step as without a cap
    {"strategy": {"chunk_sizes": [3, 5], "max_micro_batch": "auto"}, "batchnorm": False},
]


@pytest.mark.slow
def test_uneven_shares_train_as_one_process_on_the_global_batch_on_two_ranks() -> None:
    results = run_distributed(_fit_rank, 2, _TWO_RANK_RUNS, timeout_s=600)
    references = [
        _reference(3),
        _reference(3, optimizer="adam"),
        _reference(6, batch_size=5),  # not 3: the short batch must be reached
        _reference(3, accumulate=2, clip=0.05),
        _reference(3, optimizer="adam", accumulate=2, batchnorm=False),
        _reference(3, batchnorm=False),
    ]
    for index, reference in enumerate(references):
        ranks = [results[rank][index] for rank in range(2)]
        if index == 2:
            ranks = [{**rank, "losses": rank["losses"][:6]} for rank in ranks]
        _assert_trained_as(ranks, reference if index != 2 else _reference(3, batch_size=5))


@pytest.mark.slow
def test_three_ranks_with_a_zero_share_and_one_process_train_alike_and_evaluate_every_sample_once() -> None:
    run = {"strategy": {"chunk_sizes": [4, 0, 4]}, "validate": True}
    three = run_distributed(_fit_rank, 3, [run], timeout_s=600)
    one = run_distributed(_fit_rank, 1, [{"validate": True}], timeout_s=300)
    reference = _reference(3)
    _assert_trained_as([rank[0] for rank in three] + [one[0][0]], reference)
    model = Regressor()
    model.load_state_dict(reference[0])
    model.eval()
    x, y = _data(10)[:]
    with torch.no_grad():
        expected = model.net(x)
    for rank in [*three, one[0]]:
        # Every validation sample once, in order, on every rank, with uneven and zero shares.
        torch.testing.assert_close(rank[0]["gathered"]["pred"], expected, **EXACT)
        assert "indices" not in rank[0]["gathered"]  # the strategy's indices are not handed back
        # The logged loss is the global batches' mean, whatever the shares (3 batches of 4, 4, 2).
        assert rank[0]["val_loss"] == pytest.approx(F.mse_loss(expected, y).item(), rel=1e-12)


def _resume_rank(rank: int, world_size: int, checkpoint: str, resume: bool, chunk_sizes: list[int]) -> Any:
    model = Regressor()
    strategy = BalancedDDPStrategy(chunk_sizes=chunk_sizes)
    trainer = quiet_trainer(strategy, world_size, max_epochs=2 if resume else 1)
    trainer.fit(model, DataLoader(_data(), batch_size=8, shuffle=True), ckpt_path=checkpoint if resume else None)
    if not resume:
        trainer.save_checkpoint(checkpoint)
    return _state(model)


@pytest.mark.slow
def test_a_checkpoint_from_two_ranks_resumes_on_three_as_one_uninterrupted_process(tmp_path: Path) -> None:
    checkpoint = str(tmp_path / "two_ranks.ckpt")
    run_distributed(_resume_rank, 2, checkpoint, False, [5, 3], timeout_s=300)
    resumed = run_distributed(_resume_rank, 3, checkpoint, True, [2, 0, 6], timeout_s=300)
    reference, _ = _reference(6)  # two epochs of 3 global batches
    _assert_trained_as([{"state": state, "losses": []} for state in resumed], (reference, []))


def _auto_rank(rank: int, world_size: int) -> list[int]:
    model = Regressor(batchnorm=False, slow_rank=1)
    policy = AutoSplit(profile_steps=3, warmup_steps=1, drift_window=3)
    trainer = quiet_trainer(BalancedDDPStrategy(split=policy), world_size, max_steps=8)
    trainer.fit(model, DataLoader(_data(), batch_size=8, shuffle=True))
    return policy.plan(8, world_size)


@pytest.mark.slow
def test_auto_gives_the_slower_rank_the_smaller_share_on_every_rank_alike() -> None:
    plans = run_distributed(_auto_rank, 2, timeout_s=300)
    assert plans[0] == plans[1]  # planned from the gathered times: the same on every rank
    assert plans[0][0] > plans[0][1] > 0, plans


# ---- bad input: a named error on every rank, before any step ------------------------------------------------------
def _error_ranks(rank: int, world_size: int, cases: list[str]) -> list[str]:
    return [_error_rank(rank, world_size, case) for case in cases]  # one spawn of the ranks for every case


def _error_rank(rank: int, world_size: int, case: str) -> str:
    model = Regressor(batchnorm=case != "batchnorm")
    options: dict[str, Any] = {}
    loader: Any = DataLoader(_data(), batch_size=8)
    strategy = BalancedDDPStrategy(chunk_sizes=[1, 2, 5] if case == "length" else None)
    if case == "micro-batches":
        strategy = BalancedDDPStrategy(max_micro_batch=[4, 4, 4])
    if case == "micro-batches-batchnorm":
        strategy = BalancedDDPStrategy(max_micro_batch=2)
    if case == "batchnorm":
        strategy = BalancedDDPStrategy(sync_batchnorm=False)
        model = Regressor()
    if case == "shuffled":
        options["use_distributed_sampler"] = False
        loader = DataLoader(_data(), batch_size=8, shuffle=True)
    if case == "iterable":
        loader = DataLoader(_Stream(), batch_size=8)
    trainer = quiet_trainer(strategy, world_size, max_steps=1, **options)
    try:
        trainer.fit(model, loader)
    except Exception as error:
        return f"{type(error).__name__}: {error}"
    return "trained"


class _Stream(IterableDataset):  # type: ignore[type-arg]
    def __iter__(self) -> Any:
        return iter(_data())


@pytest.mark.slow
def test_bad_input_is_named_on_every_rank_before_a_step() -> None:
    cases = {
        "length": "ValueError: `chunk_sizes` needs one entry per device (2), got 3: [1, 2, 5]",
        "micro-batches": "ValueError: `max_micro_batch` needs one entry per rank (2), got 3: [4, 4, 4]",
        "micro-batches-batchnorm": (
            "ValueError: strategy='balanced_ddp' cannot run a share in micro-batches (`max_micro_batch`) with"
            " BatchNorm layers: BatchNorm normalizes over the samples of one forward pass, so the step would change"
            " (and the ranks' synchronized layers would meet a different number of times); drop `max_micro_batch`"
        ),
        "batchnorm": (
            "ValueError: strategy='balanced_ddp' with `sync_batchnorm=False` cannot give the step of one process on"
            " the global batch: BatchNorm layers (net.1) would normalize each rank's share on its own; keep"
            " `sync_batchnorm=True` (the default)"
        ),
        "shuffled": (
            "ValueError: strategy='balanced_ddp' needs the same global sample order on every rank, but the"
            " DataLoader's RandomSampler gives each rank its own (`use_distributed_sampler=False` keeps it): leave"
            " `use_distributed_sampler=True` (every rank then shuffles alike, seeded as Lightning seeds DDP), or give"
            " the sampler a `generator` seeded alike on every rank"
        ),
        "iterable": (
            "ValueError: strategy='balanced_ddp' splits each global batch by sample index, which an IterableDataset"
            " (_Stream) does not have: use a map-style Dataset (with `__getitem__` and `__len__`), or strategy='ddp'"
            " with a dataset that shards itself"
        ),
    }
    results = run_distributed(_error_ranks, 2, list(cases), timeout_s=300)
    for index, (case, message) in enumerate(cases.items()):
        assert [results[rank][index] for rank in range(2)] == [message] * 2, case


# ---- pure parts ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("world_size", "split"),
    [(1, EvenSplit()), (2, EvenSplit()), (5, EvenSplit()), (2, ChunkSizes([0, 3])), (5, ChunkSizes([0, 3, 1, 4, 2]))],
)
def test_the_ranks_shares_partition_every_global_batch(world_size: int, split: Any) -> None:
    from torch.utils.data import BatchSampler, SequentialSampler

    global_batches = BatchSampler(SequentialSampler(range(23)), batch_size=6, drop_last=False)
    samplers = [ShareBatchSampler(global_batches, split, rank, world_size) for rank in range(world_size)]
    yielded = [list(sampler) for sampler in samplers]
    assert all(len(sampler) == 4 for sampler in samplers)
    for batch_index, batch in enumerate(global_batches):
        shares = [sampler.pending[batch_index] for sampler in samplers]
        assert [i for share in shares for i in share.indices] == batch  # each sample once, in the global order
        for rank, share in enumerate(shares):
            assert share.global_size == len(batch) and share.chunk_sizes == shares[0].chunk_sizes
            # A zero share yields the batch's first index (the structure to collate), to be cut to 0 samples.
            assert yielded[rank][batch_index] == (share.indices or batch[:1])


def test_a_loader_the_strategy_cannot_split_is_named() -> None:
    with raises_exactly(
        ValueError,
        "strategy='balanced_ddp' splits the DataLoader's batches, but it has none (`batch_size=None`): give it a"
        " `batch_size`, the global batch size",
    ):
        share_loader(DataLoader(_data(), batch_size=None), EvenSplit(), 0, 2)
    with raises_exactly(
        ValueError,
        "strategy='balanced_ddp' splits each batch of a torch DataLoader over the ranks; got a list: return a"
        " `torch.utils.data.DataLoader` from the `*_dataloader` hooks",
    ):
        share_loader([1, 2], EvenSplit(), 0, 2)


def test_bad_arguments_name_what_was_expected() -> None:
    with raises_exactly(ValueError, "`loss_reduction` must be 'mean' or 'sum', got 'max'"):
        BalancedDDPStrategy(loss_reduction="max")  # type: ignore[arg-type]
    with raises_exactly(
        ValueError, "Give at most one of `gpu0_bsz`, `chunk_sizes` and `weights`, got chunk_sizes and weights"
    ):
        BalancedDDPStrategy(chunk_sizes=[1, 2], weights=[1.0, 2.0])
    with raises_exactly(ValueError, "`max_micro_batch[1]` must be >= 1, got 0"):
        BalancedDDPStrategy(max_micro_batch=[2, 0])
    with raises_exactly(TypeError, "`sync_batchnorm` must be a bool, got 'yes'"):
        BalancedDDPStrategy(sync_batchnorm="yes")  # type: ignore[arg-type]
    with raises_exactly(ValueError, "`max_micro_batch` must be an int >= 1, one per rank, 'auto' or None, got 'big'"):
        BalancedDDPStrategy(max_micro_batch="big")  # type: ignore[arg-type]


def test_a_measured_micro_batch_fills_ninety_percent_of_the_gpu_by_the_fitted_line() -> None:
    measured = MeasuredMicroBatch(capacity_bytes=10_000)
    assert measured.cap is None  # before the first step: the share runs whole
    measured.observe(8, 4_000)  # one size: conservatively 0 fixed + 500 per sample
    assert measured.cap == 18  # floor(9000 / 500)
    measured.observe(4, 2_400)  # two sizes: 800 fixed + 400 per sample
    assert measured.cap == 20  # floor((9000 - 800) / 400) = 20.5
    measured.observe(4, 9_500)  # a share that already overflows: at least 1 sample
    assert measured.cap == 1


def test_registered_names_and_launches() -> None:
    trainer = quiet_trainer("balanced_ddp_spawn", 2, max_steps=1)
    assert isinstance(trainer.strategy, BalancedDDPStrategy)
    assert trainer.strategy._start_method == "spawn"
    assert trainer.strategy.data_parallel_size == 1
    assert trainer.strategy.distributed_sampler_kwargs == {"num_replicas": 1, "rank": 0}


def test_a_policy_with_a_two_argument_observe_is_told_chunk_sizes_and_seconds_only() -> None:
    from lightning_balanced.split_policies.split_policy import observes_peak_bytes as _takes_peaks

    class TwoArguments(EvenSplit):  # a policy written for balanced_dp's devices
        def observe(self, chunk_sizes: list[int], seconds: list[float]) -> None:  # type: ignore[override]
            pass

    assert not _takes_peaks(TwoArguments())
    assert _takes_peaks(AutoSplit())
