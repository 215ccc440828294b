"""``gradckpt plan --optimizer adam``: the optimizer's state, alive all step, counted in the
peak and taken out of the budget before solving."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from gradckpt.plan import Plan
    from gradckpt.profile_types import Profile

__all__ = ["optimizer_state_bytes", "solve_with_optimizer"]


def optimizer_state_bytes(model: nn.Module, optimizer: str) -> int:
    """Adam keeps two fp32 values (moments) per trainable parameter; other choices nothing.

    Example:
        >>> import torch
        >>> optimizer_state_bytes(torch.nn.Linear(4, 4), "adam"), 8 * (16 + 4)
        (160, 160)
        >>> optimizer_state_bytes(torch.nn.Linear(4, 4), "none")
        0
    """
    if optimizer != "adam":
        return 0
    return sum(8 * p.numel() for p in model.parameters() if p.requires_grad)


def solve_with_optimizer(
    profile: Profile, budget: str | None, strategy: str, optimizer_bytes: int
) -> Plan:
    """Solve with the optimizer's state taken out of the budget (it is alive all step).

    A percentage is of the peak without checkpointing, the optimizer's state included.

    Example:
        >>> from gradckpt.profile_types import BlockProfile
        >>> from gradckpt.cli.sqrt_table import homogeneous_chain
        >>> chain = homogeneous_chain(BlockProfile("b", 10, 10, 50, True, 1.0, 2.0), 16)
        >>> plan = solve_with_optimizer(chain, "80%", "optimal", optimizer_bytes=200)
        >>> plan.predicted_peak_bytes + 200 <= 0.8 * (chain.peak_bytes + 200)
        True
        >>> solve_with_optimizer(chain, "100B", "optimal", optimizer_bytes=200)
        Traceback (most recent call last):
        ...
        gradckpt.errors.BudgetError: budget 100 B does not even hold Adam's state, 200 B; ...
    """
    from gradckpt import BudgetError, solve
    from gradckpt.budget import format_bytes, parse_budget

    if budget is None:
        return solve(profile, None, strategy)
    budget_bytes = parse_budget(
        budget, unconstrained_peak_bytes=profile.peak_bytes + optimizer_bytes
    )
    if budget_bytes <= optimizer_bytes:
        raise BudgetError(
            f"budget {format_bytes(budget_bytes)} does not even hold Adam's state, "
            f"{format_bytes(optimizer_bytes)}; raise the budget",
            minimum_bytes=optimizer_bytes,
        )
    try:
        return solve(profile, budget_bytes - optimizer_bytes, strategy)
    except BudgetError as error:
        if not optimizer_bytes:
            raise
        minimum = error.minimum_bytes + optimizer_bytes
        raise BudgetError(
            f"budget {format_bytes(budget_bytes)} is below the smallest peak {strategy} reaches "
            f"with Adam's state, {format_bytes(minimum)}; raise the budget to at least that",
            minimum_bytes=minimum,
        ) from None
