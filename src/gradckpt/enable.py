"""The one-liner: measure the model, solve for the budget, apply the plan.

``enable(model, sample, budget="6GiB")`` is ``profile`` → ``solve`` → ``apply``; it returns the
plan, whose ``str`` and ``predicted_peak_bytes`` say what the step will cost before it runs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .apply import apply
from .budget import format_bytes, parse_budget
from .errors import BudgetError
from .measure import infer_device, profile
from .plan import Plan
from .profile_types import Profile
from .ranks import agreed_on_every_rank
from .solvers import solve
from .solvers.infeasible import budget_message

__all__ = ["enable", "solve_reserving"]


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
    plan = solve_reserving(measured, budget, strategy, device=infer_device(model))
    apply(model, plan)
    return plan


def solve_reserving(
    measured: Profile,
    budget: int | str | None,
    strategy: str = "optimal",
    *,
    reserved_bytes: int = 0,
    reserved_for: str = "memory held outside the step",
    device: torch.device | str | None = None,
) -> Plan:
    """Solve for ``budget`` when the step also holds ``reserved_bytes`` all along (an
    optimizer's state, accumulated gradients: ``gradckpt.reserved``), which the profile's
    step did not.

    ``budget`` is for everything, as the user compares it with the GPU; the solver gets it less
    ``reserved_bytes``, and the plan's predicted peak and budget include them again. A
    percentage is of the peak without checkpointing, the reserved memory included. A budget
    too small says the smallest that works, ``reserved_for`` naming what was added.

    Under ``torch.distributed`` with several ranks, rank 0 solves and every rank gets its plan
    (or its error): one plan for all ranks (``gradckpt.ranks``).

    Example:
        >>> from gradckpt.profile_types import BlockProfile
        >>> from gradckpt.cli.sqrt_table import homogeneous_chain
        >>> chain = homogeneous_chain(BlockProfile("b", 10, 10, 50, True, 1.0, 2.0), 16)
        >>> plan = solve_reserving(chain, "80%", reserved_bytes=200, reserved_for="Adam's state")
        >>> plan.predicted_peak_bytes <= plan.budget_bytes == int(0.8 * (chain.peak_bytes + 200))
        True
        >>> solve_reserving(chain, "100B", reserved_bytes=200, reserved_for="Adam's state")
        Traceback (most recent call last):
        ...
        gradckpt.errors.BudgetError: budget 100 B does not even hold Adam's state, 200 B; ...
    """
    return agreed_on_every_rank(lambda: _solve_reserving(
        measured, budget, strategy, reserved_bytes, reserved_for, device))


def _solve_reserving(
    measured: Profile, budget: int | str | None, strategy: str, reserved_bytes: int,
    reserved_for: str, device: torch.device | str | None,
) -> Plan:
    if budget is None:
        return solve(measured, None, strategy)
    budget_bytes = parse_budget(
        budget, unconstrained_peak_bytes=measured.peak_bytes + reserved_bytes, device=device
    )
    if not reserved_bytes:
        return solve(measured, budget_bytes, strategy)
    if budget_bytes <= reserved_bytes:
        raise BudgetError(
            f"budget {format_bytes(budget_bytes)} does not even hold {reserved_for}, "
            f"{format_bytes(reserved_bytes)}; raise the budget",
            minimum_bytes=reserved_bytes + 1,
            profile=measured,
        )
    try:
        plan = solve(measured, budget_bytes - reserved_bytes, strategy)
    except BudgetError as error:
        minimum = error.minimum_bytes + reserved_bytes
        # The solver's least plan is the least here too: the reserved memory only adds to it.
        explanation = f"{error.explanation} {reserved_for} comes on top of that peak."
        raise BudgetError(
            budget_message(
                f"budget {format_bytes(budget_bytes)} is below the smallest peak {strategy} "
                f"reaches with {reserved_for} ({format_bytes(reserved_bytes)}) counted, "
                f"{format_bytes(minimum)}; raise the budget to at least that.", explanation),
            minimum_bytes=minimum,
            profile=measured,
            explanation=explanation,
        ) from None
    return dataclasses.replace(
        plan,
        budget_bytes=budget_bytes,
        predicted_peak_bytes=plan.predicted_peak_bytes + reserved_bytes,
    )
