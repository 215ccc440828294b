"""The "what takes the memory" table of ``gradckpt plan`` (measured and ``--estimate``): one
breakdown (``measure.memory_parts``) with one set of labels, its parts sizes, not one instant,
read against the predicted peak."""

from __future__ import annotations

import pytest
import torch

import gradckpt
from gradckpt.budget import format_bytes
from gradckpt.measure.memory_parts import (
    ACTIVATIONS,
    CUDA_RESERVE,
    OUTPUT_HEAD,
    PLAN_ACTIVATIONS,
    THE_REST,
    memory_parts,
)
from gradckpt.report import MemoryParts, memory_breakdown_table
from gradckpt.toy_models import GPTConfig, TinyGPT, mlp_chain

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

MiB = 2**20


@pytest.fixture(scope="module")
def gpt_with_a_large_head():
    """A TinyGPT whose logits outweigh its blocks' activations, as a small Transformers model's
    do: under every-layer the parts add up to more than the predicted peak."""
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(n_layer=2, vocab_size=4096, block_size=64))
    tokens = torch.randint(0, 4096, (2, 65), generator=torch.Generator().manual_seed(0))
    sample = {"idx": tokens[:, :-1], "targets": tokens[:, 1:]}
    profile = gradckpt.profile(model, sample, repeats=1)
    return model, profile, gradckpt.solve(profile, None, "every-layer")


def test_a_plans_table_says_its_parts_are_sizes_and_shows_the_predicted_peak(
    gpt_with_a_large_head,
):
    model, profile, plan = gpt_with_a_large_head
    memory = memory_parts(model, profile, plan)
    total = sum(size for _, size in memory.parts)
    assert total > plan.predicted_peak_bytes  # the case that read "100%" under a smaller peak
    table = memory_breakdown_table(memory)
    header = table.splitlines()[0]
    assert "sizes; not all alive at one instant" in header and "of the predicted peak" in header
    text = " ".join(table.split())
    assert "The parts are sizes, not one instant" in text
    assert f"they add up to {format_bytes(total)}, more than the predicted peak of " \
           f"{format_bytes(plan.predicted_peak_bytes)}" in text
    assert "100%" not in table and "all of these together" not in table


def test_each_share_is_of_the_predicted_peak():
    memory = MemoryParts([("logits", 20 * MiB), ("parameters", 6 * MiB), ("tiny", 1024)],
                         predicted_peak_bytes=25 * MiB)
    lines = memory_breakdown_table(memory).splitlines()
    assert lines[1].split()[-1] == "80%" and lines[2].split()[-1] == "24%"
    assert lines[3].split()[-1] == "<1%"  # not a misleading 0%


def test_parts_that_make_the_peak_say_so():
    memory = MemoryParts([("a", 3 * MiB), ("the rest", MiB)], predicted_peak_bytes=4 * MiB)
    assert memory_breakdown_table(memory).splitlines()[-1] == (
        "The parts are sizes, not one instant: they add up to the predicted peak, 4.00 MiB."
    )


def test_parts_short_of_the_peak_name_the_rest():
    memory = MemoryParts([("a", MiB)], predicted_peak_bytes=4 * MiB)
    text = " ".join(memory_breakdown_table(memory).split())
    assert "1.00 MiB, less than the predicted peak of 4.00 MiB" in text


def test_the_estimate_table_reads_the_same_and_keeps_the_reserve_out_of_the_sum():
    parts = [("parameters", 6 * MiB), (OUTPUT_HEAD, 20 * MiB), (CUDA_RESERVE, 2 * 2**30)]
    memory = MemoryParts(parts, predicted_peak_bytes=25 * MiB,
                         outside_peak=frozenset({CUDA_RESERVE}))
    table = memory_breakdown_table(memory, device_bytes=80 * 2**30)
    lines = table.splitlines()
    assert lines[0].split("  ")[0] == "what takes the memory (sizes; not all alive at one instant)"
    assert lines[0].endswith("of the predicted peak  of the device")
    assert lines[1].startswith(CUDA_RESERVE) and "outside" in lines[1].split("MiB")[-1]
    text = " ".join(table.split())
    assert "those inside the peak add up to 26.00 MiB, more than the predicted peak of 25.00 MiB" \
        in text
    assert "100%" not in table


def test_measured_and_predicted_steps_break_down_under_the_same_labels():
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(n_layer=2))
    tokens = torch.randint(0, 512, (2, 33), generator=torch.Generator().manual_seed(0))
    sample = {"idx": tokens[:, :-1], "targets": tokens[:, 1:]}
    measured = gradckpt.profile(model, sample, optimizer="adamw", repeats=1)
    predicted = gradckpt.estimate(model, sample, device="h100-80gb", optimizer="adamw")
    step_names = [name for name, _ in memory_parts(model, measured).parts]
    assert step_names == [name for name in predicted.notes["memory_parts"] if name != CUDA_RESERVE]
    assert ACTIVATIONS in step_names and OUTPUT_HEAD in step_names
    for profile in (measured, predicted):
        memory = memory_parts(model, profile, gradckpt.solve(profile, None, "sqrt"),
                              optimizer="adamw")
        names = [name for name, _ in memory.parts]
        assert "optimizer state (AdamW)" in names and PLAN_ACTIVATIONS in names
        assert ACTIVATIONS not in names
        assert memory.outside_peak == (frozenset({CUDA_RESERVE}) if profile is predicted
                                       else frozenset())


def test_a_plans_parts_cover_its_peak_with_the_rest():
    """Where the parts fall short of the plan's peak, the rest is a part of its own; where they
    exceed it (they live at different moments), there is no rest."""
    torch.manual_seed(0)
    model = mlp_chain(4, 64)
    profile = gradckpt.profile(model, torch.randn(8, 64), repeats=1)
    for strategy in ("none", "every-layer", "sqrt"):
        memory = memory_parts(model, profile, gradckpt.solve(profile, None, strategy))
        parts = dict(memory.parts)
        assert sum(parts.values()) >= memory.predicted_peak_bytes, strategy
        if THE_REST in parts:
            assert sum(parts.values()) == memory.predicted_peak_bytes, strategy


def test_one_rank_s_table_says_which_parts_each_rank_keeps_a_share_of():
    model = mlp_chain(4, 64)
    predicted = gradckpt.estimate(model, torch.randn(8, 64), device="l4", optimizer="adamw",
                                  world_size=2)
    memory = memory_parts(model, predicted, gradckpt.solve(predicted, None, "sqrt"),
                          optimizer="adamw")
    assert memory.world_size == 2
    table = memory_breakdown_table(memory)
    for label in ("parameters (1/2 per rank)", "gradients (trainable parameters, 1/2 per rank)",
                  "optimizer state (AdamW, 1/2 per rank)"):
        assert f"\n{label} " in table, label
    assert PLAN_ACTIVATIONS + " " in table  # not sharded: each rank's own batch
