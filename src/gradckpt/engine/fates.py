"""Fates and policies: what happens to each tensor a checkpointed region would save.

A policy is a plain function ``(op, output) -> Fate``, asked about every operation inside a
checkpointed region that makes a new tensor (views and in-place operations are never asked:
their results alias tensors that exist anyway, so keeping them would save nothing). ``op`` is the
ATen overload (for example ``torch.ops.aten.mm.default``), ``output`` the operation's first
tensor output; the fate applies to all of the operation's outputs. It is asked each time the
region's forward runs: once per step, and again for a region nested inside another one whenever
the outer region is recomputed. Make it a function of ``(op, output)`` alone: a policy whose
answers depend on how often it was called keeps different tensors each time.

- ``Fate.KEEP``: keep the output from the forward pass; recomputation reuses it instead of
  running the operation again.
- ``Fate.RECOMPUTE``: drop it; backward runs the operation again.
- ``Fate.OFFLOAD``: move it to CPU memory in the forward pass and bring it back when
  recomputation reaches it. For tensors already in CPU memory this is the same as ``KEEP``.

The named presets below are what ``policy="save-matmuls"`` and friends resolve to; a name
``"save-ops:aten.mm,aten.silu"`` keeps the outputs of exactly the ATen operations it lists (by
overload packet, as ``str(op.overloadpacket)`` names them) and recomputes the rest, and
``"offload-ops:..."`` offloads them: the per-block choices that plans make
(``gradckpt.op_choices``), written so a plan's JSON names them.
"""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch

from ..errors import UsageError


class Fate(enum.Enum):
    """What happens to a tensor saved for backward inside a checkpointed region."""

    KEEP = "keep"
    RECOMPUTE = "recompute"
    OFFLOAD = "offload"


Policy = Callable[[torch._ops.OpOverload, torch.Tensor], Fate]
PolicyLike = None | str | Policy

_aten = torch.ops.aten


def _packets(*names: str) -> frozenset:
    # Look names up one by one so a torch build without one of them still imports.
    return frozenset(getattr(_aten, name) for name in names if hasattr(_aten, name))


MATMUL_OPS = _packets("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_int_mm")
"""Matrix multiplies as they reach the engine (``linear`` and ``matmul`` decompose into these)."""

ATTENTION_OPS = _packets(
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_fused_attention_overrideable",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)
"""Fused attention kernels behind ``torch.nn.functional.scaled_dot_product_attention``."""


_ATTENTION_NAMES = frozenset(str(packet) for packet in ATTENTION_OPS)
MATMUL_AND_ATTENTION_NAMES = frozenset(str(packet) for packet in MATMUL_OPS | ATTENTION_OPS)
"""The same operations by name (``"aten.mm"``), as profiles and ``"save-ops:..."`` name them."""


def is_matmul_or_attention(op: torch._ops.OpOverload) -> bool:
    """True for the expensive operations that ``save-matmuls`` keeps.

    >>> is_matmul_or_attention(torch.ops.aten.mm.default)
    True
    >>> is_matmul_or_attention(torch.ops.aten.gelu.default)
    False
    """
    packet = op.overloadpacket
    return packet in MATMUL_OPS or packet in ATTENTION_OPS


def asks_policy(op: torch._ops.OpOverload) -> bool:
    """Whether a policy is asked about ``op``: not a view nor an in-place operation, whose
    results alias tensors that exist anyway (nothing to keep).

    >>> asks_policy(torch.ops.aten.mm.default), asks_policy(torch.ops.aten.add_.Tensor)
    (True, False)
    """
    return not op.is_view and not op._schema.is_mutable


def save_matmuls(op: torch._ops.OpOverload, output: torch.Tensor) -> Fate:
    """Keep matrix-multiply and attention outputs, recompute everything else.

    This is Megatron-style selective recomputation: the cheap element-wise work is redone in
    backward, the expensive matmuls are not.

    >>> save_matmuls(torch.ops.aten.addmm.default, torch.zeros(2, 2))
    <Fate.KEEP: 'keep'>
    """
    return Fate.KEEP if is_matmul_or_attention(op) else Fate.RECOMPUTE


def offload_matmuls(op: torch._ops.OpOverload, output: torch.Tensor) -> Fate:
    """Like ``save_matmuls`` but moves those outputs to CPU memory instead of keeping them.

    >>> offload_matmuls(torch.ops.aten.mm.default, torch.zeros(2, 2))
    <Fate.OFFLOAD: 'offload'>
    """
    return Fate.OFFLOAD if is_matmul_or_attention(op) else Fate.RECOMPUTE


PRESETS: dict[str, Policy] = {
    "save-matmuls": save_matmuls,
    "offload-matmuls": offload_matmuls,
}

SAVE_OPS = "save-ops:"
"""The prefix of a policy name listing the operations to keep: ``"save-ops:aten.mm,aten.bmm"``."""
OFFLOAD_OPS = "offload-ops:"
"""The same listing the operations to offload to host memory (``Fate.OFFLOAD``)."""


ATTENTION = "attention"
"""In a ``"save-ops:..."`` name: every fused attention kernel (``ATTENTION_OPS``), so that a
plan made where one kernel runs (an estimate for a GPU, a CPU profile) keeps the attention
output where another runs."""


def save_ops_policy_name(
    operations: list[str] | set[str] | frozenset[str], offload: bool = False
) -> str:
    """The policy name that keeps (``offload``: offloads) the outputs of ``operations`` (in a
    fixed order), attention kernels named as one (``ATTENTION``).

    >>> save_ops_policy_name({"aten.silu", "aten.mm"})
    'save-ops:aten.mm,aten.silu'
    >>> save_ops_policy_name({"aten._scaled_dot_product_flash_attention_for_cpu", "aten.mm"})
    'save-ops:aten.mm,attention'
    """
    names = {ATTENTION if name in _ATTENTION_NAMES else name for name in operations}
    return (OFFLOAD_OPS if offload else SAVE_OPS) + ",".join(sorted(names))


def keeps_operation(operations: frozenset[str], name: str) -> bool:
    """Whether a ``"save-ops:..."`` policy keeping ``operations`` keeps the outputs of the
    operation called ``name`` (``"aten.mm"``).

    >>> keeps_operation(frozenset({"attention"}), "aten._scaled_dot_product_flash_attention")
    True
    """
    return name in operations or (ATTENTION in operations and name in _ATTENTION_NAMES)


def operations_kept_by(name: str) -> frozenset[str]:
    """The operations a ``"save-ops:..."`` (or ``"offload-ops:..."``) policy name keeps.

    >>> sorted(operations_kept_by("save-ops:aten.mm,aten.silu"))
    ['aten.mm', 'aten.silu']
    """
    prefix = next((p for p in (SAVE_OPS, OFFLOAD_OPS) if name.startswith(p)), None)
    listed = name[len(prefix):] if prefix else ""
    operations = frozenset(op for op in listed.split(",") if op)
    if not operations or not all("." in op or op == ATTENTION for op in operations):
        raise UsageError(
            f"policy {name!r} names no operations; write {prefix or SAVE_OPS!r} followed by "
            "ATen operation names separated by commas, e.g. 'save-ops:aten.mm,aten.silu'"
        )
    return operations


def _listed_ops(operations: frozenset[str], fate: Fate) -> Policy:
    def listed(op: torch._ops.OpOverload, output: torch.Tensor) -> Fate:
        return fate if keeps_operation(operations, str(op.overloadpacket)) else Fate.RECOMPUTE

    listed.__name__ = save_ops_policy_name(operations, offload=fate is Fate.OFFLOAD)
    return listed


def resolve_policy(policy: PolicyLike) -> Policy | None:
    """Turn what a user passed as ``policy=`` into a callable (or ``None`` = recompute all).

    >>> resolve_policy("save-matmuls") is save_matmuls
    True
    >>> resolve_policy(None) is None
    True
    """
    if policy is None:
        return None
    if isinstance(policy, str):
        if policy in PRESETS:
            return PRESETS[policy]
        if policy.startswith((SAVE_OPS, OFFLOAD_OPS)):
            fate = Fate.OFFLOAD if policy.startswith(OFFLOAD_OPS) else Fate.KEEP
            return _listed_ops(operations_kept_by(policy), fate)
        raise UsageError(
            f"unknown checkpoint policy {policy!r}; valid names are "
            f"{', '.join(sorted(PRESETS))}, '{SAVE_OPS}' or '{OFFLOAD_OPS}' followed by the "
            "ATen operations to keep or offload (e.g. 'save-ops:aten.mm'), or pass None "
            "(recompute everything) "
            "or a callable (op, output) -> gradckpt.Fate"
        )
    if callable(policy):
        return policy
    raise UsageError(
        f"policy must be None, a preset name ({', '.join(sorted(PRESETS))}) or a callable "
        f"(op, output) -> gradckpt.Fate; got {type(policy).__name__}"
    )
