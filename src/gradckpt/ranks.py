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

import textwrap
from collections.abc import Callable

import torch.distributed as dist

from .errors import BudgetError, GradckptError
from .plan import Plan
from .solvers.infeasible import RETRY_WITHOUT_MEASURING

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
                        getattr(error, "minimum_bytes", None))]
    dist.broadcast_object_list(payload, src=0)
    if isinstance(failure, BudgetError):
        raise _retried_on_every_rank(failure, str(failure), failure.minimum_bytes) from None
    if failure is not None:
        raise failure
    kind, *rest = payload[0]
    if kind == "plan":
        return Plan.from_json(rest[0])
    name, message, minimum_bytes = rest
    if name == "BudgetError":
        raise _retried_on_every_rank(None, f"(solved on rank 0) {message}", minimum_bytes)
    raise GradckptError(f"rank 0 failed to solve the plan: {name}: {message}")


def _retried_on_every_rank(
    error: BudgetError | None, message: str, minimum_bytes: int
) -> BudgetError:
    """The budget error every rank raises: solving again from one rank's profile
    (``error.profile``) would make that rank's plan alone, so the retry it advises goes through
    ``enable`` on every rank again. Only rank 0 keeps the profile it solved from."""
    headline, _, explanation = message.partition("\n")  # the explanation comes wrapped
    explanation = " ".join(explanation.split()).replace(
        RETRY_WITHOUT_MEASURING.strip(), RETRY_ON_EVERY_RANK.strip())
    message = f"{headline}\n{textwrap.fill(explanation, width=100)}" if explanation else headline
    return BudgetError(message, minimum_bytes=minimum_bytes,
                       profile=error.profile if error is not None else None)
