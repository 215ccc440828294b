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

import torch.distributed as dist

from .errors import BudgetError, GradckptError
from .plan import Plan

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
    if failure is not None:
        raise failure
    kind, *rest = payload[0]
    if kind == "plan":
        return Plan.from_json(rest[0])
    name, message, minimum_bytes = rest
    if name == "BudgetError":
        # This rank's profile is not the one rank 0 solved from: none to retry with.
        raise BudgetError(f"(solved on rank 0) {message}", minimum_bytes=minimum_bytes)
    raise GradckptError(f"rank 0 failed to solve the plan: {name}: {message}")
