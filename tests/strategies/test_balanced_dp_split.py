"""balanced_dp's `split=`: a policy object, its shorthands, and a policy that learns from the steps and re-plans."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader

from lightning_balanced import BalancedDataParallelStrategy, ChunkSizes, EvenSplit, Gpu0Budget, SplitPolicy, Weights
from tests.helpers import raises_exactly
from tests.strategies.test_balanced_dp import Regressor, _data, _trainer

SHORTHAND_AND_POLICY = [
    ({}, EvenSplit()),
    ({"gpu0_bsz": 3}, Gpu0Budget(3)),
    ({"chunk_sizes": [2, 4, 6]}, ChunkSizes([2, 4, 6])),
    ({"weights": [0.5, 2.0, 1.0]}, Weights([0.5, 2.0, 1.0])),
]


@pytest.mark.parametrize(("shorthand", "policy"), SHORTHAND_AND_POLICY, ids=lambda v: repr(v))
def test_a_policy_object_plans_as_its_shorthand(shorthand: dict[str, Any], policy: SplitPolicy) -> None:
    by_object, by_shorthand = BalancedDataParallelStrategy(split=policy), BalancedDataParallelStrategy(**shorthand)
    assert by_object.split is policy
    assert type(by_shorthand.split) is type(policy)
    for strategy in (by_object, by_shorthand):
        strategy.parallel_devices = [torch.device("cpu")] * 3
    for batch_size in range(30):
        assert by_object.plan(batch_size) == by_shorthand.plan(batch_size)
    for name in ("gpu0_bsz", "chunk_sizes", "weights"):  # the settings stay readable under their old names
        assert getattr(by_object, name) == getattr(by_shorthand, name) == shorthand.get(name), name


def test_the_default_is_the_even_split() -> None:
    assert repr(BalancedDataParallelStrategy().split) == "EvenSplit()"


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (
            {"split": Gpu0Budget(14), "gpu0_bsz": 14},
            "`split` and `gpu0_bsz` cannot be given together: `gpu0_bsz=14` is short for `split=Gpu0Budget(14)`; give"
            " one of them",
        ),
        (
            {"split": EvenSplit(), "chunk_sizes": [4, 14, 14]},
            "`split` and `chunk_sizes` cannot be given together: `chunk_sizes=[4, 14, 14]` is short for"
            " `split=ChunkSizes([4, 14, 14])`; give one of them",
        ),
        (
            {"split": Weights([1, 1]), "weights": [24, 12]},
            "`split` and `weights` cannot be given together: `weights=[24, 12]` is short for"
            " `split=Weights([24, 12])`; give one of them",
        ),
    ],
)
def test_split_with_a_shorthand_raises_naming_both(kwargs: dict[str, Any], message: str) -> None:
    with raises_exactly(ValueError, message):
        BalancedDataParallelStrategy(**kwargs)


def test_split_must_be_a_policy() -> None:
    message = (
        "`split` must be a SplitPolicy (EvenSplit(), Gpu0Budget(...), ChunkSizes([...]), Weights([...]) or a subclass"
        " of your own), got 14 of type int"
    )
    with raises_exactly(TypeError, message):
        BalancedDataParallelStrategy(split=14)  # type: ignore[arg-type]


def test_the_first_positional_argument_is_still_gpu0_bsz() -> None:
    """`split` came after the shorthands, so 0.1's `BalancedDataParallelStrategy(14)` keeps its meaning."""
    assert BalancedDataParallelStrategy(14).split.plan(32, 2) == BalancedDataParallelStrategy(
        split=Gpu0Budget(14)
    ).split.plan(32, 2)


def test_setup_checks_a_policy_object_against_the_device_count() -> None:
    loader = DataLoader(_data(6), batch_size=6)
    with raises_exactly(ValueError, "`weights` needs one entry per device (3), got 2: [1.0, 1.0]"):
        _trainer(BalancedDataParallelStrategy(split=Weights([1, 1])), max_steps=1).fit(Regressor(), loader)


# --- a policy that learns: observe() after each training step, plan() before every step ------------------------------


class _Learner(SplitPolicy):
    """Plans [0, 2, 4] until it has observed a step, then gives each device a share inverse to its time per sample."""

    def __init__(self) -> None:
        self.observed: list[tuple[list[int], list[float]]] = []
        self.planned_on: list[str] = []

    def _plan(self, batch_size: int, num_devices: int) -> list[int]:
        self.planned_on.append(threading.current_thread().name)
        if not self.observed:
            return [0, 2, 4] if batch_size == 6 else [batch_size, 0, 0]
        return [2, 2, 2] if batch_size == 6 else [batch_size, 0, 0]

    def observe(self, chunk_sizes: list[int], seconds: list[float]) -> None:
        self.observed.append((chunk_sizes, seconds))

    def __repr__(self) -> str:
        return "_Learner()"


class _SlowPerSample(Regressor):
    """Each training step sleeps 20 ms per sample of its chunk, so the observed times follow the chunk sizes."""

    def __init__(self) -> None:
        super().__init__(lr=0.0)
        self.chunks: list[list[int]] = []
        self._lock = threading.Lock()

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        time.sleep(0.02 * len(batch[0]))
        with self._lock:
            while len(self.chunks) <= batch_idx:
                self.chunks.append([])
            self.chunks[batch_idx].append(len(batch[0]))
        return super().training_step(batch, batch_idx)


def test_a_learning_policy_observes_each_training_step_and_re_plans() -> None:
    policy, model = _Learner(), _SlowPerSample()
    trainer = _trainer(BalancedDataParallelStrategy(split=policy), max_steps=2, limit_val_batches=1)
    trainer.fit(model, DataLoader(_data(12), batch_size=6), DataLoader(_data(6), batch_size=6))
    # The first step ran as planned before any observation, the second with the plan learned from the first.
    assert [sorted(chunks) for chunks in model.chunks] == [[2, 4], [2, 2, 2]]
    # One observation per training step (none for the validation steps), one entry per device, a device left out
    # at 0.0 seconds; the times follow the chunk sizes (20 ms per sample).
    assert [sizes for sizes, _ in policy.observed] == [[0, 2, 4], [2, 2, 2]]
    (_, first), (_, second) = policy.observed
    assert first[0] == 0.0
    assert 0.04 <= first[1] < first[2] and first[2] >= 0.08
    assert all(s >= 0.04 for s in second)
    assert set(policy.planned_on) == {threading.main_thread().name}


def test_a_policy_that_does_not_observe_has_no_timer() -> None:
    strategy = BalancedDataParallelStrategy(split=Gpu0Budget(1))
    assert not strategy._split_observes
    assert BalancedDataParallelStrategy(split=_Learner())._split_observes
