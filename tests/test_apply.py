"""``apply`` and ``disable``: a plan installed on a model changes what is saved for backward and
nothing else (names, state_dict keys, outputs, gradients), and comes off completely."""

from __future__ import annotations

import copy

import pytest
import torch

import gradckpt
from gradckpt import UsageError
from gradckpt.plan import Plan, Segment
from gradckpt.toy_models import GPTConfig, TinyGPT

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

CONFIG = GPTConfig(n_layer=4, n_embd=32, n_head=2, block_size=16, dropout=0.1)
NAMES = [f"transformer.h.{i}" for i in range(CONFIG.n_layer)]


def tiny_gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(CONFIG)


def plan_with(segments: list[Segment], names: list[str] = NAMES) -> Plan:
    return Plan("test", None, segments, 0, 0.0, 0.0, block_names=list(names))


def step(model: TinyGPT) -> tuple[torch.Tensor, list[torch.Tensor]]:
    idx = torch.randint(0, CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    torch.manual_seed(3)
    loss = model(idx, targets=idx)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def hook_counts(model: TinyGPT) -> list[int]:
    return [len(b._forward_pre_hooks) + len(b._forward_hooks) for b in model.transformer.h]


PLANS = {
    "none": [],
    "every-layer": [Segment(i, i) for i in range(4)],
    "sqrt": [Segment(0, 1), Segment(2, 3)],
    "nested": [Segment(0, 3, [Segment(0, 1), Segment(2, 3)])],
    "policy": [Segment(0, 0, policy="save-matmuls"), Segment(1, 3)],
}


@pytest.mark.parametrize("segments", PLANS.values(), ids=PLANS.keys())
def test_applied_plan_trains_exactly_like_the_plain_model(segments: list[Segment]) -> None:
    expected_loss, expected_grads = step(tiny_gpt())
    model = tiny_gpt()
    keys = list(model.state_dict())
    gradckpt.apply(model, plan_with(segments))
    assert list(model.state_dict()) == keys
    loss, grads = step(model)
    assert torch.equal(loss, expected_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads, strict=True))


def test_disable_removes_everything_and_apply_replaces() -> None:
    model = tiny_gpt()
    plain_hooks = hook_counts(model)
    gradckpt.apply(model, plan_with(PLANS["sqrt"]))
    assert hook_counts(model) != plain_hooks
    gradckpt.apply(model, plan_with(PLANS["every-layer"]))  # replaces, does not stack
    assert hook_counts(model) == [2, 2, 2, 2]
    gradckpt.disable(model)
    assert hook_counts(model) == plain_hooks
    gradckpt.disable(model)  # a second disable is a no-op


def test_plan_none_installs_nothing() -> None:
    model = tiny_gpt()
    gradckpt.apply(model, plan_with([]))
    assert hook_counts(model) == [0, 0, 0, 0]


def test_a_plan_for_another_model_is_a_usage_error() -> None:
    other = copy.deepcopy(plan_with(PLANS["sqrt"], names=["layers.0", "layers.1", "layers.2"]))
    with pytest.raises(UsageError, match="made for another model"):
        gradckpt.apply(tiny_gpt(), other)


def test_policy_with_children_is_refused() -> None:
    plan = plan_with([Segment(0, 3, [Segment(0, 1)], policy="save-matmuls")])
    with pytest.raises(UsageError, match="policy only on segments without children"):
        gradckpt.apply(tiny_gpt(), plan)


def test_policy_inside_another_segment_is_refused() -> None:
    plan = plan_with([Segment(0, 3, [Segment(0, 0, policy="save-matmuls")])])
    with pytest.raises(UsageError, match="nested in segment 0-3; put policies on top-level"):
        gradckpt.apply(tiny_gpt(), plan)


def test_apply_needs_a_plan() -> None:
    with pytest.raises(UsageError, match="needs a gradckpt.Plan"):
        gradckpt.apply(tiny_gpt(), "sqrt")


class _Config:
    use_cache = True


@pytest.mark.parametrize("segments", [[], [Segment(0, 1)]], ids=["none", "one-segment"])
def test_caches_are_off_in_training_steps_while_any_plan_is_applied(
    segments: list[Segment],
) -> None:
    """As profile measured the step: with Hugging Face's use_cache off in every forward pass
    with gradients, for the plan "none" too (a T5 training step holds 1.7% more with it on);
    as configured without gradients (generate())."""
    model = tiny_gpt()
    config = model.transformer.wte.config = _Config()  # TinyGPT's own config has no use_cache
    seen = []
    model.transformer.h[0].register_forward_pre_hook(
        lambda module, args: seen.append(config.use_cache))
    gradckpt.apply(model, plan_with(segments))
    idx = torch.randint(0, 512, (2, 16))
    model(idx, targets=idx)
    with torch.no_grad():
        model(idx, targets=idx)
    assert seen == [False, True]
    assert config.use_cache is True
    gradckpt.disable(model)
    assert not model._forward_pre_hooks and not model._forward_hooks
    model.transformer.h[0]._forward_pre_hooks.clear()  # the test's own
    assert hook_counts(model) == [0] * CONFIG.n_layer
