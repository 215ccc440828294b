"""The attention kernel a GPU would run, run on fake tensors: what ``estimate`` saves for
attention is what the target saves, not what this machine's CPU would.

``torch.nn.functional.scaled_dot_product_attention`` picks a kernel per call from the tensors
and the GPU (PyTorch 2.13, ``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp``): in order
cuDNN attention (first only on compute capability 9.0 and 10.0), FlashAttention-2, the
memory-efficient kernel, and the math path, each taken when its conditions hold. What they keep
for backward differs by orders of magnitude at long sequences: the fused kernels keep their
output and one log-sum-exp per query (plus the inputs); the math path keeps the attention
weights, batch x heads x queries x keys, and with dropout its mask too. On fake CPU tensors
PyTorch would choose as a CPU does (its one fused kernel takes no dropout, so GPT-2 or BERT
training with attention dropout would be predicted on the math path). While ``estimate``
predicts a GPU, ``TargetAttention`` makes each call choose as that GPU would and runs the
chosen kernel's own ATen operation: its meta implementation gives the output's shape, its
autograd formula the tensors saved for backward, ``torch.utils.flop_counter`` its FLOPs.

The conditions are those of dense (not nested) inputs in a training step, with no backend
turned off by ``torch.nn.attention.sdpa_kernel``; the cuDNN version is taken to be a recent one
(9.10 or later, as PyTorch's CUDA 12.8+ builds ship), and a user-disabled backend is not seen.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

__all__ = ["TargetAttention", "choose_kernel"]

aten = torch.ops.aten
_HALF = (torch.float16, torch.bfloat16)


@dataclass
class _Call:
    """One ``scaled_dot_product_attention`` call's arguments."""

    query: torch.Tensor
    key: torch.Tensor
    value: torch.Tensor
    attn_mask: torch.Tensor | None = None
    dropout_p: float = 0.0
    is_causal: bool = False
    scale: float | None = None
    enable_gqa: bool = False

    @property
    def needs_grad(self) -> bool:
        return torch.is_grad_enabled() and any(
            t.requires_grad for t in (self.query, self.key, self.value))


def choose_kernel(call: _Call, capability: tuple[int, int]) -> str:
    """``"cudnn"``, ``"flash"``, ``"efficient"`` or ``"math"``: what PyTorch's CUDA build runs
    for ``call`` on a GPU of compute capability ``capability``.

    Example:
        >>> import torch
        >>> # (batch, heads, seq, dim) as Transformers makes it: a view of (batch, seq, heads, dim)
        >>> q = torch.empty(2, 128, 8, 64, dtype=torch.bfloat16).transpose(1, 2)
        >>> choose_kernel(_Call(q, q, q, dropout_p=0.1), (8, 0)), choose_kernel(_Call(q, q, q),
        ...                                                                     (9, 0))
        ('flash', 'cudnn')
        >>> f = q.float()  # fp32: no flash, no cuDNN
        >>> choose_kernel(_Call(f, f, f, attn_mask=torch.ones(128, 128, dtype=torch.bool)), (9, 0))
        'efficient'
        >>> odd = torch.empty(2, 8, 128, 70)  # fp32 head size 70: not a multiple of 4
        >>> choose_kernel(_Call(odd, odd, odd), (8, 0))
        'math'
    """
    if capability in ((9, 0), (10, 0)) and _cudnn_can_run(call, capability):
        return "cudnn"
    if _flash_can_run(call, capability):
        return "flash"
    if _efficient_can_run(call):
        return "efficient"
    return "math"


def _dense_ok(call: _Call, gqa_supported: bool) -> bool:
    q, k, v = call.query, call.key, call.value
    if not (q.dim() == k.dim() == v.dim() == 4):
        return False
    if not (q.size(0) == k.size(0) == v.size(0)):
        return False
    if min(q.size(2), k.size(2)) == 0:
        return False
    if any(t.size(-1) != 1 and t.stride(-1) != 1 for t in (q, k, v)):
        return False
    heads_q, heads_k, heads_v = q.size(1), k.size(1), v.size(1)
    if heads_q == heads_k == heads_v:
        return True
    return (gqa_supported and call.enable_gqa and heads_k == heads_v
            and heads_q % heads_k == 0)


def _cudnn_can_run(call: _Call, capability: tuple[int, int]) -> bool:
    q, k, v = call.query, call.key, call.value
    if torch.are_deterministic_algorithms_enabled() and not (
            torch.is_deterministic_algorithms_warn_only_enabled()):
        return False
    if q.dtype not in _HALF or not _dense_ok(call, gqa_supported=True):
        return False
    limit = 256 if capability == (9, 0) else 128
    d_qk, d_v = q.size(-1), v.size(-1)
    if d_qk > limit or d_v > limit or d_qk % 8 or d_v % 8:
        return False
    if k.size(2) == 1 or (q.size(2) == 1 and call.dropout_p > 0):
        return False
    return _cudnn_layout(v, packed=True) or all(_cudnn_layout(t) for t in (q, k, v))


def _cudnn_layout(t: torch.Tensor, packed: bool = False) -> bool:
    """(batch, heads, seq, dim) as a view of (batch, seq, heads, dim), or of packed QKV."""
    _, heads, seq, dim = t.shape
    width = 3 * heads * dim if packed else heads * dim
    return t.stride() == (seq * width, dim, width, 1)


def _flash_can_run(call: _Call, capability: tuple[int, int]) -> bool:
    q, k, v = call.query, call.key, call.value
    if call.attn_mask is not None or q.dtype not in _HALF:
        return False
    dim = q.size(-1)
    if not (dim == k.size(-1) == v.size(-1)) or dim > 256:
        return False
    if not ((8, 0) <= capability <= (12, 1)):
        return False
    # Its backward fails for these head sizes on sm86-89 and sm120-121, so they are refused.
    consumer = (8, 6) <= capability <= (8, 9) or (12, 0) <= capability <= (12, 1)
    if call.needs_grad and consumer and (
            192 < dim <= 224 or (dim > 224 and call.dropout_p > 0)):
        return False
    if call.is_causal and q.size(2) != k.size(2):
        return False
    return _dense_ok(call, gqa_supported=True)


def _efficient_can_run(call: _Call) -> bool:
    q, k, v = call.query, call.key, call.value
    if q.dtype not in (*_HALF, torch.float32):
        return False
    alignment = 8 if q.dtype in _HALF else 4  # tensor-core GEMM alignment on sm80+
    if q.size(-1) != k.size(-1) or q.size(-1) % alignment or v.size(-1) % alignment:
        return False
    if any(t.stride(-1) != 1 for t in (q, k, v)):
        return False
    return _dense_ok(call, gqa_supported=False)


def _additive_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask as the fused kernels take it: a new tensor of zeros and -inf."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask.logical_not(), -math.inf)


def _aligned_bias(bias: torch.Tensor | None, call: _Call) -> torch.Tensor | None:
    """The memory-efficient kernel's bias: last dimension padded to a multiple of 16, then
    expanded to (batch, heads, queries, keys) (a view)."""
    if bias is None:
        return None
    keys = bias.size(-1)
    if keys % 16:
        bias = F.pad(bias, (0, 16 - keys % 16))[..., :keys]
    shape = (call.query.size(0), call.query.size(1), call.query.size(2), call.key.size(2))
    return bias.expand(shape)


def _run_flash(call: _Call) -> torch.Tensor:
    dim = call.query.size(-1)
    padding = (8 - dim % 8) % 8
    scale = call.scale if call.scale is not None else 1 / math.sqrt(dim)
    q, k, v = (F.pad(t, (0, padding)) if padding else t
               for t in (call.query, call.key, call.value))
    out = aten._scaled_dot_product_flash_attention(
        q, k, v, call.dropout_p, call.is_causal, False, scale=scale)[0]
    return out[..., :dim] if padding else out


def _run_efficient(call: _Call) -> torch.Tensor:
    bias = _aligned_bias(_additive_mask(call.attn_mask, call.query.dtype), call)
    return aten._scaled_dot_product_efficient_attention(
        call.query, call.key, call.value, bias, call.needs_grad, call.dropout_p,
        call.is_causal, scale=call.scale)[0]


def _run_cudnn(call: _Call) -> torch.Tensor:
    bias = _additive_mask(call.attn_mask, call.query.dtype)
    return aten._scaled_dot_product_cudnn_attention(
        call.query, call.key, call.value, bias, call.needs_grad, call.dropout_p,
        call.is_causal, False, scale=call.scale)[0]


def _run_math(call: _Call) -> torch.Tensor:
    return aten._scaled_dot_product_attention_math(
        call.query, call.key, call.value, call.attn_mask, call.dropout_p, call.is_causal,
        None, scale=call.scale, enable_gqa=call.enable_gqa)[0]


_RUN = {"cudnn": _run_cudnn, "flash": _run_flash, "efficient": _run_efficient,
        "math": _run_math}
_ARGUMENTS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale",
              "enable_gqa")


class TargetAttention:
    """While entered, ``torch.nn.functional.scaled_dot_product_attention`` runs the kernel a
    GPU of ``capability`` would choose (``choose_kernel``); ``kernels`` collects their names.

    The function is replaced in ``torch.nn.functional`` for the duration (process-wide), not
    intercepted with a ``TorchFunctionMode``: a mode is off while its handler runs, and the
    handler of ``backward`` would then run checkpointed recomputations, whose attention must
    choose as the forward's did, without it. Code that imported the function by name before
    (``from torch.nn.functional import scaled_dot_product_attention``) keeps PyTorch's choice.

    Example:
        >>> import torch
        >>> from torch._subclasses.fake_tensor import FakeTensorMode
        >>> with FakeTensorMode():
        ...     q = torch.empty(2, 4, 1024, 64, dtype=torch.bfloat16, requires_grad=True)
        ...     with TargetAttention((8, 0)) as target:
        ...         out = torch.nn.functional.scaled_dot_product_attention(
        ...             q, q, q, dropout_p=0.1, is_causal=True)
        >>> sorted(target.kernels), out.grad_fn.name()
        (['flash'], 'ScaledDotProductFlashAttentionBackward0')
    """

    def __init__(self, capability: tuple[int, int] | None) -> None:
        self.capability = capability or (8, 0)
        self.kernels: set[str] = set()
        self._original: Any = None

    def __call__(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        call = _Call(**dict(zip(_ARGUMENTS, args, strict=False)), **kwargs)
        kernel = choose_kernel(call, self.capability)
        self.kernels.add(kernel)
        return _RUN[kernel](call)

    def __enter__(self) -> TargetAttention:
        self._original = F.scaled_dot_product_attention
        F.scaled_dot_product_attention = self
        return self

    def __exit__(self, *exc: Any) -> None:
        F.scaled_dot_product_attention = self._original
