"""Small built-in models for the demo, the tests and the benchmarks.

Everything here is a plain ``nn.Module`` that reads top to bottom, in the style of nanoGPT:

- ``TinyGPT``: a GPT-2-style decoder (token + position embeddings, a stack of ``Block``s, a final
  LayerNorm and a language-model head). Its ``transformer.h`` is the chain of blocks that
  checkpointing works on.
- ``mlp_chain``: a stack of Linear + GELU + Dropout blocks, the simplest chain there is.
- ``small_cnn``: Conv2d + BatchNorm2d + ReLU blocks, for checking that recomputation leaves
  BatchNorm running statistics exactly as one forward pass would.

Example:
    >>> import torch
    >>> from gradckpt.toy_models import GPTConfig, TinyGPT
    >>> model = TinyGPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
    >>> idx = torch.randint(0, 512, (2, 16))
    >>> model(idx).shape
    torch.Size([2, 16, 512])
    >>> model(idx, targets=idx).ndim  # with targets: the scalar cross-entropy loss
    0
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPTConfig",
    "TinyGPT",
    "Block",
    "CausalSelfAttention",
    "MLP",
    "mlp_chain",
    "small_cnn",
]


@dataclass
class GPTConfig:
    """Sizes of a ``TinyGPT``.

    Example:
        >>> GPTConfig(n_layer=8).n_embd
        128
    """

    vocab_size: int = 512
    block_size: int = 128  # the longest sequence the position embedding covers
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.1
    bias: bool = True  # bias in Linear and LayerNorm layers


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention through ``F.scaled_dot_product_attention``.

    Causal by default; given a boolean ``attention_mask`` (True = may attend, broadcastable to
    ``(batch, n_head, seq, seq)``) it uses that mask instead.

    Example:
        >>> attn = CausalSelfAttention(GPTConfig(n_embd=32, n_head=2))
        >>> attn(torch.randn(2, 5, 32)).shape
        torch.Size([2, 5, 32])
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        if config.n_embd % config.n_head != 0:
            raise ValueError(
                f"n_embd ({config.n_embd}) must be a multiple of n_head ({config.n_head})"
            )
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        # query, key and value for all heads in one matmul
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq, channels = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        # (batch, seq, channels) -> (batch, n_head, seq, head_size)
        q = q.view(batch, seq, self.n_head, channels // self.n_head).transpose(1, 2)
        k = k.view(batch, seq, self.n_head, channels // self.n_head).transpose(1, 2)
        v = v.view(batch, seq, self.n_head, channels // self.n_head).transpose(1, 2)
        # Attention dropout happens inside SDPA, so it draws random numbers: recomputing this
        # module must replay the RNG state to reproduce the forward pass.
        dropout_p = self.dropout if self.training else 0.0
        if attention_mask is None:
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)
        else:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=attention_mask, dropout_p=dropout_p
            )
        y = y.transpose(1, 2).contiguous().view(batch, seq, channels)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """Linear to 4x width, GELU, Linear back, Dropout.

    Example:
        >>> MLP(GPTConfig(n_embd=32))(torch.randn(2, 5, 32)).shape
        torch.Size([2, 5, 32])
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One pre-LayerNorm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``.

    ``attention_mask`` is an optional boolean keyword argument (True = may attend) passed on to
    the attention; without it attention is causal.

    Example:
        >>> block = Block(GPTConfig(n_embd=32, n_head=2))
        >>> x = torch.randn(2, 5, 32)
        >>> block(x).shape
        torch.Size([2, 5, 32])
        >>> mask = torch.ones(5, 5, dtype=torch.bool).tril()
        >>> block(x, attention_mask=mask).shape
        torch.Size([2, 5, 32])
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), attention_mask=attention_mask)
        x = x + self.mlp(self.ln_2(x))
        return x


class TinyGPT(nn.Module):
    """A small GPT-2-style language model (nanoGPT's layout, without weight tying).

    ``forward(idx)`` returns logits of shape ``(batch, seq, vocab_size)``;
    ``forward(idx, targets)`` returns the scalar mean cross-entropy loss instead, which is all a
    training step needs.

    Example:
        >>> model = TinyGPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
        >>> [name for name, _ in model.transformer.h.named_children()]
        ['0', '1']
        >>> tokens = torch.randint(0, 512, (2, 9))
        >>> loss = model(tokens[:, :-1], targets=tokens[:, 1:])
        >>> loss.backward()
    """

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)

        # GPT-2 initialisation: small normal weights, zero biases, and the residual projections
        # scaled down by sqrt(2 * n_layer) so the residual stream does not grow with depth.
        self.apply(self._init_weights)
        for name, parameter in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(parameter, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        batch, seq = idx.shape
        if seq > self.config.block_size:
            raise ValueError(
                f"sequence length {seq} is longer than block_size {self.config.block_size}"
            )
        positions = torch.arange(seq, dtype=torch.long, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(positions))
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))
        if targets is None:
            return logits
        return F.cross_entropy(logits.view(-1, logits.size(-1)), targets.reshape(-1))


def mlp_chain(depth: int, width: int, dropout: float = 0.1) -> nn.Sequential:
    """A chain of ``depth`` blocks, each ``nn.Sequential(Linear(width, width), GELU, Dropout)``.

    Example:
        >>> chain = mlp_chain(depth=3, width=8)
        >>> len(chain), chain(torch.randn(4, 8)).shape
        (3, torch.Size([4, 8]))
    """
    return nn.Sequential(
        *[
            nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Dropout(dropout))
            for _ in range(depth)
        ]
    )


def small_cnn(
    in_channels: int = 3, width: int = 16, depth: int = 3, num_classes: int = 10
) -> nn.Sequential:
    """A small image classifier: ``depth`` Conv2d + BatchNorm2d + ReLU blocks, then a head.

    Each block is an ``nn.Sequential(Conv2d(3x3, padding 1), BatchNorm2d, ReLU)`` that keeps the
    spatial size; the last item is the head (global average pool, flatten, Linear). BatchNorm
    updates its running statistics in every training forward pass, which is what makes this
    model useful for checking that recomputation has no visible side effects.

    Example:
        >>> cnn = small_cnn()
        >>> cnn(torch.randn(2, 3, 8, 8)).shape
        torch.Size([2, 10])
    """
    blocks: list[nn.Module] = []
    channels = in_channels
    for _ in range(depth):
        blocks.append(
            nn.Sequential(
                nn.Conv2d(channels, width, kernel_size=3, padding=1, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(),
            )
        )
        channels = width
    head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, num_classes))
    return nn.Sequential(*blocks, head)
