"""The model families people fine-tune, tiny and built from configs (random weights, nothing
downloaded), each with the batch it trains on: the one catalogue the tests and ``bench/`` use.

``FAMILIES``: GPT-2, Llama, Qwen2, BERT (masked LM), T5 and ViT called with their labels, so
that the output has ``.loss``; a CNN with BatchNorm and a stack of frozen MLPs with hand-written
LoRA adapters (plain torch, ``loss_fn=mean_square``); PEFT's LoRA on Llama. Each ``Family``
builds its model (``fresh()``: seeded, in training mode, caches off) and its sample, at its own
size or another (``make_sample(*size)``). The builders and batch makers are public too, so a
test can take Llama with other sizes (``hf_model("llama", num_hidden_layers=2)``: keywords are
the Transformers config's) or BART and CLIP, which no family measures.

Transformers and PEFT are imported inside the builders: importing this module needs neither;
building one of their models needs the ``hf`` extra. Nothing imports this module but those who
want a model from it (``gradckpt`` itself does not).

Example:
    >>> cnn = family("cnn")
    >>> model = cnn.fresh()
    >>> cnn.loss_fn(model(cnn.sample())).shape, cnn.make_sample(2, 32, 32).shape
    (torch.Size([]), torch.Size([2, 3, 32, 32]))
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UsageError, did_you_mean
from .hf import turn_caches_off

__all__ = [
    "VOCAB", "Family", "FAMILIES", "family", "families", "mean_square",
    "token_ids", "causal_batch", "masked_batch", "seq2seq_batch", "labelled_images", "images",
    "hidden_states", "HF_MODELS", "hf_model", "clip", "cnn", "lora_stack", "peft_llama",
    "LoRABlock",
]

VOCAB = 1000  # every token family's vocabulary


# ---------------------------------------------------------------------------------------------
# Batches
# ---------------------------------------------------------------------------------------------


def token_ids(batch: int, seq: int, vocab_size: int = VOCAB, *, first_id: int = 3,
              seed: int = 1, generator: torch.Generator | None = None) -> torch.Tensor:
    """Random token ids ``first_id`` .. ``vocab_size - 1`` (ids 0-2 are the configs' special
    tokens), drawn from ``generator`` or one seeded with ``seed``.

    Example:
        >>> ids = token_ids(2, 5)
        >>> ids.shape, bool((ids >= 3).all()), torch.equal(ids, token_ids(2, 5))
        (torch.Size([2, 5]), True, True)
    """
    generator = generator or torch.Generator().manual_seed(seed)
    return torch.randint(first_id, vocab_size, (batch, seq), generator=generator)


def causal_batch(batch: int = 2, seq: int = 128, vocab_size: int = VOCAB, *,
                 first_id: int = 3, seed: int = 1) -> dict:
    """A causal language model's batch as fine-tuning scripts pass it: ids, labels = ids.

    Example:
        >>> sorted(causal_batch(1, 8))
        ['input_ids', 'labels']
    """
    ids = token_ids(batch, seq, vocab_size, first_id=first_id, seed=seed)
    return {"input_ids": ids, "labels": ids}


def masked_batch(batch: int = 2, seq: int = 128, vocab_size: int = VOCAB) -> dict:
    """A masked language model's batch: one token in seven predicted (labels -100 elsewhere),
    as masked LM recipes do.

    Example:
        >>> masked_batch(1, 8)["labels"][0, 1].item()
        -100
    """
    ids = token_ids(batch, seq, vocab_size)
    labels = torch.full_like(ids, -100)
    labels[:, ::7] = ids[:, ::7]
    return {"input_ids": ids, "labels": labels}


def seq2seq_batch(batch: int = 2, source: int = 96, target: int | None = None,
                  vocab_size: int = VOCAB, *, generator: torch.Generator | None = None) -> dict:
    """Source sequences and their labels (``target`` long, default half of ``source``; the
    decoder's inputs are derived from the labels). The ids come from ``generator``, or the
    inputs from seed 1 and the labels from seed 2.

    Example:
        >>> {name: list(t.shape) for name, t in seq2seq_batch(2, 10).items()}
        {'input_ids': [2, 10], 'labels': [2, 5]}
    """
    target = source // 2 if target is None else target
    return {"input_ids": token_ids(batch, source, vocab_size, generator=generator, seed=1),
            "labels": token_ids(batch, target, vocab_size, generator=generator, seed=2)}


def labelled_images(batch: int = 4, height: int = 64, width: int = 64) -> dict:
    """RGB images and one of 10 class labels each (``pixel_values``, ``labels``).

    Example:
        >>> labelled_images(2, 8, 8)["pixel_values"].shape
        torch.Size([2, 3, 8, 8])
    """
    generator = torch.Generator().manual_seed(1)
    return {"pixel_values": torch.randn(batch, 3, height, width, generator=generator),
            "labels": torch.randint(0, 10, (batch,), generator=generator)}


def images(batch: int = 8, height: int = 48, width: int = 48) -> torch.Tensor:
    """A batch of RGB images, unlabelled.

    Example:
        >>> images(2, 8, 8).shape
        torch.Size([2, 3, 8, 8])
    """
    return torch.randn(batch, 3, height, width, generator=torch.Generator().manual_seed(1))


def hidden_states(batch: int = 8, seq: int = 64, width: int = 128) -> torch.Tensor:
    """Hidden states (batch, seq, width), as a stack of blocks takes them.

    Example:
        >>> hidden_states(2, 3, 4).shape
        torch.Size([2, 3, 4])
    """
    return torch.randn(batch, seq, width, generator=torch.Generator().manual_seed(1))


def mean_square(output: torch.Tensor) -> torch.Tensor:
    """The loss of the families whose output is a plain tensor.

    Example:
        >>> mean_square(torch.full((2, 2), 3.0))
        tensor(9.)
    """
    return output.square().mean()


# ---------------------------------------------------------------------------------------------
# Models (keywords: the Transformers config's fields, over the sizes given here)
# ---------------------------------------------------------------------------------------------


def _transformers() -> Any:
    import transformers

    return transformers


# Llama and Qwen2 share their architecture's sizes here.
_DECODER_SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128,
                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                      max_position_embeddings=128)

# The Transformers models of the catalogue: model class, config class, and the config's sizes
# here. Llama's attention dropout makes recomputation replay the RNG.
HF_MODELS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "gpt2": ("GPT2LMHeadModel", "GPT2Config", dict(
        vocab_size=VOCAB, n_embd=64, n_layer=4, n_head=4, n_positions=128, bos_token_id=0,
        eos_token_id=0)),
    "llama": ("LlamaForCausalLM", "LlamaConfig", _DECODER_SIZES | {"attention_dropout": 0.1}),
    "qwen2": ("Qwen2ForCausalLM", "Qwen2Config", _DECODER_SIZES),
    "bert": ("BertForMaskedLM", "BertConfig", dict(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128)),
    "t5": ("T5ForConditionalGeneration", "T5Config", dict(
        vocab_size=VOCAB, d_model=64, num_layers=3, num_decoder_layers=3, num_heads=4, d_kv=16,
        d_ff=128, decoder_start_token_id=0)),
    "vit": ("ViTForImageClassification", "ViTConfig", dict(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128,
        image_size=64, patch_size=8, num_labels=10)),
    "bart": ("BartForConditionalGeneration", "BartConfig", dict(
        vocab_size=VOCAB, d_model=64, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=128,
        decoder_ffn_dim=128, max_position_embeddings=64, pad_token_id=1, bos_token_id=0,
        eos_token_id=2, decoder_start_token_id=2, dropout=0.0)),
}


def hf_model(kind: str, **config: Any) -> nn.Module:
    """The Transformers model ``kind`` (a key of ``HF_MODELS``) with random weights, built from
    its config at the sizes there; keywords (the config's fields) win over them.

    Example:
        >>> hf_model("llama", num_hidden_layers=1).config.attention_dropout
        0.1
        >>> hf_model("t5", num_layers=1, num_decoder_layers=1).config.d_model
        64
        >>> hf_model("lama")
        Traceback (most recent call last):
        ...
        gradckpt.errors.UsageError: unknown model kind 'lama' (known: gpt2, llama, ...); did you ...
    """
    if kind not in HF_MODELS:
        raise UsageError(f"unknown model kind {kind!r} (known: {', '.join(HF_MODELS)})"
                         f"{did_you_mean(kind, HF_MODELS)}")
    model_class, config_class, sizes = HF_MODELS[kind]
    t = _transformers()
    return getattr(t, model_class)(getattr(t, config_class)(**sizes | config))


def clip(text_vocab_size: int = 64) -> nn.Module:
    """CLIPModel: two towers of 2 layers, hidden 32; the text tower is created first, the
    vision tower runs first.

    Example:
        >>> clip().config.projection_dim
        16
    """
    t = _transformers()
    text = t.CLIPTextConfig(
        vocab_size=text_vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=2, max_position_embeddings=16, bos_token_id=0, eos_token_id=2)
    vision = t.CLIPVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                num_attention_heads=2, image_size=16, patch_size=8)
    return t.CLIPModel(t.CLIPConfig(text_config=text.to_dict(), vision_config=vision.to_dict(),
                                    projection_dim=16))


def cnn() -> nn.Module:
    """Four stages of Conv2d + BatchNorm + ReLU, pooled, then a linear classifier.

    Example:
        >>> cnn()(images(2, 16, 16)).shape
        torch.Size([2, 10])
    """

    def stage(channels_in: int, channels_out: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(channels_in, channels_out, 3, padding=1),
                             nn.BatchNorm2d(channels_out), nn.ReLU())

    return nn.Sequential(stage(3, 16), stage(16, 16), stage(16, 16), stage(16, 16),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


class LoRABlock(nn.Module):
    """A frozen base MLP with trainable low-rank adapters on both projections.

    Example:
        >>> LoRABlock(width=8, rank=2)(hidden_states(1, 2, 8)).shape
        torch.Size([1, 2, 8])
    """

    def __init__(self, width: int = 128, rank: int = 8) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width).requires_grad_(False)
        self.down = nn.Linear(4 * width, width).requires_grad_(False)
        self.up_a = nn.Parameter(torch.randn(rank, width) / width)
        self.up_b = nn.Parameter(torch.zeros(4 * width, rank))
        self.down_a = nn.Parameter(torch.randn(rank, 4 * width) / width)
        self.down_b = nn.Parameter(torch.randn(width, rank) / rank)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(self.norm(x)) + x @ self.up_a.t() @ self.up_b.t()
        h = F.gelu(h)
        return x + self.down(h) + h @ self.down_a.t() @ self.down_b.t()


def lora_stack() -> nn.Module:
    """Six ``LoRABlock`` of width 128.

    Example:
        >>> len(lora_stack())
        6
    """
    return nn.Sequential(*(LoRABlock() for _ in range(6)))


def peft_llama() -> nn.Module:
    """``hf_model("llama")`` with PEFT's LoRA (rank 8) on the attention's q and v projections.

    Example:
        >>> model = peft_llama()
        >>> sorted({name.split(".")[-3] for name, p in model.named_parameters() if p.requires_grad})
        ['lora_A', 'lora_B']
    """
    import peft

    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                             lora_dropout=0.1)
    return peft.get_peft_model(hf_model("llama"), config)


# ---------------------------------------------------------------------------------------------
# The families
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Family:
    """A model family: its model, its batch at ``size`` (or any, ``make_sample(*size)``), and
    its loss where the output has no ``.loss``."""

    name: str
    build: Callable[[], nn.Module]
    make_sample: Callable[..., Any]
    size: tuple[int, ...]
    loss_fn: Callable[[Any], torch.Tensor] | None = None

    def sample(self) -> Any:
        """The batch at the family's own size."""
        return self.make_sample(*self.size)

    def fresh(self) -> nn.Module:
        """The model, seeded (the same weights every time), in training mode, caches off as
        fine-tuning scripts set them (and as gradckpt does while a plan is applied)."""
        torch.manual_seed(0)
        model = self.build().train()
        turn_caches_off(model)
        return model


FAMILIES = [
    Family("gpt2", functools.partial(hf_model, "gpt2"), causal_batch, (2, 128)),
    Family("llama", functools.partial(hf_model, "llama"), causal_batch, (2, 128)),
    Family("qwen2", functools.partial(hf_model, "qwen2"), causal_batch, (2, 128)),
    Family("bert", functools.partial(hf_model, "bert"), masked_batch, (2, 128)),
    Family("t5", functools.partial(hf_model, "t5"), seq2seq_batch, (2, 96)),
    Family("vit", functools.partial(hf_model, "vit"), labelled_images, (4, 64, 64)),
    Family("cnn", cnn, images, (8, 48, 48), mean_square),
    Family("lora", lora_stack, hidden_states, (8, 64, 128), mean_square),
    Family("peft-llama", peft_llama, causal_batch, (2, 128)),
]


def family(name: str) -> Family:
    """The family called ``name``.

    Example:
        >>> family("t5").size
        (2, 96)
    """
    return families(name)[0]


def families(names: str | None = None) -> list[Family]:
    """The families a comma-separated list names, in ``FAMILIES`` order (all for None or "");
    a name it does not know is a ``ValueError`` listing those it knows.

    Example:
        >>> [f.name for f in families("t5,llama")]
        ['llama', 't5']
        >>> families("llama,gpt5")
        Traceback (most recent call last):
        ...
        ValueError: unknown family gpt5; known: gpt2, llama, qwen2, bert, t5, vit, cnn, lora, peft-llama
    """  # noqa: E501  (a doctest's output is one line)
    if not names:
        return list(FAMILIES)
    wanted = names.split(",")
    known = [f.name for f in FAMILIES]
    unknown = [name for name in wanted if name not in known]
    if unknown:
        raise ValueError(f"unknown family {', '.join(unknown)}; known: {', '.join(known)}")
    return [f for f in FAMILIES if f.name in wanted]
