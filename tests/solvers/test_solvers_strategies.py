"""The solvers (``gradckpt.solvers``): valid plans, budgets met or refused with the right minimum,
and the "optimal" DP against brute force over every plan ``simulate`` can evaluate."""

from __future__ import annotations

import math
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gradckpt import BudgetError, UsageError
from gradckpt.budget import format_bytes
from gradckpt.cost import simulate
from gradckpt.plan import Segment
from gradckpt.profile_types import BlockProfile, Profile
from gradckpt.solvers import BUDGET_DRIVEN, STRATEGIES, solve, table_resolution, time_tables
from gradckpt.solvers import optimal as optimal_solver
from gradckpt.solvers.chen_greedy import candidate_plans
from gradckpt.solvers.chen_greedy import minimum_peak_bytes as greedy_minimum_peak_bytes
from gradckpt.solvers.optimal import memory_unit_bytes, minimum_peak_bytes, solve_optimal
from gradckpt.solvers.sqrt import solve_sqrt

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

FIXED_BYTES = 1000


def homogeneous(n: int, **overrides: object) -> Profile:
    """n identical blocks: input/output 10 B, saves 50 B (its input included), 1 s / 2 s."""
    fields = dict(
        input_bytes=10, output_bytes=10, saved_bytes=50, input_saved=True,
        forward_seconds=1.0, backward_seconds=2.0,
    )
    fields.update(overrides)
    blocks = [BlockProfile(name=f"h.{i}", **fields) for i in range(n)]
    return with_peak(Profile(blocks, peak_bytes=0, fixed_bytes=FIXED_BYTES, step_seconds=3.0 * n))


def with_peak(profile: Profile) -> Profile:
    """The profile with peak_bytes what simulate predicts without checkpointing."""
    profile.peak_bytes = profile.fixed_bytes + simulate(profile, [])[0]
    return profile


def random_block(rng: random.Random, index: int, matmuls: bool) -> BlockProfile:
    input_bytes = rng.randint(1, 30)
    input_saved = rng.random() < 0.7
    matmul_bytes = rng.randint(0, 25) if matmuls else 0
    forward_seconds = rng.randint(1, 8) * 0.25
    measured = rng.random() < 0.5
    return BlockProfile(
        name=f"h.{index}",
        input_bytes=input_bytes,
        output_bytes=rng.randint(1, 30),
        saved_bytes=(input_bytes if input_saved else 0) + matmul_bytes + rng.randint(0, 40),
        input_saved=input_saved,
        forward_seconds=forward_seconds,
        backward_seconds=rng.randint(1, 8) * 0.25,
        forward_peak_bytes=rng.randint(0, 20),
        backward_peak_bytes=rng.randint(0, 20),
        matmul_bytes=matmul_bytes,
        # matmuls are part of the forward pass: never more than all of it
        matmul_seconds=forward_seconds * rng.randint(0, 4) / 4 if matmuls else 0.0,
        gradient_bytes=rng.randint(0, 15),
        # profile measures a block checkpointed alone with and without the policy, or
        # neither (a hand-made profile): never one without the other
        **(measured_policy(rng, matmul_bytes) if matmuls and measured else {}),
        **(measured_checkpointed(rng) if measured else {}),
        # an encoder output or rotary cos/sin this block is the first to take
        side_bytes=rng.randint(1, 25) if rng.random() < 0.4 else 0,
        # a mask or position bias no block saves, which segments keep for recomputation
        held_side_bytes=rng.randint(1, 25) if rng.random() < 0.3 else 0,
    )


def measured_checkpointed(rng: random.Random) -> dict:
    """What profile measures of a block checkpointed alone: a forward that saves nothing, a
    backward whose recomputation may peak above or below the plain walk's, and what the
    recomputation costs (not its forward time)."""
    return {
        "checkpointed_forward_peak_bytes": rng.randint(0, 20),
        "checkpointed_backward_peak_bytes": rng.randint(0, 60),
        "checkpointed_extra_seconds": rng.randint(1, 10) * 0.25,
    }


def measured_policy(rng: random.Random, matmul_bytes: int) -> dict:
    """What profile measures of a block run alone under the policy (forward peak: its kept
    outputs and more)."""
    return {
        "policy_forward_peak_bytes": matmul_bytes + rng.randint(0, 20),
        "policy_backward_peak_bytes": rng.randint(0, 40),
        "policy_extra_seconds": rng.randint(0, 8) * 0.25,
    }


def random_profile(seed: int, n: int, matmuls: bool = True) -> Profile:
    rng = random.Random(seed)
    blocks = [random_block(rng, i, matmuls) for i in range(n)]
    profile = Profile(blocks, 0, FIXED_BYTES, sum(b.forward_seconds for b in blocks) * 3,
                      head_bytes=rng.randint(0, 60), head_gradient_bytes=rng.randint(0, 20),
                      other_peak_bytes=rng.randint(0, 40))
    if n > 1 and rng.random() < 0.4:  # an encoder/decoder-like chain: no segment across
        profile.chain_breaks = sorted(rng.sample(range(1, n), rng.randint(1, min(2, n - 1))))
    for index in range(n - 1):
        if rng.random() < 0.4:
            saves_its_output(profile, index)
    profile.chain_input_fixed = rng.random() < 0.3  # a CNN's first block takes the images
    return with_peak(profile)


def saves_its_output(profile: Profile, index: int) -> None:
    """Block ``index``'s graph saves its output (a CNN block ending in ReLU), which is the
    next block's input: the same tensor, so of the same size."""
    block, following = profile.blocks[index], profile.blocks[index + 1]
    block.output_saved = True
    block.saved_bytes += block.output_bytes
    if following.input_saved:
        following.saved_bytes += block.output_bytes - following.input_bytes
    following.input_bytes = block.output_bytes


def spans_no_chain_break(segments: list[Segment], profile: Profile) -> bool:
    return all(
        segment.end <= profile.segment_end_limit(segment.start)
        and spans_no_chain_break(segment.children, profile)
        for segment in segments
    )


def all_plans(start: int, end: int, policies: tuple, top: bool = True):
    """Every plan over blocks start..end: each block kept or in a segment, segments nested to any
    depth (each child ending before its parent's last block), each top-level one-block segment
    with each policy (the solver's option space: ``apply`` refuses a policy on a segment with
    children or inside another, and only one-block segments have their policy costs
    measured). ``policies``: a tuple, or a function of the block giving its own (its menu).
    ``top=False``: the children of a segment ending at ``end``."""
    if start > end:
        yield []
        return
    yield from all_plans(start + 1, end, policies, top=top)  # block `start` kept
    for segment_end in range(start, end + 1 if top else end):
        for children in all_plans(start, segment_end, policies, top=False):
            one_block = segment_end == start and not children
            options = policies(start) if callable(policies) else policies
            for policy in options if one_block and top else (None,):
                for rest in all_plans(segment_end + 1, end, policies, top=top):
                    yield [Segment(start, segment_end, children, policy), *rest]


def assert_valid(segments: list[Segment], start: int, end: int) -> None:
    """In range, not overlapping, children properly inside their parent (laminar)."""
    previous_end = start - 1
    for segment in segments:
        assert previous_end < segment.start <= segment.end <= end
        assert segment.policy in (None, "save-matmuls")
        if segment.children:
            assert segment.policy is None
            assert all(child.policy is None for child in segment.children)  # apply refuses
            assert_valid(segment.children, segment.start, segment.end)
            assert all(child.end < segment.end for child in segment.children)
        previous_end = segment.end


def budgets_for(profile: Profile) -> list[int]:
    """Budgets from below the lowest reachable peak to above the unconstrained one."""
    low = minimum_peak_bytes(profile)
    return sorted({low - 1, low, (low + profile.peak_bytes) // 2, profile.peak_bytes - 1,
                   profile.peak_bytes, profile.peak_bytes + 100})


# ------------------------------------------------------------------------------------------
# solve(): names, budgets, errors
# ------------------------------------------------------------------------------------------


def test_strategies_are_the_documented_names() -> None:
    assert list(STRATEGIES) == ["none", "every-layer", "sqrt", "chen-greedy", "optimal"]


def test_unknown_strategy_lists_valid_names() -> None:
    with pytest.raises(UsageError) as error:
        solve(homogeneous(4), "1GiB", strategy="fastest")
    for name in STRATEGIES:
        assert name in str(error.value)


@pytest.mark.parametrize("budget", ["6 gigs", "6G", "0", -5, "150%", 1.5, True])
def test_malformed_budget_is_a_usage_error(budget: object) -> None:
    with pytest.raises(UsageError):
        solve(homogeneous(4), budget)


@pytest.mark.parametrize("strategy", sorted(BUDGET_DRIVEN))
def test_budget_driven_strategies_need_a_budget(strategy: str) -> None:
    with pytest.raises(UsageError, match="budget"):
        solve(homogeneous(4), None, strategy)


@pytest.mark.parametrize("budget", [None, "100%", 10**9])
def test_none_has_zero_overhead(budget: object) -> None:
    plan = solve(homogeneous(6), budget, "none")
    assert plan.segments == []
    assert plan.predicted_overhead == 0.0 and plan.predicted_extra_seconds == 0.0
    assert plan.predicted_peak_bytes == homogeneous(6).peak_bytes


def test_plan_records_strategy_budget_and_names() -> None:
    profile = homogeneous(8)
    plan = solve(profile, "90%", "chen-greedy")
    assert plan.strategy == "chen-greedy"
    assert plan.budget_bytes == int(profile.peak_bytes * 0.9)
    assert plan.block_names == [f"h.{i}" for i in range(8)]


def test_optimal_without_need_checkpoints_nothing() -> None:
    for seed in range(10):
        profile = random_profile(seed, 6)
        plan = solve(profile, profile.peak_bytes, "optimal")
        assert plan.segments == [] and plan.predicted_extra_seconds == 0.0


# ------------------------------------------------------------------------------------------
# Every strategy: valid plans; budgets met, or refused with the exact minimum
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("seed", range(8))
def test_plans_are_valid_and_fit_or_refuse(strategy: str, seed: int) -> None:
    profile = random_profile(seed, 1 + seed % 7)
    for budget in budgets_for(profile):
        try:
            plan = solve(profile, budget, strategy)
        except BudgetError:
            continue
        assert_valid(plan.segments, 0, len(profile.blocks) - 1)
        assert plan.predicted_peak_bytes <= budget
        chain_peak, extra_seconds = simulate(profile, plan.segments)
        assert plan.predicted_peak_bytes == FIXED_BYTES + chain_peak
        assert plan.predicted_extra_seconds == extra_seconds


@pytest.mark.parametrize("strategy", list(STRATEGIES))
@pytest.mark.parametrize("seed", range(6))
def test_budget_error_states_the_exact_minimum(strategy: str, seed: int) -> None:
    profile = random_profile(100 + seed, 2 + seed)
    with pytest.raises(BudgetError) as error:
        solve(profile, 1, strategy)
    minimum_bytes = error.value.minimum_bytes
    assert format_bytes(minimum_bytes) in str(error.value)
    assert "raise the budget" in str(error.value)
    assert solve(profile, minimum_bytes, strategy).predicted_peak_bytes <= minimum_bytes
    with pytest.raises(BudgetError) as again:
        solve(profile, minimum_bytes - 1, strategy)
    assert again.value.minimum_bytes == minimum_bytes
    assert isinstance(error.value, ValueError)


def test_fixed_strategy_minimum_is_its_own_peak() -> None:
    profile = homogeneous(16)
    every_layer_peak = solve(profile, None, "every-layer").predicted_peak_bytes
    with pytest.raises(BudgetError) as error:
        solve(profile, every_layer_peak - 1, "every-layer")
    assert error.value.minimum_bytes == every_layer_peak


def test_optimal_minimum_is_below_every_other_strategy() -> None:
    for seed in range(5):
        profile = random_profile(200 + seed, 8)
        lowest = minimum_peak_bytes(profile)
        for strategy in ("none", "every-layer", "sqrt"):
            assert lowest <= solve(profile, None, strategy).predicted_peak_bytes
        assert lowest <= min(FIXED_BYTES + simulate(profile, plan)[0]
                             for plan in candidate_plans(profile))


@pytest.mark.parametrize("strategy", sorted(BUDGET_DRIVEN))
@pytest.mark.parametrize("seed", range(6))
def test_more_budget_never_costs_more_time(strategy: str, seed: int) -> None:
    profile = random_profile(300 + seed, 3 + seed)
    low = BUDGET_DRIVEN[strategy](profile)
    budgets = sorted({low + (profile.peak_bytes - low) * k // 12 for k in range(13)})
    # Exactly (time_noise=0): within the timing noise band a later plan may be as slow as the
    # band allows (solvers/timing_noise.py).
    times = [solve(profile, budget, strategy, time_noise=0).predicted_extra_seconds
             for budget in budgets]
    assert all(later <= earlier for earlier, later in zip(times, times[1:], strict=False))
    assert times[-1] == 0.0  # the unconstrained peak is enough for no checkpointing


def test_optimal_is_never_slower_than_chen_greedy() -> None:
    for seed in range(6):
        profile = random_profile(400 + seed, 8)
        for budget in budgets_for(profile):
            try:
                greedy = solve(profile, budget, "chen-greedy")
            except BudgetError:
                continue
            optimal = solve(profile, budget, "optimal")
            assert optimal.predicted_extra_seconds <= greedy.predicted_extra_seconds + 1e-9


# ------------------------------------------------------------------------------------------
# The fixed strategies
# ------------------------------------------------------------------------------------------


def test_every_layer_recomputes_each_block_once() -> None:
    for seed in range(10):
        profile = random_profile(500 + seed, 1 + seed)
        plan = solve(profile, None, "every-layer")
        assert [(s.start, s.end) for s in plan.segments] == [(i, i) for i in range(1 + seed)]
        expected = sum(block.recompute_seconds() for block in profile.blocks)
        assert plan.predicted_extra_seconds == pytest.approx(expected)


@pytest.mark.parametrize("n", [4, 5, 9, 10, 16, 17, 50, 99, 100, 101, 128, 255, 256])
def test_sqrt_keeps_about_sqrt_n_checkpoints(n: int) -> None:
    profile = homogeneous(n)
    segments = solve(profile, None, "sqrt").segments
    assert_valid(segments, 0, n - 1)
    assert [block for s in segments for block in s.blocks()] == list(range(n))
    assert abs(len(segments) - math.sqrt(n)) <= 1
    # memory grows with sqrt(n): ~sqrt(n) kept inputs plus one segment of ~sqrt(n) blocks
    chain_peak, extra_seconds = simulate(profile, segments)
    assert chain_peak <= 10 * len(segments) + 50 * math.ceil(math.sqrt(n)) + 10
    assert extra_seconds == n * 1.0  # one extra forward pass


def test_sqrt_of_every_length_up_to_256() -> None:
    for n in range(4, 257):
        count = len(solve_sqrt(homogeneous(n), None))
        assert abs(count - math.sqrt(n)) <= 1, n


def test_empty_chain() -> None:
    profile = Profile([], peak_bytes=FIXED_BYTES, fixed_bytes=FIXED_BYTES, step_seconds=1.0)
    for strategy in STRATEGIES:
        assert solve(profile, FIXED_BYTES, strategy).segments == []


# ------------------------------------------------------------------------------------------
# "chen-greedy"
# ------------------------------------------------------------------------------------------


def test_chen_greedy_picks_the_fastest_fitting_candidate() -> None:
    for seed in range(6):
        profile = random_profile(600 + seed, 10)
        candidates = [simulate(profile, plan) for plan in candidate_plans(profile)]
        for budget in budgets_for(profile):
            fitting = [t for peak, t in candidates if FIXED_BYTES + peak <= budget]
            if not fitting:
                with pytest.raises(BudgetError):
                    solve(profile, budget, "chen-greedy")
                continue
            plan = solve(profile, budget, "chen-greedy")
            assert plan.predicted_extra_seconds == min(fitting)


def test_chen_greedy_on_a_homogeneous_chain_lands_near_sqrt() -> None:
    profile = homogeneous(100)
    sqrt_plan = solve(profile, None, "sqrt")
    greedy = solve(profile, sqrt_plan.predicted_peak_bytes, "chen-greedy")
    assert greedy.predicted_extra_seconds <= sqrt_plan.predicted_extra_seconds


# ------------------------------------------------------------------------------------------
# "optimal" against brute force over every plan simulate can evaluate
# ------------------------------------------------------------------------------------------


def assert_optimal_matches_brute_force(profile: Profile, policies: tuple) -> None:
    n = len(profile.blocks)
    outcomes = [
        simulate(profile, plan)
        for plan in all_plans(0, n - 1, policies)
        if spans_no_chain_break(plan, profile)  # simulate refuses the others
    ]
    peaks = sorted({peak for peak, _ in outcomes})
    assert minimum_peak_bytes(profile) == FIXED_BYTES + peaks[0]
    for chain_budget in [peaks[0] - 1, *peaks]:
        budget = FIXED_BYTES + chain_budget
        best = min((t for peak, t in outcomes if peak <= chain_budget), default=None)
        if best is None:
            with pytest.raises(BudgetError) as error:
                solve(profile, budget, "optimal")
            assert error.value.minimum_bytes == FIXED_BYTES + peaks[0]
            continue
        plan = solve(profile, budget, "optimal", time_noise=0)  # the exact least time
        assert_valid(plan.segments, 0, n - 1)
        assert plan.predicted_peak_bytes <= budget
        assert plan.predicted_extra_seconds == pytest.approx(best, abs=1e-9)


def test_brute_force_enumerates_every_plan() -> None:
    # 1 block: kept, or a segment with either policy; 2 blocks: 11 plans (worked out by hand:
    # 3 x 3 for blocks apart, plus segment 0-1 without children (no policy: two blocks) or with
    # the child [0-0] (none reaches block 1, the segment's end): 1 + 1 = 2)
    assert len(list(all_plans(0, 0, (None, "save-matmuls")))) == 3
    assert len(list(all_plans(0, 1, (None, "save-matmuls")))) == 11


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 4))
def test_optimal_equals_brute_force_with_policies(seed: int, n: int) -> None:
    profile = random_profile(seed, n, matmuls=True)
    assert_optimal_matches_brute_force(profile, (None, "save-matmuls"))


@settings(max_examples=5, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(5, 6))
def test_optimal_equals_brute_force_without_matmuls(seed: int, n: int) -> None:
    # Without matmul outputs a policy changes nothing, so plans without policies cover all.
    assert_optimal_matches_brute_force(random_profile(seed, n, matmuls=False), (None,))


def test_optimal_equals_brute_force_on_a_homogeneous_chain() -> None:
    assert_optimal_matches_brute_force(homogeneous(6), (None,))


def test_brute_force_sees_chain_breaks() -> None:
    # Chains with and without breaks are drawn (the oracle above filters plans across them).
    drawn = [random_profile(seed, 4).chain_breaks for seed in range(20)]
    assert any(drawn) and not all(drawn)


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_no_strategy_puts_a_segment_across_a_chain_break(strategy: str) -> None:
    """An encoder's last block and a decoder's first cannot be recomputed as one segment:
    each strategy plans around the break, at every budget."""
    profile = homogeneous(9)
    profile.chain_breaks = [4]
    budgets = budgets_for(profile)[2:] if strategy in BUDGET_DRIVEN else [None]
    if strategy == "chen-greedy":  # its lowest peak is not optimal's
        budgets = [greedy_minimum_peak_bytes(profile), *budgets[1:]]
    for budget in budgets:
        plan = solve(profile, budget, strategy)
        assert spans_no_chain_break(plan.segments, profile), (budget, plan.segments)
    if strategy == "sqrt":  # 3-block segments, the one across the break cut in two
        assert [(s.start, s.end) for s in plan.segments] == [(0, 2), (3, 3), (4, 5), (6, 8)]


def test_simulate_refuses_a_segment_across_a_chain_break() -> None:
    profile = homogeneous(4)
    profile.chain_breaks = [2]
    with pytest.raises(UsageError, match=r"segment 1-2 spans blocks 1 and 2 \(h.1 -> h.2\)"):
        simulate(profile, [Segment(1, 2)])
    with pytest.raises(UsageError, match="segment 0-3 spans"):
        simulate(profile, [Segment(0, 3, [Segment(0, 1)])])
    simulate(profile, [Segment(0, 1), Segment(2, 3)])  # either side of it: fine


def test_chain_breaks_out_of_range_are_refused() -> None:
    profile = homogeneous(4)
    profile.chain_breaks = [4]
    with pytest.raises(UsageError, match="chain_breaks"):
        solve(profile, None, "sqrt")


def test_optimal_uses_nesting_when_it_pays() -> None:
    # Find a chain and budget where the best plan nests; brute force above checks it is optimal.
    for seed in range(50):
        profile = random_profile(700 + seed, 6, matmuls=False)
        for budget in budgets_for(profile)[1:]:
            if any(s.children for s in solve_optimal(profile, budget)):
                return
    pytest.fail("no nested optimal plan in 50 random chains")


@pytest.mark.parametrize(
    ("overrides", "field"),
    [
        ({"saved_bytes": 5, "input_bytes": 10}, "saved_bytes"),
        ({"output_bytes": -1}, "output_bytes"),
        ({"matmul_seconds": 2.0}, "matmul_seconds"),
    ],
)
def test_inconsistent_profiles_are_refused(overrides: dict, field: str) -> None:
    # e.g. saved_bytes below the input it claims to include: a hand-edited profile
    fields = dict(input_bytes=10, output_bytes=10, saved_bytes=50, input_saved=True,
                  forward_seconds=1.0, backward_seconds=2.0)
    blocks = [BlockProfile(f"h.{i}", **{**fields, **overrides}) for i in range(4)]
    profile = Profile(blocks, peak_bytes=10_000, fixed_bytes=FIXED_BYTES, step_seconds=12.0)
    for strategy in STRATEGIES:
        with pytest.raises(UsageError, match=f"block h.0: {field}"):
            solve(profile, None if strategy not in BUDGET_DRIVEN else 10_000, strategy)


def test_optimal_solves_a_100_block_chain() -> None:
    # Memory in units of 1/1176 of the room (1 byte below 1176 bytes): the plan fits, is never
    # slower than Chen's greedy, and no slower than the sqrt plan at that plan's own peak.
    profile = random_profile(42, 100)
    low = minimum_peak_bytes(profile)
    assert memory_unit_bytes(profile, profile.peak_bytes - 1 - FIXED_BYTES) > 1
    for budget in (low, (low + profile.peak_bytes) // 2, profile.peak_bytes - 1):
        plan = solve(profile, budget, "optimal")
        assert plan.predicted_peak_bytes <= budget
        try:
            greedy = solve(profile, budget, "chen-greedy")
        except BudgetError:
            continue
        assert plan.predicted_extra_seconds <= greedy.predicted_extra_seconds + 1e-9
    sqrt_plan = solve(profile, None, "sqrt")
    at_sqrt = solve(profile, sqrt_plan.predicted_peak_bytes, "optimal")
    assert at_sqrt.predicted_extra_seconds <= sqrt_plan.predicted_extra_seconds + 1e-9


def test_rounded_memory_is_as_fast_as_the_exact_optimum_with_a_little_less_room(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Sizes rounded up to units: every plan whose exact peak leaves (2n + 1) units spare is
    still seen (each of a peak's at most 2n + 1 terms gains under a unit), so the rounded
    answer is at least as fast as the exact optimum for that smaller room."""
    n = 24
    for seed in range(3):
        profile = random_profile(800 + seed, n)
        low = minimum_peak_bytes(profile)
        budget = (low + profile.peak_bytes) // 2
        room = budget - FIXED_BYTES
        assert memory_unit_bytes(profile, room) == 1
        with monkeypatch.context() as patch:
            patch.setattr(table_resolution, "_MAX_LEVELS", 100)
            patch.setattr(table_resolution, "_MIN_LEVELS", 10)
            unit = memory_unit_bytes(profile, room)
            coarse = solve_optimal(profile, budget)
        assert unit > 1
        assert FIXED_BYTES + simulate(profile, coarse)[0] <= budget
        exact = solve_optimal(profile, budget)
        assert simulate(profile, exact)[1] <= simulate(profile, coarse)[1] + 1e-9
        smaller = budget - (2 * n + 1) * unit
        if smaller >= low:
            exact_smaller = solve_optimal(profile, smaller)
            assert simulate(profile, coarse)[1] <= simulate(profile, exact_smaller)[1] + 1e-9


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_optimal_fills_its_tables_the_same_a_few_columns_at_a_time(seed, monkeypatch) -> None:
    # The tables are filled in column chunks small enough that every tensor operation stays on
    # the calling thread; the chunk width must not change the answer (brute force above covers
    # one chunk: its tables are small).
    profile = random_profile(seed, 14)
    for index in range(0, 13, 3):
        saves_its_output(profile, index)
    profile = with_peak(profile)
    budgets = budgets_for(profile)
    wide = [solve(profile, budget, "optimal") for budget in budgets[1:]]
    monkeypatch.setattr(time_tables, "_GRAIN", 1)  # one column per chunk
    narrow = [solve(profile, budget, "optimal") for budget in budgets[1:]]
    assert [plan.segments for plan in narrow] == [plan.segments for plan in wide]


@pytest.mark.parametrize("seed", range(4))
def test_optimal_plan_is_read_from_the_choice_tables(seed: int) -> None:
    # The fill records each entry's choice (what_after, what_at_input, what_held) and the plan
    # is read back from them, never chosen again: what it reads costs what the table holds
    # (float32 sums) and fits the room the table was filled for.
    profile = random_profile(900 + seed, 7)
    for budget in budgets_for(profile)[1:-2]:
        room_bytes = budget - FIXED_BYTES
        tables = optimal_solver._TimeTables(profile, 1, room_bytes)
        plan = tables.best_plan()
        assert plan is not None
        assert_valid(plan, 0, 6)
        peak_bytes, extra_seconds = simulate(profile, plan)
        assert peak_bytes <= room_bytes
        assert extra_seconds == pytest.approx(tables._top()[-1].item(), rel=1e-6)


def test_optimal_breaks_ties_between_plans_of_equal_time_by_the_order_of_its_options() -> None:
    # Block 0 or block 1 (0.7 s each) checkpointed with block 2 (0.1 s): 0.8 s either way, but
    # the tables' float32 sums, and the float64 sums of their entries, round the two apart in
    # their last bits. The choice takes an option only when it is faster by more than that
    # (memory_levels.SUM_ROUNDING), so the order of the options decides the tie, not rounding:
    # block 0 kept (KEEP is offered first), block 1 checkpointed.
    profile = random_profile(0, 3, matmuls=False)
    for block, seconds in zip(profile.blocks, [0.7, 0.7, 0.1], strict=True):
        block.forward_seconds, block.checkpointed_extra_seconds = seconds, None
    profile = with_peak(profile)
    assert solve_optimal(profile, 1169) == [Segment(1, 1), Segment(2, 2)]
    profile.blocks[0].forward_seconds = 0.69  # a real difference still decides
    assert solve_optimal(profile, 1169) == [Segment(0, 0), Segment(2, 2)]


def test_solving_leaves_torchs_thread_count_alone(monkeypatch) -> None:
    def refuse(count: int) -> None:
        raise AssertionError("a solver changed torch's thread count, which is process-wide")

    monkeypatch.setattr(torch, "set_num_threads", refuse)
    profile = random_profile(3, 30)
    for strategy in STRATEGIES:
        try:
            solve(profile, (minimum_peak_bytes(profile) + profile.peak_bytes) // 2, strategy)
        except BudgetError:
            pass
