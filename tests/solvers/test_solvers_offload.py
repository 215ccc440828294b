"""Offload as a planned fate (issue 25): offered only where the profile's device has a host link
(a GPU), priced by the transfer that its overlap does not hide, capped by host memory, shown in
the plan's table; the optimal DP with offload options against brute force; on the CPU never
offered, and the plan says why.

No GPU is needed: the profiles here are made by hand (``device="cuda"`` and a host link in
their notes) or estimated for a GPU preset; the engine's offload copies are tested on a GPU in
tests/engine/test_engine_cuda.py and bench/device_check.sh.
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hf_models import causal_sample, tiny_llama
from test_solvers_strategies import all_plans

import gradckpt
from gradckpt.cost import block_bytes, simulate
from gradckpt.op_choices import HOST_CAP, HOST_LINK, PolicyCost, offload_offer, offloaded
from gradckpt.plan import Plan, Segment
from gradckpt.profile_types import OpChoice, Profile, example_block
from gradckpt.solvers.chain_costs import ChainCosts
from gradckpt.solvers.optimal import minimum_peak_bytes

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

FIXED = 1000
MM = "save-ops:aten.mm"


def gpu_block(name: str, rng: random.Random | None = None) -> gradckpt.BlockProfile:
    """A block with one measured op-level choice (keeping its matmul outputs, 30 bytes)."""
    rng = rng or random.Random(0)
    saved = rng.randint(40, 80)
    kept = rng.randint(5, saved - 5)
    choice = OpChoice(MM, kept_bytes=kept, forward_share=rng.uniform(0.2, 0.8),
                      forward_peak_bytes=kept + rng.randint(5, 20),
                      backward_peak_bytes=rng.randint(30, saved + 10))
    return example_block(
        name, saved_bytes=saved, forward_peak_bytes=saved + 10,
        forward_seconds=rng.uniform(0.5, 2.0), kept_bytes_by_op={"aten.mm": kept},
        forward_seconds_by_op={"aten.mm": 0.5, "aten.mul": 0.5},
        checkpointed_forward_peak_bytes=rng.randint(10, 30),
        checkpointed_backward_peak_bytes=rng.randint(40, saved + 20),
        op_choices=[choice],
    )


def gpu_profile(n: int, link: float | None = 100.0, seed: int = 0, **notes: object) -> Profile:
    rng = random.Random(seed)
    blocks = [gpu_block(f"h.{i}", rng) for i in range(n)]
    profile = Profile(blocks, peak_bytes=0, fixed_bytes=FIXED, step_seconds=10.0,
                      device="cuda", notes={HOST_LINK: link, **notes})
    profile.peak_bytes = FIXED + simulate(profile, [])[0]
    return profile


# ------------------------------------------------------------------------------------------
# The cost of one offloaded choice
# ------------------------------------------------------------------------------------------


def test_offloading_moves_the_kept_bytes_off_the_device_and_pays_the_unhidden_transfer() -> None:
    block = example_block(forward_seconds=1.0)
    kept = PolicyCost(MM, kept_bytes=400, extra_seconds=0.5, transient_bytes=10,
                      backward_peak_bytes=20)
    fast = offloaded(block, kept, 1e6, "offload-ops:aten.mm")  # 0.4 ms each way: hidden
    assert (fast.kept_bytes, fast.offloaded_bytes) == (0, 400)
    assert fast.extra_seconds == pytest.approx(0.5)
    # the forward holds them until copied, the recomputation from its start (prefetch)
    assert (fast.transient_bytes, fast.backward_peak_bytes) == (410, 420)
    slow = offloaded(block, kept, 100.0, "offload-ops:aten.mm")  # 4 s each way
    assert slow.extra_seconds == pytest.approx(0.5 + (4 - 1.0) + (4 - 0.5))


def test_without_a_host_link_offloading_is_priced_as_keeping() -> None:
    kept = PolicyCost(MM, 400, 0.5, 10, 20)
    cost = offloaded(example_block(), kept, None, "offload-ops:aten.mm")
    assert (cost.kept_bytes, cost.offloaded_bytes, cost.extra_seconds) == (400, 0, 0.5)


# ------------------------------------------------------------------------------------------
# Where it is offered
# ------------------------------------------------------------------------------------------


def test_on_the_cpu_offload_is_never_offered_and_the_plan_says_why() -> None:
    profile = dataclasses.replace(gpu_profile(3), device="cpu")
    assert all(not option.policy.startswith("offload")
               for s in range(3) for option in ChainCosts(profile).menu(s))
    plan = gradckpt.solve(profile, minimum_peak_bytes(profile), "optimal")
    assert "offload: not offered: the model runs on the CPU" in str(plan)
    assert not any(b.offloaded for b in plan.block_bytes)


def test_on_a_gpu_without_a_link_figure_offload_is_not_offered() -> None:
    profile = gpu_profile(2, link=None)
    link, why = offload_offer(profile)
    assert link is None and f"profile.notes[{HOST_LINK!r}]" in why
    assert [o.policy for o in ChainCosts(profile).menu(0)] == [MM]


def test_on_a_gpu_each_choice_is_offered_kept_and_offloaded() -> None:
    menu = ChainCosts(gpu_profile(2)).menu(0)
    assert [o.policy for o in menu] == [MM, "offload-ops:aten.mm"]
    assert menu[1].kept_bytes == 0


def test_a_fast_link_makes_offloading_the_answer_where_keeping_does_not_fit() -> None:
    # Four identical blocks, each keeping 30 bytes of matmul outputs under the choice; the
    # budget is the least peak with offloading: every block offloads, nothing is recomputed
    # more than the choice says.
    block = gpu_block("h.0")
    profile = Profile([dataclasses.replace(block, name=f"h.{i}") for i in range(4)], 0, FIXED,
                      10.0, device="cuda", notes={HOST_LINK: 1e12})
    profile.peak_bytes = FIXED + simulate(profile, [])[0]
    offload_all = [Segment(i, i, policy="offload-ops:aten.mm") for i in range(4)]
    budget = FIXED + simulate(profile, offload_all)[0]
    plan = gradckpt.solve(profile, budget, "optimal")
    assert plan.predicted_peak_bytes <= budget
    assert plan.predicted_extra_seconds <= simulate(profile, offload_all)[1] + 1e-9
    assert sum(b.offloaded for b in plan.block_bytes) > 0
    assert "offload: offered over a host link of 1000.0 GB/s" in str(plan)
    # With the host allowed fewer bytes than that plan offloads, it is planned without.
    capped = dataclasses.replace(profile, notes={**profile.notes, HOST_CAP: 1})
    try:
        plan = gradckpt.solve(capped, budget, "optimal")
    except gradckpt.BudgetError:
        return  # without offloading nothing fits this budget: refused, never over the cap
    assert sum(b.offloaded for b in plan.block_bytes) <= 1


# ------------------------------------------------------------------------------------------
# The DP with offload options against brute force
# ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(12))
def test_optimal_with_offload_equals_brute_force(seed: int) -> None:
    rng = random.Random(seed)
    n = rng.randint(1, 3)
    profile = gpu_profile(n, link=rng.choice([5.0, 50.0, 1e4]), seed=seed)
    outcomes = [simulate(profile, plan) for plan in
                all_plans(0, n - 1, (None, MM, "offload-ops:aten.mm"))]
    least = min(peak for peak, _ in outcomes)
    assert minimum_peak_bytes(profile) == FIXED + least
    for room in sorted({peak for peak, _ in outcomes}):
        best = min(seconds for peak, seconds in outcomes if peak <= room)
        plan = gradckpt.solve(profile, FIXED + room, "optimal")
        assert plan.predicted_peak_bytes <= FIXED + room
        assert plan.predicted_extra_seconds == pytest.approx(best, abs=1e-9)


# ------------------------------------------------------------------------------------------
# Estimates, JSON, the engine on the CPU
# ------------------------------------------------------------------------------------------


def test_an_estimate_for_a_gpu_offers_offload_over_its_pcie_link() -> None:
    model = tiny_llama(2)
    sample = causal_sample()
    predicted = gradckpt.estimate(model, sample, device="h100-80gb")
    assert predicted.notes[HOST_LINK] == pytest.approx(51.2e9)  # Gen5, one way, 80%
    assert offload_offer(predicted)[0] == pytest.approx(51.2e9)
    here = gradckpt.estimate(model, sample, device="this")
    assert offload_offer(here)[0] is None


def test_a_plan_with_offloaded_blocks_round_trips_through_json() -> None:
    profile = gpu_profile(3, link=1e12)
    plan = gradckpt.solve(profile, minimum_peak_bytes(profile), "optimal")
    again = Plan.from_json(plan.to_json())
    assert again == plan and again.block_bytes == block_bytes(profile, plan.segments)


def test_an_offloading_plan_trains_as_the_plain_model_on_the_cpu() -> None:
    # On the CPU the engine keeps what it would offload: gradients bit for bit.
    model = tiny_llama(3)
    sample = causal_sample()
    plain = _gradients(model, sample)
    blocks = len(gradckpt.find_blocks(model))
    plan = Plan("optimal", None, [Segment(i, i, policy="offload-ops:aten.mm,attention")
                                  for i in range(blocks)], 0, 0.0, 0.0,
                [name for name, _ in gradckpt.find_blocks(model)])
    gradckpt.apply(model, plan)
    try:
        planned = _gradients(model, sample)
    finally:
        gradckpt.disable(model)
    assert plain.keys() == planned.keys()
    assert all(torch.equal(plain[name], planned[name]) for name in plain)


def _gradients(model: torch.nn.Module, sample: dict) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)
    model(**sample).loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def test_the_memory_table_counts_offloaded_outputs_in_host_memory_not_the_device() -> None:
    # A plan offloading every block's kept outputs: "what takes the memory" must not count
    # them among the activations the device keeps (an 8B LoRA estimate for a 24 GB card once
    # showed activations at 105% of its own peak), and lists them apart, outside the peak.
    from gradckpt.measure.memory_parts import (
        OFFLOADED,
        PLAN_ACTIVATIONS,
        memory_parts,
        retained_activation_bytes,
    )
    from gradckpt.report import memory_breakdown_table

    block = gpu_block("h.0")
    profile = Profile([dataclasses.replace(block, name=f"h.{i}") for i in range(4)], 0, FIXED,
                      10.0, device="cuda", notes={HOST_LINK: 1e12})
    profile.peak_bytes = FIXED + simulate(profile, [])[0]
    offload_all = [Segment(i, i, policy="offload-ops:aten.mm") for i in range(4)]
    keep_all = [Segment(i, i, policy="save-ops:aten.mm") for i in range(4)]
    plan = Plan("optimal", None, offload_all, FIXED + simulate(profile, offload_all)[0], 0.0,
                0.0, block_names=[b.name for b in profile.blocks])
    model = torch.nn.Linear(2, 2)
    parts = dict(memory_parts(model, profile, plan).parts)
    kept_choice = block.op_choices[0].kept_bytes
    assert parts[OFFLOADED] == 4 * kept_choice
    inputs = 4 * block.input_bytes
    assert parts[PLAN_ACTIVATIONS] == inputs  # the segments' inputs only
    assert retained_activation_bytes(profile, dataclasses.replace(plan, segments=keep_all)) == (
        inputs + 4 * kept_choice)
    table = memory_breakdown_table(memory_parts(model, profile, plan), 10**6)
    offloaded_row = next(line for line in table.splitlines() if line.startswith(OFFLOADED))
    assert offloaded_row.split()[-2:] == ["outside", "host"]
