"""Checkpointed segments: several consecutive blocks, called by the model's own loop, as one region.

``checkpoint(fn, ...)`` needs one callable that runs the whole region. A model's chain of blocks
is not one: its ``forward`` calls ``block(hidden, ...)`` for each block in a loop we do not own.
``checkpoint_segments(blocks, [(0, 3), (4, 7)])`` makes blocks 0-3 one region and 4-7 another all
the same, with hooks on the blocks:

- the first block's pre-hook opens the region: it saves that block's inputs (the only tensors the
  region keeps);
- each later block's pre-hook records how it was called (its other arguments: attention masks,
  position embeddings) and checks that its hidden-state input *is* the previous block's output —
  otherwise something runs between the blocks and they cannot form one region;
- around each block's call (from its pre-hook to its post-hook) the region's saved-tensor hooks
  (and its policy's dispatch mode) are on; the last block's post-hook closes the region.

Recomputation calls the blocks again, in order, feeding each block's output to the next. Segments
may nest (a segment inside a segment, as optimal schedules do): the outer one is opened first and
closed last, and while a segment is being recomputed only segments inside it open (engine rule R3).
This is the mechanism behind plans whose segments span more than one block; a single block can
also use ``gradckpt.checkpoint_module``.

Failure safety. Torch keeps saved-tensor hooks and dispatch modes on per-thread stacks and every
exit pops the top, whoever pushed it; a region's hooks left on across the model's own code would
be popped by whatever scope of the caller ends first (a block run alone, a ``with`` around one
block, an exception or ``KeyboardInterrupt`` between blocks), and every later step of the thread,
on any model, would save its tensors into a dead region. So the hooks are on only within one
block's forward, which turns them on (a ``KeyboardInterrupt`` in a pre-hook after ours is
followed by no forward and no post-hook), and where its post-hook (``always_call``, for
exceptions) or its forward (for ``KeyboardInterrupt``, which skips post-hooks) takes them off
again. A segment whose blocks stop coming (an exception, a forward cut short, a block called
on its own) is finished where it stopped: the next call that does not continue it drops it, and
recomputation replays the blocks that ran. ``plans_suspended`` (suspension.py) makes the hooks
stand aside.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import UsageError
from .ambient import RngSnapshot
from .compiled import compiling, lower_for_compile
from .debug import _debug_state
from .fates import PolicyLike, resolve_policy
from .module import refuse_checkpointed_modules
from .region import _Region
from .suspension import _register_handle, _standing_aside, _unregister_handle
from .tensors import detached_like, first_tensor, storage_key

__all__ = ["checkpoint_segments", "SegmentsHandle"]


class _Segment:
    """Blocks ``start``..``end`` (inclusive) of one chain, checkpointed as one region."""

    def __init__(self, start: int, end: int, policy: PolicyLike, name: str) -> None:
        self.start = start
        self.end = end
        self.policy = policy
        self.name = name

    def contains(self, other: _Segment) -> bool:
        return self.start <= other.start and other.end <= self.end


def continues_chain(args: tuple, kwargs: dict, previous_output: Any) -> bool:
    """Whether a block called with ``(args, kwargs)`` takes ``previous_output`` (the previous
    block's hidden state) as its own hidden state: its first tensor argument.

    Passing it elsewhere is not enough: a BART decoder layer gets the encoder's last output as
    ``encoder_hidden_states`` while its hidden state is the decoder's embedding.

    Example:
        >>> import torch
        >>> x, memory = torch.ones(2), torch.zeros(2)
        >>> continues_chain((x,), {}, x), continues_chain((memory,), {"context": x}, x)
        (True, False)
    """
    return previous_output is not None and is_alias(first_tensor((args, kwargs)), previous_output)


def is_alias(tensor: Any, other: torch.Tensor) -> bool:
    """``tensor`` is ``other``, or the same elements of the same storage under another tensor
    object: what a hook that passes a block's input through an identity autograd function
    gives (FSDP2's pre-forward hook does, to hook the input's gradient).

    Example:
        >>> import torch
        >>> x = torch.ones(2, 3)
        >>> is_alias(x, x), is_alias(x.view_as(x), x), is_alias(x[0], x), is_alias(x + 0, x)
        (True, True, False, False)
    """
    if tensor is other:
        return True
    if not isinstance(tensor, torch.Tensor) or storage_key(tensor) is None:
        return False
    return (
        storage_key(tensor) == storage_key(other)
        and tensor.shape == other.shape
        and tensor.stride() == other.stride()
        and tensor.storage_offset() == other.storage_offset()
        and tensor.dtype == other.dtype
    )


class _CallRecord:
    """How a block inside a segment was called, with the hidden-state input left as a hole
    (a hole wherever the previous output appears: ``block(x, residual=x)`` gets it twice)."""

    def __init__(self, args: tuple, kwargs: dict, chain_input: torch.Tensor) -> None:
        leaves, self.spec = tree_flatten((args, kwargs))
        # The model's loop may draw random numbers between blocks (LayerDrop's torch.rand):
        # recomputation, which calls the blocks back to back, starts each from its own state.
        self.rng = RngSnapshot([leaf for leaf in leaves if isinstance(leaf, torch.Tensor)])
        self.continues = continues_chain(args, kwargs, chain_input)
        self.holes = {i for i, leaf in enumerate(leaves)
                      if chain_input is not None and is_alias(leaf, chain_input)}
        # The other tensors (masks, position embeddings, ...) exist outside the blocks anyway;
        # detached, so recomputation builds a graph of its own, with the same requires_grad.
        self.leaves = [
            None if i in self.holes else detached_like(leaf) if isinstance(leaf, torch.Tensor)
            else leaf
            for i, leaf in enumerate(leaves)
        ]

    def call_with(self, chain_input: torch.Tensor) -> tuple[tuple, dict]:
        leaves = [chain_input if i in self.holes else leaf for i, leaf in enumerate(self.leaves)]
        return tree_unflatten(leaves, self.spec)


class _Run:
    """One forward pass through one segment: how its blocks were called, and the region's
    hooks, entered around each of its blocks' calls while the run is open.

    The region replays the run (``region.fn``), so once closed the run must not hold the
    region (its hooks do): the cycle would keep the region's saved inputs alive until the
    garbage collector runs, a hidden state per segment through the rest of backward.
    """

    def __init__(self, segment: _Segment, hooks: list[Any]) -> None:
        self.segment = segment
        self.hooks = hooks  # context managers, re-entered around each block's call
        self.records: list[_CallRecord] = []
        self.last_output: torch.Tensor | None = None
        self.next_index = segment.start  # the block the run expects next

    def continues_at(self, index: int) -> bool:
        """Whether block ``index`` is the next one of this run (not its first)."""
        return self.segment.start < index == self.next_index <= self.segment.end

    def close(self) -> None:
        self.hooks = []
        self.last_output = None


class _Frame:
    """The runs open in one forward pass, or in one recomputation of ``replaying`` (where
    only segments inside it open: R3)."""

    def __init__(self, replaying: _Segment | None) -> None:
        self.replaying = replaying
        self.runs: dict[_Segment, _Run] = {}


class _BlockCall:
    """One call of a block inside a run: the hooks its pre-hook chose, entered once its forward
    starts (``SegmentsHandle.enter_hooks``), exited by its post-hook."""

    def __init__(self, index: int, hooks: list[contextlib.AbstractContextManager]) -> None:
        self.index = index
        self.hooks = hooks
        self.started = False
        self.entered = contextlib.ExitStack()


class _ThreadState(threading.local):
    """A handle's state on one thread (recomputation runs on autograd's thread on CUDA):
    its frames, innermost last, and the block calls in progress inside a run, innermost
    last (``_BlockCall``: the hooks to turn on while the block's forward runs)."""

    def __init__(self) -> None:
        self.frames: list[_Frame] = [_Frame(None)]
        self.entered: list[_BlockCall] = []


class SegmentsHandle:
    """Returned by ``checkpoint_segments``; ``remove()`` puts the blocks back as they were."""

    def __init__(self, blocks: Sequence[nn.Module], segments: list[_Segment]) -> None:
        self.blocks = list(blocks)
        self.segments = segments
        self.local = _ThreadState()
        # Outer segments open first and close last, so the hook stacks stay properly nested.
        self.opening = {
            j: sorted((s for s in segments if s.start == j), key=lambda s: s.start - s.end)
            for j in range(len(self.blocks))
        }
        self.closing = {
            j: sorted((s for s in segments if s.end == j), key=lambda s: s.end - s.start)
            for j in range(len(self.blocks))
        }
        self.hooks = []
        # Under torch.compile the hooks stand aside and each block of a segment runs as a
        # torch.utils.checkpoint region of its own (compiled.py: what survives compilation).
        self.lowered = [
            lower_for_compile(block, _policy_of(index, segments),
                               functools.partial(self.interrupted, index),
                               functools.partial(self.enter_hooks, index))
            for index, block in enumerate(self.blocks)
            if any(s.start <= index <= s.end for s in segments)
        ]
        for index, block in enumerate(self.blocks):
            self.hooks.append(
                block.register_forward_pre_hook(
                    functools.partial(self.before_block, index), with_kwargs=True
                )
            )
            self.hooks.append(
                block.register_forward_hook(
                    functools.partial(self.after_block, index), always_call=True
                )
            )
        _register_handle(self)

    def remove(self) -> None:
        """Remove the hooks; the blocks run exactly as before."""
        _unregister_handle(self)
        for frame in self.local.frames:
            self.abort_runs(frame)
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        for restore in self.lowered:
            restore()
        self.lowered = []

    # ---- hooks ----------------------------------------------------------------------------

    def before_block(self, index: int, block: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled() or compiling() or _standing_aside(self):
            return
        frame = self.local.frames[-1]
        self.drop_calls_never_run()
        self.finish_runs_cut_short(frame, index)
        hooks: list[contextlib.AbstractContextManager] = []
        try:
            # Outer runs first: a tensor belongs to the innermost region (R1), whose hooks
            # are on top; a segment opening here saves its inputs into the ones around it (R2),
            # whose hooks are on only while it does.
            with contextlib.ExitStack() as around_opening:
                for run in sorted(frame.runs.values(), key=lambda run: _nesting(run.segment)):
                    self.record_call(run, index, args, kwargs)
                    hooks += run.hooks
                on = 0
                for segment in self.opening[index]:
                    if self.may_open(frame, segment):
                        for hook in hooks[on:]:
                            around_opening.enter_context(hook)
                        on = len(hooks)
                        hooks += self.open(frame, segment, args, kwargs).hooks
        except BaseException:
            self.abort_runs(frame)
            raise
        if frame.runs:
            self.local.entered.append(_BlockCall(index, hooks))

    def enter_hooks(self, index: int) -> None:
        """Block ``index``'s forward starts: turn on the hooks its pre-hook chose.

        Not in the pre-hook: a ``KeyboardInterrupt`` from a pre-hook registered after ours
        (which torch follows with no post-hook and no forward) would leave them on torch's
        stack, and every later step of the thread would save its tensors into a dead region.
        From here on the forward's own ``except`` (``interrupted``) or the post-hook takes them
        off again."""
        calls = self.local.entered
        if calls and calls[-1].index == index and not calls[-1].started:
            call = calls[-1]
            call.started = True
            for hook in call.hooks:
                call.entered.enter_context(hook)

    def drop_calls_never_run(self) -> None:
        """Forget the calls whose forward never started (a pre-hook after ours interrupted):
        nothing of theirs is on, and their runs are finished like any cut short."""
        calls = self.local.entered
        while calls and not calls[-1].started:
            calls.pop()

    def after_block(self, index: int, block: nn.Module, args: tuple, output: Any) -> None:
        if compiling():
            return
        entered = self.take_entered(index)
        if entered is None:  # no run of ours around this call (no grad, suspended, none)
            return
        entered.close()  # the regions' hooks off, innermost first
        frame = self.local.frames[-1]
        if output is None and sys.exc_info()[0] is not None:  # it raised: leave nothing open
            self.abort_runs(frame)
            return
        for run in frame.runs.values():
            if run.next_index == index:
                run.last_output = first_tensor(output)
                run.next_index = index + 1
        for segment in self.closing[index]:
            run = frame.runs.pop(segment, None)
            if run is not None:
                run.close()

    def interrupted(self, index: int) -> None:
        """Block ``index``'s forward raised a ``KeyboardInterrupt`` (or another exception
        that is not an ``Exception``), which torch runs no post-hook for: do its part."""
        entered = self.take_entered(index)
        if entered is not None:
            entered.close()
            self.abort_runs(self.local.frames[-1])

    def take_entered(self, index: int) -> contextlib.ExitStack | None:
        """The hooks the pre-hook of this call of block ``index`` entered, if it did."""
        calls = self.local.entered
        if calls and calls[-1].index == index:
            return calls.pop().entered
        return None

    # ---- opening, recording, closing ------------------------------------------------------

    def may_open(self, frame: _Frame, segment: _Segment) -> bool:
        # While a segment is recomputed, only segments inside it open (R3); it does not reopen.
        if segment in frame.runs:
            return False
        if frame.replaying is not None:
            return frame.replaying.contains(segment) and segment is not frame.replaying
        return True

    def open(self, frame: _Frame, segment: _Segment, args: tuple, kwargs: dict) -> _Run:
        region = _Region(
            None,  # set below, once the run exists: recomputation replays this run's calls
            name=segment.name,
            policy=resolve_policy(segment.policy),
            preserve_rng_state=True,
            debug=_debug_state.enabled,
        )
        region.save_inputs(args, kwargs)
        run = _Run(segment, region.forward_hooks())
        region.fn = functools.partial(self.replay, segment, run)
        frame.runs[segment] = run
        return run

    def record_call(self, run: _Run, index: int, args: tuple, kwargs: dict) -> None:
        record = _CallRecord(args, kwargs, run.last_output)
        if not record.continues:
            raise UsageError(
                f"gradckpt: block {index} of segment {run.segment.name!r} was not called with "
                f"the output of block {index - 1}: something runs between the two blocks, so "
                "they cannot be recomputed as one segment. Checkpoint these blocks one by one "
                "(segments of length 1) instead."
            )
        run.records.append(record)

    def finish_runs_cut_short(self, frame: _Frame, index: int) -> None:
        """Close the runs that block ``index`` does not continue: their blocks stopped coming
        (an exception or interrupt between blocks, a forward that ended early, a block called
        on its own). Their regions recompute the blocks that ran."""
        for segment, run in list(frame.runs.items()):
            if not run.continues_at(index):
                del frame.runs[segment]
                run.close()

    def abort_runs(self, frame: _Frame) -> None:
        for run in frame.runs.values():
            run.close()
        frame.runs.clear()

    # ---- recomputation --------------------------------------------------------------------

    def replay(self, segment: _Segment, run: _Run, *args: Any, **kwargs: Any) -> Any:
        """Run the segment's blocks again, each fed the previous one's output: the blocks the
        run saw (all of them, unless its forward pass stopped early)."""
        frames = self.local.frames
        frame = _Frame(replaying=segment)
        frames.append(frame)
        try:
            output = self.blocks[segment.start](*args, **kwargs)
            for index, record in enumerate(run.records, start=segment.start + 1):
                block_args, block_kwargs = record.call_with(first_tensor(output))
                with record.rng.replayed():
                    output = self.blocks[index](*block_args, **block_kwargs)
            return output
        finally:
            # Recomputation stops in the middle of a segment (R5): close what it opened.
            self.abort_runs(frame)
            frames.pop()


def _nesting(segment: _Segment) -> tuple[int, int]:
    """Sort key putting a segment before the segments inside it."""
    return (segment.start, -segment.end)


def _policy_of(index: int, segments: list[_Segment]) -> PolicyLike:
    """The policy of the segment holding block ``index`` that has one (at most one does:
    ``apply`` puts policies on top-level segments without children)."""
    return next((s.policy for s in segments
                 if s.start <= index <= s.end and s.policy is not None), None)


def checkpoint_segments(
    blocks: Sequence[nn.Module],
    segments: Sequence[tuple[int, int]],
    *,
    policies: Sequence[PolicyLike] | None = None,
    names: Sequence[str] | None = None,
) -> SegmentsHandle:
    """Checkpoint runs of consecutive blocks of a chain, each run as one region.

    ``blocks`` is the chain in execution order (``gradckpt.find_blocks`` finds it); each
    segment ``(start, end)`` is inclusive. Segments are disjoint or nested (an inner segment is
    recomputed, with bounded memory, while its outer one is). Only the first block's inputs of a
    top-level segment are kept through the forward pass. The model's ``forward`` is not
    changed: its loop must call block ``j + 1`` with block ``j``'s output, which is checked.

    Example:
        >>> import torch, gradckpt
        >>> from gradckpt.engine import checkpoint_segments
        >>> chain = torch.nn.Sequential(*[torch.nn.Linear(8, 8) for _ in range(4)])
        >>> handle = checkpoint_segments(list(chain), [(0, 1), (2, 3)])
        >>> chain(torch.randn(2, 8, requires_grad=True)).sum().backward()
        >>> handle.remove()
    """
    blocks = list(blocks)
    if not all(isinstance(block, nn.Module) for block in blocks):
        raise UsageError("checkpoint_segments() needs a list of nn.Module blocks")
    policies = list(policies) if policies is not None else [None] * len(segments)
    names = list(names) if names is not None else [f"blocks {s}-{e}" for s, e in segments]
    if not len(policies) == len(names) == len(segments):
        raise UsageError("checkpoint_segments(): give one policy and one name per segment")
    made = []
    for (start, end), policy, name in zip(segments, policies, names, strict=True):
        in_range = isinstance(start, int) and isinstance(end, int)
        if not (in_range and 0 <= start <= end < len(blocks)):
            raise UsageError(
                f"segment {(start, end)!r} is not a range of block indices: it needs "
                f"0 <= start <= end < {len(blocks)} (the number of blocks)"
            )
        resolve_policy(policy)
        made.append(_Segment(start, end, policy, name))
    refuse_checkpointed_modules(
        [(name, blocks[index]) for (start, end), name in zip(segments, names, strict=True)
         for index in range(start, end + 1)])
    for first in made:
        for second in made:
            if first is second:
                continue
            disjoint = first.end < second.start or second.end < first.start
            if not (disjoint or first.contains(second) or second.contains(first)):
                raise UsageError(
                    f"segments {(first.start, first.end)} and {(second.start, second.end)} "
                    "overlap without one containing the other; segments must be disjoint or "
                    "nested"
                )
            if (first.start, first.end) == (second.start, second.end):
                raise UsageError(f"segment {(first.start, first.end)} is given twice")
    return SegmentsHandle(blocks, made)
