"""Recording each block's call in one training step: its arguments, its output, the order the
blocks ran in, and what the step kept outside them.

``profile`` re-runs each block on its own from the call recorded here; ``estimate`` will predict
from the same recording. So this module only watches one plain step: it neither times nor
meters memory (``timing.py``, ``meter.py``), and leaves nothing installed on the model.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..engine import AutocastSnapshot, continues_chain, detached_like, first_tensor, storage_key
from ..errors import GradckptError, UsageError
from . import clock
from .chain_checks import NoneOfTheBlocksRan, blocks_not_run, check_not_interleaved
from .step import OutputHolder, loss_of, run_model
from .tensors import saved_apart, tensor_bytes, tensors_in

__all__ = ["BlockCall", "Recording", "record_block_calls"]


class BlockCall:
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
        # Under mixed precision (torch.autocast around the model, as Accelerate and the
        # Trainer's bf16=True put it) a block's matmuls save half-size tensors: re-runs must
        # compute as the step did (``ambient``).
        self.autocast = AutocastSnapshot([self.leaves[i] for i in tensors])
        # The strides of the gradient its output got in the step, where that was laid out
        # otherwise than contiguously (``gradient_layout``); None: contiguous.
        self.gradient_stride: tuple[int, ...] | None = None

    def ambient(self) -> Any:
        """A context in which the block computes as in the step: its autocast settings."""
        return self.autocast.replayed()

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
            storage_key(leaf): tensor_bytes(leaf)
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
class Recording:
    """What one step showed about the blocks: each one's first call in the forward pass with
    gradients on (its arguments, and the output it returned; a block run only without
    gradients: its first call), in the order of those calls."""

    calls: dict[int, BlockCall]
    arguments: dict[int, tuple[tuple, dict]]  # each recorded call's (args, kwargs)
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
    # Per block, its calls in the forward pass with gradients on, and without (a recurrent
    # model's cycles under torch.no_grad(): they save nothing for backward).
    calls_with_gradients: dict[int, int] = field(default_factory=dict)
    calls_without_gradients: dict[int, int] = field(default_factory=dict)

    def held_storages(self) -> set:
        """The storages of the tensors this recording holds on to: the blocks' arguments and
        outputs, from the step recorded."""
        held = [*tensors_in([call.leaves for call in self.calls.values()]),
                *tensors_in(list(self.arguments.values())),
                *(output for output in self.outputs.values() if output is not None)]
        return {storage_key(tensor) for tensor in held}

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


def record_block_calls(
    model: nn.Module, sample: Any, loss_fn: Any, blocks: list[nn.Module],
    holder: OutputHolder | None = None,
) -> Recording:
    """Run one plain training step (forward, loss, backward) with hooks on ``blocks`` and on
    the parameters outside them, and return what it showed; the hooks are removed after.
    With ``holder``, the model's output outlives the step there, as a loop's ``out`` does
    (the step metered next starts with it, as it would after any step).

    Blocks that did not run are left out of ``order`` where no block of their list and class
    ran but others did (``chain_checks.blocks_not_run``); raises ``UsageError`` if other
    blocks did not run (``chain_checks.NoneOfTheBlocksRan`` where none ran), or the blocks run
    interleaved from several lists and are no chain (``chain_checks.check_not_interleaved``).
    """
    recording = Recording({}, {}, {}, [])
    in_backward = False  # calls from then on recompute (a model's own torch.utils.checkpoint)
    recorded_now: set[int] = set()  # the blocks whose call running now is the one recorded

    def record(index: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        recording.running += 1
        if in_backward:
            return
        gradients = torch.is_grad_enabled()
        counts = (recording.calls_with_gradients if gradients
                  else recording.calls_without_gradients)
        counts[index] = counts.get(index, 0) + 1
        # The call that saves for backward: the first with gradients on. A call without them
        # (a recurrent model's cycles run under no_grad) stands only until such a call comes.
        earlier = recording.calls_with_gradients.get(index, 0) - gradients
        if index in recording.calls and (earlier or not gradients):
            return
        if index in recording.calls:
            recording.order.remove(index)
        recording.calls[index] = BlockCall(args, kwargs)
        recording.arguments[index] = (args, kwargs)
        recording.order.append(index)
        recorded_now.add(index)
        hidden = first_tensor((args, kwargs))
        if gradients and hidden is not None and hidden.requires_grad:
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
                                                  + tensor_bytes(parameter))

    def record_output(index: int, module: nn.Module, args: tuple, output: Any) -> None:
        recording.running -= 1
        recording.last_ended = index
        if index not in recorded_now:
            return
        recorded_now.discard(index)
        hidden = recording.outputs[index] = first_tensor(output)
        if hidden is not None and hidden.requires_grad:
            handles.append(hidden.register_hook(functools.partial(
                gradient_layout, recording.calls[index])))
        # Besides the hidden state, whose gradient the walk counts as the incoming one.
        recording.returned[index] = {
            storage_key(leaf) for leaf in tree_flatten(output)[0]
            if isinstance(leaf, torch.Tensor) and leaf is not hidden
            and (hidden is None or storage_key(leaf) != storage_key(hidden))
        }

    handles: list[Any] = []

    def gradient_layout(call: BlockCall, gradient: torch.Tensor) -> None:
        # A gradient coming through a permutation (PVT's stage boundary, a transposed
        # hidden state) is laid out as that left it: the block's backward copies it where it
        # needs it contiguous, one output more than from a contiguous one.
        if not gradient.is_contiguous() and _dense(gradient):
            call.gradient_stride = tuple(gradient.stride())

    def saved_between(tensor: torch.Tensor) -> torch.Tensor:
        if recording.running == 0 and recording.last_ended is not None:
            saved = recording.saved_after.setdefault(recording.last_ended, {})
            saved[storage_key(tensor)] = tensor.untyped_storage().nbytes()
        return saved_apart(tensor)

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
        with torch.autograd.graph.saved_tensors_hooks(saved_between, lambda tensor: tensor), \
                _said_to_be_the_samples(model):
            output = run_model(model, sample)
            loss = loss_of(output, loss_fn)
        recording.output_storages = {
            storage_key(leaf) for leaf in tree_flatten(output)[0]
            if isinstance(leaf, torch.Tensor)
        }
        if holder is not None:
            holder.output = output
        del output
        in_backward = True
        with _said_to_be_the_samples(model):
            loss.backward()
    finally:
        for hook in hooks + handles:
            hook.remove()
    # A whole stack that did not run (a vision tower given text) is left out of ``order``; a
    # stack that ran partly is refused, and so are lists run interleaved that are no chain
    # (``chain.py``, rule 4 and below).
    names_by_id = {id(module): name for name, module in model.named_modules() if name}
    named = [(names_by_id.get(id(block), type(block).__name__), block) for block in blocks]
    names = [name for name, _ in named]
    _, missing = blocks_not_run(named, recording.order)
    if missing:
        message = (f"blocks {missing} did not run in the model's forward pass on this sample "
                   f"({', '.join(names[index] for index in missing)})")
        if not recording.order:  # profile takes the chain that runs, or says which it is
            raise NoneOfTheBlocksRan(message)
        raise UsageError(message + ", while other blocks of their lists did; pass blocks= "
                         "with the blocks that run, in order")
    _check_run_once(model, names, recording)
    check_not_interleaved([names[index] for index in recording.order], recording.chain_breaks())
    return recording


def _check_run_once(model: nn.Module, names: list[str], recording: Recording) -> None:
    """Raise ``UsageError`` where a block ran more than once with gradients in the forward
    pass (a recurrent model looping over its layers: HRM's cycles). A plan gives every run
    of a block its fate, while the cost model walks each block once: the step's peak cannot
    be predicted, and a plan's could go over its budget. Runs without gradients save nothing
    for backward, and are let be."""
    repeated = {index: count for index, count in recording.calls_with_gradients.items()
                if count > 1}
    if not repeated:
        return
    runs = [f"{names[index]} {count} times"
            + (f" (and {without} more without gradients)"
               if (without := recording.calls_without_gradients.get(index)) else "")
            for index, count in repeated.items()]
    shown = "; ".join(runs[:4]) + (f"; and {len(runs) - 4} more blocks" if len(runs) > 4
                                    else "")
    raise UsageError(
        f"gradckpt plans a chain of blocks that each run once per training step, but in "
        f"{type(model).__name__}'s forward pass on this sample blocks ran more than once with "
        f"gradients: {shown}. The model loops over its layers (a recurrent or weight-shared "
        "model): a plan would checkpoint every run of a block alike, and the peak of such a "
        "step cannot be predicted from one run per block, so no plan is made. Runs without "
        "gradients (torch.no_grad()) are fine: a model whose blocks each run once with them "
        "can be planned. Otherwise checkpoint each run yourself: gradckpt.checkpoint or "
        "torch.utils.checkpoint around the call, or the model's own gradient checkpointing "
        "(Hugging Face: model.gradient_checkpointing_enable())"
    )


@contextlib.contextmanager
def _said_to_be_the_samples(model: nn.Module) -> Iterator[None]:
    """The first step gradckpt runs is the model's own, on the user's sample: an error the
    model raises there (a shape it cannot take, labels that do not match) says so, the model's
    own error chained. gradckpt's errors, and running out of memory, pass as they are."""
    try:
        yield
    except (GradckptError, torch.OutOfMemoryError):
        raise
    except Exception as error:
        where = " on fake tensors (estimate: shapes, no values)" if clock.modeled() else ""
        raise UsageError(
            f"gradckpt ran one training step of {type(model).__name__} on the sample given "
            f"(its forward, the loss, backward){where}, and the model raised "
            f"{type(error).__name__}: {str(error).rstrip('.')}. Check the sample: what the "
            "model's forward takes (a dict of keyword arguments, a tuple of positional ones, "
            "or one tensor), "
            "with shapes and dtypes it accepts, and, for the loss, labels or loss_fn="
        ) from error



def _dense(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s elements fill a block of memory of its size, each once, in some
    order of its dimensions (a permuted contiguous tensor): a tensor of its shape made with its
    strides takes its bytes."""
    span = 1
    for size, stride in sorted(zip(tensor.shape, tensor.stride(), strict=True),
                               key=lambda pair: pair[1]):
        if size == 1:
            continue
        if stride != span:
            return False
        span *= size
    return True
