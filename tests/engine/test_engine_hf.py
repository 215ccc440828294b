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
