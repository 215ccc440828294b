"""Issue 22: an infeasible budget's explanation fits the step it explains, and "auto" on an
estimate is the target device's memory.

The explanation names each part of the least plan's peak for what it holds (the optimizer's
state and accumulated gradients apart from the parameters; ``optimizer.step()`` as a moment of
its own) and offers only the levers that apply: no bf16 for weights in bf16, no smaller batch
at batch 1, no ``keep_output=False`` for a loop that drops the output already. Hand-made
profiles pin each case; one real model checks what ``gradckpt.enable`` measures.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from hf_models import causal_sample, tiny_llama

import gradckpt
from gradckpt import BudgetError
from gradckpt import budget as budget_module
from gradckpt.profile_types import BlockProfile
from gradckpt.solvers.infeasible import RETRY_WITHOUT_MEASURING, budget_message
from gradckpt.toy_models import mlp_chain

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

GIB = 2**30


def step(fixed_bytes: int = 1000, gradient_bytes: int = 0, **fields) -> gradckpt.Profile:
    """A chain of 16 equal blocks; ``fields`` are Profile fields, or notes by their names."""
    notes = {name: fields.pop(name) for name in list(fields) if name not in
             {f.name for f in dataclasses.fields(gradckpt.Profile)}}
    blocks = [BlockProfile(f"h.{i}", 10, 10, 50, True, 1.0, 2.0, gradient_bytes=gradient_bytes)
              for i in range(16)]
    return gradckpt.Profile(blocks, 2000, fixed_bytes, 48.0, notes=notes, **fields)


def refused(profile: gradckpt.Profile) -> BudgetError:
    with pytest.raises(BudgetError) as caught:
        gradckpt.solve(profile, 1)
    return caught.value


def explained(profile: gradckpt.Profile) -> str:
    return refused(profile).explanation


# 1. Each part named for what it holds
# --------------------------------------------------------------------------------------------


def test_the_optimizer_state_is_a_part_of_its_own_named_for_the_optimizer() -> None:
    text = explained(step(fixed_bytes=5000, optimizer_state_bytes=4000, head_bytes=600,
                          optimizer="AdamW"))
    assert "the optimizer's state (AdamW) 3.91 KiB" in text
    assert "the parameters, buffers and batch 1000 B" in text
    assert "memory held all step" not in text  # the state is held all step too: no such label
    assert text.index("the optimizer's state") < text.index("the logits")  # largest first
    assert "use an 8-bit optimizer (bitsandbytes' AdamW8bit), one with less state" in text


def test_accumulated_gradients_are_a_part_of_their_own() -> None:
    text = explained(step(fixed_bytes=6000, accumulated_gradient_bytes=5000,
                          gradient_bytes=300))
    assert "gradients held between micro-batches 4.88 KiB" in text
    assert "the parameters, buffers and batch 1000 B" in text
    assert "train adapters on a frozen base (LoRA) so that fewer gradients exist" in text


def test_ddp_buckets_are_a_part_of_their_own() -> None:
    text = explained(step(fixed_bytes=6000, ddp_bucket_bytes=5000, gradient_bytes=300))
    assert "DDP's buckets (a copy of the trainable gradients) 4.88 KiB" in text
    assert "the parameters, buffers and batch 1000 B" in text
    assert ("train adapters on a frozen base (LoRA) so that fewer gradients exist or shard the "
            "model with FSDP2 instead of DDP") in text


def test_without_state_or_accumulation_the_label_is_as_before() -> None:
    text = explained(step(head_bytes=600))
    assert "memory held all step (parameters, buffers, the batch) 1000 B" in text
    assert "optimizer" not in text


def test_a_peak_at_the_optimizer_step_says_no_plan_changes_it_and_names_its_levers() -> None:
    text = explained(step(fixed_bytes=1500, optimizer_state_bytes=500, optimizer_step_bytes=3000,
                          gradient_bytes=100, optimizer="AdamW"))
    assert text.startswith("The least plan's peak, 4.39 KiB, comes at optimizer.step(): every "
                           "gradient, the model's output your loop holds and the optimizer's "
                           "temporaries 2.93 KiB; the parameters, buffers and batch 1000 B; the "
                           "optimizer's state (AdamW) 500 B."), text
    assert "none are alive then; to lower this peak" in text
    for lever in ("8-bit optimizer", "none (SGD)", "train adapters on a frozen base (LoRA)",
                  "shard the gradients and the optimizer's state across GPUs (FSDP2"):
        assert lever in text, lever


def test_the_optimizer_step_of_a_loop_that_drops_the_output_does_not_count_one() -> None:
    text = explained(step(optimizer_step_bytes=3000, optimizer_state_bytes=500,
                          fixed_bytes=1500, keep_output=False, previous_output_bytes=0))
    assert "every gradient and the optimizer's temporaries 2.93 KiB" in text
    assert "del out" not in text


def test_the_optimizer_step_of_a_loop_holding_the_output_is_told_to_let_it_go() -> None:
    text = explained(step(optimizer_step_bytes=3000, optimizer_state_bytes=500,
                          fixed_bytes=1500, keep_output=True, previous_output_bytes=100))
    assert "let go of the model's output before optimizer.step() (del out after backward)" in text


def test_a_stateless_optimizer_is_told_of_gradients_only() -> None:
    text = explained(step(optimizer_step_bytes=3000, fixed_bytes=1500, optimizer="SGD",
                          keep_output=False))
    assert "8-bit" not in text and "state" not in text.split("none are alive then")[1]
    assert "shard the gradients across GPUs (FSDP2" in text


def test_the_previous_steps_output_is_told_apart_from_the_activations() -> None:
    profile = step(previous_output_bytes=2000, keep_output=True)
    error = refused(profile)
    assert "comes in the forward pass: the previous step's output" in error.explanation
    assert "let go of the last step's output before the next forward" in error.explanation


# 2. Levers only where they apply
# --------------------------------------------------------------------------------------------


def parameters_bound(dtype: str, trainable_share: float) -> gradckpt.Profile:
    return step(fixed_bytes=10**6, gradient_bytes=10, parameter_dtypes={dtype: 10**6},
                trainable_parameter_bytes=int(trainable_share * 10**6))


def test_fp32_weights_are_told_to_hold_them_in_bf16() -> None:
    text = explained(parameters_bound("torch.float32", 1.0))
    assert "hold the weights in bf16" in text and "train adapters" in text


def test_bf16_weights_are_not_told_to_hold_them_in_bf16() -> None:
    text = explained(parameters_bound("torch.bfloat16", 1.0))
    assert "bf16" not in text
    assert "with that base in 8-bit or 4-bit (QLoRA)" in text and "FSDP2" in text


def test_a_frozen_bf16_base_is_told_8_or_4_bits() -> None:
    text = explained(parameters_bound("torch.float16", 0.01))
    assert "mostly frozen already: hold the frozen base in 8-bit or 4-bit (QLoRA)" in text
    assert "bf16" not in text and "train adapters" not in text


def test_a_frozen_4_bit_base_is_told_only_to_shard() -> None:
    text = explained(parameters_bound("torch.uint8", 0.01))  # bitsandbytes packs 4 bits in uint8
    assert "in 8 bits or fewer: shard them across GPUs (FSDP2" in text
    assert "QLoRA" not in text and "bf16" not in text


def test_a_frozen_base_is_not_told_to_train_adapters_at_the_optimizer_step() -> None:
    text = explained(step(fixed_bytes=1500, optimizer_state_bytes=100, optimizer_step_bytes=3000,
                          parameter_dtypes={"torch.bfloat16": 1000},
                          trainable_parameter_bytes=10, optimizer="AdamW"))
    assert "train adapters" not in text and "FSDP2" in text


def test_an_8_bit_optimizer_is_not_told_to_use_an_8_bit_optimizer() -> None:
    text = explained(step(fixed_bytes=5000, optimizer_state_bytes=4000, optimizer="AdamW8bit"))
    assert "8-bit optimizer" not in text
    assert "use an optimizer with less state (Adafactor) or none (SGD)" in text


@pytest.mark.parametrize("shape", ["logits", "activations"])
def test_batch_1_is_not_told_to_use_a_smaller_batch(shape: str) -> None:
    fields = {"head_bytes": 5000} if shape == "logits" else {"fixed_bytes": 10}
    text = explained(step(batch_size=1, **fields))
    assert "smaller batch" not in text
    assert "shorter sequences (the batch is 1 already)" in text


@pytest.mark.parametrize("batch_size", [8, None])  # None: the profile does not say
def test_a_larger_batch_is_told_to_use_a_smaller_batch(batch_size: int | None) -> None:
    assert "or a smaller batch" in explained(step(head_bytes=5000, batch_size=batch_size))


def test_a_loop_that_drops_the_output_is_not_told_to_drop_it() -> None:
    assert "keep_output=False" not in explained(step(head_bytes=5000, keep_output=False))
    assert "keep_output=False" in explained(step(head_bytes=5000, keep_output=True))
    assert "keep_output=False" in explained(step(head_bytes=5000))  # unknown: told


# 3. The error itself
# --------------------------------------------------------------------------------------------


def test_the_error_keeps_its_attributes_and_its_message_is_budget_message() -> None:
    profile = step(fixed_bytes=5000, optimizer_state_bytes=4000, optimizer="AdamW")
    error = refused(profile)
    assert error.profile is profile
    assert error.minimum_bytes == gradckpt.solve(profile, error.minimum_bytes
                                                 ).predicted_peak_bytes
    headline = str(error).partition("\n")[0]
    assert str(error) == budget_message(headline, error.explanation, RETRY_WITHOUT_MEASURING)


def test_a_real_step_bound_by_its_optimizer_says_so() -> None:
    """A Llama with a tiny vocabulary and short sequences, full fine-tuning with AdamW: the
    optimizer's state and step, not the activations or logits, set the least peak."""
    pytest.importorskip("transformers")
    model = tiny_llama(layers=2, vocab_size=256)
    with pytest.raises(BudgetError) as caught:
        gradckpt.enable(model, causal_sample(256, 1, 8), budget=1024, optimizer="adamw")
    text = caught.value.explanation
    assert "comes at optimizer.step()" in text
    assert "the optimizer's state (AdamW)" in text
    assert "smaller batch" not in text and "bf16" not in text.split("to lower")[0]


# 4. "auto" on an estimate is the target's memory
# --------------------------------------------------------------------------------------------


@pytest.fixture
def this_machine(monkeypatch) -> list:
    """``available_bytes`` answering 5 GiB and recording each device it is asked about."""
    asked: list = []

    def available(device=None):
        asked.append(device)
        return 5 * GIB

    monkeypatch.setattr(budget_module, "available_bytes", available)
    return asked


def test_auto_on_an_estimate_is_the_target_devices_memory(this_machine) -> None:
    predicted = gradckpt.estimate(mlp_chain(4, 8), torch.randn(16, 8), device="rtx4090")
    plan = gradckpt.solve(predicted, "auto")
    assert plan.budget_bytes == predicted.notes["device_usable_bytes"] == 22 * GIB
    assert this_machine == []  # this machine's memory was never read


def test_auto_on_a_measured_profile_is_what_its_device_has_free(this_machine) -> None:
    measured = step()
    assert gradckpt.solve(measured, "auto").budget_bytes == 5 * GIB
    assert this_machine == ["cpu"]


def test_the_command_line_reads_auto_as_solve_does(this_machine, tmp_path) -> None:
    from gradckpt.cli import main

    path = tmp_path / "plan.json"
    assert main(["plan", "mlp-chain", "--batch", "2", "--seq", "4", "--estimate", "--device",
                 "l4", "--budget", "auto", "--json", str(path)]) == 0
    report = json.loads(path.read_text())
    assert report["plan"]["budget_bytes"] == report["device_usable_bytes"] == 22 * GIB


def test_a_plan_that_would_fit_the_target_is_offered_as_budget_auto() -> None:
    from gradckpt.cli.estimate import fit_line
    from gradckpt.predict.devices import DEVICES

    profile = step(device_usable_bytes=1300, estimated_for="l4-24gb")
    line = fit_line(profile, gradckpt.solve(profile, strategy="none"), DEVICES["l4-24gb"])
    assert line.startswith("does not fit: ")
    assert "a plan does fit: --budget auto (the 1.27 KiB usable; the least any plan" in line
    assert gradckpt.solve(profile, "auto").predicted_peak_bytes <= 1300  # as offered
