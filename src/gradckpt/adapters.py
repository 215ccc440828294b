"""Model adapters: what an ecosystem needs done to a model while gradckpt works on it.

The core knows no model family. An integration that knows one (``gradckpt.integrations.hf``:
Hugging Face's key/value cache off) registers an adapter here, and the core runs every
registered adapter around its work on a model: while ``profile`` measures it, and while a plan
is applied (from ``apply`` to ``disable``).

An adapter is a callable ``adapter(model)``: it changes what the model needs changed for
training with a plan and returns a function that puts it back, or ``None`` when it changed
nothing (the model is not of its kind).

Example:
    >>> import torch
    >>> events = []
    >>> def note(model):
    ...     events.append("adapted")
    ...     return lambda: events.append("restored")
    >>> register_adapter(note)
    >>> with adapted(torch.nn.Linear(1, 1)):
    ...     print(events)
    ['adapted']
    >>> events
    ['adapted', 'restored']
    >>> unregister_adapter(note)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch import nn

__all__ = ["Adapter", "register_adapter", "unregister_adapter", "adapt", "adapted"]

Adapter = Callable[[nn.Module], "Callable[[], None] | None"]

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


def adapt(model: nn.Module) -> Callable[[], None]:
    """Run every registered adapter on ``model``; return a function undoing them all, the last
    one first."""
    undos = [undo for adapter in list(_ADAPTERS) if (undo := adapter(model)) is not None]

    def restore() -> None:
        for undo in reversed(undos):
            undo()

    return restore


@contextlib.contextmanager
def adapted(model: nn.Module) -> Iterator[None]:
    """``adapt`` for the duration of a ``with`` block."""
    restore = adapt(model)
    try:
        yield
    finally:
        restore()
