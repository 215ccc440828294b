"""Identical blocks traced once: on fake tensors, the blocks after the first few stand in.

``estimate`` runs ``profile`` on fake tensors, where an operation costs the same to trace
whatever its size: a step of Llama-3-8B traces its 32 layers' thousand operations each, every
time the step runs (to record the blocks' calls, to meter the step, for each chunk count of the
output head). Under a modeled clock (and only there: real steps are measured as they run) a
chain of more than ``KEPT`` blocks built alike runs its steps with its first ``KEPT`` blocks
and the rest standing in: each returns its input, computing nothing. The step's memory and time
are then put together as the whole chain has them, exactly:

1. The step is metered with marks (``StepMemory(marked=...)``): where each kept block's forward
   starts and returns, when the gradient of its input arrives, and the total after every
   operation. The kept blocks but the first and the last are *middles* (blocks 1 and 2 of 4).
2. Checked, or the step is traced again with every block (``NotSpliceable``): the marks come in
   the order a chain runs; between blocks, and while the stand-ins run, no operation runs and
   no second passes (the hidden state before may be let go as the loop binds the next: the
   same after every block); and the middles' forwards, and their backwards, are the same
   operation by operation (the total after each, relative to where each starts).
3. The whole chain's step is the kept one with ``n - KEPT`` more middles run before the last
   kept block, and their backwards after its backward: each adds its forward's bytes and
   seconds from there on, and its backward's after that. A phase's peak is the most of the
   kept step's stretches in it (shifted by what the middles before them add) and of the added
   middles' peaks, worked out in closed form (``splice``). Seconds add up exactly
   (``clock.Seconds``): the step's time is the sum of the same operations' times.

Each block standing in is measured on its own as the last kept block (``computes_alike``): its
call in the step (recorded as it stood in) has the same shapes, side inputs and settings
(``block_kind``), and its forward dispatches the same operations on tensors of the same shapes
from the same places (its parameters by name, its arguments, what it made before) and saves
the same tensors for backward: a block told apart by a setting (its index choosing a sliding
window, say) is caught there, and the step traced whole.

Example:
    >>> import torch, gradckpt
    >>> from gradckpt.toy_models import GPTConfig, TinyGPT
    >>> with torch.device("meta"):
    ...     model = TinyGPT(GPTConfig(n_layer=6, n_embd=32, n_head=2, block_size=16))
    >>> idx = torch.randint(0, 512, (2, 16), device="meta")
    >>> predicted = gradckpt.estimate(model, {"idx": idx, "targets": idx})
    >>> predicted.notes["blocks_traced_in_steps"]  # 4 of the 6 ran in the whole steps
    4
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from ..engine import first_tensor, storage_key
from ..engine.module import replace_forward
from ..errors import GradckptError
from . import clock
from .recording import BlockCall
from .step_memory import StepMemory
from .tensors import returns_tensor, saved_apart

__all__ = ["KEPT", "NotSpliceable", "StandIns", "splice"]

KEPT = 4
"""Blocks that run in the steps: the first, two middles to compare, and the last."""


class NotSpliceable(GradckptError):
    """The kept step does not add up to the whole chain's (say why): trace every block."""


@dataclass(frozen=True)
class StandIns:
    """The chain ``blocks`` with blocks ``kept`` and after standing in during the steps."""

    blocks: list[nn.Module]
    kept: int
    _signatures: dict[int, list] = field(default_factory=dict)  # the kept block's, by id

    @classmethod
    def of(cls, blocks: list[nn.Module]) -> StandIns | None:
        """Stand-ins for a chain of more than ``KEPT`` blocks whose blocks after the first are
        built alike (class, parameters and buffers: names, shapes, strides, dtypes, which are
        trained; train or eval mode) and share no parameter; None for any other chain."""
        if len(blocks) <= KEPT:
            return None
        shapes = {_built(block) for block in blocks[1:]}
        parameters = [id(p) for block in blocks for p in block.parameters()]
        if len(shapes) != 1 or len(parameters) != len(set(parameters)):
            return None
        return cls(list(blocks), KEPT)

    @property
    def standing_in(self) -> range:
        return range(self.kept, len(self.blocks))

    @contextlib.contextmanager
    def in_place(self) -> Iterator[None]:
        """The blocks after the kept ones return their input (the hidden state, their first
        tensor argument) while inside; their hooks still run, so recording notes their calls.
        A kept block returning more than one tensor cannot be stood for: ``NotSpliceable``."""
        last = self.blocks[self.kept - 1]
        returned_a_tensor: list[bool] = []  # not the output: holding it would change the step
        hook = last.register_forward_hook(
            lambda module, args, output: returned_a_tensor.append(isinstance(output, torch.Tensor)))

        def identity(*args: Any, **kwargs: Any) -> torch.Tensor:
            hidden = first_tensor((args, kwargs))
            if hidden is None or not returned_a_tensor or not returned_a_tensor[-1]:
                raise NotSpliceable("the blocks return more than their hidden state")
            return hidden

        restores = [replace_forward(block, identity) for block in self.blocks[self.kept:]]
        try:
            yield
        finally:
            hook.remove()
            for restore in restores:
                restore()

    @contextlib.contextmanager
    def first_alone(self) -> Iterator[None]:
        """Inside ``in_place``: the kept blocks after the first stand in too, for a step run
        for its output alone (the loop's ``out`` before a metered step), where only the
        output's shapes count: the same as with every kept block, whose output has the hidden
        state's shape. The caller makes sure the first block's output needs a gradient (a
        frozen chain would leave the loss with none)."""

        def hidden_state(*args: Any, **kwargs: Any) -> torch.Tensor:
            return first_tensor((args, kwargs))

        restores = [replace_forward(block, hidden_state) for block in self.blocks[1:self.kept]]
        try:
            yield
        finally:
            for restore in restores:
                restore()

    def step_memory(self, device: torch.device) -> StepMemory:
        """A ``StepMemory`` of the chain that marks the kept blocks (``splice`` reads it)."""
        return StepMemory(self.blocks[0], self.blocks[-1], device, marked=self.blocks[:self.kept])

    def computes_alike(self, block: nn.Module, call: BlockCall, kept: nn.Module,
                       kept_call: BlockCall) -> None:
        """Raise ``NotSpliceable`` unless ``block`` on ``call`` runs as ``kept`` (the last kept
        block) on ``kept_call``: the same operations, on tensors of the same shapes and
        strides from the same places, saving the same tensors for backward."""
        with clock.set_aside():  # a check, not a measurement: untimed
            if id(kept) not in self._signatures:
                self._signatures[id(kept)] = _forward_signature(kept, kept_call)
            alike = _forward_signature(block, call) == self._signatures[id(kept)]
        if not alike:
            raise NotSpliceable("a block standing in computes otherwise than the kept ones")


def splice(memory: StepMemory, kept: int, count: int) -> tuple[StepMemory, float]:
    """The step of the whole chain of ``count`` blocks from ``memory``, the marked step of its
    first ``kept`` blocks (the rest standing in), and the seconds the blocks that stood in add.
    Raises ``NotSpliceable`` where the kept step does not show that it adds up (see the
    module)."""
    marks = memory.marks
    at = {(mark.what, mark.block): index for index, mark in enumerate(marks)}
    expected = [("forward", None), ("returned", 0)]
    for block in range(1, kept):
        expected += [("forward", block), ("returned", block)]
    expected += [("head", None), ("backward", None)]
    expected += [("backward", block) for block in range(kept - 1, 0, -1)]
    ending = [("after", None), ("end", None)] if ("after", None) in at else [("end", None)]
    if [(mark.what, mark.block) for mark in marks] != expected + ending:
        raise NotSpliceable("the step's marks are not a chain's")
    # Between blocks (and while the blocks stand in) nothing runs: no operation, no second;
    # what is let go there is the hidden state before, as the loop binds the next one.
    gaps = []
    for block in range(kept):
        returned = marks[at["returned", block]]
        following = marks[at["returned", block] + 1]
        if (following.operations, following.seconds, following.peak) != (
                returned.operations, returned.seconds, returned.current):
            raise NotSpliceable("something runs between blocks")
        gaps.append(following.current - returned.current)
    # The middles run alike, forward and backward, and so does what follows each: the last
    # kept block (whose gap is that of the whole chain's last block) and the blocks after it.
    middles = range(1, kept - 1)
    forwards = [_stretch(memory, marks[at["forward", b]], marks[at["returned", b]])
                + (gaps[b],) for b in middles]
    backwards = [_stretch(memory, marks[at["backward", b + 1]], marks[at["backward", b]])
                 for b in middles]
    if len(middles) < 2 or any(stretch != forwards[0] for stretch in forwards) or any(
            stretch != backwards[0] for stretch in backwards) or gaps[-1] != gaps[-2]:
        raise NotSpliceable("the middle blocks differ")

    middle = kept - 2  # one middle's forward (and the stillness after it), then its backward
    starts, ends = marks[at["forward", middle]], marks[at["forward", middle + 1]]
    forward_bytes = ends.current - starts.current
    forward_rise = max(marks[at["returned", middle]].peak, ends.peak) - starts.current
    forward_seconds = ends.seconds - starts.seconds
    starts, ends = marks[at["backward", middle + 1]], marks[at["backward", middle]]
    backward_bytes = ends.current - starts.current
    backward_rise = ends.peak - starts.current
    backward_seconds = ends.seconds - starts.seconds

    added = count - kept
    forward_at, backward_at = at["forward", kept - 1], at["backward", kept - 1]
    whole = StepMemory(memory.first, memory.last, memory.device)
    whole.keep_before_chain(memory)
    for index, mark in enumerate(marks):
        shift = (0 if index <= forward_at else added * forward_bytes if index <= backward_at
                 else added * (forward_bytes + backward_bytes))
        whole.highest[mark.phase] = max(whole.highest[mark.phase], mark.peak + shift)
    # The added middles, one after another from where the last kept block started (forward),
    # and from where its backward ended: the highest of them is the first or the last.
    start = marks[forward_at].current
    whole.highest["forward"] = max(whole.highest["forward"], start + forward_rise
                                   + max(0, (added - 1) * forward_bytes))
    start = marks[backward_at].current + added * forward_bytes
    whole.highest["backward"] = max(whole.highest["backward"], start + backward_rise
                                    + max(0, (added - 1) * backward_bytes))
    # In the whole chain the last block's gap (the hidden state before it let go) comes after
    # its forward returned, in the head's phase: the head starts from where it returned.
    last_returned = marks[at["returned", kept - 1]].current + added * forward_bytes
    whole.highest["head"] = max(whole.highest["head"], last_returned)
    whole.start = memory.start
    whole.chain_forward_start = memory.chain_forward_start  # before any block: as it was
    whole.chain_backward_start = memory.chain_backward_start + added * forward_bytes
    if memory.chain_backward_end:
        whole.chain_backward_end = memory.chain_backward_end + added * (
            forward_bytes + backward_bytes)
    whole.end = memory.end + added * (forward_bytes + backward_bytes)
    whole.peak = max(whole.highest.values())
    return whole, added * (forward_seconds + backward_seconds)


def _stretch(memory: StepMemory, starts: Any, ends: Any) -> tuple:
    """What happened between two marks, relative to where it started: bytes at the end, the
    most, the operations and the total after each."""
    return (ends.current - starts.current, ends.peak - starts.current,
            ends.operations - starts.operations,
            tuple(total - starts.current
                  for total in memory.trace[starts.operations:ends.operations]))


def _built(block: nn.Module) -> tuple:
    """How a block is built: its class, its parameters and buffers, train or eval."""
    return (
        getattr(type(block), "_gradckpt_original_class", type(block)),
        block.training,
        tuple((name, tuple(p.shape), p.stride(), p.dtype, p.requires_grad)
              for name, p in block.named_parameters()),
        tuple((name, tuple(b.shape), b.stride(), b.dtype) for name, b in block.named_buffers()),
    )


def _forward_signature(block: nn.Module, call: BlockCall) -> list:
    """The block's forward on ``call``'s arguments, operation by operation: each operation
    and its arguments and outputs (tensors by shape, strides, dtype, whether they need a
    gradient and where their memory comes from: a parameter or buffer by name, an argument
    by position, or the n-th storage the forward made), and each tensor saved for backward."""
    places: dict[Any, Any] = {}
    for name, tensor in (*block.named_parameters(), *block.named_buffers()):
        places.setdefault(storage_key(tensor), ("parameter", name))
    args, kwargs, _ = call.fresh()
    for position, leaf in enumerate(tree_flatten((args, kwargs))[0]):
        if isinstance(leaf, torch.Tensor):
            places.setdefault(storage_key(leaf), ("argument", position))
    with _Signature(places) as signature, torch.autograd.graph.saved_tensors_hooks(
            signature.saved, lambda tensor: tensor):
        block(*args, **kwargs)
    return signature.events


class _Signature(TorchDispatchMode):
    def __init__(self, places: dict[Any, Any]) -> None:
        super().__init__()
        self.places = places
        self.events: list = []
        self.made = 0
        self.held: list[torch.UntypedStorage] = []  # a freed storage's key could come back

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False  # on fake tensors only, never compiled

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        output = func(*args, **(kwargs or {}))
        if returns_tensor(func):  # questions about a tensor come and go with fake caches
            self.events.append((func, self._describe(args), self._describe(kwargs or {}),
                                self._describe(output)))
        return output

    def saved(self, tensor: torch.Tensor) -> torch.Tensor:
        self.events.append(("saved", self._describe(tensor)))
        return saved_apart(tensor)

    def _describe(self, value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            key = storage_key(value)
            if key not in self.places:
                self.places[key] = ("made", self.made)
                self.made += 1
                self.held.append(value.untyped_storage())
            return (self.places[key], tuple(value.shape), value.stride(),
                    value.storage_offset(), value.dtype, value.requires_grad)
        if isinstance(value, (list, tuple)):
            return tuple(self._describe(item) for item in value)
        if isinstance(value, dict):
            return tuple((key, self._describe(item)) for key, item in value.items())
        return repr(value)
