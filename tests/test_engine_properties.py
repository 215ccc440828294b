"""Property tests: random chains, checkpointed at random, match the plain chain bit for bit.

Hypothesis draws a chain (depth 1-6, widths, activations, dropout on/off, frozen blocks), which
blocks are checkpointed, how they are grouped into outer checkpointed segments (nesting), a
policy per region (None, the presets, or random fates per op: keep, recompute, offload)
and whether ``checkpoint`` or ``checkpoint_module`` is used.

Invariant 1: outputs and gradients equal the plain chain's (``torch.equal``), dropout included.
Invariant 4: inputs or blocks that do not require grad change nothing.
Invariant 5: nested checkpoints behave as without checkpointing.
Invariant 1/2 (RNG): the caller's random stream after the step is the plain step's.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from typing import Any

import torch
from engine_models import ACTIVATIONS, MLPBlock, assert_identical, gradients
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from torch import nn

import gradckpt
from gradckpt import Fate


class RandomFates:
    """A policy that gives each op a fate drawn at random (hashed from the op and a salt).

    A pure function of the op, as a policy should be: with nesting, an inner region's policy
    is asked again when its parent is recomputed (rule R3) and must answer the same.
    """

    def __init__(self, fates: list[Fate], salt: int) -> None:
        self.fates = fates
        self.salt = salt

    def __call__(self, op: Any, output: torch.Tensor) -> Fate:
        assert isinstance(output, torch.Tensor)
        return self.fates[zlib.crc32(f"{self.salt}:{op}".encode()) % len(self.fates)]

    def __repr__(self) -> str:
        return f"RandomFates({[f.name for f in self.fates]}, salt={self.salt})"


policies = st.one_of(
    st.none(),
    st.sampled_from(["save-matmuls", "offload-matmuls"]),
    st.builds(
        RandomFates,
        st.lists(st.sampled_from(list(Fate)), min_size=1, max_size=3),
        st.integers(0, 1000),
    ),
)


@dataclass
class ChainSpec:
    widths: list[int]
    activations: list[str]
    dropouts: list[float]
    frozen: list[bool]
    checkpointed: list[bool]
    block_policies: list[Any]
    segment_ends: list[int]  # exclusive end index of each segment of blocks
    segment_checkpointed: list[bool]
    segment_policies: list[Any]
    method: str
    input_requires_grad: bool
    seed: int


@st.composite
def chain_specs(draw: st.DrawFn) -> ChainSpec:
    depth = draw(st.integers(1, 6))

    def per_block(strategy: st.SearchStrategy) -> list:
        return draw(st.lists(strategy, min_size=depth, max_size=depth))

    cuts = sorted(draw(st.sets(st.integers(1, depth - 1))) if depth > 1 else set())
    segment_ends = [*cuts, depth]
    segments = len(segment_ends)
    spec = ChainSpec(
        widths=draw(st.lists(st.integers(1, 7), min_size=depth + 1, max_size=depth + 1)),
        activations=per_block(st.sampled_from(sorted(ACTIVATIONS))),
        dropouts=per_block(st.sampled_from([0.0, 0.5])),
        frozen=per_block(st.booleans()),
        checkpointed=per_block(st.booleans()),
        block_policies=per_block(policies),
        segment_ends=segment_ends,
        segment_checkpointed=draw(st.lists(st.booleans(), min_size=segments, max_size=segments)),
        segment_policies=draw(st.lists(policies, min_size=segments, max_size=segments)),
        method=draw(st.sampled_from(["function", "module"])),
        input_requires_grad=draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )
    assume(spec.input_requires_grad or not all(spec.frozen))  # something to differentiate
    return spec


class Group(nn.Module):
    """A segment of blocks; each block is called through ``gradckpt.checkpoint`` if asked."""

    def __init__(self, blocks: list[nn.Module], policies: list[Any | None]) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.policies = policies  # one entry per block; the string "plain" = no checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block, policy in zip(self.blocks, self.policies, strict=True):
            x = block(x) if policy == "plain" else gradckpt.checkpoint(block, x, policy=policy)
        return x


class Chain(nn.Module):
    def __init__(self, groups: list[Group], policies: list[Any]) -> None:
        super().__init__()
        self.groups = nn.ModuleList(groups)
        self.policies = policies

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for group, policy in zip(self.groups, self.policies, strict=True):
            x = group(x) if policy == "plain" else gradckpt.checkpoint(group, x, policy=policy)
        return x


def build(spec: ChainSpec, checkpointing: bool) -> Chain:
    torch.manual_seed(spec.seed)
    blocks = []
    for i in range(len(spec.activations)):
        block = MLPBlock(spec.widths[i], spec.widths[i + 1], spec.activations[i], spec.dropouts[i])
        block.requires_grad_(not spec.frozen[i])
        blocks.append(block)
    use_function = checkpointing and spec.method == "function"
    use_module = checkpointing and spec.method == "module"

    def fate(flag: bool, policy: Any) -> Any:
        return policy if use_function and flag else "plain"

    groups, group_policies, start = [], [], 0
    for end, outer, outer_policy in zip(
        spec.segment_ends, spec.segment_checkpointed, spec.segment_policies, strict=True
    ):
        inner = [fate(spec.checkpointed[i], spec.block_policies[i]) for i in range(start, end)]
        groups.append(Group(blocks[start:end], inner))
        group_policies.append(fate(outer, outer_policy))
        start = end
    if use_module:
        # Parents first, then their children: checkpoint_module nests like checkpoint does.
        for group, outer, policy in zip(
            groups, spec.segment_checkpointed, spec.segment_policies, strict=True
        ):
            if outer:
                gradckpt.checkpoint_module(group, policy=policy)
        for block, flag, policy in zip(blocks, spec.checkpointed, spec.block_policies, strict=True):
            if flag:
                gradckpt.checkpoint_module(block, policy=policy)
    return Chain(groups, group_policies)


def run(spec: ChainSpec, checkpointing: bool) -> dict:
    model = build(spec, checkpointing)
    generator = torch.Generator().manual_seed(spec.seed + 1)
    x = torch.randn(3, spec.widths[0], generator=generator)
    x.requires_grad_(spec.input_requires_grad)
    torch.manual_seed(spec.seed + 2)
    y = model(x)
    (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum().backward()
    return {
        "output": y.detach(),
        "input_grad": x.grad,
        "grads": gradients(model),
        "rng_after": torch.get_rng_state(),
    }


@settings(max_examples=40, deadline=None)
@given(chain_specs())
def test_random_checkpointed_chain_matches_plain_chain(spec: ChainSpec) -> None:
    """Invariants 1, 4, 5: any checkpointing of any chain gives the plain grads bit for bit."""
    expected = run(spec, checkpointing=False)
    actual = run(spec, checkpointing=True)
    assert_identical(actual["output"], expected["output"], "output")
    assert_identical(actual["input_grad"], expected["input_grad"], "input grad")
    assert_identical(actual["grads"], expected["grads"], "grads")
    # The caller's random stream is not shifted by recomputation (replayed, then restored).
    assert torch.equal(actual["rng_after"], expected["rng_after"])


@settings(max_examples=25, deadline=None)
@given(chain_specs())
def test_random_chain_backward_twice_accumulates_exactly_twice(spec: ChainSpec) -> None:
    """Invariants 5 and 6: retain_graph=True, backward twice: exactly 2x the plain grads."""
    expected = run(spec, checkpointing=False)
    model = build(spec, checkpointing=True)
    generator = torch.Generator().manual_seed(spec.seed + 1)
    x = torch.randn(3, spec.widths[0], generator=generator)
    x.requires_grad_(spec.input_requires_grad)
    torch.manual_seed(spec.seed + 2)
    y = model(x)
    loss = (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum()
    loss.backward(retain_graph=True)
    loss.backward()
    doubled = {k: None if g is None else 2 * g for k, g in expected["grads"].items()}
    assert_identical(gradients(model), doubled, "grads")
    expected_input_grad = None if expected["input_grad"] is None else 2 * expected["input_grad"]
    assert_identical(x.grad, expected_input_grad, "input grad")
