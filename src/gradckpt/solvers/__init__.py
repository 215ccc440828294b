"""Solvers: pure functions from a ``Profile`` and a budget to the segments of a plan.

Each strategy is one module with one function ``(profile, budget_bytes) -> list[Segment]``; no
model, no device, no global state (``optimal`` uses torch tensors only as arrays), so each can
be tested exhaustively against brute force. ``solve`` picks one by name, parses the budget,
wraps the segments in a ``Plan`` (predictions from ``gradckpt.cost.simulate``) and raises
``BudgetError`` when the plan does not fit.

- ``"none"``, ``"every-layer"``, ``"sqrt"``: fixed plans, the same whatever the budget; the budget
  may be ``None``. Given a budget their plan exceeds, ``BudgetError.minimum_bytes`` is that
  plan's own predicted peak (the smallest budget *this strategy* meets; another strategy may
  meet a smaller one).
- ``"chen-greedy"``, ``"optimal"``: chosen for the budget, which is required. When nothing they
  can produce fits, ``minimum_bytes`` is the lowest peak any of their plans reaches.

The output head is part of every strategy's plan: where the profile measured the step with its
head's loss in chunks (``Profile.chunked_heads``, a few chunk counts), each strategy solves for
each of those steps and the plain one, and ``solve`` keeps the plan that fits at the least
predicted extra time, the plain head on a tie, then the fewest chunks (``output_head="plain"``
or ``"chunked"`` narrows the choice). A step that peaks above the budget whatever the plan is
not solved (it could not be kept), and ``optimal`` solves the others together
(``optimal.solve_optimal_heads``): the same plan as solving each alone, for less work.

Times measured on this machine's clock are compared with a band,
``timing_noise.TIME_NOISE_BAND`` (10%): times and plans less than that apart are the same, and
ties go to each solver's fixed order, so the same model and sample give the same plan whatever
the noise in their timing (``timing_noise``); an estimate's times, and a hand-made profile's,
are compared exactly.

Example:
    >>> from gradckpt.profile_types import Profile, example_block
    >>> blocks = [example_block(f"h.{i}") for i in range(4)]
    >>> profile = Profile(blocks, peak_bytes=1210, fixed_bytes=1000, step_seconds=12.0)
    >>> plan = solve(profile, 1120)
    >>> plan.predicted_peak_bytes <= 1120, plan.predicted_extra_seconds
    (True, 2.0)
"""

from __future__ import annotations

from collections.abc import Callable

from ..budget import format_bytes, parse_budget
from ..cost import as_chunked, plan_for
from ..errors import BudgetError, UsageError, did_you_mean
from ..plan import Plan, Segment
from ..profile_types import MODELED_TIMES, Profile
from . import chen_greedy, optimal
from .every_layer import solve_every_layer
from .infeasible import RETRY_WITHOUT_MEASURING, budget_message, explain_infeasible
from .none import solve_none
from .sqrt import solve_sqrt
from .timing_noise import TIME_NOISE_BAND, settle_times

__all__ = ["STRATEGIES", "BUDGET_DRIVEN", "OUTPUT_HEADS", "check_output_head", "check_strategy",
           "solve"]

Solver = Callable[[Profile, "int | None"], "list[Segment]"]

STRATEGIES: dict[str, Solver] = {
    "none": solve_none,
    "every-layer": solve_every_layer,
    "sqrt": solve_sqrt,
    "chen-greedy": chen_greedy.solve_chen_greedy,
    "optimal": optimal.solve_optimal,
}

# Strategies whose plan depends on the budget, with the lowest peak any plan of theirs reaches.
BUDGET_DRIVEN: dict[str, Callable[[Profile], int]] = {
    "chen-greedy": chen_greedy.minimum_peak_bytes,
    "optimal": optimal.minimum_peak_bytes,
}


# What a plan may do with the output head: "auto" (whichever fits faster), "plain" (the logits
# whole: out.logits as the model returns them), "chunked" (the loss in chunks of tokens).
OUTPUT_HEADS = ("auto", "plain", "chunked")


def solve(
    profile: Profile, budget: int | str | None = None, strategy: str = "optimal", *,
    output_head: str = "auto", time_noise: float | None = None,
) -> Plan:
    """The plan ``strategy`` makes for ``profile`` under ``budget``.

    Args:
        profile: what ``gradckpt.profile`` or ``gradckpt.estimate`` returned.
        budget: the step's peak memory limit: int bytes or anything ``parse_budget`` reads
            (``"6GiB"``, ``"60%"`` of ``profile.peak_bytes``, ...); ``None`` (the default: no
            limit) only for the fixed strategies ``"none"``, ``"every-layer"`` and ``"sqrt"``.
            ``"auto"`` is what the profile's device has for the step: for an estimate, its
            target's ``notes["device_usable_bytes"]``; for a measured profile, what
            ``profile.device`` has free on this machine now (``gradckpt.budget.available_bytes``).
        strategy: one of ``STRATEGIES``.
        output_head: ``"auto"`` (default): the head and loss in chunks of tokens (each chunk's
            logits recomputed in backward) when that fits where the plain head does not, or
            fits faster (less recomputation of the blocks); ``"plain"``: never (the output's
            ``logits`` stay whole, for a loop that reads them); ``"chunked"``: always. The
            choice exists where ``profile.chunked_heads`` were measured.
        time_noise: the relative difference below which two measured times, and two plans'
            predicted extra times, count as the same: the same model and sample give the same
            plan whatever the noise in their timing, ties going to the solver's fixed order
            (docs/planning.md, "Plans are stable under timing noise"). ``None`` (default):
            ``timing_noise.TIME_NOISE_BAND`` (10%) for a profile measured on this machine's
            clock, 0 for an estimate (a modeled clock times the same operations alike) or a
            profile made by hand. ``0``: the least predicted extra time, exactly.

    Raises ``UsageError`` for an unknown strategy or a malformed budget, and ``BudgetError``
    when the strategy's plan does not fit the budget: its message and ``minimum_bytes`` give the
    smallest budget that fits, the message says what that plan's peak is made of and what would
    lower it, and ``profile`` is this profile, to solve again without measuring again.

    Example:
        >>> from gradckpt.profile_types import Profile, example_block
        >>> blocks = [example_block(f"h.{i}") for i in range(4)]
        >>> profile = Profile(blocks, peak_bytes=1210, fixed_bytes=1000, step_seconds=12.0)
        >>> solve(profile, strategy="every-layer").predicted_overhead  # 4 s extra of 12 s
        0.3333333333333333
        >>> solve(profile, "100%").segments  # fits without checkpointing: nothing to do
        []
        >>> solve(profile, 1050)
        Traceback (most recent call last):
        ...
        gradckpt.errors.BudgetError: budget 1.03 KiB is below the smallest peak any plan ...
    """
    check_strategy(strategy)
    if time_noise is None:  # noise only where the times were measured on the wall's clock
        time_noise = TIME_NOISE_BAND if profile.notes.get(MODELED_TIMES) is False else 0.0
    if budget is None:
        if strategy in BUDGET_DRIVEN:
            raise UsageError(
                f"strategy {strategy!r} chooses its plan for a budget, and budget=None gives "
                f"none; pass a budget ('6GiB', '60%') or use one of the fixed strategies "
                f"'none', 'every-layer', 'sqrt'"
            )
        budget_bytes = None
    else:
        budget_bytes = parse_budget(
            budget, unconstrained_peak_bytes=profile.peak_bytes, device=profile.device,
            # An estimate's "auto" is its target's memory, not this machine's.
            device_bytes=profile.notes.get("device_usable_bytes"),
        )

    # Chosen on the times merged within the timing noise (timing_noise.py: the same model and
    # sample give the same plan), predicted on the profile's own.
    settled = settle_times(profile, time_noise)
    choices = _head_choices(profile, output_head)
    # A head whose step peaks above the budget whatever the plan cannot be chosen: not solved
    # (the plain head's logits at 8k tokens alone take more than a GPU has left).
    possible = [chunks for chunks in choices if budget_bytes is None
                or _least_possible_peak_bytes(as_chunked(settled, chunks)) <= budget_bytes]
    candidates = _head_candidates(settled, strategy, budget_bytes, possible)
    fitting = [plan for plan in candidates
               if budget_bytes is None or plan.predicted_peak_bytes <= budget_bytes]
    if not fitting:  # the others solved too, for the error's smallest budget that fits
        rest = [chunks for chunks in choices if chunks not in possible]
        solved = dict(zip(possible + rest, candidates
                          + _head_candidates(settled, strategy, budget_bytes, rest), strict=True))
        raise _infeasible(profile, strategy, budget_bytes, [solved[c] for c in choices],
                          output_head)
    # The plain head first: on a tie it wins (the logits as the model returns them), and a
    # plan later in that order must be faster by more than the timing noise to win.
    least = min(plan.predicted_extra_seconds for plan in fitting)
    chosen = next(plan for plan in fitting
                  if plan.predicted_extra_seconds <= least * (1 + time_noise))
    return plan_for(profile, strategy, budget_bytes, chosen.segments, chosen.head_chunks)


def check_strategy(strategy: str) -> None:
    """Raise ``UsageError`` naming the valid strategies (and the one a misspelt name is close
    to) unless ``strategy`` is one of ``STRATEGIES``.

    Example:
        >>> check_strategy("sqrt")
        >>> check_strategy("optimial")
        Traceback (most recent call last):
        ...
        gradckpt.errors.UsageError: unknown strategy 'optimial'; ...; did you mean 'optimal'?
    """
    if not isinstance(strategy, str) or strategy not in STRATEGIES:
        suggestion = did_you_mean(strategy, STRATEGIES) if isinstance(strategy, str) else ""
        raise UsageError(f"unknown strategy {strategy!r}; valid strategies: "
                         f"{', '.join(STRATEGIES)}{suggestion}")


def check_output_head(output_head: str) -> None:
    """Raise ``UsageError`` naming the valid values unless ``output_head`` is one of
    ``OUTPUT_HEADS``.

    Example:
        >>> check_output_head("auto")
        >>> check_output_head("whole")
        Traceback (most recent call last):
        ...
        gradckpt.errors.UsageError: unknown output_head 'whole'; valid: 'auto', 'plain', 'chunked'
        >>> check_output_head("chunk")
        Traceback (most recent call last):
        ...
        gradckpt.errors.UsageError: unknown output_head 'chunk'; valid: ...; did you mean 'chunked'?
    """
    if output_head not in OUTPUT_HEADS:
        suggestion = (did_you_mean(output_head, OUTPUT_HEADS) if isinstance(output_head, str)
                      else "")
        raise UsageError(f"unknown output_head {output_head!r}; valid: "
                         f"{', '.join(map(repr, OUTPUT_HEADS))}{suggestion}")


def _least_possible_peak_bytes(step: Profile) -> int:
    """A lower bound on the predicted peak of any plan for ``step``: its fixed bytes and the
    phases no plan lowers (the head on top of whatever the chain retains, what runs outside
    the chain, the optimizer's step; ``gradckpt.cost.simulate``).

    Example:
        >>> from gradckpt.profile_types import Profile, example_block
        >>> _least_possible_peak_bytes(Profile([example_block()], 1500, 1000, 4.0,
        ...                                    head_bytes=300))
        1300
    """
    return step.fixed_bytes + max(step.head_bytes, step.other_peak_bytes,
                                  step.optimizer_step_bytes)


def _head_candidates(
    settled: Profile, strategy: str, budget_bytes: int | None, choices: list[int],
) -> list[Plan]:
    """The plan ``strategy`` makes for the step with each of the head's chunk counts
    ``choices``: ``optimal`` solves them together (``solve_optimal_heads``: the same plans,
    from tables shared where the steps differ only in their head), the others one by one."""
    steps = [as_chunked(settled, chunks) for chunks in choices]
    if strategy == "optimal":
        each = optimal.solve_optimal_heads(steps, budget_bytes)
    else:
        each = [STRATEGIES[strategy](step, budget_bytes) for step in steps]
    return [plan_for(settled, strategy, budget_bytes, segments, chunks)
            for chunks, segments in zip(choices, each, strict=True)]


def _head_choices(profile: Profile, output_head: str) -> list[int]:
    """The head's chunk counts the strategy solves for (1: the plain head), in the order ties
    go: the plain head, then the fewest chunks."""
    check_output_head(output_head)
    chunked = sorted(head.chunks for head in profile.chunked_heads)
    if output_head == "chunked":
        if not chunked:
            raise UsageError(
                "output_head='chunked', but the profile has no chunked head: "
                f"{profile.notes.get('chunked_head', 'not measured')}"
            )
        return chunked
    if output_head == "plain":
        return [1]
    return [1, *chunked]


def _infeasible(
    profile: Profile, strategy: str, budget_bytes: int, candidates: list[Plan], output_head: str,
) -> BudgetError:
    """The error for a budget below what ``strategy`` reaches: the smallest budget it meets,
    what that plan's peak is made of, what lowers it, and the profile to retry with."""
    least_of_each = []
    for plan in candidates:
        step = as_chunked(profile, plan.head_chunks)
        if strategy in BUDGET_DRIVEN:
            minimum = BUDGET_DRIVEN[strategy](step)
            segments = STRATEGIES[strategy](step, minimum)
        else:
            minimum, segments = plan.predicted_peak_bytes, plan.segments
        least_of_each.append((minimum, step, segments))
    minimum_bytes, step, least = min(least_of_each, key=lambda item: item[0])
    if strategy in BUDGET_DRIVEN:
        what = "any plan reaches" if strategy == "optimal" else f"any {strategy} plan reaches"
    else:
        what = f"the {strategy} plan reaches (strategy='optimal' may reach less)"
    headline = (f"budget {format_bytes(budget_bytes)} is below the smallest peak {what}, "
                f"{format_bytes(minimum_bytes)}; raise the budget to at least that.")
    explanation = explain_infeasible(step, least, head_chunked=step is not profile,
                                     output_head=output_head)
    return BudgetError(budget_message(headline, explanation, RETRY_WITHOUT_MEASURING),
                       minimum_bytes=minimum_bytes, profile=profile, explanation=explanation)
