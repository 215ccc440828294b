"""Why a budget is infeasible, and what to do about it: the text a ``BudgetError`` adds below
"raise the budget to at least ...".

Checkpointing lowers one part of a step's memory, the activations kept for backward. When no
plan fits, the rest of the step is what stands in the way: what is held all step (the
parameters, the optimizer's state, gradients accumulated between micro-batches), the output
head's logits, which for a language model are often the largest item of all, or
``optimizer.step()``, when every gradient exists beside the optimizer's state. So the
explanation breaks down the least plan's peak, the moment it happens, into those parts,
largest first, and names the levers that shrink the largest one: only those that apply to this
step, as far as the profile tells (``Profile.notes``: the parameters' dtypes, how many of them
train, the batch size, the optimizer, whether the loop holds the model's output); no "hold the
weights in bf16" for weights in bf16 already, no "a smaller batch" at batch 1.

Example:
    >>> from gradckpt.profile_types import Profile, example_block
    >>> blocks = [example_block(f"h.{i}") for i in range(4)]
    >>> profile = Profile(blocks, 1500, 1000, 12.0, head_bytes=300)
    >>> print(budget_message("budget 1.10 KiB is below ...", explain_infeasible(
    ...     profile, [Segment(0, 3)])))  # doctest: +ELLIPSIS
    budget 1.10 KiB is below ...
    The least plan's peak, 1.28 KiB, comes at the output head: memory held all step (parameters,
    ...
"""

from __future__ import annotations

import re
import textwrap
from dataclasses import dataclass

from ..budget import format_bytes
from ..cost import PHASES, phase_peaks
from ..plan import Segment
from ..profile_types import Profile

__all__ = ["RETRY_WITHOUT_MEASURING", "budget_message", "explain_infeasible"]

_PHASE_WORDS = {
    "forward": "in the forward pass",
    "head": "at the output head",
    "backward": "in the backward pass",
    "other": "outside the checkpointed blocks",
    "optimizer": "at optimizer.step()",
}

_SHARD = "shard them across GPUs (FSDP2; gradckpt.estimate(..., world_size=N) predicts one rank)"


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


def explain_infeasible(
    profile: Profile, least_segments: list[Segment], *, head_chunked: bool = False,
    output_head: str = "auto",
) -> str:
    """What the least plan's peak is made of, largest first, and what lowers the largest part
    (see the module): one paragraph, unwrapped. ``profile`` is the step the least plan runs
    (``head_chunked``: with its head in chunks already); ``output_head``: what the caller let
    the plan do with the head (``"plain"``: chunking it is a lever the caller ruled out).

    Example: full fine-tuning in bf16 with AdamW, where ``optimizer.step()`` peaks highest
        >>> from gradckpt.profile_types import Profile, example_block
        >>> blocks = [example_block(f"h.{i}", gradient_bytes=250)
        ...           for i in range(4)]
        >>> profile = Profile(blocks, 6000, 5000, 12.0, optimizer_state_bytes=4000,
        ...                   optimizer_step_bytes=1500, notes={
        ...     "parameter_dtypes": {"torch.bfloat16": 1000}, "trainable_parameter_bytes": 1000,
        ...     "optimizer": "AdamW", "batch_size": 1, "keep_output": False})
        >>> print(textwrap.fill(explain_infeasible(profile, [Segment(0, 3)]), 88))
        The least plan's peak, 6.35 KiB, comes at optimizer.step(): the optimizer's state
        (AdamW) 3.91 KiB; every gradient and the optimizer's temporaries 1.46 KiB; the
        parameters, buffers and batch 1000 B. Checkpointing lowers only the activations, and
        none are alive then; to lower this peak, use an 8-bit optimizer (bitsandbytes'
        AdamW8bit), one with less state (Adafactor) or none (SGD), train adapters on a frozen
        base (LoRA) so that fewer gradients and less state exist, or shard the state across GPUs
        (FSDP2; gradckpt.estimate(..., world_size=N) predicts one rank).
    """
    phases = phase_peaks(profile, least_segments)
    phase = max(PHASES, key=lambda name: phases.get(name, 0))
    step = _Step.of(profile, head_chunked, output_head)
    parts = _parts_at_peak(profile, phases, phase, step)
    listed = "; ".join(f"{label} {format_bytes(size)}" for _, label, size in parts)
    lever = _lever(parts[0][0], step) if parts else "raise the budget"
    if phase == "optimizer":  # no activation is alive then: no plan changes this moment
        advice = (f"Checkpointing lowers only the activations, and none are alive then; to "
                  f"lower this peak, {lever}.")
    else:
        advice = f"Checkpointing lowers only the activations; to lower the rest, {lever}."
    return (f"The least plan's peak, {format_bytes(profile.fixed_bytes + phases[phase])}, comes "
            f"{_PHASE_WORDS.get(phase, f'at {phase}')}: {listed}. {advice}")


@dataclass(frozen=True)
class _Step:
    """What the profile tells of the step around the chain, for the levers that apply to it.
    ``None`` (or "wide") where the profile does not say (a hand-made one): every lever."""

    frozen: bool  # most parameters do not train (LoRA on a frozen base)
    precision: str  # the parameters' storage, by bytes: "wide" (32 bits+), "half", "low" (<= 8)
    batch_size: int | None
    keep_output: bool | None  # the loop holds the model's output until backward ends
    optimizer: str | None
    optimizer_state_bytes: int
    accumulated_gradient_bytes: int
    previous_output_bytes: int
    head_chunked: bool = False  # the least plan computes the loss in chunks already
    chunkable_head: bool = False  # the profile measured a chunked head (Profile.chunked_heads)
    output_head: str = "auto"  # what the caller let the plan do with the head

    @classmethod
    def of(cls, profile: Profile, head_chunked: bool = False, output_head: str = "auto"
           ) -> _Step:
        notes = profile.notes
        optimizer_state = profile.optimizer_state_bytes
        accumulated = profile.accumulated_gradient_bytes
        dtypes = notes.get("parameter_dtypes") or {}
        parameter_bytes = sum(dtypes.values())
        trainable = notes.get("trainable_parameter_bytes")
        if parameter_bytes and trainable is not None:
            frozen = 10 * trainable < parameter_bytes
        else:  # gradients a tenth of what is held all step besides them: a frozen base
            gradients = profile.head_gradient_bytes + sum(block.gradient_bytes
                                                          for block in profile.blocks)
            frozen = 10 * gradients < profile.fixed_bytes - optimizer_state - accumulated
        batch_size = notes.get("batch_size")
        keep_output = notes.get("keep_output")
        return cls(
            frozen=frozen,
            precision=_precision(dtypes),
            batch_size=batch_size if isinstance(batch_size, int) else None,
            keep_output=keep_output if isinstance(keep_output, bool) else None,
            optimizer=notes.get("optimizer") or None,
            optimizer_state_bytes=optimizer_state,
            accumulated_gradient_bytes=accumulated,
            previous_output_bytes=profile.previous_output_bytes,
            head_chunked=head_chunked,
            chunkable_head=bool(profile.chunked_heads),
            output_head=output_head,
        )

    @property
    def single_example(self) -> bool:
        return self.batch_size == 1

    @property
    def eight_bit_optimizer(self) -> bool:
        return bool(self.optimizer) and "8bit" in re.sub(r"[^a-z0-9]", "",
                                                         str(self.optimizer).lower())


def _precision(dtypes: dict[str, int]) -> str:
    """How the parameters are stored, by bytes: "wide" (32 bits or more, or unknown), "half"
    (bf16, fp16) or "low" (8 bits or fewer: int8, a 4-bit base packed in uint8, float8).

    Example:
        >>> _precision({"torch.bfloat16": 900, "torch.float32": 100}), _precision({})
        ('half', 'wide')
        >>> _precision({"torch.uint8": 500, "torch.bfloat16": 300, "torch.float32": 300})
        'low'
    """
    by_kind = {"wide": 0, "half": 0, "low": 0}
    for name, size in dtypes.items():
        bits = re.search(r"(\d+)", str(name))
        if bits is None:  # bool, or an alias str(dtype) does not write ("float", "half")
            continue
        width = int(bits.group(1))
        kind = "wide" if width >= 32 else "half" if width == 16 else "low"
        by_kind[kind] += size
    return max(by_kind, key=lambda kind: by_kind[kind]) if any(by_kind.values()) else "wide"


def _parts_at_peak(profile: Profile, phases: dict[str, int], phase: str, step: _Step
                   ) -> list[tuple[str, str, int]]:
    """The parts of the peak as (kind, label, bytes), largest first."""
    optimizer_name = f" ({step.optimizer})" if step.optimizer else ""
    state = min(step.optimizer_state_bytes, profile.fixed_bytes)
    accumulated = min(step.accumulated_gradient_bytes, profile.fixed_bytes - state)
    buckets = min(profile.notes.get("ddp_bucket_bytes", 0),
                  profile.fixed_bytes - state - accumulated)
    parts = [
        ("optimizer_state", f"the optimizer's state{optimizer_name}", state),
        ("accumulated", "gradients held between micro-batches", accumulated),
        ("ddp_buckets", "DDP's buckets (a copy of the trainable gradients)", buckets),
        # With the state or gradients named apart, "held all step" would not tell the rest.
        ("frozen" if step.frozen else "fixed",
         "the parameters, buffers and batch" if state or accumulated or buckets
         else "memory held all step (parameters, buffers, the batch)",
         profile.fixed_bytes - state - accumulated - buckets),
    ]
    if phase == "head":
        parts += [("head", "the logits, the loss and their gradient", profile.head_bytes),
                  ("kept", "activations kept for backward", phases["retained"])]
    elif phase == "forward":
        previous = min(step.previous_output_bytes, phases["forward"])
        parts += [("previous_output", "the previous step's output (alive until this step's "
                   "replaces it)", previous),
                  ("kept", "activations kept for backward", phases["forward"] - previous)]
    elif phase == "backward":
        parts.append(("backward", "activations, gradients and one block's working memory",
                      phases[phase]))
    elif phase == "optimizer":
        held = "" if step.keep_output is False else ", the model's output your loop holds"
        parts.append(("optimizer", f"every gradient{held} and the optimizer's temporaries",
                      phases[phase]))
    else:
        parts.append((phase, "the step outside the blocks (the embedding's backward, with "
                      "every gradient)", phases[phase]))
    return sorted((part for part in parts if part[2] > 0), key=lambda part: -part[2])


def _lever(kind: str, step: _Step) -> str:
    """What shrinks the part ``kind`` of this step (see ``_parts_at_peak``), as a clause."""
    smaller = ("use shorter sequences (the batch is 1 already)" if step.single_example else
               "use a smaller batch (accumulating gradients over several for the same "
               "effective batch) or shorter sequences")
    if kind in ("kept", "backward"):
        return smaller
    if kind == "head":
        return _head_lever(step)
    if kind == "previous_output":
        return ("let go of the last step's output before the next forward (del out at the end "
                "of each step), or drop it before backward and plan for that: "
                "keep_output=False")
    if kind == "frozen":
        if step.precision == "low":
            return f"the weights are mostly frozen already, in 8 bits or fewer: {_SHARD}"
        base = "8-bit or 4-bit" if step.precision == "half" else "bf16 or 4-bit"
        return (f"the weights are mostly frozen already: hold the frozen base in {base} "
                f"(QLoRA), or {_SHARD.replace('them', 'it', 1)}")
    if kind == "fixed":
        if step.precision == "wide":
            return f"train adapters on a frozen base (LoRA), hold the weights in bf16, or {_SHARD}"
        with_base = (" with that base in 8-bit or 4-bit (QLoRA)" if step.precision == "half"
                     else "")
        return f"train adapters on a frozen base (LoRA){with_base}, or {_SHARD}"
    if kind in ("ddp_buckets", "accumulated"):  # gradients held all step: fewer, or sharded
        levers = [] if step.frozen else ["train adapters on a frozen base (LoRA) so that fewer "
                                         "gradients exist"]
        shard = ("shard the model with FSDP2 instead of DDP (each rank then holds 1/N of the "
                 "gradients; gradckpt.estimate(..., world_size=N) predicts one rank)"
                 if kind == "ddp_buckets" else _SHARD.replace("them", "the gradients", 1))
        return _either([*levers, shard])
    if kind in ("optimizer_state", "optimizer"):
        levers = []
        if step.optimizer_state_bytes:
            levers.append(
                "use an optimizer with less state (Adafactor) or none (SGD)"
                if step.eight_bit_optimizer else
                "use an 8-bit optimizer (bitsandbytes' AdamW8bit), one with less state "
                "(Adafactor) or none (SGD)")
        if not step.frozen:
            levers.append("train adapters on a frozen base (LoRA) so that fewer gradients and "
                          "less state exist")
        if kind == "optimizer" and step.keep_output is not False and step.previous_output_bytes:
            levers.append("let go of the model's output before optimizer.step() (del out "
                          "after backward)")
        if kind == "optimizer" and step.chunkable_head and step.output_head == "plain":
            levers.append("let gradckpt compute the loss in chunks of tokens, so that the "
                          "output holds no logits (output_head='auto' instead of 'plain')")
        what = ("the state" if kind == "optimizer_state" else
                "the gradients and the optimizer's state" if step.optimizer_state_bytes
                else "the gradients")
        return _either([*levers, _SHARD.replace("them", what, 1)])
    # "other": the embedding's backward, with every gradient
    if step.frozen:
        return "shard the parameters across GPUs (FSDP2)"
    return ("train adapters on a frozen base (LoRA) so fewer gradients exist, or shard the "
            "parameters across GPUs (FSDP2)")


def _head_lever(step: _Step) -> str:
    """What shrinks the output head's part: its loss in chunks where gradckpt can and the
    plan does not yet, then shorter sequences or a smaller batch."""
    shorter = ("use shorter sequences (the batch is 1 already)" if step.single_example
               else "use shorter sequences or a smaller batch")
    if step.head_chunked:  # one chunk of logits at a time already
        return shorter
    if step.chunkable_head and step.output_head == "plain":
        return (f"let gradckpt compute the loss in chunks of tokens (output_head='auto' or "
                f"'chunked' instead of 'plain'; out.logits is then empty), or {shorter}")
    lever = ("compute the loss in chunks of tokens so that the whole logits never exist at "
             "once: gradckpt plans that itself when the loss runs through "
             "gradckpt.linear_cross_entropy(hidden, head, targets) (a Hugging Face causal "
             f"language model given labels does), or {shorter}")
    if step.keep_output is not False:  # a loop known to drop it already needs no telling
        lever += ("; if your loop drops the model's output before backward (the Hugging "
                  "Face Trainer does), plan for that: keep_output=False (gradckpt plan "
                  "--drop-output)")
    return lever


def _either(levers: list[str]) -> str:
    """``a``, ``a or b``, ``a, b, or c``.

    Example:
        >>> _either(["a"]), _either(["a", "b"]), _either(["a", "b", "c"])
        ('a', 'a or b', 'a, b, or c')
    """
    if len(levers) < 3:
        return " or ".join(levers)
    return f"{', '.join(levers[:-1])}, or {levers[-1]}"
