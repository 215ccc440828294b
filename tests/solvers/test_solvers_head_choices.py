"""``solve`` over the output head's choices (the plain head, each measured chunk count) does
less work than solving each alone and picks the same plan: a head whose step peaks above the
budget whatever the plan is not solved, and ``optimal`` fills one set of time tables for the
heads whose steps differ only after the chain (``solve_optimal_heads``). The reference,
``exhaustive`` below, is how ``solve`` chose before: every head solved alone by the strategy,
then the fitting plan of least extra time, the plain head on a tie, then the fewest chunks.
Random profiles (tiny byte counts, exact tables; megabyte-sized ones, tables in units) with
random chunked heads, and estimates of a small Llama, plain and under LoRA, at budgets from
below the least reachable peak to the plain step's: the same plan, or the same error, every
time."""

from __future__ import annotations

import dataclasses
import random

import pytest
from hf_models import causal_sample, tiny_llama, with_lora
from test_solvers_boundaries import scaled
from test_solvers_op_choices import with_op_choices
from test_solvers_strategies import random_profile

import gradckpt
from gradckpt import BudgetError
from gradckpt.budget import parse_budget
from gradckpt.cost import as_chunked, plan_for
from gradckpt.profile_types import MODELED_TIMES, ChunkedHead, Profile
from gradckpt.solvers import STRATEGIES, _head_choices, _infeasible, solve
from gradckpt.solvers import optimal as optimal_solver
from gradckpt.solvers.optimal import (
    minimum_peak_bytes,
    same_chain,
    solve_optimal,
    solve_optimal_heads,
)
from gradckpt.solvers.timing_noise import TIME_NOISE_BAND, settle_times

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

OUTPUT_HEADS = ("auto", "plain", "chunked")


def exhaustive(profile: Profile, budget: int, strategy: str, output_head: str) -> str:
    """The plan ``solve`` chose before it skipped or shared any work, as JSON: each head's
    step solved alone, every candidate kept for the error."""
    noise = TIME_NOISE_BAND if profile.notes.get(MODELED_TIMES) is False else 0.0
    budget_bytes = parse_budget(budget, unconstrained_peak_bytes=profile.peak_bytes)
    settled = settle_times(profile, noise)
    candidates = [
        plan_for(settled, strategy, budget_bytes,
                 STRATEGIES[strategy](as_chunked(settled, chunks), budget_bytes), chunks)
        for chunks in _head_choices(profile, output_head)
    ]
    fitting = [plan for plan in candidates if plan.predicted_peak_bytes <= budget_bytes]
    if not fitting:
        raise _infeasible(profile, strategy, budget_bytes, candidates, output_head)
    least = min(plan.predicted_extra_seconds for plan in fitting)
    chosen = next(plan for plan in fitting
                  if plan.predicted_extra_seconds <= least * (1 + noise))
    return plan_for(profile, strategy, budget_bytes, chosen.segments,
                    chosen.head_chunks).to_json()


def outcome(solver, profile: Profile, budget: int, strategy: str, output_head: str) -> tuple:
    """What ``solver`` answers: the plan as JSON, or the budget error's message and minimum."""
    try:
        plan = solver(profile, budget, strategy, output_head)
    except BudgetError as error:
        return str(error), error.minimum_bytes
    return plan if isinstance(plan, str) else plan.to_json(), None


def solved(profile: Profile, budget: int, strategy: str, output_head: str) -> gradckpt.Plan:
    return solve(profile, budget, strategy, output_head=output_head)


def assert_same_choices(profile: Profile, budgets: list[int], strategies: tuple[str, ...],
                        output_heads: tuple[str, ...] = OUTPUT_HEADS) -> None:
    for budget in budgets:
        for strategy in strategies:
            for output_head in output_heads:
                expected = outcome(exhaustive, profile, budget, strategy, output_head)
                got = outcome(solved, profile, budget, strategy, output_head)
                assert got == expected, (budget, strategy, output_head)


def with_chunked_heads(profile: Profile, rng: random.Random, scale: int = 1) -> Profile:
    """``profile`` with one to three chunked heads of random sizes up to what the plain step
    peaks at above ``fixed_bytes`` (most with the same head gradients, so that their steps
    share the chain), a plain head up to twice that (often above the room a budget leaves),
    and, every other time, times measured on the wall's clock (compared within the noise
    band)."""
    room = profile.peak_bytes - profile.fixed_bytes  # what the plain step peaks at above it
    gradient_bytes = rng.randint(0, 20) * scale
    heads = [
        ChunkedHead(
            "lm_head", chunks, head_bytes=rng.randint(0, room),
            head_gradient_bytes=(gradient_bytes if rng.random() < 0.8
                                 else rng.randint(0, 20) * scale),
            other_peak_bytes=rng.randint(0, 40) * scale,
            optimizer_step_bytes=rng.randint(0, 40) * scale,
            previous_output_bytes=rng.randint(0, 20) * scale if rng.random() < 0.5 else 0,
            peak_bytes=profile.peak_bytes, extra_seconds=rng.randint(0, 8) * 0.25,
        )
        for chunks in sorted(rng.sample([2, 4, 8, 16, 64], rng.randint(1, 3)))
    ]
    notes = {**profile.notes, MODELED_TIMES: False} if rng.random() < 0.5 else profile.notes
    return dataclasses.replace(
        profile, chunked_heads=heads, head_bytes=rng.randint(0, 2 * room),
        previous_output_bytes=rng.randint(0, 20) * scale,
        optimizer_step_bytes=rng.randint(0, 40) * scale, notes=notes,
    )


def random_headed_profile(seed: int) -> Profile:
    rng = random.Random(seed)
    profile = random_profile(seed, rng.randint(1, 8), matmuls=rng.random() < 0.7)
    if rng.random() < 0.4:
        profile = with_op_choices(profile, rng)
    scale = 100_003 if rng.random() < 0.5 else 1  # megabyte-sized: tables in units
    return with_chunked_heads(scaled(profile, scale) if scale > 1 else profile, rng, scale)


def budgets_between(profile: Profile, rng: random.Random, count: int) -> list[int]:
    """Below the least reachable peak, at it, at the plain step's peak and ``count`` between."""
    lowest, highest = minimum_peak_bytes(profile), max(profile.peak_bytes, 1)
    return sorted({lowest - 1, lowest, highest,
                   *(rng.randint(lowest, max(lowest, highest)) for _ in range(count))})


@pytest.mark.parametrize("seed", range(24))
def test_solve_chooses_as_when_every_head_is_solved_alone(seed: int) -> None:
    profile = random_headed_profile(seed)
    budgets = budgets_between(profile, random.Random(seed), 5)
    assert_same_choices(profile, budgets, ("optimal", "chen-greedy", "sqrt"))


@pytest.mark.parametrize("seed", range(24))
def test_heads_solved_together_get_each_their_own_plan(seed: int) -> None:
    profile = random_headed_profile(1000 + seed)
    steps = [as_chunked(profile, chunks) for chunks in _head_choices(profile, "auto")]
    for budget in budgets_between(profile, random.Random(seed), 4):
        assert solve_optimal_heads(steps, budget) == [solve_optimal(step, budget)
                                                      for step in steps]


@pytest.fixture(scope="module")
def llama_estimates() -> dict[str, Profile]:
    """Estimates of a 4-layer Llama, whole at 32 tokens and under LoRA at 128."""
    pytest.importorskip("transformers")
    return {"llama": gradckpt.estimate(tiny_llama(4), causal_sample(seq=32)),
            "llama-lora": gradckpt.estimate(with_lora(tiny_llama(4)), causal_sample(seq=128))}


@pytest.mark.parametrize("name", ["llama", "llama-lora"])
@pytest.mark.parametrize("clock", ["modeled", "measured"])
def test_an_estimated_llama_gets_the_plan_every_head_solved_alone_gives(
    llama_estimates: dict[str, Profile], name: str, clock: str,
) -> None:
    profile = llama_estimates[name]
    assert profile.chunked_heads, "the estimate measured no chunked head: nothing to choose"
    if clock == "measured":  # its times compared within the noise band
        profile = dataclasses.replace(profile, notes={**profile.notes, MODELED_TIMES: False})
    lowest, highest = minimum_peak_bytes(profile), profile.peak_bytes
    budgets = [lowest - 1, *(lowest + (highest - lowest) * i // 10 for i in range(11))]
    assert_same_choices(profile, budgets, ("optimal", "chen-greedy"))


def counting_tables(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of heads each set of ``optimal``'s time tables is filled for, from now on."""
    filled: list[int] = []
    tables = optimal_solver._TimeTables

    def counted(profile: Profile, unit_bytes: int, room_bytes: int, heads=None):
        filled.append(len(heads) if heads else 1)
        return tables(profile, unit_bytes, room_bytes, heads)

    monkeypatch.setattr(optimal_solver, "_TimeTables", counted)
    return filled


def large_head_profile(head_gradient_bytes: tuple[int, ...] = (8, 8, 8)) -> Profile:
    """An 8k-token step in miniature: a plain head (logits whole) larger than the room any
    budget below the plain step's leaves, and three chunked heads, the chunks' steps with the
    given head gradients."""
    profile = scaled(random_profile(7, 6), 100_003)
    chunked = [
        ChunkedHead("lm_head", chunks, head_bytes=head_bytes, head_gradient_bytes=gradients,
                    other_peak_bytes=0, optimizer_step_bytes=0, previous_output_bytes=0,
                    peak_bytes=profile.peak_bytes, extra_seconds=0.01 * chunks)
        for chunks, head_bytes, gradients in zip((4, 16, 64), (3_000_000, 1_000_000, 800_000),
                                                 head_gradient_bytes, strict=True)
    ]
    return dataclasses.replace(profile, head_bytes=profile.peak_bytes,
                               chunked_heads=chunked, head_gradient_bytes=2_000_000)


def test_a_head_above_the_budget_whatever_the_plan_is_not_solved(monkeypatch) -> None:
    profile = large_head_profile()
    budget = (minimum_peak_bytes(as_chunked(profile, 64)) + profile.peak_bytes) // 2
    expected = outcome(exhaustive, profile, budget, "optimal", "auto")
    filled = counting_tables(monkeypatch)
    assert outcome(solved, profile, budget, "optimal", "auto") == expected
    assert filled == [3]  # the chunked heads' steps, together; the plain head's, never


def test_heads_whose_chains_differ_get_tables_of_their_own(monkeypatch) -> None:
    profile = large_head_profile(head_gradient_bytes=(8, 8, 500_000))
    steps = [as_chunked(profile, chunks) for chunks in (4, 16, 64)]
    assert same_chain(steps[0], steps[1]) and not same_chain(steps[1], steps[2])
    budget = (minimum_peak_bytes(steps[2]) + profile.peak_bytes) // 2
    expected = outcome(exhaustive, profile, budget, "optimal", "chunked")
    filled = counting_tables(monkeypatch)
    assert outcome(solved, profile, budget, "optimal", "chunked") == expected
    assert filled == [2, 1]


def test_when_no_head_fits_the_error_is_the_one_every_head_solved_gives() -> None:
    profile = large_head_profile()
    for strategy in ("optimal", "chen-greedy", "every-layer"):
        expected = outcome(exhaustive, profile, profile.fixed_bytes + 1, strategy, "auto")
        assert expected[1] is not None  # a BudgetError
        assert outcome(solved, profile, profile.fixed_bytes + 1, strategy, "auto") == expected
