"""Plans installed on a model in turn and measured: peak memory, step time, and training.

Every measurement runs the same step ``gradckpt.profile`` measured (``training_step``), and
starts it as a training loop does, with gradients set to None, so that the demo's measured
columns compare with the predicted ones.

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
    >>> cpu = torch.device("cpu")
    >>> measure_peaks(model, sample, runs, cpu)
    >>> time_plans(model, sample, runs, repeats=1, device=cpu)
    >>> train_plans(model, [(sample["idx"], sample["targets"])], runs, seed=0)
    >>> runs[0].peak_bytes >= runs[1].peak_bytes > 0, runs[1].median_seconds > 0
    (True, True)
    >>> identical_to(runs[1], runs[0])  # checkpointing changes no number of training
    True
"""

from __future__ import annotations

import copy
import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .devices import synchronize
from .progress import with_progress

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = ["PlanRun", "measure_peaks", "time_plans", "train_plans", "identical_to"]


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


def measure_peaks(
    model: nn.Module, sample: dict[str, Any], runs: list[PlanRun], device: torch.device
) -> None:
    """The peak memory of one training step under each plan, into ``run.peak_bytes``."""
    import gradckpt
    from gradckpt.measure import measure_peak_bytes
    from gradckpt.measure.step import training_step

    def forward_backward() -> None:
        training_step(model, sample)  # as profile() measured it

    for run in with_progress(runs, "gradckpt: measuring the peak of each plan"):
        gradckpt.apply(model, run.plan)
        model.zero_grad(set_to_none=True)  # as in profile(): gradients start the step as None
        run.peak_bytes = measure_peak_bytes(
            forward_backward, model, *sample.values(), device=device
        )
    gradckpt.disable(model)
    model.zero_grad(set_to_none=True)


def time_plans(
    model: nn.Module, sample: dict[str, Any], runs: list[PlanRun], repeats: int,
    device: torch.device,
) -> None:
    """Median forward+backward time of each plan, in rounds (A, B, C, ..., A, B, C, ...), so
    that a slow spell of the machine touches every plan alike; into ``run.median_seconds``."""
    import gradckpt
    from gradckpt.measure.step import training_step

    times: dict[int, list[float]] = {index: [] for index in range(len(runs))}
    rounds = range(1 + repeats)
    for round_index in with_progress(rounds, "gradckpt: timing the plans side by side"):
        for index, run in enumerate(runs):
            gradckpt.apply(model, run.plan)  # outside the timed part: installing is not a step
            model.zero_grad(set_to_none=True)
            synchronize(device)
            start = time.perf_counter()
            training_step(model, sample)  # the step measure_peaks and profile() measure
            synchronize(device)
            if round_index:  # round 0 warms up
                times[index].append(time.perf_counter() - start)
    gradckpt.disable(model)
    model.zero_grad(set_to_none=True)
    for index, run in enumerate(runs):
        run.median_seconds = statistics.median(times[index])


def train_plans(
    model: nn.Module, batches: list[tuple[torch.Tensor, torch.Tensor]], runs: list[PlanRun],
    seed: int,
) -> None:
    """A few AdamW steps under each plan, from the same weights and seed, of a model called as
    ``model(inputs, targets) -> loss``: into ``run.losses`` and ``run.parameters``."""
    import torch

    import gradckpt

    initial = copy.deepcopy(model.state_dict())
    training = f"gradckpt: training {len(batches)} AdamW steps under each plan"
    for run in with_progress(runs, training):
        model.load_state_dict(initial)
        gradckpt.apply(model, run.plan)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        torch.manual_seed(seed + 1)  # the same dropout masks for every plan
        losses = []
        for inputs, targets in batches:
            optimizer.zero_grad(set_to_none=True)
            loss = model(inputs, targets)
            loss.backward()
            optimizer.step()
            losses.append(loss.detach())
        run.losses = torch.stack(losses)
        run.parameters = [parameter.detach().clone() for parameter in model.parameters()]
    gradckpt.disable(model)
    model.load_state_dict(initial)


def identical_to(run: PlanRun, reference: PlanRun) -> bool:
    """Whether training under ``run``'s plan gave the very same losses and weights, bit for bit.
    """
    import torch

    return torch.equal(run.losses, reference.losses) and all(
        torch.equal(a, b) for a, b in zip(run.parameters, reference.parameters, strict=True)
    )
