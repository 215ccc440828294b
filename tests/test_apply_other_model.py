"""A plan applied to a model it was not made for (issue 27, item 3): blocks of the same names
that hold other parameters (a wider model), a container holding more blocks (a deeper one), or
blocks of other names, are a UsageError saying how the model differs, the model left as it was.
The model the plan was made for, another instance of it, the real model of an estimate made on
the meta device (a QLoRA base included: packed weights counted by dtype) and a plan read back
from JSON are taken as before, and a plan from an older JSON (no fingerprint) too."""

from __future__ import annotations

import json

import pytest
import torch
from hf_models import causal_sample, tiny_llama, with_lora

import gradckpt
from gradckpt.integrations import hf_families

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB = 64


def _plan(model: torch.nn.Module) -> gradckpt.Plan:
    profile = gradckpt.profile(model, causal_sample(VOCAB, seq=16), repeats=1)
    return gradckpt.solve(profile, strategy="every-layer")


def _hooks(model: torch.nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


@pytest.fixture(scope="module")
def llama_plan() -> gradckpt.Plan:
    return _plan(tiny_llama(3, vocab_size=VOCAB))


@pytest.mark.parametrize(("other", "message"), [
    (lambda: tiny_llama(5, vocab_size=VOCAB),
     "'model.layers' held 3 blocks when the plan was made, and holds 5 here"),
    (lambda: hf_families.hf_model(
        "llama", num_hidden_layers=3, vocab_size=VOCAB, max_position_embeddings=64,
        hidden_size=128),
     "block 'model.layers.0': its input_layernorm.weight was [64] when the plan was made, "
     "and is [128] here"),
    (lambda: tiny_llama(2, vocab_size=VOCAB),
     "it checkpoints 'model.layers.2', which LlamaForCausalLM has no module named (3 blocks "
     "planned, 1 missing)"),
    (lambda: with_lora(tiny_llama(3, vocab_size=VOCAB)),
     "it checkpoints 'model.layers.0', 'model.layers.1' and 'model.layers.2', which "
     "PeftModel has no module named (3 blocks planned, 3 missing); the model holds "
     "'base_model.model.model.layers.0', 'base_model.model.model.layers.1' and "
     "'base_model.model.model.layers.2', as if wrapped after the plan was made. "),
])
def test_a_plan_on_another_model_says_how_it_differs(llama_plan, other, message) -> None:
    model = other()
    before = {name: p.clone() for name, p in model.state_dict().items()}
    hooks = _hooks(model)
    with pytest.raises(gradckpt.UsageError, match="^this plan was made for another model") as e:
        gradckpt.apply(model, llama_plan)
    assert message in str(e.value)
    assert gradckpt.get_plan(model) is None and _hooks(model) == hooks
    assert all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())


def test_the_same_architecture_and_a_plan_read_back_are_taken(llama_plan) -> None:
    assert llama_plan.block_fingerprints and llama_plan.chain_lengths == {"model.layers": 3}
    again = gradckpt.Plan.from_json(llama_plan.to_json())
    assert again == llama_plan
    older = json.loads(llama_plan.to_json())
    del older["block_fingerprints"], older["chain_lengths"]  # a plan saved before they existed
    for plan in (llama_plan, again, gradckpt.Plan.from_json(json.dumps(older))):
        model = tiny_llama(3, vocab_size=VOCAB)
        gradckpt.apply(model, plan)
        model(**causal_sample(VOCAB, seq=16)).loss.backward()
        gradckpt.disable(model)


def test_a_plan_estimated_on_meta_is_taken_by_the_real_model() -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2)
    with torch.device("meta"):
        meta = transformers.LlamaForCausalLM(config)
    sample = causal_sample(VOCAB, seq=16)
    predicted = gradckpt.estimate(meta, {k: v.to("meta") for k, v in sample.items()})
    plan = gradckpt.solve(predicted, strategy="every-layer")
    model = transformers.LlamaForCausalLM(config)
    gradckpt.apply(model, plan)
    model(**sample).loss.backward()


def test_a_qlora_plan_estimated_on_meta_is_taken_by_the_quantised_model() -> None:
    pytest.importorskip("bitsandbytes")
    transformers = pytest.importorskip("transformers")
    from gradckpt.integrations.quantized import quantize_linear_layers

    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2)

    def qlora(device: str) -> torch.nn.Module:
        torch.manual_seed(0)
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
        return with_lora(quantize_linear_layers(model))

    sample = causal_sample(VOCAB, seq=16)
    predicted = gradckpt.estimate(qlora("meta"), {k: v.to("meta") for k, v in sample.items()})
    plan = gradckpt.solve(predicted, strategy="every-layer")
    assert any("uint8" in words for words in plan.block_fingerprints)  # the packed weights
    model = qlora("cpu")
    gradckpt.apply(model, plan)
    model(**sample).loss.backward()
