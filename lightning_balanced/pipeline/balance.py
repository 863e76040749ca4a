"""Choosing the balance (layers per partition): even by layer count, or from per-layer costs, measured or counted.

``split_costs`` is the pure part: contiguous partitions that minimize the largest partition cost. The cost of a
layer is its parameter count (deterministic), its forward+backward time on a sample micro-batch, or, on CUDA, the
memory its forward pass keeps for backward plus its parameters and their gradients. :func:`choose_balance` picks the
cost by name (``"auto"``: memory on CUDA, time elsewhere) and falls back to parameter counts when ``"auto"`` cannot
measure; :func:`even_balance` needs no cost at all.
"""

from __future__ import annotations

import itertools
import statistics
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any, Literal

import torch
from torch.nn import Module

from lightning_balanced.pipeline.batchnorm import DeferredBatchNorm
from lightning_balanced.pipeline.microbatch import flatten

__all__ = [
    "BALANCE_CHOICES",
    "BalanceChoice",
    "BalanceMethod",
    "balance_argument",
    "balance_by_parameters",
    "balance_by_time",
    "choose_balance",
    "even_balance",
    "layer_memory",
    "layer_parameters",
    "layer_times",
    "split_costs",
    "validate_balance",
]

BalanceMethod = Literal["time", "memory", "parameters"]
#: A balance asked for by name: a cost (:data:`BalanceMethod`), or ``"auto"`` (memory on CUDA, time elsewhere).
BalanceChoice = Literal["auto", "time", "memory", "parameters"]
BALANCE_CHOICES: tuple[BalanceChoice, ...] = ("auto", "time", "memory", "parameters")


def balance_argument(balance: object) -> list[int] | BalanceChoice | None:
    """A strategy's ``balance`` checked: ``None``, a list of positive ints, or a name in :data:`BALANCE_CHOICES`.

    Raises:
        ValueError: an unknown name, or a list entry below 1.
        TypeError: neither a name nor a sequence of ints.
    """
    if isinstance(balance, str):
        if balance not in BALANCE_CHOICES:
            raise ValueError(
                f"`balance` must be a list of ints, None or one of {list(BALANCE_CHOICES)}, got {balance!r}"
            )
        return balance
    return None if balance is None else validate_balance(balance)


def validate_balance(balance: object, num_layers: int | None = None, num_devices: int | None = None) -> list[int]:
    """``balance`` as a list of positive ints, checked against the layers and devices when given.

    With ``num_layers`` it must sum to the number of layers; with ``num_devices`` it must not be longer.

    Raises:
        TypeError: ``balance`` is not a sequence of ints.
        ValueError: an entry below 1, a sum other than ``num_layers``, more partitions than ``num_devices``.
    """
    if isinstance(balance, (str, bytes)) or not isinstance(balance, Sequence):
        raise TypeError(f"`balance` must be a list of ints (layers per partition), got {balance!r}")
    if any(isinstance(b, bool) or not isinstance(b, int) for b in balance):
        raise TypeError(f"`balance` must be a list of ints (layers per partition), got {list(balance)}")
    if not balance or any(b < 1 for b in balance):
        raise ValueError(f"`balance` must hold at least one partition of at least 1 layer each, got {list(balance)}")
    if num_layers is not None and sum(balance) != num_layers:
        raise ValueError(
            f"`balance` {list(balance)} covers {sum(balance)} layers, but the nn.Sequential has {num_layers} layers"
        )
    if num_devices is not None and len(balance) > num_devices:
        raise ValueError(
            f"`balance` {list(balance)} has {len(balance)} partitions but there are only {num_devices} devices"
            " (one partition per device): use fewer partitions or more devices"
        )
    return list(balance)


def even_balance(num_layers: int, partitions: int) -> list[int]:
    """One partition per device, each of ``num_layers // partitions`` layers or one more (the larger ones first).

    The balance for ``balance=None``: it needs neither a sample nor a measurement.

    Args:
        num_layers (int): the layers of the ``nn.Sequential``.
        partitions (int): the number of partitions (one per device), at least 1.

    Returns:
        list[int]: ``partitions`` positive counts summing to ``num_layers``.

    Raises:
        ValueError: fewer layers than partitions (a partition would be empty).
    """
    if num_layers < partitions:
        raise ValueError(
            f"`balance`=None puts one partition on each of the {partitions} devices, but the nn.Sequential has only"
            f" {num_layers} layers: give a `balance` with at most {num_layers} partitions, or use fewer devices"
        )
    base, extra = divmod(num_layers, partitions)
    return [base + 1] * extra + [base] * (partitions - extra)


def split_costs(costs: Sequence[float], partitions: int) -> list[int]:
    """Cut ``costs`` into ``partitions`` non-empty contiguous runs that minimize the largest run's sum.

    Exact for the largest run (dynamic programming, ``O(partitions * len(costs)^2)``); among cuts with the same largest
    run, the one with the smaller sum of squared run costs (the more even one), then the earliest cut, so the result is
    deterministic.

    Args:
        costs (Sequence[float]): a non-negative cost per layer.
        partitions (int): between 1 and ``len(costs)``.

    Returns:
        list[int]: the number of layers per partition (the balance), summing to ``len(costs)``.

    Raises:
        ValueError: ``partitions`` out of range, or a negative or non-finite cost.
    """
    n = len(costs)
    if not 1 <= partitions <= n:
        raise ValueError(f"`partitions` must be between 1 and the number of layers ({n}), got {partitions}")
    if any(not (c >= 0 and c != float("inf")) for c in costs):
        raise ValueError(f"costs must be non-negative and finite, got {list(costs)}")
    prefix = [0.0]
    for c in costs:
        prefix.append(prefix[-1] + float(c))
    inf = (float("inf"), float("inf"))
    # best[p][i]: the (largest run, sum of squared runs) of the first i layers cut into p runs, compared in that
    # order; cut[p][i]: where run p starts.
    best = [[inf] * (n + 1) for _ in range(partitions + 1)]
    cut = [[0] * (n + 1) for _ in range(partitions + 1)]
    best[0][0] = (0.0, 0.0)
    for p in range(1, partitions + 1):
        for i in range(p, n - (partitions - p) + 1):
            for k in range(p - 1, i):
                run = prefix[i] - prefix[k]
                value = (max(best[p - 1][k][0], run), best[p - 1][k][1] + run * run)
                if value < best[p][i]:
                    best[p][i], cut[p][i] = value, k
    balance = []
    i = n
    for p in range(partitions, 0, -1):
        k = cut[p][i]
        balance.append(i - k)
        i = k
    return balance[::-1]


def layer_parameters(layers: Sequence[Module]) -> list[float]:
    """Parameter count of each layer, plus one so that layers without parameters still weigh.

    A parameter shared by several layers is counted once, where first seen.
    """
    seen: set[int] = set()
    costs = []
    for layer in layers:
        count = 0
        for p in layer.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                count += p.numel()
        costs.append(float(count + 1))
    return costs


def balance_by_parameters(layers: Sequence[Module], partitions: int) -> list[int]:
    """The balance that evens out parameter counts: deterministic, needs no sample."""
    return split_costs(layer_parameters(layers), partitions)


@contextmanager
def _side_effect_free(layers: Sequence[Module], device: torch.device) -> Iterator[None]:
    """Profile without leaving a trace: random generators, buffers (BatchNorm statistics) and gradients restored."""
    params = [p for layer in layers for p in layer.parameters()]
    grads = [p.grad for p in params]
    for p in params:
        p.grad = None  # backward would accumulate into the existing gradient tensors
    # By owner and name: a layer measured on another device comes back with new buffer tensors.
    buffers = [
        (module, name, buffer.detach().clone())
        for layer in layers
        for module in layer.modules()
        for name, buffer in module._buffers.items()
        if buffer is not None
    ]
    devices = []
    if device.type == "cuda":
        devices = [torch.cuda.current_device() if device.index is None else device.index]
    with ExitStack() as stack:
        stack.enter_context(torch.random.fork_rng(devices=devices))
        stack.enter_context(torch.inference_mode(False))
        stack.enter_context(torch.enable_grad())
        try:
            yield
        finally:
            with torch.no_grad():
                for module, name, copy in buffers:
                    current = module._buffers[name]
                    if current is not None:
                        current.copy_(copy)
            for p, g in zip(params, grads, strict=True):
                p.grad = g
            for layer in layers:
                for m in layer.modules():
                    if isinstance(m, DeferredBatchNorm):
                        m.reset_accumulator()


def _leaf(value: Any) -> Any:
    tensors, rebuild = flatten(value)
    return rebuild([t.detach().clone().requires_grad_(t.is_floating_point()) for t in tensors])


def _backward(output: Any) -> None:
    tensors = [t for t in flatten(output)[0] if t.requires_grad]
    if tensors:
        torch.autograd.backward(tensors, [torch.ones_like(t) for t in tensors])


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def _visiting(layer: Module, device: torch.device) -> Iterator[None]:
    """``layer`` on ``device`` for a measurement, then back where it was: one layer at a time, never the model whole."""
    home = next(itertools.chain(layer.parameters(), layer.buffers()), None)
    layer.to(device)
    try:
        yield
    finally:
        if home is not None:
            layer.to(home.device)


def layer_times(layers: Sequence[Module], sample: Any, device: torch.device, repeats: int = 3) -> list[float]:
    """Forward+backward seconds of each layer on ``sample`` (the input of the first layer), on ``device``.

    Each layer in turn is moved to ``device`` (and back afterwards, so the model never sits there whole) and runs on
    the previous layer's output ``repeats + 1`` times; the first run warms up and its cost is the median of the
    others. Gradients, buffers and random generators are left as they were.
    """
    times: list[float] = []
    with _side_effect_free(layers, device):
        value = sample
        for layer in layers:
            runs = []
            with _visiting(layer, device):
                for _ in range(repeats + 1):
                    leaf = _leaf(value)
                    _synchronize(device)
                    start = time.perf_counter()
                    output = layer(leaf)
                    _backward(output)
                    _synchronize(device)
                    runs.append(time.perf_counter() - start)
            times.append(statistics.median(runs[1:]))
            value = flatten(output)[1]([t.detach() for t in flatten(output)[0]])
    return times


def balance_by_time(layers: Sequence[Module], sample: Any, partitions: int, device: torch.device) -> list[int]:
    """The balance that evens out measured forward+backward time per partition (:func:`layer_times`)."""
    return split_costs(layer_times(layers, sample, device), partitions)


def layer_memory(layers: Sequence[Module], sample: Any, device: torch.device, param_scale: float = 2.0) -> list[float]:
    """Bytes each layer needs on CUDA ``device``.

    That is what its forward pass on ``sample`` keeps for backward (its output and saved activations), plus
    ``param_scale`` times its parameter bytes (2: parameters and gradients).
    """
    if device.type != "cuda":
        raise ValueError(f"memory per layer is measured on CUDA devices only, got {device}")
    costs = []
    with _side_effect_free(layers, device):
        value = sample
        for layer in layers:
            with _visiting(layer, device):  # one layer at a time on the device, as layer_times does
                value = _leaf(value)
                torch.cuda.synchronize(device)
                before = torch.cuda.memory_allocated(device)
                output = layer(value)
                torch.cuda.synchronize(device)
                kept = torch.cuda.memory_allocated(device) - before
                params = sum(p.numel() * p.element_size() for p in layer.parameters())
                costs.append(float(max(kept, 0) + param_scale * params))
                value = flatten(output)[1]([t.detach() for t in flatten(output)[0]])
                del output
    return costs


def choose_balance(
    layers: Sequence[Module], sample: Any, partitions: int, device: torch.device, choice: BalanceChoice
) -> tuple[list[int], str]:
    """The balance of ``layers`` over ``partitions`` by the cost ``choice`` names, and how it was chosen.

    ``"time"`` (:func:`layer_times`), ``"memory"`` (:func:`layer_memory`, CUDA only) and ``"parameters"``
    (:func:`layer_parameters`) are that cost; ``"auto"`` is ``"memory"`` on a CUDA ``device`` and ``"time"``
    elsewhere, and falls back to parameter counts when the measurement fails (a ``RuntimeError`` such as out of
    memory, or a ``ValueError``; every layer measuring 0 counts as a failure).

    Args:
        layers (Sequence[Module]): the layers of the ``nn.Sequential``, in order.
        sample (Any): the input of the first layer (a micro-batch), for the measured costs.
        partitions (int): between 1 and ``len(layers)``.
        device (torch.device): where the layers are measured (one at a time).
        choice (str): one of :data:`BALANCE_CHOICES`.

    Returns:
        tuple[list[int], str]: the balance (:func:`split_costs`) and the cost it evened out: ``"time"``,
        ``"memory"``, ``"parameters"``, or ``"parameters (measuring <cost> failed: <error>)"`` after a fallback.

    Raises:
        RuntimeError, ValueError: the measurement of an explicitly named cost failed (no fallback but for ``"auto"``).
    """
    auto: BalanceMethod = "memory" if device.type == "cuda" else "time"
    method: BalanceMethod = auto if choice == "auto" else choice
    try:
        if method == "memory":
            costs = layer_memory(layers, sample, device)
        elif method == "time":
            costs = layer_times(layers, sample, device)
        else:
            costs = layer_parameters(layers)
        if not any(costs):
            raise ValueError("every layer measured 0")
        return split_costs(costs, partitions), method
    except (RuntimeError, ValueError) as err:
        if choice != "auto" and method != "parameters":
            raise
        return balance_by_parameters(layers, partitions), f"parameters (measuring {method} failed: {err})"
