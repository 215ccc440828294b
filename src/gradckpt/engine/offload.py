"""The offload fate: an operation's outputs in CPU memory until recomputation needs them."""

from __future__ import annotations

import weakref
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from .tensors import _alias_sharing_version, _version_of


class _Offloaded:
    """An operation's outputs moved to CPU memory, and the way back (tree of ``_HostCopy``)."""

    def __init__(self, output: Any) -> None:
        leaves, self.spec = tree_flatten(output)
        self.entries = [_HostCopy(x) if isinstance(x, torch.Tensor) else x for x in leaves]

    def copies(self) -> list[_HostCopy]:
        return [entry for entry in self.entries if isinstance(entry, _HostCopy)]

    def prefetch(self) -> None:
        for copy in self.copies():
            copy.prefetch()

    def finish_before_mutation(self) -> None:
        for copy in self.copies():
            copy.finish_before_mutation()

    def changed_after_copy(self) -> bool:
        return any(copy.changed_after_copy() for copy in self.copies())

    def restore(self, fresh_copy: bool) -> Any:
        leaves = [
            entry.restore(fresh_copy) if isinstance(entry, _HostCopy) else entry
            for entry in self.entries
        ]
        return tree_unflatten(leaves, self.spec)


def offloadable(output: Any) -> bool:
    """Whether any tensor of an operation's output lives where offloading it saves memory: an
    accelerator's memory (not the CPU's, and not a meta or fake tensor, which has none).

    Example:
        >>> offloadable(torch.ones(2)), offloadable((torch.ones(2, device="meta"), 3))
        (False, False)
    """
    return any(_on_accelerator(leaf) for leaf in tree_flatten(output)[0]
               if isinstance(leaf, torch.Tensor))


def _on_accelerator(tensor: torch.Tensor) -> bool:
    return tensor.device.type not in ("cpu", "meta") and not _is_fake(tensor)


class _HostCopy:
    """One tensor in CPU memory while the forward goes on, back on its device for backward.

    On an accelerator the copy runs on a side stream into pinned memory, so it overlaps with the
    rest of the forward; recomputation starts copying a region's tensors back all at once
    (prefetch) and waits for each one only when it is needed. On the CPU there is nowhere cheaper
    to put a tensor: it is simply kept (documented: OFFLOAD is KEEP for CPU-resident models), and
    so are meta and fake tensors, which have no memory to copy. (An output with no tensor on an
    accelerator is recorded as kept before it gets here: ``offloadable``; these are the CPU
    tensors of an output that has some on one.)
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self.device = tensor.device
        # Fake tensors (estimate) have a device but no memory to copy: they are kept.
        self.on_accelerator = _on_accelerator(tensor)
        self.back: tuple[torch.Tensor, Any] | None = None
        if not self.on_accelerator:
            self.host = _alias_sharing_version(tensor)
            self.source: weakref.ref[torch.Tensor] | None = None
            self.version = _version_of(self.host)
            return
        # The copy runs while the program goes on: a change to the tensor made before it is
        # done could reach the copy. Watch the tensor (weakly: offload must not keep it alive).
        self.source = weakref.ref(tensor)
        self.version = _version_of(tensor)
        module = torch.get_device_module(self.device.type)
        stream = _side_stream(self.device)
        stream.wait_stream(module.current_stream(self.device))  # the tensor must be written first
        with module.stream(stream):
            self.host = torch.empty_like(tensor, device="cpu", pin_memory=True)
            self.host.copy_(tensor.detach(), non_blocking=True)
            self.copied = stream.record_event()
        # The allocator must not hand the tensor's memory to anyone before the copy has read it.
        tensor.record_stream(stream)

    def finish_before_mutation(self) -> None:
        if not self.on_accelerator:
            self.host = self.host.clone()
            self.version = _version_of(self.host)
            return
        module = torch.get_device_module(self.device.type)
        module.current_stream(self.device).wait_event(self.copied)
        self.source = None  # the region changes it from here on, after the copy is done

    def changed_after_copy(self) -> bool:
        """Whether the tensor was changed in place outside the region since it was copied.

        On the CPU the copy is the tensor itself. On an accelerator only a tensor still alive
        can be checked; one that died can only have been changed through an alias that
        autograd does not track either (``.data``, ``detach()``), as docs/engine.md says.
        """
        if not self.on_accelerator:
            return _version_of(self.host) != self.version
        source = self.source() if self.source is not None else None
        return source is not None and _version_of(source) != self.version

    def prefetch(self) -> None:
        if not self.on_accelerator or self.back is not None:
            return
        module = torch.get_device_module(self.device.type)
        stream = _side_stream(self.device)
        with module.stream(stream):
            tensor = torch.empty_like(self.host, device=self.device)
            tensor.copy_(self.host, non_blocking=True)
            self.back = (tensor, stream.record_event())

    def restore(self, fresh_copy: bool) -> torch.Tensor:
        if not self.on_accelerator:
            return self.host.clone() if fresh_copy else self.host.detach()
        self.prefetch()
        tensor, ready = self.back
        self.back = None  # drop our reference: backward owns the tensor from here (invariant 6)
        current = torch.get_device_module(self.device.type).current_stream(self.device)
        current.wait_event(ready)
        tensor.record_stream(current)  # made on the side stream, used and freed on this one
        return tensor


def _is_fake(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(tensor)


_side_streams: dict[torch.device, Any] = {}


def _side_stream(device: torch.device) -> Any:
    if device not in _side_streams:
        _side_streams[device] = torch.get_device_module(device.type).Stream(device)
    return _side_streams[device]

