"""``gradckpt demo``, part 2: the sqrt(n) table.

Chains of n identical blocks, planned by each strategy: activation memory in blocks' worth and
extra forward passes, computed by the solvers, and measured on chains short enough to run.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING

from .demo_size import DemoSize
from .profiling import profile_with_bar
from .progress import stage, with_progress

if TYPE_CHECKING:
    from gradckpt.plan import Plan
    from gradckpt.profile_types import BlockProfile, Profile

__all__ = [
    "SQRT_TABLE_STRATEGIES", "DepthRow", "DepthSeries", "depth_series", "homogeneous_chain",
    "sqrt_plans", "sqrt_rows", "sqrt_table", "sqrt_verdict",
]


SQRT_TABLE_STRATEGIES = ("none", "every-layer", "sqrt", "optimal")


@dataclass
class DepthRow:
    """One chain length of the sqrt(n) table, in blocks' worth and extra forward passes."""

    depth: int
    memory: dict[str, float]  # strategy -> activation memory, in blocks' worth
    extra_forwards: dict[str, float]  # strategy -> extra forward passes of the chain
    measured: dict[str, float]  # strategy -> measured activation memory (short chains only)


def homogeneous_chain(block: BlockProfile, depth: int) -> Profile:
    """A profile of ``depth`` copies of ``block`` (a ``BlockProfile``), named ``"0"``, ``"1"``...

    Named as the blocks of an ``nn.Sequential``, so its plans apply to ``mlp_chain(depth, ...)``.

    Example:
        >>> from gradckpt.profile_types import example_block
        >>> chain = homogeneous_chain(example_block("b"), 100)
        >>> len(chain.blocks), chain.blocks[99].name, chain.step_seconds
        (100, '99', 300.0)
    """
    from gradckpt.cost import simulate
    from gradckpt.profile_types import Profile

    blocks = [dataclasses.replace(block, name=str(index)) for index in range(depth)]
    seconds = depth * (block.forward_seconds + block.backward_seconds)
    chain = Profile(blocks, peak_bytes=0, fixed_bytes=0, step_seconds=seconds)
    chain.peak_bytes = simulate(chain, [])[0]
    return chain


def sqrt_plans(chain: Profile) -> dict[str, Plan]:
    """none, every-layer and sqrt plans of a chain, and optimal within the sqrt plan's memory.

    Example:
        >>> from gradckpt.profile_types import example_block
        >>> chain = homogeneous_chain(example_block("b"), 100)
        >>> plans = sqrt_plans(chain)
        >>> plans["sqrt"].predicted_peak_bytes / 50, plans["sqrt"].predicted_extra_seconds
        (12.0, 100.0)
        >>> plans["optimal"].predicted_extra_seconds < 100  # the same memory, less recomputation
        True
    """
    from gradckpt import solve

    plans = {name: solve(chain, None, name) for name in ("none", "every-layer", "sqrt")}
    plans["optimal"] = solve(chain, plans["sqrt"].predicted_peak_bytes, "optimal")
    return plans


def _measure_chain_block(size: DemoSize, seed: int) -> BlockProfile:
    """The profile of one MLP block, measured inside a short chain (its inner block)."""
    import torch

    from gradckpt.toy_models import mlp_chain

    torch.manual_seed(seed)
    chain = mlp_chain(4, size.chain_width)
    rows = torch.randn(size.chain_rows, size.chain_width)
    return profile_with_bar(chain, rows).blocks[1]  # an inner block: input from a block


def _measured_memory(
    block: BlockProfile, depth: int, plans: dict[str, Plan], size: DemoSize, seed: int
) -> dict[str, float]:
    """Run the chain under each plan: activation memory in blocks' worth, measured.

    The peak outside the chain's activations (weights, gradients, input) is what the plain
    step's measured peak leaves over the computed plain chain; the rest is the plan's doing.
    """
    import torch

    from gradckpt.cost import simulate
    from gradckpt.side_by_side import measure_users_step
    from gradckpt.toy_models import mlp_chain

    torch.manual_seed(seed)
    chain = mlp_chain(depth, size.chain_width)
    rows = torch.randn(size.chain_rows, size.chain_width)
    # chain(rows).sum().backward(): the output goes before backward (keep_output=False).
    peaks = {name: measure_users_step(chain, rows, plan, keep_output=False).peak_bytes
             for name, plan in plans.items()}
    outside_bytes = peaks["none"] - simulate(homogeneous_chain(block, depth), [])[0]
    return {
        name: (peak - outside_bytes) / block.saved_bytes
        for name, peak in peaks.items()
        if name != "none"  # equal to the computed value by construction
    }


def sqrt_rows(size: DemoSize, seed: int) -> tuple[BlockProfile, list[DepthRow]]:
    """Part 2: one MLP block measured, then per chain length each strategy's memory and extra
    forwards (and, on chains up to ``size.measured_depth``, the memory measured).

    Example:
        >>> import dataclasses, torch
        >>> from gradckpt.cli.demo_size import QUICK_DEMO
        >>> size = dataclasses.replace(QUICK_DEMO, depths=(4, 8), measured_depth=4,
        ...                            chain_width=8, chain_rows=16)
        >>> block, rows = sqrt_rows(size, seed=0)
        >>> [row.depth for row in rows], sorted(rows[0].measured)
        ([4, 8], ['every-layer', 'optimal', 'sqrt'])
        >>> n8 = rows[1]  # every-layer recomputes each block once: +1 forward pass
        >>> round(n8.extra_forwards["every-layer"], 3), n8.memory["sqrt"] < n8.memory["none"]
        (1.0, True)
    """
    from gradckpt.cost import simulate

    stage("profiling one MLP block")
    block = _measure_chain_block(size, seed)
    rows = []
    solving = "gradckpt: solving chains of n blocks (measuring the short ones)"
    for depth in with_progress(size.depths, solving):
        chain = homogeneous_chain(block, depth)
        plans = sqrt_plans(chain)
        # In extra forward passes: one pass recomputes every block once.
        chain_recompute_seconds = depth * block.recompute_seconds()
        memory, extra = {}, {}
        for name, plan in plans.items():
            chain_peak, extra_seconds = simulate(chain, plan.segments)
            memory[name] = chain_peak / block.saved_bytes
            extra[name] = (extra_seconds / chain_recompute_seconds
                           if chain_recompute_seconds else 0.0)
        measured = {}
        if depth <= size.measured_depth:
            measured = _measured_memory(block, depth, plans, size, seed)
        rows.append(DepthRow(depth, memory, extra, measured))
    return block, rows


def sqrt_table(rows: list[DepthRow]) -> str:
    """The rows as the demo prints them: memory / extra forwards per strategy, and measured.

    Example:
        >>> row = DepthRow(4, {"none": 4.0, "every-layer": 1.0, "sqrt": 2.0, "optimal": 2.0},
        ...                {"none": 0.0, "every-layer": 1.0, "sqrt": 0.5, "optimal": 0.5}, {})
        >>> print(sqrt_table([row]))  # doctest: +NORMALIZE_WHITESPACE
        n  none  every-layer  sqrt  optimal  measured: every-layer / sqrt / optimal
        4  4.0 / +0.00  1.0 / +1.00  2.0 / +0.50  2.0 / +0.50  -
    """
    from gradckpt.report import format_table

    table_rows = []
    for row in rows:
        cells = [str(row.depth)]
        cells += [
            f"{row.memory[name]:.1f} / +{row.extra_forwards[name]:.2f}"
            for name in SQRT_TABLE_STRATEGIES
        ]
        measured = [row.measured.get(name) for name in SQRT_TABLE_STRATEGIES[1:]]
        cells.append(
            " / ".join(f"{value:.1f}" for value in measured) if row.measured else "-"
        )
        table_rows.append(cells)
    header = ["n", *SQRT_TABLE_STRATEGIES, "measured: every-layer / sqrt / optimal"]
    return format_table(header, table_rows, align="rrrrrr")


@dataclass
class DepthSeries:
    """The sqrt(n) rows as the depth plot draws them: per strategy, one value per depth."""

    depths: list[int]
    memory: dict[str, list[float]]  # strategy -> activation memory, in blocks' worth
    extra_forwards: dict[str, list[float]]  # strategy -> extra forward passes of the chain
    measured: dict[str, list[tuple[int, float]]]  # strategy -> (depth, measured memory)


def depth_series(rows: list[DepthRow]) -> DepthSeries:
    """The numbers ``sqrt_table`` prints, per strategy, for the plot of memory and extra
    forward passes against depth.

    Example:
        >>> rows = [DepthRow(4, {"none": 4.0, "every-layer": 1.0, "sqrt": 2.0, "optimal": 2.0},
        ...                  {"none": 0.0, "every-layer": 1.0, "sqrt": 0.5, "optimal": 0.5},
        ...                  {"sqrt": 2.1})]
        >>> series = depth_series(rows)
        >>> series.extra_forwards["sqrt"], series.measured["sqrt"], series.measured["optimal"]
        ([0.5], [(4, 2.1)], [])
    """
    measured_names = SQRT_TABLE_STRATEGIES[1:]  # none's measured memory is its computed one
    return DepthSeries(
        depths=[row.depth for row in rows],
        memory={name: [row.memory[name] for row in rows] for name in SQRT_TABLE_STRATEGIES},
        extra_forwards={
            name: [row.extra_forwards[name] for row in rows] for name in SQRT_TABLE_STRATEGIES
        },
        measured={
            name: [(row.depth, row.measured[name]) for row in rows if name in row.measured]
            for name in measured_names
        },
    )


def sqrt_verdict(rows: list[DepthRow]) -> str:
    """One sentence on the row nearest n = 100: what sqrt and optimal keep and recompute.

    Example:
        >>> row = DepthRow(100, {"none": 100.0, "sqrt": 20.0}, {"sqrt": 1.0, "optimal": 0.8}, {})
        >>> sqrt_verdict([row])  # doctest: +ELLIPSIS
        "At n = 100: no checkpointing keeps 100.0 blocks' worth; sqrt keeps 20.0 for +1.00 ..."
    """
    row = min(rows, key=lambda r: abs(r.depth - 100))
    return (
        f"At n = {row.depth}: no checkpointing keeps {row.memory['none']:.1f} blocks' worth; "
        f"sqrt keeps {row.memory['sqrt']:.1f} for +{row.extra_forwards['sqrt']:.2f} forward "
        f"pass; optimal, given the same memory, recomputes +{row.extra_forwards['optimal']:.2f}."
    )
