"""``gradckpt.estimate``: the profile of a step predicted on fake tensors (issue 15).

Checked against ``profile`` on the same models (bytes to the byte where the model takes the
same code path on fake tensors), on a model that only exists on the meta device, and for what
it must leave alone: the model, and this process's memory.
"""

from __future__ import annotations

import resource
import time
from pathlib import Path

import pytest
import torch

import gradckpt
from gradckpt.cli.model_lookup import build_known_model
from gradckpt.cost import as_planned, simulate
from gradckpt.integrations.hf_families import FAMILIES, family, hf_model
from gradckpt.predict.clock import ModeledClock


@pytest.mark.slow
@pytest.mark.parametrize("case", FAMILIES, ids=lambda case: case.name)
def test_estimate_and_profile_agree_on_bytes(case) -> None:
    sample = case.sample()
    measured = gradckpt.profile(case.fresh(), sample, loss_fn=case.loss_fn, repeats=1)
    model = case.fresh()
    before = {name: p.detach().clone() for name, p in model.state_dict().items()}
    # For this machine: on a GPU target, attention runs the GPU's kernel (test_estimate_attention).
    predicted = gradckpt.estimate(model, sample, loss_fn=case.loss_fn, device="this")
    assert [b.name for b in predicted.blocks] == [b.name for b in measured.blocks]
    for ours, theirs in zip(predicted.blocks, measured.blocks, strict=True):
        assert ours.saved_bytes == theirs.saved_bytes, ours.name
        assert ours.input_bytes == theirs.input_bytes, ours.name
        assert ours.checkpointed_forward_peak_bytes == theirs.checkpointed_forward_peak_bytes
        assert ours.checkpointed_backward_peak_bytes == theirs.checkpointed_backward_peak_bytes
    assert predicted.peak_bytes == measured.peak_bytes
    assert predicted.fixed_bytes == measured.fixed_bytes
    # Op-level choices measured by both agree to the byte. The menus themselves differ: each
    # is chosen by the operations' time shares (rooflines against this CPU's clock), and a CPU
    # convolution shows an aten.empty that its meta kernel does not.
    def choice_bytes(choice) -> tuple[int, int, int]:
        return choice.kept_bytes, choice.forward_peak_bytes, choice.backward_peak_bytes

    for ours, theirs in zip(predicted.blocks, measured.blocks, strict=True):
        measured_choices = {choice.policy: choice for choice in theirs.op_choices}
        ours.op_choices = [choice for choice in ours.op_choices
                           if choice.policy in measured_choices]
        for choice in ours.op_choices:
            assert choice_bytes(choice) == choice_bytes(measured_choices[choice.policy])
    # A plan solved from the estimate (on those choices) is predicted as the measured profile
    # predicts it. The plans may differ from those solved from the measured profile: their
    # times are rooflines.
    plan = gradckpt.solve(predicted, int(0.7 * measured.peak_bytes))
    assert plan.predicted_peak_bytes == measured.fixed_bytes + simulate(
        as_planned(measured, plan), plan.segments)[0]
    # The model is exactly as it was: real parameters, the same values.
    after = model.state_dict()
    assert all(torch.equal(after[name], value) for name, value in before.items())
    assert not any("Fake" in type(p).__name__ for p in model.parameters())
    assert predicted.notes["estimated_for"] == "this"
    if case.name in ("qwen2", "vit"):  # Llama here has attention dropout: the math path
        assert "flash_attention" in predicted.notes["attention"]
    if case.name in ("cnn", "lora"):
        assert predicted.notes["attention"].startswith("no fused attention kernel")
    assert predicted.step_seconds > 0
    # Blocks that compute take time, their backward at least half their forward's; a block of
    # views only (the CNN's Flatten) takes none on a roofline.
    for block in predicted.blocks:
        views_only = case.name == "cnn" and block.name == "5"
        assert (block.forward_seconds == 0) == views_only, block.name
        assert block.backward_seconds >= block.forward_seconds / 2, block.name


def test_a_model_on_the_meta_device_is_estimated_in_bf16() -> None:
    pytest.importorskip("transformers")
    with torch.device("meta"):  # the catalogue's Llama, at other sizes
        model = hf_model("llama", vocab_size=32000, hidden_size=512, intermediate_size=1376,
                         num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
                         max_position_embeddings=512, attention_dropout=0.0)
    ids = torch.randint(0, 32000, (2, 256), device="meta")
    predicted = gradckpt.estimate(model, {"input_ids": ids, "labels": ids},
                                  device="a100-80gb", dtype=torch.bfloat16)
    parameter_bytes = 2 * sum(p.numel() for p in model.parameters())
    assert predicted.fixed_bytes >= parameter_bytes
    assert predicted.blocks[0].input_bytes == 2 * 256 * 512 * 2  # bf16 hidden states
    assert all(p.device.type == "meta" for p in model.parameters())  # left as it was


@pytest.mark.slow
def test_an_8b_llama_config_estimates_in_minutes_without_memory() -> None:
    pytest.importorskip("transformers")
    grown_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model = build_known_model("llama-3-8b", on_meta=True)  # Llama-3-8B's published config
    assert sum(p.numel() for p in model.parameters()) > 8e9
    ids = torch.randint(0, 128256, (1, 1024))
    start = time.perf_counter()
    predicted = gradckpt.estimate(model, {"input_ids": ids, "labels": ids}, device="h100-80gb",
                                  dtype=torch.bfloat16)
    # A guard against a stall, not a benchmark: since the chunked head (issue 24) the estimate
    # also runs the step for 3 chunk counts; 46-62 s on a quiet 2-core CI machine.
    assert time.perf_counter() - start < 120
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - grown_before
    assert grown_kib < 4 * 2**20  # under 4 GiB (ru_maxrss is in KiB on Linux)
    assert len(predicted.blocks) == 32
    # bf16 weights and their gradients alone are 2 x 16 GB: the peak holds both.
    assert predicted.peak_bytes > 2 * 2 * 8e9


def test_an_unknown_device_lists_the_known_ones() -> None:
    with pytest.raises(gradckpt.UsageError, match="h100-80gb"):
        gradckpt.estimate(torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.ones(1, 2),
                          device="h1000")


def test_a_dtype_that_is_not_floating_is_refused() -> None:
    with pytest.raises(gradckpt.UsageError, match="floating"):
        gradckpt.estimate(torch.nn.Sequential(torch.nn.Linear(2, 2)), torch.ones(1, 2),
                          device="h100-80gb", dtype=torch.int8)


def test_the_modeled_clock_is_a_roofline() -> None:
    class Device:
        def seconds(self, flops, bytes_moved, dtype):
            return max(flops / 1e12, bytes_moved / 1e9)

    a = torch.randn(64, 64)
    with ModeledClock(Device()) as clock:
        a.t()  # a view: nothing moves
        assert clock.elapsed == 0
        a @ a
    assert clock.flops == 2 * 64**3
    assert clock.elapsed == pytest.approx(3 * 64 * 64 * 4 / 1e9)  # memory-bound at this size


def test_the_optimizer_state_is_in_the_peak_and_the_memory_is_broken_down() -> None:
    case = family("peft-llama")
    sample = case.sample()
    model = case.fresh()
    without = gradckpt.estimate(model, sample, device="a100-80gb")
    with_adamw = gradckpt.estimate(model, sample, device="a100-80gb", optimizer="adamw")
    trainable_tensors = [p for p in model.parameters() if p.requires_grad]
    trainable = sum(p.numel() * p.element_size() for p in trainable_tensors)
    # LoRA: the adapters' two moments, and AdamW's 4-byte step counter per adapter tensor.
    state = 2 * trainable + 4 * len(trainable_tensors)
    assert with_adamw.optimizer_state_bytes == state
    assert with_adamw.fixed_bytes - without.fixed_bytes == state
    # The step's peak holds the state, and optimizer.step() (every gradient, its temporaries)
    # may be the new highest point.
    assert with_adamw.peak_bytes - without.peak_bytes >= state
    assert with_adamw.peak_bytes == max(
        with_adamw.fixed_bytes + with_adamw.optimizer_step_bytes, without.peak_bytes + state)
    parts = with_adamw.notes["memory_parts"]
    assert parts["optimizer state"] == state
    assert parts["gradients (trainable parameters)"] == trainable
    assert parts["parameters"] == sum(p.numel() * p.element_size() for p in model.parameters())
    assert parts["CUDA context and allocator reserve (outside the peak)"] == 2 * 2**30
    assert with_adamw.notes["largest_part"] == max(parts, key=parts.get)
    assert with_adamw.notes["device_usable_bytes"] == 78 * 2**30
    # A plan solved from it holds the state too.
    plan = gradckpt.solve(with_adamw, with_adamw.peak_bytes)
    assert plan.predicted_peak_bytes == with_adamw.peak_bytes
    with pytest.raises(gradckpt.UsageError, match="adamw-8bit"):
        gradckpt.estimate(model, sample, device="a100-80gb", optimizer="adafactorr")


def test_the_example_in_docs_estimate_runs() -> None:
    pytest.importorskip("transformers")
    page = Path(__file__).resolve().parents[2] / "docs" / "estimate.md"
    block = page.read_text().split("```python\n")[1].split("```")[0]
    exec(compile(block, str(page), "exec"), {"__name__": "docs_example"})


def test_world_size_makes_the_profile_one_sharding_ranks() -> None:
    case = family("llama")
    sample = case.sample()
    model = case.fresh()
    whole = gradckpt.estimate(model, sample, device="h100-80gb", optimizer="adamw")
    per_rank = gradckpt.estimate(model, sample, device="h100-80gb", optimizer="adamw",
                                 world_size=4)
    before, after = whole.notes["memory_parts"], per_rank.notes["memory_parts"]
    for part in ("parameters", "gradients (trainable parameters)", "optimizer state"):
        assert after[part] == before[part] // 4
    assert after["activations kept for backward (no checkpointing)"] == before[
        "activations kept for backward (no checkpointing)"]
    gathered = after["gathered in full while a block computes (FSDP)"]
    assert gathered >= 2 * sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    assert per_rank.notes["world_size"] == 4
    assert per_rank.peak_bytes < whole.peak_bytes
    # Its peak is the cost model's for the plain step, as every plan's is: budgets are per rank.
    assert gradckpt.solve(per_rank, None, "none").predicted_peak_bytes == per_rank.peak_bytes
    plan = gradckpt.solve(per_rank, "70%")
    assert plan.segments and plan.predicted_peak_bytes <= plan.budget_bytes
    for bad in (0, -2, 1.5, True):
        with pytest.raises(gradckpt.UsageError, match="world_size"):
            gradckpt.estimate(model, sample, device="h100-80gb", world_size=bad)


def test_a_plan_from_an_estimate_names_its_device_and_round_trips() -> None:
    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(4)))
    predicted = gradckpt.estimate(model, torch.randn(8, 32), device="l4")
    plan = gradckpt.solve(predicted, None, "sqrt")
    assert plan.estimated_for == "l4-24gb"
    *_, summary, offload = str(plan).splitlines()
    assert summary.endswith("(estimated for l4-24gb)")
    assert offload.startswith("offload: offered over a host link of 25.6 GB/s")  # PCIe Gen4
    assert gradckpt.Plan.from_json(plan.to_json()) == plan
    measured = gradckpt.solve(gradckpt.profile(model, torch.randn(8, 32), repeats=1), None, "sqrt")
    assert measured.estimated_for is None and "estimated" not in str(measured)


def test_autocast_mixed_precision_is_estimated_as_it_measures() -> None:
    """fp32 parameters, forward under bf16 autocast (as Accelerate applies it): the estimate
    equals the profile of the same model wrapped that way, and shows the weights' bf16 copies."""
    import types

    case = family("llama")
    sample = case.sample()
    wrapped = case.fresh()
    wrapped.forward = types.MethodType(
        torch.autocast("cpu", dtype=torch.bfloat16)(type(wrapped).forward), wrapped)
    measured = gradckpt.profile(wrapped, sample, repeats=1)
    model = case.fresh()
    predicted = gradckpt.estimate(model, sample, device="this", autocast=torch.bfloat16)
    assert predicted.peak_bytes == measured.peak_bytes
    assert [b.saved_bytes for b in predicted.blocks] == [b.saved_bytes for b in measured.blocks]
    copies = predicted.notes["memory_parts"]["mixed-precision copies of the parameters"]
    linear_weights = sum(m.weight.numel() for m in model.modules()
                         if isinstance(m, torch.nn.Linear))
    assert copies == 2 * linear_weights  # each matmul weight cast to bf16 once
    assert "forward" not in model.__dict__  # the model is as it was
