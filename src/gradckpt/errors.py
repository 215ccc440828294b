"""The exceptions gradckpt raises. Every one says what went wrong and how to fix it."""

from __future__ import annotations


class GradckptError(Exception):
    """Base class of every error gradckpt raises on purpose."""


class UsageError(GradckptError, ValueError):
    """An argument is wrong: the message names it, says what was given and what is accepted."""


class CheckpointError(GradckptError, RuntimeError):
    """Recomputation did not reproduce the forward pass of a checkpointed region.

    The message names the region and the first tensor (or operation) that differed. Without this
    error the backward pass would silently use wrong activations (DESIGN.md invariant 7).
    """


class BudgetError(GradckptError, ValueError):
    """No plan fits the memory budget.

    ``minimum_bytes`` is the smallest budget that any plan can meet; the message states it too.
    """

    def __init__(self, message: str, minimum_bytes: int) -> None:
        super().__init__(message)
        self.minimum_bytes = minimum_bytes
