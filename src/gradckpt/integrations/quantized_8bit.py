"""8-bit bases (bitsandbytes ``Linear8bitLt``, LLM.int8(): ``load_in_8bit=True``) under LoRA,
measured and estimated as they train.

Such a layer holds its weight as int8 rows (``CB``, the parameter's own data) and one fp32 scale
per row (``SCB``), and trains frozen through one of two bitsandbytes autograd functions,
chosen by the input's device:

- **CPU (and XPU): ``MatMul8bitFp``.** The weight dequantised into the input's dtype (a
  transient of the weight's shape), then ``linear``; backward dequantises it again.
- **GPU: ``MatMul8bitLt``.** An fp16 copy of the input, quantised row by row to int8 (with an
  outlier threshold, 6.0 as Transformers loads it: the columns holding a larger value are
  computed apart, in the input's dtype), an int8 matmul into an int32 accumulator, dequantised
  into fp16 and cast to the input's dtype. The accumulator, the fp16 result and the outlier
  search (a mask of the input) live inside custom operations. Backward dequantises the
  weight, as on CPU. ``estimate``'s modeled clock counts the int8 matmul's FLOPs (2·M·N·K,
  registered below) at the target's INT8 tensor-core rate.

Four things a meter that sees operations (``MemoryMeter`` on CPU, and ``estimate``'s fake
tensors) would miss are made visible while gradckpt holds the model (the ecosystem hook):

1. **The forward as the operations it runs** (``_Int8Functions``): the path bitsandbytes takes
   on the tensors' device, or, on ``estimate``'s fake tensors, on the target's (the modeled
   clock's ``modeled_device_kind``), with the GPU path's kernels called one by one, and
   bitsandbytes' own backward. Same values bit for bit where the same kernels run. On fake
   tensors which columns hold outliers is not known (it depends on values): the search's
   temporaries are there, and no column is an outlier (LLM.int8() finds a few per layer in
   large models, each a column of the input kept in 16 bits, a fraction of a percent of it).
2. **The layer's input.** Both functions keep it for backward as an attribute of their
   context (``ctx.A``, in ``ctx.tensors`` on a GPU), which saved-tensor hooks never see, so a
   checkpoint could not drop it, and which lives as long as the autograd graph: with a loop
   that holds ``out`` through the next forward, every layer's input of the step before too.
   Here it is saved for backward (``save_for_backward``) instead: held until the layer's
   backward, as bitsandbytes holds it within a step, counted where the block's saved tensors
   are, dropped by a checkpoint that recomputes the block, and freed by backward. (Its
   backward reads it only to train the weight, which is frozen.)
3. **The scales** (``SCB``) live in the layer's ``MatmulLtState`` or on the weight, outside
   any parameter or buffer: while measuring or estimating they are a non-persistent buffer.
4. **A base built on the meta device** (``estimate`` of a model too big for this machine) has
   float weights, not yet quantised. While estimating, each layer holds what quantising
   leaves: an int8 weight of the same shape and an fp32 scale per row, on meta.

``quantize_linear_layers_8bit`` turns a model's linear layers into ``Linear8bitLt``, real (CPU)
or on meta, as ``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_8bit=True))``
loads them.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64)).to(torch.bfloat16)
    >>> type(quantize_linear_layers_8bit(model)[0]).__name__
    'Linear8bitLt'
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from math import prod
from typing import Any

import torch
from torch import nn

from ..ecosystem_hooks import Occasion, register_ecosystem_hook
from ..errors import UsageError
from ..measure import clock
from ..predict.clock import register_flop_formula
from .quantized import (
    all_or_none,
    as_bits,
    from_bits,
    is_8bit,
    linear_children,
    replace_forward,
    replace_weight,
)

__all__ = ["adapt_8bit_layers", "quantize_linear_layers_8bit"]

# What Transformers' BitsAndBytesConfig(load_in_8bit=True) sets (llm_int8_threshold).
DEFAULT_THRESHOLD = 6.0
_SCALES = "gradckpt_SCB"


def adapt_8bit_layers(model: nn.Module, occasion: Occasion) -> Callable[[], None] | None:
    """The ecosystem hook: each frozen ``Linear8bitLt`` of ``model`` runs its forward as the
    operations its training path runs, keeping its input as a saved tensor, for as long as
    gradckpt holds the model; while measuring or estimating its scales are counted; while
    estimating, a base on the meta device holds its quantised sizes. (A layer training its fp16
    weights is ``adapt_quantized_layers``' ``UsageError``.)

    Example:
        >>> adapt_8bit_layers(torch.nn.Linear(2, 2), Occasion()) is None  # nothing to do
        True
    """
    if "bitsandbytes" not in sys.modules:
        return None
    layers = [m for m in model.modules() if is_8bit(m) and not m.state.has_fp16_weights]
    if not layers:
        return None
    if not occasion.fake_tensors and (raw := [m for m in layers if not _is_quantized(m)]):
        raise UsageError(
            f"{type(model).__name__} has {len(raw)} bitsandbytes 8-bit layers not quantised "
            "yet (their weights are floats): bitsandbytes quantises them when they move to "
            "their device (layer.to('cuda')); load with load_in_8bit=True, or use "
            "gradckpt.integrations.quantized_8bit.quantize_linear_layers_8bit"
        )

    def adapt(undos: list[Callable[[], None]]) -> None:
        for layer in layers:
            if occasion.fake_tensors and not _is_quantized(layer):
                undos.append(_hold_quantized_sizes(layer))
            if not occasion.plan_applied:
                undos.append(_scales_as_buffer(layer))
            undos.append(replace_forward(layer, functools.partial(_forward, layer)))

    return all_or_none(adapt)


def quantize_linear_layers_8bit(
    model: nn.Module, *, skip: tuple[str, ...] = ("lm_head",),
    threshold: float = DEFAULT_THRESHOLD,
) -> nn.Module:
    """``model`` with its ``nn.Linear`` layers and Transformers ``Conv1D`` ones (but those
    named in ``skip``: ``quantized.linear_children``) replaced by frozen bitsandbytes
    ``Linear8bitLt``: quantised now on CPU (int8 rows, an fp32 scale per row), or
    left for ``estimate`` on meta; as ``BitsAndBytesConfig(load_in_8bit=True)`` loads them
    (outlier threshold 6.0, the bias as it was). Sets ``model.is_loaded_in_8bit``, which PEFT
    reads to wrap them in its 8-bit LoRA layer. Changes ``model`` in place and returns it.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64)).to(torch.bfloat16)
        >>> quantize_linear_layers_8bit(model)[0].weight.dtype
        torch.int8
    """
    import bitsandbytes as bnb

    for child in linear_children(model, skip):
        parent, name, linear = child.parent, child.name, child.layer
        device = linear.weight.device
        layer = bnb.nn.Linear8bitLt(
            child.in_features, child.out_features, bias=linear.bias is not None,
            has_fp16_weights=False, threshold=threshold, device="meta",
        )
        weight = bnb.nn.Int8Params(child.weight.contiguous(), requires_grad=False,
                                   has_fp16_weights=False)
        layer.weight = weight._quantize(device) if device.type != "meta" else weight
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.data, requires_grad=linear.bias.requires_grad)
        layer.train(linear.training)
        setattr(parent, name, layer)
    model.is_loaded_in_8bit = True  # as Transformers' 8-bit loading: PEFT reads it
    return model


def _is_quantized(layer: nn.Module) -> bool:
    return layer.weight.dtype == torch.int8


# --- 1. the forward as the operations it runs --------------------------------------------------


def _forward(layer: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """``Linear8bitLt.forward`` (frozen weights), with the path bitsandbytes' ``matmul`` takes
    on the device the step runs on, run as separate operations."""
    if layer.bias is not None and layer.bias.dtype != x.dtype:
        layer.bias.data = layer.bias.data.to(x.dtype)  # as bitsandbytes does, for good
    state = _matmul_state(layer)
    kind = clock.modeled_device_kind() or x.device.type
    functions = _int8_functions()
    if layer.training and kind in ("cpu", "xpu"):
        return functions.dequantize_then_linear.apply(x, layer.weight, None, layer.bias, state)
    return functions.quantize_then_int8_matmul.apply(x, layer.weight, None, layer.bias, state)


def _matmul_state(layer: nn.Module) -> Any:
    """A ``MatmulLtState`` of the layer's int8 weight and scales as they are now (the fake
    tensors ``estimate`` put in their place, where it did), for one call."""
    from bitsandbytes.autograd._functions import MatmulLtState

    state = MatmulLtState(CB=layer.weight.data, SCB=_scales(layer))
    state.threshold = layer.state.threshold
    state.has_fp16_weights = False
    state.is_training = layer.training
    return state


class _Int8Functions:
    """bitsandbytes' two 8-bit autograd functions, their forwards as separate operations and
    the layer's input saved for backward (made on first use: bitsandbytes is optional)."""

    def __init__(self) -> None:
        from bitsandbytes.autograd._functions import MatMul8bitFp, MatMul8bitLt

        class DequantizeThenLinear(MatMul8bitFp):
            """``MatMul8bitFp``: its forward's operations, the input saved for backward."""

            @staticmethod
            def forward(ctx, A, B, out=None, bias=None, state=None):  # noqa: ANN001, ANN205
                weight = state.CB.data.to(A.dtype).mul_(state.SCB.unsqueeze(1).mul(1.0 / 127.0))
                output = torch.nn.functional.linear(A, weight, bias)
                ctx.state = state
                ctx.dtype_A, ctx.grad_shape = A.dtype, A.shape
                ctx.dtype_bias = None if bias is None else bias.dtype
                ctx.save_for_backward(A)
                return output

            @staticmethod
            def backward(ctx, grad_output):  # noqa: ANN001, ANN205
                (ctx.A,) = ctx.saved_tensors
                try:
                    return MatMul8bitFp.backward(ctx, grad_output)
                finally:
                    del ctx.A  # nothing outlives backward on the graph

        class QuantizeThenInt8Matmul(MatMul8bitLt):
            """``MatMul8bitLt`` (frozen weight: its fast path): its forward's kernels one by
            one, the input (and the outlier columns of it) saved for backward."""

            @staticmethod
            def forward(ctx, A, B, out=None, bias=None, state=None):  # noqa: ANN001, ANN205
                if prod(A.shape) == 0:
                    return MatMul8bitLt.forward(ctx, A, B, out, bias, state)
                ctx.is_empty = False
                input_shape = A.shape
                if len(A.shape) == 3:
                    A = A.reshape(-1, A.shape[-1])
                CA, SCA, outlier_cols = _quantize_rows(A.to(torch.float16), state.threshold)
                if state.threshold > 0.0:
                    state.idx = outlier_cols
                    output, subA = _mixed_int8_matmul(A, CA, state, SCA, outlier_cols, bias)
                else:
                    output, subA = _int8_matmul(CA, state.CB, SCA, state.SCB, bias, A.dtype), None
                ctx.state = state
                ctx.grad_shape, ctx.dtype_A = input_shape, A.dtype
                ctx.dtype_bias = None if bias is None else bias.dtype
                if any(ctx.needs_input_grad[:2]):
                    ctx.tensor_states = (None, state.idx)
                    ctx.save_for_backward(subA, A)
                else:
                    ctx.tensor_states = (None, None)
                    ctx.save_for_backward(None, None)
                if len(input_shape) == 3:
                    return output.reshape(*input_shape[:-1], state.CB.shape[0])
                return output

            @staticmethod
            def backward(ctx, grad_output):  # noqa: ANN001, ANN205
                if ctx.is_empty:
                    return MatMul8bitLt.backward(ctx, grad_output)
                subA, A = ctx.saved_tensors
                ctx.tensors = (None, subA, A)
                try:
                    return MatMul8bitLt.backward(ctx, grad_output)
                finally:
                    del ctx.tensors

        self.dequantize_then_linear = DequantizeThenLinear
        self.quantize_then_int8_matmul = QuantizeThenInt8Matmul


@functools.cache
def _int8_functions() -> _Int8Functions:
    return _Int8Functions()


def _quantize_rows(A16: torch.Tensor, threshold: float) -> tuple[torch.Tensor, ...]:
    """``int8_vectorwise_quant``: the fp16 input in int8 rows, a scale per row, and (with a
    threshold) the columns holding an outlier. On fake tensors, which columns those are is not
    known: none, and the GPU kernel's search for them (a 16-bit ``abs`` of the input and a mask
    of it, made while its outputs exist) as operations."""
    quantize = torch.ops.bitsandbytes.int8_vectorwise_quant.default
    if threshold == 0.0 or not clock.modeled():
        return quantize(A16, threshold)
    CA, SCA, _ = quantize(A16, 0.0)
    outliers = A16.abs() >= threshold  # noqa: F841  (held while made, as in the kernel)
    return CA, SCA, A16.new_empty(0, dtype=torch.int64)


def _mixed_int8_matmul(A: torch.Tensor, CA: torch.Tensor, state: Any, SCA: torch.Tensor,
                       outlier_cols: torch.Tensor | None, bias: torch.Tensor | None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``int8_mixed_scaled_mm`` (bitsandbytes' one implementation, on every device): the
    outlier columns in the input's dtype against their weight columns dequantised, the rest
    in int8."""
    subB = None
    if outlier_cols is not None and outlier_cols.numel():
        subA = A[:, outlier_cols].contiguous()
        subB = torch.ops.bitsandbytes.int8_vectorwise_dequant.default(
            state.CB[:, outlier_cols].contiguous(), state.SCB).to(A.dtype).t()
    else:
        subA = torch.empty(0, device=A.device, dtype=A.dtype)
    output = _int8_matmul(CA, state.CB, SCA, state.SCB, bias, A.dtype)
    if subB is not None:
        output = output.addmm(subA, subB)
    return output, subA


def _int8_matmul(CA: torch.Tensor, CB: torch.Tensor, SCA: torch.Tensor, SCB: torch.Tensor,
                 bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``int8_scaled_mm``: the int8 matmul into int32, then dequantised into ``dtype``; on a
    GPU the dequantising kernel writes fp16 only, which is then cast (one operation here)."""
    ops = torch.ops.bitsandbytes
    accumulated = ops.int8_linear_matmul.default(CA, CB)
    if (clock.modeled_device_kind() or CA.device.type) != "cuda":
        return ops.int8_mm_dequant.default(accumulated, SCA, SCB, dtype=dtype, bias=bias)
    return ops.int8_mm_dequant.default(accumulated, SCA, SCB, dtype=torch.float16,
                                       bias=bias).to(dtype)


# --- 3. the scales, counted --------------------------------------------------------------------


def _scales(layer: nn.Module) -> torch.Tensor:
    """The layer's fp32 scale per row: the buffer standing for them while there is one (the
    fake tensor ``estimate`` put there), else where bitsandbytes keeps them (on the weight
    until the first forward moves them into the layer's state)."""
    if _SCALES in layer._buffers:
        return from_bits(layer._buffers[_SCALES])
    if layer.state.SCB is not None:
        return layer.state.SCB
    return layer.weight.SCB


def _scales_as_buffer(layer: nn.Module) -> Callable[[], None]:
    """The layer's scales registered as a non-persistent buffer (as their bits), for the
    duration."""
    if _SCALES in layer._buffers:
        return lambda: None
    layer.register_buffer(_SCALES, as_bits(_scales(layer)), persistent=False)
    return lambda: layer._buffers.pop(_SCALES, None)


# --- 4. a base on meta, at its quantised sizes ------------------------------------------------


def _hold_quantized_sizes(layer: nn.Module) -> Callable[[], None]:
    """A layer not yet quantised (built on meta) given, for the duration, what quantising it
    leaves: its weight in int8, of the same shape, and an fp32 scale per row, on meta."""
    import bitsandbytes as bnb

    shape = layer.weight.shape
    data = torch.empty(shape, dtype=torch.int8, device="meta")
    return replace_weight(layer, bnb.nn.Int8Params(
        data, requires_grad=False, has_fp16_weights=False, CB=data,
        SCB=torch.empty(shape[0], dtype=torch.float32, device="meta"),
    ))


def _int8_matmul_flops(A: torch.Tensor, B: torch.Tensor, *rest: Any, out_val: Any = None) -> int:
    """FLOPs of bitsandbytes' ``int8_linear_matmul(A, B)``, ``A @ B.T`` for ``A`` of (..., K)
    and ``B`` of (N, K) (its ``.out`` overload takes ``out`` after them): 2·M·N·K, as torch
    counts a matmul's multiply-adds, which the modeled clock times at the INT8 rate (its
    inputs' dtype). Without it the matmul was timed by its bytes alone.

    Example:
        >>> A = torch.empty(2, 4096, 4096, dtype=torch.int8, device="meta")  # 8192 tokens
        >>> B = torch.empty(14336, 4096, dtype=torch.int8, device="meta")
        >>> _int8_matmul_flops(A, B) == 2 * 8192 * 14336 * 4096
        True
    """
    return 2 * A.numel() * B.shape[0]


register_flop_formula("bitsandbytes::int8_linear_matmul", _int8_matmul_flops)
register_ecosystem_hook(adapt_8bit_layers)
