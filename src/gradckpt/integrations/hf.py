"""Hugging Face Transformers: caches off while gradckpt works, a model from its ``config.json``,
and the batch it trains on.

Transformers is imported inside the functions that need it, so that importing this module works
without it (``gradckpt`` imports it to register ``turn_caches_off``; the command line imports it
whatever model it plans); only building a model from a config needs the ``hf`` extra.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..adapters import register_adapter

__all__ = [
    "NoLanguageModelError", "is_language_model", "model_from_config_json", "token_sample",
    "turn_caches_off",
]


def turn_caches_off(model: Any) -> Callable[[], None] | None:
    """Set ``use_cache = False`` on every config of ``model`` that has it true; return a
    function that turns them back on (``None`` when there were none).

    With ``config.use_cache`` true, a Transformers model hands its layers a cache object even in
    a training step, and each layer appends its keys and values to it. A recomputed layer would
    append them again, and profiling re-runs each layer on its own; the cache is useless for
    training anyway. Transformers' own gradient checkpointing turns it off for the same
    reasons. Registered as an adapter (``gradckpt.adapters``): gradckpt turns caches off while
    it profiles a model and while a plan is applied, and puts them back after.

    Example:
        >>> import torch
        >>> from types import SimpleNamespace
        >>> model = torch.nn.Linear(2, 2)
        >>> model.config = SimpleNamespace(use_cache=True)
        >>> restore = turn_caches_off(model)
        >>> model.config.use_cache
        False
        >>> restore()
        >>> model.config.use_cache
        True
    """
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None}
    turned_off = [c for c in configs.values() if getattr(c, "use_cache", False) is True]
    if not turned_off:
        return None
    for config in turned_off:
        config.use_cache = False

    def restore() -> None:
        for config in turned_off:
            config.use_cache = True

    return restore


register_adapter(turn_caches_off)


class NoLanguageModelError(ValueError):
    """Transformers has neither a causal nor a sequence-to-sequence language model for a config
    (a vision model's, say): it cannot be built from the config alone."""


def model_from_config_json(path: str | Path) -> Any:
    """The language model a Hugging Face ``config.json`` describes, with random weights.

    Nothing is downloaded. Encoder-decoder configs (T5, BART) give the sequence-to-sequence
    model, the others the causal one; the key/value cache is off, as for training.

    Example:
        >>> import json, pathlib, tempfile
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "config.json"
        >>> settings = {"model_type": "gpt2", "n_layer": 2, "n_embd": 32, "n_head": 2,
        ...             "vocab_size": 64, "n_positions": 32}
        >>> _ = path.write_text(json.dumps(settings))
        >>> model = model_from_config_json(path)
        >>> type(model).__name__, model.config.use_cache
        ('GPT2LMHeadModel', False)
    """
    try:
        import transformers
    except ImportError:
        raise ImportError(
            "planning a config.json needs Hugging Face Transformers: pip install 'gradckpt[hf]'"
        ) from None
    path = Path(path)
    try:
        settings = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path} is not valid JSON ({error})") from None
    if not isinstance(settings, dict) or "model_type" not in settings:
        raise ValueError(f"{path} has no 'model_type': not a Hugging Face model config.json")
    config = transformers.AutoConfig.for_model(**settings)
    config.use_cache = False  # training: the key/value cache only costs memory
    # Encoder-decoder configs (T5, BART) train as sequence-to-sequence models, the rest as
    # causal language models; both on input_ids and labels.
    seq2seq = bool(getattr(config, "is_encoder_decoder", False))
    auto = transformers.AutoModelForSeq2SeqLM if seq2seq else transformers.AutoModelForCausalLM
    try:
        return auto.from_config(config)  # random weights
    except ValueError:
        kind = "sequence-to-sequence" if seq2seq else "causal language"
        raise NoLanguageModelError(
            f"{path}: Transformers has no {kind} model for model_type "
            f"{settings['model_type']!r}"
        ) from None


def is_language_model(model: Any) -> bool:
    """Whether ``model`` has a Hugging Face config with a vocabulary, so that ``token_sample``
    can make its batch.

    Example:
        >>> import torch
        >>> is_language_model(torch.nn.Linear(2, 2))
        False
    """
    return isinstance(getattr(getattr(model, "config", None), "vocab_size", None), int)


def token_sample(model: Any, batch: int, seq: int) -> dict[str, Any]:
    """Random ``input_ids`` and ``labels`` of shape (batch, seq): what a causal language model
    trains on (a sequence-to-sequence one reads labels as its targets, of the same length here).

    Example:
        >>> from types import SimpleNamespace
        >>> sample = token_sample(SimpleNamespace(config=SimpleNamespace(vocab_size=64)), 2, 8)
        >>> tuple(sample["input_ids"].shape), bool((sample["labels"] == sample["input_ids"]).all())
        ((2, 8), True)
    """
    import torch

    tokens = torch.randint(0, model.config.vocab_size, (batch, seq))
    return {"input_ids": tokens, "labels": tokens.clone()}
