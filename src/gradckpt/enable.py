"""The one-liner: measure the model, solve for the budget, apply the plan.

``enable(model, sample, budget="6GiB")`` is ``profile`` → ``solve`` → ``apply``; it returns the
plan, whose ``str`` and ``predicted_peak_bytes`` say what the step will cost before it runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .apply import apply
from .budget import parse_budget
from .measure import infer_device, profile
from .plan import Plan
from .solvers import solve

__all__ = ["enable"]


def enable(
    model: nn.Module,
    sample: Any,
    budget: int | str = "auto",
    strategy: str = "optimal",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    blocks: Any = None,
    *,
    keep_output: bool = True,
) -> Plan:
    """Checkpoint ``model`` so that a training step on batches like ``sample`` fits ``budget``.

    ``budget`` is the step's peak memory on the model's device: bytes, ``"6GiB"``, ``"60%"``
    (of the peak without checkpointing) or ``"auto"`` (what the device has free). When the
    model fits without checkpointing, the plan is empty and the model runs exactly as before.
    A budget no plan meets raises ``gradckpt.BudgetError`` stating the smallest one that works.
    The step is the one users write, the model's output held until backward ends; pass
    ``keep_output=False`` for loops that drop it first (the Hugging Face Trainer).

    Example:
        >>> import torch, gradckpt
        >>> from gradckpt.models import GPTConfig, TinyGPT
        >>> model = TinyGPT(GPTConfig(n_layer=4, n_embd=32, n_head=2, block_size=16))
        >>> idx = torch.randint(0, 512, (2, 16))
        >>> plan = gradckpt.enable(model, {"idx": idx, "targets": idx}, budget="85%")
        >>> plan.predicted_peak_bytes <= plan.budget_bytes
        True
        >>> gradckpt.disable(model)
    """
    measured = profile(model, sample, loss_fn=loss_fn, blocks=blocks, keep_output=keep_output)
    budget_bytes = parse_budget(
        budget, unconstrained_peak_bytes=measured.peak_bytes, device=infer_device(model)
    )
    plan = solve(measured, budget_bytes, strategy)
    apply(model, plan)
    return plan
