"""The cost model: what a plan costs, walked through the training step.

``simulate(profile, segments)`` is the cost model every solver optimizes and every prediction
comes from: it walks the training step as the engine runs it (see ``docs/engine.md``, segments)
and returns the chain's peak memory and the extra (recomputation) time. The walk itself is in
``cost.walk``; what it reads of each block beside its profile, in ``cost.per_block``.

The model, per block i with input x_i, output x_(i+1) and saved bytes s_i (``BlockProfile``):

- forward, block kept: it adds s_i to what is retained (its input included if its graph keeps
  that); while it runs, memory peaks at retained + its input + ``forward_peak_bytes``. When
  the block before was kept and saved its output (``BlockProfile.output_saved``), or the input
  is the sample's (``Profile.chain_input_fixed``), that input is retained already: it is not
  counted again, and a segment starting there keeps it free;
- forward, segment s..e: it retains x_s only; its blocks run with nothing else retained,
  each peaking at ``segment_forward_peak_bytes()`` above its input (measured checkpointed, or
  the plain forward's peak);
- the head (output layer, loss, their backward): peak at what the chain retains + ``head_bytes``;
- backward, block kept: peak at retained + gradient x_(i+1) + ``backward_peak_bytes`` + the
  parameter gradients made before it (``head_gradient_bytes`` and every later block's
  ``gradient_bytes``: gradients start the step as None, as after ``zero_grad()``); then its s_i
  is released;
- backward, segment: its blocks run forward again (the children plan applies, with the incoming
  gradient x_(e+1) and the parameter gradients made so far alive), costing their
  ``recompute_seconds()`` (measured checkpointed, or their forward time), then their backward
  as above; then x_s is released. A one-block segment's backward peak is what ``profile``
  measured for that block checkpointed alone (``checkpointed_backward_peak_bytes``), where
  measured, except as the last child of another segment, which that segment's recomputation
  runs through: then it is walked as above. A segment with a policy keeps its
  blocks' outputs of the operations the policy names (``"save-matmuls"``: matmuls and
  attention; ``"save-ops:..."``: those listed) from the first forward and recomputes only the
  rest; a one-block segment's backward peak under the policy is measured too
  (``policy_backward_peak_bytes``, ``BlockProfile.op_choices``; its time from measured ones,
  ``gradckpt.op_choices.policy_cost``), a longer one is walked as above with each block's
  kept outputs counted from its first forward on (an upper bound), and not again in the
  forward peaks of its recomputation, which reuses them; its last block's backward no lower
  than measured alone under the policy. A block's own output the policy keeps
  (``output_kept_bytes``: a ReLU's) counts with them from the first forward to the
  recomputation, except where the next top-level item retains it already (a segment, or a
  kept block saving its input);
- side inputs (``side_bytes``: an encoder output the decoder blocks save) are retained by the
  top-level item holding the block they are counted in, from its forward to its backward,
  whatever the plan; so are those no block saves (``held_side_bytes``: T5's position bias),
  when the plan has any segment (segments keep them for recomputation); their gradients
  (``side_gradient_bytes``) count with the parameter gradients made before a block's backward;
- the previous step's output (``previous_output_bytes``: a loop's ``out = model(**batch)``
  holds it until the model returns) on top of the chain's forward;
- and, whatever the plan, ``other_peak_bytes`` (the step outside the chain) and
  ``optimizer_step_bytes`` (``optimizer.step()``, with every gradient alive).

Example:
    >>> from gradckpt.profile_types import Profile, example_block
    >>> blocks = [example_block(f"h.{i}") for i in range(4)]  # 10 in, 50 saved, 1 s + 2 s
    >>> profile = Profile(blocks, peak_bytes=1210, fixed_bytes=1000, step_seconds=12.0)
    >>> simulate(profile, [])  # all kept: 4 x 50 retained, plus the last block's gradient
    (210, 0.0)
    >>> simulate(profile, [Segment(0, 1), Segment(2, 3)])  # two inputs kept, 4 forwards redone
    (120, 4.0)
"""

from __future__ import annotations

from ..measure.fingerprint import BLOCK_FINGERPRINTS, CHAIN_LENGTHS
from ..op_choices import HOST_LINK, kept_by_policy, offload_offer, policy_cost
from ..plan import BlockBytes, Plan, Segment
from ..profile_types import Profile
from .per_block import gradients_after, output_kept_bytes, returned_alive, side_inputs_held
from .walk import PHASES, policy_blocks, walk_step

__all__ = [
    "simulate", "phase_peaks", "plan_for", "as_chunked", "as_planned", "gradients_after",
    "side_inputs_held", "output_kept_bytes", "returned_alive", "PHASES",
]


def plan_for(
    profile: Profile, strategy: str, budget_bytes: int | None, segments: list[Segment],
    head_chunks: int = 1,
) -> Plan:
    """Wrap segments into a ``Plan`` with the predictions ``simulate`` makes for them; with
    ``head_chunks`` above 1, for the step whose head's loss runs in that many chunks
    (``profile.chunked_head(head_chunks)``: its memory, and its extra time added).

    Example:
        >>> from gradckpt.profile_types import Profile, example_block
        >>> profile = Profile([example_block()], 1050, 1000, 4.0)
        >>> plan_for(profile, "every-layer", None, [Segment(0, 0)]).predicted_overhead
        0.25
    """
    step = as_chunked(profile, head_chunks)
    chain_peak, extra_seconds = simulate(step, segments)
    if head_chunks > 1:
        extra_seconds += profile.chunked_head(head_chunks).extra_seconds
    return Plan(
        strategy=strategy,
        budget_bytes=budget_bytes,
        segments=segments,
        predicted_peak_bytes=profile.fixed_bytes + chain_peak,
        predicted_extra_seconds=extra_seconds,
        predicted_overhead=extra_seconds / profile.step_seconds if profile.step_seconds else 0.0,
        block_names=[block.name for block in profile.blocks],
        block_fingerprints=list(profile.notes.get(BLOCK_FINGERPRINTS, [])),
        chain_lengths=dict(profile.notes.get(CHAIN_LENGTHS, {})),
        estimated_for=profile.notes.get("estimated_for"),
        head_name=profile.chunked_heads[0].name if profile.chunked_heads else None,
        head_chunks=head_chunks,
        block_bytes=block_bytes(step, segments),
        offload=offload_offer(profile)[1],
    )


def block_bytes(profile: Profile, segments: list[Segment]) -> list[BlockBytes]:
    """Per block, what ``segments`` keep, recompute and offload of what it saves (the top
    level's view: a nested segment's input is kept only while its parent is recomputed).
    A block's input that it saves is counted once, with the segment holding it.

    Example:
        >>> from gradckpt.profile_types import Profile, example_block
        >>> profile = Profile([example_block(f"h.{i}") for i in range(3)], 0, 0, 1.0)
        >>> [(b.kept, b.recomputed) for b in block_bytes(profile, [Segment(0, 1)])]
        [(10, 40), (0, 50), (50, 0)]
    """
    result = [BlockBytes(kept=block.saved_bytes, recomputed=0) for block in profile.blocks]
    for segment in segments:
        governed = set(policy_blocks(segment)) if segment.policy else set()
        for index in segment.blocks():
            block = profile.blocks[index]
            own_input = block.input_bytes if block.input_saved else 0
            kept = block.input_bytes if index == segment.start else 0
            kept_saved = own_input if index == segment.start else 0
            offloaded = 0
            if index in governed:
                cost = policy_cost(block, segment.policy, profile.notes.get(HOST_LINK))
                kept_saved += sum(nbytes for op, nbytes in block.saved_bytes_by_op.items()
                                  if kept_by_policy(segment.policy, op))
                kept += cost.kept_bytes
                offloaded = cost.offloaded_bytes
            result[index] = BlockBytes(kept, max(block.saved_bytes - kept_saved, 0), offloaded)
    return result


def as_planned(profile: Profile, plan: Plan) -> Profile:
    """The profile of the step ``plan`` runs: with its head in chunks when the plan chose so.

    Example:
        >>> from gradckpt.profile_types import Profile, example_block
        >>> profile = Profile([example_block()], 1050, 1000, 4.0)
        >>> as_planned(profile, plan_for(profile, "none", None, [])) is profile
        True
    """
    return as_chunked(profile, plan.head_chunks)


def as_chunked(profile: Profile, head_chunks: int) -> Profile:
    """The profile of the step whose head's loss runs in ``head_chunks`` pieces (1: itself)."""
    return profile.with_chunked_head(head_chunks) if head_chunks > 1 else profile


def simulate(profile: Profile, segments: list[Segment]) -> tuple[int, float]:
    """The step's peak memory (bytes, above ``fixed_bytes``) and extra seconds under a plan."""
    phases, extra_seconds = walk_step(profile, segments)
    return max(phases[phase] for phase in PHASES), extra_seconds


def phase_peaks(profile: Profile, segments: list[Segment]) -> dict[str, int]:
    """The highest memory above ``fixed_bytes`` in each phase of the step under a plan:
    ``"forward"`` (the chain's), ``"head"`` (output layer, loss and their backward),
    ``"backward"`` (the chain's, recomputation included), ``"other"`` (outside the chain),
    ``"optimizer"`` (``optimizer.step()``); and ``"retained"``, what the chain keeps for
    backward when its forward ends (under ``"head"``, the rest of that phase is
    ``Profile.head_bytes``). The step's peak is the largest phase: what an infeasible budget's
    error explains.

    Example:
        >>> from gradckpt.profile_types import Profile, example_block
        >>> blocks = [example_block(f"h.{i}") for i in range(4)]
        >>> profile = Profile(blocks, 1500, 1000, 12.0, head_bytes=300)
        >>> phase_peaks(profile, [Segment(0, 3)])
        {'forward': 20, 'head': 310, 'backward': 210, 'other': 0, 'optimizer': 0, 'retained': 10}
    """
    return walk_step(profile, segments)[0]
