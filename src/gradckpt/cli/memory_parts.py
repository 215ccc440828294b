"""What takes a training step's memory under a plan, part by part, read against the plan's
predicted peak (the table ``gradckpt plan`` prints under the plan)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import nn

    from gradckpt.plan import Plan
    from gradckpt.profile_types import Profile
    from gradckpt.report import MemoryParts

__all__ = ["memory_parts", "retained_activation_bytes", "without_optimizer_note"]


def without_optimizer_note(model: nn.Module, optimizer: str | None) -> str | None:
    """With ``--optimizer none`` and parameters to train, the line saying what the plan leaves
    out: the state AdamW would add from the second step on. None otherwise.

    Example:
        >>> import torch
        >>> print(without_optimizer_note(torch.nn.Linear(4, 4), None))  # 20 fp32 parameters
        no optimizer counted (--optimizer none): a loop stepping AdamW holds 160 B more from its
        second step on; --optimizer adamw plans for that
        >>> without_optimizer_note(torch.nn.Linear(4, 4), "adamw") is None
        True
    """
    from gradckpt.budget import format_bytes
    from gradckpt.measure.training_state import optimizer_state_bytes

    if optimizer is not None:
        return None
    adamw_bytes = optimizer_state_bytes("adamw", model)
    if not adamw_bytes:
        return None
    return (f"no optimizer counted (--optimizer none): a loop stepping AdamW holds "
            f"{format_bytes(adamw_bytes)} more from its\nsecond step on; --optimizer adamw "
            "plans for that")


def memory_parts(
    model: nn.Module, profile: Profile, plan: Plan, optimizer_bytes: int,
    optimizer_name: str = "Adam",
) -> MemoryParts:
    """What takes the step's memory under the plan, part by part, with the plan's predicted
    peak. The parts are sizes, not one instant: they may add up to more than the peak.

    Example:
        >>> import torch, gradckpt
        >>> from gradckpt.toy_models import mlp_chain
        >>> model = mlp_chain(4, 8)
        >>> profile = gradckpt.profile(model, torch.randn(16, 8), repeats=1)
        >>> plan = gradckpt.solve(profile, None, "sqrt")
        >>> parts = memory_parts(model, profile, plan, 0)
        >>> [name for name, _ in parts.parts][:3]
        ['parameters', 'gradients', 'activations kept for backward (under this plan)']
        >>> parts.predicted_peak_bytes == plan.predicted_peak_bytes
        True
    """
    from gradckpt.report import MemoryParts

    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    gradient_bytes = sum(
        p.numel() * p.element_size() for p in model.parameters() if p.requires_grad
    )
    activation_bytes = retained_activation_bytes(profile, plan)
    head_bytes = getattr(profile, "head_bytes", 0)  # the logits, mostly, where profiled
    parts = [
        ("parameters", parameter_bytes),
        ("gradients", gradient_bytes),
        ("activations kept for backward (under this plan)", activation_bytes),
    ]
    if head_bytes:
        parts.append(("logits and loss (the output head)", head_bytes))
    if optimizer_bytes:
        parts.append((f"optimizer state ({optimizer_name})", optimizer_bytes))
    # The plan's predicted peak counts the optimizer's state (in the profile's fixed_bytes).
    rest = plan.predicted_peak_bytes - parameter_bytes - gradient_bytes - activation_bytes
    rest -= head_bytes + optimizer_bytes
    if rest > 0:
        parts.append(("the rest (inputs, temporaries, recomputation)", rest))
    return MemoryParts(parts, plan.predicted_peak_bytes)


def retained_activation_bytes(profile: Profile, plan: Plan) -> int:
    """What the chain keeps for backward at the end of the forward pass under the plan: what
    its kept blocks save, each segment's input, the matmul outputs a policy keeps, and the side
    inputs (an encoder's output the decoder saves), which stay whatever the plan.

    Example:
        >>> from gradckpt import solve
        >>> from gradckpt.profile_types import BlockProfile
        >>> from gradckpt.cli.sqrt_table import homogeneous_chain
        >>> chain = homogeneous_chain(BlockProfile("b", 10, 10, 50, True, 1.0, 2.0), 4)
        >>> retained_activation_bytes(chain, solve(chain, None, "none"))  # 4 blocks x 50
        200
        >>> retained_activation_bytes(chain, solve(chain, None, "every-layer"))  # 4 inputs
        40
    """
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
    sides = sum(block.side_bytes for block in blocks)
    return kept + inputs + matmuls + sides
