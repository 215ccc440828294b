"""Quantised bases (bitsandbytes 4-bit, QLoRA): measured and estimated as they train.

A QLoRA model is a frozen base whose linear layers are bitsandbytes ``Linear4bit`` (weights
packed two to a byte, with per-block scales), under trainable LoRA adapters. Three things about
such a layer are invisible to a meter that sees operations (``MemoryMeter`` on CPU, and
``estimate``'s fake tensors), and this integration makes each visible while gradckpt holds the
model (the ecosystem hook, ``gradckpt.ecosystem_hooks``):

1. **The dequantised weight.** The forward is one custom operation, ``bitsandbytes::gemm_4bit``,
   that dequantises the whole weight into the compute dtype and multiplies. Seen from outside it
   creates only its output. On the GPU it runs exactly that (dequantise, then ``linear``) for
   training-sized inputs (bitsandbytes' fused kernel serves only a few rows); on CPU always. Its
   forward here is those two steps as separate operations (``_DequantizeThenMatmul``), with
   bitsandbytes' own backward, which saves the packed weight alone and dequantises again. The
   values are bitsandbytes' (its CPU path runs the same two operations).
2. **The quantisation state** (``absmax`` per block, and with double quantisation its own
   scales and codebook) lives in a ``QuantState`` object, not in a parameter or a buffer, so
   a meter counting the model's tensors misses it. While measuring or estimating it is
   registered as non-persistent buffers of the layer (``state_dict`` unchanged).
3. **A base built on the meta device** (``estimate`` of a model too big for this machine) has
   ``Linear4bit`` weights of the full ``[out, in]`` shape, not yet quantised. While estimating,
   each holds what quantisation will leave: the packed weight and the state's tensors, on meta.

``quantize_linear_layers`` turns a model's linear layers into ``Linear4bit``, real (CPU) or on
meta, as ``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_4bit=True))``
does. bitsandbytes' 8-bit layers are ``quantized_8bit``'s, with the helpers here. A quantiser
gradckpt does not model (GPTQ, AWQ, HQQ, torchao, quanto, bitsandbytes 8-bit layers that train
their fp16 weights) is a ``UsageError`` naming it.

Example:
    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.Linear(128, 64))
    >>> base = quantize_linear_layers(model.to(torch.bfloat16))  # doctest: +SKIP
    >>> type(base[0]).__name__  # doctest: +SKIP
    'Linear4bit'
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from ..ecosystem_hooks import Occasion, register_ecosystem_hook
from ..errors import UsageError

__all__ = ["adapt_quantized_layers", "quantize_linear_layers", "unsupported_quantizer"]

# Packages whose layers hold weights gradckpt cannot yet count or run as they train.
_UNSUPPORTED_QUANTIZERS = {
    "auto_gptq": "GPTQ (auto-gptq)", "gptqmodel": "GPTQ (gptqmodel)", "awq": "AWQ (autoawq)",
    "hqq": "HQQ", "torchao": "torchao", "optimum": "quanto (optimum-quanto)",
    "quanto": "quanto", "eetq": "EETQ", "aqlm": "AQLM",
}
_STATE_BUFFERS = ("absmax", "nested_absmax", "nested_code", "offset", "code")


def unsupported_quantizer(model: nn.Module) -> str | None:
    """The name of a quantiser whose layers ``model`` has and gradckpt does not model, or
    ``None``.

    Example:
        >>> unsupported_quantizer(torch.nn.Linear(2, 2)) is None
        True
    """
    for module in model.modules():
        package = type(module).__module__.split(".")[0]
        if package in _UNSUPPORTED_QUANTIZERS:
            return f"{_UNSUPPORTED_QUANTIZERS[package]} ({type(module).__name__})"
        if package == "bitsandbytes" and is_8bit(module) and module.state.has_fp16_weights:
            return f"bitsandbytes 8-bit training fp16 weights ({type(module).__name__}, " \
                "has_fp16_weights=True)"
    return None


def adapt_quantized_layers(model: nn.Module, occasion: Occasion) -> Callable[[], None] | None:
    """The ecosystem hook: each ``Linear4bit`` of ``model`` runs its forward as separate
    operations for as long as gradckpt holds the model (so that a plan's operation-level
    choices see the same operations measured); while measuring or estimating, its quantisation
    state is counted; while estimating, a base on the meta device holds its quantised sizes.
    A quantiser gradckpt does not model is a ``UsageError`` while measuring or estimating.

    Example:
        >>> adapt_quantized_layers(torch.nn.Linear(2, 2), Occasion()) is None  # nothing to do
        True
    """
    if "bitsandbytes" not in sys.modules and not _has_foreign_quantizer(model):
        return None  # no bitsandbytes layer can exist unless bitsandbytes was imported
    if not occasion.plan_applied and (name := unsupported_quantizer(model)) is not None:
        raise UsageError(
            f"{type(model).__name__} has layers quantised by {name}, which gradckpt cannot "
            "measure or estimate yet: it knows bitsandbytes 4-bit (QLoRA: load_in_4bit=True) "
            "and 8-bit with frozen weights (load_in_8bit=True). Plan the model unquantised in "
            "the same dtype as an upper bound, or quantise it with bitsandbytes"
        )
    layers = [m for m in model.modules() if _is_4bit(m)]
    if not layers:
        return None

    def adapt(undos: list[Callable[[], None]]) -> None:
        for layer in layers:
            if occasion.fake_tensors and not _is_quantized(layer):
                undos.append(_hold_quantized_sizes(layer))
            if not occasion.plan_applied:
                undos.append(_state_as_buffers(layer))
            undos.append(_forward_as_separate_operations(layer))

    return all_or_none(adapt)


def quantize_linear_layers(
    model: nn.Module,
    *,
    skip: tuple[str, ...] = ("lm_head",),
    quant_type: str = "nf4",
    compute_dtype: torch.dtype | None = torch.bfloat16,
    double_quant: bool = True,
) -> nn.Module:
    """``model`` with its ``nn.Linear`` layers and Transformers ``Conv1D`` ones (but those
    named in ``skip``: ``linear_children``) replaced by bitsandbytes ``Linear4bit``:
    quantised now on CPU, or left for ``estimate`` on meta. The defaults are the QLoRA recipe
    (NF4, double quantisation, bf16 compute) and what ``BitsAndBytesConfig(load_in_4bit=True,
    bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
    bnb_4bit_compute_dtype=torch.bfloat16)`` loads. Changes ``model`` in place and returns it.

    Example:
        >>> model = torch.nn.Sequential(torch.nn.Linear(64, 64)).to(torch.bfloat16)
        >>> type(quantize_linear_layers(model)[0]).__name__
        'Linear4bit'
    """
    import bitsandbytes as bnb

    if quant_type not in ("nf4", "fp4"):
        raise UsageError(f"quant_type must be 'nf4' or 'fp4', got {quant_type!r}")
    for child in linear_children(model, skip):
        parent, name, linear = child.parent, child.name, child.layer
        device = linear.weight.device
        layer = bnb.nn.Linear4bit(
            child.in_features, child.out_features, bias=linear.bias is not None,
            compute_dtype=compute_dtype, compress_statistics=double_quant,
            quant_type=quant_type, device="meta",
        )
        weight = bnb.nn.Params4bit(
            child.weight.contiguous(), requires_grad=False, compress_statistics=double_quant,
            quant_type=quant_type, module=layer,
        )
        layer.weight = weight._quantize(device) if device.type != "meta" else weight
        if linear.bias is not None:
            layer.bias = nn.Parameter(linear.bias.data, requires_grad=linear.bias.requires_grad)
        layer.train(linear.training)
        setattr(parent, name, layer)
    # What Transformers' 4-bit loading sets: PEFT reads it to wrap these layers with its
    # bitsandbytes LoRA layer (which, for one, clones the base's output) as it would on a GPU.
    model.is_loaded_in_4bit = True
    return model


# --- which layers ------------------------------------------------------------------------------


def _is_4bit(module: nn.Module) -> bool:
    bnb = sys.modules.get("bitsandbytes")
    return bnb is not None and isinstance(module, bnb.nn.Linear4bit)


def is_8bit(module: nn.Module) -> bool:
    bnb = sys.modules.get("bitsandbytes")
    return bnb is not None and isinstance(module, bnb.nn.Linear8bitLt)


def _is_quantized(layer: nn.Module) -> bool:
    return bool(getattr(layer.weight, "bnb_quantized", False))


def _has_foreign_quantizer(model: nn.Module) -> bool:
    return any(name in sys.modules for name in _UNSUPPORTED_QUANTIZERS)


class LinearChild(NamedTuple):
    """A layer a bitsandbytes config quantises, where it sits, and its weight laid out as
    ``nn.Linear`` holds it (``[out, in]``)."""

    parent: nn.Module
    name: str
    layer: nn.Module
    weight: torch.Tensor

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]


def linear_children(model: nn.Module, skip: tuple[str, ...]) -> list[LinearChild]:
    """Each plain ``nn.Linear`` in ``model`` not named in ``skip``, and each Transformers
    ``Conv1D`` (GPT-2's linear layers, their weight stored ``[in, out]``): the layers a
    bitsandbytes config quantises (Transformers' loading turns a ``Conv1D`` into a
    ``Linear4bit`` of its transposed weight; left out, a GPT-2 "4-bit base" kept every weight
    in full precision).

    Example:
        >>> [(c.name, c.in_features, c.out_features) for c in linear_children(
        ...     nn.Sequential(nn.Linear(2, 3), nn.ReLU()), skip=("lm_head",))]
        [('0', 2, 3)]
    """
    children = []
    for parent in model.modules():
        for name, child in parent.named_children():
            if name in skip:
                continue
            if type(child) is nn.Linear:
                children.append(LinearChild(parent, name, child, child.weight.data))
            elif _is_conv1d(child):
                children.append(LinearChild(parent, name, child, child.weight.data.t()))
    return children


def _is_conv1d(module: nn.Module) -> bool:
    """Transformers' ``Conv1D`` (``x @ weight + bias``, ``weight`` of shape ``[in, out]``)."""
    utils = sys.modules.get("transformers.pytorch_utils")
    return utils is not None and type(module) is getattr(utils, "Conv1D", None)


# --- changes made for the duration, and undone -------------------------------------------------


def all_or_none(adapt: Callable[[list[Callable[[], None]]], None]) -> Callable[[], None]:
    """Run ``adapt(undos)``, which appends an undo for each change it makes; if it fails, undo
    what it did and raise. Returns what undoes them all, the last first."""
    undos: list[Callable[[], None]] = []
    try:
        adapt(undos)
    except BaseException:
        _undo_all(undos)
        raise
    return lambda: _undo_all(undos)


def _undo_all(undos: list[Callable[[], None]]) -> None:
    for undo in reversed(undos):
        undo()


def replace_forward(layer: nn.Module, forward: Callable[..., Any]) -> Callable[[], None]:
    """``layer.forward`` is ``forward`` until the returned function is called; a layer whose
    forward is replaced already (gradckpt holds the model twice: nested) is left as it is."""
    if "forward" in layer.__dict__:
        return lambda: None
    layer.forward = forward

    def restore() -> None:
        if layer.__dict__.get("forward") is forward:
            del layer.forward

    return restore


def as_bits(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """An fp32 tensor as its bits (an int32 view of the same memory), to register as a buffer:
    ``estimate``'s ``dtype=`` casts floating buffers as ``model.to(dtype)`` does, and
    ``model.to(dtype)`` leaves quantisation state that is no buffer as it is."""
    return tensor.view(torch.int32) if tensor is not None and tensor.dtype == torch.float32 \
        else tensor


def from_bits(tensor: torch.Tensor | None) -> torch.Tensor | None:
    """``as_bits`` undone: an int32 buffer as the fp32 tensor it holds."""
    return tensor.view(torch.float32) if tensor is not None and tensor.dtype == torch.int32 \
        else tensor


# --- 1. the forward as the operations it runs ------------------------------------------------


def _dequantize_then_matmul_class() -> type:
    """bitsandbytes' ``MatMul4Bit`` with its forward as separate operations (made on first use:
    bitsandbytes is optional)."""
    global _DequantizeThenMatmul
    if _DequantizeThenMatmul is not None:
        return _DequantizeThenMatmul
    from bitsandbytes.autograd._functions import MatMul4Bit

    class DequantizeThenMatmul(MatMul4Bit):
        """Forward: dequantise the weight into the input's dtype, then ``linear``: what
        ``gemm_4bit`` runs inside on CPU, and on a GPU for training-sized inputs. Backward:
        bitsandbytes' own (saves the packed weight only; dequantises again)."""

        @staticmethod
        def forward(ctx, A, B, out=None, bias=None, quant_state=None):  # noqa: ANN001, ANN205
            if A.numel() == 0:
                return MatMul4Bit.forward(ctx, A, B, out, bias, quant_state)
            ctx.is_empty = False
            B = B.view(-1, 1)
            weight = torch.ops.bitsandbytes.dequantize_4bit.default(
                B, _block_scales(quant_state), quant_state.blocksize, quant_state.quant_type,
                quant_state.shape, A.dtype,
            )
            output = torch.nn.functional.linear(A, weight, bias)
            ctx.state = quant_state
            ctx.dtype_A, ctx.dtype_B = A.dtype, B.dtype
            ctx.dtype_bias = None if bias is None else bias.dtype
            ctx.tensors = (None, B) if any(ctx.needs_input_grad[:2]) else (None, None)
            return output

    _DequantizeThenMatmul = DequantizeThenMatmul
    return DequantizeThenMatmul


_DequantizeThenMatmul: type | None = None


def _block_scales(quant_state: Any) -> torch.Tensor:
    """Each block's scale; with double quantisation, dequantised first (as ``gemm_4bit``)."""
    if not quant_state.nested:
        return quant_state.absmax
    state2 = quant_state.state2
    scales = torch.ops.bitsandbytes.dequantize_blockwise.default(
        quant_state.absmax, state2.absmax, state2.code, state2.blocksize, torch.float32
    )
    return scales + quant_state.offset


def _forward_as_separate_operations(layer: nn.Module) -> Callable[[], None]:
    """``layer.forward`` replaced, for the duration, by ``Linear4bit.forward``'s training path
    with ``_DequantizeThenMatmul`` in place of ``bnb.matmul_4bit``."""
    matmul = _dequantize_then_matmul_class()

    def forward(x: torch.Tensor) -> torch.Tensor:
        if not layer.compute_type_is_set:
            layer.set_compute_type(x)
            layer.compute_type_is_set = True
        input_dtype = x.dtype
        if layer.compute_dtype is not None:
            x = x.to(layer.compute_dtype)
        bias = layer.bias
        if bias is not None:
            bias = bias.to(x.dtype)
        return matmul.apply(x, layer.weight, None, bias, _quant_state(layer)).to(input_dtype)

    return replace_forward(layer, forward)


def _quant_state(layer: nn.Module) -> Any:
    """The layer's ``QuantState``, built from its buffers while they stand for it (so that the
    fake tensors ``estimate`` puts in their place are the ones used)."""
    buffers = layer._buffers
    if "gradckpt_absmax" not in buffers:
        return layer.weight.quant_state
    from bitsandbytes.functional import QuantState

    def buffer(name: str) -> torch.Tensor | None:
        return from_bits(buffers.get(f"gradckpt_{name}"))

    spec = layer.gradckpt_quant_spec
    state2 = None
    if buffer("nested_absmax") is not None:
        state2 = QuantState(absmax=buffer("nested_absmax"), code=buffer("nested_code"),
                            blocksize=256, dtype=torch.float32)
    return QuantState(
        absmax=buffer("absmax"), shape=spec["shape"], code=buffer("code"),
        blocksize=spec["blocksize"], quant_type=spec["quant_type"], dtype=spec["dtype"],
        offset=buffer("offset"), state2=state2,
    )


# --- 2. the quantisation state, counted ------------------------------------------------------


def _state_as_buffers(layer: nn.Module) -> Callable[[], None]:
    """The layer's quantisation state registered as non-persistent buffers, for the duration."""
    if "gradckpt_absmax" in layer._buffers:
        return lambda: None
    state = layer.weight.quant_state
    nested = state.state2 if state.nested else None
    tensors = {
        "absmax": state.absmax, "code": state.code,
        "offset": state.offset if nested is not None else None,
        "nested_absmax": nested.absmax if nested is not None else None,
        "nested_code": nested.code if nested is not None else None,
    }
    for name in _STATE_BUFFERS:  # floating ones as their bits
        layer.register_buffer(f"gradckpt_{name}", as_bits(tensors[name]), persistent=False)
    layer.gradckpt_quant_spec = {
        "shape": state.shape, "blocksize": state.blocksize, "quant_type": state.quant_type,
        "dtype": state.dtype,
    }

    def restore() -> None:
        for name in _STATE_BUFFERS:
            layer._buffers.pop(f"gradckpt_{name}", None)
        layer.__dict__.pop("gradckpt_quant_spec", None)

    return restore


# --- 3. a base on meta, at its quantised sizes -----------------------------------------------


def _hold_quantized_sizes(layer: nn.Module) -> Callable[[], None]:
    """A layer not yet quantised (built on meta) given, for the duration, what quantising it
    leaves: the packed weight, and a ``QuantState`` of meta tensors of the sizes bitsandbytes'
    ``quantize_4bit`` makes (one scale per ``blocksize`` weights; with double quantisation those
    scales in 8 bits, one float scale per 256 of them, their mean, and a 256-entry codebook,
    a copy per layer as bitsandbytes makes)."""
    from bitsandbytes.functional import QuantState

    weight = layer.weight
    out_features, in_features = weight.shape
    storage = getattr(weight, "quant_storage", torch.uint8)
    packed_bytes = (out_features * in_features + 1) // 2
    packed = nn.Parameter(
        torch.empty((math.ceil(packed_bytes / storage.itemsize), 1), dtype=storage,
                    device="meta"),
        requires_grad=False,
    )
    blocksize = getattr(weight, "blocksize", 64) or 64
    blocks = math.ceil(out_features * in_features / blocksize)
    quant_type = getattr(weight, "quant_type", "fp4")
    meta = {"device": "meta"}
    code = torch.empty(16, dtype=torch.float32, **meta)
    if getattr(weight, "compress_statistics", True):
        state2 = QuantState(
            absmax=torch.empty(math.ceil(blocks / 256), dtype=torch.float32, **meta),
            code=torch.empty(256, dtype=torch.float32, **meta), blocksize=256,
            dtype=torch.float32,
        )
        state = QuantState(
            absmax=torch.empty(blocks, dtype=torch.uint8, **meta),
            shape=torch.Size((out_features, in_features)), code=code, blocksize=blocksize,
            quant_type=quant_type, dtype=weight.dtype,
            offset=torch.empty((), dtype=torch.float32, **meta), state2=state2,
        )
    else:
        state = QuantState(
            absmax=torch.empty(blocks, dtype=torch.float32, **meta),
            shape=torch.Size((out_features, in_features)), code=code, blocksize=blocksize,
            quant_type=quant_type, dtype=weight.dtype,
        )
    packed.quant_state = state
    packed.bnb_quantized = True
    return replace_weight(layer, packed)


def replace_weight(layer: nn.Module, weight: nn.Parameter) -> Callable[[], None]:
    """``layer.weight`` is ``weight`` until the returned function puts the one before back."""
    before = layer.weight
    layer._parameters["weight"] = weight

    def restore() -> None:
        if layer._parameters.get("weight") is weight:
            layer._parameters["weight"] = before

    return restore


register_ecosystem_hook(adapt_quantized_layers)
