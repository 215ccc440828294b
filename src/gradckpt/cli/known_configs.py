"""Well-known models ``gradckpt plan`` knows by name: their hyper-parameters only, no weights.

Each entry is what the model's published ``config.json`` says, as a Transformers config dict
(``model_type`` and the fields that decide the architecture and its sizes), written here from
the public config files named in each entry's ``source`` (checked against copies of them).
Token ids, initializer ranges and other fields that change no tensor's size are left out;
``AutoConfig.for_model`` fills them with Transformers' defaults.

They are meant for ``gradckpt plan NAME --estimate``: the model is built on the meta device
(parameters with shapes, no memory) and its step predicted on fake tensors, so an 8B model
plans on a laptop. A measured plan builds the real model, which only a machine holding its
parameters and gradients can do (``check_fits_for_measuring``).

Example:
    >>> known = KNOWN_CONFIGS["llama-3-8b"]
    >>> known.settings["num_hidden_layers"], known.settings["hidden_size"], known.dtype
    (32, 4096, 'bfloat16')
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["KnownConfig", "KNOWN_CONFIGS", "known_config_rows"]


@dataclass(frozen=True)
class KnownConfig:
    """A published model's hyper-parameters.

    - ``settings``: a Transformers config dict (``model_type`` and fields).
    - ``dtype``: the published ``torch_dtype``, the dtype ``--estimate`` trains in by default
      (``None``: none published, so fp32). Kept apart from ``settings`` because Transformers 5
      renamed the key to ``dtype`` and warns about the old one, while older versions only
      know the old one.
    - ``source``: the Hugging Face repository whose ``config.json`` the numbers are from.
    """

    description: str
    settings: dict[str, Any]
    dtype: str | None
    source: str


KNOWN_CONFIGS: dict[str, KnownConfig] = {
    # huggingface.co/meta-llama/Meta-Llama-3-8B, config.json (LlamaForCausalLM).
    "llama-3-8b": KnownConfig(
        description="32 layers, hidden 4096, 32 heads (8 kv), vocab 128256",
        settings={
            "model_type": "llama",
            "vocab_size": 128256,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "hidden_act": "silu",
            "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-05,
            "rope_theta": 500000.0,
            "attention_bias": False,
            "tie_word_embeddings": False,
        },
        dtype="bfloat16",
        source="meta-llama/Meta-Llama-3-8B",
    ),
    # huggingface.co/mistralai/Mistral-7B-v0.1, config.json (MistralForCausalLM). Its attention
    # looks back at most sliding_window = 4096 tokens.
    "mistral-7b": KnownConfig(
        description="32 layers, hidden 4096, 32 heads (8 kv), vocab 32000, attention window 4096",
        settings={
            "model_type": "mistral",
            "vocab_size": 32000,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "hidden_act": "silu",
            "max_position_embeddings": 32768,
            "rms_norm_eps": 1e-05,
            "rope_theta": 10000.0,
            "sliding_window": 4096,
            "tie_word_embeddings": False,
        },
        dtype="bfloat16",
        source="mistralai/Mistral-7B-v0.1",
    ),
    # huggingface.co/Qwen/Qwen2.5-7B, config.json (Qwen2ForCausalLM): biases on q, k and v
    # (Transformers' Qwen2 always has them), full attention (use_sliding_window false).
    "qwen2.5-7b": KnownConfig(
        description="28 layers, hidden 3584, 28 heads (4 kv), vocab 152064",
        settings={
            "model_type": "qwen2",
            "vocab_size": 152064,
            "hidden_size": 3584,
            "intermediate_size": 18944,
            "num_hidden_layers": 28,
            "num_attention_heads": 28,
            "num_key_value_heads": 4,
            "hidden_act": "silu",
            "max_position_embeddings": 131072,
            "rms_norm_eps": 1e-06,
            "rope_theta": 1000000.0,
            "use_sliding_window": False,
            "sliding_window": 131072,
            "max_window_layers": 28,
            "tie_word_embeddings": False,
        },
        dtype="bfloat16",
        source="Qwen/Qwen2.5-7B",
    ),
    # huggingface.co/openai-community/gpt2-xl, config.json (GPT2LMHeadModel): no torch_dtype
    # (the checkpoint is fp32), output embedding tied to the input one (GPT-2's default).
    "gpt2-xl": KnownConfig(
        description="48 layers, hidden 1600, 25 heads, vocab 50257, 1024 positions",
        settings={
            "model_type": "gpt2",
            "vocab_size": 50257,
            "n_embd": 1600,
            "n_layer": 48,
            "n_head": 25,
            "n_positions": 1024,
            "n_ctx": 1024,
            "activation_function": "gelu_new",
            "layer_norm_epsilon": 1e-05,
            "resid_pdrop": 0.1,
            "embd_pdrop": 0.1,
            "attn_pdrop": 0.1,
            "tie_word_embeddings": True,
        },
        dtype=None,
        source="openai-community/gpt2-xl",
    ),
}


def known_config_rows() -> list[list[str]]:
    """Rows for ``gradckpt plan --list``: each known config, what it is and where from.

    Example:
        >>> [row[0] for row in known_config_rows()]
        ['llama-3-8b', 'mistral-7b', 'qwen2.5-7b', 'gpt2-xl']
    """
    return [
        [name, f"{known.description}; {known.source}, {known.dtype or 'float32'}"]
        for name, known in KNOWN_CONFIGS.items()
    ]
