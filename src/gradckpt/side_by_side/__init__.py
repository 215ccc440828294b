"""Ways of running one training step measured side by side: the real peak of each, its step
time against the others in alternating rounds, and whether it computes the plain gradients.

The one protocol gradckpt has for comparing plans; ``gradckpt demo``, the scripts in ``bench/``
and the tests that compare plans all measure with it (``step.py``: what runs and its step,
memory and gradients; ``timing.py``: time; ``compare.py``: all three on plans):

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

from .compare import Comparison, compare_plans, plans_at_shares
from .step import (
    Contender,
    GradientCheck,
    StepMeasurement,
    UsersStep,
    compare_gradients,
    installed,
    measure_users_step,
)
from .timing import RatioStats, Round, SideBySideTimes, Turn, summarize_ratios, time_side_by_side

__all__ = [
    "Contender", "UsersStep", "installed", "measure_users_step", "StepMeasurement",
    "compare_gradients", "GradientCheck", "time_side_by_side", "SideBySideTimes", "Round",
    "Turn", "RatioStats", "summarize_ratios", "compare_plans", "Comparison", "plans_at_shares",
]
