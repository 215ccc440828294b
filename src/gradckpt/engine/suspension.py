"""What the engine has installed on a model's modules, and making it stand aside for a while.

``checkpoint_module`` (a module's class) and ``checkpoint_segments`` (hooks on a chain's blocks,
what ``apply`` installs) change how modules run. ``plans_suspended(model)`` makes both stand
aside on ``model``'s modules for the duration of a ``with`` block, on this thread only: the
model runs as without gradckpt there (``profile`` measures a planned model that way), while
another thread keeps training with its checkpointing. What is installed stays installed.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Iterator
from typing import Any

from torch import nn

__all__ = ["plans_suspended"]

# Every live ``SegmentsHandle`` (registered by it, until ``remove()``): what is planned where.
# Threads plan and measure models at once: the lock keeps the set whole while one reads it.
_segment_handles: weakref.WeakSet[Any] = weakref.WeakSet()
_segment_handles_lock = threading.Lock()


def _register_handle(handle: Any) -> None:
    with _segment_handles_lock:
        _segment_handles.add(handle)


def _unregister_handle(handle: Any) -> None:
    with _segment_handles_lock:
        _segment_handles.discard(handle)


class _Suspended(threading.local):
    """Per thread: the ids of what stands aside (handles, checkpointed modules), each with how
    many ``plans_suspended`` blocks hold it (they nest)."""

    def __init__(self) -> None:
        self.counts: dict[int, int] = {}


_suspended = _Suspended()


def _standing_aside(owner: object) -> bool:
    """Whether ``owner`` (a segments handle or a checkpointed module) stands aside on this
    thread. Cheap when nothing does: that is every training step."""
    counts = _suspended.counts
    return bool(counts) and id(owner) in counts


def _handles_on(modules: list[nn.Module]) -> list[Any]:
    """The live segments handles with a block among ``modules``."""
    ids = {id(module) for module in modules}
    with _segment_handles_lock:
        handles = list(_segment_handles)
    return [handle for handle in handles if any(id(block) in ids for block in handle.blocks)]


@contextlib.contextmanager
def plans_suspended(model: nn.Module) -> Iterator[None]:
    """Within, ``model`` runs as if gradckpt had installed nothing on it: a plan's segments
    and ``checkpoint_module`` stand aside on every module of ``model``, on this thread only.

    What is installed stays installed and works again afterwards (also after an exception).
    Segments made inside the block (``checkpoint_segments`` called there) are not affected.

    Example:
        >>> import torch, gradckpt
        >>> block = gradckpt.checkpoint_module(torch.nn.Linear(4, 4))
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> with plans_suspended(block):
        ...     y = block(x)  # plain: autograd keeps what the layer saves
        >>> y.grad_fn._saved_mat1 is x
        True
        >>> gradckpt.is_checkpointed(block)
        True
    """
    modules = list(model.modules())  # held: their ids must not be reused while suspended
    owners = [*modules, *_handles_on(modules)]
    counts = _suspended.counts
    for owner in owners:
        counts[id(owner)] = counts.get(id(owner), 0) + 1
    try:
        yield
    finally:
        counts = _suspended.counts  # the same thread's: a generator resumes where it started
        for owner in owners:
            left = counts[id(owner)] - 1
            if left:
                counts[id(owner)] = left
            else:
                del counts[id(owner)]
