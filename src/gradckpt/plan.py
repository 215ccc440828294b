"""Plans: which blocks are checkpointed in which segments, and what that is predicted to cost.

A plan is a list of top-level ``Segment``s over the chain of blocks; blocks in no segment are
kept as usual. A segment's ``children`` are segments inside it: while the segment is recomputed
in backward, its children are checkpointed again (nested schedules, Beaumont et al.'s optimal
"rotor" schedules), and the blocks in none of its children keep what they save.

``gradckpt.cost.simulate`` predicts what a plan costs; ``plan_for`` (there) wraps segments into a
``Plan`` with those predictions.

Example:
    >>> plan = Plan("sqrt", None, [Segment(0, 1)], 2048, 1.0, 0.25, ["h.0", "h.1", "h.2"])
    >>> [list(segment.blocks()) for segment in plan.segments]
    [[0, 1]]
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from .budget import format_bytes
from .errors import UsageError
from .profile_types import Profile
from .tables import format_table

__all__ = [
    "BlockBytes", "Segment", "Plan", "head_fate", "plan_table", "plan_summary", "policy_words",
    "split_at_chain_breaks",
]


@dataclass
class Segment:
    """Blocks ``start``..``end`` (inclusive) checkpointed as one region.

    ``children``: segments inside it, checkpointed again during its recomputation. ``policy``:
    an op-level preset (``"save-matmuls"``) for the blocks of this segment that are in no child.
    """

    start: int
    end: int
    children: list[Segment] = field(default_factory=list)
    policy: str | None = None

    def blocks(self) -> range:
        return range(self.start, self.end + 1)


@dataclass
class BlockBytes:
    """What a plan does with one block's activations, in bytes (``gradckpt.cost.block_bytes``):
    ``kept`` from its forward to its backward (all it saves, for a kept block; its input and
    the outputs its policy keeps, in a segment), ``recomputed`` in backward (what backward
    needs and the plan dropped) and ``offloaded`` (moved to host memory meanwhile)."""

    kept: int
    recomputed: int
    offloaded: int = 0


@dataclass
class Plan:
    """A solver's answer: the segments, and what they are predicted to cost.

    - ``strategy``: the solver that made it; ``budget_bytes``: the budget it was asked to meet.
    - ``predicted_peak_bytes``: the step's predicted peak memory under the plan.
    - ``predicted_overhead``: predicted extra step time as a fraction of the step without
      checkpointing (0.25 = 25% slower).
    - ``estimated_for``: the device a plan solved from ``gradckpt.estimate`` was predicted
      for (``"h100-80gb"``); None when the profile was measured.
    - ``head_name``: the output head the profile found a chunked loss for (``"lm_head"``),
      None when it found none; ``head_chunks``: how many pieces of tokens the plan computes
      that head and its loss in, each recomputed in backward (1: the plain head, the logits
      whole).
    - ``block_bytes``: per block, what is kept, recomputed and offloaded (``BlockBytes``);
      empty for a plan made by hand.
    - ``offload``: whether offloading was offered to the solver, and over what host link, or
      why not (``gradckpt.op_choices.offload_offer``), in a sentence.
    - ``block_fingerprints``, ``chain_lengths``: what the blocks held (their parameters) and how
      many blocks their containers held, in the model the profile measured: ``apply`` refuses
      a model whose blocks differ (``gradckpt.measure.fingerprint``); empty for a plan made
      by hand.
    """

    strategy: str
    budget_bytes: int | None
    segments: list[Segment]
    predicted_peak_bytes: int
    predicted_extra_seconds: float
    predicted_overhead: float
    block_names: list[str] = field(default_factory=list)
    # The device whose profile the predictions come from: the preset or "this" an estimate was
    # made for (gradckpt.estimate), None for a profile measured here.
    estimated_for: str | None = None
    head_name: str | None = None
    head_chunks: int = 1
    block_bytes: list[BlockBytes] = field(default_factory=list)
    offload: str = ""
    block_fingerprints: list[str] = field(default_factory=list)
    chain_lengths: dict[str, int] = field(default_factory=dict)

    def to_json(self) -> str:
        """The plan as a JSON string (``Plan.from_json`` reads it back)."""
        return json.dumps(dataclasses.asdict(self), indent=2)

    def __str__(self) -> str:
        """A table: one row per block, saying what happens to it, then the predictions.

        Example:
            >>> plan = Plan("sqrt", None, [Segment(0, 1)], 2048, 1.0, 0.25, ["h.0", "h.1", "h.2"])
            >>> print(plan)  # doctest: +NORMALIZE_WHITESPACE
            block  what happens to its activations
            h.0    recomputed: segment 0-1 (its input kept)
            h.1    recomputed: segment 0-1
            h.2    kept
            strategy sqrt: predicted peak 2.00 KiB, predicted extra time +25.0%
        """
        return plan_table(self)

    @classmethod
    def from_json(cls, text: str) -> Plan:
        """Read a plan written by ``to_json``."""
        try:
            data = json.loads(text)
            data["segments"] = [_segment_from_dict(item) for item in data["segments"]]
            data["block_bytes"] = [BlockBytes(**item) for item in data.get("block_bytes", [])]
            return cls(**data)
        except (json.JSONDecodeError, KeyError, TypeError) as error:
            raise UsageError(f"not a gradckpt plan (JSON from Plan.to_json()): {error}") from None


def _segment_from_dict(data: dict[str, Any]) -> Segment:
    children = [_segment_from_dict(child) for child in data.get("children", [])]
    return Segment(data["start"], data["end"], children, data.get("policy"))


def split_at_chain_breaks(segments: list[Segment], profile: Profile) -> list[Segment]:
    """Segments without children, each cut where the chain breaks (see ``Profile``).

    Example:
        >>> from gradckpt.profile_types import example_block
        >>> blocks = [example_block(f"h.{i}", input_bytes=1, output_bytes=1, saved_bytes=1,
        ...                         backward_seconds=1.0) for i in range(6)]
        >>> profile = Profile(blocks, 0, 0, 1.0, chain_breaks=[3])
        >>> [(s.start, s.end) for s in split_at_chain_breaks([Segment(0, 5)], profile)]
        [(0, 2), (3, 5)]
    """
    pieces = []
    for segment in segments:
        start = segment.start
        while start <= segment.end:
            end = min(segment.end, profile.segment_end_limit(start))
            pieces.append(Segment(start, end, policy=segment.policy))
            start = end + 1
    return pieces


def plan_table(plan: Plan) -> str:
    """One row per block, saying what happens to its activations, then the predictions.

    This is ``str(plan)``.

    Example:
        >>> plan = Plan("sqrt", None, [Segment(0, 1)], 2048, 1.0, 0.25, ["h.0", "h.1", "h.2"])
        >>> print(plan_table(plan))
        block  what happens to its activations
        h.0    recomputed: segment 0-1 (its input kept)
        h.1    recomputed: segment 0-1
        h.2    kept
        strategy sqrt: predicted peak 2.00 KiB, predicted extra time +25.0%
    """
    fates = {index: "kept" for index in range(len(plan.block_names))}
    for segment, depth in _nested(plan.segments, 0):
        for index in segment.blocks():
            where = f"segment {segment.start}-{segment.end}"
            if depth:
                where += f" (nested, level {depth + 1})"
            if segment.policy:
                where += f", {policy_words(segment.policy)}"
            if index == segment.start and depth == 0:
                where += " (its input kept)"
            fates[index] = (f"{fates[index]}; " if depth else "recomputed: ") + where
    headers = ["block", "what happens to its activations"]
    rows = [[name, fates[index]] for index, name in enumerate(plan.block_names)]
    if len(plan.block_bytes) == len(rows):
        headers += ["kept", "recomputed", "offloaded"]
        for row, nbytes in zip(rows, plan.block_bytes, strict=True):
            row += [_bytes_or_dash(nbytes.kept), _bytes_or_dash(nbytes.recomputed),
                    _bytes_or_dash(nbytes.offloaded)]
    if plan.head_name is not None:
        rows.append([f"{plan.head_name} (output head)", head_fate(plan)]
                    + [""] * (len(headers) - 2))
    table = format_table(headers, rows, align="l" * len(headers))
    offload = f"\n{plan.offload}" if plan.offload else ""
    return f"{table}\n{plan_summary(plan)}{offload}"


def policy_words(policy: str) -> str:
    """A segment's policy as the plan's table names it: ``"save-ops:..."`` (``"offload-ops:..."``)
    as the operations it keeps (offloads), without their namespace, attention kernels as
    "attention".

    Example:
        >>> policy_words("save-ops:aten._scaled_dot_product_flash_attention_for_cpu,aten.mean")
        'keeps attention, mean'
        >>> policy_words("offload-ops:aten.mm")
        'offloads mm'
        >>> policy_words("save-matmuls")
        'save-matmuls'
    """
    verb = next((verb for prefix, verb in _LISTING_POLICIES.items()
                 if policy.startswith(prefix)), None)
    if verb is None:
        return policy
    names = policy.split(":", 1)[1].split(",")
    words = ["attention" if "attention" in name else name.split(".", 1)[-1] for name in names]
    return f"{verb} " + ", ".join(dict.fromkeys(words))


_LISTING_POLICIES = {"save-ops:": "keeps", "offload-ops:": "offloads"}


def _bytes_or_dash(nbytes: int) -> str:
    return format_bytes(nbytes) if nbytes else "-"


def head_fate(plan: Plan) -> str:
    """What happens to the output head's logits under the plan, in words.

    Example:
        >>> plan = Plan("optimal", None, [], 0, 0.0, 0.0, ["h.0"], head_name="lm_head",
        ...             head_chunks=16)
        >>> head_fate(plan)
        'recomputed: loss in 16 chunks of tokens, one chunk of logits at a time'
    """
    if plan.head_chunks > 1:
        return (f"recomputed: loss in {plan.head_chunks} chunks of tokens, one chunk of logits "
                "at a time")
    return "kept: the logits whole"


def plan_summary(plan: Plan) -> str:
    """The plan's predictions in one line.

    Example:
        >>> plan_summary(Plan("optimal", 4096, [], 3000, 2.0, 0.4, ["a"]))
        'strategy optimal within 4.00 KiB: predicted peak 2.93 KiB, predicted extra time +40.0%'
        >>> plan_summary(Plan("none", None, [], 3000, 0.0, 0.0, ["a"], estimated_for="l4-24gb"))
        'strategy none: predicted peak 2.93 KiB, predicted extra time +0.0% (estimated for l4-24gb)'
    """
    budget = f" within {format_bytes(plan.budget_bytes)}" if plan.budget_bytes else ""
    device = f" (estimated for {plan.estimated_for})" if plan.estimated_for else ""
    return (
        f"strategy {plan.strategy}{budget}: predicted peak "
        f"{format_bytes(plan.predicted_peak_bytes)}, predicted extra time "
        f"+{100 * plan.predicted_overhead:.1f}%{device}"
    )


def _nested(segments: list[Segment], depth: int) -> Iterator[tuple[Segment, int]]:
    """Every segment with its nesting depth (0 = top level), parents before children."""
    for segment in segments:
        yield segment, depth
        yield from _nested(segment.children, depth + 1)
