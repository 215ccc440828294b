"""Measuring one block on its own, re-run from its call in the step: the bytes its graph saves,
the peaks of its forward and backward (plain, checkpointed, under the planned policy), and its
times as multiples of its forward (``timing.py`` pools those over identical blocks)."""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch import nn

from ..engine import (
    checkpoint_segments,
    dispatch_seconds_per_operation,
    first_tensor,
    save_ops_policy_name,
    storage_key,
)
from ..errors import UsageError
from ..op_choices import menu_of
from ..profile_types import PLANNED_POLICY, BlockProfile, OpChoice
from . import clock
from .block_leaves import graph_position, leaves_made
from .clock import BOOKKEEPING
from .meter import MemoryMeter, trackable
from .operations import MENU_TIMING_RUNS, operations_of
from .recording import BlockCall
from .tensors import SavedStorages, is_passed_object, tensor_bytes, tensors_in
from .timing import TimeRatios, interleaved_seconds, median_seconds

__all__ = ["MIN_OFFERED_SHARE", "measure_block"]

# On a measured clock, operations taking less of a block's forward are not offered as op-level
# choices (``_measured_op_choices``).
MIN_OFFERED_SHARE = 0.05


def measure_block(
    name: str, block: nn.Module, call: BlockCall, repeats: int, device: torch.device,
    gradient_bytes: int, forward_in_step: float | None, side_inputs: dict[int, int],
    like: tuple[BlockProfile, dict[int, int], TimeRatios] | None = None,
    same_kind: BlockProfile | None = None,
) -> tuple[BlockProfile, dict[int, int], TimeRatios]:
    """Everything ``BlockProfile`` holds about one block but its side inputs' fields
    (``with_side_inputs`` fills those for the chain), re-run on its own from its call in the
    step, and which of ``side_inputs`` (its arguments besides the hidden state) its graph
    saves: those count once for the chain, not in its ``saved_bytes``.

    Its backward and extra times are multiples of its forward timed in the same rounds (the
    ``TimeRatios`` returned, which ``profile`` pools over identical blocks) times its forward
    timed in the step (``forward_in_step``; its forward alone when that is None).

    ``like``: what a block expected to measure the same returned (``estimate``: an identical
    layer on fake tensors, timed by a modeled clock). Its first pass (the bytes saved, the
    peaks) is still measured; when that agrees, the rest (timings, operations, checkpointed
    peaks: most of the passes) is taken from ``like``.

    ``same_kind``: a block measured before that computes the same (``timing.block_kind``):
    where its operations kept the same bytes, its op-level choices are taken as they are
    (the same policies, peaks measured once), so identical layers get identical menus."""
    parameter_storages = {storage_key(p) for p in block.parameters()}
    parameter_storages |= {storage_key(b) for b in block.buffers()}

    # Its gradients start as None, as in a training step: the steps profile ran before left
    # them allocated, and a backward accumulating into them would not count the new ones (an
    # MLP weight's gradient was missing from the peak of a Llama layer's backward).
    block.zero_grad(set_to_none=True)
    readings = _Readings()  # on a modeled clock, this pass's times are its forward's and step's
    args, kwargs, hidden = call.fresh()
    readings.add("forward", readings.started)
    saving = SavedStorages(parameter_storages)

    objects = _objects_passed(call)
    stored_before = _storages_held_by(objects)
    graph_before = graph_position()
    with MemoryMeter(device, block, *tensors_in((args, kwargs))) as memory:
        # Each pass's peak above what exists when it starts, frees of older tensors counted:
        # its forward's above its input; its backward's above what the forward saved and the
        # incoming gradient (it frees the saved tensors as it goes).
        start = memory.current()
        began = clock.now()
        with torch.autograd.graph.saved_tensors_hooks(saving.pack, lambda tensor: tensor):
            output = block(*args, **kwargs)
        saved = saving.alive()  # storage -> bytes, each storage once
        readings.add("forward", began)
        forward_peak = memory.peak() - start
        began = clock.now()
        chain_output = _block_output(output)
        # Not made by its forward: its parameters, buffers and arguments.
        given = parameter_storages | {storage_key(t) for t in tensors_in((args, kwargs))}
        leaves = leaves_made(chain_output, graph_before, given)
        returned_bytes = _returned_bytes(output, chain_output, given)
        argument_stored_bytes = sum(nbytes for key, nbytes in _storages_held_by(objects).items()
                                    if key not in stored_before)
        if not chain_output.requires_grad:
            # Nothing it computes needs a gradient (a frozen first block on an input that
            # needs none): it has no backward and saves nothing, and checkpointing it changes
            # nothing.
            return _without_backward(
                name, block, call, tensor_bytes(hidden), tensor_bytes(chain_output),
                forward_peak, gradient_bytes, forward_in_step, readings, repeats, device)
        output_key, output_bytes = storage_key(chain_output), tensor_bytes(chain_output)
        # Backward from the output's gradient edge, the output itself let go: in a step
        # nothing else holds a block's output by then, so where its own graph saved it (a
        # ReLU's) it is freed as soon as that node has run. Held here, it was counted through
        # the whole backward: a hidden state too many on a CNN block (9.8% over the step).
        backward = _backward_from_ones(chain_output, memory, call.gradient_stride)
        del output, chain_output
        backward_peak = backward()
        readings.add("backward", began)
    input_saved = storage_key(hidden) in saved
    output_saved = output_key in saved
    # Its backward's gradients that stay to the step's end: its parameters' and those of the
    # leaves its forward made (``leaves_made``).
    gradient_bytes += sum(tensor_bytes(leaf.grad) for leaf in leaves if leaf.grad is not None)
    del leaves
    saved_sides = {key: saved.pop(key) for key in list(saved) if key in side_inputs}
    block.zero_grad(set_to_none=True)
    if like is not None:
        same = like[0]
        first_pass = (tensor_bytes(hidden), output_bytes, sum(saved.values()),
                      input_saved, output_saved, forward_peak, backward_peak, saved_sides)
        if first_pass == (same.input_bytes, same.output_bytes, same.saved_bytes,
                          same.input_saved, same.output_saved, same.forward_peak_bytes,
                          same.backward_peak_bytes, like[1]):
            return replace(same, name=name, gradient_bytes=gradient_bytes), like[1], like[2]

    if clock.modeled():
        # A modeled clock times the same operations alike: the passes that measure the peaks
        # are timed as they run (each from no gradients, as a training step starts).
        operations = operations_of(block, call, side_inputs)
        checkpointed_run = _checkpointed_peaks(block, call, device, None, name)
        policy_run = _checkpointed_peaks(block, call, device, PLANNED_POLICY, name)
        forward_alone = readings.seconds["forward"]
        forward_times, backward, checkpointed, policy = (
            [forward_alone], [readings.seconds["backward"]],
            [checkpointed_run.seconds - forward_alone], [policy_run.seconds - forward_alone])
    else:
        forward_times, backward, checkpointed, policy = _timed_apart(block, call, repeats,
                                                                     device, name)
        block.zero_grad(set_to_none=True)
        # Where its op-level choices will be chosen from them, the least of several runs.
        operations = operations_of(block, call, side_inputs,
                                   runs=1 if same_kind is not None else MENU_TIMING_RUNS)
        checkpointed_run = _checkpointed_peaks(block, call, device, None, name)
        policy_run = _checkpointed_peaks(block, call, device, PLANNED_POLICY, name)
    forward_seconds = (statistics.median(forward_times) if forward_in_step is None
                       else forward_in_step)
    ratios = TimeRatios.of(forward_times, backward, checkpointed, policy)
    block_profile = BlockProfile(
        name=name,
        input_bytes=tensor_bytes(hidden),
        output_bytes=output_bytes,
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
        kept_bytes_by_op=operations.kept_bytes,
        # Its forward and its recomputation, each operation through the policy's dispatch;
        # under a modeled clock (an estimate for a GPU) hidden behind the device's work.
        policy_dispatch_seconds=(0.0 if clock.modeled() else
                                 2 * operations.count * dispatch_seconds_per_operation()),
        forward_seconds_by_op={
            name: share * forward_seconds for name, share in operations.time_share.items()
        },
        gradient_bytes=gradient_bytes,
        policy_forward_peak_bytes=policy_run.forward_peak,
        policy_backward_peak_bytes=policy_run.backward_peak,
        policy_extra_seconds=ratios.median("policy") * forward_seconds,
        checkpointed_forward_peak_bytes=checkpointed_run.forward_peak,
        checkpointed_backward_peak_bytes=checkpointed_run.backward_peak,
        checkpointed_extra_seconds=ratios.median("checkpointed") * forward_seconds,
        returned_bytes=returned_bytes,
        argument_stored_bytes=argument_stored_bytes,
    )
    if same_kind is not None and same_kind.kept_bytes_by_op == block_profile.kept_bytes_by_op:
        block_profile.op_choices = list(same_kind.op_choices)
    else:
        block_profile.op_choices = _measured_op_choices(block, call, device, block_profile)
    return block_profile, saved_sides, ratios


def _without_backward(
    name: str, block: nn.Module, call: BlockCall, input_bytes: int, output_bytes: int,
    forward_peak: int, gradient_bytes: int, forward_in_step: float | None,
    readings: _Readings, repeats: int, device: torch.device,
) -> tuple[BlockProfile, dict[int, int], TimeRatios]:
    """A block whose output needs no gradient, as ``measure_block`` returns it: its forward's
    time and peak, and nothing for backward or checkpointing."""
    if forward_in_step is not None:
        forward_seconds = forward_in_step
    elif clock.modeled():
        forward_seconds = readings.seconds["forward"]
    else:
        def forward_only() -> None:
            args, kwargs, _ = call.fresh()
            block(*args, **kwargs)

        forward_seconds = median_seconds(forward_only, repeats, device)
    block_profile = BlockProfile(
        name=name, input_bytes=input_bytes, output_bytes=output_bytes, saved_bytes=0,
        input_saved=False, output_saved=False, forward_seconds=forward_seconds,
        backward_seconds=0.0, forward_peak_bytes=forward_peak, backward_peak_bytes=0,
        gradient_bytes=gradient_bytes, policy_forward_peak_bytes=forward_peak,
        policy_backward_peak_bytes=0, policy_extra_seconds=0.0,
        checkpointed_forward_peak_bytes=forward_peak, checkpointed_backward_peak_bytes=0,
        checkpointed_extra_seconds=0.0,
    )
    return block_profile, {}, TimeRatios([0.0], [0.0], [0.0])


def _measured_op_choices(
    block: nn.Module, call: BlockCall, device: torch.device, measured: BlockProfile
) -> list[OpChoice]:
    """The op-level choices worth weighing for this block (``op_choices.menu_of``), each run
    checkpointed alone under its policy for its peaks (their times follow from the measured
    ones: ``op_choices.policy_cost``)."""
    choices = []
    by_op = measured.forward_seconds_by_op
    if _sharded(block):
        by_op = _agreed_across_ranks(by_op)
    if not clock.modeled():
        # An operation under a twentieth of the forward is not offered: its share is within
        # what a busy machine adds even to the least of its runs (the demo GPT's GELU, mul and
        # residual add: 2-5%, in the menu of one profile and out of the next).
        least = MIN_OFFERED_SHARE * sum(by_op.values())
        by_op = {name: seconds if seconds >= least else 0.0 for name, seconds in by_op.items()}
    agreed = replace(measured, forward_seconds_by_op=by_op)
    for operations, kept_bytes, share in menu_of(agreed):
        policy = save_ops_policy_name(operations)
        run = _checkpointed_peaks(block, call, device, policy, measured.name,
                                  output_kept_counted=True)
        choices.append(OpChoice(policy, kept_bytes, share, run.forward_peak, run.backward_peak,
                                run.kept_output))
    return choices


def _sharded(block: nn.Module) -> bool:
    """Whether the block's parameters are sharded over ranks (FSDP2's ``DTensor``s): its
    forward then gathers them, a collective every rank must run alike."""
    return any(type(p).__name__ == "DTensor" for p in block.parameters())


def _agreed_across_ranks(seconds_by_op: dict[str, float]) -> dict[str, float]:
    """Per-operation times every rank agrees on: their mean over the ranks of a process group
    (each rank times its own; for a sharded block the choices measured from them must be the
    same everywhere, or the ranks run different numbers of its forward, whose all-gathers then
    never meet: FSDP2 hung that way).

    Example:
        >>> _agreed_across_ranks({"aten.mm": 1.0})  # one process: its own
        {'aten.mm': 1.0}
    """
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return seconds_by_op
    gathered: list[dict[str, float] | None] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, seconds_by_op)
    names = sorted({name for rank in gathered for name in rank or {}})
    return {name: statistics.fmean((rank or {}).get(name, 0.0) for rank in gathered)
            for name in names}


def _timed_apart(
    block: nn.Module, call: BlockCall, repeats: int, device: torch.device, name: str
) -> tuple[list[float], ...]:
    """Its forward alone, plain, checkpointed and under the policy, in turn, ``repeats`` rounds
    (``interleaved_seconds``): each time is kept as a multiple of the forward timed in the same
    round, moments apart (a shared machine's pace drifts by 10-20% over seconds), then put at
    the step's pace by the forward timed inside the step, where the step's own time was taken.
    Each backward starts from no gradients, as in a training step: accumulating into the last
    run's would add a read and a write of every gradient to the checkpointed runs' times."""

    def forward_only() -> Any:
        a, k, _ = call.fresh()
        return block(*a, **k)

    def forward_and_backward() -> None:
        block.zero_grad(set_to_none=True)
        out = _block_output(forward_only())
        out.backward(torch.ones_like(out))

    def checkpointed(policy: str | None) -> Callable[[], None]:
        step = _checkpointed_step(block, call, policy, name)

        def from_no_gradients() -> None:
            block.zero_grad(set_to_none=True)
            step()

        return from_no_gradients

    return interleaved_seconds(
        [forward_only, forward_and_backward, checkpointed(None), checkpointed(PLANNED_POLICY)],
        repeats, device,
    )


class _Readings:
    """Seconds on the active clock, summed by name over the stretches ``add`` closes (exact on
    a modeled clock: its readings subtract and add without rounding)."""

    def __init__(self) -> None:
        self.started = clock.now()
        self.seconds: dict[str, Any] = {}

    def add(self, name: str, began: Any) -> None:
        stretch = clock.now() - began
        self.seconds[name] = stretch if name not in self.seconds else self.seconds[name] + stretch


class _CheckpointedRun(NamedTuple):
    """What ``_checkpointed_peaks`` measured of one checkpointed run of a block."""

    forward_peak: int
    backward_peak: int
    kept_output: int  # the block's own output the policy kept (0 where none)
    seconds: Any  # the whole run's, on the active clock


def _checkpointed_peaks(
    block: nn.Module, call: BlockCall, device: torch.device, policy: str | None, name: str,
    output_kept_counted: bool = False,
) -> _CheckpointedRun:
    """The block checkpointed on its own (under ``policy``), as ``apply`` runs a one-block
    segment: its forward's peak above its input, and its backward's peak (the recomputation
    included) above what exists when that starts; the bytes of its output the policy kept; and
    the seconds of the whole run (its arguments' fresh copy, forward and backward: what
    ``_checkpointed_step`` times).

    ``output_kept_counted``: the output, where the policy keeps it (a ReLU's, the last
    operation's), counts in the backward's peak rather than in what exists at its start
    (``OpChoice.output_kept_bytes`` then holds it apart). An op-level choice's kept bytes
    leave it out (``operations_of``: the next item retains it), but in a step that item has
    run its backward and let it go by the time this block's starts, while the policy holds it
    until the recomputation: left out of both, a CNN block's backward under
    ``save-ops:aten.relu`` came out one hidden state under the step's (while the measured
    backward held its incoming gradient to the end, of the output's size, that gradient stood
    in for it).

    Measured rather than derived: what the recomputation holds and frees early (kept outputs
    backward does not save, under a policy) depends on the block's code, and a checkpointed
    forward, which saves nothing, peaks far below the plain one.
    """
    # The forward runs inside the tracker too: the recomputation frees kept outputs that
    # backward does not save, and a tracker only sees the frees of tensors it knows.
    with MemoryMeter(device, block, *tensors_in(call.leaves)) as memory, _planned_alone(
        block, policy, name
    ):
        readings = _Readings()
        args, kwargs, _ = call.fresh()
        start = memory.current()
        memory.reset_peak()
        output = _block_output(block(*args, **kwargs))
        forward_peak = memory.peak() - start
        # Its output let go too: in a step, the next item has released it by then.
        backward = _backward_from_ones(output, memory, call.gradient_stride)
        output_bytes, before = tensor_bytes(output), memory.current()
        del output
        kept_output = max(output_bytes - (before - memory.current()), 0)
        backward_peak = backward() + (kept_output if output_kept_counted else 0)
        readings.add("run", readings.started)
        del args, kwargs
    block.zero_grad(set_to_none=True)
    return _CheckpointedRun(forward_peak, backward_peak, kept_output, readings.seconds["run"])


def _checkpointed_step(
    block: nn.Module, call: BlockCall, policy: str | None, name: str
) -> Callable[[], None]:
    """The block's forward and backward, checkpointed on its own under ``policy`` (engine,
    recomputation and the policy's per-operation dispatch included), as the region ``name``."""

    def forward_and_backward() -> None:
        args, kwargs, _ = call.fresh()
        with _planned_alone(block, policy, name):
            out = _block_output(block(*args, **kwargs))
            out.backward(torch.ones_like(out))

    return forward_and_backward


@contextlib.contextmanager
def _planned_alone(block: nn.Module, policy: str | None, name: str) -> Iterator[None]:
    """``block`` checkpointed on its own as ``apply`` does it (a one-block segment): its hooks
    open and close the region, so that other hooks on the block run outside it, as in a
    planned step (FSDP2's all-gather before the block, its reshard after). The region is
    named as the block is in the model: a ``CheckpointError`` says which block."""
    handle = checkpoint_segments([block], [(0, 0)], policies=[policy], names=[name])
    try:
        yield
    finally:
        handle.remove()


def _backward_from_ones(
    output: torch.Tensor, memory: MemoryMeter, stride: tuple[int, ...] | None = None
) -> Callable[[], int]:
    """The backward from ``output`` with a gradient of ones, to run once the caller has let
    ``output`` go; it returns its peak above what existed when the gradient was made (the
    saved tensors and the gradient).

    The gradient is made inside the backward (``_OnesGradient``), as the step's is, and freed
    once the first node has used it: held by the caller, it was counted through the whole
    backward (a RegNet block's peak, at its input's gradient, one output over the step's).
    ``stride``: the gradient laid out as the step gave it (``BlockCall.gradient_stride``)."""
    started: list[int] = []

    def gradient_made() -> None:
        started.append(memory.current())
        memory.reset_peak()

    with BOOKKEEPING:  # the stand-in's own operations are not the block's
        seed = _OnesGradient.apply(output, gradient_made, stride)
        one = torch.ones_like(seed)
    edge = torch.autograd.graph.get_gradient_edge(seed)
    del seed

    def backward() -> int:
        torch.autograd.backward(edge, one)
        return memory.peak() - started[0]

    return backward


class _OnesGradient(torch.autograd.Function):
    """A zero-dimensional stand-in for a block's output whose backward hands the output a
    gradient of ones made there, which nothing outside the backward holds, and calls
    ``made`` once it exists."""

    @staticmethod
    def forward(ctx: Any, output: torch.Tensor, made: Callable[[], None],
                stride: tuple[int, ...] | None) -> torch.Tensor:
        ctx.shape, ctx.made, ctx.stride = output.shape, made, stride
        return output.new_zeros(())

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        if ctx.stride is not None:  # laid out as the step's (PVT's, through a permutation)
            ones = gradient.new_empty_strided(ctx.shape, ctx.stride).fill_(1)
        else:
            with BOOKKEEPING:
                like = gradient.expand(ctx.shape)
            ones = torch.ones_like(like)  # as a backward from ``ones_like`` is timed elsewhere
        ctx.made()
        return ones, None, None


def _returned_bytes(output: Any, hidden: torch.Tensor, excluded: set) -> int:
    """The bytes of the distinct storages of the tensors in ``output`` besides the hidden
    state's (a layer's attention weights), leaving out ``excluded`` (its arguments passed
    back, its parameters)."""
    sizes = {storage_key(tensor): tensor.untyped_storage().nbytes()
             for tensor in tensors_in(output)}
    sizes.pop(storage_key(hidden), None)
    return sum(nbytes for key, nbytes in sizes.items() if key not in excluded)


def _objects_passed(call: BlockCall) -> list[Any]:
    """The arguments of a block's call that are neither tensors nor plain values: objects
    its forward may store tensors in (a dictionary of key/value states shared by layers)."""
    return [leaf for leaf in call.leaves if is_passed_object(leaf)]


def _storages_held_by(objects: list[Any]) -> dict[int, int]:
    """The storages of the tensors ``objects`` hold (through containers and attributes, as
    the meter finds them), with their bytes."""
    if not objects:
        return {}
    return {storage_key(found): found.untyped_storage().nbytes() for found in trackable(objects)
            if isinstance(found, torch.Tensor)}


def _block_output(output: Any) -> torch.Tensor:
    tensor = first_tensor(output)
    if tensor is None:
        raise UsageError("a block returned no tensor: it cannot be part of a chain")
    return tensor
