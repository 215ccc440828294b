"""The budget, checked where it is cheap: the first training steps of a planned CUDA model.

A plan promises that the step fits ``plan.budget_bytes``; the promise rests on the step being
the one the plan was made for. The usual ways it is not: the optimizer's state was not given
to ``enable`` (``optimizer=``), batches are larger or sequences longer than the sample, or
another model or other tensors share the device. ``watch_budget`` catches those on CUDA, where
the caching allocator keeps a running peak for free:

- a forward pre-hook on the model, which acts only on training forwards (grad enabled, the
  model in training mode), reads ``torch.cuda.max_memory_allocated`` (the peak since the last
  reset: the previous step's forward, backward, ``optimizer.step()`` and whatever ran between)
  and resets it (``torch.cuda.reset_peak_memory_stats``);
- the first reading is not judged (it covers whatever ran before training: loading, the
  profile); each later one is a step's peak, compared with the budget;
- a forward without grad or in eval mode between two training forwards (an evaluation) voids
  the next reading: its peak is not a training step's;
- a step more than ``tolerance`` (1%) above the budget warns once (``GradckptWarning``) with
  the measured peak, the budget, the plan's prediction and the likely causes; below that the
  difference is the allocator's rounding, not a step that does not fit;
- after ``steps`` judged steps the hook removes itself; what it saw stays in the watch
  (``measured_peaks``) for an integration to report (``watch_of(model)``).

The cost is two allocator queries and a reset per training forward, for the first few steps,
and no device synchronization. While it watches, a ``max_memory_allocated`` you read yourself
covers only the time since the last training forward. On CPU (no allocator statistics to read
for free: MemTracker slows every operation) and without a budget it does nothing. Under
``torch.compile`` the hook is traced as nothing: compiled models are not watched.
"""

from __future__ import annotations

import os
import sys
import warnings
import weakref

import torch
from torch import nn

from .budget import format_bytes
from .errors import GradckptWarning, UsageError
from .measure import infer_device
from .plan import Plan

__all__ = ["BudgetWatch", "watch_budget", "watch_of"]

# The watch installed on each model by watch_budget (active or done), for reporting.
_watches: weakref.WeakKeyDictionary[nn.Module, BudgetWatch] = weakref.WeakKeyDictionary()


class BudgetWatch:
    """What ``watch_budget`` installed on a model, and what it saw. Calling it (or
    ``remove()``) takes the hook off; a no-op once it is off.

    - ``active``: whether the hook is still on the model.
    - ``reason``: why a watch that never started does not watch (``""`` when it does).
    - ``measured_peaks``: the peak of each judged step, in bytes, in order.
    - ``start_bytes``: allocated at the start of each judged step's reading (parameters,
      optimizer state, anything else living on the device between steps).
    - ``exceeded_step``: the first judged step (1 = the first training step) above the budget
      by more than the tolerance, or None.
    """

    def __init__(
        self,
        plan: Plan,
        device: torch.device,
        *,
        steps: int,
        tolerance: float,
        model_name: str,
        reason: str = "",
    ) -> None:
        self.device = device
        self.budget_bytes = plan.budget_bytes
        self.predicted_peak_bytes = plan.predicted_peak_bytes
        self.steps = steps
        self.tolerance = tolerance
        self.reason = reason
        self.measured_peaks: list[int] = []
        self.start_bytes: list[int] = []
        self.exceeded_step: int | None = None
        self._model_name = model_name
        self._handle: torch.utils.hooks.RemovableHandle | None = None
        # The peak was reset at a training forward, and only training forwards ran since.
        self._reading_valid = False

    @property
    def active(self) -> bool:
        return self._handle is not None

    @property
    def peak_bytes(self) -> int | None:
        """The highest of ``measured_peaks``; None before a step was judged."""
        return max(self.measured_peaks) if self.measured_peaks else None

    def remove(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    __call__ = remove

    def summary(self) -> str:
        """One line on what the watch saw, for a report.

        Example:
            >>> from gradckpt.plan import Plan
            >>> watch = watch_budget(torch.nn.Linear(2, 2), Plan("none", 2**20, [], 0, 0.0, 0.0))
            >>> watch.summary()
            'budget not watched: the model is on cpu (the watch reads CUDA allocator statistics)'
        """
        if self.reason:
            return f"budget not watched: {self.reason}"
        if not self.measured_peaks:
            return f"budget {format_bytes(self.budget_bytes or 0)}: no training step judged yet"
        verdict = ("within it" if self.exceeded_step is None
                   else f"above it from step {self.exceeded_step}")
        return (
            f"measured peak {format_bytes(self.peak_bytes or 0)} over the first "
            f"{len(self.measured_peaks)} training step(s) on {self.device}, {verdict} "
            f"(budget {format_bytes(self.budget_bytes or 0)}, predicted "
            f"{format_bytes(self.predicted_peak_bytes)})"
        )

    def __repr__(self) -> str:
        return f"<BudgetWatch {'active' if self.active else 'off'}: {self.summary()}>"

    def _install(self, model: nn.Module) -> None:
        self._handle = model.register_forward_pre_hook(self._before_forward)

    def _before_forward(self, module: nn.Module, args: tuple) -> None:
        if torch.compiler.is_compiling():
            return  # traced as nothing: a compiled model is not watched
        if not (torch.is_grad_enabled() and module.training):
            self._reading_valid = False  # an evaluation's peak is no training step's
            return
        if self._reading_valid:
            self._judge(torch.cuda.max_memory_allocated(self.device))
            if len(self.measured_peaks) >= self.steps:
                self.remove()
                return
        self.start_bytes.append(torch.cuda.memory_allocated(self.device))
        torch.cuda.reset_peak_memory_stats(self.device)
        self._reading_valid = True

    def _judge(self, peak_bytes: int) -> None:
        self.measured_peaks.append(peak_bytes)
        step = len(self.measured_peaks)
        budget = self.budget_bytes or 0
        if self.exceeded_step is not None or peak_bytes <= budget * (1 + self.tolerance):
            return
        self.exceeded_step = step
        warnings.warn(self._message(peak_bytes, step), GradckptWarning,
                      stacklevel=_stacklevel_outside_libraries())

    def _message(self, peak_bytes: int, step: int) -> str:
        budget = self.budget_bytes or 0
        over = (peak_bytes - budget) / budget if budget else float("inf")
        started = self.start_bytes[step - 1]
        return (
            f"training step {step} of {self._model_name} peaked at {format_bytes(peak_bytes)} "
            f"on {self.device} (torch.cuda.max_memory_allocated), {over:.1%} above its budget "
            f"of {format_bytes(budget)}; the plan predicted "
            f"{format_bytes(self.predicted_peak_bytes)}, and {format_bytes(started)} was "
            f"allocated when the step began. Likely causes: the optimizer's state, which the "
            f"plan counts only when given to enable (gradckpt.enable(..., optimizer=optimizer)); "
            f"a larger batch or a longer sequence than the sample the plan was made for (plan "
            f"with the largest); another model or other tensors on the device. Measure a step "
            f"with gradckpt.peak_memory(); only the first {self.steps} steps are checked."
        )


def watch_budget(
    model: nn.Module,
    plan: Plan,
    steps: int = 3,
    *,
    tolerance: float = 0.01,
    device: torch.device | str | None = None,
) -> BudgetWatch:
    """Check the first ``steps`` training steps of ``model`` against ``plan.budget_bytes``.

    On a CUDA model with a budget, a forward pre-hook reads the allocator's peak at each
    training forward and warns once (``gradckpt.GradckptWarning``) when a step peaked more than
    ``tolerance`` above the budget, naming the likely causes (module docstring). Watching the
    same model again replaces the earlier watch. On CPU or without a budget nothing is
    installed.

    Args:
        model: the planned model, on its device.
        plan: the plan applied to it (``budget_bytes``, ``predicted_peak_bytes``).
        steps: how many training steps to judge before the hook removes itself.
        tolerance: how far above the budget (a fraction) a peak may be without a warning.
        device: where to read the allocator; by default the model's device (for tests).

    Returns:
        The ``BudgetWatch``: call it to remove the hook; ``measured_peaks`` holds the judged
        steps' peaks.

    Raises:
        UsageError: ``steps`` below 1 or a negative ``tolerance``.

    Example:
        >>> import torch
        >>> from gradckpt.plan import Plan
        >>> model = torch.nn.Linear(4, 4)
        >>> plan = Plan("none", 2**20, [], 0, 0.0, 0.0)
        >>> remove = watch_budget(model, plan)  # CUDA models only: here nothing to watch
        >>> remove.active, remove.reason
        (False, 'the model is on cpu (the watch reads CUDA allocator statistics)')
        >>> remove()
    """
    if steps < 1:
        raise UsageError(f"watch_budget needs steps >= 1, got {steps}")
    if tolerance < 0:
        raise UsageError(f"watch_budget needs tolerance >= 0, got {tolerance}")
    where = torch.device(device) if device is not None else infer_device(model)
    reason = ""
    if plan.budget_bytes is None:
        reason = "the plan has no budget"
    elif where.type != "cuda":
        reason = f"the model is on {where.type} (the watch reads CUDA allocator statistics)"
    earlier = _watches.get(model)
    if earlier is not None:
        earlier.remove()
    watch = BudgetWatch(plan, where, steps=steps, tolerance=tolerance,
                        model_name=type(model).__name__, reason=reason)
    if not reason:
        watch._install(model)
    _watches[model] = watch
    return watch


def watch_of(model: nn.Module) -> BudgetWatch | None:
    """The last watch ``watch_budget`` put on ``model`` (active or done), or None.

    Example:
        >>> watch_of(torch.nn.Linear(2, 2)) is None
        True
    """
    return _watches.get(model)


_LIBRARY_DIRECTORIES = (
    os.path.dirname(torch.__file__) + os.sep,
    os.path.dirname(os.path.abspath(__file__)) + os.sep,
)


def _stacklevel_outside_libraries() -> int:
    """The ``stacklevel`` of the first frame outside torch and gradckpt, counted from the
    caller, so that a warning raised in a hook points at the user's ``model(...)`` line."""
    frame = sys._getframe(1)
    level = 1
    while frame is not None and frame.f_code.co_filename.startswith(_LIBRARY_DIRECTORIES):
        frame = frame.f_back
        level += 1
    return level
