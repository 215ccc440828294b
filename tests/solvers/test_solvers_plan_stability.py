"""Plans are stable under timing noise (issue 27, item 5; ``gradckpt.solvers.timing_noise``):
the same model and sample give the same plan unless a measured difference is beyond the noise.

One profile of a small Llama (``estimate``: identical layers get identical times, so what the
test adds is the only noise) has every time it holds perturbed by independent noise of up to
+-3% (``NOISE``), 20 times; at budgets from the least reachable peak to the plain step's,
``solve`` returns the plan it returns on the profile itself, every time. Without the band
(``time_noise=0``) the same draws change the plan. Layers doing the same work are one cost
whatever their times (a layer measured 30% cheaper than its twins changes nothing); a layer
doing other work and 20% cheaper (beyond the band) takes the recomputation, 5% cheaper (within it)
changes nothing. Real measured profiles: test_solvers_plan_stability_measured.py.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import pytest
from hf_models import causal_sample, tiny_llama

import gradckpt
from gradckpt.profile_types import MODELED_TIMES, BlockProfile, Profile
from gradckpt.solvers.optimal import minimum_peak_bytes
from gradckpt.solvers.timing_noise import (
    TIME_NOISE_BAND,
    merged_within_band,
    same_work_pooled,
    settle_times,
)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

NOISE = 0.03
DRAWS = 20
BUDGETS = (0.0, 0.3, 0.6, 0.9)  # between the least reachable peak (0) and the plain step's (1)
SCALAR_SECONDS = ("forward_seconds", "backward_seconds", "matmul_seconds",
                  "policy_dispatch_seconds", "policy_extra_seconds",
                  "checkpointed_extra_seconds")


@pytest.fixture(scope="module")
def estimated() -> Profile:
    pytest.importorskip("transformers")
    return gradckpt.estimate(tiny_llama(6), causal_sample())


@pytest.fixture(scope="module")
def profile(estimated: Profile) -> Profile:
    """The estimate standing for a measured profile: its times are what measuring would give
    without noise, and the noise the tests add is what a measured profile's times carry."""
    return dataclasses.replace(estimated, notes={**estimated.notes, MODELED_TIMES: False})


def budget_at(profile: Profile, fraction: float) -> int:
    lowest = minimum_peak_bytes(profile)
    return lowest + int((profile.peak_bytes - lowest) * fraction)


def with_times(profile: Profile, change: Callable[[float], float],
               blocks: range | None = None) -> Profile:
    """``profile`` with ``change`` applied to every time of ``blocks`` (all: and the heads')."""
    changed = list(profile.blocks)
    for index in blocks if blocks is not None else range(len(changed)):
        changed[index] = _block_with_times(changed[index], change)
    heads = profile.chunked_heads if blocks is not None else [
        dataclasses.replace(head, extra_seconds=change(head.extra_seconds))
        for head in profile.chunked_heads]
    return dataclasses.replace(profile, blocks=changed, chunked_heads=heads)


def _block_with_times(block: BlockProfile, change: Callable[[float], float]) -> BlockProfile:
    return dataclasses.replace(
        block,
        **{name: change(getattr(block, name)) for name in SCALAR_SECONDS
           if getattr(block, name) is not None},
        forward_seconds_by_op={op: change(s) for op, s in block.forward_seconds_by_op.items()},
        op_choices=[dataclasses.replace(choice, forward_share=change(choice.forward_share))
                    for choice in block.op_choices],
    )


def plan_of(profile: Profile, budget: int, **options: float) -> tuple:
    plan = gradckpt.solve(profile, budget, **options)
    return repr(plan.segments), plan.head_chunks


def noisy_plans(profile: Profile, budget: int, **options: float) -> set[tuple]:
    draws = random.Random(budget)

    def noise(seconds: float) -> float:
        return seconds * (1 + draws.uniform(-NOISE, NOISE))

    return {plan_of(with_times(profile, noise), budget, **options) for _ in range(DRAWS)}


@pytest.mark.parametrize("fraction", BUDGETS)
def test_noise_within_the_band_leaves_the_plan_as_it_was(profile: Profile,
                                                         fraction: float) -> None:
    budget = budget_at(profile, fraction)
    assert noisy_plans(profile, budget) == {plan_of(profile, budget)}


def test_without_the_band_the_same_noise_changes_plans(profile: Profile) -> None:
    # What the test above holds is not given: compared exactly, the noise picks the plan.
    changed = [len(noisy_plans(profile, budget_at(profile, f), time_noise=0)) > 1
               for f in BUDGETS]
    assert sum(changed) >= 2, changed


def built_otherwise(block: BlockProfile) -> BlockProfile:
    """``block`` with one more operation (taking no time, keeping nothing): a layer doing
    other work, whose times the solver does not pool with the others'."""
    return dataclasses.replace(block, kept_bytes_by_op={**block.kept_bytes_by_op, "aten.relu": 0})


def with_block(profile: Profile, index: int, block: BlockProfile) -> Profile:
    blocks = list(profile.blocks)
    blocks[index] = block
    return dataclasses.replace(profile, blocks=blocks)


@pytest.mark.parametrize("fraction", [0.7, 0.8])  # one block checkpointed
def test_a_difference_beyond_the_band_changes_the_plan(profile: Profile,
                                                       fraction: float) -> None:
    budget = budget_at(profile, fraction)
    segments = gradckpt.solve(profile, budget).segments
    assert len(segments) == 1 and segments[0].start > 0  # the tie went to a later block
    other = segments[0].start - 1  # the block before it, built otherwise
    apart = with_block(profile, other, built_otherwise(profile.blocks[other]))
    assert plan_of(apart, budget) == plan_of(profile, budget)
    # 5% cheaper (within the noise): the same plan.
    slightly = with_times(apart, lambda seconds: seconds * 0.95, range(other, other + 1))
    assert plan_of(slightly, budget) == plan_of(profile, budget)
    # 20% cheaper (beyond it): that block is the one checkpointed now.
    cheaper = with_times(apart, lambda seconds: seconds * 0.8, range(other, other + 1))
    assert [s.start for s in gradckpt.solve(cheaper, budget).segments] == [other]


@pytest.mark.parametrize("fraction", [0.7, 0.8])
def test_layers_doing_the_same_work_cost_alike_whatever_their_times(profile: Profile,
                                                            fraction: float) -> None:
    # The price of stability: identical layers measured apart are the machine's noise (up to
    # 5x apart for a millisecond's layer on a loaded machine), so a difference between them
    # changes nothing, however large.
    budget = budget_at(profile, fraction)
    other = gradckpt.solve(profile, budget).segments[0].start - 1
    cheaper = with_times(profile, lambda seconds: seconds * 0.7, range(other, other + 1))
    assert plan_of(cheaper, budget) == plan_of(profile, budget)
    pooled = same_work_pooled(cheaper.blocks)
    assert len({block.forward_seconds for block in pooled}) == 1


def test_times_within_the_band_are_one_time_and_beyond_it_two() -> None:
    within = 1.0 + 0.99 * TIME_NOISE_BAND
    assert merged_within_band([1.0, within, 2.0]) == pytest.approx([(1.0 + within) / 2] * 2 + [2.0])
    assert merged_within_band([1.0, 1.0 + 2 * TIME_NOISE_BAND]) == [1.0, 1.0 + 2 * TIME_NOISE_BAND]


def test_settling_keeps_each_blocks_times_consistent(profile: Profile) -> None:
    # Blocks are merged as wholes (every time within the band), so a block's parts stay parts:
    # its matmuls' seconds within its forward's (Profile checks it on construction).
    draws = random.Random(0)
    noisy = with_times(profile, lambda seconds: seconds * (1 + draws.uniform(-NOISE, NOISE)))
    settled = settle_times(noisy)
    assert len({block.forward_seconds for block in settled.blocks}) == 1
    assert all(b.matmul_seconds <= b.forward_seconds for b in settled.blocks)
    assert [b.input_bytes for b in settled.blocks] == [b.input_bytes for b in profile.blocks]
    assert settle_times(noisy, 0) is noisy


def test_an_estimate_is_solved_exactly(estimated: Profile) -> None:
    """A modeled clock times the same operations alike: an estimate's times carry no noise,
    so its plan is the least predicted extra time (no band), at every budget."""
    assert estimated.notes[MODELED_TIMES] is True
    for fraction in BUDGETS:
        budget = budget_at(estimated, fraction)
        assert plan_of(estimated, budget) == plan_of(estimated, budget, time_noise=0)
