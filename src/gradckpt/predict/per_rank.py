"""One rank's profile when ranks shard the model: ``gradckpt.estimate(..., world_size=N)``.

``estimate`` first predicts one process training the whole model. With FSDP2 (``fully_shard``
on each block of the chain, then on the root, which takes what is left: embeddings, final norm,
output head) each of ``N`` ranks keeps 1/N of the parameters, gradients and optimizer state, and
holds more at times. This module turns the single-process profile into one rank's, so that the
budget is a per-rank budget; its plain-step peak is the cost model's (``cost.plan_for`` with no
segments), as every plan's is. What a rank holds besides its shards, as torch 2.13's
``torch/distributed/fsdp/_fully_shard`` does it (each item below is one term of ``shard``):

- the root's parameters in full from before the embedding runs until the root's reduce-scatter
  after the last backward (the root does not reshard after forward), and the gradients of the
  root's parameters (output head, embeddings) in full until then;
- in a block's forward, its parameters gathered and the all-gather buffer they were copied from:
  FSDP2 keeps that buffer until the next block's copy-out, so that the next copy-in can overlap
  this all-gather. The last block's buffer lives through the head's forward (freed when the
  root's forward ends); the root's, until block 0's has been gathered;
- in a block's backward, its parameters gathered, the next block to run's all-gather buffer
  (prefetched: in the head's backward, the last block's), the reduce-scatter buffer of the block
  whose backward ran before (kept until this block reduce-scatters) and its own gradients in full
  until it reduce-scatters them; after that only its 1/N of them;
- in the embedding's backward, block 0's reduce-scatter buffer besides the root's gradients.

Activations are per rank already (the sample is one rank's batch).

Measured: ``tests/predict/test_predict_per_rank.py`` trains a 4-layer Llama with
``fully_shard`` on 2 CPU processes (gloo, reduce-scattering in place as NCCL does: gloo's own
copies its input): plain, with a vocabulary large enough for the root to make the peak, LoRA on
a frozen base, and every layer checkpointed (a plan ``gradckpt.solve`` made from this profile).
Each rank's peak of forward and backward is within 156 bytes of the prediction
(docs/estimate.md has the figures).

Not modeled: FSDP units other than one per block plus the root; shard padding (FSDP2 pads each
parameter's first dimension to a multiple of ``N``: at most ``N - 1`` rows per parameter);
``MixedPrecisionPolicy``, ``reshard_after_forward=False`` on blocks, CPU offload, explicit
prefetching (``set_modules_to_forward_prefetch``); the time of the collectives. A checkpointed
block's recomputation runs FSDP2's hooks again and holds what its backward holds anyway
(measured for one-block segments; segments of several blocks run under FSDP2 with the
gradients of a run without them, ``tests/integrations/test_integrations_fsdp.py``, their memory
not yet measured against this model). ZeRO-3 shards the same parts with buffers of its own,
not measured here.
"""

from __future__ import annotations

import dataclasses

from ..cost import plan_for
from ..measure.memory_parts import (
    FSDP_GATHERED,
    FSDP_ROOT,
    GRADIENTS,
    OPTIMIZER_STATE,
    PARAMETERS,
)
from ..profile_types import BlockProfile, ChunkedHead, Profile

__all__ = ["BLOCK_PARAMETERS", "shard"]

# Per block, its parameters' bytes in the dtype trained in (``estimate`` notes them).
BLOCK_PARAMETERS = "block_parameter_bytes"


def shard(predicted: Profile, world_size: int) -> Profile:
    """``predicted`` (from ``estimate`` with one process) as one of ``world_size`` ranks running
    FSDP2 with ``fully_shard`` on each block and on the root (see the module's docstring).

    Each block's parameter bytes come from ``notes["block_parameter_bytes"]`` (``estimate``
    notes them); without them every block is taken to hold
    ``notes["largest_block_parameter_bytes"]``.

    Example:
        >>> from gradckpt.profile_types import Profile, example_block
        >>> block = example_block("h.0", gradient_bytes=400)
        >>> whole = Profile([block], 2000, 1500, 4.0, notes={"memory_parts": {
        ...     "parameters": 800, "gradients (trainable parameters)": 800,
        ...     "optimizer state": 0}, "largest_block_parameter_bytes": 400})
        >>> per_rank = shard(whole, 2)
        >>> per_rank.notes["memory_parts"]["parameters"]
        400
        >>> per_rank.fixed_bytes  # 1500 - 400 of the parameters + 400 of the root's, in full
        1500
    """
    parts = dict(predicted.notes["memory_parts"])
    keep = 1 / world_size
    parameter_bytes = parts.get(PARAMETERS, 0)
    gathered = _gathered_per_block(predicted)
    gradients = [block.gradient_bytes for block in predicted.blocks]
    # The root holds the rest: its parameters stay gathered from its forward to its
    # reduce-scatter, after every block's backward (its 1/N shard stays too).
    root = max(0, parameter_bytes - sum(gathered))
    root_gradients = max(0, parts.get(GRADIENTS, 0) - sum(gradients))
    for name in (PARAMETERS, OPTIMIZER_STATE, GRADIENTS):
        if name in parts:
            parts[name] = int(parts[name] * keep)
    parts[FSDP_GATHERED] = max(
        (max(2 * gathered[i], held) for i, held in enumerate(_backward_held(gathered, gradients))),
        default=0,
    )
    if root:
        parts[FSDP_ROOT] = root + root_gradients
    # What the one-process step started with: ``fixed_bytes`` counts the optimizer's state and
    # accumulated gradients besides it, and the step's phase peaks are absolute.
    accumulated = predicted.accumulated_gradient_bytes
    start = predicted.fixed_bytes - predicted.optimizer_state_bytes - accumulated
    # optimizer.step() runs on each rank's shards; the output the loop holds is the rank's own.
    held_output = predicted.previous_output_bytes
    sharded = dataclasses.replace(
        predicted,
        blocks=_sharded_blocks(predicted.blocks, gathered, keep),
        fixed_bytes=predicted.fixed_bytes
        - int((1 - keep) * (parameter_bytes + predicted.optimizer_state_bytes + accumulated))
        + root,
        optimizer_state_bytes=int(predicted.optimizer_state_bytes * keep),
        accumulated_gradient_bytes=int(accumulated * keep),
        optimizer_step_bytes=int(max(0, predicted.optimizer_step_bytes - held_output) * keep)
        + min(held_output, predicted.optimizer_step_bytes),
        # The last block's all-gather buffer: alive through the head's forward (freed when the
        # root's forward ends), then gathered again in its backward (the root prefetches it).
        head_bytes=predicted.head_bytes + (gathered[-1] if gathered else 0),
        # The head's gradients are the root's: in full until the root reduce-scatters them at
        # the end of backward (and the logits the step's output holds are a rank's own).
        head_gradient_bytes=predicted.head_gradient_bytes,
        other_peak_bytes=_other_peak(predicted, start, root, gathered, gradients, keep),
        notes={**predicted.notes, "memory_parts": parts, "world_size": world_size,
               "largest_part": max(parts, key=parts.get)},
    )
    sharded.chunked_heads = [
        _sharded_head(head, predicted, sharded, gathered[-1] if gathered else 0, keep)
        for head in predicted.chunked_heads
    ]
    sharded.peak_bytes = plan_for(sharded, "none", None, []).predicted_peak_bytes
    for head in sharded.chunked_heads:
        head.peak_bytes = plan_for(sharded, "none", None, [],
                                   head_chunks=head.chunks).predicted_peak_bytes
    return sharded


def _sharded_head(
    head: ChunkedHead, predicted: Profile, sharded: Profile, last_gathered: int, keep: float
) -> ChunkedHead:
    """The step with its head in chunks, on one rank: as the plain step's numbers are sharded
    (the last block's all-gather buffer through the head, optimizer.step() on the shards, the
    output the rank's own); the part outside the chain lower than the sharded plain one's by
    what the chunked step's is lower (the logits the output no longer holds)."""
    held_output = head.previous_output_bytes
    return dataclasses.replace(
        head,
        head_bytes=head.head_bytes + last_gathered,
        optimizer_step_bytes=int(max(0, head.optimizer_step_bytes - held_output) * keep)
        + min(held_output, head.optimizer_step_bytes),
        other_peak_bytes=max(0, sharded.other_peak_bytes
                             - (predicted.other_peak_bytes - head.other_peak_bytes)),
    )


def _gathered_per_block(predicted: Profile) -> list[int]:
    """Each block's parameter bytes in full: noted by ``estimate``, else the largest block's."""
    noted = predicted.notes.get(BLOCK_PARAMETERS)
    if noted is not None and len(noted) == len(predicted.blocks):
        return list(noted)
    largest = predicted.notes.get("largest_block_parameter_bytes", 0)
    return [largest] * len(predicted.blocks)


def _backward_held(gathered: list[int], gradients: list[int]) -> list[int]:
    """Per block i, what FSDP2 holds in full during its backward besides its own gradients: its
    parameters, block i - 1's all-gather buffer (prefetched: block 0 prefetches nothing) and
    block i + 1's reduce-scatter buffer (its gradients, in full until block i's reduce-scatter
    pops it; the last block has none before it)."""
    count = len(gathered)
    return [gathered[i] + (gathered[i - 1] if i > 0 else 0)
            + (gradients[i + 1] if i + 1 < count else 0) for i in range(count)]


def _sharded_blocks(
    blocks: list[BlockProfile], gathered: list[int], keep: float
) -> list[BlockProfile]:
    """The blocks with FSDP2's buffers added to their transient peaks and 1/N of their gradients
    kept after their backward (they are reduce-scattered)."""
    held = _backward_held(gathered, [block.gradient_bytes for block in blocks])

    def plus(value: int | None, extra: int) -> int | None:
        return None if value is None else value + extra

    sharded = []
    for block, full, backward in zip(blocks, gathered, held, strict=True):
        forward = 2 * full  # the parameters and the all-gather buffer they came from
        sharded.append(dataclasses.replace(
            block,
            gradient_bytes=int(block.gradient_bytes * keep),
            forward_peak_bytes=block.forward_peak_bytes + forward,
            checkpointed_forward_peak_bytes=plus(block.checkpointed_forward_peak_bytes, forward),
            policy_forward_peak_bytes=plus(block.policy_forward_peak_bytes, forward),
            backward_peak_bytes=block.backward_peak_bytes + backward,
            checkpointed_backward_peak_bytes=plus(block.checkpointed_backward_peak_bytes,
                                                  backward),
            policy_backward_peak_bytes=plus(block.policy_backward_peak_bytes, backward),
        ))
    return sharded


def _other_peak(
    predicted: Profile, start: int, root: int, gathered: list[int], gradients: list[int],
    keep: float,
) -> int:
    """The step's peak outside the chain, above the sharded ``fixed_bytes``.

    Before the chain: the root's all-gather buffer is alive until block 0's parameters have been
    gathered into a buffer of their own, beside the root's gathered parameters (in
    ``fixed_bytes``); counted on top of the phase's own peak (an upper bound). After it (the
    embedding's backward): the blocks' gradients are 1/N each, but block 0's reduce-scatter
    buffer is still alive (the root's reduce-scatter frees it, after freeing the root's
    gathered parameters: no higher). Without the one-process step's phases (a hand-made
    profile), its ``other_peak_bytes`` stands for the part after the chain.
    """
    phases = predicted.notes.get("measured_phase_peaks") or {}
    first = gathered[0] if gathered else 0
    before = max(0, phases.get("before", start) - start) + root + first
    after = predicted.other_peak_bytes
    if "after" in phases:
        after = max(0, phases["after"] - start)
    after += (gradients[0] if gradients else 0) - int((1 - keep) * sum(gradients))
    return max(0, before, after)
