"""What takes a training step's memory at a plan's predicted peak, part by part (the table
``gradckpt plan`` prints under the plan)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from gradckpt.plan import Plan
    from gradckpt.profile_types import Profile

__all__ = ["memory_parts"]


def memory_parts(
    model: nn.Module, profile: Profile, plan: Plan, optimizer_bytes: int
) -> list[tuple[str, int]]:
    """What takes the step's memory at the predicted peak, part by part.

    Example:
        >>> import torch, gradckpt
        >>> from gradckpt.models import mlp_chain
        >>> model = mlp_chain(4, 8)
        >>> profile = gradckpt.profile(model, torch.randn(16, 8), repeats=1)
        >>> parts = memory_parts(model, profile, gradckpt.solve(profile, None, "sqrt"), 0)
        >>> [name for name, _ in parts][:3]
        ['parameters', 'gradients', 'activations kept for backward (under this plan)']
    """
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gradient_bytes = sum(
        p.numel() * p.element_size() for p in model.parameters() if p.requires_grad
    )
    activation_bytes = _retained_activation_bytes(profile, plan)
    head_bytes = getattr(profile, "head_bytes", 0)  # the logits, mostly, where profiled
    parts = [
        ("parameters", parameter_bytes),
        ("gradients", gradient_bytes),
        ("activations kept for backward (under this plan)", activation_bytes),
    ]
    if head_bytes:
        parts.append(("logits and loss (the output head)", head_bytes))
    if optimizer_bytes:
        parts.append(("optimizer state (Adam, predicted)", optimizer_bytes))
    # The plan's predicted peak counts the optimizer's state (enable.solve_reserving).
    rest = plan.predicted_peak_bytes - parameter_bytes - gradient_bytes - activation_bytes
    rest -= head_bytes + optimizer_bytes
    if rest > 0:
        parts.append(("the rest (inputs, temporaries, recomputation)", rest))
    return parts


def _retained_activation_bytes(profile: Profile, plan: Plan) -> int:
    """What the chain keeps for backward at the end of the forward pass under the plan."""
    blocks = profile.blocks
    covered = {index for segment in plan.segments for index in segment.blocks()}
    kept = sum(block.saved_bytes for index, block in enumerate(blocks) if index not in covered)
    inputs = sum(blocks[segment.start].input_bytes for segment in plan.segments)
    matmuls = sum(
        blocks[index].matmul_bytes
        for segment in plan.segments
        if segment.policy and not segment.children
        for index in segment.blocks()
    )
    return kept + inputs + matmuls
