"""``gradckpt.side_by_side``: wrong input is a clear ``UsageError`` before anything runs, and the
model is left as it was."""

from __future__ import annotations

import pytest
import torch

import gradckpt
from gradckpt.side_by_side import compare_plans, plans_at_shares, time_side_by_side
from gradckpt.toy_models import mlp_chain

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread


def test_compare_plans_needs_a_plan_and_leaves_the_model_alone() -> None:
    model = mlp_chain(2, 8)
    before = {name: p.clone() for name, p in model.named_parameters()}
    with pytest.raises(gradckpt.UsageError, match="compare_plans needs at least one plan"):
        compare_plans(model, torch.randn(4, 8), {})
    assert gradckpt.get_plan(model) is None
    for name, parameter in model.named_parameters():
        assert torch.equal(parameter, before[name]) and parameter.grad is None, name


def test_plans_at_shares_needs_a_strategy_that_reads_a_budget() -> None:
    model = mlp_chain(2, 8)
    measured = gradckpt.profile(model, torch.randn(4, 8), repeats=1)
    with pytest.raises(gradckpt.UsageError, match="budget-driven strategy, not 'sqrt'"):
        plans_at_shares(measured, [0.7], strategy="sqrt")


def test_time_side_by_side_needs_a_step() -> None:
    with pytest.raises(gradckpt.UsageError, match="needs at least one step"):
        time_side_by_side({}, 1)
