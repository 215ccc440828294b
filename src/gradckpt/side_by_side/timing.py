"""Step times side by side: ratios to a reference measured round after round in one run, their
median and spread."""

from __future__ import annotations

import contextlib
import gc
import math
import random
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field

import torch

from ..errors import UsageError


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
