"""Random numbers in pipeline tasks: one seed per (micro-batch, partition), replayed by the recomputation.

Partitions on the same device share its default generator (on the CPU path every partition shares the CPU one), and
their tasks run on different threads at once. A task that draws random numbers (dropout in training) therefore runs
with the generator of its device seeded from ``(step seed, micro-batch, partition)`` and holds that generator's lock;
its masks depend only on the seed drawn from the global generator at the start of the forward pass, never on thread
timing, and the recomputation in backward replays them exactly. Tasks that draw no random numbers take no lock.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import torch
from torch.nn import Module, MultiheadAttention, RReLU
from torch.nn.modules.dropout import _DropoutNd

__all__ = ["draw_step_seed", "draws_random_numbers", "seeded", "task_seed"]

# One lock per process-wide default generator ("cpu", "cuda:0", ...): the generators are global, so are their locks.
_GENERATOR_LOCKS: dict[str, threading.Lock] = {}
_LOCKS_LOCK = threading.Lock()


def draws_random_numbers(module: Module) -> bool:
    """Whether ``module`` or a submodule draws random numbers in its current mode.

    True for dropout layers (``nn.Dropout*``, ``AlphaDropout``) with ``p > 0``, ``nn.RReLU`` and
    ``nn.MultiheadAttention`` with ``dropout > 0``, in training mode, and for any module with a truthy attribute
    ``draws_random_numbers`` (set it on custom layers that call ``torch.rand*`` or ``F.dropout`` themselves).
    """
    for m in module.modules():
        if getattr(m, "draws_random_numbers", False) is True:
            return True
        if not m.training:
            continue
        if isinstance(m, _DropoutNd) and m.p > 0:
            return True
        if isinstance(m, RReLU) or (isinstance(m, MultiheadAttention) and m.dropout > 0):
            return True
    return False


def draw_step_seed() -> int:
    """A seed for one forward pass, drawn from the global CPU generator (so ``seed_everything`` fixes it)."""
    return int(torch.randint(0, 2**62, (1,)).item())


def task_seed(step_seed: int, micro_batch: int, partition: int) -> int:
    """The seed of one task: distinct for every ``(micro_batch, partition)`` of a step."""
    return (step_seed + 1_000_003 * micro_batch + 7_919 * partition) % 2**63


def _generator(device: torch.device) -> tuple[str, torch.Generator]:
    if device.type == "cuda":
        index = torch.cuda.current_device() if device.index is None else device.index
        return f"cuda:{index}", torch.cuda.default_generators[index]
    if device.type == "cpu":
        return "cpu", torch.default_generator
    raise ValueError(f"no default generator is known for device {device}")


def _generators(device: torch.device) -> list[tuple[str, torch.Generator]]:
    """The default generators a task on ``device`` may draw from: the CPU one, then ``device``'s own.

    The CPU one always: a layer on a CUDA partition may draw there (``torch.rand(n).to(x.device)``, a random crop).
    """
    found = [("cpu", torch.default_generator)]
    key, generator = _generator(device)
    if key != "cpu":
        found.append((key, generator))
    return found


@contextmanager
def seeded(device: torch.device, seed: int) -> Iterator[None]:
    """Run with the CPU generator and ``device``'s seeded with ``seed``, exclusively; their states are restored after.

    Both, as torchgpipe saves and restores both: a layer on a CUDA partition that draws on the CPU generator gets the
    same numbers in the recomputation. Locks are taken in one order (the CPU generator's first), so tasks never
    deadlock; on CUDA they are held while the kernels are queued, not while they run.
    """
    with ExitStack() as stack:
        for key, generator in _generators(device):
            with _LOCKS_LOCK:
                lock = _GENERATOR_LOCKS.setdefault(key, threading.Lock())
            stack.enter_context(lock)
            stack.callback(generator.set_state, generator.get_state())
            generator.manual_seed(seed)
        yield
