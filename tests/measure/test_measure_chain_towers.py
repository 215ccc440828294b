"""Multimodal models trained on text whose vision or audio tower outweighs the language model:
by structure the chain is the tower's layers alone (``find_blocks(model)``), which do not run on
text; ``enable`` (through ``profile``) and ``estimate`` take the language model's layers, which
``find_blocks(model, sample)`` chooses among the stacks that ran (``measure/chain.py``, rule 4).

GOT-OCR2 (a SAM-like vision tower; also frozen under PEFT LoRA) and Phi-4-multimodal (an audio
encoder of conformer blocks and a vision tower) are built from tiny configs, random weights,
nothing downloaded. Each is planned with ``enable`` and AdamW and trained three steps as a loop
does, beside an identical model without a plan: the parameters after and the gradients of one
more step bit for bit equal, the measured peak of steps 2-3 within the budget + 3%;
``estimate`` takes the same chain and predicts the peak ``profile`` measures.
"""

from __future__ import annotations

import pytest
import torch
from hf_models import adamw, assert_trains_as_plain, trained_as_a_loop, with_lora
from torch import nn

import gradckpt
from gradckpt.measure import find_blocks

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

VOCAB, STEPS = 128, 3
OVER_BUDGET = 1.03
# The language models' sizes: 3 layers, far smaller than the towers.
TEXT = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
            num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=128,
            attention_dropout=0.1)


def got_ocr2() -> nn.Module:
    config = transformers.GotOcr2Config(
        vision_config=dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2,
                           image_size=64, patch_size=8, mlp_dim=2048, output_channels=64,
                           global_attn_indexes=[1], window_size=4),
        text_config=TEXT,
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.GotOcr2ForConditionalGeneration(config).train()


def phi4_multimodal() -> nn.Module:
    config = transformers.Phi4MultimodalConfig(
        **TEXT, bos_token_id=1, eos_token_id=2, pad_token_id=0,
        vision_config=dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=2, image_size=64, patch_size=8),
        audio_config=dict(hidden_size=64, intermediate_size=128, num_blocks=4,
                          num_attention_heads=2, ext_pw_out_channel=256,
                          depthwise_separable_out_channel=256, nemo_conv_channels=256),
    )
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return transformers.Phi4MultimodalForCausalLM(config).train()


def got_ocr2_lora() -> nn.Module:
    """GOT-OCR2 frozen under PEFT LoRA adapters on every linear layer (the tower's too)."""
    model = got_ocr2()
    torch.manual_seed(1)  # the adapters' A matrices: the same in both runs
    return with_lora(model)


# name: (builder, the tower's layers by structure, the language model's layers)
MODELS = {
    "got_ocr2": (got_ocr2, "model.vision_tower.layers", "model.language_model.layers"),
    "got_ocr2_lora": (got_ocr2_lora, "base_model.model.model.vision_tower.layers",
                      "base_model.model.model.language_model.layers"),
    "phi4_multimodal": (phi4_multimodal, "model.embed_tokens_extend.audio_embed.encoder.encoders",
                        "model.layers"),
}


def text_batch(seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(3, VOCAB, (2, 64), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def train(model: nn.Module, optimizer: torch.optim.Optimizer
          ) -> tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor | None]]:
    return trained_as_a_loop(model, optimizer, text_batch, STEPS)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_enable_plans_the_language_model_and_trains_as_plain(name: str) -> None:
    build, tower, language_model = MODELS[name]
    model = build()
    by_structure = {block_name.rpartition(".")[0] for block_name, _ in find_blocks(model)}
    assert by_structure == {tower}  # the tower alone: it outweighs the language model tenfold
    expected = [f"{language_model}.{index}" for index in range(3)]
    assert [block_name for block_name, _ in find_blocks(model, text_batch(0))] == expected

    plain = train(model, adamw(model))
    model = build()
    optimizer = adamw(model)
    try:
        plan = gradckpt.enable(model, text_batch(0), budget="60%", optimizer=optimizer,
                               output_head="plain")
    except gradckpt.BudgetError as error:  # the parameters and AdamW's state weigh most
        plan = gradckpt.solve(error.profile, error.minimum_bytes, output_head="plain")
        gradckpt.apply(model, plan)
    assert list(plan.block_names) == expected
    assert plan.segments, plan
    planned = train(model, optimizer)
    gradckpt.disable(model)
    assert_trains_as_plain(plan, plain, planned, STEPS, OVER_BUDGET)


@pytest.mark.parametrize("name", sorted(MODELS))
def test_estimate_takes_the_same_chain_and_predicts_the_measured_peak(name: str) -> None:
    # On fake tensors: built on the meta device, or (PEFT) the model as built. The peak as
    # profile measures it: to the byte under LoRA, 1,024 B (0.02%) over from the meta device.
    build, _, language_model = MODELS[name]
    model = build()
    measured = gradckpt.profile(model, text_batch(0), optimizer="adamw", repeats=1)
    if "lora" not in name:
        with torch.device("meta"):
            model = type(model)(model.config)
    batch = {key: tensor.to(model.device) for key, tensor in text_batch(0).items()}
    predicted = gradckpt.estimate(model, batch, optimizer="adamw", device="h100-80gb")
    expected = [f"{language_model}.{index}" for index in range(3)]
    assert [block.name for block in predicted.blocks] == expected
    assert [block.name for block in measured.blocks] == expected
    assert abs(predicted.peak_bytes - measured.peak_bytes) <= 0.001 * measured.peak_bytes, (
        predicted.peak_bytes, measured.peak_bytes)
