"""One plan for all ranks (issue 16): two gloo processes that time the model differently get
rank 0's plan, and an infeasible budget fails on both instead of leaving one waiting."""

from __future__ import annotations

import dataclasses
import sys

import pytest
import torch
from gloo_ranks import answer, join_group, run_ranks

import gradckpt

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow




def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=6, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(config)


def skewed(profile: gradckpt.Profile, rank: int) -> gradckpt.Profile:
    """Rank 1 measures its even blocks 20 times slower: a slow, noisy rank."""
    if rank == 0:
        return profile
    blocks = [
        dataclasses.replace(
            block, **{field: getattr(block, field) * 20 for field in (
                "forward_seconds", "backward_seconds", "checkpointed_extra_seconds",
                "policy_extra_seconds")})
        if index % 2 == 0 else block
        for index, block in enumerate(profile.blocks)
    ]
    return dataclasses.replace(profile, blocks=blocks)


BUDGETS = ("60%", "1KiB")  # one that rank 0's plan meets, one that no plan meets


def worker(rank: int, port: int, out: str, budgets: tuple[str, ...]) -> None:
    """``gradckpt.enable`` on a fresh model for each budget, in one process group (starting
    ranks is most of the cost); per budget, the plan and what this rank would choose alone, or
    the error."""
    join_group(rank, port)  # on one thread
    # The module, not the function gradckpt.enable that its package attribute names.
    enable_module = sys.modules["gradckpt.enable"]
    measure = enable_module.profile
    alone: list = []

    def profile_skewed(*args, **kwargs):
        measured = skewed(measure(*args, **kwargs), rank)
        try:  # what this rank would choose on its own
            alone.append(gradckpt.solve(measured, int(0.6 * measured.peak_bytes)).to_json())
        except gradckpt.BudgetError:
            alone.append(None)
        return measured

    enable_module.profile = profile_skewed
    ids = torch.randint(0, 256, (2, 64), generator=torch.Generator().manual_seed(1))
    results = {}
    for budget in budgets:
        alone.clear()
        try:
            plan = gradckpt.enable(tiny_llama(), {"input_ids": ids, "labels": ids},
                                   budget=budget)
            results[budget] = {"plan": plan.to_json(), "alone": alone[0]}
        except gradckpt.BudgetError as error:
            results[budget] = {"error": str(error), "minimum": error.minimum_bytes}
    answer(out, rank, results)


@pytest.fixture(scope="module")
def by_budget(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[dict, dict]]:
    """Per budget, the two ranks' answers: one launch of the ranks for every test here."""
    first, second = run_ranks(worker, tmp_path_factory.mktemp("ranks"), BUDGETS)
    return {budget: (first[budget], second[budget]) for budget in BUDGETS}


def test_ranks_that_time_differently_get_rank_0s_plan(by_budget: dict) -> None:
    first, second = by_budget["60%"]
    assert first["alone"] != second["alone"]  # on their own they would disagree
    assert first["plan"] == second["plan"] == first["alone"]


def test_an_infeasible_budget_fails_on_every_rank(by_budget: dict) -> None:
    first, second = by_budget["1KiB"]
    assert "error" in first and "error" in second
    assert first["minimum"] == second["minimum"]
    assert "rank 0" in second["error"]
    for rank in (first, second):  # no retry that would solve on one rank alone
        assert "error.profile" not in rank["error"] and "on every rank" in rank["error"]
