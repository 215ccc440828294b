"""Memory a plan holds that no block's own numbers show, in the cost model and the optimal
solver: what a checkpointed block returns besides its hidden state (alive while the next block
runs forward: ``BlockProfile.returned_bytes``), and what the modules before the chain hold
through its forward (``Profile.before_chain_bytes``). The real models these come from are in
``tests/integrations/test_integrations_families_predictions.py``."""

from __future__ import annotations

import pytest

import gradckpt
from gradckpt.cost import phase_peaks, simulate
from gradckpt.plan import Segment
from gradckpt.profile_types import Profile, example_block


def chain(returned_bytes: int = 0, before_chain_bytes: int = 0, count: int = 4) -> Profile:
    """``count`` blocks of 10-byte hidden states that save 50 bytes, peak 60 above their input
    in forward (30 checkpointed), each returning ``returned_bytes`` besides its hidden state."""
    blocks = [example_block(f"h.{i}", forward_peak_bytes=60, checkpointed_forward_peak_bytes=30,
                            backward_peak_bytes=20, returned_bytes=returned_bytes)
              for i in range(count)]
    return Profile(blocks, 2000, 1000, 12.0, before_chain_bytes=before_chain_bytes)


def test_what_a_checkpointed_block_returns_counts_while_the_next_one_runs_forward() -> None:
    plain, returning = chain(count=2), chain(returned_bytes=100, count=2)
    # Kept, the block's graph saves what it returns: nothing more.
    assert phase_peaks(returning, [])["forward"] == phase_peaks(plain, [])["forward"]
    # Block 0 checkpointed, block 1 kept: block 1's forward runs with block 0's returned.
    first_alone = [Segment(0, 0)]
    assert (phase_peaks(returning, first_alone)["forward"]
            == phase_peaks(plain, first_alone)["forward"] + 100)
    # Inside a segment, each later block's forward runs with the one before's.
    whole = [Segment(0, 1)]
    assert phase_peaks(returning, whole)["forward"] == phase_peaks(plain, whole)["forward"] + 100
    # Nor after a chain break, where the loop that held it has ended.
    broken = chain(returned_bytes=100, count=2)
    broken.chain_breaks = [1]
    unbroken = chain(count=2)
    unbroken.chain_breaks = [1]
    assert phase_peaks(broken, first_alone)["forward"] == phase_peaks(unbroken, first_alone)[
        "forward"]


def test_what_the_stem_holds_counts_through_the_chains_forward_only() -> None:
    plain, stem = chain(), chain(before_chain_bytes=70)
    for segments in ([], [Segment(0, 0)], [Segment(0, 3)]):
        with_stem, without = phase_peaks(stem, segments), phase_peaks(plain, segments)
        assert with_stem["forward"] == without["forward"] + 70
        assert {k: v for k, v in with_stem.items() if k != "forward"} == {
            k: v for k, v in without.items() if k != "forward"}


@pytest.mark.parametrize("returned_bytes", [0, 40, 400])
def test_the_optimal_plan_fits_as_the_cost_model_counts_it(returned_bytes: int) -> None:
    """The solver's tables count what a block returns whatever the fate of the block before
    (an upper bound): every plan it finds fitting fits ``simulate``'s exact count."""
    profile = chain(returned_bytes=returned_bytes, before_chain_bytes=25)
    lowest = profile.fixed_bytes + min(
        simulate(profile, segments)[0]
        for segments in ([], [Segment(0, 3)], [Segment(i, i) for i in range(4)]))
    for budget in range(lowest, profile.fixed_bytes + simulate(profile, [])[0] + 1, 7):
        plan = gradckpt.solve(profile, budget)
        assert plan.predicted_peak_bytes <= budget
        assert plan.predicted_peak_bytes == profile.fixed_bytes + simulate(
            profile, plan.segments)[0]
