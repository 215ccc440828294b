"""The search behind ``gradckpt.integrations.fit.fit``: the configurations of a step that does
not fit, in order of change (``gradckpt.integrations.fit_options``), each estimated with
``gradckpt.estimate`` and solved for the budget, until enough fit.

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
device (``fit_step._meta_copy``), whose parameters take no memory.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch import nn

from ..budget import format_bytes, parse_budget
from ..errors import BudgetError, UsageError
from ..plan import Plan
from ..predict import estimate
from ..predict.devices import DeviceSpec
from ..profile_types import Profile
from ..solvers import solve
from .fit_options import (
    _APPLICATION_ORDER,
    _BY_NAME,
    _PLAN_LEVERS,
    _RANKS,
    _SAVING_SUBSTITUTES,
    LEVERS,
    Adapters,
    Configuration,
    FineTune,
    FitOption,
    FitSearch,
    LeverSkipped,
    _change,
    _saving_closure,
    _subsets_by_change,
)
from .fit_step import _floating_dtype, _meta_copy, _sliced, _state_bytes, _trains_a_part


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
        if config.ddp:  # FSDP2 instead over the same GPUs: each keeps its batch
            return [replace(config, world_size=ranks, ddp=False) for ranks in counts]
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
            ddp=config.ddp,
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
            words.append(f"FSDP2 over {config.world_size} GPUs"
                         + (" instead of DDP" if as_is.ddp and not config.ddp else ""))
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
        batch, was = self._effective_batch(config), self._effective_batch(as_is)
        if batch != was:
            words.append(f"effective batch {batch} (was {was})"
                         + (" per GPU" if as_is.ddp else ""))
        if plan is not None:
            words.append(_plan_words(plan))
        return "; ".join(words) or "as it is"

    def _effective_batch(self, config: Configuration) -> int | None:
        """``config``'s effective batch as the step as it is counts it: where that runs under
        DDP, per GPU (FSDP2 instead, over the same GPUs, keeps each one's batch)."""
        if self.as_is.ddp and config.batch is not None:
            return config.batch * config.accumulation_steps
        return config.effective_batch


# --- small pieces ----------------------------------------------------------------------------


def _blamed_lever(subset: tuple[str, ...], config: Configuration) -> str | None:
    """The lever an estimate's failure is told against: the one that changed the model."""
    if config.adapters is None:
        return None
    if config.adapters.base != "as-is" and "4bit" in subset:
        return "4bit"
    return "lora" if "lora" in subset else None


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


def _dtype_name(dtype: torch.dtype | None) -> str:
    return {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}.get(
        dtype, str(dtype).removeprefix("torch."))
