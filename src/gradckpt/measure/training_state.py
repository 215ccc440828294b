"""Memory a training step holds besides what the model's forward and backward allocate.

One forward and backward, starting with no gradients, is not all a training loop holds once it
has run a while:

- the optimizer's state (Adam's two moments per trainable parameter), created by the first
  ``optimizer.step()`` and alive from then on;
- with gradient accumulation, the gradients of the earlier micro-batches, alive from the start
  of each later forward pass. Counted here in full: the measured step allocates them during
  backward anyway, so this over-counts by what it held of them at its peak, never under.

``gradckpt.profile`` counts both in the step it measures (``Profile.fixed_bytes``); the
optimizer's state is measured there (``measure/optimizer_step.py``), and counted here only for
an optimizer that cannot be replicated on fake tensors (bitsandbytes' 8-bit ones).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from ..errors import UsageError, did_you_mean
from .tensors import tensor_bytes

__all__ = [
    "OPTIMIZER_STATES_PER_PARAMETER", "OPTIMIZER_STATE_BYTES_PER_PARAMETER",
    "accumulated_gradient_bytes", "optimizer_state_bytes",
]

# Tensors of a parameter's shape and dtype that each optimizer keeps per trainable parameter,
# by class name (torch.optim and the usual Hugging Face choices). Scalar step counters are left
# out: a few bytes per parameter tensor.
OPTIMIZER_STATES_PER_PARAMETER: dict[str, int] = {
    "Adam": 2, "AdamW": 2, "NAdam": 2, "RAdam": 2, "Adamax": 2, "Adagrad": 1,
    "SGD": 0, "Adadelta": 2, "Rprop": 2, "ASGD": 1, "LBFGS": 0,
    # Its square average; momentum > 0 adds a buffer, centered=True a gradient average (given
    # by name, the defaults are planned: pass the optimizer itself for the others).
    "RMSprop": 1,
}


# Optimizers whose state is not in the parameter's dtype: bytes per trainable parameter.
# bitsandbytes' 8-bit AdamW keeps both moments in one byte each (plus block-wise scales,
# under 1% more, left out).
OPTIMIZER_STATE_BYTES_PER_PARAMETER: dict[str, int] = {"adamw-8bit": 2, "adam-8bit": 2}


def _trainable(parameters: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    unique = {id(p): p for p in parameters if p.requires_grad}
    return list(unique.values())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer | str | None, model: nn.Module) -> int:
    """Bytes of state ``optimizer`` will keep for ``model``'s trainable parameters.

    ``optimizer`` is an optimizer instance, a class name from ``OPTIMIZER_STATES_PER_PARAMETER``
    (case-insensitive; ``"adam"`` and ``"adamw"`` alike), ``"adamw-8bit"`` (bitsandbytes) or
    ``None`` (no state). An instance
    counts the parameters it was given; SGD keeps one buffer only with momentum, RMSprop one
    more with momentum and another when centered. State already created (after a step) is
    counted as it is.

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(4, 4)  # 20 parameters, fp32
        >>> optimizer_state_bytes("adamw", layer), optimizer_state_bytes("adamw-8bit", layer)
        (160, 40)
        >>> optimizer_state_bytes(torch.optim.SGD(layer.parameters(), lr=0.1, momentum=0.9), layer)
        80
    """
    if optimizer is None:
        return 0
    if isinstance(optimizer, str):
        name = optimizer.lower()
        trainable = _trainable(model.parameters())
        if name in OPTIMIZER_STATE_BYTES_PER_PARAMETER:
            return OPTIMIZER_STATE_BYTES_PER_PARAMETER[name] * sum(p.numel() for p in trainable)
        by_lower_name = {name.lower(): n for name, n in OPTIMIZER_STATES_PER_PARAMETER.items()}
        if name not in by_lower_name:
            known = ", ".join(sorted([*by_lower_name, *OPTIMIZER_STATE_BYTES_PER_PARAMETER]))
            raise UsageError(f"unknown optimizer {optimizer!r}; known: {known}"
                             f"{did_you_mean(optimizer, known.split(', '))}")
        return by_lower_name[name] * sum(tensor_bytes(p) for p in trainable)
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UsageError(
            "optimizer must be a torch.optim.Optimizer, a name or None; got "
            f"{type(optimizer).__name__}"
        )
    total = 0
    for group in optimizer.param_groups:
        per_parameter = _states_per_parameter(optimizer, group)
        for parameter in _trainable(group["params"]):
            state = optimizer.state.get(parameter)
            if state:  # already created: count what is there
                total += sum(tensor_bytes(v) for v in state.values() if isinstance(v, torch.Tensor))
            else:
                total += per_parameter * tensor_bytes(parameter)
    return total


def _states_per_parameter(optimizer: torch.optim.Optimizer, group: dict) -> int:
    name = type(optimizer).__name__
    if name == "SGD":
        return 1 if group.get("momentum", 0) else 0
    if name == "RMSprop":
        return 1 + bool(group.get("momentum", 0)) + bool(group.get("centered", False))
    # Unknown optimizers (bitsandbytes' 8-bit ones, Adafactor) are counted as Adam: an upper
    # bound for most, documented in docs/integrations.md.
    return OPTIMIZER_STATES_PER_PARAMETER.get(name, 2)


def accumulated_gradient_bytes(model: nn.Module, accumulation_steps: int) -> int:
    """Bytes of the gradients earlier micro-batches leave alive, with ``accumulation_steps``
    micro-batches per optimizer step (none with one).

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(4, 4)
        >>> accumulated_gradient_bytes(layer, 1), accumulated_gradient_bytes(layer, 4)
        (0, 80)
    """
    if accumulation_steps <= 1:
        return 0
    return sum(tensor_bytes(p) for p in _trainable(model.parameters()))
