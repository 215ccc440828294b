"""The solvers with op-level choices (issue 25): each top-level one-block segment may run under
any policy of its block's menu (``ChainCosts.menu``: ``"save-matmuls"`` where the chain has
matmuls, then the block's measured ``op_choices``, ``"save-ops:..."``).

The "optimal" DP is checked against brute force over every plan of that space, evaluated by
``simulate`` (which reads the same ``op_choices.policy_cost``): at every budget the least
predicted time among the plans that fit, and, below them all, a ``BudgetError`` whose
``minimum_bytes`` is the least peak of any plan (``least_peak`` weighs the menus too). The
random blocks carry one to three measured choices with consistent numbers (the kept bytes are
the listed operations' ``kept_bytes_by_op``, their share of the forward their seconds').
"""

from __future__ import annotations

import random
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_solvers_strategies import (
    FIXED_BYTES,
    all_plans,
    random_profile,
    spans_no_chain_break,
    with_peak,
)

from gradckpt import BudgetError
from gradckpt.cost import simulate
from gradckpt.op_choices import is_op_choice
from gradckpt.plan import Segment
from gradckpt.profile_types import OpChoice, Profile, example_block
from gradckpt.solvers import solve
from gradckpt.solvers.chain_costs import ChainCosts
from gradckpt.solvers.optimal import minimum_peak_bytes

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

OPERATIONS = ["aten.mean", "aten.silu", "aten.mul", "aten.add", "aten.bmm", "aten._safe_softmax"]


def with_op_choices(profile: Profile, rng: random.Random, choices: tuple[int, int] = (1, 3)
                    ) -> Profile:
    """Each block with per-operation numbers and ``choices`` measured op-level choices: a
    random set of its operations each, keeping those operations' bytes (never more than the
    block saves), saving their share of the forward, with a forward peak above what they keep
    and a backward peak of their own."""
    for block in profile.blocks:
        names = rng.sample(OPERATIONS, rng.randint(3, len(OPERATIONS)))
        room = max(block.saved_bytes // len(names), 0)
        block.kept_bytes_by_op = {name: rng.randint(0, room) for name in names}
        seconds = {name: rng.randint(0, 4) for name in names}
        if not any(seconds.values()):
            seconds[names[0]] = 1
        total = sum(seconds.values()) * 2  # the operations named take half the forward or less
        block.forward_seconds_by_op = {name: block.forward_seconds * count / total
                                       for name, count in seconds.items()}
        measured = {}
        while len(measured) < min(rng.randint(*choices), 2 ** len(names) - 1):
            kept = frozenset(rng.sample(names, rng.randint(1, len(names))))
            measured[kept] = None
        block.op_choices = []
        for kept in measured:
            kept_bytes = sum(block.kept_bytes_by_op[name] for name in kept)
            block.op_choices.append(OpChoice(
                policy="save-ops:" + ",".join(sorted(kept)),
                kept_bytes=kept_bytes,
                forward_share=sum(block.forward_seconds_by_op[name] for name in kept)
                / sum(block.forward_seconds_by_op.values()),
                forward_peak_bytes=kept_bytes + rng.randint(0, 20),
                backward_peak_bytes=rng.randint(0, 60),
            ))
    return with_peak(profile)


def op_choice_profile(seed: int, n: int, matmuls: bool = True, choices=(1, 3)) -> Profile:
    return with_op_choices(random_profile(seed, n, matmuls), random.Random(seed + 1), choices)


def menu_of(profile: Profile):
    """Each block's policies, for ``all_plans``: None, then its menu's."""
    return lambda s: menu_policies(profile, s)


def menu_policies(profile: Profile, s: int) -> tuple:
    """What a one-block top-level segment on block s may run under: none, then its menu."""
    return (None, *(option.policy for option in ChainCosts(profile).menu(s)))


def assert_valid(profile: Profile, segments: list[Segment], start: int, end: int,
                 top: bool = True) -> None:
    """Laminar, in range, and a policy only on a top-level one-block segment, from its menu."""
    previous_end = start - 1
    for segment in segments:
        assert previous_end < segment.start <= segment.end <= end
        if segment.policy is not None:
            assert top and segment.start == segment.end and not segment.children
            assert segment.policy in menu_policies(profile, segment.start)
        if segment.children:
            assert_valid(profile, segment.children, segment.start, segment.end, top=False)
            assert all(child.end < segment.end for child in segment.children)
        previous_end = segment.end


def assert_optimal_matches_brute_force(profile: Profile) -> list[list[Segment]]:
    """The DP against every plan; returns the plans it chose."""
    n = len(profile.blocks)
    outcomes = [simulate(profile, plan) for plan in all_plans(0, n - 1, menu_of(profile))
                if spans_no_chain_break(plan, profile)]
    peaks = sorted({peak for peak, _ in outcomes})
    assert minimum_peak_bytes(profile) == FIXED_BYTES + peaks[0]
    with pytest.raises(BudgetError) as error:
        solve(profile, FIXED_BYTES + peaks[0] - 1, "optimal")
    assert error.value.minimum_bytes == FIXED_BYTES + peaks[0]
    chosen = []
    for chain_budget in peaks:
        budget = FIXED_BYTES + chain_budget
        best = min(t for peak, t in outcomes if peak <= chain_budget)
        plan = solve(profile, budget, "optimal", time_noise=0)  # the exact least time
        assert_valid(profile, plan.segments, 0, n - 1)
        assert plan.predicted_peak_bytes <= budget
        assert (plan.predicted_peak_bytes - FIXED_BYTES, plan.predicted_extra_seconds) == (
            simulate(profile, plan.segments))
        assert plan.predicted_extra_seconds == pytest.approx(best, abs=1e-9), (
            budget, plan.segments)
        chosen.append(plan.segments)
    return chosen


def uses_op_choice(segments: list[Segment]) -> bool:
    return any(is_op_choice(segment.policy) for segment in segments)


# ------------------------------------------------------------------------------------------
# The menus
# ------------------------------------------------------------------------------------------


def test_a_blocks_menu_is_save_matmuls_then_its_measured_choices() -> None:
    profile = op_choice_profile(3, 3)
    chain = ChainCosts(profile)
    for s, block in enumerate(profile.blocks):
        assert [option.policy for option in chain.menu(s)] == [
            "save-matmuls", *(choice.policy for choice in block.op_choices)]
        for option, choice in zip(chain.menu(s)[1:], block.op_choices, strict=True):
            assert option.kept_bytes == choice.kept_bytes
            assert option.transient == max(choice.forward_peak_bytes - choice.kept_bytes, 0)


def test_without_matmuls_the_menu_is_the_op_choices_alone() -> None:
    profile = op_choice_profile(4, 3, matmuls=False)
    chain = ChainCosts(profile)
    assert chain.policies  # op-level choices are policies to weigh
    for s, block in enumerate(profile.blocks):
        assert [o.policy for o in chain.menu(s)] == [c.policy for c in block.op_choices]


def test_brute_force_enumerates_every_menu_option() -> None:
    # One block, a menu of save-matmuls and two choices: kept, or a segment under None or
    # any of the three. Two blocks: (1 + 4) x (1 + 4) apart, plus segment 0-1 with or
    # without the child [0-0] (no policy on either: 2).
    profile = op_choice_profile(5, 2, choices=(2, 2))
    assert [len(menu_policies(profile, s)) for s in range(2)] == [4, 4]
    assert len(list(all_plans(0, 0, menu_of(profile)))) == 5
    assert len(list(all_plans(0, 1, menu_of(profile)))) == 5 * 5 + 2


# ------------------------------------------------------------------------------------------
# "optimal" against brute force
# ------------------------------------------------------------------------------------------


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 4))
def test_optimal_equals_brute_force_with_op_choices(seed: int, n: int) -> None:
    assert_optimal_matches_brute_force(op_choice_profile(seed, n))


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 2**32 - 1), n=st.integers(1, 4))
def test_optimal_equals_brute_force_with_op_choices_and_no_matmuls(seed: int, n: int) -> None:
    assert_optimal_matches_brute_force(op_choice_profile(seed, n, matmuls=False))


def test_the_optimum_takes_op_choices_where_they_pay() -> None:
    # The brute force above is not vacuous: optimal plans do run blocks under op choices.
    for seed in range(40):
        plans = assert_optimal_matches_brute_force(op_choice_profile(1000 + seed, 3))
        if any(uses_op_choice(plan) for plan in plans):
            return
    pytest.fail("no optimal plan took an op choice in 40 random chains")


def test_an_op_choice_below_every_other_option_sets_the_minimum() -> None:
    # One block (no matmuls: its menu is the choice alone) whose recomputation peaks high
    # (60 B) while the choice keeps nothing and recomputes little (30 B): the lowest peak of
    # any plan is that choice's, strictly, and the smallest budget gets it.
    block = example_block(forward_peak_bytes=50, backward_peak_bytes=20,
                          checkpointed_forward_peak_bytes=10, checkpointed_backward_peak_bytes=60,
                          kept_bytes_by_op={"aten.mean": 0, "aten.silu": 40},
                          forward_seconds_by_op={"aten.mean": 0.1, "aten.silu": 0.2},
                          op_choices=[OpChoice("save-ops:aten.mean", 0, 1 / 3, 5, 30)])
    profile = with_peak(Profile([block], 0, FIXED_BYTES, 3.0))
    assert_optimal_matches_brute_force(profile)
    peaks = {policy: simulate(profile, [Segment(0, 0, policy=policy)])[0]
             for policy in (None, "save-ops:aten.mean")}
    assert peaks["save-ops:aten.mean"] < min(peaks[None], simulate(profile, [])[0])
    lowest = solve(profile, minimum_peak_bytes(profile), "optimal")
    assert lowest.segments == [Segment(0, 0, policy="save-ops:aten.mean")]
    assert lowest.predicted_peak_bytes == FIXED_BYTES + peaks["save-ops:aten.mean"]


@pytest.mark.slow
def test_optimal_solves_a_100_block_chain_with_five_choices_per_block() -> None:
    # Mirrors test_solvers_strategies.test_optimal_solves_a_100_block_chain: fits, never
    # slower than Chen's greedy, and the predictions are simulate's. How long it takes is
    # printed (tests assert no wall time; bench/ measures it): about 2 s per solve on a quiet
    # 2-core CPU, as without op choices (the menus add a few offers per block, not a table).
    profile = op_choice_profile(42, 100, choices=(5, 5))
    assert all(len(block.op_choices) == 5 for block in profile.blocks)
    low = minimum_peak_bytes(profile)
    for budget in (low, (low + profile.peak_bytes) // 2, profile.peak_bytes - 1):
        started = time.perf_counter()
        plan = solve(profile, budget, "optimal")
        print(f"budget {budget}: solved in {time.perf_counter() - started:.2f} s")
        assert plan.predicted_peak_bytes <= budget
        assert_valid(profile, plan.segments, 0, 99)
        chain_peak, extra_seconds = simulate(profile, plan.segments)
        assert plan.predicted_peak_bytes == FIXED_BYTES + chain_peak
        assert plan.predicted_extra_seconds == extra_seconds
        try:
            greedy = solve(profile, budget, "chen-greedy")
        except BudgetError:
            continue
        assert plan.predicted_extra_seconds <= greedy.predicted_extra_seconds + 1e-9
