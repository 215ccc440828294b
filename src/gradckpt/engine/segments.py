"""Checkpointed segments: several consecutive blocks, called by the model's own loop, as one region.

``checkpoint(fn, ...)`` needs one callable that runs the whole region. A model's chain of blocks
is not one: its ``forward`` calls ``block(hidden, ...)`` for each block in a loop we do not own.
``checkpoint_segments(blocks, [(0, 3), (4, 7)])`` makes blocks 0-3 one region and 4-7 another all
the same, with hooks on the blocks:

- the first block's pre-hook opens the region: it saves that block's inputs (the only tensors the
  region keeps) and pushes the region's saved-tensor hooks;
- each later block's pre-hook records how it was called (its other arguments: attention masks,
  position embeddings) and checks that its hidden-state input *is* the previous block's output —
  otherwise something runs between the blocks and they cannot form one region;
- the last block's post-hook closes the region.

Recomputation calls the blocks again, in order, feeding each block's output to the next. Segments
may nest (a segment inside a segment, as optimal schedules do): the outer one is opened first and
closed last, and while a segment is being recomputed only segments inside it open (engine rule R3).
This is the mechanism behind plans whose segments span more than one block; a single block can
also use ``gradckpt.checkpoint_module``.
"""

from __future__ import annotations

import contextlib
import functools
import sys
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import UsageError
from ..policies import PolicyLike, resolve_policy
from .compiled import compiling, torch_checkpoint
from .debug import _debug_state
from .module import replace_forward
from .policy_mode import _PolicyMode
from .region import _Region, _unpack
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
    """One forward pass through one segment: how its blocks were called.

    The region replays the run (``region.fn``), so the run must not hold the region: the
    cycle would keep the region's saved inputs alive until the garbage collector runs, a
    hidden state per segment through the rest of backward.
    """

    def __init__(self, segment: _Segment, contexts: contextlib.ExitStack) -> None:
        self.segment = segment
        self.contexts = contexts
        self.records: list[_CallRecord] = []
        self.last_output: torch.Tensor | None = None


class _Replaying(threading.local):
    def __init__(self) -> None:
        self.stack: list[_Segment] = []


class SegmentsHandle:
    """Returned by ``checkpoint_segments``; ``remove()`` puts the blocks back as they were."""

    def __init__(self, blocks: Sequence[nn.Module], segments: list[_Segment]) -> None:
        self.blocks = list(blocks)
        self.segments = segments
        self.runs: dict[_Segment, _Run] = {}
        self.replaying = _Replaying()
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
            _lower_for_compile(block, _policy_of(index, segments))
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

    def remove(self) -> None:
        """Remove the hooks; the blocks run exactly as before."""
        self.abort_runs()
        for hook in self.hooks:
            hook.remove()
        self.hooks = []
        for restore in self.lowered:
            restore()
        self.lowered = []

    # ---- hooks ----------------------------------------------------------------------------

    def before_block(self, index: int, block: nn.Module, args: tuple, kwargs: dict) -> None:
        if not torch.is_grad_enabled() or compiling():
            return
        for run in self.runs.values():
            if run.segment.start < index <= run.segment.end:
                self.record_call(run, index, args, kwargs)
        for segment in self.opening[index]:
            if self.may_open(segment):
                self.open(segment, args, kwargs)

    def after_block(self, index: int, block: nn.Module, args: tuple, output: Any) -> None:
        if compiling():
            return
        if output is None and sys.exc_info()[0] is not None:  # it raised: leave no hooks behind
            self.abort_runs()
            return
        for run in self.runs.values():
            if run.segment.start <= index <= run.segment.end:
                run.last_output = first_tensor(output)
        for segment in self.closing[index]:
            run = self.runs.pop(segment, None)
            if run is not None:
                run.contexts.close()
                run.last_output = None  # the run lives on for recomputation; this must not

    # ---- opening, recording, closing ------------------------------------------------------

    def may_open(self, segment: _Segment) -> bool:
        # While a segment is recomputed, only segments inside it open (R3); it does not reopen.
        if self.replaying.stack:
            inner_most = self.replaying.stack[-1]
            return inner_most.contains(segment) and segment is not inner_most
        return segment not in self.runs

    def open(self, segment: _Segment, args: tuple, kwargs: dict) -> None:
        region = _Region(
            None,  # set below, once the run exists: recomputation replays this run's calls
            name=segment.name,
            policy=resolve_policy(segment.policy),
            preserve_rng_state=True,
            debug=_debug_state.enabled,
        )
        region.save_inputs(args, kwargs)
        contexts = contextlib.ExitStack()
        if region.policy is not None or region.debug:
            contexts.enter_context(_PolicyMode(region, recomputing=False))
        contexts.enter_context(
            torch.autograd.graph.saved_tensors_hooks(region.pack_during_forward, _unpack)
        )
        run = _Run(segment, contexts)
        region.fn = functools.partial(self.replay, segment, run)
        self.runs[segment] = run

    def record_call(self, run: _Run, index: int, args: tuple, kwargs: dict) -> None:
        record = _CallRecord(args, kwargs, run.last_output)
        if not record.continues:
            self.abort_runs()
            raise UsageError(
                f"gradckpt: block {index} of segment {run.segment.name!r} was not called with "
                f"the output of block {index - 1}: something runs between the two blocks, so "
                "they cannot be recomputed as one segment. Checkpoint these blocks one by one "
                "(segments of length 1) instead."
            )
        run.records.append(record)

    def abort_runs(self) -> None:
        # Innermost first: they were opened last.
        for segment in sorted(self.runs, key=lambda s: s.start - s.end):
            self.runs.pop(segment).contexts.close()

    # ---- recomputation --------------------------------------------------------------------

    def replay(self, segment: _Segment, run: _Run, *args: Any, **kwargs: Any) -> Any:
        """Run the segment's blocks again, each fed the previous one's output."""
        self.replaying.stack.append(segment)
        try:
            output = self.blocks[segment.start](*args, **kwargs)
            for record, block in zip(
                run.records, self.blocks[segment.start + 1 : segment.end + 1], strict=True
            ):
                block_args, block_kwargs = record.call_with(first_tensor(output))
                output = block(*block_args, **block_kwargs)
            return output
        finally:
            self.replaying.stack.pop()


def _policy_of(index: int, segments: list[_Segment]) -> PolicyLike:
    """The policy of the segment holding block ``index`` that has one (at most one does:
    ``apply`` puts policies on top-level segments without children)."""
    return next((s.policy for s in segments
                 if s.start <= index <= s.end and s.policy is not None), None)


def _lower_for_compile(block: nn.Module, policy: PolicyLike) -> Callable[[], None]:
    """Give ``block`` a forward that, while ``torch.compile`` traces it with gradients, runs
    as one ``torch.utils.checkpoint`` region under ``policy``, and otherwise is the block's
    own forward; return what puts the block's forward back."""
    return replace_forward(block, _CompiledForward(block, policy))


class _CompiledForward:
    """A planned block's ``forward`` (see ``_lower_for_compile``).

    An object holding the block rather than a closure over its bound ``forward``: a deep copy
    of the model (a reference model, an EMA copy) copies it with the block, so the copy's
    forward runs the copy's parameters, where a copied closure would run the original's.
    """

    def __init__(self, block: nn.Module, policy: PolicyLike) -> None:
        self.block = block
        self.policy = policy
        self.own = block.__dict__.get("forward")  # a forward set on the instance, if any
        functools.update_wrapper(self, block.forward)  # its name, doc and signature

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self.own or functools.partial(type(self.block).forward, self.block)
        if compiling() and torch.is_grad_enabled():
            return torch_checkpoint(forward, args, kwargs, self.policy)
        return forward(*args, **kwargs)


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
