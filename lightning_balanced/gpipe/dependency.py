"""Fork/join autograd edges: make backward of one lane wait for another, without moving data.

A *phony* is an empty tensor that only carries an autograd edge. :func:`fork` branches a phony off a tensor's lane;
:func:`join` makes another tensor depend on that phony. In backward, the forked lane's gradient is passed on only
after the joined lane's gradient has gone through the join.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["depend", "fork", "join", "phony"]


def phony(device: torch.device, requires_grad: bool = False) -> Tensor:
    """An empty float tensor on ``device``: an autograd edge with no data."""
    return torch.empty(0, device=device, requires_grad=requires_grad)


class _Fork(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input: Tensor) -> tuple[Tensor, Tensor]:
        return input.detach(), phony(input.device)

    @staticmethod
    def backward(ctx: Any, grad_input: Tensor, grad_phony: Tensor) -> Tensor:
        return grad_input


class _Join(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, input: Tensor, edge: Tensor) -> Tensor:
        return input.detach()

    @staticmethod
    def backward(ctx: Any, grad_input: Tensor) -> tuple[Tensor, None]:
        return grad_input, None


def fork(input: Tensor) -> tuple[Tensor, Tensor]:
    """Branch a phony off ``input``'s autograd lane.

    Returns:
        tuple[Tensor, Tensor]: ``input`` (same values, now behind the fork) and the phony. Backward through the fork
        waits until the phony's gradient has arrived, i.e. until every :func:`join` on it was passed in backward.
        Without grad mode or an input that requires grad, ``input`` is returned as is with a phony that has no edge.
    """
    if torch.is_grad_enabled() and input.requires_grad:
        forked, edge = _Fork.apply(input)
        return forked, edge
    return input, phony(input.device)


def join(input: Tensor, edge: Tensor) -> Tensor:
    """Make ``input``'s autograd lane depend on the phony ``edge`` (from :func:`fork`); values are unchanged."""
    if torch.is_grad_enabled() and (input.requires_grad or edge.requires_grad):
        joined: Tensor = _Join.apply(input, edge)
        return joined
    return input


def depend(fork_from: Tensor, join_to: Tensor) -> tuple[Tensor, Tensor]:
    """Order backward: ``fork_from``'s gradient is passed on only after ``join_to``'s gradient went through the join.

    Returns:
        tuple[Tensor, Tensor]: the new ``fork_from`` and ``join_to``, to be used in place of the old ones.

    Source: the ``fork``/``join`` dependencies of torchgpipe (Lee et al., 2020), which keep the backward pass of
    micro-batch ``i - 1`` on a partition behind that of micro-batch ``i``.
    """
    fork_from, edge = fork(fork_from)
    join_to = join(join_to, edge)
    return fork_from, join_to
