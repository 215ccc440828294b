"""Per-operation fates: the dispatch mode that asks the policy in the forward pass and hands
kept and offloaded outputs back in recomputation."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

from ..errors import UsageError
from .debug import _user_frame
from .fates import Fate
from .offload import _Offloaded
from .tensors import (
    _alias_sharing_version,
    _engine_internal,
    _internal_work,
    _version_of,
    first_tensor,
    storage_key,
)

if TYPE_CHECKING:
    from .region import _Region


class _OpRecord:
    """One policy-asked operation of the forward pass: what it was, its fate, what we stored."""

    __slots__ = ("op", "fate", "stored", "versions", "mutated_later")

    def __init__(self, op: torch._ops.OpOverload, fate: Fate, stored: Any) -> None:
        self.op = op
        self.fate = fate
        self.stored = stored
        # A kept output is an alias sharing the operation output's version counter: in-place
        # changes to that output, in the region or after it, move these numbers.
        self.versions = _versions(stored) if fate is Fate.KEEP else None
        self.mutated_later = False

    def protect_from_mutation(self) -> None:
        """The region is about to modify this output in place: stop sharing memory with it.

        Otherwise recomputation would hand back the modified value and apply the in-place
        operation a second time.
        """
        self.mutated_later = True
        if self.fate is Fate.KEEP:
            self.stored = tree_map_only(torch.Tensor, torch.Tensor.clone, self.stored)
            self.versions = _versions(self.stored)
        else:
            self.stored.finish_before_mutation()

    @property
    def handed_out(self) -> bool:
        """A kept output already given to a recomputation: a later one must run the op again."""
        return self.fate is Fate.KEEP and self.stored is None

    def changed_after_region(self) -> bool:
        """Whether what we stored was changed in place after the forward pass left the region.

        The user may modify a returned tensor before backward (``y = block(x); y.mul_(2)``).
        Handing the changed value to recomputation would give a wrong gradient; running the
        operation again gives the true one (plain autograd would raise instead). The region's
        own in-place changes are not counted where ``protect_from_mutation`` made a private copy
        first; where it could not (a subclass without storage to match), running the operation
        again is right for them too.
        """
        if self.fate is Fate.KEEP:
            return _versions(self.stored) != self.versions
        return self.stored.changed_after_copy()

    def give_up_stored(self) -> None:
        """From now on run the operation again: what we stored is stale (and its copy on the
        way back, if any, is freed)."""
        self.fate = Fate.RECOMPUTE
        self.stored = None

    def replay(self) -> Any:
        if self.fate is Fate.OFFLOAD:
            return self.stored.restore(fresh_copy=self.mutated_later)
        # Kept outputs are handed over, not shared: the recomputation's graph holds them while
        # its backward needs them, and an output it never saves is freed as soon as the
        # recomputation has used it (as torch's selective checkpointing does). Holding on
        # until the region dies would add every kept output that backward does not save to
        # the step's peak. The rare second backward (retain_graph=True) recomputes the op.
        # A fresh alias, so autograd's bookkeeping on it never leaks into the region.
        stored, self.stored = self.stored, None
        return tree_map_only(torch.Tensor, torch.Tensor.detach, stored)


def _versions(tree: Any) -> list[int | None]:
    return [_version_of(leaf) for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)]


@functools.cache
def _is_query(op: torch._ops.OpOverload) -> bool:
    """Whether ``op`` returns no tensor and changes none: sizes, strides, device, ``.item()``.

    These are not operations of the region. A tensor subclass that reports its sizes through
    dispatch (a jagged NestedTensor, DTensor, a wrapper subclass) answers every such question
    autograd, the subclass itself or the engine asks, and they ask more of them in one pass than
    in another; counted, they would make a faithful recomputation look like a different one.
    Nothing they return can be kept, so no policy is asked either.
    """
    schema = op._schema
    return not schema.is_mutable and not any("Tensor" in str(ret.type) for ret in schema.returns)


def _asks_policy(op: torch._ops.OpOverload) -> bool:
    # Views and in-place operations alias tensors that exist anyway: nothing to keep.
    return not op.is_view and not op._schema.is_mutable


class _PolicyMode(TorchDispatchMode):
    """Sees every ATen operation of a region.

    Forward: asks the policy about each operation that makes new tensors and keeps or offloads
    the outputs it chooses. Recomputation: hands those back instead of running the operation
    again, after checking that the same operation comes at the same position (invariant 7).
    In debug mode it also logs every operation with the line of user code that called it.
    Queries that return no tensor (``_is_query``) are neither asked about, counted nor logged.
    """

    def __init__(self, region: _Region, recomputing: bool) -> None:
        super().__init__()
        self.region = region
        self.recomputing = recomputing
        self.position = 0
        self.watched: dict[int | None, list[_OpRecord]] = {}  # storage -> records sharing it
        self.log = region.recompute_log if recomputing else region.forward_log
        if recomputing:
            for record in region.op_records:
                if record.fate is Fate.OFFLOAD:
                    record.stored.prefetch()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        region = self.region
        if _internal_work.active or _is_query(func):
            return func(*args, **kwargs)
        if region.debug:
            self.log.append(f"{func}  ({_user_frame()})")
        if region.policy is None:
            return func(*args, **kwargs)
        if not _asks_policy(func):
            if self.watched and func._schema.is_mutable and not self.recomputing:
                with _engine_internal():
                    self.protect_inputs(args, kwargs)
            return func(*args, **kwargs)
        if self.recomputing:
            return self.replay(func, args, kwargs)
        output = func(*args, **kwargs)
        # The policy's and our own tensor work must stay invisible to the policy mode of an
        # enclosing region, or that region's recomputation would see different operations.
        with _engine_internal():
            self.record(func, output)
        return output

    def record(self, func: torch._ops.OpOverload, output: Any) -> None:
        region = self.region
        first = first_tensor(output)
        fate = Fate.RECOMPUTE if first is None else region.policy(func, first)
        if not isinstance(fate, Fate):
            raise UsageError(
                f"checkpoint policy {region.policy!r} returned {fate!r} for {func}; "
                "a policy must return gradckpt.Fate.KEEP, .RECOMPUTE or .OFFLOAD"
            )
        if fate is Fate.KEEP:
            stored = tree_map_only(torch.Tensor, _alias_sharing_version, output)
        elif fate is Fate.OFFLOAD:
            stored = _Offloaded(output)
        else:
            stored = None
        record = _OpRecord(func, fate, stored)
        region.op_records.append(record)
        if fate is not Fate.RECOMPUTE:
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and storage_key(tensor) is not None:
                    self.watched.setdefault(storage_key(tensor), []).append(record)

    def protect_inputs(self, args: tuple, kwargs: dict) -> None:
        # Over-approximates "the mutated arguments" by all tensor arguments: a needless copy in a
        # rare case is cheaper than reading every schema's alias annotations on every call.
        for tensor in tree_flatten((args, kwargs))[0]:
            if isinstance(tensor, torch.Tensor):
                for record in self.watched.pop(storage_key(tensor), ()):
                    record.protect_from_mutation()

    def replay(self, func, args, kwargs):  # noqa: ANN001
        region = self.region
        position = self.position
        self.position += 1
        record = region.op_records[position] if position < len(region.op_records) else None
        if record is None or record.op is not func:
            expected = record.op if record is not None else "nothing (the forward had ended)"
            raise region.mismatch(
                f"ran {func} as operation #{position}, where the forward pass ran {expected}"
            )
        if record.fate is not Fate.RECOMPUTE and record.changed_after_region():
            record.give_up_stored()
        if record.fate is Fate.RECOMPUTE or record.handed_out:
            return func(*args, **kwargs)
        with _engine_internal():
            return record.replay()

