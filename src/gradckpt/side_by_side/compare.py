"""``compare_plans``: the peak, the step-time ratio and the gradients of several plans on one
model, and ``plans_at_shares`` to make such plans from a profile."""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..apply import apply, disable, get_plan
from ..errors import BudgetError, UsageError
from ..measure import infer_device
from ..plan import Plan
from ..profile_types import Profile
from ..solvers import BUDGET_DRIVEN, solve
from .step import (
    Contender,
    GradientCheck,
    UsersStep,
    compare_gradients,
    installed,
    measure_users_step,
)
from .timing import RatioStats, SideBySideTimes, time_side_by_side


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

    def largest_difference(self, name: str) -> float:
        """``name``'s largest difference from the reference's loss and gradients, relative to
        each tensor's largest magnitude (``GradientCheck.largest_difference``)."""
        if self.gradients is None:
            raise ValueError("gradients were not compared (check_gradients=False)")
        return self.gradients.largest_difference[name]

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
