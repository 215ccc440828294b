"""Causal language models whose loss is not Transformers' ``ForCausalLMLoss`` on the head's
logits: ``estimate`` offers the chunked heads ``profile`` does, and a plan's head trains as the
plain model.

``profile`` checks the chunked loss against the model's own on the sample; ``estimate`` runs on
fake tensors and has no values to compare, so both read one table
(``gradckpt.integrations.hf_head._LOSSES``). Each family is built tiny from its config (random
weights, dropout off, nothing downloaded) and trained as fine-tuning scripts do (labels with
-100 padding in the batch, AdamW, 3 steps). Checked:

- the families that score the logits against the labels as they are, unshifted
  (``CrossEntropyLoss()(logits.view(-1, vocab), labels.view(-1))``): BART's decoder and the
  other encoder-decoder families' decoders as causal LMs, TrOCR, Whisper, CPM-Ant, XLNet.
  ``estimate`` offered them the shifted chunked loss (BART: a loss of 5.582 for the model's
  4.733) where ``profile`` offered none; now both offer the same chunk counts, and the plan
  with the chunked head trains as the plain model within float rounding;
- RecurrentGemma and xLSTM soft-cap their logits under another config name: the chunked loss
  soft-caps them too, and trains as the plain model;
- Cohere scales its logits (``logit_scale``), Granite with ``logits_scaling`` other than 1: no
  chunked head, from ``profile`` or ``estimate``; Granite at 1 has one from both;
- a model outside the table that changes its logits (a user's subclass scaling them):
  ``estimate`` cannot tell and offers a chunked head; applied, the plan's first training step
  raises, saying what to do, and leaves the parameters as they were;
- GIT scores the text's logits alone, after the image's tokens its head also reads: it keeps
  its own loss (``profile`` and ``estimate`` raised on the chunked step's shapes).

XLM also scores its labels unshifted (its entry in the table is checked by the same loss
comparison in ``bench/architectures.py``), but ``profile`` refuses its interleaved blocks.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from test_integrations_hf_head import (
    DECODER as LLAMA,
)
from test_integrations_hf_head import (
    GRADIENT_TOLERANCE,
    LOSS_TOLERANCE,
    VOCAB,
    ScaledLogitsLlama,
    causal_batch,
    largest_difference,
    train,
    train_planned_and_plain,
)
from torch import nn

import gradckpt

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")

ENCODER_DECODER = dict(vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
                       encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
                       decoder_ffn_dim=128, max_position_embeddings=64)
DECODER = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
DROPOUTS = ("dropout", "attention_dropout", "activation_dropout", "dropout_p")

# The model class and its config, by family: the unshifted ones first.
UNSHIFTED = {
    "bart": ("BartForCausalLM", "BartConfig", ENCODER_DECODER),
    "bigbird_pegasus": ("BigBirdPegasusForCausalLM", "BigBirdPegasusConfig",
                        {**ENCODER_DECODER, "attention_type": "original_full"}),
    "blenderbot": ("BlenderbotForCausalLM", "BlenderbotConfig", ENCODER_DECODER),
    "blenderbot_small": ("BlenderbotSmallForCausalLM", "BlenderbotSmallConfig",
                         ENCODER_DECODER),
    "marian": ("MarianForCausalLM", "MarianConfig",
               {**ENCODER_DECODER, "decoder_start_token_id": 1, "pad_token_id": 0}),
    "mbart": ("MBartForCausalLM", "MBartConfig", ENCODER_DECODER),
    "mvp": ("MvpForCausalLM", "MvpConfig", ENCODER_DECODER),
    "pegasus": ("PegasusForCausalLM", "PegasusConfig", ENCODER_DECODER),
    "plbart": ("PLBartForCausalLM", "PLBartConfig", ENCODER_DECODER),
    "trocr": ("TrOCRForCausalLM", "TrOCRConfig",
              dict(vocab_size=VOCAB, d_model=64, decoder_layers=2, decoder_attention_heads=4,
                   decoder_ffn_dim=128, max_position_embeddings=64)),
    "whisper": ("WhisperForCausalLM", "WhisperConfig",
                {**ENCODER_DECODER, "max_target_positions": 64, "decoder_start_token_id": 1,
                 "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}),
    "cpmant": ("CpmAntForCausalLM", "CpmAntConfig",
               dict(vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, dim_head=16,
                    dim_ff=128, num_hidden_layers=2)),
    "xlnet": ("XLNetLMHeadModel", "XLNetConfig",
              dict(vocab_size=VOCAB, d_model=64, n_layer=2, n_head=4, d_inner=128)),
}
SOFT_CAPPED = {
    "recurrent_gemma": ("RecurrentGemmaForCausalLM", "RecurrentGemmaConfig",
                        {**DECODER, "head_dim": 16, "logits_soft_cap": 5.0}),
    "xlstm": ("xLSTMForCausalLM", "xLSTMConfig",
              dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_heads=4,
                   output_logit_soft_cap=5.0)),
}
# Largest differences measured against the plain model (torch 2.13, CPU, float32, lr 1e-3,
# 2 chunks): the loss within 2 ulp (CPM-Ant's 23.5: 1.9e-6), the gradients of step 1 within
# 4.5e-8; the parameters after 3 AdamW steps, by family (where the gradient is rounding noise,
# as a key projection's bias has, AdamW scales it to a good fraction of the learning rate: see
# test_integrations_hf_head.py): bart 1.3e-7, bigbird_pegasus 1.7e-7, blenderbot 6.2e-6
# (layers.0.self_attn.k_proj.bias), blenderbot_small 1.2e-7, marian 3.1e-7, mbart 1.1e-7,
# mvp 4.8e-7, pegasus 4.1e-7, plbart 2.6e-6 (embed_tokens, tied to the head), trocr 4.8e-7,
# whisper 1.2e-7, cpmant 2.4e-7, xlnet 5.3e-7, recurrent_gemma 9.7e-8, xlstm 2.7e-7. A loss
# with the labels shifted would move every parameter by about the learning rate per step.
PARAMETER_TOLERANCE = {"blenderbot": 1.5e-5, "plbart": 5e-6}


def build(model_class: str, config_class: str, fields: dict[str, Any]) -> nn.Module:
    """The tiny model, seeded, dropout off, in training mode, caches off."""
    config = getattr(transformers, config_class)(**fields, use_cache=False)
    for name in DROPOUTS:
        if hasattr(config, name):
            setattr(config, name, 0.0)
    config.is_decoder, config.is_encoder_decoder = True, False
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config).train()


def chunk_counts(profile: gradckpt.Profile) -> list[int]:
    return [head.chunks for head in profile.chunked_heads]


def profile_and_estimate(model: nn.Module, batch: dict) -> tuple[gradckpt.Profile,
                                                                  gradckpt.Profile]:
    measured = gradckpt.profile(model, batch, optimizer="adamw", repeats=1)
    predicted = gradckpt.estimate(model, batch, optimizer="adamw", device="this")
    assert gradckpt.get_plan(model) is None
    return measured, predicted


@pytest.mark.parametrize("name", [*UNSHIFTED, *SOFT_CAPPED])
def test_estimate_offers_profiles_chunked_heads_and_the_plan_trains_as_plain(name: str) -> None:
    model = build(*{**UNSHIFTED, **SOFT_CAPPED}[name])
    batch, plain = causal_batch(), copy.deepcopy(model)
    measured, predicted = profile_and_estimate(model, batch)
    assert chunk_counts(measured), measured.notes.get("chunked_head")
    assert chunk_counts(predicted) == chunk_counts(measured)

    plan = gradckpt.solve(predicted, None, "none", output_head="chunked")
    assert plan.head_chunks > 1
    got, expected = train_planned_and_plain(model, plain, batch, plan)
    assert got.logits_shape[-1] == 0 and expected.logits_shape[-1] == VOCAB
    torch.testing.assert_close(torch.stack(got.losses), torch.stack(expected.losses),
                               rtol=0, atol=LOSS_TOLERANCE)
    assert largest_difference(got.gradients, expected.gradients) <= GRADIENT_TOLERANCE
    assert largest_difference(got.parameters, expected.parameters) <= PARAMETER_TOLERANCE.get(
        name, 1e-6)


@pytest.mark.parametrize(("model_class", "config_class", "fields", "chunked"), [
    ("CohereForCausalLM", "CohereConfig", {**DECODER, "logit_scale": 0.0625}, False),
    ("GraniteForCausalLM", "GraniteConfig", {**DECODER, "logits_scaling": 8.0}, False),
    ("GraniteForCausalLM", "GraniteConfig", {**DECODER, "logits_scaling": 1.0}, True),
], ids=["cohere", "granite-scaled", "granite-unscaled"])
def test_logits_scaled_after_the_head_get_no_chunked_head_from_either(
    model_class: str, config_class: str, fields: dict, chunked: bool
) -> None:
    model = build(model_class, config_class, fields)
    measured, predicted = profile_and_estimate(model, causal_batch())
    assert chunk_counts(predicted) == chunk_counts(measured)
    assert bool(chunk_counts(measured)) is chunked
    if not chunked:
        with pytest.raises(gradckpt.UsageError, match="output_head='chunked'.*no chunked head"):
            gradckpt.solve(predicted, None, "none", output_head="chunked")


def test_git_scoring_its_text_after_the_image_keeps_its_own_loss() -> None:
    """GIT's head reads the image's tokens and the text's; its loss scores the text's alone.
    Both ``profile`` and ``estimate`` raised on the chunked step's shapes; now the model keeps
    its own loss, no chunked head, and a plan trains it bit for bit."""
    torch.manual_seed(0)
    config = transformers.GitConfig(
        vision_config=dict(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                           intermediate_size=64, image_size=32, patch_size=16),
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=64, hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0)
    model = transformers.GitForCausalLM(config).train()
    batch = {**causal_batch(), "pixel_values": torch.randn(2, 3, 32, 32,
                                                          generator=torch.Generator())}
    plain = copy.deepcopy(model)
    measured, predicted = profile_and_estimate(model, batch)
    assert chunk_counts(measured) == chunk_counts(predicted) == []
    plan = gradckpt.solve(measured, None, "every-layer")
    assert plan.head_chunks == 1 and plan.segments
    got, expected = train_planned_and_plain(model, plain, batch, plan)
    assert [loss.item() for loss in got.losses] == [loss.item() for loss in expected.losses]
    assert largest_difference(got.gradients, expected.gradients) == 0
    assert largest_difference(got.parameters, expected.parameters) == 0


def test_a_chunked_plan_on_a_model_that_scales_its_logits_raises_at_its_first_step() -> None:
    """A user's subclass that halves its logits: ``profile`` compares the losses and offers no
    chunked head; ``estimate`` has no values and offers one. Applied, the step sees that the
    forward multiplied the logits its head returned and raises before any gradient."""
    torch.manual_seed(0)
    model = ScaledLogitsLlama(transformers.LlamaConfig(vocab_size=VOCAB, **LLAMA)).train()
    batch, before = causal_batch(), copy.deepcopy(model.state_dict())
    measured, predicted = profile_and_estimate(model, batch)
    assert chunk_counts(measured) == [] and chunk_counts(predicted) == [2, 4]
    gradckpt.apply(model, gradckpt.solve(predicted, None, "none", output_head="chunked"))
    try:
        with pytest.raises(RuntimeError, match=r"ScaledLogitsLlama's forward changes the logits "
                           r"its output head returns \(MulBackward0\).*output_head='plain'"):
            train(model, batch)
    finally:
        gradckpt.disable(model)
    after = model.state_dict()
    assert all(torch.equal(after[name], value) for name, value in before.items())
