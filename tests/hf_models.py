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


def tiny_clip(vocab_size: int = 64) -> nn.Module:
    """A seeded CLIPModel: two towers, text created first, vision run first (2 layers each)."""
    import transformers

    text = transformers.CLIPTextConfig(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=16,
        bos_token_id=0,
        eos_token_id=2,
    )
    vision = transformers.CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=16,
        patch_size=8,
    )
    config = transformers.CLIPConfig(
        text_config=text.to_dict(), vision_config=vision.to_dict(), projection_dim=16
    )
    torch.manual_seed(0)
    return transformers.CLIPModel(config)
