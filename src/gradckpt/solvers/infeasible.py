"""Why a budget is infeasible, and what to do about it: the text a ``BudgetError`` adds below
"raise the budget to at least ...".

Checkpointing lowers one part of a step's memory, the activations kept for backward. When no
plan fits, the rest of the step is what stands in the way: the parameters (and their gradients
and optimizer state) held all step, or the output head's logits, which for a language model
are often the largest item of all. So the explanation breaks down the least plan's peak,
the moment it happens, into those parts, largest first, and names the levers that shrink the
largest one.

Example:
    >>> from gradckpt.profile_types import BlockProfile, Profile
    >>> blocks = [BlockProfile(f"h.{i}", 10, 10, 50, True, 1.0, 2.0) for i in range(4)]
    >>> profile = Profile(blocks, 1500, 1000, 12.0, head_bytes=300)
    >>> print(budget_message("budget 1.10 KiB is below ...", explain_infeasible(
    ...     profile, [Segment(0, 3)])))  # doctest: +ELLIPSIS
    budget 1.10 KiB is below ...
    The least plan's peak, 1.28 KiB, comes at the output head: memory held all step (parameters,
    ...
"""

from __future__ import annotations

import textwrap

from ..budget import format_bytes
from ..cost import PHASES, phase_peaks
from ..plan import Segment
from ..profile_types import Profile

__all__ = ["RETRY_WITHOUT_MEASURING", "budget_message", "explain_infeasible"]

# What each part of the peak is, and what shrinks it when it is the largest part.
_PARTS = {
    "fixed": ("memory held all step (parameters, buffers, the batch)",
              "train adapters on a frozen base (LoRA), hold the weights in bf16, or shard them "
              "across GPUs (FSDP2; gradckpt.estimate(..., world_size=N) predicts one rank)"),
    "frozen": ("memory held all step (parameters, buffers, the batch)",
               "the weights are mostly frozen already: hold the frozen base in bf16 or 4-bit "
               "(QLoRA), or shard it across GPUs (FSDP2; gradckpt.estimate(..., world_size=N) "
               "predicts one rank)"),
    "head": ("the logits, the loss and their gradient",
             "compute the loss in chunks so that the whole logits never exist at once (a chunked "
             "or fused cross-entropy), or use shorter sequences or a smaller batch; if your loop "
             "drops the model's output before backward (the Hugging Face Trainer does), plan for "
             "that: keep_output=False (gradckpt plan --drop-output)"),
    "kept": ("activations kept for backward",
             "use a smaller batch (accumulating gradients over several for the same effective "
             "batch) or shorter sequences"),
    "backward": ("activations, gradients and one block's working memory",
                 "use a smaller batch (accumulating gradients over several for the same "
                 "effective batch) or shorter sequences"),
    "other": ("the step outside the blocks (the embedding's backward, with every gradient)",
              "train adapters on a frozen base (LoRA) so fewer gradients exist, or shard the "
              "parameters across GPUs (FSDP2)"),
}

_PHASE_WORDS = {
    "forward": "in the forward pass",
    "head": "at the output head",
    "backward": "in the backward pass",
    "other": "outside the checkpointed blocks",
}


RETRY_WITHOUT_MEASURING = (
    " To retry at the smallest budget without measuring again: plan = "
    "gradckpt.solve(error.profile, error.minimum_bytes); gradckpt.apply(model, plan)."
)


def budget_message(headline: str, explanation: str, after: str = "") -> str:
    """A ``BudgetError``'s message: the headline (the budget and the smallest that works) on
    its line, then the explanation and ``after`` (a sentence: how to retry) wrapped below it.

    Example:
        >>> print(budget_message("budget 1 B is below 2 B", "Why.", " Retry."))
        budget 1 B is below 2 B
        Why. Retry.
    """
    if not explanation:
        return headline
    return f"{headline}\n{textwrap.fill(explanation + after, width=100)}"


def explain_infeasible(profile: Profile, least_segments: list[Segment]) -> str:
    """What the least plan's peak is made of, largest first, and what lowers the largest part
    (see the module): one paragraph, unwrapped."""
    phases = phase_peaks(profile, least_segments)
    phase = max(PHASES, key=lambda name: phases[name])
    parts = _parts_at_peak(profile, phases, phase)
    listed = "; ".join(f"{_PARTS[kind][0]} {format_bytes(size)}" for kind, size in parts)
    text = (
        f"The least plan's peak, {format_bytes(profile.fixed_bytes + phases[phase])}, comes "
        f"{_PHASE_WORDS[phase]}: {listed}. Checkpointing lowers "
        f"only the activations; to lower the rest, {_PARTS[parts[0][0]][1]}."
    )
    return text


def _parts_at_peak(profile: Profile, phases: dict[str, int], phase: str) -> list[tuple[str, int]]:
    """The parts of the peak as (kind, bytes), largest first."""
    trainable = profile.head_gradient_bytes + sum(block.gradient_bytes
                                                  for block in profile.blocks)
    # Gradients a tenth of what is held all step: a frozen base (LoRA), where "train
    # adapters" is no advice.
    parts = [("frozen" if 10 * trainable < profile.fixed_bytes else "fixed", profile.fixed_bytes)]
    if phase == "head":
        parts += [("head", profile.head_bytes), ("kept", phases["retained"])]
    elif phase == "forward":
        parts.append(("kept", phases[phase]))
    else:
        parts.append((phase, phases[phase]))
    return sorted((part for part in parts if part[1] > 0), key=lambda part: -part[1])
