"""The walk behind ``gradckpt.cost.simulate``: a step through the chain under a plan, item
by item (a kept block, or a segment standing for its blocks), forward then backward, tracking
what is retained and each phase's peak; the model it walks is described in ``gradckpt.cost``.
"""

from __future__ import annotations

from ..errors import UsageError
from ..op_choices import HOST_LINK, policy_cost
from ..plan import Segment
from ..profile_types import Profile
from .per_block import gradients_after, output_kept_bytes, returned_alive, side_inputs_held

# The step's phases, in order; its peak is the highest of them.
PHASES = ("forward", "head", "backward", "other", "optimizer")


def walk_step(profile: Profile, segments: list[Segment]) -> tuple[dict[str, int], float]:
    """The step's peak in each phase (``PHASES``, and ``"retained"``: what the chain keeps
    for backward when its forward ends) and its extra seconds under ``segments``.

    Example:
        >>> from gradckpt.profile_types import Profile, example_block
        >>> walk_step(Profile([example_block()], 1050, 1000, 4.0), [])  # 50 saved, 10 out
        ({'forward': 10, 'head': 50, 'backward': 60, 'other': 0, 'optimizer': 0,
          'retained': 50}, 0.0)
    """
    blocks = profile.blocks
    profile.validate()
    check_segments(segments, 0, len(blocks) - 1)
    check_chain_breaks(segments, profile)
    walk = Walk(profile, checkpointing=bool(segments))
    items = items_of(segments, 0, len(blocks) - 1)
    retained, forward_peak, added = walk.forward(items, 0, profile.input_held(0), 0, top=True)
    head_peak = retained + profile.head_bytes
    backward_peak, _ = walk.backward(items, added, retained)
    phases = dict(zip(PHASES, (forward_peak + profile.previous_output_bytes
                               + profile.before_chain_bytes, head_peak,
                               backward_peak, profile.other_peak_bytes,
                               profile.optimizer_step_bytes), strict=True))
    return {**phases, "retained": retained}, walk.extra_seconds


def items_of(segments: list[Segment], start: int, end: int) -> list[int | Segment]:
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


def check_segments(segments: list[Segment], start: int, end: int) -> None:
    previous_end = start - 1
    for segment in sorted(segments, key=lambda s: s.start):
        if not (previous_end < segment.start <= segment.end <= end):
            raise UsageError(
                f"segment {segment.start}-{segment.end} does not fit: segments must lie within "
                f"blocks {start}-{end} and must not overlap"
            )
        check_segments(segment.children, segment.start, segment.end)
        previous_end = segment.end


def check_chain_breaks(segments: list[Segment], profile: Profile) -> None:
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
        check_chain_breaks(segment.children, profile)


class Walk:
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
        kept = {j: output_kept_bytes(self.blocks[j], segment.policy, self.host_link)
                for j in policy_blocks(segment) if j < segment.end or not held_after}
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
                            .kept_bytes + outputs.get(j, 0) for j in policy_blocks(item)}
                before = retained + added
                retained = before + sum(kept.values())
                for j in item.blocks():
                    # Its input, unless the policy keeps it as the block before's output.
                    hidden = 0 if j == item.start or outputs.get(j - 1) else (
                        self.blocks[j].input_bytes)
                    returned = self.returned[j] if after_checkpointed or j > item.start else 0
                    peak = max(peak, alive + before + hidden + returned
                               + segment_transient(self.blocks, item, j, self.host_link))
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
                inner_items = items_of(item.children, item.start, item.end)
                policies = {j: policy_cost(self.blocks[j], item.policy, self.host_link)
                            for j in policy_blocks(item)} if item.policy else {}
                self.extra_seconds += sum(
                    policies[j].extra_seconds if j in policies
                    else self.blocks[j].recompute_seconds()
                    for j in item.blocks()
                )
                # A child ending where its segment ends is run through by the segment's
                # recomputation and holds what its blocks kept would (measured: LoRA blocks
                # 4.6% above the one-block measurement): walked as that, not as measured.
                measured = (measured_backward_peak(self.blocks, item, self.host_link)
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


def segment_transient(
    blocks: list, segment: Segment, j: int, host_link: float | None
) -> int:
    """The most block j holds above its input while segment's first forward runs it, what
    the policy keeps of it included."""
    block = blocks[j]
    if segment.policy is None:
        return block.segment_forward_peak_bytes()  # saves nothing
    if j in policy_blocks(segment):
        cost = policy_cost(block, segment.policy, host_link)
        if cost.backward_peak_bytes is not None:  # measured, checkpointed alone under it
            return cost.transient_bytes + cost.kept_bytes
    return block.forward_peak_bytes  # bounded: the plain forward saves more


def measured_backward_peak(
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


def policy_blocks(segment: Segment) -> list[int]:
    """The blocks of a segment that its own policy governs: those in none of its children."""
    inside_children = {j for child in segment.children for j in child.blocks()}
    return [j for j in segment.blocks() if j not in inside_children]
