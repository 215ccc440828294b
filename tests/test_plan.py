"""The cost model (``gradckpt.cost.simulate``) on chains small enough to work out by hand, and
the Plan/Profile types' JSON round trips and errors."""

from __future__ import annotations

from dataclasses import replace

import pytest

from gradckpt import UsageError
from gradckpt.cost import plan_for, simulate
from gradckpt.plan import Plan, Segment
from gradckpt.profile_types import BlockProfile, Profile


def chain(n: int = 4, **overrides: object) -> Profile:
    """n identical blocks: input/output 10 B, saves 50 B (its input included), 1 s / 2 s."""
    fields = dict(
        input_bytes=10, output_bytes=10, saved_bytes=50, input_saved=True,
        forward_seconds=1.0, backward_seconds=2.0,
    )
    fields.update(overrides)
    blocks = [BlockProfile(name=f"h.{i}", **fields) for i in range(n)]
    return Profile(blocks, peak_bytes=1000 + 210, fixed_bytes=1000, step_seconds=12.0)


def test_no_checkpointing_retains_everything_and_costs_nothing() -> None:
    # forward retains 4 x 50; the last block's backward adds its 10-byte incoming gradient
    assert simulate(chain(), []) == (210, 0.0)


def test_every_layer_keeps_inputs_and_recomputes_each_block_once() -> None:
    # forward keeps 4 inputs (40); recomputing block 3 with its gradient (10) alive retains its
    # 40 saved bytes beyond the input, and its backward adds the gradient: 40 + 40 + 10
    assert simulate(chain(), [Segment(i, i) for i in range(4)]) == (90, 4.0)


def test_two_segments() -> None:
    # forward keeps inputs 0 and 2 (20); recomputing blocks 2-3: 20 + 40 + 50, plus gradient 10
    assert simulate(chain(), [Segment(0, 1), Segment(2, 3)]) == (120, 4.0)


def test_one_segment_over_everything_saves_no_peak() -> None:
    assert simulate(chain(), [Segment(0, 3)]) == (210, 4.0)


def test_nested_segments_recompute_inner_blocks_again() -> None:
    plan = [Segment(0, 3, children=[Segment(0, 1), Segment(2, 3)])]
    assert simulate(chain(), plan) == (120, 8.0)


def test_a_policy_keeps_matmul_outputs_and_skips_their_recomputation() -> None:
    profile = chain(matmul_bytes=20, matmul_seconds=0.25)
    peak_full, extra_full = simulate(profile, [Segment(i, i) for i in range(4)])
    peak_kept, extra_kept = simulate(
        profile, [Segment(i, i, policy="save-matmuls") for i in range(4)]
    )
    assert extra_full == 4.0 and extra_kept == 3.0  # 4 x (1 s - 0.25 s)
    assert peak_kept == peak_full + 4 * 20 - 20  # the kept outputs, once for the last block


def test_transients_count_where_they_happen() -> None:
    profile = chain(forward_peak_bytes=5, backward_peak_bytes=7)
    assert simulate(profile, []) == (210 + 7, 0.0)


def test_plan_for_predicts_peak_and_overhead() -> None:
    plan = plan_for(chain(), "every-layer", None, [Segment(i, i) for i in range(4)])
    assert plan.predicted_peak_bytes == 1000 + 90
    assert plan.predicted_overhead == pytest.approx(4.0 / 12.0)
    assert plan.block_names == ["h.0", "h.1", "h.2", "h.3"]


def test_plan_and_profile_round_trip_through_json() -> None:
    plan = plan_for(
        chain(), "optimal", 1100, [Segment(0, 3, [Segment(0, 1, policy="save-matmuls")])]
    )
    assert Plan.from_json(plan.to_json()) == plan
    profile = chain(matmul_bytes=3)
    assert Profile.from_json(profile.to_json()) == profile


@pytest.mark.parametrize(
    "segments",
    [[Segment(0, 4)], [Segment(2, 1)], [Segment(0, 2), Segment(2, 3)],
     [Segment(0, 1, children=[Segment(1, 2)])]],
)
def test_segments_that_do_not_fit_are_usage_errors(segments: list[Segment]) -> None:
    with pytest.raises(UsageError, match="does not fit"):
        simulate(chain(), segments)


@pytest.mark.parametrize("reader", [Plan.from_json, Profile.from_json])
def test_reading_something_else_is_a_usage_error(reader) -> None:
    with pytest.raises(UsageError, match="not a gradckpt"):
        reader('{"hello": 1}')
    with pytest.raises(UsageError, match="not a gradckpt"):
        reader("not json")


def test_str_is_a_per_block_table_with_the_predictions() -> None:
    plan = Plan(
        "optimal", 4096, [Segment(0, 3, [Segment(0, 1), Segment(2, 2, policy="save-matmuls")])],
        3000, 2.0, 0.4, ["a", "b", "c", "d", "e"],
    )
    lines = str(plan).splitlines()
    assert lines[0].split() == ["block", "what", "happens", "to", "its", "activations"]
    assert lines[1] == (
        "a      recomputed: segment 0-3 (its input kept); segment 0-1 (nested, level 2)"
    )
    assert lines[3].endswith("segment 2-2 (nested, level 2), save-matmuls")
    assert lines[5] == "e      kept"
    assert lines[6] == (
        "strategy optimal within 4.00 KiB: predicted peak 2.93 KiB, predicted extra time +40.0%"
    )


def test_a_saved_output_and_the_next_blocks_saved_input_count_once() -> None:
    # A CNN block ending in ReLU saves its output, which the next block's convolution saves
    # as its input: one tensor of 10 bytes, in both blocks' saved_bytes (10 + 40 and 10 + 40).
    blocks = [BlockProfile(f"h.{i}", 10, 10, 50, True, 1.0, 1.0, output_saved=True)
              for i in range(3)]
    profile = Profile(blocks, 0, 0, 1.0)
    assert profile.plain_retained_bytes() == 3 * 50 - 2 * 10
    # plain: 130 retained, then block 2's backward adds its incoming gradient
    assert simulate(profile, [])[0] == 130 + 10
    # a segment starting after a kept block keeps its input at no cost (block 0 retains it),
    # and inside its recomputation block 2's input is block 1's saved output: 20 bytes less
    separate = Profile([replace(b, output_saved=False) for b in blocks], 0, 0, 1.0)
    assert simulate(profile, [Segment(1, 2)])[0] == 50 + 40 + 40 + 10
    assert simulate(separate, [Segment(1, 2)])[0] == 50 + 10 + 40 + 50 + 10
    # after a chain break the next block's input is another tensor
    broken = Profile(blocks, 0, 0, 1.0, chain_breaks=[2])
    assert broken.plain_retained_bytes() == 3 * 50 - 10


def test_a_chain_input_from_the_sample_is_counted_in_the_fixed_bytes_only() -> None:
    blocks = [BlockProfile(f"h.{i}", 10, 10, 50, True, 1.0, 1.0) for i in range(2)]
    outside = Profile(blocks, 0, 0, 1.0)
    from_sample = Profile(blocks, 0, 0, 1.0, chain_input_fixed=True)
    assert from_sample.plain_retained_bytes() == outside.plain_retained_bytes() - 10
    assert simulate(from_sample, [])[0] == simulate(outside, [])[0] - 10
    assert simulate(from_sample, [Segment(0, 1)])[0] == simulate(outside, [Segment(0, 1)])[0] - 10
