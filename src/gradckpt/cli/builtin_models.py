"""The models ``gradckpt plan`` knows by name (``gradckpt plan --list``), and what a model to
plan is: the module, the batch it trains on, and a few words for the report."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = ["DTYPES", "PlanTarget", "BUILTIN_MODELS", "builtin_list"]

# --dtype: the short names people write, and torch's (what config_dtype holds).
DTYPES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}


@dataclass
class PlanTarget:
    """A model to plan, the batch it trains on, and a few words saying what it is;
    ``config_dtype``: the floating dtype its config names (``torch_dtype``), if any;
    ``dtype_applied``: the model is in the dtypes it trains in already (a fine-tuned base cast
    before its adapters were added), so nothing casts it again."""

    model: Any
    sample: Any
    description: str
    config_dtype: str | None = None
    dtype_applied: bool = False


def _tinygpt(layers: int) -> Callable[[int, int], PlanTarget]:
    def build(batch: int, seq: int) -> PlanTarget:
        import torch

        from gradckpt.toy_models import GPTConfig, TinyGPT

        model = TinyGPT(GPTConfig(n_layer=layers, block_size=max(seq, 128)))
        tokens = torch.randint(0, model.config.vocab_size, (batch, seq + 1))
        sample = {"idx": tokens[:, :-1], "targets": tokens[:, 1:]}
        return PlanTarget(model, sample, "TinyGPT (n_embd 128, vocab 512)")

    return build


def _mlp_chain(batch: int, seq: int) -> PlanTarget:
    import torch

    from gradckpt.toy_models import mlp_chain

    return PlanTarget(mlp_chain(16, 256), torch.randn(batch, seq, 256), "mlp_chain(16, 256)")


BUILTIN_MODELS: dict[str, tuple[str, Callable[[int, int], PlanTarget]]] = {
    "tinygpt": ("TinyGPT, 8 blocks, n_embd 128, vocab 512 (the demo's GPT)", _tinygpt(8)),
    "tinygpt-24": ("TinyGPT, 24 blocks, n_embd 128, vocab 512", _tinygpt(24)),
    "mlp-chain": ("16 blocks of Linear 256->256 + GELU + Dropout; input (batch, seq, 256)",
                  _mlp_chain),
}


def builtin_list() -> str:
    """The table ``gradckpt plan --list`` prints: each built-in model and what it is.

    Example:
        >>> [line.split()[0] for line in builtin_list().splitlines()]
        ['tinygpt', 'tinygpt-24', 'mlp-chain']
    """
    from gradckpt.report import format_table

    rows = [[name, description] for name, (description, _) in BUILTIN_MODELS.items()]
    return format_table(["built-in model", "what it is"], rows, align="ll").split("\n", 1)[1]
