"""What a predicted step's memory is made of, by what each part is for.

``estimate`` notes these parts in ``Profile.notes["memory_parts"]``; ``shard`` divides some of
them among ranks, and the command line prints them. Sizes, not one instant: they need not sum
to the peak, since activations are freed as gradients are made.
"""

from __future__ import annotations

from torch import nn

from ..measure.tensors import tensor_bytes
from ..profile_types import Profile
from .devices import DeviceSpec

__all__ = [
    "ACTIVATIONS", "CUDA_RESERVE", "CUDA_RESERVE_BYTES", "GRADIENTS", "OPTIMIZER_STATE",
    "PARAMETERS", "memory_parts",
]

# What a process on a GPU loses before its first tensor and never sees in
# max_memory_allocated(): the CUDA context (kernels, cuBLAS/cuDNN workspaces: 0.5-1 GiB on
# recent GPUs and drivers) and the caching allocator's fragmentation. A fixed allowance.
CUDA_RESERVE = "CUDA context and allocator reserve (outside the peak)"
# The names of the parts that sharding divides among ranks (``per_rank``) and the command
# line looks up.
PARAMETERS = "parameters"
GRADIENTS = "gradients (trainable parameters)"
OPTIMIZER_STATE = "optimizer state"
ACTIVATIONS = "activations kept for backward (no checkpointing)"
CUDA_RESERVE_BYTES = 2 * 2**30


def memory_parts(
    model: nn.Module, predicted: Profile, optimizer_bytes: int, spec: DeviceSpec
) -> dict[str, int]:
    """The step's memory by what it is for (sizes, not one instant: they need not sum to the
    peak, since activations are freed as gradients are made)."""

    unique = {id(p): p for p in model.parameters()}.values()
    parts = {
        PARAMETERS: sum(tensor_bytes(p) for p in unique),
        GRADIENTS: sum(tensor_bytes(p) for p in unique if p.requires_grad),
        OPTIMIZER_STATE: optimizer_bytes,
        ACTIVATIONS: sum(
            b.saved_bytes + b.side_bytes for b in predicted.blocks),
        "logits, loss and their gradients (the output head)": predicted.head_bytes,
    }
    if spec.kind == "cuda":
        parts[CUDA_RESERVE] = CUDA_RESERVE_BYTES
    return {name: value for name, value in parts.items() if value}
