"""Tiny Hugging Face models built from configs with random weights (nothing is downloaded)."""

from __future__ import annotations

import torch
from torch import nn


def tiny_llama(layers: int, vocab_size: int = 128) -> nn.Module:
    """A seeded LlamaForCausalLM in training mode, attention dropout on (RNG replay matters)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        attention_dropout=0.1,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()
