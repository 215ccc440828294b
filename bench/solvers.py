"""How long each solver takes, and what rounding memory to levels costs "optimal".

Run: ``python bench/solvers.py`` (about a minute on 2 CPU cores; ``--quick``: a few seconds).

Chains are built directly as profiles (no model runs): a GPT-like uniform chain (every block
alike, the shape transformers have) and a heterogeneous one with seeded random sizes and times.
For each length and a budget a quarter and three quarters of the way from the lowest reachable
peak to the unconstrained one, it prints the median wall time of ``gradckpt.solve`` per
strategy. Then, for "optimal", the plan's extra time against the same DP with 4x as many memory
levels (finer rounding), as a share of the step: the price of the default resolution. The
verdict line gives the longest chain's slowest "optimal" solve and the largest price.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time

from _common import format_table

from gradckpt.cost import simulate
from gradckpt.profile_types import BlockProfile, Profile
from gradckpt.solvers import BUDGET_DRIVEN, solve, table_resolution
from gradckpt.solvers import optimal as optimal_solver

MIB = 1 << 20
STRATEGIES = ("every-layer", "sqrt", "chen-greedy", "optimal")


def uniform_chain(n: int) -> Profile:
    """Blocks like a transformer layer: 4 MiB hidden state, 40 MiB saved, matmuls 12 MiB."""
    blocks = [
        BlockProfile(f"h.{i}", 4 * MIB, 4 * MIB, 40 * MIB, True, 0.010, 0.020,
                     forward_peak_bytes=44 * MIB, backward_peak_bytes=10 * MIB,
                     matmul_bytes=12 * MIB, matmul_seconds=0.006, gradient_bytes=8 * MIB)
        for i in range(n)
    ]
    return with_peak(Profile(blocks, 0, 1 << 30, 0.03 * n + 0.1, head_bytes=200 * MIB))


def random_chain(n: int, seed: int = 0) -> Profile:
    rng = random.Random(seed)
    blocks = []
    for i in range(n):
        hidden = rng.randint(1, 8) * MIB
        matmuls = rng.randint(0, 20) * MIB
        forward = rng.uniform(0.002, 0.02)
        blocks.append(BlockProfile(
            f"h.{i}", hidden, hidden, hidden + matmuls + rng.randint(0, 40) * MIB, True,
            forward, 2 * forward, forward_peak_bytes=rng.randint(0, 60) * MIB,
            backward_peak_bytes=rng.randint(0, 30) * MIB, matmul_bytes=matmuls,
            matmul_seconds=forward * rng.random(), gradient_bytes=rng.randint(0, 10) * MIB,
        ))
    step = 3 * sum(b.forward_seconds for b in blocks)
    return with_peak(Profile(blocks, 0, 1 << 30, step, head_bytes=100 * MIB))


def with_peak(profile: Profile) -> Profile:
    profile.peak_bytes = profile.fixed_bytes + simulate(profile, [])[0]
    return profile


def budgets(profile: Profile) -> dict[str, int]:
    low = optimal_solver.minimum_peak_bytes(profile)
    span = profile.peak_bytes - low
    return {"25%": low + span // 4, "75%": low + 3 * span // 4}


def median_solve_seconds(profile: Profile, budget: int, strategy: str, repeats: int) -> float:
    """Fixed strategies are timed without a budget: theirs need not fit it."""
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        solve(profile, budget if strategy in BUDGET_DRIVEN else None, strategy)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def solve_times(lengths: list[int], repeats: int) -> tuple[str, dict[int, float]]:
    """The table, and per chain length the longest median time of "optimal", in seconds."""
    rows = []
    slowest: dict[int, float] = {}
    for n in lengths:
        for kind, profile in (("uniform", uniform_chain(n)), ("random", random_chain(n))):
            for label, budget in budgets(profile).items():
                row = [n, kind, label]
                for strategy in STRATEGIES:
                    seconds = median_solve_seconds(profile, budget, strategy, repeats)
                    row.append(f"{seconds * 1000:.0f} ms")
                    if strategy == "optimal":
                        slowest[n] = max(slowest.get(n, 0.0), seconds)
                rows.append(row)
    return format_table(["blocks", "chain", "budget", *STRATEGIES], rows), slowest


def rounding_cost(lengths: list[int]) -> tuple[str, float]:
    """The table, and the largest extra time the default levels cost over 4x as many (a share
    of the step)."""
    rows = []
    worst = 0.0
    for n in lengths:
        for kind, profile in (("uniform", uniform_chain(n)), ("random", random_chain(n))):
            for label, budget in budgets(profile).items():
                default = solve(profile, budget, "optimal")
                saved = table_resolution._TABLE_CELLS, table_resolution._MAX_LEVELS
                table_resolution._TABLE_CELLS, table_resolution._MAX_LEVELS = 4 * saved[0], 8000
                try:
                    finer = solve(profile, budget, "optimal")
                finally:
                    table_resolution._TABLE_CELLS, table_resolution._MAX_LEVELS = saved
                levels = optimal_solver.levels_for(n)
                worst = max(worst, default.predicted_overhead - finer.predicted_overhead)
                rows.append([
                    n, kind, label, levels,
                    f"{100 * default.predicted_overhead:.2f}%",
                    f"{100 * finer.predicted_overhead:.2f}%",
                    f"{100 * (default.predicted_overhead - finer.predicted_overhead):+.2f}",
                ])
    table = format_table(
        ["blocks", "chain", "budget", "levels", "extra time", "4x levels", "difference (pp)"],
        rows,
    )
    return table, worst


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="short chains, one repeat")
    args = parser.parse_args(argv)
    lengths = [10, 25] if args.quick else [10, 25, 50, 100, 200]
    repeats = 1 if args.quick else 3
    print(f"command: python bench/solvers.py{' --quick' if args.quick else ''}")
    print("budget: a share of the way from the lowest reachable peak to the unconstrained one\n")
    print("Solve time (median of", repeats, "runs):")
    times, slowest = solve_times(lengths, repeats)
    print(times)
    print("\n'optimal': predicted extra time (share of the step) at the default memory levels")
    print("and with 4x as many (finer rounding):")
    table, worst = rounding_cost([n for n in lengths if n <= 100])
    print(table)
    longest = max(slowest)
    print(f"\nverdict: 'optimal' solves a {longest}-block chain in at most "
          f"{slowest[longest] * 1000:.0f} ms; rounding memory to the default levels costs at "
          f"most {100 * worst:+.2f} pp of extra time against 4x as many")
    return 0


if __name__ == "__main__":
    sys.exit(main())
