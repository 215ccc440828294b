"""What runs and the step it runs, measured once: a contender installed, the loop's step as
users write it, its real peak on the package's meter, and its gradients against another's."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..apply import apply, disable
from ..measure import MemoryMeter, infer_device
from ..measure.step import OutputHolder, training_step
from ..measure.tensors import tensors_in
from ..plan import Plan

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
    ``largest_difference``: per contender, the largest difference from the reference over the
    loss and every gradient, each relative to the largest magnitude of the reference's tensor
    (0.0: identical): what a plan computing the loss in chunks, which sums in another order,
    is held to instead of bit for bit.
    """

    reference: str
    compared: int
    differing: dict[str, list[str]]
    largest_difference: dict[str, float] = field(default_factory=dict)

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
        >>> check.identical("again"), check.differing["x2"], check.largest_difference["x2"]
        (True, ['loss', 'weight', 'bias'], 1.0)
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
    differing, largest = {}, {}
    for label, (loss, grads) in results.items():
        names = ["loss"] if not _equal(loss, reference_loss) else []
        names += [name for (name, _), mine, theirs in zip(named, grads, reference_grads,
                                                          strict=True)
                  if not _equal(mine, theirs)]
        differing[label] = names
        largest[label] = max(_relative_difference(mine, theirs) for mine, theirs in
                             zip([loss, *grads], [reference_loss, *reference_grads], strict=True))
    return GradientCheck(reference, len(named), differing, largest)


def _relative_difference(first: torch.Tensor | None, second: torch.Tensor | None) -> float:
    """The largest difference between two tensors over the second's largest magnitude; inf
    when one is None and the other not."""
    if first is None or second is None:
        return 0.0 if first is second else float("inf")
    scale = second.double().abs().max().item() if second.numel() else 0.0
    difference = (first.double() - second.double()).abs().max().item() if first.numel() else 0.0
    return difference / scale if scale else difference


def _equal(first: torch.Tensor | None, second: torch.Tensor | None) -> bool:
    if first is None or second is None:
        return first is second
    return torch.equal(first, second)
