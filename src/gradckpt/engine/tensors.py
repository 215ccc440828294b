"""Small facts about tensors the engine needs everywhere, and the flag that hides the engine's
own tensor work from policy modes."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_flatten


class _InternalWork(threading.local):
    """Set while the engine itself runs tensor operations inside a region (copying buffers,
    detaching saved tensors): the policy mode must neither count nor log those, or forward and
    recomputation would seem to differ. Outer modes (e.g. MemTracker) still see them."""

    active = False


_internal_work = _InternalWork()


@contextlib.contextmanager
def _engine_internal() -> Iterator[None]:
    previous = _internal_work.active
    _internal_work.active = True
    try:
        yield
    finally:
        _internal_work.active = previous


def _metadata(tensor: torch.Tensor) -> tuple[torch.Size, torch.dtype, torch.device]:
    return (tensor.shape, tensor.dtype, tensor.device)


def _producer(tensor: torch.Tensor) -> type | None:
    """The type of autograd node that made a saved tensor, where it identifies the operation.

    None for leaves (region inputs are fresh leaves in recomputation) and for views: autograd
    may record the same reshape as ViewBackward0 once and ReshapeAliasBackward0 the next time.
    """
    node = tensor.grad_fn
    if node is None or tensor._is_view():
        return None
    return type(node)


def _describe(metadata: tuple[torch.Size, torch.dtype, torch.device]) -> str:
    shape, dtype, device = metadata
    return f"{str(dtype).removeprefix('torch.')}{list(shape)} on {device}"


def first_tensor(tree: Any) -> torch.Tensor | None:
    """The first tensor in a (possibly nested) output: an op's primary output, a block's hidden
    state."""
    return next((leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)), None)


def detached_like(tensor: torch.Tensor) -> torch.Tensor:
    """A detached alias that requires grad exactly when the original does."""
    return tensor.detach().requires_grad_(tensor.requires_grad)


def storage_key(tensor: torch.Tensor) -> int | None:
    """What identifies the memory a tensor uses: its storage (views and aliases share it).

    The storage object itself, not its data pointer: fake and meta tensors have storages but no
    data (every data pointer is 0, and reading a fake one is deprecated), and so does every
    empty tensor. None for tensors without a storage (sparse tensors, wrapper subclasses).
    """
    try:
        return tensor.untyped_storage()._cdata
    except (RuntimeError, NotImplementedError, TypeError):
        return None



def _version_of(tensor: torch.Tensor) -> int | None:
    """The tensor's version counter (bumped by every in-place change), None if it has none."""
    try:
        return tensor._version
    except RuntimeError:  # inference tensors keep no version counter
        return None


def _alias_sharing_version(tensor: torch.Tensor) -> torch.Tensor:
    """A detached alias that shares ``tensor``'s version counter, so that in-place changes to
    the original show on it. Below autograd, where a dispatch mode runs, ``detach()`` alone
    makes an alias with a counter of its own; the ADInplaceOrView kernel is what shares it."""
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return tensor.detach()
