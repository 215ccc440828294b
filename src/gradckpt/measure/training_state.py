"""Memory a training step holds besides what the model's forward and backward allocate.

One forward and backward, starting with no gradients, is not all a training loop holds once it
has run a while:

- the optimizer's state (Adam's two moments per trainable parameter), created by the first
  ``optimizer.step()`` and alive from then on;
- with gradient accumulation, the gradients of the earlier micro-batches, alive from the start
  of each later forward pass. Counted here in full: the measured step allocates them during
  backward anyway, so this over-counts by what it held of them at its peak, never under;
- under ``DistributedDataParallel`` (``ddp=True``), its buckets: flat buffers, one per dtype
  and device up to ``bucket_cap_mb`` each, that DDP allocates when it wraps the model and keeps
  for the whole run, together as large as the trainable parameters. With the default
  ``gradient_as_bucket_view=False`` they hold a copy of every gradient, beside the gradients
  themselves.

``gradckpt.profile`` counts them all in the step it measures (``Profile.fixed_bytes``); the
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
    "accumulated_gradient_bytes", "check_ddp", "ddp_bucket_bytes", "optimizer_state_bytes",
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
    return _trainable_bytes(model)


def check_ddp(ddp: object) -> bool:
    """``ddp`` as given, when it is a bool; otherwise ``UsageError`` (a process group or a
    DDP object is not what it asks).

    Example:
        >>> check_ddp(True)
        True
        >>> check_ddp("yes")
        Traceback (most recent call last):
        ...
        gradckpt.errors.UsageError: ddp must be True (the model trains wrapped in ...
    """
    if not isinstance(ddp, bool):
        raise UsageError(
            f"ddp must be True (the model trains wrapped in DistributedDataParallel, whose "
            f"buckets hold a copy of the trainable gradients all run) or False (the default); "
            f"got {ddp!r}"
        )
    return ddp


def ddp_bucket_bytes(model: nn.Module, ddp: bool) -> int:
    """Bytes of ``DistributedDataParallel``'s buckets for ``model`` when it trains wrapped in
    one (``ddp=True``; none otherwise): the trainable parameters' bytes, each in its dtype.

    DDP's reducer lays every parameter that requires grad into a flat bucket of its dtype and
    device, at its number of elements, when it wraps the model (laid out again in the order
    gradients come after the first step, the same size), and keeps the buckets until it is
    freed. With ``gradient_as_bucket_view=False`` (the default, and
    what the Hugging Face Trainer builds) they are a copy of the gradients that backward
    copies in and all-reduces. With ``True`` they are alive all run too, and after
    ``zero_grad(set_to_none=True)`` backward still makes each gradient before DDP copies it in
    and points the gradient at its bucket: a rank of the Llama in
    ``tests/integrations/test_integrations_ddp.py`` measured the same peak either way, to the
    byte. A model already wrapped needs no count: its buckets are measured with its step.

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(4, 4)  # 20 parameters, fp32
        >>> ddp_bucket_bytes(layer, True), ddp_bucket_bytes(layer, False)
        (80, 0)
    """
    if not ddp or isinstance(model, nn.parallel.DistributedDataParallel):
        # Wrapped already: the buckets exist, and the step measured through the wrapper counts
        # each from backward's first copy into it, as it counts the loop's later steps.
        return 0
    return _trainable_bytes(model)


def _trainable_bytes(model: nn.Module) -> int:
    """The trainable parameters' bytes, each in its dtype: as large as their gradients."""
    return sum(tensor_bytes(p) for p in _trainable(model.parameters()))
