"""The leaves a block's forward makes: tensors created with ``requires_grad_()`` inside it.

Such a leaf is no parameter, yet the graph holds it, and backward gives it a gradient that stays
to the step's end, as a parameter's does (MRA's attention without its CUDA kernel returns
``torch.zeros_like(query).requires_grad_()``). ``one_block`` counts those gradients in the
block's ``gradient_bytes``.

Example:
    >>> import torch
    >>> weight = torch.nn.Parameter(torch.ones(3))  # a parameter: not one it made
    >>> since = graph_position()
    >>> made = torch.zeros(3).requires_grad_()
    >>> output = (weight * 2 + made).sum()
    >>> [leaf is made for leaf in leaves_made(output, since, excluded=set())]
    [True]
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..engine import storage_key
from .clock import BOOKKEEPING

__all__ = ["graph_position", "leaves_made"]


def graph_position() -> int:
    """The sequence number the next autograd node made in this thread will exceed: nodes
    made after this call have a higher one."""
    with BOOKKEEPING, torch.enable_grad():
        return torch.zeros((), requires_grad=True).expand(1).grad_fn._sequence_nr()


def leaves_made(output: torch.Tensor, since: int, excluded: set) -> list[torch.Tensor]:
    """The leaf tensors needing a gradient that the graph of ``output`` made after ``since``
    (``graph_position``) reaches, less parameters and those whose storage is in ``excluded``
    (its own parameters and buffers, its arguments): tensors a block's forward creates with
    ``requires_grad_()`` (MRA's attention without its CUDA kernel returns
    ``torch.zeros_like(query).requires_grad_()``). The graph holds each until it is freed, and
    backward gives each a gradient that stays as long: the step's end, like a parameter's."""
    leaves: dict[int, torch.Tensor] = {}
    seen: dict[int, Any] = {}  # holding each node, so that no two share an id
    stack = [output.grad_fn] if output.grad_fn is not None else []
    while stack:
        node = stack.pop()
        for following, _ in node.next_functions:
            if following is None or id(following) in seen:
                continue
            seen[id(following)] = following
            variable = getattr(following, "variable", None)
            if variable is not None:  # an AccumulateGrad: a leaf
                # Another module's parameter (a weight shared with the block) is no leaf it made.
                if (not isinstance(variable, nn.Parameter)
                        and storage_key(variable) not in excluded):
                    leaves[id(variable)] = variable
            elif following._sequence_nr() > since:  # made by this forward
                stack.append(following)
    return list(leaves.values())
