"""The measured step's memory read as the phases ``gradckpt.cost`` walks (``assemble``):
what is fixed, what the part before the chain holds, the head's bytes and what stays through
the chain's backward besides the chain's own tensors (``_head_leftovers``); then the loop's
steady state (``steady_state``: the optimizer's state and step, gradients held between
micro-batches, DDP's buckets) and a chunked head's step as a plan choosing it sees it
(``chunked_head``). ``profile`` measures; this puts the readings in the ``Profile``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..profile_types import BlockProfile, ChunkedHead, Profile
from .host_link import host_link_notes
from .optimizer_step import OptimizerStep
from .output_head import HeadMeasurement
from .step_memory import StepMemory
from .tensors import tensor_bytes, tensors_in

__all__ = ["assemble", "chunked_head", "steady_state"]


def assemble(
    blocks: list[BlockProfile], memory: StepMemory, step_seconds: float, device: torch.device,
    chain_breaks: list[int], counted_by_blocks_bytes: int = 0, chain_input_fixed: bool = False,
    previous_output_bytes: int = 0, first_side_bytes: int = 0,
) -> Profile:
    """The profile, with the step's phases expressed the way ``gradckpt.cost`` models them.
    ``counted_by_blocks_bytes``: what is alive when the chain's backward ends that the blocks'
    ``side_gradient_bytes`` count already, not the head's: gradients made inside the chain's
    backward outside its blocks, and side inputs the step's output holds.
    ``previous_output_bytes``: the previous step's output, alive at the start of the measured
    step and let go when its forward returns: not fixed (the phases before that count it).
    ``first_side_bytes``: the first block's side inputs, which exist when the chain starts and
    its walk counts as the blocks' (``before_chain_bytes`` is the rest made before it)."""
    fixed = memory.start - previous_output_bytes
    measured = Profile(
        blocks,
        peak_bytes=memory.peak,
        fixed_bytes=fixed,
        step_seconds=step_seconds,
        device=str(device),
        other_peak_bytes=max(0, memory.highest["before"] - fixed, memory.highest["after"] - fixed),
        chain_breaks=chain_breaks,
        chain_input_fixed=chain_input_fixed,
        previous_output_bytes=previous_output_bytes,
    )
    if memory.chain_forward_start:
        measured.before_chain_bytes = max(0, memory.chain_forward_start - memory.start
                                          - (0 if chain_input_fixed else blocks[0].input_bytes)
                                          - first_side_bytes)
    retained = measured.plain_retained_bytes()
    measured.head_bytes = max(0, memory.highest["head"] - fixed - retained)
    measured.head_gradient_bytes = _head_leftovers(
        blocks, memory, fixed, retained, counted_by_blocks_bytes
    )
    measured.notes["chain_backward_start_bytes"] = memory.chain_backward_start
    measured.notes.update(host_link_notes(device))
    measured.notes["measured_phase_peaks"] = dict(memory.highest)
    return measured


def steady_state(
    measured: Profile, memory: StepMemory, optimizer_step: OptimizerStep | None,
    accumulated_bytes: int, ddp_bytes: int, model: nn.Module, sample: Any, keep_output: bool,
) -> Profile:
    """The measured step as the loop's steady state: the optimizer's state, the gradients
    earlier micro-batches hold and DDP's buckets (``ddp_bytes``), alive all step, and
    ``optimizer.step()`` after backward (every gradient and the output the loop holds alive,
    plus the optimizer's temporaries); with the notes that explanations of the plan read."""
    state_bytes = optimizer_step.state_bytes if optimizer_step else 0
    measured.optimizer_state_bytes = state_bytes
    measured.accumulated_gradient_bytes = accumulated_bytes
    if optimizer_step is not None:
        after_backward = memory.end - (memory.start - measured.previous_output_bytes)
        measured.optimizer_step_bytes = (max(0, after_backward - accumulated_bytes)
                                         + optimizer_step.temporary_bytes)
    held_all_step = state_bytes + accumulated_bytes + ddp_bytes
    measured.fixed_bytes += held_all_step
    measured.peak_bytes = max(memory.peak + held_all_step,
                              measured.fixed_bytes + measured.optimizer_step_bytes)
    parameters = list({id(p): p for p in model.parameters()}.values())
    dtypes: dict[str, int] = {}
    for parameter in parameters:
        dtypes[str(parameter.dtype)] = dtypes.get(str(parameter.dtype), 0) + tensor_bytes(
            parameter)
    first = next(iter(tensors_in(sample)), None)
    measured.notes.update(
        keep_output=keep_output,
        optimizer=optimizer_step.name if optimizer_step else None,
        optimizer_temporaries_measured=optimizer_step.measured if optimizer_step else None,
        parameter_dtypes=dtypes,
        trainable_parameter_bytes=sum(tensor_bytes(p) for p in parameters if p.requires_grad),
        batch_size=int(first.shape[0]) if first is not None and first.dim() else None,
    )
    if ddp_bytes:  # the memory parts name them (measure/memory_parts.py)
        measured.notes["ddp_bucket_bytes"] = ddp_bytes
    return measured


def chunked_head(head: HeadMeasurement, step: Profile) -> ChunkedHead:
    """What a plan choosing the chunked head changes: its step's profile where it differs."""
    return ChunkedHead(
        name=head.name, chunks=head.chunks, head_bytes=step.head_bytes,
        head_gradient_bytes=step.head_gradient_bytes, other_peak_bytes=step.other_peak_bytes,
        optimizer_step_bytes=step.optimizer_step_bytes,
        previous_output_bytes=step.previous_output_bytes, peak_bytes=step.peak_bytes,
        extra_seconds=head.extra_seconds,
    )


def _head_leftovers(
    blocks: list[BlockProfile], memory: StepMemory, fixed: int, retained: int,
    counted_by_blocks_bytes: int,
) -> int:
    """What stays allocated through the chain's backward besides the chain's own tensors: the
    head's parameter gradients, what the part before the chain saved (its dropout mask), and
    what the step's output holds (the logits, unless ``keep_output=False``).

    Read when the chain's backward ends, less the blocks' gradients and the input's gradient:
    at its start, scalars of the loss's backward still exist that die before any block runs.
    Without that hook (a chain input that needs no gradient) the start is all there is.
    The chain's input, where the modules before it saved it (a CNN stem's ReLU its output)
    and the first block saves it too, is the chain's (the walk retains it with that block's
    saved bytes): counted here as well, it came out one input too many through the whole
    backward (RegNet, 1 MB: +14% on its plain step). What the part before the chain saved
    and freed after the chain's backward started but before its end was read counts too
    (``StepMemory.freed_before_end``): it was alive through every block's backward.
    """
    if memory.chain_backward_end:
        input_counted = (blocks[0].input_bytes
                         if memory.chain_input_alive_at_end and blocks[0].input_saved else 0)
        made_by_chain = (sum(block.gradient_bytes for block in blocks) + blocks[0].input_bytes
                         + input_counted + counted_by_blocks_bytes)
        return max(0, memory.chain_backward_end - fixed - made_by_chain
                   + memory.freed_before_end)
    return max(0, memory.chain_backward_start - fixed - retained - blocks[-1].output_bytes)
