"""The exceptions gradckpt raises. Every one says what went wrong and how to fix it."""

from __future__ import annotations

import warnings
from typing import Any


class GradckptError(Exception):
    """Base class of every error gradckpt raises on purpose."""


class UsageError(GradckptError, ValueError):
    """An argument is wrong: the message names it, says what was given and what is accepted."""


class CheckpointError(GradckptError, RuntimeError):
    """Recomputation did not reproduce the forward pass of a checkpointed region.

    The message names the region and the first tensor (or operation) that differed. Without this
    error the backward pass would silently use wrong activations (invariant 7 in docs/engine.md).
    """


class BudgetError(GradckptError, ValueError):
    """No plan fits the memory budget.

    ``minimum_bytes`` is the smallest budget that any plan can meet; the message states it too,
    with what the least plan's peak is made of and what would lower it. ``profile`` is the
    ``gradckpt.Profile`` the plan was solved from (``None`` where it is not at hand: on the
    ranks that did not solve), so that retrying needs no second measurement (where memory was
    reserved beside the step, an optimizer's state in the Trainer callback, pass the budget
    again instead)::

        try:
            plan = gradckpt.enable(model, batch, budget="60%")
        except gradckpt.BudgetError as error:
            plan = gradckpt.solve(error.profile, error.minimum_bytes)
            gradckpt.apply(model, plan)
    """

    def __init__(self, message: str, minimum_bytes: int, profile: Any = None) -> None:
        super().__init__(message)
        self.minimum_bytes = minimum_bytes
        self.profile = profile


class GradckptWarning(UserWarning):
    """Something that would silently cost memory, time or correct gradients; the message names
    the fix. Each kind is issued once per process (``warn_once``)."""


_warned: set[str] = set()


def warn_once(key: str, message: str, *, stacklevel: int = 3) -> bool:
    """Issue ``message`` as a ``GradckptWarning`` the first time ``key`` is seen in this
    process; return whether it was issued.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_once("example", "first"), warn_once("example", "second")
        (True, False)
        >>> [str(w.message) for w in caught]
        ['first']
        >>> forget_warnings()
    """
    if key in _warned:
        return False
    _warned.add(key)
    warnings.warn(message, GradckptWarning, stacklevel=stacklevel)
    return True


def forget_warnings() -> None:
    """Let every ``warn_once`` warning be issued again (for tests)."""
    _warned.clear()
