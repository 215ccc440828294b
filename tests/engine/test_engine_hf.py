"""The engine on real Hugging Face Transformers layers, built from configs with random weights.

Decoder layers take many keyword arguments (attention masks, position embeddings as a tuple of
tensors, cache objects, flags) and, in GPT-2, reshape through views whose autograd node type can
differ between the forward pass and recomputation. Invariants 1 and 5: with every layer
checkpointed, the loss and every gradient equal the plain model's bit for bit, attention
dropout included; invariant 2 of the module form: parameter names and state_dict keys unchanged.
"""

from __future__ import annotations

import copy
from collections.abc import Callable

import hf_models
import pytest
import torch
from torch import nn

import gradckpt
from gradckpt.engine import checkpoint_segments

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread


def tiny_llama() -> tuple[nn.Module, Callable[[nn.Module], nn.ModuleList]]:
    return hf_models.tiny_llama(layers=3), lambda model: model.model.layers


def tiny_gpt2() -> tuple[nn.Module, Callable[[nn.Module], nn.ModuleList]]:
    config = transformers.GPT2Config(
        vocab_size=128, n_embd=64, n_layer=3, n_head=4, n_positions=64, bos_token_id=0,
        eos_token_id=0,
    )
    return transformers.GPT2LMHeadModel(config), lambda model: model.transformer.h


def training_step(model: nn.Module, input_ids: torch.Tensor) -> dict:
    torch.manual_seed(3)  # dropout masks
    output = model(input_ids=input_ids, labels=input_ids)
    output.loss.backward()
    return {
        "loss": output.loss.detach(),
        "grads": {name: p.grad for name, p in model.named_parameters() if p.grad is not None},
    }


@pytest.mark.parametrize("build", [tiny_llama, tiny_gpt2], ids=["llama", "gpt2"])
@pytest.mark.parametrize("policy", [None, "save-matmuls", "offload-matmuls"])
def test_every_layer_checkpointed_is_bit_identical(build, policy) -> None:
    torch.manual_seed(0)
    plain, layers_of = build()
    plain.train()
    checkpointed = copy.deepcopy(plain)
    for layer in layers_of(checkpointed):
        gradckpt.checkpoint_module(layer, policy=policy)
    assert list(checkpointed.state_dict()) == list(plain.state_dict())

    input_ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    expected = training_step(plain, input_ids)
    actual = training_step(checkpointed, input_ids)

    assert torch.equal(actual["loss"], expected["loss"])
    assert actual["grads"].keys() == expected["grads"].keys()
    for name, grad in expected["grads"].items():
        assert torch.equal(actual["grads"][name], grad), name


def test_segments_replay_the_random_draws_made_between_their_blocks() -> None:
    """NLLB-MoE's encoder and decoder loops draw ``torch.rand([])`` between layers (LayerDrop,
    on by default): a segment of several layers recomputes them back to back, so each later
    layer must start from the random state it started from in the forward pass, or its
    dropout masks, and the gradients, differ silently."""
    config = transformers.NllbMoeConfig(
        vocab_size=128, d_model=32, encoder_layers=4, decoder_layers=4,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=64,
        decoder_ffn_dim=64, num_experts=4, expert_capacity=8, encoder_sparse_step=2,
        decoder_sparse_step=2, max_position_embeddings=64, dropout=0.2,
        attention_dropout=0.2, encoder_layerdrop=0.2, decoder_layerdrop=0.2,
        pad_token_id=1, decoder_start_token_id=2)
    torch.manual_seed(0)
    plain = transformers.NllbMoeForConditionalGeneration(config).train()
    checkpointed = copy.deepcopy(plain)
    handles = [checkpoint_segments(list(stack), [(0, 1), (2, 3)])
               for stack in (checkpointed.model.encoder.layers, checkpointed.model.decoder.layers)]
    input_ids = torch.randint(3, 128, (2, 12), generator=torch.Generator().manual_seed(1))
    for seed in range(4):  # different draws: layers dropped or not, at either place
        expected = _nllb_gradients(plain, input_ids, seed)
        got = _nllb_gradients(checkpointed, input_ids, seed)
        assert expected.keys() == got.keys()
        assert all(torch.equal(expected[name], got[name]) for name in expected), seed
    for handle in handles:
        handle.remove()


def _nllb_gradients(model: nn.Module, input_ids: torch.Tensor, seed: int) -> dict:
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    # No cache: filled in the forward pass, recomputation would attend to it (enable turns
    # it off in training; checkpoint_segments by hand does not).
    model(input_ids=input_ids, labels=input_ids, use_cache=False).loss.backward()
    return {name: p.grad for name, p in model.named_parameters() if p.grad is not None}
