"""Key/value caches off while training with a plan (Hugging Face's ``use_cache``).

With ``config.use_cache`` true, a Transformers model hands its layers a cache object even in a
training step, and each layer appends its keys and values to it. A recomputed layer would
append them again, and profiling re-runs each layer on its own; the cache is useless for
training anyway. Transformers' own gradient checkpointing turns it off for the same reasons;
gradckpt does too, for what it profiles and while a plan is applied, and puts it back after.

Example:
    >>> import torch
    >>> class Config:
    ...     use_cache = True
    >>> model = torch.nn.Linear(2, 2)
    >>> model.config = Config()
    >>> with caches_off(model):
    ...     model.config.use_cache
    False
    >>> model.config.use_cache
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from torch import nn

__all__ = ["caches_off", "turn_caches_off"]


def turn_caches_off(model: nn.Module) -> Callable[[], None]:
    """Set ``use_cache = False`` on every config of ``model`` that has it true; return a
    function that turns them back on."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    turned_off = [c for c in configs.values() if getattr(c, "use_cache", False) is True]
    for config in turned_off:
        config.use_cache = False

    def restore() -> None:
        for config in turned_off:
            config.use_cache = True

    return restore


@contextlib.contextmanager
def caches_off(model: nn.Module) -> Iterator[None]:
    """``turn_caches_off`` for the duration of a ``with`` block."""
    restore = turn_caches_off(model)
    try:
        yield
    finally:
        restore()
