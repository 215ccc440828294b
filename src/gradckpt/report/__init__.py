"""Tables and plots: how the command line shows a plan and what it measured.

So that ``str(plan)``, ``gradckpt plan`` and ``gradckpt demo`` say things the same way, the
tables the core needs live below this module and are re-exported here:

- ``format_table`` (``gradckpt.tables``): rows of text cells in aligned columns;
- ``plan_table``, ``plan_summary`` (``gradckpt.plan``): one row per block saying what happens
  to its activations, then the plan's predictions (this is ``str(plan)``);
- ``memory_breakdown_table``: what takes the memory of a step (parameters, gradients, ...),
  read against the predicted peak: the parts ``gradckpt.measure.memory_parts`` counts
  (``MemoryParts``), named as ``part_label`` says;
- ``plot_frontier``, ``plot_memory_vs_depth``: PNG plots. They need matplotlib (the ``plot``
  extra, ``pip install 'gradckpt[plot]'``); without it they raise ``PlotsUnavailable``, which
  says so. ``draw_frontier`` and ``draw_memory_vs_depth`` return what they would write (the
  figure, and for the frontier the line and the label boxes), so the data drawn can be checked.
  They live in ``report.plots``, where labels go in ``report.labels``.

Example:
    >>> print(format_table(["strategy", "peak"], [["none", "275.1 MiB"], ["sqrt", "90.2 MiB"]]))
    strategy       peak
    none      275.1 MiB
    sqrt       90.2 MiB
"""

from __future__ import annotations

import textwrap

from ..budget import format_bytes
from ..measure.memory_parts import (
    GRADIENTS,
    OFFLOADED,
    OPTIMIZER_STATE,
    PARAMETERS,
    MemoryParts,
    one_head_chunk_bytes,
)
from ..plan import plan_summary, plan_table
from ..profile_types import Profile
from ..tables import format_table
from .plots import (
    FrontierDrawing,
    PlotsUnavailable,
    StrategyPoint,
    draw_frontier,
    draw_memory_vs_depth,
    frontier_staircase,
    plot_frontier,
    plot_memory_vs_depth,
)

__all__ = [
    "FrontierDrawing",
    "MemoryParts",
    "PlotsUnavailable",
    "StrategyPoint",
    "draw_frontier",
    "draw_memory_vs_depth",
    "format_table",
    "frontier_staircase",
    "head_chunk_options",
    "part_label",
    "plan_table",
    "plan_summary",
    "memory_breakdown_table",
    "plot_frontier",
    "plot_memory_vs_depth",
]

MEMORY_TABLE_TITLE = "what takes the memory (sizes; not all alive at one instant)"


def memory_breakdown_table(memory: MemoryParts, device_bytes: int | None = None) -> str:
    """What takes the memory, largest first: each part's size and share of the predicted peak
    (and of the device, given ``device_bytes``; parts outside the peak say so), then how the
    parts relate to the peak.

    Example:
        >>> parts = [("parameters", 6 * 2**20), ("logits", 20 * 2**20), ("gradients", 6 * 2**20)]
        >>> print(memory_breakdown_table(MemoryParts(parts, 26 * 2**20)))
        what takes the memory (sizes; not all alive at one instant)       size  of the predicted peak
        logits                                                       20.00 MiB                    77%
        parameters                                                    6.00 MiB                    23%
        gradients                                                     6.00 MiB                    23%
        The parts are sizes, not one instant: they add up to 32.00 MiB, more than the predicted peak
        of 26.00 MiB, since they live at different moments (what the forward pass keeps, activations
        and logits, is freed as the backward pass makes the gradients).
    """  # noqa: E501  (a table's lines are longer than code's)
    header = [MEMORY_TABLE_TITLE, "size", "of the predicted peak"]
    if device_bytes:
        header.append("of the device")
    rows = []
    for name, size in sorted(memory.parts, key=lambda part: -part[1]):
        of_peak = ("outside" if name in memory.outside_peak
                   else _share(size, memory.predicted_peak_bytes))
        row = [part_label(name, memory.world_size), format_bytes(size), of_peak]
        if device_bytes:  # what is offloaded lies in the host's memory, not the device's
            row.append("host" if name == OFFLOADED else _share(size, device_bytes))
        rows.append(row)
    return f"{format_table(header, rows)}\n{parts_against_peak(memory)}"


def part_label(name: str, world_size: int) -> str:
    """How the table names a part: with ``world_size`` ranks sharding the model, the parts each
    rank keeps 1/N of say so (``--json`` keeps the plain names).

    Example:
        >>> part_label("parameters", 8)
        'parameters (1/8 per rank)'
        >>> part_label("optimizer state (AdamW)", 8)
        'optimizer state (AdamW, 1/8 per rank)'
        >>> part_label("parameters", 1)
        'parameters'
    """
    sharded = name in (PARAMETERS, GRADIENTS) or name.startswith(OPTIMIZER_STATE)
    if world_size == 1 or not sharded:
        return name
    share = f"1/{world_size} per rank"
    return f"{name[:-1]}, {share})" if name.endswith(")") else f"{name} ({share})"


def parts_against_peak(memory: MemoryParts) -> str:
    """How the parts add up against the predicted peak, and why they need not equal it.

    Example:
        >>> print(parts_against_peak(MemoryParts([("a", 3 * 2**20), ("b", 2**20)], 4 * 2**20)))
        The parts are sizes, not one instant: they add up to the predicted peak, 4.00 MiB.
    """
    inside = sum(size for name, size in memory.parts if name not in memory.outside_peak)
    outside = any(name in memory.outside_peak for name, _ in memory.parts)
    parts = "those inside the peak" if outside else "they"
    peak = format_bytes(memory.predicted_peak_bytes)
    if inside == memory.predicted_peak_bytes:
        relation = f"{parts} add up to the predicted peak, {peak}."
    elif inside > memory.predicted_peak_bytes:
        relation = (
            f"{parts} add up to {format_bytes(inside)}, more than the predicted peak of {peak}, "
            "since they live at different moments (what the forward pass keeps, activations and "
            "logits, is freed as the backward pass makes the gradients)."
        )
    else:
        relation = (
            f"{parts} add up to {format_bytes(inside)}, less than the predicted peak of {peak}; "
            "the rest is what the step holds briefly (temporaries, recomputed activations)."
        )
    sentence = f"The parts are sizes, not one instant: {relation}"
    return textwrap.fill(sentence, width=92)


def _share(part_bytes: int, whole_bytes: int) -> str:
    """``part_bytes`` as a percentage of ``whole_bytes``; "<1%" rather than a misleading 0%."""
    if not whole_bytes:
        return "-"
    share = part_bytes / whole_bytes
    return "<1%" if 0 < share < 0.005 else f"{share:.0%}"


def head_chunk_options(profile: Profile, head_chunks: int) -> str | None:
    """The chunk counts the profile measured for the output head's loss, each with one chunk's
    memory and its extra time, and which one the plan (``head_chunks``) takes: what a user
    weighs against the plan's choice. None where the profile offers no chunked head.

    Example:
        >>> from gradckpt.profile_types import ChunkedHead, example_block
        >>> def measured(chunks, head_bytes, seconds):
        ...     return ChunkedHead("lm_head", chunks, head_bytes, 0, 0, 0, 0, 1000, seconds)
        >>> profile = Profile([example_block()], 1500, 1000, 4.0,
        ...                   chunked_heads=[measured(4, 3 * 2**28, 0.1),
        ...                                  measured(16, 9 * 2**26, 0.4)])
        >>> print(head_chunk_options(profile, 4))
        the output head's loss in chunks (one chunk's logits, loss and gradients; extra time):
          4 chunks 256.00 MiB +2.5%, 16 chunks 64.00 MiB +10.0%; this plan: 4 chunks
    """
    if not profile.chunked_heads:
        return None
    options = ", ".join(
        f"{head.chunks} chunks {format_bytes(one_head_chunk_bytes(profile, head.chunks) or 0)} "
        f"+{100 * head.extra_seconds / profile.step_seconds:.1f}%"
        for head in profile.chunked_heads
    )
    chosen = f"{head_chunks} chunks" if head_chunks > 1 else "the plain head (logits whole)"
    return ("the output head's loss in chunks (one chunk's logits, loss and gradients; extra "
            f"time):\n  {options}; this plan: {chosen}")
