"""One plan for all ranks: solved on rank 0, broadcast to the others.

Under ``torch.distributed`` every rank profiles the model (the step's collectives need every
rank), and ranks time differently: two ranks solving on their own can choose different plans
for the same budget. Ranks that recompute different blocks still compute the same gradients,
but their steps differ in memory and time, and the slowest sets the pace. So when a process
group of more than one rank is running, ``agreed_on_every_rank(solve)`` runs ``solve`` on rank
0 only and broadcasts what it gave: the plan, or the error it raised (every rank raises it, so
none waits for a plan that never comes). Budgets given as ``"60%"`` or ``"auto"`` are then
rank 0's.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch.distributed as dist

from .errors import BudgetError, GradckptError
from .plan import Plan
from .solvers.infeasible import budget_message

# What an infeasible budget's message advises instead of solving again on one rank.
RETRY_ON_EVERY_RANK = (
    " To retry: call gradckpt.enable (or the Trainer) again on every rank with "
    "budget=error.minimum_bytes; rank 0 solves, every rank gets its plan."
)

__all__ = ["agreed_on_every_rank", "several_ranks"]


def several_ranks() -> bool:
    """Whether this process is one of several in a running ``torch.distributed`` group."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def agreed_on_every_rank(solve: Callable[[], Plan]) -> Plan:
    """``solve()`` on rank 0, its plan (or error) on every rank; just ``solve()`` when this
    process is alone.

    Example:
        >>> from gradckpt.plan import Plan
        >>> agreed_on_every_rank(lambda: Plan("none", None, [], 0, 0.0, 0.0)).strategy
        'none'
    """
    if not several_ranks():
        return solve()
    payload: list = [None]
    failure: BaseException | None = None
    if dist.get_rank() == 0:
        try:
            payload = [("plan", solve().to_json())]
        except Exception as error:  # every rank must hear of it, or the others wait forever
            failure = error
            payload = [("error", type(error).__name__, str(error),
                        getattr(error, "minimum_bytes", None), getattr(error, "explanation", ""))]
    dist.broadcast_object_list(payload, src=0)
    if isinstance(failure, BudgetError):
        raise _retried_on_every_rank(str(failure), failure.minimum_bytes, failure.explanation,
                                     failure.profile) from None
    if failure is not None:
        raise failure
    kind, *rest = payload[0]
    if kind == "plan":
        return Plan.from_json(rest[0])
    name, message, minimum_bytes, explanation = rest
    if name == "BudgetError":
        # This rank's profile is not the one rank 0 solved from: none to retry with.
        raise _retried_on_every_rank(f"(solved on rank 0) {message}", minimum_bytes,
                                     explanation, None)
    raise GradckptError(f"rank 0 failed to solve the plan: {name}: {message}")


def _retried_on_every_rank(
    message: str, minimum_bytes: int, explanation: str, profile: Any
) -> BudgetError:
    """The budget error every rank raises: solving again from one rank's profile
    (``error.profile``) would make that rank's plan alone, so the retry it advises goes through
    ``enable`` on every rank again. Only rank 0 keeps the profile it solved from."""
    headline = message.partition("\n")[0]  # the budget and the smallest that works
    return BudgetError(budget_message(headline, explanation, RETRY_ON_EVERY_RANK),
                       minimum_bytes=minimum_bytes, profile=profile, explanation=explanation)
