"""Property tests: random chains, checkpointed at random, match the plain chain bit for bit.

Hypothesis draws a chain (depth 1-6, widths, activations, dropout on/off, frozen blocks), which
blocks are checkpointed, how they are grouped into outer checkpointed segments (nesting), a
policy per region (None, the presets, or random fates per op: keep, recompute, offload)
and whether ``checkpoint`` or ``checkpoint_module`` is used. It also draws what the caller does
around the regions: a constant the output of a block or segment is multiplied by, in place
(``y.mul_(c)``) where that region is checkpointed; whether the chain's input is a tensor subclass
that answers size queries through dispatch (``SizesThroughDispatch``); and the ambient state of
the forward pass, undone before backward (default dtype float64, or a ``torch.device("meta")``
context), with blocks that create tensors with factory functions. CI (``CI`` set) runs these
tests derandomized: the same examples every run (the ``ci`` profile in ``conftest.py``).

Invariant 1: outputs and gradients equal the plain chain's (``torch.equal``), dropout included,
also when a kept or offloaded output is changed in place after its region returned, on a
subclass input, and when the default dtype of the forward pass is gone by backward.
Invariant 4: inputs or blocks that do not require grad change nothing.
Invariant 5: nested checkpoints behave as without checkpointing.
Invariant 1/2 (RNG): the caller's random stream after the step is the plain step's.
Invariant 7: recomputation under the caller's ambient state (a ``torch.device`` context left
before backward) is no mismatch: on the meta device the step finishes with the plain shapes.
"""

from __future__ import annotations

import contextlib
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from engine_models import (
    ACTIVATIONS,
    MLPBlock,
    SizesThroughDispatch,
    assert_identical,
    flatten_named,
    gradients,
)
from hypothesis import assume, event, given, settings
from hypothesis import strategies as st
from torch import nn

import gradckpt
from gradckpt import Fate

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread


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

activation_names = st.sampled_from(sorted(ACTIVATIONS))
dropout_rates = st.sampled_from([0.0, 0.5])

# Policies that keep or offload some ops' outputs: KEEP or OFFLOAD, then any fates.
keeping_policies = st.builds(
    RandomFates,
    st.builds(
        lambda first, rest: [first, *rest],
        st.sampled_from([Fate.KEEP, Fate.OFFLOAD]),
        st.lists(st.sampled_from(list(Fate)), max_size=2),
    ),
    st.integers(0, 1000),
)

# What a region's output is multiplied by after the region returns (None: left alone).
scales = st.sampled_from([None, 0.5, 3.0])

AMBIENTS = ("none", "default-dtype", "meta-device")
VALUE_AMBIENTS = ("none", "default-dtype")  # meta tensors have no values to compare


@dataclass
class ChainSpec:
    widths: list[int]
    activations: list[str]
    dropouts: list[float]
    frozen: list[bool]
    checkpointed: list[bool]
    block_policies: list[Any]
    block_scales: list[float | None]  # applied to each block's output
    segment_ends: list[int]  # exclusive end index of each segment of blocks
    segment_checkpointed: list[bool]
    segment_policies: list[Any]
    segment_scales: list[float | None]  # applied to each segment's output
    method: str
    input_requires_grad: bool
    subclass_input: bool  # the checkpointed run's input is wrapped in SizesThroughDispatch
    ambient: str  # one of AMBIENTS
    factory_ops: bool  # blocks also create tensors with torch.ones / torch.zeros
    seed: int


@st.composite
def chain_specs(
    draw: st.DrawFn,
    ambients: tuple[str, ...] = VALUE_AMBIENTS,
    activations: st.SearchStrategy[str] = activation_names,
    dropouts: st.SearchStrategy[float] = dropout_rates,
    region_policies: st.SearchStrategy[Any] = policies,
    region_scales: st.SearchStrategy[float | None] = scales,
) -> ChainSpec:
    depth = draw(st.integers(1, 6))

    def per_block(strategy: st.SearchStrategy) -> list:
        return draw(st.lists(strategy, min_size=depth, max_size=depth))

    cuts = sorted(draw(st.sets(st.integers(1, depth - 1))) if depth > 1 else set())
    segment_ends = [*cuts, depth]
    segments = len(segment_ends)

    def per_segment(strategy: st.SearchStrategy) -> list:
        return draw(st.lists(strategy, min_size=segments, max_size=segments))

    ambient = draw(st.sampled_from(ambients))
    spec = ChainSpec(
        widths=draw(st.lists(st.integers(1, 7), min_size=depth + 1, max_size=depth + 1)),
        activations=per_block(activations),
        dropouts=per_block(dropouts),
        frozen=per_block(st.booleans()),
        checkpointed=per_block(st.booleans()),
        block_policies=per_block(region_policies),
        block_scales=per_block(region_scales),
        segment_ends=segment_ends,
        segment_checkpointed=per_segment(st.booleans()),
        segment_policies=per_segment(region_policies),
        segment_scales=per_segment(region_scales),
        method=draw(st.sampled_from(["function", "module"])),
        input_requires_grad=draw(st.booleans()),
        # Every activation and dropout of MLPBlock runs on SizesThroughDispatch plainly, so the
        # subclass is drawn for every chain.
        subclass_input=draw(st.booleans()),
        ambient=ambient,
        # The ambient state matters to factory functions: with an ambient, every block has them.
        factory_ops=ambient != "none" or draw(st.booleans()),
        seed=draw(st.integers(0, 2**16)),
    )
    assume(spec.input_requires_grad or not all(spec.frozen))  # something to differentiate
    return spec


class FactoryMLPBlock(MLPBlock):
    """An ``MLPBlock`` that also makes tensors with factory functions, which take the default
    dtype and device: recomputation must create them as the forward pass did.

    ``* torch.ones(())`` saves the factory tensor for backward wherever the linear output
    requires grad (its grad needs it), so a recomputation that made it with another dtype or
    device is noticed; before the engine replayed the ambient state, this was a spurious
    ``CheckpointError`` ("saved float32[] on meta, recomputation saved float32[] on cpu").
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.linear(x) * torch.ones(()) + torch.zeros(())
        return self.dropout(self.activation(hidden))


def rescaled(y: torch.Tensor, scale: float | None, in_place: bool) -> torch.Tensor:
    """``y * scale`` (``y`` itself for None), computed in place when ``in_place``.

    In place only after a checkpointed region: plain autograd refuses an in-place change of a
    tensor an op saved (relu, sigmoid and tanh save their outputs), while the engine must
    notice that a kept or offloaded output changed and run that op again.
    """
    if scale is None:
        return y
    return y.mul_(scale) if in_place else y * scale


class Group(nn.Module):
    """A segment of blocks; each block is called through ``gradckpt.checkpoint`` if asked, and
    its output rescaled (in place where the block is checkpointed)."""

    def __init__(
        self,
        blocks: list[nn.Module],
        policies: list[Any | None],
        scales: list[float | None],
        in_place: list[bool],
    ) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(blocks)
        self.policies = policies  # one entry per block; the string "plain" = no checkpoint
        self.scales = scales
        self.in_place = in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block, policy, scale, in_place in zip(
            self.blocks, self.policies, self.scales, self.in_place, strict=True
        ):
            x = block(x) if policy == "plain" else gradckpt.checkpoint(block, x, policy=policy)
            x = rescaled(x, scale, in_place)
        return x


class Chain(nn.Module):
    def __init__(
        self,
        groups: list[Group],
        policies: list[Any],
        scales: list[float | None],
        in_place: list[bool],
    ) -> None:
        super().__init__()
        self.groups = nn.ModuleList(groups)
        self.policies = policies
        self.scales = scales
        self.in_place = in_place

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for group, policy, scale, in_place in zip(
            self.groups, self.policies, self.scales, self.in_place, strict=True
        ):
            x = group(x) if policy == "plain" else gradckpt.checkpoint(group, x, policy=policy)
            x = rescaled(x, scale, in_place)
        return x


def build(spec: ChainSpec, checkpointing: bool) -> Chain:
    torch.manual_seed(spec.seed)
    block_type = FactoryMLPBlock if spec.factory_ops else MLPBlock
    blocks = []
    for i in range(len(spec.activations)):
        block = block_type(
            spec.widths[i], spec.widths[i + 1], spec.activations[i], spec.dropouts[i]
        )
        block.requires_grad_(not spec.frozen[i])
        blocks.append(block)
    use_function = checkpointing and spec.method == "function"
    use_module = checkpointing and spec.method == "module"

    def fate(flag: bool, policy: Any) -> Any:
        return policy if use_function and flag else "plain"

    # In place exactly where the region is checkpointed (by either method) in this run.
    block_in_place = [checkpointing and flag for flag in spec.checkpointed]
    groups, group_policies, start = [], [], 0
    for end, outer, outer_policy in zip(
        spec.segment_ends, spec.segment_checkpointed, spec.segment_policies, strict=True
    ):
        inner = [fate(spec.checkpointed[i], spec.block_policies[i]) for i in range(start, end)]
        groups.append(
            Group(blocks[start:end], inner, spec.block_scales[start:end], block_in_place[start:end])
        )
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
    group_in_place = [checkpointing and flag for flag in spec.segment_checkpointed]
    return Chain(groups, group_policies, spec.segment_scales, group_in_place)


@contextlib.contextmanager
def forward_ambient(ambient: str) -> Iterator[None]:
    """The global state the model is built and run forward under; undone before backward, so
    recomputation runs under other state than the forward pass did."""
    if ambient == "meta-device":
        with torch.device("meta"):
            yield
    elif ambient == "default-dtype":
        previous = torch.get_default_dtype()  # float32
        torch.set_default_dtype(torch.float64)
        try:
            yield
        finally:
            torch.set_default_dtype(previous)
    else:
        assert ambient == "none", ambient
        yield


def unwrapped(value: Any) -> Any:
    """``value`` with every ``SizesThroughDispatch`` (in dicts too) replaced by the tensor it
    wraps: the subclass run's results, comparable with the plain run's."""
    if isinstance(value, SizesThroughDispatch):
        return value.unwrapped()
    if isinstance(value, dict):
        return {key: unwrapped(item) for key, item in value.items()}
    return value


def run(spec: ChainSpec, checkpointing: bool, backward_passes: int = 1) -> dict:
    """One step: build, forward (under the drawn ambient), backward ``backward_passes`` times.

    The subclass input is used only when checkpointing: the reference is the plain chain on the
    plain input. Results come back unwrapped.
    """
    with forward_ambient(spec.ambient):
        model = build(spec, checkpointing)
        generator = torch.Generator().manual_seed(spec.seed + 1)
        x = torch.randn(3, spec.widths[0], generator=generator)
        x.requires_grad_(spec.input_requires_grad)
        if checkpointing and spec.subclass_input:
            x = SizesThroughDispatch.of(x)
        torch.manual_seed(spec.seed + 2)
        y = model(x)
        loss = (y * torch.linspace(-1, 1, y.numel()).view_as(y)).sum()
    for remaining in reversed(range(backward_passes)):
        loss.backward(retain_graph=remaining > 0)
    return {
        "output": unwrapped(y.detach()),
        "input_grad": unwrapped(x.grad),
        "grads": unwrapped(gradients(model)),
        "rng_after": torch.get_rng_state(),
    }


# The activations whose backward needs their own output (the result, not the input).
SAVES_OWN_OUTPUT = {
    "relu": torch.ops.aten.relu.default,
    "sigmoid": torch.ops.aten.sigmoid.default,
    "tanh": torch.ops.aten.tanh.default,
}


def changes_kept_output_that_backward_needs(spec: ChainSpec) -> bool:
    """Whether some checkpointed region is rescaled in place after it returned, and its output
    is one that the region's policy keeps or offloads and that its own backward needs.

    Only then does a missed change reach a gradient: recomputation is handed the changed value
    (or, once the engine notices, runs the op again). Other kept outputs (a matmul's, dropout's)
    are never asked for: recomputation stops once the tensors backward saved exist (R5).
    """

    def last_op(block: int) -> Any:
        # Dropout off (p = 0) is no op on the CPU: the activation's output is the block's.
        return SAVES_OWN_OUTPUT.get(spec.activations[block]) if spec.dropouts[block] == 0 else None

    def keeps(policy: Any, op: Any) -> bool:
        return isinstance(policy, RandomFates) and policy(op, torch.empty(0)) is not Fate.RECOMPUTE

    regions = [
        (spec.checkpointed[i], spec.block_policies[i], spec.block_scales[i], last_op(i))
        for i in range(len(spec.activations))
    ] + [
        (flag, policy, scale, last_op(end - 1))
        for flag, policy, scale, end in zip(
            spec.segment_checkpointed,
            spec.segment_policies,
            spec.segment_scales,
            spec.segment_ends,
            strict=True,
        )
    ]
    return any(
        flag and scale is not None and op is not None and keeps(policy, op)
        for flag, policy, scale, op in regions
    )


def note_coverage(spec: ChainSpec) -> None:
    """Hypothesis statistics (``--hypothesis-show-statistics``): how often the new cases come."""
    event(f"ambient: {spec.ambient}")
    if spec.subclass_input:
        event("subclass input")
    if changes_kept_output_that_backward_needs(spec):
        event("a kept or offloaded output that backward needs is changed after its region")


def checkpointed_and_plain_run_alike(spec: ChainSpec) -> tuple[dict, dict]:
    """Run the chain checkpointed and plain; assert the same output and gradients bit for bit."""
    note_coverage(spec)
    expected = run(spec, checkpointing=False)
    actual = run(spec, checkpointing=True)
    assert_identical(actual["output"], expected["output"], "output")
    assert_identical(actual["input_grad"], expected["input_grad"], "input grad")
    assert_identical(actual["grads"], expected["grads"], "grads")
    return actual, expected


@settings(max_examples=40, deadline=None)
@given(chain_specs())
def test_random_checkpointed_chain_matches_plain_chain(spec: ChainSpec) -> None:
    """Invariants 1, 4, 5: any checkpointing of any chain gives the plain grads bit for bit,
    with region outputs changed in place afterwards, a subclass input, or a float64 default
    dtype in the forward pass only."""
    actual, expected = checkpointed_and_plain_run_alike(spec)
    # The caller's random stream is not shifted by recomputation (replayed, then restored).
    assert torch.equal(actual["rng_after"], expected["rng_after"])


@settings(max_examples=30, deadline=None)
@given(
    chain_specs(
        activations=st.sampled_from(sorted(SAVES_OWN_OUTPUT)),
        dropouts=st.just(0.0),
        region_policies=keeping_policies,
        region_scales=st.sampled_from([0.5, 3.0]),
    )
)
def test_random_chain_whose_kept_outputs_change_after_their_regions_matches_plain_chain(
    spec: ChainSpec,
) -> None:
    """Invariant 1: a region output that the policy kept (or offloaded) and that its own backward
    needs (relu, sigmoid, tanh), multiplied in place after the region returned, gives the plain
    grads bit for bit: the engine runs the op again instead of handing back the changed value.

    The chains above draw this case too, but rarely (dropout, other activations and policies
    that recompute hide it); here every region output is rescaled, under keeping policies.
    """
    checkpointed_and_plain_run_alike(spec)


@settings(max_examples=25, deadline=None)
@given(chain_specs())
def test_random_chain_backward_twice_accumulates_exactly_twice(spec: ChainSpec) -> None:
    """Invariants 5 and 6: retain_graph=True, backward twice: exactly 2x the plain grads.

    The second backward cannot reuse kept outputs (handed out to the first): it recomputes them,
    also those changed in place after their region.
    """
    note_coverage(spec)
    expected = run(spec, checkpointing=False)
    actual = run(spec, checkpointing=True, backward_passes=2)
    doubled = {k: None if g is None else 2 * g for k, g in expected["grads"].items()}
    assert_identical(actual["grads"], doubled, "grads")
    expected_input_grad = None if expected["input_grad"] is None else 2 * expected["input_grad"]
    assert_identical(actual["input_grad"], expected_input_grad, "input grad")


def assert_same_metadata(actual: Any, expected: Any, what: str) -> None:
    """Same structure, and tensors (or None) in the same places with the same shape, dtype,
    device: all there is to compare of meta tensors."""
    actual_leaves = dict(flatten_named(actual))
    expected_leaves = dict(flatten_named(expected))
    assert actual_leaves.keys() == expected_leaves.keys(), what
    for path, expected_leaf in expected_leaves.items():
        actual_leaf = actual_leaves[path]
        label = f"{what}{'/' + path if path else ''}"
        if expected_leaf is None or actual_leaf is None:
            assert actual_leaf is expected_leaf, f"{label}: {actual_leaf!r} vs {expected_leaf!r}"
            continue
        assert type(actual_leaf) is torch.Tensor, f"{label}: {type(actual_leaf).__name__}"
        assert (actual_leaf.shape, actual_leaf.dtype, actual_leaf.device) == (
            expected_leaf.shape,
            expected_leaf.dtype,
            expected_leaf.device,
        ), f"{label}: {actual_leaf!r} vs {expected_leaf!r}"


@settings(max_examples=25, deadline=None)
@given(chain_specs(ambients=("meta-device",)))
def test_random_chain_on_meta_device_gives_the_plain_shapes_dtypes_and_devices(
    spec: ChainSpec,
) -> None:
    """Invariants 5 and 7: built and run forward in a ``torch.device("meta")`` context that
    backward runs outside of, a checkpointed chain whose blocks make factory tensors recomputes
    without a mismatch (the factory tensors are made on meta again, not on the CPU), and its
    output and every gradient have the plain chain's shape, dtype and device (meta)."""
    note_coverage(spec)
    expected = run(spec, checkpointing=False)
    actual = run(spec, checkpointing=True)
    assert expected["output"].device.type == "meta"
    for key in ("output", "input_grad", "grads"):
        assert_same_metadata(actual[key], expected[key], key)
    # The CPU random stream is the caller's too (meta ops draw nothing, replay must not either).
    assert torch.equal(actual["rng_after"], expected["rng_after"])
