"""QLoRA: a bitsandbytes 4-bit base under LoRA adapters, measured, estimated and trained (issue
26, item 1).

What a 4-bit layer holds and creates is measured on the real bitsandbytes layer, on its CPU
backend: ``profile`` of a real quantised model is the reference, and ``estimate`` of the same
model built on the meta device (never quantised, nothing allocated) must predict it to the byte.
bitsandbytes' CPU dequantisation costs ~30 ms a call whatever the size, so the models are tiny
and each real profile is shared by the tests that read it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import logging
import re
import warnings
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from engine_models import assert_identical, gradients, parameters
from torch import nn

import gradckpt
from gradckpt.ecosystem_hooks import ecosystem_hooks_on
from gradckpt.errors import UsageError
from gradckpt.measure import MemoryMeter

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

from gradckpt.integrations.quantized import quantize_linear_layers  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
logging.getLogger("bitsandbytes").setLevel(logging.ERROR)  # its optional CPU kernel hub

VOCAB, BATCH, SEQ = 128, 2, 32
FAMILIES = {
    "llama": lambda: transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
    "qwen2": lambda: transformers.Qwen2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64),
    # GPT-2's linear layers are Transformers' Conv1D (weight [in, out]).
    "gpt2": lambda: transformers.GPT2Config(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=64),
}
# The layers a bitsandbytes config quantises in each (all but the output head).
QUANTISED_LAYERS = {"llama": 2 * 7, "qwen2": 2 * 7, "gpt2": 2 * 4}


def qlora(family: str, *, meta: bool, lora: bool = True) -> nn.Module:
    """The family's tiny causal LM in bf16, its linear layers in NF4 (double quantisation),
    LoRA r=4 on every linear layer: real and quantised now, or on meta."""
    torch.manual_seed(0)
    config = FAMILIES[family]()
    with torch.device("meta" if meta else "cpu"):
        model = transformers.AutoModelForCausalLM.from_config(config).to(torch.bfloat16)
    quantize_linear_layers(model)
    if not lora:
        return model
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8,
                                                      target_modules="all-linear"))


def batch(device: str = "cpu") -> dict[str, torch.Tensor]:
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    ids = ids.to(device)
    return {"input_ids": ids, "labels": ids}


def numbers(profile: gradckpt.Profile) -> dict[str, int]:
    """Every byte count of a profile and of its blocks."""
    flat = {k: v for k, v in dataclasses.asdict(profile).items() if isinstance(v, int)}
    for block in profile.blocks:
        flat.update({f"{block.name}.{k}": v for k, v in dataclasses.asdict(block).items()
                     if isinstance(v, int) and not isinstance(v, bool)})
    return flat


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def measured(request: pytest.FixtureRequest) -> tuple[str, gradckpt.Profile]:
    family = request.param
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return family, gradckpt.profile(qlora(family, meta=False), batch(), optimizer="adamw",
                                        repeats=1)


def test_an_estimate_of_a_qlora_model_on_meta_is_its_measured_profile_to_the_byte(measured):
    family, profile = measured
    model = qlora(family, meta=True)
    predicted = gradckpt.estimate(model, batch("meta"), optimizer="adamw")
    assert numbers(predicted) == numbers(profile)


def test_the_measurement_counts_the_dequantised_weight_and_the_quantisation_state():
    """Seen from outside, bitsandbytes' gemm_4bit makes only its output; the layer dequantises
    its whole weight inside, and keeps its scales outside any parameter or buffer."""
    torch.manual_seed(0)
    layer = quantize_linear_layers(nn.Sequential(nn.Linear(256, 512).to(torch.bfloat16)))[0]
    x = torch.randn(8, 256, dtype=torch.bfloat16, requires_grad=True)
    state = layer.weight.quant_state
    state_bytes = sum(t.nbytes for t in (state.absmax, state.code, state.offset,
                                          state.state2.absmax, state.state2.code))

    def forward_peak(hooked: bool) -> tuple[int, int]:
        context = ecosystem_hooks_on(layer) if hooked else warnings.catch_warnings()
        with context, MemoryMeter("cpu", layer, x) as meter:
            start = meter.current()
            layer(x)
        return start, meter.peak() - start

    bare_start, bare_peak = forward_peak(hooked=False)
    start, peak = forward_peak(hooked=True)
    output_bytes, weight_bytes = 8 * 512 * 2, 512 * 256 * 2
    assert bare_peak == output_bytes  # the opaque kernel
    assert peak >= output_bytes + weight_bytes  # the dequantised weight, transient
    assert start - bare_start == state_bytes
    assert "forward" not in layer.__dict__ and "gradckpt_absmax" not in layer._buffers


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_a_planned_qlora_loop_fits_its_budget_and_trains_bit_for_bit(family):
    """enable() on a real 4-bit base with LoRA; four AdamW steps as a fine-tuning script runs
    them; steps 2-4 metered (with the quantisation state counted) against the plain run."""
    assert_a_planned_loop_fits_and_trains_bit_for_bit(lambda: qlora(family, meta=False))


@pytest.mark.parametrize("quantise", ["4-bit", "8-bit"])
def test_a_conv1d_is_quantised_as_the_linear_layer_of_its_transposed_weight(quantise):
    """Transformers' bitsandbytes loading turns GPT-2's ``Conv1D`` (``x @ W + b``, W of shape
    [in, out]) into a quantised linear layer of W transposed: the same layer, bit for bit, as
    quantising that ``nn.Linear``; and a whole GPT-2 keeps no layer in full precision but its
    head (before, its "4-bit base" kept every weight in bf16)."""
    from transformers.pytorch_utils import Conv1D

    from gradckpt.integrations.quantized_8bit import quantize_linear_layers_8bit

    quantised = {"4-bit": quantize_linear_layers, "8-bit": quantize_linear_layers_8bit}[quantise]
    torch.manual_seed(0)
    conv = Conv1D(48, 32)
    nn.init.normal_(conv.bias)
    linear = nn.Linear(32, 48)
    with torch.no_grad():
        linear.weight.copy_(conv.weight.t())
        linear.bias.copy_(conv.bias)
    from_conv = quantised(nn.Sequential(conv).to(torch.bfloat16))[0]
    from_linear = quantised(nn.Sequential(linear).to(torch.bfloat16))[0]
    assert type(from_conv) is type(from_linear)
    assert torch.equal(from_conv.weight, from_linear.weight)
    x = torch.randn(4, 32, dtype=torch.bfloat16)
    assert torch.equal(from_conv(x), from_linear(x))
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(FAMILIES["gpt2"]())
    quantised(model.to(torch.bfloat16))
    kinds = [type(m).__name__ for m in model.modules()]
    assert "Conv1D" not in kinds
    assert sum(kind in ("Linear4bit", "Linear8bitLt") for kind in kinds) == QUANTISED_LAYERS["gpt2"]


def assert_a_planned_loop_fits_and_trains_bit_for_bit(build: Callable[[], nn.Module]) -> None:
    """``build()``'s model trained four AdamW steps, plain and under ``enable`` at 70%: steps 2-4
    metered (with what gradckpt counts of a quantised layer), within the budget + 3% and 3% of
    the prediction, and the parameters and gradients after identical."""

    def run(planned: bool) -> tuple[int, dict, dict, gradckpt.Plan | None]:
        model = build()
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad])
        plan = None
        if planned:
            plan = gradckpt.enable(model, batch(), "70%", optimizer=optimizer)
        torch.manual_seed(7)
        data = batch()
        out = None

        def step() -> None:
            nonlocal out
            out = model(**data)
            out.loss.backward()
            optimizer.step()
            optimizer.zero_grad()

        step()
        with ecosystem_hooks_on(model), MemoryMeter("cpu", model, optimizer, *data.values()) as m:
            for _ in range(3):
                step()
        out = None
        trained = parameters(model)
        model(**data).loss.backward()
        return m.peak(), trained, gradients(model), plan

    plain_peak, plain_parameters, plain_gradients, _ = run(planned=False)
    peak, trained, grads, plan = run(planned=True)
    assert plan.segments, plan
    assert peak < plain_peak
    assert peak <= plan.budget_bytes * 1.03, (peak, plan.budget_bytes)
    assert abs(plan.predicted_peak_bytes - peak) <= 0.03 * peak, (plan.predicted_peak_bytes, peak)
    assert_identical(trained, plain_parameters, "parameters")
    assert_identical(grads, plain_gradients, "gradients")


def test_the_docs_qlora_example_runs_and_leaves_its_meta_model_as_it_was():
    """docs/estimate.md's QLoRA example, as it stands; afterwards its model is still on meta,
    not quantised, with no forward or buffer of gradckpt's left on its layers."""
    page = (Path(__file__).resolve().parents[2] / "docs" / "estimate.md").read_text()
    (block,) = [b for b in re.findall(r"```python\n(.*?)```", page, re.S)
                if "quantize_linear_layers" in b]
    namespace: dict = {}
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        exec(compile(block, "docs/estimate.md", "exec"), namespace)
    assert "predicted peak" in printed.getvalue()
    model = namespace["model"]
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(layers) == 4 * 7
    for layer in layers:
        assert "forward" not in layer.__dict__ and not any(
            name.startswith("gradckpt_") for name in layer._buffers)
        assert layer.weight.is_meta and not layer.weight.bnb_quantized and layer.weight.dim() == 2
    # The base in bf16, the adapters in PEFT's fp32: nothing cast them.
    dtypes = {p.dtype for p in model.parameters() if p.requires_grad}
    assert dtypes == {torch.float32}


class _ForeignQuantLinear(nn.Linear):
    """Stands for a GPTQ layer: gradckpt knows quantisers by their package."""


_ForeignQuantLinear.__module__ = "auto_gptq.nn_modules.qlinear"


@pytest.mark.parametrize("quantizer", ["gptq", "bnb-8bit-fp16-weights"])
def test_a_quantiser_gradckpt_does_not_model_is_named_and_the_model_left_alone(quantizer):
    model = nn.Sequential(nn.Linear(8, 8), nn.Linear(8, 8))
    if quantizer == "gptq":
        model[1] = _ForeignQuantLinear(8, 8)
        name = "GPTQ"
    else:  # bitsandbytes' default: training the fp16 weights, quantised again every forward
        model[1] = bnb.nn.Linear8bitLt(8, 8, has_fp16_weights=True)
        name = "bitsandbytes 8-bit training fp16 weights"
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(UsageError, match=name) as raised:
        gradckpt.estimate(model, torch.randn(2, 8))
    assert "bitsandbytes 4-bit" in str(raised.value) and "load_in_8bit" in str(raised.value)
    assert set(model.state_dict()) == set(before)


def test_bitsandbytes_8bit_layers_as_load_in_8bit_makes_them_are_supported():
    """Frozen int8 weights (``load_in_8bit=True``): ``test_integrations_quantized_8bit.py``."""
    from gradckpt.integrations.quantized import unsupported_quantizer

    model = nn.Sequential(nn.Linear(8, 8), bnb.nn.Linear8bitLt(8, 8, has_fp16_weights=False))
    assert unsupported_quantizer(model) is None
