"""A block that does not compute the same thing twice (data-dependent shapes from state the
engine cannot replay) is a ``CheckpointError`` naming the block, wherever it shows: while
``enable`` measures it, or in the step of a plan applied; the model is left as it was, and the
next model in the process is planned and trained as if nothing had happened."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradckpt


class Linear(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.linear(x))


class RowsByCallCount(nn.Module):
    """Keeps the rows above a threshold that moves with each call: a Python counter, which
    no RNG replay restores, so its recomputation sees other rows than its forward did."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        rows = x[:, 0] > (self.calls % 3) * 0.5 - 0.5
        return x * self.linear(x[rows]).mean()


class Chain(nn.Module):
    def __init__(self, flaky: bool) -> None:
        super().__init__()
        self.blocks = nn.ModuleList([Linear(), RowsByCallCount() if flaky else Linear(),
                                     Linear()])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.square().mean()


def _hooks(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) for m in model.modules())


def _gradients(model: nn.Module, sample: torch.Tensor) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(sample).backward()
    return [p.grad.clone() for p in model.parameters()]


def _a_fresh_model_trains_as_without_a_plan(sample: torch.Tensor) -> None:
    torch.manual_seed(1)
    model = Chain(flaky=False)
    plain = _gradients(model, sample)
    gradckpt.enable(model, sample, None, "every-layer", optimizer="none",
                    blocks=list(model.blocks))
    planned = _gradients(model, sample)
    gradckpt.disable(model)
    assert all(torch.equal(a, b) for a, b in zip(plain, planned, strict=True))


def test_enable_names_the_block_that_recomputes_otherwise_and_changes_nothing() -> None:
    """``enable`` measures each block checkpointed on its own: the recomputation of
    ``blocks.1`` saves rows of another count, a ``CheckpointError`` naming it."""
    torch.manual_seed(0)
    model, sample = Chain(flaky=True), torch.randn(64, 8)
    before = {name: value.clone() for name, value in model.state_dict().items()}
    hooks = _hooks(model)
    with pytest.raises(gradckpt.CheckpointError, match="recomputing region 'blocks.1' produced "
                                                        "a different saved tensor"):
        gradckpt.enable(model, sample, "80%", optimizer="none", blocks=list(model.blocks))
    assert gradckpt.get_plan(model) is None and _hooks(model) == hooks
    assert all(torch.equal(value, model.state_dict()[name]) for name, value in before.items())
    _a_fresh_model_trains_as_without_a_plan(sample)


def test_a_planned_step_names_the_block_that_recomputes_otherwise() -> None:
    """A plan made where the block behaved (it was measured as another one) and applied:
    the step's backward raises a ``CheckpointError`` naming the block's segment, and the
    model's next step without the plan runs."""
    torch.manual_seed(0)
    steady, sample = Chain(flaky=False), torch.randn(64, 8)
    profile = gradckpt.profile(steady, sample, blocks=list(steady.blocks), repeats=1)
    plan = gradckpt.solve(profile, strategy="every-layer")
    model = Chain(flaky=True)
    gradckpt.apply(model, plan)
    with pytest.raises(gradckpt.CheckpointError, match="region 'blocks.1..blocks.1'"):
        model(sample).backward()
    gradckpt.disable(model)
    model(sample).backward()  # unplanned: its forward is its own business
    _a_fresh_model_trains_as_without_a_plan(sample)
