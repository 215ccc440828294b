"""One rank's profile when ranks shard the model: ``gradckpt.estimate(..., world_size=N)``.

``measure.estimate`` predicts one process training the whole model. With sharded data
parallelism (FSDP2's ``fully_shard`` per block and on the root, ZeRO-3) each of ``N`` ranks
keeps 1/N of the parameters, gradients and optimizer state, and holds more while a block
computes: that block's parameters gathered in full, the next block's too (FSDP2 prefetches),
and the block's full gradients until they are reduce-scattered. Activations are per rank
already (the sample is one rank's batch). This module turns the single-process profile into one
rank's, so that the budget is a per-rank budget; its plain-step peak is the cost model's
(``cost.plan_for`` with no segments), as every plan's is.

Not yet checked against a sharded run: issue 16 measures FSDP2.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .cost import plan_for
from .devices import DeviceSpec
from .errors import UsageError
from .measure import estimate as estimate_one_process
from .measure.estimate import GRADIENTS, OPTIMIZER_STATE, PARAMETERS
from .profile_types import Profile

__all__ = ["estimate", "shard"]

GATHERED = "gathered in full while a block computes (FSDP)"


def estimate(
    model: nn.Module,
    sample: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    blocks: Any = None,
    *,
    device: str | DeviceSpec | dict | None = "this",
    optimizer: str | None = None,
    world_size: int = 1,
    dtype: torch.dtype | None = None,
    autocast: torch.dtype | None = None,
    keep_output: bool = True,
) -> Profile:
    """Predict what ``gradckpt.profile`` would measure, without running the model for real.

    See ``gradckpt.measure.estimate`` for every argument but ``world_size``: the ranks that
    shard parameters, gradients and optimizer state as FSDP2 and ZeRO-3 do (``shard``); the
    profile is then one rank's and ``sample`` is one rank's batch.

    Example:
        >>> import torch, gradckpt
        >>> from gradckpt.models import GPTConfig, TinyGPT
        >>> with torch.device("meta"):
        ...     model = TinyGPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
        >>> idx = torch.randint(0, 512, (2, 16), device="meta")
        >>> whole = gradckpt.estimate(model, {"idx": idx, "targets": idx}, device="h100")
        >>> per_rank = gradckpt.estimate(model, {"idx": idx, "targets": idx}, device="h100",
        ...                              world_size=4)
        >>> per_rank.notes["memory_parts"]["parameters"] * 4 == whole.notes["memory_parts"][
        ...     "parameters"]
        True
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise UsageError(f"world_size must be a positive int (the ranks sharding the model), "
                         f"got {world_size!r}")
    predicted = estimate_one_process(
        model, sample, loss_fn, blocks, device=device, optimizer=optimizer, dtype=dtype,
        autocast=autocast, keep_output=keep_output,
    )
    return shard(predicted, world_size) if world_size > 1 else predicted


def shard(predicted: Profile, world_size: int) -> Profile:
    """``predicted`` (from ``measure.estimate``) as one of ``world_size`` sharding ranks.

    Example:
        >>> from gradckpt.profile_types import BlockProfile, Profile
        >>> block = BlockProfile("h.0", 10, 10, 50, True, 1.0, 2.0, gradient_bytes=400)
        >>> whole = Profile([block], 2000, 1500, 4.0, notes={"memory_parts": {
        ...     "parameters": 800, "gradients (trainable parameters)": 800,
        ...     "optimizer state": 0}, "largest_block_parameter_bytes": 400})
        >>> shard(whole, 2).notes["memory_parts"]["parameters"]
        400
    """
    parts = dict(predicted.notes["memory_parts"])
    keep = 1 / world_size
    parameter_bytes = parts.get(PARAMETERS, 0)
    gradient_bytes = parts.get(GRADIENTS, 0)
    optimizer_bytes = parts.get(OPTIMIZER_STATE, 0)
    largest_gradients = max((block.gradient_bytes for block in predicted.blocks), default=0)
    gathered = 2 * predicted.notes.get("largest_block_parameter_bytes", 0) + largest_gradients
    # Parameters and optimizer state are allocated all step (fixed); gradients as backward
    # makes them, block by block: each block's kept 1/N once reduce-scattered.
    away = int((1 - keep) * (parameter_bytes + optimizer_bytes))
    gradients_away = int((1 - keep) * gradient_bytes)
    blocks = [dataclasses.replace(block, gradient_bytes=int(block.gradient_bytes * keep))
              for block in predicted.blocks]
    for name, size in ((PARAMETERS, parameter_bytes), (OPTIMIZER_STATE, optimizer_bytes),
                       (GRADIENTS, gradient_bytes)):
        if name in parts:
            parts[name] = int(size * keep)
    parts[GATHERED] = gathered
    sharded = dataclasses.replace(
        predicted,
        blocks=blocks,
        fixed_bytes=predicted.fixed_bytes - away + gathered,
        head_gradient_bytes=int(predicted.head_gradient_bytes * keep),
        other_peak_bytes=max(0, predicted.other_peak_bytes - gradients_away),
        notes={**predicted.notes, "memory_parts": parts, "world_size": world_size,
               "largest_part": max(parts, key=parts.get)},
    )
    sharded.peak_bytes = plan_for(sharded, "none", None, []).predicted_peak_bytes
    return sharded
