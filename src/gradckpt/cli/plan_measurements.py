"""The demo's plans measured on its GPT: side by side (``gradckpt.side_by_side``: each plan's
peak and its step time in alternating rounds), then trained.

Every measurement runs the step ``gradckpt.profile`` measured (the user's step, its output kept),
so that the demo's measured columns compare with the predicted ones.

Example:
    >>> import torch
    >>> import gradckpt
    >>> from gradckpt.toy_models import GPTConfig, TinyGPT
    >>> model = TinyGPT(GPTConfig(vocab_size=32, block_size=8, n_layer=2, n_embd=16))
    >>> tokens = torch.randint(0, model.config.vocab_size, (2, 9))
    >>> sample = {"idx": tokens[:, :-1], "targets": tokens[:, 1:]}
    >>> profile = gradckpt.profile(model, sample, repeats=1)
    >>> runs = [PlanRun(name, "-", gradckpt.solve(profile, None, name))
    ...         for name in ("none", "every-layer")]
    >>> measure_plans(model, sample, runs, repeats=1)
    >>> train_plans(model, [(sample["idx"], sample["targets"])], runs, seed=0)
    >>> runs[0].peak_bytes >= runs[1].peak_bytes > 0, runs[1].median_seconds > 0
    (True, True)
    >>> identical_to(runs[1], runs[0])  # checkpointing changes no number of training
    True
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .progress import progress_bar, with_progress

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["PlanRun", "measure_plans", "train_plans", "identical_to"]


@dataclass
class PlanRun:
    """One plan of the demo's GPT and what was measured with it installed (see the module's
    example)."""

    label: str
    budget: str
    plan: Any
    peak_bytes: int = 0
    median_seconds: float = 0.0
    losses: Any = None
    parameters: list = dataclasses.field(default_factory=list)


def measure_plans(
    model: nn.Module, sample: dict[str, Any], runs: list[PlanRun], repeats: int
) -> None:
    """Each plan's peak memory of a training step and its median step time over ``repeats``
    rounds after one of warm-up, side by side (``gradckpt.side_by_side.compare_plans``), into
    ``run.peak_bytes`` and ``run.median_seconds``. Training under each plan
    (``train_plans``) checks its numbers, so gradients are not compared here."""
    from gradckpt.side_by_side import compare_plans

    plans = {str(index): run.plan for index, run in enumerate(runs)}
    with progress_bar("gradckpt: measuring the plans side by side (peak, time)") as report:
        measured = compare_plans(model, sample, plans, rounds=repeats, check_gradients=False,
                                 progress=report)
    for key, run in zip(plans, runs, strict=True):
        run.peak_bytes = measured.peak_bytes[key]
        run.median_seconds = measured.median_seconds(key)


def train_plans(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], runs: list[PlanRun],
    seed: int,
) -> None:
    """A few AdamW steps under each plan, from the same weights and seed, of a model called as
    ``model(inputs, targets) -> loss``: into ``run.losses`` and ``run.parameters``."""
    import torch

    from gradckpt.side_by_side import installed

    initial = copy.deepcopy(model.state_dict())
    training = f"gradckpt: training {len(batches)} AdamW steps under each plan"
    for run in with_progress(runs, training):
        model.load_state_dict(initial)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        torch.manual_seed(seed + 1)  # the same dropout masks for every plan
        losses = []
        with installed(model, run.plan):
            for inputs, targets in batches:
                optimizer.zero_grad(set_to_none=True)
                loss = model(inputs, targets)
                loss.backward()
                optimizer.step()
                losses.append(loss.detach())
        run.losses = torch.stack(losses)
        run.parameters = [parameter.detach().clone() for parameter in model.parameters()]
    model.load_state_dict(initial)


def identical_to(run: PlanRun, reference: PlanRun) -> bool:
    """Whether training under ``run``'s plan gave the very same losses and weights, bit for bit.
    """
    import torch

    return torch.equal(run.losses, reference.losses) and all(
        torch.equal(a, b) for a, b in zip(run.parameters, reference.parameters, strict=True)
    )
