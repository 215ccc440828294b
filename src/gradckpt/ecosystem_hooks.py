"""Model adapters: what an ecosystem needs done to a model while gradckpt works on it.

The core knows no model family. An integration that knows one (``gradckpt.integrations.hf``:
Hugging Face's key/value cache off) registers an adapter here, and the core runs every
registered adapter around its work on a model: while ``profile`` measures it, and while a plan
is applied (from ``apply`` to ``disable``).

An adapter is a callable ``adapter(model, occasion)``: it changes what the model needs changed
and returns a function that puts it back, or ``None`` when it changed nothing (the model is not
of its kind). ``occasion`` (an ``Occasion``) says why gradckpt holds the model: measuring it, or
training it under a plan, and whether that plan recomputes anything.

Example:
    >>> import torch
    >>> events = []
    >>> def note(model, occasion):
    ...     events.append(f"adapted, plan applied: {occasion.plan_applied}")
    ...     return lambda: events.append("restored")
    >>> register_adapter(note)
    >>> with adapted(torch.nn.Linear(1, 1)):
    ...     print(events)
    ['adapted, plan applied: False']
    >>> events
    ['adapted, plan applied: False', 'restored']
    >>> unregister_adapter(note)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from torch import nn

__all__ = [
    "Adapter", "ESTIMATING", "MEASURING", "Occasion", "register_adapter", "unregister_adapter",
    "adapt", "adapted",
]


@dataclass(frozen=True)
class Occasion:
    """Why gradckpt holds a model.

    - ``plan_applied``: False while ``profile`` measures it, True from ``apply`` to ``disable``.
    - ``recomputes``: the applied plan recomputes at least one block (False for the plan
      "none", and while measuring).
    - ``fake_tensors``: ``estimate`` runs the model on fake tensors, which have no values: an
      integration whose model reads values to choose a code path says which to take.
    """

    plan_applied: bool = False
    recomputes: bool = False
    fake_tensors: bool = False


MEASURING = Occasion()
ESTIMATING = Occasion(fake_tensors=True)

Adapter = Callable[[nn.Module, Occasion], "Callable[[], None] | None"]

_ADAPTERS: list[Adapter] = []


def register_adapter(adapter: Adapter) -> None:
    """Run ``adapter`` on every model gradckpt measures or applies a plan to (once, however
    often it is registered)."""
    if adapter not in _ADAPTERS:
        _ADAPTERS.append(adapter)


def unregister_adapter(adapter: Adapter) -> None:
    """Stop running ``adapter``; nothing happens if it was not registered."""
    if adapter in _ADAPTERS:
        _ADAPTERS.remove(adapter)


def adapt(model: nn.Module, occasion: Occasion = MEASURING) -> Callable[[], None]:
    """Run every registered adapter on ``model``; return a function undoing them all, the last
    one first."""
    undos = [
        undo for adapter in list(_ADAPTERS) if (undo := adapter(model, occasion)) is not None
    ]

    def restore() -> None:
        for undo in reversed(undos):
            undo()

    return restore


@contextlib.contextmanager
def adapted(model: nn.Module, occasion: Occasion = MEASURING) -> Iterator[None]:
    """``adapt`` for the duration of a ``with`` block."""
    restore = adapt(model, occasion)
    try:
        yield
    finally:
        restore()
