"""Where gradckpt knowingly differs from ``torch.utils.checkpoint(use_reentrant=False)``.

docs/engine.md lists each difference and why; each test here pins both sides of one row, so
that the table goes stale loudly if either library changes: torch's behaviour as documented,
and gradckpt's, checked against the plain model (no checkpointing) where it gives a result.
"""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch
import torch.utils.checkpoint as torch_checkpoint
from engine_models import assert_identical

import gradckpt
from gradckpt import Fate

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread


def keep_all(op: Any, output: torch.Tensor) -> Fate:
    return Fate.KEEP


def torch_must_save(ctx: Any, op: Any, *args: Any, **kwargs: Any) -> Any:
    return torch_checkpoint.CheckpointPolicy.MUST_SAVE


def torch_selective(fn: Any, *args: Any) -> Any:
    """torch's selective checkpointing, keeping every operation's output (like ``keep_all``)."""
    context_fn = functools.partial(
        torch_checkpoint.create_selective_checkpoint_contexts, torch_must_save
    )
    return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False, context_fn=context_fn)


def torch_plain(fn: Any, *args: Any) -> Any:
    return torch_checkpoint.checkpoint(fn, *args, use_reentrant=False)


def region(x: torch.Tensor) -> torch.Tensor:
    return x.exp().sin()


def test_second_backward_through_a_selective_region() -> None:
    """torch refuses a second backward through a selective region; gradckpt runs the kept
    operations again (a kept output is handed to the first recomputation only) and
    accumulates exactly twice the plain gradient."""
    x = torch.randn(4, requires_grad=True)
    loss = torch_selective(region, x).sum()
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward an extra time"):
        loss.backward()

    x = torch.randn(4, requires_grad=True)
    loss = gradckpt.checkpoint(region, x, policy=keep_all).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    plain = x.detach().clone().requires_grad_()
    region(plain).sum().backward()
    assert_identical(x.grad, 2 * plain.grad)


class SavesItsInput(torch.autograd.Function):
    """A custom function whose backward reads ``ctx.saved_tensors`` twice."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        (first,) = ctx.saved_tensors
        (second,) = ctx.saved_tensors
        return grad * (first + second)


def squares(x: torch.Tensor) -> torch.Tensor:
    return SavesItsInput.apply(x.sin())


def test_reading_saved_tensors_twice_in_one_backward() -> None:
    """torch raises when a saved tensor is unpacked a second time in one backward; gradckpt
    hands out recomputed tensors once each, so the second read recomputes the region again
    (correct, at the cost of one more recomputation)."""
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(torch_checkpoint.CheckpointError, match="already unpacked once"):
        torch_plain(squares, x).sum().backward()

    x = torch.randn(4, requires_grad=True)
    gradckpt.checkpoint(squares, x).sum().backward()
    plain = x.detach().clone().requires_grad_()
    squares(plain).sum().backward()
    assert_identical(x.grad, plain.grad)


def test_kept_output_changed_in_place_after_the_region() -> None:
    """torch's selective checkpointing raises "has been mutated"; gradckpt runs the operation
    again and gives the true gradient, as it does with no policy (and as torch does with
    none)."""
    x = torch.tensor([0.0, 1.0, 2.0], requires_grad=True)
    y = torch_selective(torch.exp, x)
    y.mul_(10)
    with pytest.raises(RuntimeError, match="has been mutated"):
        y.sum().backward()

    x = torch.tensor([0.0, 1.0, 2.0], requires_grad=True)
    y = gradckpt.checkpoint(torch.exp, x, policy=keep_all)
    y.mul_(10)
    y.sum().backward()
    assert_identical(x.grad, 10 * torch.tensor([0.0, 1.0, 2.0]).exp())


def test_parameter_changed_in_place_between_forward_and_backward() -> None:
    """torch recomputes with the changed weight and returns a gradient no plain step would
    give (plain autograd refuses); gradckpt raises ``CheckpointError`` instead."""

    def changed_weight_step(checkpoint: Any) -> torch.Tensor:
        torch.manual_seed(0)
        linear = torch.nn.Linear(3, 3)
        x = torch.randn(2, 3, requires_grad=True)
        y = checkpoint(lambda t: linear(t).tanh(), x)
        with torch.no_grad():
            linear.weight.add_(1)
        y.sum().backward()
        return x.grad

    torch.manual_seed(0)
    linear = torch.nn.Linear(3, 3)
    x = torch.randn(2, 3, requires_grad=True)
    linear(x).tanh().sum().backward()  # the gradient the forward pass's weights give
    assert not torch.equal(changed_weight_step(torch_plain), x.grad)
    with pytest.raises(gradckpt.CheckpointError, match="changed in place between the forward"):
        changed_weight_step(gradckpt.checkpoint)


def factory_region(x: torch.Tensor) -> torch.Tensor:
    return (x * torch.ones(())).sin()


def test_default_dtype_set_only_for_the_forward_pass() -> None:
    """torch replays the device context but not the default dtype: its metadata check fails.
    gradckpt replays it (and the other global settings of docs/engine.md)."""

    def step(checkpoint: Any) -> torch.Tensor:
        x = torch.randn(3, dtype=torch.float64, requires_grad=True)
        torch.set_default_dtype(torch.float64)
        try:
            y = checkpoint(factory_region, x)
        finally:
            torch.set_default_dtype(torch.float32)
        y.sum().backward()
        return x.grad

    with pytest.raises(torch_checkpoint.CheckpointError, match="different metadata"):
        step(torch_plain)
    assert step(gradckpt.checkpoint).dtype == torch.float64


def test_deterministic_algorithms_set_only_for_the_forward_pass() -> None:
    """torch's recomputation runs under the caller's setting at backward time; gradckpt's
    under the forward pass's."""

    def seen_in_recomputation(checkpoint: Any) -> list[bool]:
        seen: list[bool] = []

        def records(x: torch.Tensor) -> torch.Tensor:
            seen.append(torch.are_deterministic_algorithms_enabled())
            return x.sin()

        x = torch.randn(3, requires_grad=True)
        torch.use_deterministic_algorithms(True, warn_only=True)
        try:
            y = checkpoint(records, x)
        finally:
            torch.use_deterministic_algorithms(False)
        y.sum().backward()
        return seen

    assert seen_in_recomputation(torch_plain) == [True, False]
    assert seen_in_recomputation(gradckpt.checkpoint) == [True, True]
