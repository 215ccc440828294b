"""The cost model: what a plan costs, walked through the training step.

``simulate(profile, segments)`` is the cost model every solver optimizes and every prediction
comes from: it walks the training step as the engine runs it (see ``docs/engine.md``, segments)
and returns the chain's peak memory and the extra (recomputation) time.

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

from .errors import UsageError
from .measure.fingerprint import BLOCK_FINGERPRINTS, CHAIN_LENGTHS
from .op_choices import HOST_LINK, kept_by_policy, offload_offer, policy_cost
from .plan import BlockBytes, Plan, Segment
from .profile_types import BlockProfile, Profile

__all__ = [
    "simulate", "phase_peaks", "plan_for", "as_chunked", "as_planned", "gradients_after",
    "side_inputs_held", "output_kept_bytes",
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
        governed = set(_policy_blocks(segment)) if segment.policy else set()
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


# The step's phases, in order; its peak is the highest of them.
PHASES = ("forward", "head", "backward", "other", "optimizer")


def simulate(profile: Profile, segments: list[Segment]) -> tuple[int, float]:
    """The step's peak memory (bytes, above ``fixed_bytes``) and extra seconds under a plan."""
    phases, extra_seconds = _walk_step(profile, segments)
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
    return _walk_step(profile, segments)[0]


def _walk_step(profile: Profile, segments: list[Segment]) -> tuple[dict[str, int], float]:
    blocks = profile.blocks
    profile.validate()
    _check_segments(segments, 0, len(blocks) - 1)
    _check_chain_breaks(segments, profile)
    walk = _Walk(profile, checkpointing=bool(segments))
    items = _items(segments, 0, len(blocks) - 1)
    retained, forward_peak, added = walk.forward(items, 0, profile.input_held(0), 0, top=True)
    head_peak = retained + profile.head_bytes
    backward_peak, _ = walk.backward(items, added, retained)
    phases = dict(zip(PHASES, (forward_peak + profile.previous_output_bytes
                               + profile.before_chain_bytes, head_peak,
                               backward_peak, profile.other_peak_bytes,
                               profile.optimizer_step_bytes), strict=True))
    return {**phases, "retained": retained}, walk.extra_seconds


def gradients_after(profile: Profile) -> list[int]:
    """Per block i, the gradients allocated when its backward starts: the parameter gradients
    of the head and of every later block (gradients start the step as None), and those of
    side inputs later blocks took too (``BlockProfile.side_gradient_bytes``).

    Example:
        >>> from gradckpt.profile_types import Profile, example_block
        >>> blocks = [example_block(f"h.{i}", gradient_bytes=10) for i in range(3)]
        >>> gradients_after(Profile(blocks, 0, 0, 1.0, head_gradient_bytes=5))
        [25, 15, 5]
    """
    after = [0] * len(profile.blocks)
    total = profile.head_gradient_bytes
    for index in range(len(profile.blocks) - 1, -1, -1):
        after[index] = total + profile.blocks[index].side_gradient_bytes
        total += profile.blocks[index].gradient_bytes
    return after


def side_inputs_held(profile: Profile, checkpointing: bool) -> list[int]:
    """Per block, the side inputs counted in it (``BlockProfile.side_bytes``), plus, when the
    plan checkpoints anything, those no block saves (``held_side_bytes``): a segment keeps
    them for its recomputation, the plain model frees them after its forward.

    Example:
        >>> from gradckpt.profile_types import example_block
        >>> blocks = [example_block("h.0", side_bytes=4), example_block("h.1", held_side_bytes=8)]
        >>> profile = Profile(blocks, 0, 0, 1.0)
        >>> side_inputs_held(profile, False), side_inputs_held(profile, True)
        ([4, 0], [4, 8])
    """
    return [block.side_bytes + (block.held_side_bytes if checkpointing else 0)
            for block in profile.blocks]


def returned_alive(profile: Profile) -> list[int]:
    """Per block, the tensors the block before it returned besides its hidden state
    (``BlockProfile.returned_bytes``), which the model's loop holds while this block runs
    forward: they count there when that block is checkpointed (kept, its graph saves them).
    None after a chain break, where the loop that held them has ended.

    Example:
        >>> from gradckpt.profile_types import Profile, example_block
        >>> blocks = [example_block(f"h.{i}", returned_bytes=8) for i in range(3)]
        >>> returned_alive(Profile(blocks, 0, 0, 1.0)), returned_alive(
        ...     Profile(blocks, 0, 0, 1.0, chain_breaks=[2]))
        ([0, 8, 8], [0, 8, 0])
    """
    return [0] + [
        0 if index in profile.chain_breaks else profile.blocks[index - 1].returned_bytes
        for index in range(1, len(profile.blocks))
    ]


def output_kept_bytes(block: BlockProfile, policy: str) -> int:
    """Of the outputs ``policy`` keeps of ``block`` checkpointed, its own output's bytes
    (``OpChoice.output_kept_bytes``, measured with the choice; 0 where not measured).

    Example:
        >>> from gradckpt.profile_types import OpChoice, example_block
        >>> block = example_block(op_choices=[OpChoice("save-ops:aten.relu", 0, 0.1, 20, 30, 10)])
        >>> output_kept_bytes(block, "save-ops:aten.relu"), output_kept_bytes(block, "save-matmuls")
        (10, 0)
    """
    name = policy_cost(block, policy).policy
    return next((choice.output_kept_bytes for choice in block.op_choices
                 if choice.policy == name), 0)


def _items(segments: list[Segment], start: int, end: int) -> list[int | Segment]:
    """Blocks start..end in order, with each segment standing for its blocks."""
    by_start = {segment.start: segment for segment in segments}
    items: list[int | Segment] = []
    index = start
    while index <= end:
        if index in by_start:
            items.append(by_start[index])
            index = by_start[index].end + 1
        else:
            items.append(index)
            index += 1
    return items


def _check_segments(segments: list[Segment], start: int, end: int) -> None:
    previous_end = start - 1
    for segment in sorted(segments, key=lambda s: s.start):
        if not (previous_end < segment.start <= segment.end <= end):
            raise UsageError(
                f"segment {segment.start}-{segment.end} does not fit: segments must lie within "
                f"blocks {start}-{end} and must not overlap"
            )
        _check_segments(segment.children, segment.start, segment.end)
        previous_end = segment.end


def _check_chain_breaks(segments: list[Segment], profile: Profile) -> None:
    for segment in segments:
        if segment.end > profile.segment_end_limit(segment.start):
            first = min(i for i in profile.chain_breaks if segment.start < i <= segment.end)
            names = [block.name for block in profile.blocks]
            raise UsageError(
                f"segment {segment.start}-{segment.end} spans blocks {first - 1} and {first} "
                f"({names[first - 1]} -> {names[first]}), but block {first} does not take block "
                f"{first - 1}'s output (something runs between them, e.g. encoder to decoder); "
                f"split the segment there"
            )
        _check_chain_breaks(segment.children, profile)


class _Walk:
    """Walks a step through the chain, tracking retained bytes; accumulates recompute time."""

    def __init__(self, profile: Profile, checkpointing: bool) -> None:
        self.blocks = profile.blocks
        self.gradients_after = gradients_after(profile)
        self.side = side_inputs_held(profile, checkpointing)
        # Whether block i + 1's input is retained already when block i is kept before it.
        self.passes_input = [profile.input_held(i + 1) for i in range(len(self.blocks))]
        self.host_link = profile.notes.get(HOST_LINK)
        self.returned = returned_alive(profile)
        self.extra_seconds = 0.0
        # Per segment under an op-level choice (by id), the blocks' own outputs its policy
        # keeps that nothing else retains: counted from its first forward to its backward.
        self.outputs_kept: dict[int, dict[int, int]] = {}

    def _outputs_kept(self, segment: Segment, next_item: int | Segment | None) -> dict[int, int]:
        """Per block of ``segment`` its policy governs, its own output the policy keeps where
        nothing else retains it: inside the segment, the next block saves nothing in the first
        forward; after its last, ``next_item`` retains it if a segment (its input) or a kept
        block saving its input."""
        held_after = isinstance(next_item, Segment) or (
            next_item is not None and self.blocks[next_item].input_saved)
        kept = {j: output_kept_bytes(self.blocks[j], segment.policy)
                for j in _policy_blocks(segment) if j < segment.end or not held_after}
        return {j: nbytes for j, nbytes in kept.items() if nbytes}

    def forward(
        self, items: list[int | Segment], retained: int, input_retained: bool, alive: int,
        kept_by_policy: dict[int, int] | None = None, top: bool = False,
    ) -> tuple[int, int, list[int]]:
        """Run items forward. ``input_retained``: the first item's input is already counted in
        ``retained``; ``alive``: bytes alive throughout (a gradient waiting for this part);
        ``kept_by_policy``: blocks whose policy's outputs are already retained, with their
        bytes; ``top``: the
        chain's top level, whose items hold their blocks' side inputs (inside a segment's
        recomputation the segment holds them already).
        Returns retained after, the peak, and what each item added (released in backward)."""
        peak = 0
        added_per_item = []
        # What the block before returned besides its hidden state is held by the model's
        # loop while the next block runs; nothing else holds it where it was checkpointed.
        after_checkpointed = False
        for position, item in enumerate(items):
            if isinstance(item, Segment):
                block = self.blocks[item.start]
                added = 0 if input_retained else block.input_bytes
                if top:  # the segment keeps its blocks' other inputs from its start on
                    added += sum(self.side[j] for j in item.blocks())
                # What the policy keeps of each block, counted from that block's forward on.
                kept: dict[int, int] = {}
                outputs: dict[int, int] = {}
                if item.policy is not None:
                    following = items[position + 1] if position + 1 < len(items) else None
                    outputs = self.outputs_kept[id(item)] = self._outputs_kept(item, following)
                    kept = {j: policy_cost(self.blocks[j], item.policy, self.host_link)
                            .kept_bytes + outputs.get(j, 0) for j in _policy_blocks(item)}
                before = retained + added
                retained = before + sum(kept.values())
                for j in item.blocks():
                    # Its input, unless the policy keeps it as the block before's output.
                    hidden = 0 if j == item.start or outputs.get(j - 1) else (
                        self.blocks[j].input_bytes)
                    returned = self.returned[j] if after_checkpointed or j > item.start else 0
                    peak = max(peak, alive + before + hidden + returned
                               + _segment_transient(self.blocks, item, j, self.host_link))
                    before += kept.get(j, 0)
                added += sum(kept.values())
                after_checkpointed = True
            else:
                block = self.blocks[item]
                hidden = 0 if input_retained else block.input_bytes
                side = self.side[item] if top else 0
                added = block.saved_bytes + side
                # Side inputs exist before the block runs, its own peak comes on top.
                returned = self.returned[item] if after_checkpointed else 0
                # Recomputed under a policy, its kept outputs are reused, not made again.
                reused = kept_by_policy.get(item, 0) if kept_by_policy else 0
                peak = max(peak, alive + retained + hidden + side + returned
                           + max(block.forward_peak_bytes - reused, 0))
                after_checkpointed = False
                if input_retained and block.input_saved:
                    added -= block.input_bytes  # the same tensor, retained already
                if kept_by_policy and item in kept_by_policy:
                    added -= kept_by_policy[item]  # kept from the first forward already
                retained += added
            added_per_item.append(added)
            # A kept block whose graph saves its output retains the next item's input.
            input_retained = not isinstance(item, Segment) and self.passes_input[item]
        return retained, peak, added_per_item

    def backward(
        self, items: list[int | Segment], added_per_item: list[int], retained: int,
        segment_end: int | None = None,
    ) -> tuple[int, int]:
        """Run items' backward in reverse; returns the peak and retained after.
        ``segment_end``: the last block of the segment whose recomputation these items are."""
        peak = 0
        for item, added in zip(reversed(items), reversed(added_per_item), strict=True):
            if isinstance(item, Segment):
                gradient = self.blocks[item.end].output_bytes
                inner_items = _items(item.children, item.start, item.end)
                policies = {j: policy_cost(self.blocks[j], item.policy, self.host_link)
                            for j in _policy_blocks(item)} if item.policy else {}
                self.extra_seconds += sum(
                    policies[j].extra_seconds if j in policies
                    else self.blocks[j].recompute_seconds()
                    for j in item.blocks()
                )
                # A child ending where its segment ends is run through by the segment's
                # recomputation and holds what its blocks kept would (measured: LoRA blocks
                # 4.6% above the one-block measurement): walked as that, not as measured.
                measured = (_measured_backward_peak(self.blocks, item, self.host_link)
                            if item.end != segment_end else None)
                outputs = self.outputs_kept.get(id(item), {})
                if measured is not None:
                    # Exactly what profile ran: this block checkpointed alone (its kept
                    # output in its peak, retained here already where counted).
                    peak = max(peak, retained + gradient + self.gradients_after[item.end]
                               + measured - sum(outputs.values()))
                    retained -= added
                    continue
                # A kept output that its block's graph saves is retained already.
                inner_retained, inner_forward_peak, inner_added = self.forward(
                    inner_items, retained, True, gradient + self.gradients_after[item.end],
                    {j: cost.kept_bytes + (outputs.get(j, 0) if self.blocks[j].output_saved
                                           else 0) for j, cost in policies.items()},
                )
                inner_backward_peak, _ = self.backward(inner_items, inner_added, inner_retained,
                                                       segment_end=item.end)
                peak = max(peak, inner_forward_peak, inner_backward_peak,
                           self._last_block_measured(item, inner_items, inner_added, retained,
                                                     outputs, policies))
            else:
                block = self.blocks[item]
                peak = max(peak, retained + block.output_bytes + block.backward_peak_bytes
                           + self.gradients_after[item])
            retained -= added
        return peak, retained

    def _last_block_measured(
        self, segment: Segment, inner_items: list[int | Segment], inner_added: list[int],
        retained: int, outputs: dict[int, int], policies: dict,
    ) -> int:
        """A longer segment's last block, under a choice ``profile`` measured for it alone:
        its recomputation and backward peak as measured, on top of what the blocks before it
        hold recomputed; 0 where not measured. Walked as kept (the plain block's backward
        peak), a PEFT Llama pair keeping their residual adds came out 0.6% under, at this
        measured peak."""
        end = segment.end
        if inner_items[-1] != end or end not in policies or end == segment.start:
            return 0
        measured = policies[end].backward_peak_bytes
        if measured is None:
            return 0
        # Its input: retained already where kept as the output before, or saved by it.
        covered = outputs.get(end - 1) or self.passes_input[end - 1]
        return (retained + sum(inner_added[:-1]) + (0 if covered else self.blocks[end].input_bytes)
                + self.blocks[end].output_bytes + self.gradients_after[end] + measured
                - outputs.get(end, 0))


def _segment_transient(
    blocks: list, segment: Segment, j: int, host_link: float | None
) -> int:
    """The most block j holds above its input while segment's first forward runs it, what
    the policy keeps of it included."""
    block = blocks[j]
    if segment.policy is None:
        return block.segment_forward_peak_bytes()  # saves nothing
    if j in _policy_blocks(segment):
        cost = policy_cost(block, segment.policy, host_link)
        if cost.backward_peak_bytes is not None:  # measured, checkpointed alone under it
            return cost.transient_bytes + cost.kept_bytes
    return block.forward_peak_bytes  # bounded: the plain forward saves more


def _measured_backward_peak(
    blocks: list, segment: Segment, host_link: float | None = None
) -> int | None:
    """A one-block segment's backward peak (recomputation included) is measured by
    ``profile``, with and without the policy; a longer one is walked block by block."""
    if segment.children or segment.start != segment.end:
        return None
    block = blocks[segment.start]
    if segment.policy is None:
        return block.checkpointed_backward_peak_bytes
    return policy_cost(block, segment.policy, host_link).backward_peak_bytes


def _policy_blocks(segment: Segment) -> list[int]:
    """The blocks of a segment that its own policy governs: those in none of its children."""
    inside_children = {j for child in segment.children for j in child.blocks()}
    return [j for j in segment.blocks() if j not in inside_children]
