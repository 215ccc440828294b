"""Ways of running one training step measured side by side: the real peak of each, its step
time against the others in alternating rounds, and whether it computes the plain gradients.

The one protocol gradckpt has for comparing plans (DESIGN.md, "Measuring"); ``gradckpt demo``,
the scripts in ``bench/`` and the tests that compare plans all measure with it:

- what runs (a *contender*): a ``Plan`` (applied with ``gradckpt.apply`` while it runs), a
  function returning a context manager that changes the model meanwhile (checkpointing as
  users write it with ``torch.utils.checkpoint``, say), or ``None``: the model as it is.
- the step: the one users write, in the steady state of their loop (``UsersStep``): ``out =
  model(**sample)``, ``loss_of(out).backward()``, then ``optimizer.step()`` and
  ``optimizer.zero_grad()`` when there is an optimizer; the previous step's output alive until
  the next forward returns, as a loop's ``out`` variable keeps it.
- memory (``measure_users_step``): the peak of that step on the package's meter
  (``gradckpt.measure.MemoryMeter``), taken in the loop's second step, in a run of its own.
- time (``time_side_by_side``): ratios measured in one run, round after round, after warm-up
  rounds: A, B, C, then B, C, A, ... (or a shuffled order; or every contender between two
  turns of the reference). The median of the per-round ratios is the result, quartiles and
  min-max show the spread (``RatioStats``); these machines drift by 10-20% over seconds, which
  a ratio taken inside one round cancels.
- gradients (``compare_gradients``): each contender's loss and gradients against the first's,
  bit for bit (engine invariant 1).

``compare_plans`` runs all three on a mapping of contenders and returns a ``Comparison``.
Per-block timing inside ``profile`` is another job (``gradckpt.measure.timing``).

Example:
    >>> import torch
    >>> import gradckpt
    >>> from gradckpt.toy_models import mlp_chain
    >>> model = mlp_chain(4, 64)
    >>> sample = torch.randn(256, 64)
    >>> measured = gradckpt.profile(model, sample, repeats=1)
    >>> plans = {name: gradckpt.solve(measured, None, name) for name in ("none", "every-layer")}
    >>> result = compare_plans(model, sample, plans, rounds=2)
    >>> result.peak_bytes["every-layer"] < result.peak_bytes["none"]
    True
    >>> result.identical("every-layer"), result.time_ratio("every-layer").rounds
    (True, 2)
"""

from __future__ import annotations

import contextlib
import functools
import gc
import math
import random
import statistics
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from .apply import apply, disable, get_plan
from .errors import BudgetError, UsageError
from .measure import MemoryMeter, infer_device
from .measure.step import OutputHolder, training_step
from .measure.tensors import tensors_in
from .plan import Plan
from .profile_types import Profile
from .solvers import BUDGET_DRIVEN, solve

__all__ = [
    "Contender", "UsersStep", "installed", "measure_users_step", "StepMeasurement",
    "compare_gradients", "GradientCheck", "time_side_by_side", "SideBySideTimes", "Round",
    "Turn", "RatioStats", "summarize_ratios", "compare_plans", "Comparison", "plans_at_shares",
]

# What runs: a plan, a function returning a context manager that changes the model while it is
# open, or None (the model as it is).
Contender = Plan | Callable[[], AbstractContextManager] | None


# ---------------------------------------------------------------------------------------------
# What runs, and the step it runs
# ---------------------------------------------------------------------------------------------


@contextlib.contextmanager
def installed(model: nn.Module, contender: Contender) -> Iterator[None]:
    """``contender`` in effect on ``model`` while the block runs: a plan applied (and removed
    after with ``gradckpt.disable``), a context manager entered, or nothing for ``None``.

    Example:
        >>> import torch, gradckpt
        >>> from gradckpt.plan import Plan, Segment
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        >>> plan = Plan("sqrt", None, [Segment(0, 1)], 0, 0.0, 0.0, block_names=["0", "1"])
        >>> with installed(model, plan):
        ...     gradckpt.get_plan(model) is plan
        True
        >>> print(gradckpt.get_plan(model))
        None
    """
    if contender is None:
        yield
    elif isinstance(contender, Plan):
        apply(model, contender)
        try:
            yield
        finally:
            disable(model)
    else:
        with contender():
            yield


class UsersStep:
    """The training step users write, as their loop runs it again and again.

    Each call: ``torch.manual_seed(seed)`` (the same dropout masks for every contender; no
    seeding with ``seed=None``), gradients set to None, ``out = model(**sample)`` (the previous
    output let go only once this returns), ``loss_of(out, loss_fn).backward()`` with ``out``
    alive (``keep_output=False``: dropped before backward, as the Hugging Face Trainer does),
    then ``optimizer.step()`` and ``optimizer.zero_grad()`` if there is an optimizer. Returns
    the loss, detached.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(4, 2)
        >>> step = UsersStep(model, torch.ones(3, 4))
        >>> step().shape, model.weight.grad.shape
        (torch.Size([]), torch.Size([2, 4]))
    """

    def __init__(
        self,
        model: nn.Module,
        sample: Any,
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        keep_output: bool = True,
        seed: int | None = 0,
    ) -> None:
        self.model, self.sample, self.loss_fn = model, sample, loss_fn
        self.optimizer, self.keep_output, self.seed = optimizer, keep_output, seed
        self.out = OutputHolder()  # the loop's ``out`` variable

    def __call__(self) -> torch.Tensor:
        if self.seed is not None:
            torch.manual_seed(self.seed)
        self.model.zero_grad(set_to_none=True)  # no-op after an optimizer's zero_grad()
        loss = training_step(self.model, self.sample, self.loss_fn, self.keep_output, self.out)
        if self.optimizer is not None:
            self.optimizer.step()
            self.optimizer.zero_grad()
        return loss


@dataclass
class StepMeasurement:
    """What ``measure_users_step`` measured: the peak of the step in bytes, and the gradients
    it left (``p.grad`` for each parameter in order; all None when an optimizer zeroed them)."""

    peak_bytes: int
    gradients: list[torch.Tensor | None]


def measure_users_step(
    model: nn.Module,
    sample: Any,
    contender: Contender = None,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    keep_output: bool = True,
    seed: int | None = 0,
    device: torch.device | str | None = None,
) -> StepMeasurement:
    """The peak memory of the loop's second step (``UsersStep``) with ``contender`` in effect.

    The first step runs outside the meter: it leaves what a loop carries into its steady state
    (the optimizer's state, the previous output). The second runs inside ``MemoryMeter``,
    which sees the model, the optimizer, the sample and that previous output until the step's
    forward lets it go. Gradients are None when the measured step starts, as after
    ``optimizer.zero_grad()``.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(256, 256)
        >>> measured = measure_users_step(model, torch.randn(64, 256))
        >>> measured.peak_bytes >= 2 * 4 * 256 * 257  # weights and their gradients, at least
        True
        >>> measured.gradients[0].shape
        torch.Size([256, 256])
    """
    step = UsersStep(model, sample, loss_fn, optimizer, keep_output, seed)
    where = torch.device(device) if device is not None else infer_device(model)
    with installed(model, contender):
        step()  # the loop's first step
        model.zero_grad(set_to_none=True)  # as optimizer.zero_grad() leaves them
        tracked = [model, optimizer, *tensors_in(sample), *tensors_in(step.out.output)]
        with MemoryMeter(where, *tracked) as meter:
            tracked.clear()  # nothing here may keep the previous output alive once it goes
            step()
    return StepMeasurement(meter.peak(), [p.grad for p in model.parameters()])


# ---------------------------------------------------------------------------------------------
# Gradients
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GradientCheck:
    """Each contender's loss and gradients against the first's (``reference``), bit for bit.

    ``differing``: per contender, the names of the trainable parameters whose gradients differ
    from the reference's, with ``"loss"`` first where the loss differs; empty when identical.
    ``compared``: how many gradient tensors each contender had compared.
    """

    reference: str
    compared: int
    differing: dict[str, list[str]]

    def identical(self, name: str | None = None) -> bool:
        """Whether ``name`` (every contender, when None) computed exactly the reference's."""
        names = self.differing if name is None else [name]
        return not any(self.differing[each] for each in names)


def compare_gradients(
    model: nn.Module, steps: Mapping[str, Callable[[], torch.Tensor | None]]
) -> GradientCheck:
    """Run each step once (from the same weights: none may step an optimizer) and compare its
    loss (what it returns; None: not compared) and the gradients it leaves with the first's.

    Copies of the gradients are kept on the CPU, so a GPU holds none while the others run.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(4, 1)
        >>> x = torch.randn(8, 4)
        >>> def plain():
        ...     model.zero_grad(set_to_none=True)
        ...     loss = model(x).sum()
        ...     loss.backward()
        ...     return loss.detach()
        >>> def doubled():
        ...     model.zero_grad(set_to_none=True)
        ...     loss = 2 * model(x).sum()
        ...     loss.backward()
        ...     return loss.detach()
        >>> check = compare_gradients(model, {"plain": plain, "again": plain, "x2": doubled})
        >>> check.identical("again"), check.differing["x2"]
        (True, ['loss', 'weight', 'bias'])
    """
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    results = {}
    for label, step in steps.items():
        loss = step()
        loss = None if loss is None else loss.detach().to("cpu", copy=True)
        results[label] = (loss, [None if p.grad is None else p.grad.detach().to("cpu", copy=True)
                                 for _, p in named])
    model.zero_grad(set_to_none=True)
    reference = next(iter(steps))
    reference_loss, reference_grads = results[reference]
    differing = {}
    for label, (loss, grads) in results.items():
        names = ["loss"] if not _equal(loss, reference_loss) else []
        names += [name for (name, _), mine, theirs in zip(named, grads, reference_grads,
                                                          strict=True)
                  if not _equal(mine, theirs)]
        differing[label] = names
    return GradientCheck(reference, len(named), differing)


def _equal(first: torch.Tensor | None, second: torch.Tensor | None) -> bool:
    if first is None or second is None:
        return first is second
    return torch.equal(first, second)


# ---------------------------------------------------------------------------------------------
# Time
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RatioStats:
    """Per-round ratios, summarized.

    ``lower_quartile`` .. ``upper_quartile`` hold the middle half of the rounds: a better picture
    of the noise than ``low`` .. ``high``, which one stray round sets.
    """

    median: float
    lower_quartile: float
    upper_quartile: float
    low: float
    high: float
    rounds: int


def summarize_ratios(ratios: Sequence[float]) -> RatioStats:
    """Median, quartiles, min and max of per-round ratios.

    Example:
        >>> stats = summarize_ratios([1.0, 1.2, 1.1, 1.5])
        >>> stats.median, stats.low, stats.high, stats.rounds
        (1.15, 1.0, 1.5, 4)
        >>> round(stats.lower_quartile, 3), round(stats.upper_quartile, 3)
        (1.075, 1.275)
    """
    if not ratios:
        raise ValueError("no ratios to summarize")
    if len(ratios) > 1:
        lower_quartile, _, upper_quartile = statistics.quantiles(ratios, n=4, method="inclusive")
    else:
        lower_quartile = upper_quartile = ratios[0]
    return RatioStats(statistics.median(ratios), lower_quartile, upper_quartile, min(ratios),
                      max(ratios), len(ratios))


@dataclass(frozen=True)
class Turn:
    """A contender's turn in a round: untimed warm-up steps, then ``seconds``, one per timed
    step. ``load``: what the caller's ``watch`` read meanwhile (None: nothing read);
    ``disturbed``: that load was above the limit, so the turn does not count."""

    name: str
    seconds: list[float]
    load: float | None = None
    disturbed: bool = False

    @property
    def median_seconds(self) -> float:
        return statistics.median(self.seconds)


@dataclass(frozen=True)
class Round:
    """One round: every contender's turn, in the order they ran."""

    turns: list[Turn]
    reference: str

    def ratios(self) -> dict[str, float | None]:
        """Each contender's turn time / the reference's around it: the mean of the reference's
        nearest turns before and after it in the round (where there are two), None where one
        of those turns was disturbed. The reference's own ratio is 1.

        Example:
            >>> turns = [Turn("a", [1.0]), Turn("b", [1.5]), Turn("a", [1.2]), Turn("c", [2.4])]
            >>> Round(turns, "a").ratios()
            {'a': 1.0, 'b': 1.3636363636363635, 'c': 2.0}
        """
        found: dict[str, float | None] = {self.reference: 1.0}
        for index, turn in enumerate(self.turns):
            if turn.name == self.reference:
                continue
            around = [t for t in (self._reference_turn(range(index - 1, -1, -1)),
                                  self._reference_turn(range(index + 1, len(self.turns))))
                      if t is not None]
            if not around or turn.disturbed or any(t.disturbed for t in around):
                found[turn.name] = None
            else:
                reference = statistics.mean(t.median_seconds for t in around)
                found[turn.name] = turn.median_seconds / reference
        return found

    def seconds(self, name: str) -> float:
        """The median over ``name``'s turns in this round of their median step time."""
        return statistics.median(t.median_seconds for t in self.turns if t.name == name)

    @property
    def disturbed(self) -> bool:
        return any(turn.disturbed for turn in self.turns)

    def _reference_turn(self, indices: range) -> Turn | None:
        return next((self.turns[i] for i in indices if self.turns[i].name == self.reference),
                    None)


@dataclass
class SideBySideTimes:
    """Every round ``time_side_by_side`` ran; the ratios to the reference that count."""

    reference: str
    names: list[str]  # every contender, the reference first, in the order given
    wanted: int  # undisturbed ratios wanted per contender
    rounds: list[Round] = field(default_factory=list)

    def ratios_by_round(self, name: str, against: str | None = None,
                        include_disturbed: bool = False) -> dict[int, float]:
        """``name``'s time over ``against``'s (default: the reference) by round index, in the
        rounds where both counted (every round, timed as it was, with ``include_disturbed``)."""
        mine = self._to_reference(name, include_disturbed)
        if against is None or against == self.reference:
            return mine
        theirs = self._to_reference(against, include_disturbed)
        return {i: mine[i] / theirs[i] for i in mine if i in theirs}

    def ratios(self, name: str, against: str | None = None) -> list[float]:
        """``name``'s undisturbed ratios to ``against`` (default: the reference), round by
        round."""
        return list(self.ratios_by_round(name, against).values())

    def ratio_stats(self, name: str, against: str | None = None) -> RatioStats | None:
        """``summarize_ratios`` of ``ratios(name, against)``; None when no round counted."""
        ratios = self.ratios(name, against)
        return summarize_ratios(ratios) if ratios else None

    def seconds(self, name: str, include_disturbed: bool = False) -> list[float]:
        """The median step time of each undisturbed turn of ``name`` (of every turn, with
        ``include_disturbed``)."""
        return [turn.median_seconds for measured in self.rounds for turn in measured.turns
                if turn.name == name and (include_disturbed or not turn.disturbed)]

    def median_seconds(self, name: str, include_disturbed: bool = False) -> float | None:
        """The median of ``seconds(name, include_disturbed)``; None when there is none."""
        seconds = self.seconds(name, include_disturbed)
        return statistics.median(seconds) if seconds else None

    @property
    def reliable(self) -> bool:
        """Whether every contender reached the wanted number of undisturbed ratios (the
        reference alone: of undisturbed rounds)."""
        counts = [len(self.ratios_by_round(name)) for name in self.names[1:]]
        counts = counts or [sum(not measured.disturbed for measured in self.rounds)]
        return min(counts) >= self.wanted

    def _to_reference(self, name: str, include_disturbed: bool) -> dict[int, float]:
        found = {}
        for index, measured in enumerate(self.rounds):
            if include_disturbed:
                measured = Round([Turn(t.name, t.seconds, t.load) for t in measured.turns],
                                 measured.reference)
            ratio = measured.ratios().get(name)
            if ratio is not None:
                found[index] = ratio
        return found


def time_side_by_side(
    steps: Mapping[str, Callable[[], object]],
    rounds: int,
    *,
    warmup_rounds: int = 1,
    warmup_steps: int = 0,
    timed_steps: int = 1,
    bracketed: bool = False,
    shuffle_seed: int | None = None,
    device: torch.device | str = "cpu",
    setup: Mapping[str, Callable[[], AbstractContextManager]] | None = None,
    watch: Callable[[], Callable[[], float | None]] | None = None,
    max_load: float = math.inf,
    before_round: Callable[[], object] | None = None,
    retry_seconds: float = 0.0,
    on_round: Callable[[int, Round], None] | None = None,
) -> SideBySideTimes:
    """Time the steps side by side, round after round; the first is the reference.

    Args:
        steps: one step of each contender, by name, the reference first.
        rounds: how many ratios each contender should get.
        warmup_rounds: rounds first whose times are thrown away (a turn of each step).
        warmup_steps, timed_steps: a turn is ``warmup_steps`` untimed steps of one contender,
            then ``timed_steps`` timed ones (its time: their median), so that each timed step
            follows one of its own kind, as in a training loop.
        bracketed: every other contender's turn sits between two turns of the reference
            (reference, c1, reference, c2, reference), its ratio taken to their mean: for many
            contenders, on machines that drift. Else each round runs every contender once.
        shuffle_seed: the order of each round drawn afresh by ``random.Random(shuffle_seed)``;
            None: rotated by one place a round (A B C, B C A, C A B, ...).
        setup: per contender, a context manager entered around each of its turns, outside the
            timed steps (a plan installed, say).
        watch: called as a turn starts; returns a function called as it ends, whose number
            (``Turn.load``) above ``max_load`` marks the turn disturbed: it does not count.
            ``bench/`` watches the CPU other processes use.
        before_round: called before each round (``bench/`` waits there for a quiet machine).
        retry_seconds: rounds go on until every contender has ``rounds`` undisturbed ratios,
            for at most this long; then only until ``rounds`` rounds ran.
        on_round: ``on_round(index, round)`` after each timed round.

    Python's garbage collector runs before every turn, with what exists at the start frozen
    (``gc.freeze``), so that a collection never lands inside a timed step.

    Example:
        >>> import time
        >>> steps = {"short": lambda: time.sleep(0.001), "long": lambda: time.sleep(0.003)}
        >>> times = time_side_by_side(steps, rounds=3)
        >>> len(times.rounds), times.ratio_stats("long").median > 1.5
        (3, True)

        The order steps run in: a warm-up round, then rounds rotated by one place; or each
        contender between two turns of the reference:

        >>> ran = []
        >>> steps = {name: (lambda name=name: ran.append(name)) for name in "abc"}
        >>> _ = time_side_by_side(steps, rounds=2)
        >>> "".join(ran)
        'abcabcbca'
        >>> ran.clear()
        >>> _ = time_side_by_side(steps, rounds=1, warmup_rounds=0, bracketed=True)
        >>> "".join(ran)
        'abaca'
    """
    names = list(steps)
    if not names:
        raise UsageError("time_side_by_side needs at least one step")
    device = torch.device(device)
    setup = setup or {}
    times = SideBySideTimes(names[0], names, rounds)
    rng = random.Random(shuffle_seed)

    def turn(name: str, timed: int) -> Turn:
        gc.collect()  # cheap (the rest is frozen); nothing left pending for the steps
        with setup.get(name, contextlib.nullcontext)():
            stop = watch() if watch is not None else None
            for _ in range(warmup_steps):
                steps[name]()
            _synchronize(device)
            seconds = []
            for _ in range(timed):
                start = time.perf_counter()
                steps[name]()
                _synchronize(device)
                seconds.append(time.perf_counter() - start)
            load = stop() if stop is not None else None
        return Turn(name, seconds, load, load is not None and load > max_load)

    def order(index: int) -> list[str]:
        if bracketed:
            others = names[1:]
            if shuffle_seed is not None:
                others = rng.sample(others, len(others))
            return [names[0], *(name for other in others for name in (other, names[0]))]
        if shuffle_seed is not None:
            return rng.sample(names, len(names))
        shift = index % len(names)
        return names[shift:] + names[:shift]

    was_frozen = gc.get_freeze_count() > 0
    gc.collect()
    gc.freeze()  # what exists now is never scanned again: collections between turns stay cheap
    try:
        for _ in range(warmup_rounds):
            for name in names:
                turn(name, 1)  # timed, and thrown away
        deadline = time.monotonic() + retry_seconds
        while not times.reliable:
            if time.monotonic() >= deadline and len(times.rounds) >= rounds:
                break
            if before_round is not None:
                before_round()
            index = len(times.rounds)
            times.rounds.append(Round([turn(name, timed_steps) for name in order(index)],
                                      names[0]))
            if on_round is not None:
                on_round(index, times.rounds[-1])
    finally:
        if not was_frozen:
            gc.unfreeze()
    return times


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ---------------------------------------------------------------------------------------------
# All three, on plans
# ---------------------------------------------------------------------------------------------


@dataclass
class Comparison:
    """What ``compare_plans`` measured, by contender name (the first is the reference)."""

    names: list[str]
    peak_bytes: dict[str, int]  # empty when memory was not measured
    gradients: GradientCheck | None  # None when not checked
    times: SideBySideTimes | None  # None when not timed (rounds=0)

    def identical(self, name: str) -> bool:
        """Whether ``name``'s loss and gradients equal the reference's, bit for bit."""
        if self.gradients is None:
            raise ValueError("gradients were not compared (check_gradients=False)")
        return self.gradients.identical(name)

    def time_ratio(self, name: str) -> RatioStats | None:
        """``name``'s step time over the reference's, per round, summarized."""
        return None if self.times is None else self.times.ratio_stats(name)

    def median_seconds(self, name: str) -> float | None:
        """The median step time of ``name`` while timed."""
        return None if self.times is None else self.times.median_seconds(name)


def compare_plans(
    model: nn.Module,
    sample: Any,
    plans: Mapping[str, Contender],
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    keep_output: bool = True,
    rounds: int = 5,
    warmup_rounds: int = 1,
    seed: int = 0,
    measure_memory: bool = True,
    check_gradients: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> Comparison:
    """Measure each contender of ``plans`` on ``model``: its real peak, its step time against
    the first's over alternating rounds, and whether its gradients equal the first's.

    Args:
        model, sample, loss_fn, optimizer, keep_output: the user's step (``UsersStep``).
        plans: contenders by name (``Contender``: a ``Plan``, a context-manager function, or
            None for the model as it is); the first is the reference for time and gradients.
        rounds, warmup_rounds: of ``time_side_by_side`` (rounds=0: no timing).
        seed: ``torch.manual_seed`` before every step: the same dropout masks for everyone.
        measure_memory: ``measure_users_step`` for each contender.
        check_gradients: ``compare_gradients`` of one step each, from the same weights.
        progress: ``progress(done, total)`` as contenders are measured and rounds timed.

    Returns:
        A ``Comparison``: ``peak_bytes[name]``, ``identical(name)``, ``time_ratio(name)`` (a
        ``RatioStats``) and ``median_seconds(name)``.

    A plan ``model`` carried is taken off for the comparison and put back after. An optimizer
    is stepped while memory and time are measured; its state and the model's parameters are
    put back (from copies kept on the CPU) when done. See the module's example.
    """
    names = list(plans)
    if not names:
        raise UsageError("compare_plans needs at least one plan")
    total = (len(names) if measure_memory else 0) + (len(names) if check_gradients else 0)
    total += rounds
    done = 0

    def advance(*_: object) -> None:
        nonlocal done
        done = min(done + 1, total)
        if progress is not None:
            progress(done, total)

    previous = get_plan(model)
    disable(model)
    saved = _training_state(model, optimizer) if optimizer is not None else None
    options = dict(loss_fn=loss_fn, keep_output=keep_output, seed=seed)
    peaks, gradients, times = {}, None, None
    try:
        if measure_memory:
            for name in names:
                peaks[name] = measure_users_step(model, sample, plans[name], optimizer=optimizer,
                                                 **options).peak_bytes
                advance()
        if check_gradients:
            plain = UsersStep(model, sample, **options)  # no optimizer: the weights stay

            def checked(contender: Contender) -> torch.Tensor:
                with installed(model, contender):
                    loss = plain()
                advance()
                return loss

            gradients = compare_gradients(
                model, {name: functools.partial(checked, plans[name]) for name in names})
        if rounds:
            step = UsersStep(model, sample, optimizer=optimizer, **options)
            times = time_side_by_side(
                {name: step for name in names}, rounds, warmup_rounds=warmup_rounds,
                device=infer_device(model), on_round=advance,
                setup={name: functools.partial(installed, model, plans[name])
                       for name in names},
            )
    finally:
        model.zero_grad(set_to_none=True)
        if saved is not None:
            _restore_training_state(model, optimizer, saved)
        if previous is not None:
            apply(model, previous)
    return Comparison(names, peaks, gradients, times)


def _training_state(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict, dict]:
    """Copies, on the CPU, of the model's parameters and buffers and the optimizer's state."""

    def to_cpu(value: Any) -> Any:
        return value.detach().to("cpu", copy=True) if isinstance(value, torch.Tensor) else value

    state = optimizer.state_dict()
    copied = {**state, "state": {key: {name: to_cpu(value) for name, value in entry.items()}
                                 for key, entry in state["state"].items()}}
    return {name: to_cpu(value) for name, value in model.state_dict().items()}, copied


def _restore_training_state(model: nn.Module, optimizer: torch.optim.Optimizer,
                            saved: tuple[dict, dict]) -> None:
    model_state, optimizer_state = saved
    model.load_state_dict(model_state)
    optimizer.load_state_dict(optimizer_state)


def plans_at_shares(
    profile: Profile, shares: Sequence[float], *, of_bytes: int | None = None,
    strategy: str = "optimal",
) -> dict[str, Plan]:
    """Plans for budgets at ``shares`` of a peak (``of_bytes``, default ``profile.peak_bytes``),
    labelled ``"70%"``; a share below the least feasible budget gets the plan at that least,
    labelled ``"45% (least)"``.

    Example:
        >>> import torch, gradckpt
        >>> from gradckpt.toy_models import mlp_chain
        >>> measured = gradckpt.profile(mlp_chain(4, 64), torch.randn(256, 64), repeats=1)
        >>> list(plans_at_shares(measured, (0.9, 0.01)))
        ['90%', '1% (least)']
    """
    if strategy not in BUDGET_DRIVEN:
        raise UsageError(f"plans_at_shares needs a budget-driven strategy, not {strategy!r}")
    peak = profile.peak_bytes if of_bytes is None else of_bytes
    plans = {}
    for share in shares:
        label = f"{share:.0%}"
        try:
            plans[label] = solve(profile, int(share * peak), strategy)
        except BudgetError as error:
            plans[f"{label} (least)"] = solve(profile, error.minimum_bytes, strategy)
    return plans
