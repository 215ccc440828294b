"""A budget no plan meets: the error says the smallest that works, what the least plan's peak
is made of, what would lower it, and carries the profile, so the retry measures nothing again.
And ``solve`` needs no budget for the strategies that take none."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_models import LoRANet, assert_identical, assert_trains_as_plain, gradients, parameters
from hf_models import causal_sample, tiny_llama
from torch import nn

import gradckpt
from gradckpt import BudgetError, UsageError
from gradckpt.measure import loss_of, measure_peak_bytes
from gradckpt.profile_types import BlockProfile
from gradckpt.solvers.infeasible import explain_infeasible

ALLOWANCE = 1.03  # allocator noise allowed on a measured peak

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread


def chain_profile(head_bytes: int = 0) -> gradckpt.Profile:
    blocks = [BlockProfile(f"h.{i}", 10, 10, 50, True, 1.0, 2.0) for i in range(16)]
    return gradckpt.Profile(blocks, 2000, 1000, 48.0, head_bytes=head_bytes)


@pytest.mark.parametrize("strategy", ["none", "every-layer", "sqrt"])
def test_fixed_strategies_need_no_budget(strategy: str) -> None:
    assert gradckpt.solve(chain_profile(), strategy=strategy).strategy == strategy


@pytest.mark.parametrize("strategy", ["optimal", "chen-greedy"])
def test_budget_driven_strategies_ask_for_one(strategy: str) -> None:
    with pytest.raises(UsageError, match="pass a budget"):
        gradckpt.solve(chain_profile(), strategy=strategy)


def test_the_error_breaks_down_the_least_peak_at_its_moment() -> None:
    profile = chain_profile(head_bytes=5000)  # the logits dwarf the rest
    with pytest.raises(BudgetError) as caught:
        gradckpt.solve(profile, 1500)
    message = str(caught.value)
    assert "raise the budget to at least" in message
    assert "comes at the output head" in message
    # largest first: the logits, then the parameters, then the activations
    assert message.index("the logits") < message.index("memory held all step")
    assert "chunks" in message  # the lever for logits
    assert caught.value.profile is profile
    retried = gradckpt.solve(caught.value.profile, caught.value.minimum_bytes)
    assert retried.predicted_peak_bytes <= caught.value.minimum_bytes


def with_parameters(parameter_bytes: int, gradient_bytes_per_block: int) -> gradckpt.Profile:
    profile = chain_profile()
    profile.fixed_bytes = parameter_bytes
    profile.blocks = [dataclasses.replace(block, gradient_bytes=gradient_bytes_per_block)
                      for block in profile.blocks]
    return profile


def least_plan(profile: gradckpt.Profile) -> list:
    with pytest.raises(BudgetError) as caught:
        gradckpt.solve(profile, 1)
    return gradckpt.solve(profile, caught.value.minimum_bytes).segments


def test_parameters_bound_steps_name_the_parameter_levers() -> None:
    profile = with_parameters(10**6, gradient_bytes_per_block=10**4)
    text = explain_infeasible(profile, least_plan(profile))
    assert "train adapters on a frozen base" in text and "FSDP2" in text


def test_a_frozen_base_is_not_told_to_freeze_its_base() -> None:
    profile = with_parameters(10**6, gradient_bytes_per_block=100)
    text = explain_infeasible(profile, least_plan(profile))
    assert "mostly frozen already" in text and "QLoRA" in text


def test_a_fixed_strategy_over_budget_points_at_optimal() -> None:
    with pytest.raises(BudgetError, match="strategy='optimal' may reach less") as caught:
        gradckpt.solve(chain_profile(), 1100, "sqrt")
    assert caught.value.minimum_bytes == gradckpt.solve(chain_profile(), strategy="sqrt"
                                                        ).predicted_peak_bytes


def test_the_optimizer_state_is_named_and_the_retry_holds_it() -> None:
    profile = chain_profile()
    profile.fixed_bytes += 400  # the state is held all step: part of fixed_bytes
    profile.optimizer_state_bytes = 400
    profile.notes["optimizer"] = "AdamW"
    with pytest.raises(BudgetError) as caught:
        gradckpt.solve(profile, 1450)
    message = str(caught.value)
    assert "the optimizer's state (AdamW) 400 B" in message
    assert "error.minimum_bytes" in message  # the profile holds the state: the retry does too
    retried = gradckpt.solve(caught.value.profile, caught.value.minimum_bytes)
    assert retried.predicted_peak_bytes == caught.value.minimum_bytes


def plain_step(model: nn.Module, sample) -> tuple[int, dict]:
    """The step as fine-tuning scripts write it: the output alive through backward."""
    model.zero_grad(set_to_none=True)

    def run() -> None:
        torch.manual_seed(3)
        output = model(**sample) if isinstance(sample, dict) else model(sample)
        loss_of(output).backward()

    tensors = sample.values() if isinstance(sample, dict) else [sample]
    return measure_peak_bytes(run, model, *tensors), gradients(model)


def lora_llama() -> nn.Module:
    peft = pytest.importorskip("peft")
    model = tiny_llama(layers=4, vocab_size=2048)
    torch.manual_seed(1)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))


def hand_lora() -> nn.Module:
    torch.manual_seed(0)
    return LoRANet(width=64, depth=6)


CASES = {
    "llama": (lambda: tiny_llama(layers=4, vocab_size=2048), lambda: causal_sample(2048, 2, 64)),
    "peft-lora-llama": (lora_llama, lambda: causal_sample(2048, 2, 64)),
    "hand-lora": (hand_lora, lambda: torch.randn(32, 64, generator=torch.Generator()
                                                  .manual_seed(2))),
}


@pytest.mark.parametrize("case", CASES)
def test_retrying_from_the_error_measures_nothing_and_trains_identically(case: str) -> None:
    build, make_sample = CASES[case]
    pytest.importorskip("transformers")
    sample = make_sample()
    plain_peak, plain_gradients = plain_step(build(), sample)
    model = build()
    before = parameters(model)
    with pytest.raises(BudgetError) as caught:
        gradckpt.enable(model, sample, budget=1024, optimizer="none")  # plain_step steps none
    error = caught.value
    assert_identical(parameters(model), before)  # left exactly as it was
    assert not any(module._forward_pre_hooks or module._forward_hooks
                   for module in model.modules())
    assert "The least plan's peak" in str(error)

    calls = []
    model.register_forward_pre_hook(lambda *_: calls.append(1))
    plan = gradckpt.solve(error.profile, error.minimum_bytes)
    gradckpt.apply(model, plan)
    assert calls == []  # nothing measured again
    assert plan.segments  # the least plan checkpoints
    peak, checkpointed_gradients = plain_step(model, sample)
    assert peak <= error.minimum_bytes * ALLOWANCE, (peak, error.minimum_bytes)
    assert peak < plain_peak
    assert_trains_as_plain(plan, checkpointed_gradients, plain_gradients)
    gradckpt.disable(model)


def test_a_logits_bound_language_model_says_so() -> None:
    """The case a newcomer meets first: a wide vocabulary, where "60%" is below any plan that
    keeps the logits whole. The error says so and names the lever gradckpt pulls itself."""
    pytest.importorskip("transformers")
    model = tiny_llama(layers=2, vocab_size=8192)
    with pytest.raises(BudgetError) as caught:
        gradckpt.enable(model, causal_sample(8192, 2, 64), budget="60%", optimizer="none",
                        output_head="plain")
    message = str(caught.value)
    assert "at the output head" in message
    listed = message.split("comes at the output head:")[1]
    assert listed.lstrip().startswith("the logits"), message  # the largest item, named first
    assert "output_head='auto'" in " ".join(message.split()), message
    # Allowed to chunk the loss, the same budget fits.
    plan = gradckpt.enable(model, causal_sample(8192, 2, 64), budget="60%", optimizer="none")
    assert plan.head_chunks > 1
    gradckpt.disable(model)


def test_a_logits_bound_model_whose_loss_gradckpt_cannot_chunk_says_how_to_let_it() -> None:
    """A loss computed from the logits outside the model: the error points to
    gradckpt.linear_cross_entropy."""
    pytest.importorskip("transformers")
    model = tiny_llama(layers=2, vocab_size=8192)
    sample = causal_sample(8192, 2, 64)
    targets = sample.pop("labels")

    def loss_fn(output):
        logits = output.logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    with pytest.raises(BudgetError) as caught:
        gradckpt.enable(model, sample, budget="60%", optimizer="none", loss_fn=loss_fn)
    message = " ".join(str(caught.value).split())
    assert caught.value.profile.chunked_heads == []
    assert "gradckpt.linear_cross_entropy(hidden, head, targets)" in message, message


@pytest.mark.parametrize("estimate", [[], ["--estimate", "--device", "l4"]],
                         ids=["measured", "estimated"])
def test_the_command_line_explains_and_names_the_budget_to_rerun_with(estimate, capsys) -> None:
    from gradckpt.cli import main

    command = ["plan", "mlp-chain", "--batch", "2", "--seq", "4", *estimate]
    assert main([*command, "--budget", "1KiB"]) == 1
    stderr = capsys.readouterr().err
    assert "The least plan's peak" in stderr and "error.profile" not in stderr
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("gradckpt: error: budget 1.00 KiB is below"), last
    rerun = last.split("rerun with --budget ")[1].split()[0]
    assert main([*command, "--budget", rerun]) == 0
