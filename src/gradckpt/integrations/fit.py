"""The cheapest change that fits: when a training step does not fit a budget, the few
configurations of it that do, the least change to what is trained first, then the fastest.

``fit(model, sample, budget, device=..., optimizer=...)`` predicts the step as it is with
``gradckpt.estimate`` (fake tensors: no weights, no real compute) and, where no plan makes it
fit, the same step with the levers gradckpt knows pulled, alone and together, each
configuration estimated once and solved for the budget. The levers (``LEVERS``), each with the
*change rank* that orders them:

====  ==============  ==========================================================================
rank  lever           what changes
====  ==============  ==========================================================================
-     recompute       a checkpointing plan: activations recomputed (or offloaded) in backward
-     chunked-head    the output head's loss in chunks of tokens, each chunk's logits recomputed
0     drop-output     the loop drops the model's output before backward, as the HF Trainer does
1     autocast        bf16 mixed precision: fp32 weights, the forward under ``torch.autocast``
1     micro-batch     a smaller micro-batch with gradient accumulation: the same effective batch
2     bf16            the whole model in bf16: weights, gradients and optimizer state rounded
3     lora            LoRA adapters (PEFT) on a frozen base instead of training every weight
4     4bit            the frozen base in 4 bits (QLoRA: NF4 with double quantisation) + LoRA
5     fsdp            FSDP2 sharding over N GPUs (the fewest that fit; per-GPU peak and time)
====  ==============  ==========================================================================

"Cheapest" is defined so. The plan's levers (recompute, chunked-head) are what gradckpt does
anyway and count as no change; the others change the step, each by its rank: 0 the loop, not
what is trained (the same numbers come out); 1 the numerics a little; 2 more; 3 and 4 what is
trained; 5 costs money. An option's *change* is the ranks of its levers but the plan's,
largest first, and options are ordered by it as tuples: a rank-3 lever is more change than any
number of rank-1 ones; of two options whose largest ranks are equal, the one with fewer levers
of that rank (then of the next) is less change; dropping the output is more change than a plan
alone and less than anything else. Equal change is ordered by fewer GPUs, then by the predicted
time of an optimizer step over the same effective batch. Of a lever's values, the least change
is taken that fits: the largest micro-batch (GPUs keep busier with it than a roofline shows),
the fewest GPUs.

The search stays small; each configuration is one estimate, and:

- options differing only in the plan share it: each configuration is solved once (strategy
  ``"optimal"``, which takes the fastest mix of recomputation and chunked head that fits);
- configurations go in order of change, and the search stops after the change class that
  brings the options found to ``count``;
- no option pulls every lever of another and more (more change for what the other already
  does; it may be faster, which ``gradckpt plan`` with both says), so such sets are not tried;
- where the levers of a change class, all pulled at their most saving (bf16 for autocast, a
  4-bit base for LoRA), do not fit, no set of them does: one estimate rules out the class;
  with every lever, it tells an impossible budget after two estimates;
- a configuration whose parameters, gradients and optimizer state alone exceed the budget is
  not estimated (no plan lowers them);
- a lever with values (micro-batch size, GPU count) is tried at its most saving value first,
  then bisected towards the least change.

The model is never changed: the levers that wrap it (LoRA, 4-bit) work on a copy on the meta
device, whose parameters take no memory.

Example:
    >>> import torch
    >>> from gradckpt.toy_models import mlp_chain
    >>> model, sample = mlp_chain(16, 256), torch.randn(8, 64, 256)  # 1M fp32 parameters
    >>> search = fit(model, sample, "9MiB", device="h100",
    ...              levers=["recompute", "micro-batch", "bf16"])
    >>> search.as_is_least_peak_bytes > 9 * 2**20  # no plan of the step as it is fits
    True
    >>> [(option.levers, option.description) for option in search.options]  # doctest: +ELLIPSIS
    [(('recompute', 'bf16'), 'bf16 throughout; ... blocks recomputed')]
    >>> search.options[0].predicted_peak_bytes <= 9 * 2**20
    True
"""

from __future__ import annotations

import copy
import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..budget import format_bytes, parse_budget
from ..errors import BudgetError, GradckptError, UsageError, did_you_mean
from ..measure.training_state import (
    OPTIMIZER_STATE_BYTES_PER_PARAMETER,
    OPTIMIZER_STATES_PER_PARAMETER,
)
from ..plan import Plan
from ..predict import estimate
from ..predict.devices import DeviceSpec, device_spec
from ..profile_types import Profile
from ..solvers import check_output_head, solve

__all__ = [
    "LEVERS", "Adapters", "Configuration", "FitOption", "FitSearch", "Lever", "LeverSkipped",
    "check_levers", "fit", "lora_adapters",
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
    and the adapters trained (``None``: every parameter as the model has it)."""

    batch: int | None
    accumulation_steps: int = 1
    world_size: int = 1
    dtype: torch.dtype | None = None
    autocast: torch.dtype | None = None
    keep_output: bool = True
    adapters: Adapters | None = None

    @property
    def effective_batch(self) -> int | None:
        """Samples per optimizer step over every rank and micro-batch."""
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


def fit(
    model: nn.Module,
    sample: Any,
    budget: int | str = "auto",
    *,
    device: str | DeviceSpec | dict = "this",
    optimizer: str | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
    autocast: torch.dtype | None = None,
    accumulation_steps: int = 1,
    keep_output: bool = True,
    world_size: int = 1,
    adapters: Adapters | None = None,
    levers: Iterable[str] | None = None,
    count: int = 3,
    max_world_size: int = 8,
    lora_rank: int = 16,
    lora_targets: str | None = None,
    output_head: str = "auto",
    fine_tune: FineTune | None = None,
    on_estimate: Callable[[str], None] | None = None,
) -> FitSearch:
    """The ``count`` cheapest configurations of the training step that fit ``budget`` on
    ``device``, best first (the order and the search: this module's docstring).

    Args:
        model, sample, loss_fn: the step, as for ``gradckpt.estimate``; the model may be on
            the meta device (no weights) and is not changed.
        budget: the peak per GPU, in any form ``gradckpt.solve`` reads; ``"auto"`` (default)
            is what ``device`` has; a percentage is of the step as it is, without checkpointing.
        device, optimizer, dtype, autocast, accumulation_steps, keep_output, world_size: the
            step as it is, as ``gradckpt.estimate`` takes them.
        adapters: the step as it is trains these adapters on ``model`` (made by ``fine_tune``).
        levers: the names of ``LEVERS`` that may be pulled (default: all).
        count: how many options to find.
        max_world_size: the most GPUs the ``fsdp`` lever may use (it tries 2, 4, 8, ...).
        lora_rank, lora_targets: the adapters the ``lora`` and ``4bit`` levers add.
        output_head: as for ``gradckpt.solve`` (``"plain"``: the logits stay whole).
        fine_tune: ``(copy of model, Adapters, dtype) -> model with them``, the base cast to
            ``dtype`` first; default ``lora_adapters``.
        on_estimate: called with a configuration's description before it is estimated.

    Returns a ``FitSearch``. If the step fits as it is, without a plan, its one option pulls
    no lever.

    Raises ``UsageError`` for an unknown lever name or a malformed argument, and
    ``BudgetError`` when no configuration fits: its ``minimum_bytes`` is the least peak the
    configuration with every lever pulled reaches, and the message says so.

    Example:
        >>> import torch
        >>> from gradckpt.toy_models import mlp_chain
        >>> search = fit(mlp_chain(16, 256), torch.randn(8, 64, 256), "12MiB", device="h100",
        ...              levers=["recompute"])
        >>> best = search.options[0]
        >>> best.levers, best.predicted_peak_bytes <= search.budget_bytes, search.estimated
        (('recompute',), True, 1)
        >>> fit(mlp_chain(16, 256), torch.randn(8, 64, 256), "9MiB", levers=["recompte"])
        Traceback (most recent call last):
        ...
        gradckpt.errors.UsageError: unknown lever 'recompte'; did you mean 'recompute'? ...
    """
    check_output_head(output_head)
    allowed = _allowed_levers(levers, output_head)
    for name, value, what in (("count", count, "options to find"),
                              ("max_world_size", max_world_size, "the most GPUs"),
                              ("lora_rank", lora_rank, "the adapters' rank")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{name} must be a positive int ({what}), got {value!r}")
    spec = device_spec(device)
    as_is = Configuration(
        batch=_batch_size(sample), accumulation_steps=accumulation_steps,
        world_size=world_size, dtype=dtype, autocast=autocast, keep_output=keep_output,
        adapters=adapters,
    )
    search = _Search(
        model=model, sample=sample, loss_fn=loss_fn, spec=spec, optimizer=optimizer,
        allowed=allowed, output_head=output_head, fine_tune=fine_tune or lora_adapters,
        max_world_size=max_world_size,
        new_adapters=Adapters(lora_rank, lora_targets, "as-is"), on_estimate=on_estimate,
    )
    return search.run(as_is, budget, count)


def lora_adapters(model: nn.Module, adapters: Adapters, dtype: torch.dtype | None = None
                  ) -> nn.Module:
    """``model`` as fine-tuning scripts load it: cast to ``dtype`` (None: as it is), its linear
    layers in 4 bits for ``adapters.base == "4-bit"`` (``gradckpt.integrations.quantized``:
    NF4, computing in ``dtype`` where it is 16-bit, else bf16), then LoRA adapters (PEFT,
    ``lora_alpha`` twice the rank, in PEFT's dtype: fp32), as ``gradckpt plan --lora R
    [--qlora]`` makes them. Changes ``model`` in place. The default ``fine_tune`` of ``fit``.

    Example:
        >>> import torch
        >>> base = torch.nn.Sequential(torch.nn.Linear(8, 8))
        >>> wrapped = lora_adapters(base, Adapters(2), torch.bfloat16)
        >>> {n.split(".")[-2]: p.dtype for n, p in wrapped.named_parameters()}
        {'base_layer': torch.bfloat16, 'default': torch.float32}
    """
    try:
        import peft
    except ImportError:
        raise LeverSkipped("LoRA needs PEFT: pip install 'gradckpt[hf]'") from None
    if dtype is not None:
        model = model.to(dtype)
    if adapters.base == "4-bit":
        sixteen_bit = dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        model = _four_bit_base(model, sixteen_bit)
    elif adapters.base != "as-is":
        raise LeverSkipped(f"a {adapters.base} base is not built by lora_adapters")
    targets: str | list[str] = (
        "all-linear" if adapters.targets in (None, "all-linear")
        else [name.strip() for name in adapters.targets.split(",") if name.strip()]
    )
    config = peft.LoraConfig(r=adapters.rank, lora_alpha=2 * adapters.rank,
                             target_modules=targets)
    return peft.get_peft_model(model, config)


def _four_bit_base(model: nn.Module, compute_dtype: torch.dtype) -> nn.Module:
    """``model``'s linear layers as bitsandbytes 4-bit ones (QLoRA's base)."""
    from .quantized import quantize_linear_layers

    try:
        return quantize_linear_layers(model, compute_dtype=compute_dtype)
    except ImportError as error:
        raise LeverSkipped(f"a 4-bit base needs bitsandbytes ({error})") from None


# --- the search ----------------------------------------------------------------------------------


@dataclass
class _Outcome:
    """One configuration estimated and solved: its plan (None when none fits) and the least
    peak any plan of it reaches."""

    configuration: Configuration
    profile: Profile
    plan: Plan | None
    least_peak_bytes: int


@dataclass
class _Search:
    model: nn.Module
    sample: Any
    loss_fn: Any
    spec: DeviceSpec
    optimizer: str | None
    allowed: set[str]
    output_head: str
    fine_tune: FineTune
    max_world_size: int
    new_adapters: Adapters
    on_estimate: Callable[[str], None] | None
    as_is: Configuration = field(default_factory=lambda: Configuration(batch=None))
    budget_bytes: int = 0
    skipped: dict[str, str] = field(default_factory=dict)
    outcomes: dict[Configuration, _Outcome] = field(default_factory=dict)
    ruled_out: list[set[str]] = field(default_factory=list)  # lever sets that do not fit

    def run(self, as_is: Configuration, budget: int | str, count: int) -> FitSearch:
        """Conductor: the step as it is → every lever at once (is anything possible?) →
        configurations in order of change until ``count`` fit → ranked."""
        self.as_is = as_is
        first = self._estimate(as_is, budget_from=budget)
        report = FitSearch([], first.profile, self._least_peak(first), self.budget_bytes)
        if first.plan is not None and not first.plan.segments and first.plan.head_chunks == 1:
            report.options = [self._option((), first, first)]  # fits as it is
            return self._finished(report)
        levers = self._applicable(as_is)
        if first.plan is None:  # else the step as it is, planned, is an option already
            self._check_something_fits(as_is, levers, first)
        options = self._search_in_order_of_change(as_is, levers, first, count)
        report.options = sorted(options, key=FitOption.sort_key)[:count]
        return self._finished(report)

    def _finished(self, report: FitSearch) -> FitSearch:
        report.skipped = dict(self.skipped)
        report.estimated = len(self.outcomes)
        return report

    # -- which levers apply --------------------------------------------------------------------

    def _applicable(self, as_is: Configuration) -> list[str]:
        """The levers that change ``as_is`` (the others go to ``skipped`` with the reason)."""
        applicable = []
        for name in _APPLICATION_ORDER:
            if name not in self.allowed:
                continue
            try:
                self._pull(name, as_is)
            except LeverSkipped as reason:
                self.skipped[name] = str(reason)
                continue
            applicable.append(name)
        return applicable

    def _pull(self, name: str, config: Configuration) -> list[Configuration]:
        """The configurations lever ``name`` leads to from ``config``: least change first,
        least memory last. Raises ``LeverSkipped`` where it changes nothing."""
        trained_in = config.dtype or _floating_dtype(self.model)
        if name == "drop-output":
            if not config.keep_output:
                raise LeverSkipped("the loop drops the output already")
            return [replace(config, keep_output=False)]
        if name in ("autocast", "bf16"):
            if config.autocast is not None or trained_in != torch.float32:
                computes_in = _dtype_name(config.autocast or trained_in)
                raise LeverSkipped(f"the step computes in {computes_in} already")
            try:
                self.spec.check_dtypes([torch.bfloat16])
            except UsageError as error:
                raise LeverSkipped(str(error)) from None
            if name == "autocast":
                return [replace(config, autocast=torch.bfloat16)]
            return [replace(config, dtype=torch.bfloat16)]
        if name == "micro-batch":
            return self._micro_batches(config)
        if name == "lora":
            if config.adapters is not None or _trains_a_part(self.model):
                raise LeverSkipped("the step trains adapters (or a part of the model) already")
            return [replace(config, adapters=self.new_adapters)]
        if name == "4bit":
            if config.adapters is not None and config.adapters.base != "as-is":
                raise LeverSkipped(f"the base is {config.adapters.base} already")
            if config.adapters is None and _trains_a_part(self.model):
                raise LeverSkipped("the model trains a part of itself already: pass the base "
                                   "and adapters= to try a 4-bit base")
            rank = config.adapters.rank if config.adapters else self.new_adapters.rank
            targets = config.adapters.targets if config.adapters else self.new_adapters.targets
            return [replace(config, adapters=Adapters(rank, targets, "4-bit"))]
        if name == "fsdp":
            return self._sharded(config)
        raise AssertionError(name)  # pragma: no cover - _APPLICATION_ORDER names them all

    def _micro_batches(self, config: Configuration) -> list[Configuration]:
        if config.batch is None:
            raise LeverSkipped("the sample has no batch dimension to split")
        sizes = [size for size in range(config.batch - 1, 0, -1) if config.batch % size == 0]
        if not sizes:
            raise LeverSkipped(f"the micro-batch is {config.batch} already")
        return [replace(config, batch=size,
                        accumulation_steps=config.accumulation_steps * config.batch // size)
                for size in sizes]

    def _sharded(self, config: Configuration) -> list[Configuration]:
        counts = [2**k for k in range(1, 11)
                  if config.world_size < 2**k <= self.max_world_size]
        if not counts:
            raise LeverSkipped(f"{config.world_size} GPUs already, and the most allowed is "
                               f"{self.max_world_size}")
        sharded = []
        for ranks in counts:  # the effective batch split over the ranks, at least 1 each
            batch = (None if config.batch is None
                     else max(1, config.batch * config.world_size // ranks))
            sharded.append(replace(config, world_size=ranks, batch=batch))
        return sharded

    # -- estimating one configuration ---------------------------------------------------------

    def _estimate(self, config: Configuration, budget_from: int | str | None = None) -> _Outcome:
        """``config`` estimated and solved for the budget (once: kept in ``outcomes``)."""
        if config in self.outcomes:
            return self.outcomes[config]
        if self.on_estimate is not None:
            self.on_estimate(self._words(config))
        model, dtype = self.model, config.dtype
        if config.adapters is not None:  # the base cast first, the adapters in PEFT's dtype
            model = self.fine_tune(_meta_copy(self.model), config.adapters, config.dtype)
            dtype = None
        sample = _sliced(self.sample, config.batch, config.dtype)
        profile = estimate(
            model, sample, self.loss_fn, device=self.spec, optimizer=self.optimizer,
            accumulation_steps=config.accumulation_steps, world_size=config.world_size,
            dtype=dtype, autocast=config.autocast, keep_output=config.keep_output,
        )
        if budget_from is not None:  # the step as it is: a percentage is of its peak
            self.budget_bytes = parse_budget(
                budget_from, unconstrained_peak_bytes=profile.peak_bytes,
                device_bytes=profile.notes.get("device_usable_bytes"),
            )
        outcome = self._solved(config, profile)
        self.outcomes[config] = outcome
        return outcome

    def _solved(self, config: Configuration, profile: Profile, budget_bytes: int | None = None
                ) -> _Outcome:
        """The fastest plan the allowed plan levers make within the budget, or the least peak
        they reach."""
        strategy = "optimal" if "recompute" in self.allowed else "none"
        head = self.output_head if "chunked-head" in self.allowed else "plain"
        try:
            plan = solve(profile, budget_bytes or self.budget_bytes, strategy, output_head=head)
        except BudgetError as error:
            return _Outcome(config, profile, None, error.minimum_bytes)
        return _Outcome(config, profile, plan, plan.predicted_peak_bytes)

    def _least_peak(self, outcome: _Outcome) -> int:
        """The least peak any plan of ``outcome``'s configuration reaches (the allowed
        plan levers'), not only the one that fits the budget."""
        if outcome.plan is None:
            return outcome.least_peak_bytes
        return self._solved(outcome.configuration, outcome.profile, budget_bytes=1
                            ).least_peak_bytes

    def _tried(self, config: Configuration, subset: tuple[str, ...], bounded: bool = True
               ) -> _Outcome | None:
        """``config`` estimated, or None where the budget rules it out before estimating
        (``bounded``), or where a lever that wraps the model fails (that lever then goes to
        ``skipped``)."""
        if bounded and config not in self.outcomes and _state_bytes(
                self.model, config, self.optimizer) > self.budget_bytes:
            return None  # parameters, gradients and optimizer state alone: no plan helps
        try:
            return self._estimate(config)
        except Exception as error:  # noqa: BLE001 - told as the lever's reason, not lost
            blamed = _blamed_lever(subset, config)
            if blamed is None:
                raise
            said = " ".join(str(error).split())
            self.skipped[blamed] = (said if isinstance(error, LeverSkipped)
                                    else f"its estimate failed: {type(error).__name__}: {said}")
            return None

    # -- the search --------------------------------------------------------------------------

    def _check_something_fits(self, as_is: Configuration, levers: list[str],
                              first: _Outcome) -> None:
        """Every lever at once (the most memory-saving of each kind): if even that does not
        fit, nothing will; say so with the least peak it reaches (estimated even where its
        state alone rules it out, to say how far off the budget is)."""
        subset, outcome = self._widest(as_is, levers, ceiling=max(_RANKS), bounded=False)
        assert outcome is not None  # unbounded: estimated, or its failure raised
        if outcome.plan is not None:
            return
        pulled = ", ".join([*(n for n in _PLAN_LEVERS if n in self.allowed), *subset]) or "none"
        least = min(outcome.least_peak_bytes, first.least_peak_bytes)
        raise BudgetError(
            f"nothing fits the budget of {format_bytes(self.budget_bytes)}: with every lever "
            f"({pulled}) the least predicted peak is {format_bytes(least)}; a budget (a GPU) "
            f"of at least {format_bytes(least)} would fit it, or a smaller batch or shorter "
            f"sequences{', or more GPUs' if 'fsdp' in levers else ''}",
            minimum_bytes=least, profile=outcome.profile,
        )

    def _widest(self, as_is: Configuration, levers: list[str], ceiling: int,
                bounded: bool = True) -> tuple[tuple[str, ...], _Outcome | None]:
        """The levers of rank up to ``ceiling`` pulled at once, each kind's most saving one
        (bf16 for autocast, a 4-bit base for LoRA) at its most saving value, estimated; a
        lever whose estimate fails is left out (``skipped``) and the rest tried again. Where
        it does not fit, no subset of it does: it goes to ``ruled_out``."""
        while True:
            subset = _saving_closure([n for n in levers if _BY_NAME[n].rank <= ceiling
                                      and n not in self.skipped], levers, self.skipped)
            config = self._apply(as_is, subset, {}, tolerant=True)
            outcome = self._tried(config, subset, bounded)
            if outcome is not None or not any(name in self.skipped for name in subset):
                break  # estimated, or ruled out by its state alone
        if outcome is None or outcome.plan is None:
            self.ruled_out.append(set(subset))
        return subset, outcome

    def _search_in_order_of_change(self, as_is: Configuration, levers: list[str],
                                   first: _Outcome, count: int) -> list[FitOption]:
        """Each set of levers, in order of change, estimated unless ruled out; after each
        change class, stop once ``count`` options are found."""
        options: list[FitOption] = []
        fitting: list[set[str]] = []
        for change, subsets in itertools.groupby(_subsets_by_change(levers), key=_change):
            # More change than an option found is never an answer.
            subsets = [subset for subset in subsets
                       if not any(done < set(subset) for done in fitting)]
            if change and subsets:  # a class of levers ruled out by one estimate, if it can be
                self._widest(as_is, levers, ceiling=change[0])
            for subset in subsets:
                if any(name in self.skipped for name in subset) or self._is_ruled_out(subset):
                    continue
                outcome = self._fastest_value(as_is, subset) if subset else first
                if outcome is None or outcome.plan is None:
                    self.ruled_out.append(set(subset))
                    continue
                options.append(self._option(subset, outcome, first))
                fitting.append(set(subset))
            if len(options) >= count:
                break
        return options

    def _is_ruled_out(self, subset: tuple[str, ...]) -> bool:
        """Whether a set of levers known not to fit holds each of ``subset``'s levers or the
        more saving one of its kind: it then holds no more memory than ``subset`` would."""
        stronger = dict(_SAVING_SUBSTITUTES)
        return any(all(name in known or stronger.get(name) in known for name in subset)
                   for known in self.ruled_out)

    def _fastest_value(self, as_is: Configuration, subset: tuple[str, ...]) -> _Outcome | None:
        """``subset`` pulled, each lever with values at the least change that still fits:
        first every lever at its most saving value; then, higher ranks first, each bisected
        towards its least change with the others where they are."""
        choice: dict[str, int] = {}
        best = self._at(as_is, subset, choice)
        if best is None or best.plan is None:
            return None
        for name in sorted(subset, key=lambda n: -_BY_NAME[n].rank):
            values = len(self._pull(name, self._apply(as_is, subset, choice, upto=name)))
            low, high = 0, values - 1  # high fits
            while low < high:
                middle = (low + high) // 2
                outcome = self._at(as_is, subset, {**choice, name: middle})
                if outcome is not None and outcome.plan is not None:
                    high, best = middle, outcome
                else:
                    low = middle + 1
            choice[name] = high
        return self._at(as_is, subset, choice) or best

    def _at(self, as_is: Configuration, subset: tuple[str, ...], choice: dict[str, int]
            ) -> _Outcome | None:
        """``subset`` pulled at ``choice``, estimated; None where it does not fit before
        estimating, or where one of its levers changes nothing after the others (a
        micro-batch of one rank's single sample)."""
        try:
            config = self._apply(as_is, subset, choice)
        except LeverSkipped:
            return None
        return self._tried(config, subset)

    def _apply(self, config: Configuration, subset: Iterable[str], choice: dict[str, int],
               upto: str | None = None, tolerant: bool = False) -> Configuration:
        """``config`` with ``subset``'s levers pulled in application order (each at
        ``choice[name]``, an index into its values; default its last, most saving), stopping
        before ``upto``. A lever that changes nothing after the others raises
        ``LeverSkipped``, or with ``tolerant`` is passed over."""
        for name in _APPLICATION_ORDER:
            if name == upto:
                break
            if name in subset:
                try:
                    config = self._pull(name, config)[choice.get(name, -1)]
                except LeverSkipped:
                    if not tolerant:
                        raise
        return config

    # -- the answer ----------------------------------------------------------------------------

    def _option(self, subset: tuple[str, ...], outcome: _Outcome, first: _Outcome) -> FitOption:
        plan, config = outcome.plan, outcome.configuration
        assert plan is not None
        pulled = set(subset)
        if plan.segments:
            pulled.add("recompute")
        if plan.head_chunks > 1:
            pulled.add("chunked-head")
        levers = tuple(lever.name for lever in LEVERS if lever.name in pulled)
        seconds = ((outcome.profile.step_seconds + plan.predicted_extra_seconds)
                   * config.accumulation_steps)
        as_is_seconds = first.profile.step_seconds * first.configuration.accumulation_steps
        return FitOption(
            levers=levers, change=_change(levers), configuration=config,
            description=self._words(config, plan),
            plan=plan, profile=outcome.profile,
            predicted_peak_bytes=plan.predicted_peak_bytes, predicted_step_seconds=seconds,
            relative_time=seconds / as_is_seconds if as_is_seconds else math.nan,
        )

    def _words(self, config: Configuration, plan: Plan | None = None) -> str:
        """What ``config`` changes of the step as it is (and its plan does), in a few words."""
        as_is, words = self.as_is, []
        if config.world_size != as_is.world_size:
            words.append(f"FSDP2 over {config.world_size} GPUs")
        if config.adapters != as_is.adapters:
            words.append(config.adapters.describe())
        if config.dtype != as_is.dtype:
            words.append(f"{_dtype_name(config.dtype)} throughout")
        if config.autocast != as_is.autocast:
            words.append(f"{_dtype_name(config.autocast)} autocast")
        if config.accumulation_steps != as_is.accumulation_steps:
            words.append(f"micro-batch {config.batch} x {config.accumulation_steps} "
                         "accumulated")
        if config.keep_output != as_is.keep_output:
            words.append("output dropped before backward")
        if config.effective_batch != as_is.effective_batch:
            words.append(f"effective batch {config.effective_batch} (was "
                         f"{as_is.effective_batch})")
        if plan is not None:
            words.append(_plan_words(plan))
        return "; ".join(words) or "as it is"


# --- small pieces ----------------------------------------------------------------------------


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


def _blamed_lever(subset: tuple[str, ...], config: Configuration) -> str | None:
    """The lever an estimate's failure is told against: the one that changed the model."""
    if config.adapters is None:
        return None
    if config.adapters.base != "as-is" and "4bit" in subset:
        return "4bit"
    return "lora" if "lora" in subset else None


def _state_bytes(model: nn.Module, config: Configuration, optimizer: Any) -> int:
    """Parameters, gradients and optimizer state per GPU of ``config``: a lower bound on its
    peak (all of them are alive when ``optimizer.step()`` runs), counted from the model's
    shapes without estimating. Adapters are not counted (0: no bound)."""
    if config.adapters is not None:
        return 0
    name = optimizer.lower() if isinstance(optimizer, str) else ""
    states = {k.lower(): v for k, v in OPTIMIZER_STATES_PER_PARAMETER.items()}.get(name, 0)
    state_bytes = OPTIMIZER_STATE_BYTES_PER_PARAMETER.get(name)
    total = 0
    for parameter in {id(p): p for p in model.parameters()}.values():
        dtype = (config.dtype if config.dtype is not None and parameter.is_floating_point()
                 else parameter.dtype)
        size = parameter.numel() * dtype.itemsize
        total += size
        if parameter.requires_grad:
            total += size + (state_bytes * parameter.numel() if state_bytes is not None
                             else states * size)
    return total // config.world_size


def _plan_words(plan: Plan) -> str:
    """A plan in a few words.

    Example:
        >>> from gradckpt.plan import Plan, Segment
        >>> print(_plan_words(Plan("optimal", 9, [Segment(0, 1)], 9, 1.0, 0.1, head_chunks=4)))
        2 blocks recomputed, loss in 4 chunks
    """
    blocks = len({index for segment in plan.segments for index in segment.blocks()})
    words = [f"{blocks} blocks recomputed"] if blocks else ["no block recomputed"]
    if plan.head_chunks > 1:
        words.append(f"loss in {plan.head_chunks} chunks")
    return ", ".join(words)


def _batch_size(sample: Any) -> int | None:
    """The leading size of the sample's first tensor of at least one dimension (its batch)."""
    for tensor in _tensors(sample):
        if tensor.dim() >= 1:
            return tensor.shape[0]
    return None


def _sliced(sample: Any, batch: int | None, dtype: torch.dtype | None = None) -> Any:
    """``sample`` as ``batch`` rows (every tensor whose leading size is the batch cut), its
    floating tensors in ``dtype`` where given: a step trained in bf16 is fed bf16 (``estimate``
    casts the model, not the sample).

    Example:
        >>> sliced = _sliced({"x": torch.ones(8, 3), "n": torch.ones(3)}, 2, torch.bfloat16)
        >>> {name: (tuple(t.shape), t.dtype) for name, t in sliced.items()}
        {'x': ((2, 3), torch.bfloat16), 'n': ((3,), torch.bfloat16)}
    """
    full = _batch_size(sample)

    def cut(value: Any) -> Any:
        if not isinstance(value, torch.Tensor):
            return value
        if batch is not None and full is not None and value.dim() >= 1 \
                and value.shape[0] == full:
            value = value[:batch]
        return value.to(dtype) if dtype is not None and value.is_floating_point() else value

    if isinstance(sample, dict):
        return {key: cut(value) for key, value in sample.items()}
    if isinstance(sample, tuple):
        return tuple(cut(value) for value in sample)
    return cut(sample)


def _tensors(sample: Any) -> Iterator[torch.Tensor]:
    values = sample.values() if isinstance(sample, dict) else (
        sample if isinstance(sample, tuple) else (sample,))
    return (value for value in values if isinstance(value, torch.Tensor))


def _meta_copy(model: nn.Module) -> nn.Module:
    """A copy of ``model`` whose parameters and buffers are on the meta device: the same
    modules, shapes, dtypes and ``requires_grad``, no memory, ties kept."""
    memo: dict[int, Any] = {}
    for parameter in model.parameters():
        memo[id(parameter)] = nn.Parameter(torch.empty_like(parameter, device="meta"),
                                           requires_grad=parameter.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    return copy.deepcopy(model, memo)


def _floating_dtype(model: nn.Module) -> torch.dtype | None:
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), None)


def _trains_a_part(model: nn.Module) -> bool:
    return any(not p.requires_grad for p in model.parameters())


def _dtype_name(dtype: torch.dtype | None) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(
        dtype, str(dtype).removeprefix("torch."))

