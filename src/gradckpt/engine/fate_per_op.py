"""This is where a saved tensor gets its fate: ``_FatePerOpMode.decide_fate``.

Without a policy every tensor a region saves is recomputed (region.py). With one, the region
runs under the dispatch mode below, which sees every ATen operation. In the forward pass
``decide_fate`` asks the policy about each operation that makes new tensors and keeps or offloads
its outputs as the answer says, writing each operation and its fate on the region's tape
(``_FateTape``). In recomputation the mode reads the tape back: a kept or offloaded output is
handed back instead of running its operation again, after checking that the same operation comes
at the same position (invariant 7; the region passes in how to word the ``CheckpointError``, so
this module never imports it). The fates themselves and the named policies (``save_matmuls``,
``offload_matmuls``) are in fates.py; the offload fate's copies in offload.py.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only

from ..errors import CheckpointError, UsageError
from .debug import _first_divergence, _user_frame
from .fates import Fate, Policy, asks_policy
from .offload import _Offloaded, offloadable
from .tensors import (
    _alias_sharing_version,
    _engine_internal,
    _internal_work,
    _version_of,
    first_tensor,
    storage_key,
)


class _FateTape:
    """A region's operations as its forward pass ran them, each with its fate and what was kept
    or offloaded for it; in debug mode also every operation of the forward pass and of the
    latest recomputation, with the line of user code that ran it.

    The region holds one for its whole life and opens a mode on it for each pass.
    """

    def __init__(self, policy: Policy | None, debug: bool) -> None:
        self.policy = policy
        self.debug = debug
        self.records: list[_OpRecord] = []
        self.forward_log: list[str] = []
        self.recompute_log: list[str] = []

    def forward_mode(self) -> _FatePerOpMode | None:
        """The mode that decides fates in the forward pass; None where there is nothing to
        decide or log (no policy: every saved tensor is recomputed)."""
        if self.policy is None and not self.debug:
            return None
        return _FatePerOpMode(self, recomputing=False, mismatch=None)

    def recompute_mode(
        self, mismatch: Callable[[str], CheckpointError]
    ) -> _FatePerOpMode | None:
        """The mode that reads the tape back in one recomputation. ``mismatch(what_differed)``
        is the error to raise where recomputation runs another operation than the forward."""
        self.recompute_log = []
        if self.policy is None and not self.debug:
            return None
        return _FatePerOpMode(self, recomputing=True, mismatch=mismatch)

    def where_diverged(self) -> str:
        """Where the latest recomputation left the forward pass, for a mismatch's message."""
        if self.debug:
            return "\n" + _first_divergence(self.forward_log, self.recompute_log)
        return " Run the step under gradckpt.debug_mode() to see where it diverged."


class _FatePerOpMode(TorchDispatchMode):
    """Sees every ATen operation of one pass of a region: its forward, or one recomputation.

    Forward: ``decide_fate`` for each operation that makes new tensors. Recomputation: hands
    back what the tape kept or offloaded instead of running the operation again, after checking
    that the same operation comes at the same position (``replay``, invariant 7). In debug mode
    it also logs every operation with the line of user code that called it. Queries that return
    no tensor (``_is_query``) are neither asked about, counted nor logged.
    """

    def __init__(
        self,
        tape: _FateTape,
        recomputing: bool,
        mismatch: Callable[[str], CheckpointError] | None,
    ) -> None:
        super().__init__()
        self.tape = tape
        self.recomputing = recomputing
        self.mismatch = mismatch
        self.position = 0
        self.watched: dict[int | None, list[_OpRecord]] = {}  # storage -> records sharing it
        self.log = tape.recompute_log if recomputing else tape.forward_log
        if recomputing:
            for record in tape.records:
                if record.fate is Fate.OFFLOAD:
                    record.stored.prefetch()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        tape = self.tape
        if _internal_work.active or _is_query(func):
            return func(*args, **kwargs)
        if tape.debug:
            self.log.append(f"{func}  ({_user_frame()})")
        if tape.policy is None:
            return func(*args, **kwargs)
        if not asks_policy(func):
            if self.watched and func._schema.is_mutable and not self.recomputing:
                with _engine_internal():
                    self.protect_inputs(args, kwargs)
            return func(*args, **kwargs)
        if self.recomputing:
            return self.replay(func, args, kwargs)
        output = func(*args, **kwargs)
        # The policy's and our own tensor work must stay invisible to the mode of an enclosing
        # region, or that region's recomputation would see different operations.
        with _engine_internal():
            self.decide_fate(func, output)
        return output

    def decide_fate(self, func: torch._ops.OpOverload, output: Any) -> None:
        """Ask the policy what becomes of ``func``'s outputs, store them as it says (an alias
        for KEEP, a CPU copy for OFFLOAD, nothing for RECOMPUTE) and write it on the tape."""
        policy = self.tape.policy
        first = first_tensor(output)
        fate = Fate.RECOMPUTE if first is None else policy(func, first)
        if not isinstance(fate, Fate):
            raise UsageError(
                f"checkpoint policy {policy!r} returned {fate!r} for {func}; "
                "a policy must return gradckpt.Fate.KEEP, .RECOMPUTE or .OFFLOAD"
            )
        if fate is Fate.OFFLOAD and not offloadable(output):
            # Nowhere cheaper to put it (the CPU): kept, and handed to the recomputation as a
            # kept output is. Its "host copy", held until the region died, added every such
            # output backward does not save to the step's peak (a PEFT Llama layer offloading
            # its residual adds, 5.4% over the same layer keeping them).
            fate = Fate.KEEP
        if fate is Fate.KEEP:
            stored = tree_map_only(torch.Tensor, _alias_sharing_version, output)
        elif fate is Fate.OFFLOAD:
            stored = _Offloaded(output)
        else:
            stored = None
        record = _OpRecord(func, fate, stored)
        self.tape.records.append(record)
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
        records = self.tape.records
        position = self.position
        self.position += 1
        record = records[position] if position < len(records) else None
        if record is None or record.op is not func:
            expected = record.op if record is not None else "nothing (the forward had ended)"
            raise self.mismatch(
                f"ran {func} as operation #{position}, where the forward pass ran {expected}"
            )
        if record.fate is not Fate.RECOMPUTE and record.changed_after_region():
            record.give_up_stored()
        if record.fate is Fate.RECOMPUTE or record.handed_out:
            return func(*args, **kwargs)
        with _engine_internal():
            return record.replay()


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


@functools.cache
def dispatch_seconds_per_operation() -> float:
    """What the per-operation dispatch of a region under a policy adds to each operation on
    this machine, in seconds: tiny operations timed under the mode (its forward, asking a
    policy and writing the tape) against the same outside it, once per process.

    The cost model multiplies it by a block's operation count: a block's time under a policy
    less its time recomputing everything is too noisy a measure of it (on a 2-core CPU, 2 ms
    of a 16 ms layer came out anywhere between 0 and 7 ms).
    """
    x = torch.ones(1)
    operations = 400

    def run() -> None:
        y = x
        for _ in range(operations):
            y = torch.add(y, 0)

    def best_of(five: Callable[[], Any]) -> float:
        times = []
        for _ in range(5):
            start = time.perf_counter()
            five()
            times.append(time.perf_counter() - start)
        return min(times)

    def under_mode() -> None:
        with _FatePerOpMode(_FateTape(lambda op, out: Fate.RECOMPUTE, debug=False),
                            recomputing=False, mismatch=None):
            run()

    plain, moded = best_of(run), best_of(under_mode)
    return max(0.0, (moded - plain) / operations)
