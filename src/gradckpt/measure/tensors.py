"""Small facts about tensors that several measuring modules need: how many bytes a tensor
holds, and which tensors a sample or a call's arguments contain."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_flatten

from ..engine import storage_key

__all__ = ["SavedStorages", "returns_tensor", "saved_apart", "tensor_bytes", "tensors_in"]


def tensor_bytes(tensor: torch.Tensor) -> int:
    """The bytes of the tensor's own elements (not of the whole storage a view may share).

    Example:
        >>> tensor_bytes(torch.zeros(2, 3))
        24
    """
    return tensor.numel() * tensor.element_size()


def saved_apart(tensor: torch.Tensor) -> torch.Tensor:
    """What a measuring pack hook (``saved_tensors_hooks``) hands autograd to keep: the tensor
    detached, its storage the same.

    Handed back as it came, a tensor its own node saves (``exp``'s output) would hold that
    node, and the node it: a cycle no collector sees, so a graph that backward never runs
    through (a side computation the loss does not use, a reversible layer's recomputation)
    would keep its tensors for good, and every later reading would count them. Detached
    outside the dispatch modes measuring the step (meters, timers, a fake mode), which would
    count the ``detach`` as one of the step's operations.

    Example:
        >>> x = torch.ones(3, requires_grad=True)
        >>> with torch.autograd.graph.saved_tensors_hooks(saved_apart, lambda t: t):
        ...     y = x.exp()
        >>> y.sum().backward()
        >>> x.grad.equal(y.detach())
        True
    """
    with _disable_current_modes():
        return tensor.detach()


class SavedStorages:
    """The storages a forward's graph saves, each once with its bytes, less ``excluded`` (a
    block's parameters): ``pack`` is the pack hook to run the forward under, ``alive()`` what
    of it the graph still holds when asked.

    Alive, not all it was handed: a graph the forward lets go (scores computed with gradients
    of which only the top indices are kept) frees what it saved, and a storage's key can come
    back for a new one once it is freed. Counting every one handed over, DeepSeek-V4's sparse
    attention layer measured 24.6-33.3 MB on identical fresh models, as the allocator reused
    addresses, where its forward holds 15.8 MB. And held by that graph, not merely allocated:
    what such a graph saved that lives on elsewhere (the block's input, which MRA's attention
    without its CUDA kernel runs through projections it then discards) is no longer the
    graph's. Counted, MRA under LoRA came out 6.6% under its peak with every layer
    checkpointed (its retained bytes 143 KB high, what the head leaves read at the chain's
    backward's start, less them, as much low).

    Example:
        >>> saved = SavedStorages()
        >>> x = torch.ones(4, requires_grad=True)
        >>> with torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t):
        ...     y = x.exp()
        ...     z = (x * 2).sin()
        ...     w = x.cos()
        >>> sorted(saved.alive().values())  # exp's output, sin's input and x (cos's input)
        [16, 16, 16]
        >>> del z, w  # their graphs let go, and what they saved: x is alive, no longer saved
        >>> sorted(saved.alive().values())
        [16]
    """

    def __init__(self, excluded: set | frozenset = frozenset()) -> None:
        self.excluded = excluded
        # storage -> what autograd was handed of it (each one autograd keeps while the graph
        # that saved it lives), with the storage's bytes
        self._handed: dict[Any, list[tuple[weakref.ref, int]]] = {}

    def pack(self, tensor: torch.Tensor) -> torch.Tensor:
        apart = saved_apart(tensor)
        key = storage_key(tensor)
        if key not in self.excluded:
            self._handed.setdefault(key, []).append(
                (weakref.ref(apart), tensor.untyped_storage().nbytes()))
        return apart

    def alive(self) -> dict[Any, int]:
        return {key: nbytes for key, handed in self._handed.items()
                for reference, nbytes in handed if reference() is not None}


def tensors_in(tree: Any) -> list[torch.Tensor]:
    """The tensors among the leaves of a (possibly nested) tuple, list or dict, in order.

    Example:
        >>> [t.shape for t in tensors_in(({"x": torch.ones(2)}, 3, [torch.ones(1)]))]
        [torch.Size([2]), torch.Size([1])]
    """
    return [leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)]


def returns_tensor(operation: Any) -> bool:
    """Whether an ATen operation returns a tensor, by its schema; one that does not only asks
    about one (its device, a size), as fake tensors do from Python when a cache misses.

    Example:
        >>> returns_tensor(torch.ops.aten.add.Tensor), returns_tensor(torch.ops.prim.device.default)
        (True, False)
    """
    return any("Tensor" in str(value.type) for value in operation._schema.returns)


def is_passed_object(value: Any) -> bool:
    """Whether an argument is an object a block's forward may store tensors in (a dictionary
    of key/value states that later layers share): neither a tensor, nor None, nor a plain
    value.

    Example:
        >>> from collections import UserDict
        >>> [is_passed_object(v) for v in (UserDict(), torch.ones(1), None, 3, "causal")]
        [True, False, False, False, False]
    """
    return value is not None and not isinstance(
        value, (torch.Tensor, str, bytes, int, float, bool, type, torch.dtype, torch.device))
