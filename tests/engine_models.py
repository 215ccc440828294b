"""Small, self-contained models and helpers for the checkpoint-engine tests.

The engine tests do not import ``gradckpt.toy_models``: every model they
run is defined here, small enough to run in milliseconds on a CPU.

Each model routes its checkpointable regions through ``self.call(fn, *args, **kwargs)``. The
tests install a different ``call`` to run the very same model plainly, through
``gradckpt.checkpoint`` or through ``torch.utils.checkpoint.checkpoint`` (the reference), and
``regions()`` lists the modules that ``gradckpt.checkpoint_module`` wraps in the module form.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

import gradckpt

Call = Callable[..., Any]  # (fn, *args, **kwargs) -> what fn(*args, **kwargs) returns


def plain_call(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a region without any checkpointing (module-level so that models pickle)."""
    return fn(*args, **kwargs)


class Routed(nn.Module):
    """A module whose checkpointable sub-regions are called through ``self.call``."""

    def __init__(self) -> None:
        super().__init__()
        self.call: Call = plain_call


class BlockChain(Routed):
    """``self.blocks`` (set by the subclass) run one after another, each block a region."""

    blocks: nn.ModuleList

    def run_blocks(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = self.call(block, x)
        return x

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.run_blocks(x)

    def regions(self) -> list[nn.Module]:
        return list(self.blocks)


def set_call(model: nn.Module, call: Call) -> None:
    """Make every ``Routed`` module inside ``model`` call its regions through ``call``."""
    for module in model.modules():
        if isinstance(module, Routed):
            module.call = call


# ---------------------------------------------------------------------------------------------
# Ways to run a region
# ---------------------------------------------------------------------------------------------

aten = torch.ops.aten

# Written out independently of gradckpt.engine.fates, so the reference does not share its code.
REFERENCE_MATMUL_PACKETS = {
    aten.mm,
    aten.addmm,
    aten.bmm,
    aten.baddbmm,
    aten._scaled_dot_product_flash_attention_for_cpu,
    aten._scaled_dot_product_flash_attention,
    aten._scaled_dot_product_efficient_attention,
    aten._scaled_dot_product_cudnn_attention,
}


def gradckpt_call(policy: Any = None, preserve_rng_state: bool = True) -> Call:
    """Run each region through ``gradckpt.checkpoint`` with ``policy``."""
    return functools.partial(
        gradckpt.checkpoint, policy=policy, preserve_rng_state=preserve_rng_state
    )


def torch_call(save_op: Callable[[Any], bool] | None = None) -> Call:
    """Run each region through ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``.

    ``save_op(op) -> bool`` turns on selective checkpointing
    (``create_selective_checkpoint_contexts``): ops it accepts are saved, others recomputed.
    """
    if save_op is None:
        return functools.partial(torch_checkpoint.checkpoint, use_reentrant=False)

    def policy_fn(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
        if save_op(op):
            return torch_checkpoint.CheckpointPolicy.MUST_SAVE
        return torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE

    # allow_cache_entry_mutation: with everything saved, torch's cache also holds tensors that
    # autograd later updates in place (gradckpt hands out aliases and needs no such check).
    context_fn = functools.partial(
        torch_checkpoint.create_selective_checkpoint_contexts,
        policy_fn,
        allow_cache_entry_mutation=True,
    )
    return functools.partial(
        torch_checkpoint.checkpoint, use_reentrant=False, context_fn=context_fn
    )


def reference_is_matmul(op: Any) -> bool:
    return op.overloadpacket in REFERENCE_MATMUL_PACKETS


def reference_makes_new_tensor(op: Any) -> bool:
    return not op.is_view and not op._schema.is_mutable


# ---------------------------------------------------------------------------------------------
# Building blocks
# ---------------------------------------------------------------------------------------------

ACTIVATIONS: dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU,
    "gelu": nn.GELU,
    "tanh": nn.Tanh,
    "sigmoid": nn.Sigmoid,
    "silu": nn.SiLU,
    "identity": nn.Identity,
}


class CallCounter(nn.Module):
    """Counts how often it runs (a Python-side effect autograd never sees)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x


class MLPBlock(nn.Module):
    """Linear, activation, dropout."""

    def __init__(
        self, width_in: int, width_out: int, activation: str = "gelu", dropout: float = 0.0
    ) -> None:
        super().__init__()
        self.linear = nn.Linear(width_in, width_out)
        self.activation = ACTIVATIONS[activation]()
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.activation(self.linear(x)))


class MLPChain(BlockChain):
    """A chain of ``MLPBlock``s, each one a region."""

    def __init__(
        self,
        widths: list[int],
        activations: list[str] | None = None,
        dropouts: list[float] | None = None,
    ) -> None:
        super().__init__()
        depth = len(widths) - 1
        activations = activations or ["gelu"] * depth
        dropouts = dropouts or [0.0] * depth
        self.blocks = nn.ModuleList(
            MLPBlock(widths[i], widths[i + 1], activations[i], dropouts[i]) for i in range(depth)
        )


class ConvBlock(nn.Module):
    """Conv2d, BatchNorm2d, ReLU: BatchNorm updates its running statistics in every forward."""

    def __init__(self, channels_in: int, channels_out: int) -> None:
        super().__init__()
        self.conv = nn.Conv2d(channels_in, channels_out, kernel_size=3, padding=1, bias=False)
        self.norm = nn.BatchNorm2d(channels_out)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.norm(self.conv(x)))


class SmallCNN(BlockChain):
    """ConvBlocks (the regions), then a head that is never checkpointed."""

    def __init__(self, channels: int = 3, width: int = 6, depth: int = 3, classes: int = 5):
        super().__init__()
        self.blocks = nn.ModuleList(
            ConvBlock(channels if i == 0 else width, width) for i in range(depth)
        )
        self.head = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(width, classes))

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.head(self.run_blocks(images))


class AttentionBlock(nn.Module):
    """Pre-norm self-attention + MLP block.

    Takes keyword arguments (``attention_mask``, ``residual_scale``) and returns a tuple with a
    non-tensor in it: ``(hidden, aux_loss, sequence_length)``.
    """

    def __init__(self, dim: int, heads: int, dropout: float) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.norm_1 = nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.norm_2 = nn.LayerNorm(dim)
        self.fc_in = nn.Linear(dim, 2 * dim)
        self.fc_out = nn.Linear(2 * dim, dim)
        self.drop = nn.Dropout(dropout)

    def forward(
        self,
        x: torch.Tensor,
        *,
        attention_mask: torch.Tensor | None = None,
        residual_scale: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor, int]:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(self.norm_1(x)).split(dim, dim=2)
        q, k, v = (
            t.view(batch, seq, self.heads, dim // self.heads).transpose(1, 2) for t in (q, k, v)
        )
        y = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, dropout_p=self.dropout if self.training else 0.0
        )
        y = y.transpose(1, 2).reshape(batch, seq, dim)
        x = x + residual_scale * self.drop(self.proj(y))
        hidden = self.fc_in(self.norm_2(x))
        x = x + self.drop(self.fc_out(F.gelu(hidden)))
        aux_loss = hidden.pow(2).mean()
        return x, aux_loss, seq


class AttentionNet(BlockChain):
    """A stack of ``AttentionBlock``s called with keyword arguments; returns a tuple."""

    def __init__(self, dim: int = 8, heads: int = 2, depth: int = 2, dropout: float = 0.2):
        super().__init__()
        self.blocks = nn.ModuleList(AttentionBlock(dim, heads, dropout) for _ in range(depth))

    def forward(
        self, x: torch.Tensor, attention_mask: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        aux_total = x.new_zeros(())
        lengths = []
        for block in self.blocks:
            x, aux_loss, length = self.call(
                block, x, attention_mask=attention_mask, residual_scale=0.5
            )
            aux_total = aux_total + aux_loss
            lengths.append(length)
        return x, aux_total, lengths


class LoRABlock(nn.Module):
    """A frozen base Linear plus a trainable low-rank adapter, then GELU and dropout."""

    def __init__(self, width: int, rank: int = 2, dropout: float = 0.1) -> None:
        super().__init__()
        self.base = nn.Linear(width, width)
        self.base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, width) / width)
        self.lora_b = nn.Parameter(torch.randn(width, rank) / rank)  # non-zero: A gets grads
        self.drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(F.gelu(self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()))


class LoRANet(BlockChain):
    """Frozen base with trainable adapters; its input does not require grad (invariant 4)."""

    def __init__(self, width: int = 8, depth: int = 3) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(LoRABlock(width) for _ in range(depth))


class Segment(Routed):
    """A region containing regions: a Linear, then inner blocks each called by ``call``."""

    def __init__(self, width: int, inner_depth: int, dropout: float) -> None:
        super().__init__()
        self.mix = nn.Linear(width, width)
        self.inner = nn.ModuleList(
            MLPBlock(width, width, "tanh", dropout) for _ in range(inner_depth)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.sigmoid(self.mix(x))
        for block in self.inner:
            x = self.call(block, x)
        return x * 2


class NestedNet(Routed):
    """Segments (outer regions) whose inner blocks are regions too: nested checkpoints."""

    def __init__(self, width: int = 8, depth: int = 2, inner_depth: int = 2, dropout: float = 0.2):
        super().__init__()
        self.segments = nn.ModuleList(Segment(width, inner_depth, dropout) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for segment in self.segments:
            x = self.call(segment, x)
        return x

    def regions(self) -> list[nn.Module]:
        # Parents first: checkpoint_module on a parent whose children are checkpointed too.
        return [*self.segments, *(block for s in self.segments for block in s.inner)]


# ---------------------------------------------------------------------------------------------
# Comparing results
# ---------------------------------------------------------------------------------------------


def flatten_named(value: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yield ``(path, leaf)`` for every leaf of nested tuples, lists and dicts."""
    if isinstance(value, dict):
        for key in sorted(value):
            yield from flatten_named(value[key], f"{prefix}.{key}" if prefix else str(key))
    elif isinstance(value, (list, tuple)):
        yield f"{prefix}#len", len(value)
        for index, item in enumerate(value):
            yield from flatten_named(item, f"{prefix}[{index}]")
    else:
        yield prefix, value


def assert_identical(actual: Any, expected: Any, what: str = "") -> None:
    """Bit-identical: same structure, tensors ``torch.equal`` with the same dtype, rest ``==``."""
    actual_leaves = dict(flatten_named(actual))
    expected_leaves = dict(flatten_named(expected))
    assert actual_leaves.keys() == expected_leaves.keys(), (
        f"{what}: different structure {sorted(actual_leaves)} vs {sorted(expected_leaves)}"
    )
    for path, expected_leaf in expected_leaves.items():
        actual_leaf = actual_leaves[path]
        label = f"{what}{'/' + path if path else ''}"
        if isinstance(expected_leaf, torch.Tensor) or isinstance(actual_leaf, torch.Tensor):
            assert isinstance(actual_leaf, torch.Tensor), f"{label}: got {actual_leaf!r}"
            assert isinstance(expected_leaf, torch.Tensor), f"{label}: expected {expected_leaf!r}"
            assert actual_leaf.dtype == expected_leaf.dtype, (
                f"{label}: dtype {actual_leaf.dtype} vs {expected_leaf.dtype}"
            )
            assert actual_leaf.shape == expected_leaf.shape, (
                f"{label}: shape {tuple(actual_leaf.shape)} vs {tuple(expected_leaf.shape)}"
            )
            if not torch.equal(actual_leaf, expected_leaf):
                difference = (actual_leaf.double() - expected_leaf.double()).abs().max().item()
                raise AssertionError(f"{label}: not bit-identical (max abs diff {difference:.3g})")
        else:
            assert actual_leaf == expected_leaf, f"{label}: {actual_leaf!r} != {expected_leaf!r}"


# A plan computing the loss in chunks of tokens (plan.head_chunks > 1) sums it in another order:
# its step matches the plain one within float rounding. Measured largest differences: 3e-8 in
# gradients, 1e-6 in a loss, 7.7e-6 in parameters after 3 AdamW steps at lr 1e-3 (AdamW turns
# rounding in the smallest gradients into visible steps).
CHUNKED_HEAD_TOLERANCE = {"rtol": 1e-4, "atol": 2e-5}


def assert_trains_as_plain(plan: Any, actual: Any, expected: Any, what: str = "") -> None:
    """What a plan's step gives equals the plain step's: bit for bit (``assert_identical``),
    or within ``CHUNKED_HEAD_TOLERANCE`` where the plan computes the loss in chunks."""
    if plan is None or plan.head_chunks == 1:
        assert_identical(actual, expected, what)
        return
    actual_leaves, expected_leaves = dict(flatten_named(actual)), dict(flatten_named(expected))
    assert actual_leaves.keys() == expected_leaves.keys(), what
    for path, expected_leaf in expected_leaves.items():
        if isinstance(expected_leaf, torch.Tensor):
            torch.testing.assert_close(actual_leaves[path], expected_leaf,
                                       msg=lambda message, path=path: f"{what}/{path}: {message}",
                                       **CHUNKED_HEAD_TOLERANCE)
        else:
            assert actual_leaves[path] == expected_leaf, f"{what}/{path}"


def gradients(model: nn.Module) -> dict[str, torch.Tensor | None]:
    """Every parameter's ``.grad`` by name (``None`` kept: a missing grad must match too)."""
    return {
        name: None if p.grad is None else p.grad.detach().clone()
        for name, p in model.named_parameters()
    }


def buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: b.detach().clone() for name, b in model.named_buffers()}


def parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def detached(value: Any) -> Any:
    """A copy of ``value`` with every tensor detached and cloned."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(detached(v) for v in value)
    if isinstance(value, dict):
        return {k: detached(v) for k, v in value.items()}
    return value


def storage_bytes(*tensors: torch.Tensor) -> int:
    """Bytes of the distinct storages behind ``tensors`` (what MemTracker counts)."""
    seen: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


# ---------------------------------------------------------------------------------------------
# A tensor subclass that answers size questions through dispatch
# ---------------------------------------------------------------------------------------------


class SizesThroughDispatch(torch.Tensor):
    """A wrapper around a plain tensor that reports its sizes and strides through dispatch.

    Like a jagged NestedTensor or DTensor, every ``x.shape`` asked of it (by autograd, by the
    subclass itself, by the engine) becomes an ``aten.sym_size`` / ``aten.sym_stride`` call that
    any dispatch mode above it sees. Every other operation runs on the wrapped tensor and wraps
    its tensor outputs again. ``SizesThroughDispatch.of(x)`` wraps, ``.unwrapped()`` unwraps.
    """

    @staticmethod
    def __new__(cls, elem: torch.Tensor) -> SizesThroughDispatch:
        return torch.Tensor._make_wrapper_subclass(
            cls,
            elem.shape,
            strides=elem.stride(),
            dtype=elem.dtype,
            device=elem.device,
            requires_grad=elem.requires_grad,
            dispatch_sizes_strides_policy="sizes",
        )

    def __init__(self, elem: torch.Tensor) -> None:
        self.elem = elem

    @classmethod
    def of(cls, tensor: torch.Tensor) -> SizesThroughDispatch:
        wrapped = cls(tensor.detach())
        return wrapped.requires_grad_(tensor.requires_grad)

    def unwrapped(self) -> torch.Tensor:
        return self.elem

    def __repr__(self) -> str:  # type: ignore[override]
        return f"SizesThroughDispatch({self.elem!r})"

    def __tensor_flatten__(self) -> tuple[list[str], None]:
        return ["elem"], None

    @staticmethod
    def __tensor_unflatten__(inner: dict, meta: Any, size: Any, stride: Any) -> Any:
        return SizesThroughDispatch(inner["elem"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # noqa: ANN001
        from torch.utils._python_dispatch import return_and_correct_aliasing
        from torch.utils._pytree import tree_map_only

        kwargs = kwargs or {}
        if func is aten.sym_size.default:
            return args[0].elem.shape
        if func is aten.sym_stride.default:
            return args[0].elem.stride()
        unwrap = functools.partial(tree_map_only, SizesThroughDispatch, lambda t: t.elem)
        output = func(*unwrap(args), **unwrap(kwargs))
        output = tree_map_only(torch.Tensor, SizesThroughDispatch, output)
        return return_and_correct_aliasing(func, args, kwargs, output)
