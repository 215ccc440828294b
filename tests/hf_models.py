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


def tiny_t5(layers: int = 2, vocab_size: int = 128) -> nn.Module:
    """A seeded T5ForConditionalGeneration, ``layers`` encoder and decoder blocks, dropout off
    (its memory is what the tests look at)."""
    import transformers

    config = transformers.T5Config(
        vocab_size=vocab_size, d_model=64, num_layers=layers, num_decoder_layers=layers,
        num_heads=4, d_kv=16, d_ff=128, decoder_start_token_id=0, dropout_rate=0.0,
    )
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(config).train()


def tiny_bart(
    layers: int = 2, vocab_size: int = 128, decoder_layers: int | None = None
) -> nn.Module:
    """A seeded BartForConditionalGeneration, ``layers`` encoder layers and as many decoder
    layers unless ``decoder_layers`` says otherwise."""
    import transformers

    config = transformers.BartConfig(
        vocab_size=vocab_size, d_model=64, encoder_layers=layers,
        decoder_layers=layers if decoder_layers is None else decoder_layers,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, max_position_embeddings=64, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2, dropout=0.0,
    )
    torch.manual_seed(0)
    return transformers.BartForConditionalGeneration(config).train()


def seq2seq_sample(vocab_size: int = 128, source: int = 24, target: int = 16) -> dict:
    """Four source sequences and their labels (the decoder's inputs are derived from them)."""
    generator = torch.Generator().manual_seed(0)
    return {
        "input_ids": torch.randint(3, vocab_size, (4, source), generator=generator),
        "labels": torch.randint(3, vocab_size, (4, target), generator=generator),
    }


def causal_sample(vocab_size: int = 128, batch: int = 2, seq: int = 32) -> dict:
    """A causal language model's batch as fine-tuning scripts pass it: ids and labels."""
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, vocab_size, (batch, seq), generator=generator)
    return {"input_ids": input_ids, "labels": input_ids}
