"""Measuring a model: one real training step, and each block of its chain on its own.

``profile(model, sample)`` runs a warm-up step and a few measured steps of the model as it is
(no checkpointing) and records what ``Profile`` holds:

- the step's peak memory (MemTracker's "Total" on CPU, ``max_memory_allocated`` on CUDA) and
  its median time;
- per block, from the block's real inputs in that step, re-run on its own: input and output
  bytes; the bytes its autograd graph keeps (the distinct storages of the tensors it saves for
  backward, parameters excluded, its input included when saved; side inputs such as an
  encoder's output counted once for the chain); the transient memory of its forward and
  backward pass (MemTracker / the CUDA allocator, above what existed before); its forward and
  backward time and what checkpointing it adds (its forward timed inside the measured steps,
  see ``gradckpt.measure.timing``; the others as multiples of its forward timed in the same rounds
  on its own, pooled over identical blocks); and the outputs and share
  of forward time of its matrix multiplies and attention kernels (what
  ``policy="save-matmuls"`` keeps).

``fixed_bytes`` is then whatever of the measured peak the chain model (``gradckpt.plan``) does not
explain: parameters, gradients, embeddings, logits. The model's parameters, gradients, buffers
and the RNG state are as they were before profiling.
"""

from __future__ import annotations

import functools
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..caches import caches_off
from ..engine import checkpoint, continues_chain, detached_like, first_tensor, storage_key
from ..errors import UsageError
from ..policies import PLANNED_POLICY, is_matmul_or_attention
from ..profile_types import BlockProfile, Profile
from .blocks import resolve_blocks
from .device import infer_device
from .meter import MemoryMeter
from .model_state import buffers_and_rng_preserved, gradients_preserved
from .step import loss_of, run_model, training_step
from .timing import BlockForwardTimer

__all__ = ["profile", "run_model", "loss_of"]


def profile(
    model: nn.Module,
    sample: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    blocks: Any = None,
    *,
    keep_output: bool = True,
    repeats: int = 3,
    progress: Callable[[int, int], None] | None = None,
) -> Profile:
    """Measure one training step of ``model`` on ``sample`` and each block of its chain.

    Args:
        model: the model, as it will be trained (its device, dtype, train/eval mode).
        sample: one batch: a tensor, a tuple of positional arguments or a dict of keywords.
        loss_fn: turns the output into the loss; default ``output.loss`` or ``output.sum()``.
        blocks: the chain (default: ``gradckpt.find_blocks(model)``, put in the order the
            blocks run on ``sample``); see ``resolve_blocks``. Given explicitly, it must be in
            that order.
        keep_output: the step holds the model's output until backward ends, as
            ``out = model(**batch); out.loss.backward()`` does (for a language model the
            logits stay alive). ``False`` for loops that drop it before backward, such as the
            Hugging Face Trainer's; see ``gradckpt.measure.step``.
        repeats: measured repetitions for every time (the median is kept).
        progress: called as ``progress(done, total)`` after each of the ``total`` steps of
            profiling (the CLI draws a bar with it; ``gradckpt.cli.progress.progress_bar``
            makes one). ``None``: nothing is reported.

    Hugging Face key/value caches are off while it measures (``gradckpt.caches``), as they
    are while a plan is applied.

    Example:
        >>> import torch, gradckpt
        >>> from gradckpt.models import GPTConfig, TinyGPT
        >>> model = TinyGPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
        >>> idx = torch.randint(0, 512, (2, 16))
        >>> measured = gradckpt.profile(model, {"idx": idx, "targets": idx}, repeats=1)
        >>> [block.name for block in measured.blocks]
        ['transformer.h.0', 'transformer.h.1']
        >>> measured.blocks[0].input_bytes == 2 * 16 * 32 * 4
        True
    """
    named_blocks = resolve_blocks(model, blocks)
    if not isinstance(keep_output, bool):
        raise UsageError(
            f"keep_output must be True (the loop holds the model's output until backward ends, "
            f"the default) or False (it drops it first, as the Hugging Face Trainer does); got "
            f"{keep_output!r}"
        )
    if repeats < 1:
        raise UsageError(f"repeats must be at least 1, got {repeats}")
    report = _progress_callback(progress)
    device = infer_device(model)
    modules = [m for _, m in named_blocks]
    steps = 1 + repeats + 1 + len(modules)  # warm-up, timed steps, memory step, each block
    with (
        gradients_preserved(model),
        buffers_and_rng_preserved(model),
        caches_off(model),
    ):
        done = 0

        def advance() -> None:
            nonlocal done
            done += 1
            report(done, steps)

        recording = _record_block_calls(model, sample, loss_fn, modules)
        if recording.order != list(range(len(modules))):
            ran = [named_blocks[index][0] for index in recording.order]
            if blocks is not None:
                raise UsageError(
                    f"blocks= must list the blocks in the order they run; on this sample they "
                    f"ran as {ran}"
                )
            # Found by structure (stacks in the order they were created: CLIP makes its text
            # tower first and runs its vision tower first); the cost model needs run order.
            named_blocks = [named_blocks[index] for index in recording.order]
            modules = [module for _, module in named_blocks]
        calls = [recording.calls[index] for index in recording.order]
        chain_breaks = recording.chain_breaks()

        def step() -> None:
            # As a training loop runs it: gradients start out as None (optimizer.zero_grad()).
            model.zero_grad(set_to_none=True)
            training_step(model, sample, loss_fn, keep_output)
            advance()

        step()  # warm-up: lazy initialisations, allocator caches
        with BlockForwardTimer(modules, device) as timer:

            def timed_step() -> None:
                timer.begin_step()
                step()
                timer.end_step()

            step_seconds = _median_seconds(timed_step, repeats, device)
        in_step_forward = timer.median_seconds()
        memory = _StepMemory(modules[0], modules[-1], device)
        model.zero_grad(set_to_none=True)  # the memory at the start has no gradients
        memory.measure(step, model, *_tensors(sample))
        measured = []
        saved_side_inputs = []
        time_ratios = []
        model_storages = {storage_key(t) for t in (*model.parameters(), *model.buffers())}
        for (name, module), call, gradient_bytes, forward_in_step in zip(
            named_blocks, calls, _gradient_bytes(modules), in_step_forward, strict=True
        ):
            block, saved_sides, ratios = _measure_block(
                name, module, call, repeats, device, gradient_bytes, forward_in_step,
                call.side_storages(model_storages),
            )
            measured.append(block)
            saved_side_inputs.append(saved_sides)
            time_ratios.append(ratios)
            advance()
    measured = _pooled_times(
        measured, time_ratios, [_kind(module, call) for module, call in zip(modules, calls,
                                                                             strict=True)]
    )
    measured, output_held_bytes = _with_side_inputs(
        measured, recording, chain_breaks, model_storages, saved_side_inputs,
        {storage_key(tensor) for tensor in _tensors(sample)},
        recording.output_storages if keep_output else set(),
    )
    between = recording.gradients_made_after()
    return _assemble(
        measured, memory, step_seconds, device, chain_breaks,
        sum(between[1:]) + output_held_bytes,
    )


def _progress_callback(progress: Any) -> Callable[[int, int], None]:
    """``progress`` as a callable; ``None`` and ``False`` (the old "no bar") report nothing."""
    if progress is None or progress is False:
        return lambda done, total: None
    if not callable(progress):
        raise UsageError(
            f"progress must be a callable taking (done, total), or None; got {progress!r}. "
            "For a bar on stderr: with gradckpt.cli.progress.progress_bar('profiling') as bar: "
            "gradckpt.profile(..., progress=bar)"
        )
    return progress


def _with_side_inputs(
    blocks: list[BlockProfile], recording: _Recording, chain_breaks: list[int],
    model_storages: set, saved_side_inputs: list[dict[int, int]], sample_storages: set,
    output_held: set,
) -> tuple[list[BlockProfile], int]:
    """The blocks (in run order) with ``side_bytes``, ``held_side_bytes`` and
    ``side_gradient_bytes`` (see ``BlockProfile``).

    ``side_bytes``: each side input some block saves (``saved_side_inputs``), counted once, in
    the first block that takes it; after a chain break, what the modules between the two parts
    saved, the tensors counted already left out. ``held_side_bytes``: each side input no block
    saves, once, in the first block that takes it, unless it is part of the sample (counted in
    the fixed bytes). ``side_gradient_bytes``: side inputs'
    gradients, and those of the modules between two parts of the chain, which appear once the
    later part's backward is done (after the first block's: the embedding's, outside the
    chain's backward); and saved side inputs that the step's output holds (``output_held``),
    through the backward of the blocks before their first taker. Also returns the bytes of
    those, which the measured head leftovers include and must not count twice."""
    order = recording.order
    calls = [recording.calls[index] for index in order]
    returned = [recording.returned.get(index, set()) for index in order]
    saved_before = [recording.saved_after.get(order[position - 1], {})
                    if position in chain_breaks else {} for position in range(len(order))]
    saved = {key: nbytes for sides in saved_side_inputs for key, nbytes in sides.items()}
    counted = set(saved) | model_storages
    side_bytes = [
        sum(nbytes for key, nbytes in before.items() if key not in counted)
        for before in saved_before
    ]
    not_held = counted | sample_storages | {key for before in saved_before for key in before}
    held_side_bytes = [0] * len(blocks)
    side_gradient_bytes = [0] * len(blocks)
    output_held_bytes = 0
    takers: dict[int, list[int]] = {}
    gradients: dict[int, int] = {}
    for index, call in enumerate(calls):
        for key, nbytes in call.side_storages(model_storages).items():
            if key in saved:
                side_nbytes = saved.pop(key)
                side_bytes[index] += side_nbytes
                if key in output_held:
                    # The step's output holds it (an encoder's last hidden state): it outlives
                    # its first taker's backward, through the backward of the blocks before.
                    output_held_bytes += side_nbytes
                    for earlier in range(index):
                        side_gradient_bytes[earlier] += side_nbytes
            elif key not in not_held and key not in takers:
                held_side_bytes[index] += nbytes
            takers.setdefault(key, []).append(index)
        gradients.update(call.side_gradients(model_storages))
    for key, nbytes in gradients.items():
        # Made by the last taker's backward, summed into by the others' down to the first's,
        # and into the block that returned the tensor, if one did (its backward uses it).
        first = min(takers[key])
        if first > 0 and key in returned[first - 1]:
            first -= 1
        for index in range(first, max(takers[key])):
            side_gradient_bytes[index] += nbytes
    between = recording.gradients_made_after()
    for index in range(len(blocks)):
        side_gradient_bytes[index] += sum(between[index + 1:])
    return [
        replace(block, side_bytes=side, held_side_bytes=held, side_gradient_bytes=gradient)
        for block, side, held, gradient in zip(
            blocks, side_bytes, held_side_bytes, side_gradient_bytes, strict=True
        )
    ], output_held_bytes


def _assemble(
    blocks: list[BlockProfile], memory: _StepMemory, step_seconds: float, device: torch.device,
    chain_breaks: list[int], counted_by_blocks_bytes: int = 0,
) -> Profile:
    """The profile, with the step's phases expressed the way ``gradckpt.plan`` models them.
    ``counted_by_blocks_bytes``: what is alive when the chain's backward ends that the blocks'
    ``side_gradient_bytes`` count already, not the head's: gradients made inside the chain's
    backward outside its blocks, and side inputs the step's output holds."""
    fixed = memory.start
    measured = Profile(
        blocks,
        peak_bytes=memory.peak,
        fixed_bytes=fixed,
        step_seconds=step_seconds,
        device=str(device),
        other_peak_bytes=max(0, memory.highest["before"] - fixed, memory.highest["after"] - fixed),
        chain_breaks=chain_breaks,
    )
    retained = measured.plain_retained_bytes()
    measured.head_bytes = max(0, memory.highest["head"] - fixed - retained)
    measured.head_gradient_bytes = _head_leftovers(
        blocks, memory, fixed, retained, counted_by_blocks_bytes
    )
    measured.notes["chain_backward_start_bytes"] = memory.chain_backward_start
    measured.notes["measured_phase_peaks"] = dict(memory.highest)
    return measured


def _head_leftovers(
    blocks: list[BlockProfile], memory: _StepMemory, fixed: int, retained: int,
    counted_by_blocks_bytes: int,
) -> int:
    """What stays allocated through the chain's backward besides the chain's own tensors: the
    head's parameter gradients, what the part before the chain saved (its dropout mask), and
    what the step's output holds (the logits, unless ``keep_output=False``).

    Read when the chain's backward ends, less the blocks' gradients and the input's gradient:
    at its start, scalars of the loss's backward still exist that die before any block runs.
    Without that hook (a chain input that needs no gradient) the start is all there is.
    """
    if memory.chain_backward_end:
        made_by_chain = (sum(block.gradient_bytes for block in blocks) + blocks[0].input_bytes
                         + counted_by_blocks_bytes)
        return max(0, memory.chain_backward_end - fixed - made_by_chain)
    return max(0, memory.chain_backward_start - fixed - retained - blocks[-1].output_bytes)


# --------------------------------------------------------------------------------------------
# The step: recording each block's inputs, keeping the model as it was
# --------------------------------------------------------------------------------------------


class _BlockCall:
    """A block's arguments in the step, detached, and which leaf is the hidden state."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        leaves, self.spec = tree_flatten((args, kwargs))
        self.leaves = [
            detached_like(leaf) if isinstance(leaf, torch.Tensor) else leaf
            for leaf in leaves
        ]
        tensors = [i for i, leaf in enumerate(self.leaves) if isinstance(leaf, torch.Tensor)]
        if not tensors:
            raise UsageError("a block was called without a tensor argument: not a chain block")
        self.hidden = tensors[0]  # the chain's hidden state comes first (x = block(x, ...))

    def side_storages(self, excluded: set) -> dict[int, int]:
        """The storages of its other tensor arguments (masks, an encoder's output, rotary
        cos/sin), less ``excluded`` (the model's parameters and buffers), with their bytes."""
        hidden = storage_key(self.leaves[self.hidden])
        return {
            storage_key(leaf): leaf.untyped_storage().nbytes()
            for leaf in self.leaves
            if isinstance(leaf, torch.Tensor)
            and storage_key(leaf) not in excluded and storage_key(leaf) != hidden
        }

    def side_gradients(self, excluded: set) -> dict[int, int]:
        """Of those, the ones that need a gradient, with its bytes."""
        sides = self.side_storages(excluded)
        return {
            storage_key(leaf): _nbytes(leaf)
            for leaf in self.leaves
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad
            and storage_key(leaf) in sides
        }

    def fresh(self) -> tuple[tuple, dict, torch.Tensor]:
        """The arguments with a fresh copy of the hidden state (so memory measures are clean)."""
        leaves = list(self.leaves)
        original = leaves[self.hidden]
        hidden = original.detach().clone().requires_grad_(original.requires_grad)
        leaves[self.hidden] = hidden
        args, kwargs = tree_unflatten(leaves, self.spec)
        return args, kwargs, hidden


@dataclass
class _Recording:
    """What one step showed about the blocks: each one's first call (its arguments, and the
    output it returned), in the order the blocks first ran."""

    calls: dict[int, _BlockCall]
    arguments: dict[int, tuple[tuple, dict]]  # each first call's (args, kwargs)
    outputs: dict[int, torch.Tensor | None]
    order: list[int]
    # What the graph saved outside the blocks after block i ended (storage -> bytes), until
    # the next block started: an encoder's final norm, a decoder's embedding.
    saved_after: dict[int, dict[int, int]] = field(default_factory=dict)
    running: int = 0  # blocks running now (0: between blocks)
    last_ended: int | None = None
    # In backward: the block whose input's gradient came last (its backward is done), and the
    # gradients of parameters outside the blocks first made after block i's backward (a
    # decoder's embedding, between decoder and encoder).
    backward_done: int | None = None
    gradients_after: dict[int, int] = field(default_factory=dict)
    # The storages of the other tensors each block returned (T5's first block returns the
    # position bias the others take).
    returned: dict[int, set] = field(default_factory=dict)
    # The storages of the tensors in the model's output (logits, an encoder's last hidden state).
    output_storages: set = field(default_factory=set)

    def gradients_made_after(self) -> list[int]:
        """Per position in ``order``, the bytes of ``gradients_after`` its block's backward."""
        return [self.gradients_after.get(index, 0) for index in self.order]

    def chain_breaks(self) -> list[int]:
        """Positions in ``order`` whose block did not take the previous one's output as its
        hidden state (the test ``gradckpt.engine.segments`` applies)."""
        return [
            position for position in range(1, len(self.order))
            if not continues_chain(*self.arguments[self.order[position]],
                                   self.outputs.get(self.order[position - 1]))
        ]


def _record_block_calls(
    model: nn.Module, sample: Any, loss_fn: Any, blocks: list[nn.Module]
) -> _Recording:
    recording = _Recording({}, {}, {}, [])

    def record(index: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        recording.running += 1
        if index not in recording.calls:  # the first call, if called twice
            recording.calls[index] = _BlockCall(args, kwargs)
            recording.arguments[index] = (args, kwargs)
            recording.order.append(index)
            hidden = first_tensor((args, kwargs))
            if hidden is not None and hidden.requires_grad:
                hidden.register_hook(functools.partial(backward_done, index))

    def backward_done(index: int, gradient: torch.Tensor) -> None:
        recording.backward_done = index

    made: set[nn.Parameter] = set()

    def gradient_made(parameter: nn.Parameter) -> None:
        if parameter not in made:
            made.add(parameter)
            if recording.backward_done is not None:
                after = recording.gradients_after
                after[recording.backward_done] = (after.get(recording.backward_done, 0)
                                                  + _nbytes(parameter))

    def record_output(index: int, module: nn.Module, args: tuple, output: Any) -> None:
        recording.running -= 1
        recording.last_ended = index
        recording.outputs.setdefault(index, first_tensor(output))
        # Besides the hidden state, whose gradient the walk counts as the incoming one.
        hidden = recording.outputs[index]
        recording.returned.setdefault(index, {
            storage_key(leaf) for leaf in tree_flatten(output)[0]
            if isinstance(leaf, torch.Tensor) and leaf is not hidden
            and (hidden is None or storage_key(leaf) != storage_key(hidden))
        })

    def saved_between(tensor: torch.Tensor) -> torch.Tensor:
        if recording.running == 0 and recording.last_ended is not None:
            saved = recording.saved_after.setdefault(recording.last_ended, {})
            saved[storage_key(tensor)] = tensor.untyped_storage().nbytes()
        return tensor

    hooks = [
        hook
        for index, block in enumerate(blocks)
        for hook in (
            block.register_forward_pre_hook(functools.partial(record, index), with_kwargs=True),
            block.register_forward_hook(functools.partial(record_output, index)),
        )
    ]
    in_blocks = {parameter for block in blocks for parameter in block.parameters()}
    hooks += [
        parameter.register_post_accumulate_grad_hook(gradient_made)
        for parameter in model.parameters()
        if parameter.requires_grad and parameter not in in_blocks
    ]
    try:
        with torch.autograd.graph.saved_tensors_hooks(saved_between, lambda tensor: tensor):
            output = run_model(model, sample)
            loss = loss_of(output, loss_fn)
        recording.output_storages = {
            storage_key(leaf) for leaf in tree_flatten(output)[0]
            if isinstance(leaf, torch.Tensor)
        }
        del output
        loss.backward()
    finally:
        for hook in hooks:
            hook.remove()
    missing = [index for index in range(len(blocks)) if index not in recording.calls]
    if missing:
        raise UsageError(
            f"blocks {missing} did not run in the model's forward pass on this sample; pass "
            "blocks= with the blocks that run, in order"
        )
    return recording


class _StepMemory:
    """Memory through one plain step, phase by phase: each phase's peak, and the memory at the
    start and when the chain's backward starts.

    Phases: "before" the chain, the chain's "forward", the "head" (from the chain's output to
    its gradient), the chain's "backward", and "after" it (the embedding's backward).
    """

    def __init__(self, first: nn.Module, last: nn.Module, device: torch.device) -> None:
        self.first, self.last, self.device = first, last, device
        self.phase = "before"
        self.highest: dict[str, int] = dict.fromkeys(
            ("before", "forward", "head", "backward", "after"), 0
        )
        self.start = self.peak = self.chain_backward_start = self.chain_backward_end = 0
        self._memory: MemoryMeter | None = None

    def measure(self, step: Callable[[], None], *tracked: Any) -> None:
        hooks = [
            self.first.register_forward_pre_hook(self._chain_starts, with_kwargs=True),
            self.last.register_forward_hook(self._chain_ends),
        ]
        try:
            with MemoryMeter(self.device, *tracked) as memory:
                self._memory = memory
                self.start = memory.current()
                step()
                self._enter(self.phase)
        finally:
            for hook in hooks:
                hook.remove()
        self.peak = max(self.highest.values())

    def _enter(self, phase: str) -> None:
        assert self._memory is not None
        self.highest[self.phase] = max(self.highest[self.phase], self._memory.peak())
        self._memory.reset_peak()
        self.phase = phase

    def _chain_starts(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._enter("forward")
        hidden = first_tensor((args, kwargs))
        if hidden is not None and hidden.requires_grad:
            # the gradient of the chain's input ends the chain's backward
            hidden.register_hook(self._chain_backward_ends)

    def _chain_ends(self, module: nn.Module, args: tuple, output: Any) -> None:
        self._enter("head")
        hidden = first_tensor(output)
        if hidden is not None and hidden.requires_grad:
            hidden.register_hook(self._chain_backward_starts)

    def _chain_backward_starts(self, gradient: torch.Tensor) -> None:
        self._enter("backward")
        assert self._memory is not None
        self.chain_backward_start = self._memory.current()  # the gradient included

    def _chain_backward_ends(self, gradient: torch.Tensor) -> None:
        self._enter("after")
        assert self._memory is not None
        self.chain_backward_end = self._memory.current()  # the input's gradient included


def _gradient_bytes(blocks: list[nn.Module]) -> list[int]:
    """Per block, the bytes of its trainable parameters' gradients (a parameter shared by
    several blocks counts in the last: its gradient appears in the first backward)."""
    owner = {}
    for index, block in enumerate(blocks):
        for parameter in block.parameters():
            if parameter.requires_grad:
                owner[parameter] = index
    sizes = [0] * len(blocks)
    for parameter, index in owner.items():
        sizes[index] += _nbytes(parameter)
    return sizes


# --------------------------------------------------------------------------------------------
# One block on its own
# --------------------------------------------------------------------------------------------


def _measure_block(
    name: str, block: nn.Module, call: _BlockCall, repeats: int, device: torch.device,
    gradient_bytes: int, forward_in_step: float | None, side_inputs: dict[int, int],
) -> tuple[BlockProfile, dict[int, int], _TimeRatios]:
    """Everything ``BlockProfile`` holds about one block but its side inputs' fields
    (``_with_side_inputs`` fills those for the chain), re-run on its own from its call in the
    step, and which of ``side_inputs`` (its arguments besides the hidden state) its graph
    saves: those count once for the chain, not in its ``saved_bytes``.

    Its backward and extra times are multiples of its forward timed in the same rounds (the
    ``_TimeRatios`` returned, which ``profile`` pools over identical blocks) times its forward
    timed in the step (``forward_in_step``; its forward alone when that is None)."""
    parameter_storages = {storage_key(p) for p in block.parameters()}
    parameter_storages |= {storage_key(b) for b in block.buffers()}

    # Its gradients start as None, as in a training step: the steps profile ran before left
    # them allocated, and a backward accumulating into them would not count the new ones (an
    # MLP weight's gradient was missing from the peak of a Llama layer's backward).
    block.zero_grad(set_to_none=True)
    args, kwargs, hidden = call.fresh()
    saved: dict[int, int] = {}  # storage -> bytes, each storage once

    def remember(tensor: torch.Tensor) -> torch.Tensor:
        key = storage_key(tensor)
        if key not in parameter_storages:
            saved[key] = tensor.untyped_storage().nbytes()
        return tensor

    with MemoryMeter(device, block, *_tensors((args, kwargs))) as memory:
        # Each pass's peak above what exists when it starts, frees of older tensors counted:
        # its forward's above its input; its backward's above what the forward saved and the
        # incoming gradient (it frees the saved tensors as it goes).
        start = memory.current()
        with torch.autograd.graph.saved_tensors_hooks(remember, lambda tensor: tensor):
            output = block(*args, **kwargs)
        forward_peak = memory.peak() - start
        chain_output = _block_output(output)
        gradient = torch.ones_like(chain_output)
        start = memory.current()
        memory.reset_peak()
        chain_output.backward(gradient)
        backward_peak = memory.peak() - start
    input_saved = storage_key(hidden) in saved
    output_saved = storage_key(chain_output) in saved
    saved_sides = {key: saved.pop(key) for key in list(saved) if key in side_inputs}
    block.zero_grad(set_to_none=True)

    def forward_only() -> Any:
        a, k, _ = call.fresh()
        return block(*a, **k)

    def forward_and_backward() -> None:
        out = _block_output(forward_only())
        out.backward(torch.ones_like(out))

    # Its forward alone, plain, checkpointed and under the policy, in turn, ``repeats`` rounds:
    # each time is kept as a multiple of the forward timed in the same round, moments apart (a
    # shared machine's pace drifts by 10-20% over seconds), then put at the step's pace by the
    # forward timed inside the step, where the step's own time was taken.
    forward_times, backward, checkpointed, policy = _interleaved_seconds(
        [forward_only, forward_and_backward, _checkpointed_step(block, call, None),
         _checkpointed_step(block, call, PLANNED_POLICY)],
        repeats, device,
    )
    forward_seconds = (statistics.median(forward_times) if forward_in_step is None
                       else forward_in_step)

    ratios = _TimeRatios.of(forward_times, backward, checkpointed, policy)
    block.zero_grad(set_to_none=True)
    operations = _operations(block, call, side_inputs)
    checkpointed_forward_peak, checkpointed_backward_peak = _checkpointed_peaks(
        block, call, device, policy=None
    )
    policy_forward_peak, policy_backward_peak = _checkpointed_peaks(
        block, call, device, policy=PLANNED_POLICY
    )
    return BlockProfile(
        name=name,
        input_bytes=_nbytes(hidden),
        output_bytes=_nbytes(chain_output),
        saved_bytes=sum(saved.values()),
        input_saved=input_saved,
        output_saved=output_saved,
        forward_seconds=forward_seconds,
        backward_seconds=ratios.median("backward") * forward_seconds,
        forward_peak_bytes=forward_peak,
        backward_peak_bytes=backward_peak,
        matmul_bytes=operations.matmul_bytes,
        matmul_seconds=operations.matmul_share * forward_seconds,
        saved_bytes_by_op=operations.saved_bytes,
        forward_seconds_by_op={
            name: share * forward_seconds for name, share in operations.time_share.items()
        },
        gradient_bytes=gradient_bytes,
        policy_forward_peak_bytes=policy_forward_peak,
        policy_backward_peak_bytes=policy_backward_peak,
        policy_extra_seconds=ratios.median("policy") * forward_seconds,
        checkpointed_forward_peak_bytes=checkpointed_forward_peak,
        checkpointed_backward_peak_bytes=checkpointed_backward_peak,
        checkpointed_extra_seconds=ratios.median("checkpointed") * forward_seconds,
    ), saved_sides, ratios


@dataclass
class _TimeRatios:
    """Per round, a block's backward and what checkpointing it adds (plain, under the policy),
    each over its forward timed in the same round."""

    backward: list[float]
    checkpointed: list[float]
    policy: list[float]

    @classmethod
    def of(cls, forward: list[float], backward: list[float], checkpointed: list[float],
           policy: list[float]) -> _TimeRatios:
        """From ``_interleaved_seconds``: forward times, then each other run minus forward."""
        rounds = [i for i, seconds in enumerate(forward) if seconds > 0]
        # Never below zero: a checkpointed run faster than the plain block is timing noise.
        return cls(
            [max(backward[i], 0.0) / forward[i] for i in rounds],
            [max(checkpointed[i] - backward[i], 0.0) / forward[i] for i in rounds],
            [max(policy[i] - backward[i], 0.0) / forward[i] for i in rounds],
        )

    def median(self, name: str) -> float:
        values = getattr(self, name)
        return statistics.median(values) if values else 0.0

    def pooled(self, others: list[_TimeRatios]) -> _TimeRatios:
        return _TimeRatios(*([v for r in [self, *others] for v in getattr(r, name)]
                             for name in ("backward", "checkpointed", "policy")))


def _pooled_times(
    blocks: list[BlockProfile], ratios: list[_TimeRatios], kinds: list[Any]
) -> list[BlockProfile]:
    """Blocks that compute the same thing (``_kind``) share one estimate of each ratio: the
    median over all their rounds, steadier than each block's few (8 identical layers measured
    3 rounds each: 24 samples, not 3). Each keeps its own forward, timed in the step."""
    by_kind: dict[Any, list[_TimeRatios]] = {}
    for kind, ratio in zip(kinds, ratios, strict=True):
        by_kind.setdefault(kind, []).append(ratio)
    pooled = {kind: group[0].pooled(group[1:]) for kind, group in by_kind.items()}
    return [
        replace(
            block,
            backward_seconds=pooled[kind].median("backward") * block.forward_seconds,
            checkpointed_extra_seconds=pooled[kind].median("checkpointed") * block.forward_seconds,
            policy_extra_seconds=pooled[kind].median("policy") * block.forward_seconds,
        )
        for block, kind in zip(blocks, kinds, strict=True)
    ]


def _kind(module: nn.Module, call: _BlockCall) -> tuple:
    """What makes two blocks compute the same: class, parameter shapes, argument shapes and
    the non-tensor arguments."""
    return (
        type(module).__qualname__,
        tuple((tuple(p.shape), p.dtype) for p in module.parameters()),
        tuple((tuple(leaf.shape), leaf.dtype, leaf.requires_grad) if isinstance(leaf, torch.Tensor)
              else repr(leaf) for leaf in call.leaves),
        str(call.spec),
        module.training,
    )


def _checkpointed_peaks(
    block: nn.Module, call: _BlockCall, device: torch.device, policy: str | None
) -> tuple[int, int]:
    """The block checkpointed on its own (under ``policy``), as ``apply`` runs a one-block
    segment: its forward's peak above its input, and its backward's peak (the recomputation
    included) above what exists when that starts.

    Measured rather than derived: what the recomputation holds and frees early (kept outputs
    backward does not save, under a policy) depends on the block's code, and a checkpointed
    forward, which saves nothing, peaks far below the plain one.
    """
    # The forward runs inside the tracker too: the recomputation frees kept outputs that
    # backward does not save, and a tracker only sees the frees of tensors it knows.
    with MemoryMeter(device, block, *_tensors(call.leaves)) as memory:
        args, kwargs, _ = call.fresh()
        start = memory.current()
        memory.reset_peak()
        output = _block_output(checkpoint(block, *args, policy=policy, **kwargs))
        forward_peak = memory.peak() - start
        gradient = torch.ones_like(output)
        start = memory.current()
        memory.reset_peak()
        output.backward(gradient)
        backward_peak = memory.peak() - start
        del args, kwargs
    del output, gradient
    block.zero_grad(set_to_none=True)
    return forward_peak, backward_peak


def _checkpointed_step(
    block: nn.Module, call: _BlockCall, policy: str | None
) -> Callable[[], None]:
    """The block's forward and backward, checkpointed on its own under ``policy`` (engine,
    recomputation and the policy's per-operation dispatch included)."""

    def forward_and_backward() -> None:
        args, kwargs, _ = call.fresh()
        out = _block_output(checkpoint(block, *args, policy=policy, **kwargs))
        out.backward(torch.ones_like(out))

    return forward_and_backward


def _interleaved_seconds(
    fns: list[Callable[[], Any]], repeats: int, device: torch.device
) -> tuple[list[float], ...]:
    """The first function's times, then each other one's time minus the first's in the same
    round: ``repeats`` rounds running each function once, in turn."""
    times: list[list[float]] = [[] for _ in fns]
    for _ in range(repeats):
        for fn, slot in zip(fns, times, strict=True):
            slot.append(_median_seconds(fn, 1, device))
    first = times[0]
    return first, *([t - f for t, f in zip(other, first, strict=True)] for other in times[1:])


class _OpTimer(TorchDispatchMode):
    """Times every ATen operation, by operation, and remembers which made each storage."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds: dict[str, float] = {}
        self.matmul_bytes = 0
        self.matmul_seconds = 0.0
        self.producer: dict[int, str] = {}  # storage -> the operation that made it

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        start = time.perf_counter()
        output = func(*args, **(kwargs or {}))
        elapsed = time.perf_counter() - start
        name = str(func.overloadpacket)
        self.seconds[name] = self.seconds.get(name, 0.0) + elapsed
        outputs = [t for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)]
        for tensor in outputs:
            key = storage_key(tensor)
            if self.producer.get(key, "").startswith("aten.empty"):
                self.producer[key] = name  # the first to write it (dropout's bernoulli_)
            else:
                self.producer.setdefault(key, name)
        if is_matmul_or_attention(func):
            self.matmul_bytes += sum(_nbytes(t) for t in outputs)
            self.matmul_seconds += elapsed
        return output


@dataclass
class _Operations:
    """A block's forward pass by ATen operation (what op-level choices weigh)."""

    matmul_bytes: int  # outputs of matrix multiplies and attention kernels
    matmul_share: float  # their share of the forward time
    saved_bytes: dict[str, int]  # bytes saved for backward, by the operation that made them
    time_share: dict[str, float]  # share of the forward time, by operation


def _operations(block: nn.Module, call: _BlockCall, side_inputs: dict[int, int]) -> _Operations:
    """Run the block's forward once more, timing and attributing each operation (saved side
    inputs left out, as from ``saved_bytes``)."""
    args, kwargs, hidden = call.fresh()
    excluded = {storage_key(t) for t in (*block.parameters(), *block.buffers())}
    excluded |= set(side_inputs)
    saved: dict[int, int] = {}

    def remember(tensor: torch.Tensor) -> torch.Tensor:
        if storage_key(tensor) not in excluded:
            saved[storage_key(tensor)] = tensor.untyped_storage().nbytes()
        return tensor

    # With grad, as in training: kernels can differ without it.
    with torch.autograd.graph.saved_tensors_hooks(remember, lambda t: t), _OpTimer() as timer:
        block(*args, **kwargs)
    total = sum(timer.seconds.values())
    saved_by_op: dict[str, int] = {}
    for key, nbytes in saved.items():
        name = "input" if key == storage_key(hidden) else timer.producer.get(key, "other input")
        saved_by_op[name] = saved_by_op.get(name, 0) + nbytes
    by_time = sorted(timer.seconds.items(), key=lambda item: -item[1])
    return _Operations(
        matmul_bytes=timer.matmul_bytes,
        matmul_share=timer.matmul_seconds / total if total else 0.0,
        saved_bytes=dict(sorted(saved_by_op.items(), key=lambda item: -item[1])),
        time_share={name: seconds / total for name, seconds in by_time} if total else {},
    )


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def _median_seconds(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _block_output(output: Any) -> torch.Tensor:
    tensor = first_tensor(output)
    if tensor is None:
        raise UsageError("a block returned no tensor: it cannot be part of a chain")
    return tensor


def _tensors(sample: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(sample)[0] if isinstance(leaf, torch.Tensor)]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()

