"""The user's step as one configuration of ``gradckpt fit`` has it, read without running it:
its batch size, its sample cut to a micro-batch (and cast), its model copied to the meta
device, what dtype it trains in and whether it trains only a part, and the bytes its
parameters, gradients and optimizer state take (a lower bound on any plan's peak).
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from ..measure.training_state import (
    OPTIMIZER_STATE_BYTES_PER_PARAMETER,
    OPTIMIZER_STATES_PER_PARAMETER,
)
from .fit_options import Configuration


def _state_bytes(model: nn.Module, config: Configuration, optimizer: Any) -> int:
    """Parameters, gradients and optimizer state per GPU of ``config``: a lower bound on its
    peak (all of them are alive when ``optimizer.step()`` runs), counted from the model's
    shapes without estimating; under DDP, its buckets (a copy of every trainable gradient)
    too. Adapters are not counted (0: no bound)."""
    if config.adapters is not None:
        return 0
    name = optimizer.lower() if isinstance(optimizer, str) else ""
    states = {k.lower(): v for k, v in OPTIMIZER_STATES_PER_PARAMETER.items()}.get(name, 0)
    state_bytes = OPTIMIZER_STATE_BYTES_PER_PARAMETER.get(name)
    total = 0
    for parameter in {id(p): p for p in model.parameters()}.values():
        dtype = (config.dtype if config.dtype is not None and parameter.is_floating_point()
                 else parameter.dtype)
        size = parameter.numel() * dtype.itemsize
        total += size
        if parameter.requires_grad:
            total += size * (2 if config.ddp else 1) + (
                state_bytes * parameter.numel() if state_bytes is not None else states * size)
    return total // config.world_size


def _batch_size(sample: Any) -> int | None:
    """The leading size of the sample's first tensor of at least one dimension (its batch)."""
    for tensor in _tensors(sample):
        if tensor.dim() >= 1:
            return tensor.shape[0]
    return None


def _sliced(sample: Any, batch: int | None, dtype: torch.dtype | None = None) -> Any:
    """``sample`` as ``batch`` rows (every tensor whose leading size is the batch cut), its
    floating tensors in ``dtype`` where given: a step trained in bf16 is fed bf16 (``estimate``
    casts the model, not the sample).

    Example:
        >>> sliced = _sliced({"x": torch.ones(8, 3), "n": torch.ones(3)}, 2, torch.bfloat16)
        >>> {name: (tuple(t.shape), t.dtype) for name, t in sliced.items()}
        {'x': ((2, 3), torch.bfloat16), 'n': ((3,), torch.bfloat16)}
    """
    full = _batch_size(sample)

    def cut(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if batch is not None and full is not None and value.dim() >= 1 \
                and value.shape[0] == full:
            value = value[:batch]
        return value.to(dtype) if dtype is not None and value.is_floating_point() else value

    if isinstance(sample, dict):
        return {key: cut(value) for key, value in sample.items()}
    if isinstance(sample, tuple):
        return tuple(cut(value) for value in sample)
    return cut(sample)


def fed_in(sample: Any, dtype: torch.dtype | None) -> Any:
    """``sample`` as a step trained in ``dtype`` is fed: its floating tensors in ``dtype``
    (None: as it is). ``estimate(dtype=...)`` casts the model, not the sample; fed fp32, a
    bf16 model's fake step computed in fp32, as no real one can.

    Example:
        >>> fed_in(torch.ones(2), torch.bfloat16).dtype, fed_in(torch.ones(2, dtype=torch.long),
        ...                                                    torch.bfloat16).dtype
        (torch.bfloat16, torch.int64)
    """
    return _sliced(sample, None, dtype)


def _tensors(sample: Any) -> Iterator[torch.Tensor]:
    values = sample.values() if isinstance(sample, dict) else (
        sample if isinstance(sample, tuple) else (sample,))
    return (value for value in values if isinstance(value, torch.Tensor))


def _meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device: the same
    modules, shapes, dtypes and ``requires_grad``, no memory, ties kept."""
    memo: dict[int, Any] = {}
    for parameter in model.parameters():
        memo[id(parameter)] = nn.Parameter(torch.empty_like(parameter, device="meta"),
                                           requires_grad=parameter.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(model, memo)


def _floating_dtype(model: nn.Module) -> torch.dtype | None:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def _trains_a_part(model: nn.Module) -> bool:
    return any(not p.requires_grad for p in model.parameters())
