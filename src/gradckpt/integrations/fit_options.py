"""The levers of ``gradckpt fit`` and what the search passes around: each lever (``LEVERS``)
with its change rank, the order of change those ranks define over sets of levers, a step's
``Configuration`` (what one estimate is of), and what ``fit`` returns (``FitSearch`` of
``FitOption``). Plain data and pure functions of lever names: no estimate, no model.

The levers, the change ranks and what "cheapest" means: ``gradckpt.integrations.fit``; how the
search walks the sets of levers: ``gradckpt.integrations.fit_search``.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch
from torch import nn

from ..errors import GradckptError, UsageError, did_you_mean
from ..plan import Plan
from ..profile_types import Profile

__all__ = [
    "LEVERS", "Adapters", "Configuration", "FineTune", "FitOption", "FitSearch", "Lever",
    "LeverSkipped", "check_levers",
]


@dataclass(frozen=True)
class Adapters:
    """Adapters trained on a frozen base: LoRA of ``rank`` on ``targets`` (module names,
    comma-separated, or ``None``: every linear layer but the output head), the base as it is
    (``"as-is"``) or quantised (``"4-bit"``, ``"8-bit"``)."""

    rank: int = 16
    targets: str | None = None
    base: str = "as-is"

    def describe(self) -> str:
        """Example:
        >>> Adapters(16, None, "4-bit").describe()
        'QLoRA: 4-bit base + LoRA r=16 on all-linear'
        """
        lora = f"LoRA r={self.rank} on {self.targets or 'all-linear'}"
        return lora if self.base == "as-is" else f"QLoRA: {self.base} base + {lora}"


@dataclass(frozen=True)
class Configuration:
    """What one estimate is of: the step's micro-batch (one rank's), the accumulation steps,
    the ranks sharding it, the precision, whether the loop holds the output through backward,
    the adapters trained (``None``: every parameter as the model has it), and whether each
    rank runs it under ``DistributedDataParallel`` (``ddp``: its ranks are not counted here,
    they do not shard the model)."""

    batch: int | None
    accumulation_steps: int = 1
    world_size: int = 1
    dtype: torch.dtype | None = None
    autocast: torch.dtype | None = None
    keep_output: bool = True
    adapters: Adapters | None = None
    ddp: bool = False

    @property
    def effective_batch(self) -> int | None:
        """Samples per optimizer step over every rank and micro-batch (under DDP, per rank:
        DDP's ranks multiply it alike for every configuration of the same GPUs)."""
        if self.batch is None:
            return None
        return self.batch * self.accumulation_steps * self.world_size


@dataclass(frozen=True)
class Lever:
    """One thing that can change about a step: its ``name``, its change ``rank`` (0: the loop,
    nothing trained ... 5: more GPUs; the plan's levers, recompute and chunked-head, are no
    change) and a few words on what it changes."""

    name: str
    rank: int
    summary: str


LEVERS: tuple[Lever, ...] = (
    Lever("recompute", 0, "a checkpointing plan: recompute (or offload) activations in backward"),
    Lever("chunked-head", 0, "the output head's loss in chunks of tokens, logits recomputed"),
    Lever("drop-output", 0, "the loop drops the output before backward (the HF Trainer does)"),
    Lever("autocast", 1, "bf16 mixed precision: fp32 weights, forward under torch.autocast"),
    Lever("micro-batch", 1, "a smaller micro-batch with gradient accumulation, same batch"),
    Lever("bf16", 2, "the whole model trained in bf16"),
    Lever("lora", 3, "LoRA adapters on a frozen base instead of full fine-tuning"),
    Lever("4bit", 4, "a 4-bit base (QLoRA: NF4, double quantisation) with LoRA adapters"),
    Lever("fsdp", 5, "FSDP2 over N GPUs, the fewest that fit"),
)
_BY_NAME = {lever.name: lever for lever in LEVERS}
# Levers the solve pulls (one estimate serves both); the others each make a new configuration.
_PLAN_LEVERS = ("recompute", "chunked-head")
# Levers that exclude each other: one precision, one kind of adapters.
_EXCLUSIVE = ({"autocast", "bf16"}, {"lora", "4bit"})
# The order levers are applied in: sharding splits the batch before micro-batches split it
# again; adapters wrap the base before its precision is chosen.
_APPLICATION_ORDER = ("fsdp", "4bit", "lora", "bf16", "autocast", "micro-batch", "drop-output")
# Of each exclusive kind, the lever that holds no more memory than the other: bf16 throughout
# keeps less than autocast's fp32 weights and their bf16 copies; a 4-bit base less than LoRA's.
_SAVING_SUBSTITUTES = (("autocast", "bf16"), ("lora", "4bit"))
_RANKS = tuple(lever.rank for lever in LEVERS)


class LeverSkipped(GradckptError):
    """A lever cannot be pulled for this step; the message says why."""


@dataclass
class FitOption:
    """A configuration that fits: the ``levers`` it pulls (names of ``LEVERS``, in that
    order), its ``change`` (their ranks but the plan's, largest first), the ``configuration``
    estimated, a ``description`` in words, the ``plan`` solved for the budget and the
    ``profile`` it was solved from; its ``predicted_peak_bytes`` (per GPU), the predicted
    time of one optimizer step over the effective batch (``predicted_step_seconds``, a
    roofline, comparable between options of one search) and that time as a multiple of the
    step as it is, without checkpointing (``relative_time``)."""

    levers: tuple[str, ...]
    change: tuple[int, ...]
    configuration: Configuration
    description: str
    plan: Plan
    profile: Profile
    predicted_peak_bytes: int
    predicted_step_seconds: float
    relative_time: float

    def sort_key(self) -> tuple:
        """Least change first, then the fewest GPUs, then the fastest."""
        return (self.change, self.configuration.world_size, self.predicted_step_seconds)


@dataclass
class FitSearch:
    """What ``fit`` found: the ``options`` that fit, best first; the step as it is
    (``as_is``: its profile, and ``as_is_least_peak_bytes``, the least peak any plan of it
    reaches); the ``budget_bytes``; the levers not tried and why (``skipped``); and how many
    configurations were ``estimated``."""

    options: list[FitOption]
    as_is: Profile
    as_is_least_peak_bytes: int
    budget_bytes: int
    skipped: dict[str, str] = field(default_factory=dict)
    estimated: int = 0


# (a copy of the model on meta, the adapters, the dtype to train in) -> the model to train.
FineTune = Callable[[nn.Module, Adapters, "torch.dtype | None"], nn.Module]


# --- lever names and the order of change -----------------------------------------------------


def check_levers(levers: Iterable[str] | str) -> list[str]:
    """Lever names (a list, or one string of comma-separated names), checked: an unknown one
    is a ``UsageError`` naming the close ones and every lever.

    Example:
        >>> check_levers("recompute, lora")
        ['recompute', 'lora']
        >>> check_levers(["4-bit"])
        Traceback (most recent call last):
        ...
        gradckpt.errors.UsageError: unknown lever '4-bit'; did you mean '4bit'? (levers: ...
    """
    if isinstance(levers, str):
        levers = [name.strip() for name in levers.split(",") if name.strip()]
    names = list(levers)
    for name in names:
        if name not in _BY_NAME:
            raise UsageError(f"unknown lever {name!r}{did_you_mean(name, _BY_NAME)} (levers: "
                             f"{', '.join(_BY_NAME)})")
    if not names:
        raise UsageError(f"no lever named; levers: {', '.join(_BY_NAME)}")
    return names


def _allowed_levers(levers: Iterable[str] | str | None, output_head: str) -> set[str]:
    """The lever names that may be pulled (``"plain"`` output head: not the chunked one)."""
    names = set(_BY_NAME) if levers is None else set(check_levers(levers))
    if output_head == "plain":
        names.discard("chunked-head")
    return names


def _change(levers: Iterable[str]) -> tuple[int, ...]:
    """The ranks of ``levers`` but the plan's, largest first: an option's change.

    Example:
        >>> _change(["recompute", "micro-batch", "lora", "drop-output", "autocast"])
        (3, 1, 1, 0)
    """
    return tuple(sorted((_BY_NAME[n].rank for n in levers if n not in _PLAN_LEVERS),
                        reverse=True))


def _subsets_by_change(levers: list[str]) -> list[tuple[str, ...]]:
    """Every subset of ``levers`` that pulls at most one of each exclusive kind, in order of
    change, then the fewest levers.

    Example:
        >>> _subsets_by_change(["lora", "micro-batch", "drop-output"])[:4]
        [(), ('drop-output',), ('micro-batch',), ('micro-batch', 'drop-output')]
    """
    subsets = [
        subset for size in range(len(levers) + 1)
        for subset in itertools.combinations(levers, size)
        if all(len(kind & set(subset)) <= 1 for kind in _EXCLUSIVE)
    ]
    return sorted(subsets, key=lambda subset: (_change(subset), len(subset)))


def _saving_closure(subset: Iterable[str], levers: Iterable[str], skipped: dict[str, str]
                    ) -> tuple[str, ...]:
    """``subset`` with each lever replaced by the more saving one of its kind where that is
    among ``levers`` and not skipped (bf16 for autocast, a 4-bit base for LoRA), in
    application order: a configuration holding no more memory than ``subset``'s.

    Example:
        >>> _saving_closure(["autocast", "lora"], ["autocast", "bf16", "lora"], {})
        ('lora', 'bf16')
    """
    available = set(levers) - set(skipped)
    stronger = {weak: strong for weak, strong in _SAVING_SUBSTITUTES if strong in available}
    return _in_order(stronger.get(name, name) for name in subset)


def _in_order(names: Iterable[str]) -> tuple[str, ...]:
    """Lever names, each once, in application order."""
    chosen = set(names)
    return tuple(name for name in _APPLICATION_ORDER if name in chosen)
