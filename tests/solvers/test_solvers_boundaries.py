""""optimal" exact at the boundaries where users put their budget (issue 25): at the least
budget the fastest plan of that peak, and at a layout's own predicted peak (every layer, every
k-th block, torch's selective policy on every block) a plan at least as fast as that layout,
with memory rounded to units as it is for real models (megabytes, not the bytes of the
brute-force tests)."""

from __future__ import annotations

import dataclasses

import pytest
from test_solvers_strategies import (
    FIXED_BYTES,
    all_plans,
    random_profile,
    spans_no_chain_break,
    with_peak,
)

from gradckpt.cost import simulate
from gradckpt.plan import Segment
from gradckpt.profile_types import Profile
from gradckpt.solvers import optimal as optimal_solver
from gradckpt.solvers import solve, table_resolution
from gradckpt.solvers.optimal import memory_unit_bytes, minimum_peak_bytes

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

SCALE = 100_003  # bytes per byte of the random profiles: megabyte-sized blocks


def scaled(profile: Profile, factor: int = SCALE) -> Profile:
    """``profile`` with every size multiplied by ``factor`` (times unchanged): the same
    problem, in sizes the solver must round to memory units. The fixed bytes stay, so budgets
    read ``FIXED_BYTES`` + a chain peak as in the other solver tests."""

    def grow(record: object) -> None:
        for item in dataclasses.fields(record):
            value = getattr(record, item.name)
            if not item.name.endswith("_bytes") or item.name == "fixed_bytes":
                continue
            if isinstance(value, int) and not isinstance(value, bool):
                setattr(record, item.name, value * factor)

    for block in profile.blocks:
        grow(block)
    grow(profile)
    return with_peak(profile)


def brute_force_outcomes(profile: Profile) -> list[tuple[int, float]]:
    """(chain peak, extra seconds) of every plan in the optimal solver's search space."""
    return [
        simulate(profile, plan)
        for plan in all_plans(0, len(profile.blocks) - 1, (None, "save-matmuls"))
        if spans_no_chain_break(plan, profile)
    ]


@pytest.mark.parametrize("seed", range(24))
def test_the_least_budget_gets_the_fastest_plan_of_that_peak(seed: int) -> None:
    # Before: the least budget got the plan of least peak the peak-only DP found first (ties
    # by order), often slower than another plan of the same peak (a Llama: 1.14x where 1.10x
    # was to be had). Now the tables read above the room (headroom_levels) and the peak-only
    # DP breaks ties by time.
    profile = scaled(random_profile(3000 + seed, 3 + seed % 3))
    outcomes = brute_force_outcomes(profile)
    least = min(peak for peak, _ in outcomes)
    assert minimum_peak_bytes(profile) == FIXED_BYTES + least
    assert memory_unit_bytes(profile, least) > 1  # rounding is in play
    fastest = min(seconds for peak, seconds in outcomes if peak == least)
    plan = solve(profile, FIXED_BYTES + least, "optimal", time_noise=0)  # the exact least time
    assert plan.predicted_peak_bytes == FIXED_BYTES + least
    assert plan.predicted_extra_seconds == pytest.approx(fastest, abs=1e-9)


def layouts_users_write(n: int) -> dict[str, list[Segment]]:
    """Every layer, every k-th block alone, and torch's selective policy on every block."""
    layouts = {f"every {k}": [Segment(i, i) for i in range(0, n, k)] for k in range(1, n)}
    layouts["selective"] = [Segment(i, i, policy="save-matmuls") for i in range(n)]
    return layouts


@pytest.mark.parametrize("seed", range(6))
def test_a_layout_users_write_is_matched_at_its_own_peak(seed: int) -> None:
    # A budget of exactly a layout's predicted peak always has a plan, and one at least as
    # fast as that layout: it is in the search space, so rounding must not lose it.
    profile = scaled(random_profile(4000 + seed, 8))
    for name, layout in layouts_users_write(len(profile.blocks)).items():
        if not spans_no_chain_break(layout, profile):
            continue
        peak, seconds = simulate(profile, layout)
        plan = solve(profile, FIXED_BYTES + peak, "optimal")
        assert plan.predicted_peak_bytes <= FIXED_BYTES + peak, name
        assert plan.predicted_extra_seconds <= seconds + 1e-9, name


def test_reading_above_the_room_finds_plans_rounding_hides(monkeypatch) -> None:
    # With coarse units (40 levels), a plan that fits in bytes but not in rounded units is
    # found in the headroom above the room: never slower than the table filled for the room
    # alone, and faster somewhere.
    monkeypatch.setattr(table_resolution, "_MAX_LEVELS", 40)
    monkeypatch.setattr(table_resolution, "_MIN_LEVELS", 10)
    faster = 0
    for seed in range(10):
        profile = scaled(random_profile(5000 + seed, 6))
        peaks = sorted({peak for peak, _ in brute_force_outcomes(profile)})
        for chain_peak in peaks[:: max(1, len(peaks) // 12)]:
            unit = memory_unit_bytes(profile, chain_peak)
            rounded_only = optimal_solver._TimeTables(profile, unit, chain_peak)
            if not rounded_only.levels.count or rounded_only.best_plan() is None:
                continue
            before = simulate(profile, rounded_only.best_plan())[1]
            plan = solve(profile, FIXED_BYTES + chain_peak, "optimal")
            assert plan.predicted_extra_seconds <= before + 1e-9
            faster += plan.predicted_extra_seconds < before - 1e-9
    assert faster > 0
