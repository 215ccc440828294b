"""Ecosystem hooks: what an ecosystem needs done to a model while gradckpt works on it.

The core knows no model family. An integration that knows one (``gradckpt.integrations.hf``:
Hugging Face's key/value cache off) registers a hook here, and the core runs every registered
hook around its work on a model: while ``profile`` measures it, and while a plan is applied
(from ``apply`` to ``disable``). (Not to be confused with LoRA adapters, which are ordinary
trainable modules to gradckpt.)

A hook is a callable ``hook(model, occasion)``: it changes what the model needs changed and
returns a function that puts it back, or ``None`` when it changed nothing (the model is not of
its kind). ``occasion`` (an ``Occasion``) says why gradckpt holds the model: measuring it, or
training it under a plan, and whether that plan recomputes anything.

Example:
    >>> import torch
    >>> events = []
    >>> def note(model, occasion):
    ...     events.append(f"hooked, plan applied: {occasion.plan_applied}")
    ...     return lambda: events.append("restored")
    >>> register_ecosystem_hook(note)
    >>> with ecosystem_hooks_on(torch.nn.Linear(1, 1)):
    ...     print(events)
    ['hooked, plan applied: False']
    >>> events
    ['hooked, plan applied: False', 'restored']
    >>> unregister_ecosystem_hook(note)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from torch import nn

__all__ = [
    "ESTIMATING", "MEASURING", "EcosystemHook", "Occasion", "ecosystem_hooks_on",
    "register_ecosystem_hook", "run_ecosystem_hooks", "unregister_ecosystem_hook",
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

EcosystemHook = Callable[[nn.Module, Occasion], "Callable[[], None] | None"]

_HOOKS: list[EcosystemHook] = []


def register_ecosystem_hook(hook: EcosystemHook) -> None:
    """Run ``hook`` on every model gradckpt measures or applies a plan to (once, however often
    it is registered)."""
    if hook not in _HOOKS:
        _HOOKS.append(hook)


def unregister_ecosystem_hook(hook: EcosystemHook) -> None:
    """Stop running ``hook``; nothing happens if it was not registered."""
    if hook in _HOOKS:
        _HOOKS.remove(hook)


def run_ecosystem_hooks(model: nn.Module, occasion: Occasion = MEASURING) -> Callable[[], None]:
    """Run every registered hook on ``model``; return a function undoing them all, the last
    one first."""
    undos = _run_hooks(model, occasion)

    def restore() -> None:
        _undo(undos)

    return restore


@contextlib.contextmanager
def ecosystem_hooks_on(model: nn.Module, occasion: Occasion = MEASURING) -> Iterator[bool]:
    """``run_ecosystem_hooks`` for the duration of a ``with`` block, which is given whether any
    hook changed the model."""
    undos = _run_hooks(model, occasion)
    try:
        yield bool(undos)
    finally:
        _undo(undos)


def _run_hooks(model: nn.Module, occasion: Occasion) -> list[Callable[[], None]]:
    return [undo for hook in list(_HOOKS) if (undo := hook(model, occasion)) is not None]


def _undo(undos: list[Callable[[], None]]) -> None:
    for undo in reversed(undos):
        undo()
