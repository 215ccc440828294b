"""Predicted peaks on architectures whose blocks hold memory their boundaries do not show,
each built tiny from its config as ``bench/architectures.py`` builds it (hidden 64, 2 layers,
4 heads, vocabulary 256, attention dropout 0.1, eager attention; batch 2 x 128 with labels):

- RecurrentGemma: its recurrent layer keeps its last state as an attribute
  (``self.recurrent_states = ...``), a reference to the graph it was computed in. Set again by
  recomputation, it held that graph and its saved tensors (the layer's activations) until the
  next forward pass (engine invariant 2 and rule R6).
- Falcon, GPT-NeoX-Japanese: a layer returns its attention weights with its hidden state, and
  the model's loop holds both (``outputs = layer(...)``) until the next layer returns. A
  checkpointed layer's weights, which nothing else holds, are alive through the next layer's
  forward (``BlockProfile.returned_bytes``).
- Gemma 4: a layer stores its keys and values in a dictionary passed to every layer, which a
  checkpointed segment holds for recomputation until its backward
  (``BlockProfile.argument_stored_bytes``).
- RoFormer (a BERT-like encoder as a causal LM): its embeddings save their layer norm's input
  and their dropout mask, alive through the chain's forward (``Profile.before_chain_bytes``),
  which is the step's peak once the loss runs in chunks.
- BART as a causal LM (its decoder alone): the cross-attention gets no gradient, and AdamW
  keeps no state for it (the optimizer's state counts the parameters the step trains).

Each plans the step users write with AdamW (``enable(budget="60%", optimizer="adamw")``, the
least feasible budget where that cannot be met), Transformers' every-layer layout, and the
first layer alone checkpointed with the loss in the most chunks measured (the forward's peak
the step's), measured side by side with the plain step (``compare_plans``, the loop's second
step): the prediction within 3% of the measured peak and never under it by more than 1%
(where a kept layer stores in the shared dictionary, only the latter: that counts twice), the
measured peak within the budget + 3%, the gradients the plain model's bit for bit (within
float rounding where the plan computes the loss in chunks).
"""

from __future__ import annotations

import math

import pytest
import torch

import gradckpt
from gradckpt.cost import plan_for
from gradckpt.integrations.hf import turn_caches_off
from gradckpt.plan import Segment
from gradckpt.side_by_side import compare_plans

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
transformers = pytest.importorskip("transformers")

OVER = 0.03  # the prediction above the measured peak, and the measured peak above the budget
UNDER = 0.01  # the prediction under the measured peak
CHUNKED_LOSS_ROUNDING = 1e-5  # the loss summed in chunks: another order of float sums
BATCH, SEQ, VOCAB = 2, 128, 256

TINY = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
        "vocab_size": VOCAB, "attention_dropout": 0.1, "use_cache": False}
# Per architecture: the model class, its config class and the config's own tiny sizes (what
# bench/architectures.py's ``shrink`` sets on it).
ARCHITECTURES = {
    "recurrent_gemma": ("RecurrentGemmaForCausalLM", "RecurrentGemmaConfig",
                        {"intermediate_size": 128, "num_key_value_heads": 2, "head_dim": 16}),
    "falcon": ("FalconForCausalLM", "FalconConfig",
               {"num_kv_heads": 2, "ffn_hidden_size": 128, "max_position_embeddings": 256,
                "bos_token_id": 6, "eos_token_id": 5}),
    "gpt_neox_japanese": ("GPTNeoXJapaneseForCausalLM", "GPTNeoXJapaneseConfig",
                          {"max_position_embeddings": 256, "bos_token_id": 6,
                           "eos_token_id": 5}),
    "gemma4_unified_text": ("Gemma4UnifiedForCausalLM", "Gemma4UnifiedTextConfig",
                            {"intermediate_size": 128, "num_key_value_heads": 2,
                             "head_dim": 16, "max_position_embeddings": 256,
                             "layer_types": ["sliding_attention", "full_attention"]}),
    "roformer": ("RoFormerForCausalLM", "RoFormerConfig",
                 {"embedding_size": 64, "intermediate_size": 128,
                  "attention_probs_dropout_prob": 0.1, "max_position_embeddings": 256,
                  "is_decoder": True}),
    # Its own names for the sizes; only the decoder runs (its cross-attention, given no
    # encoder output, gets no gradient and AdamW no state for it).
    "bart": ("BartForCausalLM", "BartConfig",
             {"d_model": 64, "decoder_layers": 2, "decoder_ffn_dim": 128,
              "decoder_attention_heads": 4, "encoder_layers": 2, "encoder_ffn_dim": 128,
              "encoder_attention_heads": 4, "max_position_embeddings": 256,
              "is_decoder": True}),
}


def tiny_model(model_type: str) -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The architecture's tiny model (seeded, training mode, caches off) and its batch."""
    model_name, config_name, sizes = ARCHITECTURES[model_type]
    if not hasattr(transformers, model_name):
        pytest.skip(f"{model_name} is not in this Transformers")
    common = TINY if "d_model" not in sizes else {
        name: value for name, value in TINY.items()
        if name in ("vocab_size", "attention_dropout", "use_cache")}
    config = getattr(transformers, config_name)(**common, **sizes)
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).train()
    turn_caches_off(model)
    ids = torch.randint(8, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))
    return model, {"input_ids": ids, "labels": ids.clone()}


def planned(model: torch.nn.Module, batch: dict) -> gradckpt.Plan:
    """``enable`` at 60% of the plain peak, or at the least feasible budget, taken off again:
    the plan, as the sweep makes it."""
    try:
        plan = gradckpt.enable(model, batch, budget="60%", optimizer="adamw")
    except gradckpt.BudgetError as error:
        plan = gradckpt.solve(error.profile, error.minimum_bytes)
    gradckpt.disable(model)
    return plan


@pytest.mark.parametrize("model_type", ARCHITECTURES)
def test_plans_are_predicted_and_fit_their_budget(model_type: str) -> None:
    model, batch = tiny_model(model_type)
    plan = planned(model, batch)
    measured = gradckpt.profile(model, batch, optimizer="adamw", repeats=1)
    most_chunks = measured.chunked_heads[-1].chunks if measured.chunked_heads else 1
    plans = {"budget": plan, "every-layer": gradckpt.solve(measured, None, "every-layer"),
             "first alone": plan_for(measured, "optimal", None, [Segment(0, 0)], most_chunks)}
    result = compare_plans(model, batch, {"plain": None, **plans},
                           optimizer=torch.optim.AdamW(model.parameters()), rounds=0)
    for label, chosen in plans.items():
        where = f"{model_type}, {label} plan"
        peak = result.peak_bytes[label]
        assert result.identical(label) or (
            chosen.head_chunks > 1 and result.largest_difference(label) <= CHUNKED_LOSS_ROUNDING
        ), f"{where}: gradients differ from the plain model's"
        error = chosen.predicted_peak_bytes / peak - 1
        # A kept layer's keys and values in the shared dictionary count twice there: in what
        # its graph saves and in what the dictionary holds (an upper bound).
        over = (math.inf if label == "first alone" and any(
            block.argument_stored_bytes for block in measured.blocks[1:]) else OVER)
        assert -UNDER <= error <= over, (
            f"{where}: predicted {chosen.predicted_peak_bytes}, measured {peak} ({error:+.2%})")
        if chosen.budget_bytes is not None:
            assert peak <= chosen.budget_bytes * (1 + OVER), (
                f"{where}: measured {peak} over the budget {chosen.budget_bytes}")
