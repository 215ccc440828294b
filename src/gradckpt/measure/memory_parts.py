"""What a training step's memory is made of, part by part: the one breakdown and its labels.

``memory_parts`` counts the parts of a measured or a predicted profile (parameters, gradients
of the trainable ones, optimizer state, the activations kept for backward, the output head's
logits and loss, ...) and, given a plan solved from it, the parts under that plan, with the
rest of the plan's predicted peak. ``estimate`` notes a profile's parts in
``Profile.notes["memory_parts"]``, ``predict.per_rank`` divides some of them among ranks by
their labels, and ``gradckpt.report.memory_breakdown_table`` renders them (the table
``gradckpt plan`` prints). The parts are sizes, not one instant: they need not add up to the
peak, since activations are freed as gradients are made.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple, Protocol

from torch import nn

from ..op_choices import HOST_LINK, PolicyCost, policy_cost
from ..profile_types import Profile
from .tensors import tensor_bytes

__all__ = [
    "ACTIVATIONS", "CUDA_RESERVE", "CUDA_RESERVE_BYTES", "DDP_BUCKETS", "FSDP_GATHERED",
    "FSDP_ROOT",
    "GRADIENTS", "HEAD_CHUNK", "HEAD_UNDIVIDED", "MIXED_PRECISION_COPIES", "MemoryParts",
    "OFFLOADED", "OPTIMIZER_NAMES", "OPTIMIZER_STATE", "OUTPUT_HEAD", "PARAMETERS",
    "PLAN_ACTIVATIONS",
    "THE_REST", "memory_parts", "offloaded_activation_bytes", "one_head_chunk_bytes",
    "optimizer_state_label",
    "retained_activation_bytes",
]

# The labels: the names the parts go by in Profile.notes, the table and ``--json``.
PARAMETERS = "parameters"
GRADIENTS = "gradients (trainable parameters)"
OPTIMIZER_STATE = "optimizer state"  # "optimizer state (AdamW)" once the optimizer is named
ACTIVATIONS = "activations kept for backward (no checkpointing)"
PLAN_ACTIVATIONS = "activations kept for backward (under this plan)"
OUTPUT_HEAD = "logits, loss and their gradients (the output head)"
# Under a plan with the head's loss in chunks (``one_head_chunk_bytes``): what one chunk holds,
# and what the head's part of the step holds whatever the chunk count.
HEAD_CHUNK = "logits, loss and their gradients (the output head: one chunk at a time)"
HEAD_UNDIVIDED = "the rest of the output head's part, which chunking does not divide"
MIXED_PRECISION_COPIES = "mixed-precision copies of the parameters"
# Under DistributedDataParallel (``profile(..., ddp=True)``): its buckets, alive all run.
DDP_BUCKETS = "DDP's buckets (a copy of the trainable gradients)"
# One rank of an FSDP2 run (``predict.per_rank``).
FSDP_GATHERED = "gathered in full while a block computes (FSDP)"
FSDP_ROOT = "parameters outside the blocks and their gradients, in full (FSDP root)"
# What a process on a GPU loses before its first tensor and never sees in
# max_memory_allocated(): the CUDA context (kernels, cuBLAS/cuDNN workspaces: 0.5-1 GiB on
# recent GPUs and drivers) and the caching allocator's fragmentation. ``estimate`` adds a
# fixed allowance for it on a GPU target; the peak does not count it.
CUDA_RESERVE = "CUDA context and allocator reserve (outside the peak)"
OFFLOADED = "activations offloaded to host memory (under this plan; not on the device)"
CUDA_RESERVE_BYTES = 2 * 2**30
# A plan's predicted peak beyond the other parts.
THE_REST = "the rest (inputs, temporaries, recomputation)"

# How the parts name the optimizers ``gradckpt plan --optimizer`` takes.
OPTIMIZER_NAMES = {"adam": "Adam", "adamw": "AdamW", "adamw-8bit": "8-bit AdamW", "sgd": "SGD"}


class MemoryParts(NamedTuple):
    """What takes a step's memory, part by part, and the predicted peak they are read against.

    ``parts``: (name, bytes) pairs. They are sizes, not one instant: what the forward pass keeps
    is freed as the backward pass makes the gradients, so they need not add up to the peak.
    ``outside_peak``: names of parts the peak does not count (an estimate's CUDA reserve).
    ``world_size``: with more than one, the sizes are one rank's of that many sharding the
    model (the table says which parts each rank keeps 1/N of).
    """

    parts: Sequence[tuple[str, int]]
    predicted_peak_bytes: int
    outside_peak: frozenset[str] = frozenset()
    world_size: int = 1


class SolvedPlan(Protocol):
    """What the breakdown reads of a ``gradckpt.Plan`` (a layer above this one)."""

    segments: Sequence[Any]
    predicted_peak_bytes: int
    head_chunks: int


def memory_parts(
    model: nn.Module,
    profile: Profile,
    plan: SolvedPlan | None = None,
    *,
    optimizer: str | None = None,
    mixed_precision_copy_bytes: int = 0,
    cuda_reserve_bytes: int = 0,
) -> MemoryParts:
    """What takes the step's memory, part by part: of ``profile`` as it was taken (no
    checkpointing), read against its peak; or under ``plan`` (solved from it), read against the
    plan's predicted peak, with the activations the plan keeps and the rest of that peak.

    A profile from ``estimate`` starts from the parts it noted (``notes["memory_parts"]``: one
    rank's, when sharded); any other from ``model``'s parameters and the profile's bytes, plus
    ``mixed_precision_copy_bytes`` and ``cuda_reserve_bytes`` (what ``estimate`` adds). Parts of
    no bytes are left out.

    Args:
        model: the model profiled (its parameters are counted once each).
        profile: its measured or predicted profile.
        plan: a plan solved from ``profile``; None: the step without checkpointing.
        optimizer: the ``--optimizer`` name that the optimizer state's label gives
            (``"adamw"``: "optimizer state (AdamW)"), with a plan.
        mixed_precision_copy_bytes: the weights' copies autocast makes (``estimate``).
        cuda_reserve_bytes: the CUDA context and allocator reserve, outside the peak.

    Returns:
        A ``MemoryParts``, for ``gradckpt.report.memory_breakdown_table``.

    Example:
        >>> import torch, gradckpt
        >>> from gradckpt.toy_models import mlp_chain
        >>> model = mlp_chain(4, 8)
        >>> profile = gradckpt.profile(model, torch.randn(16, 8), repeats=1)
        >>> step = memory_parts(model, profile)  # as profiled: no checkpointing
        >>> for name, _ in step.parts:
        ...     print(name)
        parameters
        gradients (trainable parameters)
        activations kept for backward (no checkpointing)
        logits, loss and their gradients (the output head)
        >>> plan = gradckpt.solve(profile, None, "sqrt")
        >>> under_plan = memory_parts(model, profile, plan)
        >>> dict(under_plan.parts)[PLAN_ACTIVATIONS] < dict(step.parts)[ACTIVATIONS]
        True
        >>> under_plan.predicted_peak_bytes == plan.predicted_peak_bytes
        True
    """
    parts = dict(profile.notes.get("memory_parts") or _step_parts(
        model, profile, mixed_precision_copy_bytes, cuda_reserve_bytes))
    outside = frozenset({CUDA_RESERVE} & parts.keys())
    world_size = profile.notes.get("world_size", 1)
    if plan is None:
        return MemoryParts(list(parts.items()), profile.peak_bytes, outside, world_size)
    renamed = {ACTIVATIONS: PLAN_ACTIVATIONS, OPTIMIZER_STATE: optimizer_state_label(optimizer)}
    named = {renamed.get(name, name): size for name, size in parts.items()}
    named[PLAN_ACTIVATIONS] = retained_activation_bytes(profile, plan)  # in the step's place
    named[OFFLOADED] = offloaded_activation_bytes(profile, plan)
    if named[OFFLOADED]:
        outside |= {OFFLOADED}
    if plan.head_chunks > 1:  # one chunk's logits at a time
        head = profile.chunked_head(plan.head_chunks)
        # Its weight's gradient is alive through the chunked head's whole part of the step,
        # and among the gradients above already.
        beside_gradient = head.head_bytes - head.head_gradient_bytes
        one_chunk = one_head_chunk_bytes(profile, plan.head_chunks)
        if one_chunk is None:
            named[OUTPUT_HEAD] = beside_gradient
        else:
            del named[OUTPUT_HEAD]
            named[HEAD_CHUNK] = min(one_chunk, beside_gradient)
            named[HEAD_UNDIVIDED] = beside_gradient - named[HEAD_CHUNK]
    inside_bytes = sum(size for name, size in named.items() if name not in outside)
    named[THE_REST] = plan.predicted_peak_bytes - inside_bytes
    parts_of_plan = [(name, size) for name, size in named.items() if size > 0]
    return MemoryParts(parts_of_plan, plan.predicted_peak_bytes, outside, world_size)


def one_head_chunk_bytes(profile: Profile, chunks: int) -> int | None:
    """What one chunk of the head's loss holds (its logits, their float copy, the loss's and
    their gradients), read from the measured chunked steps: the head's bytes fall as 1/k with
    the chunk count k (``a + b / k``; the README's Llama: 28.33, 19.56, 17.36 MiB at 16, 64,
    256 chunks, within 0.01 MiB of that line), so the fewest and the most chunks measured give
    ``b``, and ``b / chunks`` is one chunk's. None where fewer than two counts were measured.

    Example:
        >>> from gradckpt.profile_types import ChunkedHead, example_block
        >>> def measured(chunks, head_bytes):
        ...     return ChunkedHead("lm_head", chunks, head_bytes, 0, 0, 0, 0, 1000, 0.1)
        >>> profile = Profile([example_block()], 1500, 1000, 4.0,
        ...                   chunked_heads=[measured(4, 300), measured(16, 150)])
        >>> one_head_chunk_bytes(profile, 4), one_head_chunk_bytes(profile, 16)
        (200, 50)
    """
    counts = sorted(profile.chunked_heads, key=lambda head: head.chunks)
    if len(counts) < 2:
        return None
    fewest, most = counts[0], counts[-1]
    whole = (fewest.head_bytes - most.head_bytes) / (1 / fewest.chunks - 1 / most.chunks)
    return max(0, round(whole / chunks))


def optimizer_state_label(optimizer: str | None) -> str:
    """The optimizer state's label, naming the optimizer when it is known.

    Example:
        >>> optimizer_state_label("adamw"), optimizer_state_label(None)
        ('optimizer state (AdamW)', 'optimizer state')
    """
    if optimizer is None:
        return OPTIMIZER_STATE
    return f"{OPTIMIZER_STATE} ({OPTIMIZER_NAMES.get(optimizer, optimizer)})"


def retained_activation_bytes(profile: Profile, plan: SolvedPlan) -> int:
    """What the chain keeps for backward at the end of the forward pass under the plan, on
    the device: what its kept blocks save, each segment's input, the outputs a policy keeps
    (``save-matmuls``, an op-level choice; not those it offloads, ``offloaded_activation_bytes``),
    and the side inputs (an encoder's output the decoder saves), which stay whatever the plan.

    Example:
        >>> from gradckpt import solve
        >>> from gradckpt.profile_types import Profile, example_block
        >>> chain = Profile([example_block(f"b{i}") for i in range(4)],
        ...                 peak_bytes=300, fixed_bytes=0, step_seconds=12.0)
        >>> retained_activation_bytes(chain, solve(chain, None, "none"))  # 4 blocks x 50
        200
        >>> retained_activation_bytes(chain, solve(chain, None, "every-layer"))  # 4 inputs
        40
    """
    blocks = profile.blocks
    covered = {index for segment in plan.segments for index in segment.blocks()}
    kept = sum(block.saved_bytes for index, block in enumerate(blocks) if index not in covered)
    inputs = sum(blocks[segment.start].input_bytes for segment in plan.segments)
    by_policy = sum(cost.kept_bytes for cost in _policy_costs(profile, plan))
    sides = sum(block.side_bytes for block in blocks)
    return kept + inputs + by_policy + sides


def offloaded_activation_bytes(profile: Profile, plan: SolvedPlan) -> int:
    """What the plan's policies move to host memory between each block's forward and its
    recomputation (``"offload-ops:..."``): not on the device meanwhile.

    Example:
        >>> from gradckpt import solve
        >>> from gradckpt.profile_types import Profile, example_block
        >>> chain = Profile([example_block(f"b{i}") for i in range(4)], 300, 0, 12.0)
        >>> offloaded_activation_bytes(chain, solve(chain, None, "every-layer"))
        0
    """
    return sum(cost.offloaded_bytes for cost in _policy_costs(profile, plan))


def _policy_costs(profile: Profile, plan: SolvedPlan) -> list[PolicyCost]:
    """Each block under a policy of the plan (segments without children), as the solvers
    price it."""
    link = profile.notes.get(HOST_LINK)
    return [
        policy_cost(profile.blocks[index], segment.policy, link)
        for segment in plan.segments
        if segment.policy and not segment.children
        for index in segment.blocks()
    ]


def _step_parts(model: nn.Module, profile: Profile, mixed_precision_copy_bytes: int,
                cuda_reserve_bytes: int) -> dict[str, int]:
    """The parts of the step without checkpointing, counted from the model and the profile."""
    parameters = {id(p): p for p in model.parameters()}.values()
    parts = {
        PARAMETERS: sum(tensor_bytes(p) for p in parameters),
        GRADIENTS: sum(tensor_bytes(p) for p in parameters if p.requires_grad),
        OPTIMIZER_STATE: profile.optimizer_state_bytes,
        DDP_BUCKETS: profile.notes.get("ddp_bucket_bytes", 0),
        ACTIVATIONS: sum(block.saved_bytes + block.side_bytes for block in profile.blocks),
        OUTPUT_HEAD: profile.head_bytes,
        CUDA_RESERVE: cuda_reserve_bytes,
        MIXED_PRECISION_COPIES: mixed_precision_copy_bytes,
    }
    return {name: size for name, size in parts.items() if size}
