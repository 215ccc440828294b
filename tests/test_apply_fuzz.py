"""Fuzzing (issue 27, item 2): random models under random plans train as the plain model.

Hypothesis draws a model: a chain of 2-5 blocks over a ``(batch, sequence, width)`` hidden
state, each block 1-3 layers from a library of real ones (``nn.Linear``, ``nn.Conv1d``,
``nn.Conv2d``, ``nn.LayerNorm``, ``nn.BatchNorm1d`` in train mode, ``nn.Dropout(0.3)``,
causal ``scaled_dot_product_attention`` with dropout, ``nn.MultiheadAttention`` with dropout,
GELU, a feature permutation by views, reshape and transpose, and the in-place
``nn.ReLU(inplace=True)`` and ``x.mul_(0.5)``), shaped as a plain chain, a residual block
(``x + body(x)``), two paths merged (``body(x) * sigmoid(other(x))``) or a block calling its
one body twice; returning a tensor, a tuple ``(hidden, aux, "aux")`` or a dict
``{"hidden": ..., "aux": ...}`` (the model adds the aux losses to its output); some blocks
frozen, some ending in a projection whose weight is shared with another block; every block
given a gate computed outside the blocks from a parameter (a keyword argument) or not; the input
requiring grad or not; float32 or float64.

How the model is checkpointed (``InstallSpec``): a plan from ``gradckpt.solve`` on a
``gradckpt.profile`` of another instance of the model, with a random strategy and a random
budget between the least that strategy reaches and a bit above the plain peak, installed with
``gradckpt.apply``; a hand-made ``Plan`` of random segments (nested, with op-level policies:
presets and ``save-ops:``/``offload-ops:`` lists) through ``gradckpt.apply``; random segments
with policies giving each op a random ``Fate`` through the engine's
``checkpoint_segments``; ``gradckpt.checkpoint_module`` on random blocks with such policies,
beside a hand-made plan or alone; ``gradckpt.enable`` with a random strategy and budget (bytes
or a percentage). Strategy plans and ``enable`` plan for a step with no optimizer, SGD or AdamW.

Invariants, for every draw:

- Invariant 1/2: output, input and parameter gradients, buffers (BatchNorm's running
  statistics) and the CPU random stream after each of two steps equal the plain model's from
  the same seed, ``torch.equal`` (CPU float32 and float64 ops are deterministic).
- Invariant 3: a forward pass without grad gives the plain output.
- Nothing left behind: once the plan is taken off (``gradckpt.disable``, the handle's
  ``remove()``, ``gradckpt.uncheckpoint_module``), every module's class, hooks and
  ``vars(module)`` entries are the ones it had before, no saved-tensor hooks or dispatch modes
  are on, gradckpt's thread-local and module-level state is idle, and the model trains its next
  step as its plain twin does.
- A budget between the least a strategy reaches and the plain peak gives a plan within it.
- Failure safety: an exception (a ``RuntimeError``) or a ``KeyboardInterrupt`` raised by a
  block on its k-th call (in the forward pass or in its recomputation in backward) or by a
  tensor hook in backward propagates unchanged (the very object raised), torch has no
  saved-tensor hook or mode of the plan's on; afterwards nothing is left behind, the same
  model with its plan put back trains as its plain copy, and a fresh model likewise.

CI (``CI`` set) runs ``EXAMPLES_IN_CI`` examples per test, derandomized (the ``ci`` profile in
``conftest.py``); ``GRADCKPT_FUZZ_LONG=1`` runs ``EXAMPLES_LONG``.
"""

from __future__ import annotations

import copy
import functools
import importlib
import math
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from engine_models import assert_identical, buffers, gradients
from hypothesis import assume, event, given, note, settings
from hypothesis import strategies as st
from torch import nn

import gradckpt
from gradckpt import Fate
from gradckpt.engine import checkpoint_segments, debug, suspension, tensors
from gradckpt.plan import Plan, Segment

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

EXAMPLES_IN_CI = 60
EXAMPLES_LONG = 1000
EXAMPLES = EXAMPLES_LONG if os.environ.get("GRADCKPT_FUZZ_LONG") == "1" else EXAMPLES_IN_CI

# What apply installed, per model (the module's: ``gradckpt.apply`` is the function).
_installed = importlib.import_module("gradckpt.apply")._installed

BATCH = 2


# ---- the library of layers ------------------------------------------------------------------


class OverChannels(nn.Module):
    """A channel-first layer (Conv1d, BatchNorm1d; Conv2d on a ``(batch, width, seq, 1)``
    image) applied to the ``(batch, seq, width)`` hidden state through transposed views."""

    def __init__(self, layer: nn.Module, image: bool = False) -> None:
        super().__init__()
        self.layer = layer
        self.image = image

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        channels_first = x.transpose(1, 2)
        if self.image:
            return self.layer(channels_first.unsqueeze(-1)).squeeze(-1).transpose(1, 2)
        return self.layer(channels_first).transpose(1, 2)


class Attention(nn.Module):
    """Causal self-attention through ``F.scaled_dot_product_attention``, with dropout."""

    def __init__(self, width: int, heads: int = 2, dropout: float = 0.2) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, width = x.shape
        q, k, v = (t.unflatten(-1, (self.heads, -1)).transpose(1, 2)
                   for t in self.qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(batch, seq, width))


class SelfAttention(nn.Module):
    """``nn.MultiheadAttention`` over the hidden state, with dropout."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.attention = nn.MultiheadAttention(width, 2, dropout=0.2, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attention(x, x, x, need_weights=False)[0]


class PermuteFeatures(nn.Module):
    """The features in another order, by views, a transpose and a reshape (a copy)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.unflatten(-1, (2, -1)).transpose(-1, -2).reshape(x.shape)


class HalveInPlace(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.mul_(0.5)


LAYERS: dict[str, Callable[[int], nn.Module]] = {
    "linear": lambda width: nn.Linear(width, width),
    "conv1d": lambda width: OverChannels(nn.Conv1d(width, width, 3, padding=1)),
    "conv2d": lambda width: OverChannels(nn.Conv2d(width, width, (3, 1), padding=(1, 0)),
                                         image=True),
    "layernorm": nn.LayerNorm,
    "batchnorm": lambda width: OverChannels(nn.BatchNorm1d(width)),
    "dropout": lambda width: nn.Dropout(0.3),
    "sdpa": Attention,
    "mha": SelfAttention,
    "gelu": lambda width: nn.GELU(),
    "permute": lambda width: PermuteFeatures(),
    "relu_": lambda width: nn.ReLU(inplace=True),
    "mul_": lambda width: HalveInPlace(),
}
IN_PLACE = ("relu_", "mul_")
# Layers whose output is a new tensor that no backward needs: only these may be changed in
# place next (in place on a block's input or on a tensor saved for backward fails plainly too).
FRESH = ("linear", "conv1d", "conv2d", "layernorm", "batchnorm", "dropout", "sdpa", "mha")
WITH_PARAMETERS = ("linear", "conv1d", "conv2d", "layernorm", "batchnorm", "sdpa", "mha")
NOT_IN_PLACE = tuple(kind for kind in LAYERS if kind not in IN_PLACE)


# ---- a tripwire: counts its calls, fails on one ---------------------------------------------


@dataclass
class Call:
    in_backward: bool  # a recomputation
    hook_fired: bool = False  # the counting hook on its input ran in backward


@dataclass
class Fault:
    """Raise ``error`` on call ``call`` (from 1) of a tripwire: there (``how="raise"``), or from
    a tensor hook on its input when backward reaches it (``how="hook"``)."""

    call: int
    how: str
    error: BaseException


class CallLog:
    def __init__(self) -> None:
        self.calls: list[Call] = []
        self.fault: Fault | None = None


def _raise(error: BaseException, gradient: torch.Tensor) -> None:
    raise error


def _fired(call: Call, gradient: torch.Tensor) -> None:
    call.hook_fired = True


class Tripwire(nn.Module):
    """The identity; logs every call, and where the input can carry a tensor hook (a forward
    pass with grad, outside backward) puts one on that logs that backward reached it, or the
    armed ``Fault``'s."""

    def __init__(self) -> None:
        super().__init__()
        self.log = CallLog()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        call = Call(in_backward=torch._C._current_graph_task_id() != -1)
        self.log.calls.append(call)
        fault = self.log.fault
        armed = fault is not None and fault.call == len(self.log.calls)
        if armed and fault.how == "raise":
            raise fault.error
        if x.requires_grad and torch.is_grad_enabled() and not call.in_backward:
            x.register_hook(functools.partial(_raise, fault.error) if armed
                            else functools.partial(_fired, call))
        return x


# ---- models ---------------------------------------------------------------------------------


@dataclass
class BlockSpec:
    layers: list[str]
    shape: str  # "chain", "residual", "two-paths", "twice"
    other_path: list[str]  # the second path of "two-paths"
    returns: str  # "tensor", "tuple", "dict"
    projection: bool  # ends in a Linear (tied to another block's, see ModelSpec.tied)
    frozen: bool
    tripwire_at: int  # the tripwire's place among the layers


@dataclass
class ModelSpec:
    width: int
    seq: int
    blocks: list[BlockSpec]
    tied: bool  # the first two blocks with a projection share its weight
    input_requires_grad: bool
    gated: bool  # every block also gets a keyword argument computed outside the blocks
    dtype: torch.dtype
    seed: int


class FuzzBlock(nn.Module):
    def __init__(self, spec: BlockSpec, width: int) -> None:
        super().__init__()
        self.shape = spec.shape
        self.returns = spec.returns
        layers = [LAYERS[kind](width) for kind in spec.layers]
        layers.insert(spec.tripwire_at, Tripwire())
        self.body = nn.Sequential(*layers)
        self.other = (nn.Sequential(*(LAYERS[kind](width) for kind in spec.other_path))
                      if spec.shape == "two-paths" else None)
        self.projection = nn.Linear(width, width) if spec.projection else None

    def forward(self, x: torch.Tensor, gate: torch.Tensor | None = None) -> Any:
        if self.shape == "residual":
            hidden = x + self.body(x)
        elif self.shape == "two-paths":
            hidden = self.body(x) * torch.sigmoid(self.other(x))
        elif self.shape == "twice":
            hidden = self.body(self.body(x))
        else:
            hidden = self.body(x)
        if self.projection is not None:
            hidden = self.projection(hidden)
        if gate is not None:
            hidden = hidden * gate
        if self.returns == "tuple":
            return hidden, hidden.pow(2).mean(), "aux"
        if self.returns == "dict":
            return {"hidden": hidden, "aux": hidden.pow(2).mean()}
        return hidden


class FuzzNet(nn.Module):
    def __init__(self, spec: ModelSpec) -> None:
        super().__init__()
        torch.manual_seed(spec.seed)
        self.blocks = nn.ModuleList(FuzzBlock(block, spec.width) for block in spec.blocks)
        # A side input of every block that needs grad: its gradient reaches this parameter
        # through every block, recomputed or not.
        self.gate = nn.Parameter(torch.randn(spec.width)) if spec.gated else None
        projected = [block for block in self.blocks if block.projection is not None]
        if spec.tied and len(projected) >= 2:
            projected[1].projection.weight = projected[0].projection.weight
        for block, block_spec in zip(self.blocks, spec.blocks, strict=True):
            if block_spec.frozen:
                block.requires_grad_(False)
        self.to(spec.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        aux = None
        gate = None if self.gate is None else torch.sigmoid(self.gate)
        for block in self.blocks:
            out = block(x) if gate is None else block(x, gate=gate)
            if isinstance(out, tuple):
                x, extra = out[0], out[1]
            elif isinstance(out, dict):
                x, extra = out["hidden"], out["aux"]
            else:
                x, extra = out, None
            if extra is not None:
                aux = extra if aux is None else aux + extra
        return x if aux is None else x + 0.1 * aux


def tripwires(model: FuzzNet) -> list[Tripwire]:
    return [module for module in model.modules() if isinstance(module, Tripwire)]


@st.composite
def layer_lists(draw: st.DrawFn) -> list[str]:
    """1-3 layers; an in-place one only right after a layer making a fresh tensor."""
    layers = [draw(st.sampled_from(NOT_IN_PLACE))]
    for _ in range(draw(st.integers(0, 2))):
        kinds = sorted(LAYERS) if layers[-1] in FRESH else NOT_IN_PLACE
        layers.append(draw(st.sampled_from(kinds)))
    return layers


@st.composite
def block_specs(draw: st.DrawFn) -> BlockSpec:
    layers = draw(layer_lists())
    return BlockSpec(
        layers=layers,
        shape=draw(st.sampled_from(["chain", "residual", "two-paths", "twice"])),
        other_path=draw(layer_lists()),
        returns=draw(st.sampled_from(["tensor", "tuple", "dict"])),
        projection=draw(st.booleans()),
        frozen=draw(st.integers(0, 3)) == 0,
        tripwire_at=draw(st.integers(0, len(layers))),
    )


def trains(block: BlockSpec) -> bool:
    """Whether the block has parameters that get gradients."""
    layers = [*block.layers, *(block.other_path if block.shape == "two-paths" else [])]
    return not block.frozen and (block.projection or bool(set(layers) & set(WITH_PARAMETERS)))


@st.composite
def model_specs(draw: st.DrawFn) -> ModelSpec:
    spec = ModelSpec(
        width=draw(st.sampled_from([4, 6, 8])),
        seq=draw(st.integers(2, 5)),
        blocks=draw(st.lists(block_specs(), min_size=2, max_size=5)),
        tied=draw(st.booleans()),
        input_requires_grad=draw(st.booleans()),
        gated=draw(st.booleans()),
        dtype=draw(st.sampled_from([torch.float32, torch.float64])),
        seed=draw(st.integers(0, 2**16)),
    )
    # Something to differentiate (a frozen first block keeps the rest trainable: invariant 4).
    assume(spec.input_requires_grad or spec.gated or any(map(trains, spec.blocks)))
    return spec


# ---- how the model is checkpointed ----------------------------------------------------------


class RandomFates:
    """A policy giving each op a fate drawn at random (hashed from the op and a salt): a pure
    function of the op, as a policy must be (test_engine_properties.RandomFates)."""

    def __init__(self, fates: list[Fate], salt: int) -> None:
        self.fates = fates
        self.salt = salt

    def __call__(self, op: Any, output: torch.Tensor) -> Fate:
        return self.fates[zlib.crc32(f"{self.salt}:{op}".encode()) % len(self.fates)]

    def __repr__(self) -> str:
        return f"RandomFates({[fate.name for fate in self.fates]}, salt={self.salt})"


OPS = ["aten.mm", "aten.addmm", "aten.bmm", "aten.gelu", "aten.native_layer_norm",
       "aten.convolution", "aten.native_batch_norm", "aten.native_dropout", "attention",
       "aten.sigmoid", "aten.mul"]

named_policies = st.one_of(
    st.none(),
    st.sampled_from(["save-matmuls", "offload-matmuls"]),
    st.builds(lambda prefix, ops: prefix + ",".join(sorted(ops)),
              st.sampled_from(["save-ops:", "offload-ops:"]),
              st.sets(st.sampled_from(OPS), min_size=1, max_size=4)),
)
random_fates = st.builds(RandomFates, st.lists(st.sampled_from(list(Fate)), min_size=1,
                                               max_size=3), st.integers(0, 1000))
any_policies = st.one_of(named_policies, random_fates)


@st.composite
def segment_lists(draw: st.DrawFn, start: int, end: int, policies: st.SearchStrategy,
                  nested: bool = False) -> list[Segment]:
    """Disjoint segments of blocks ``start..end``, each maybe with segments nested inside (two
    levels at most, never one the same as its parent); a policy only on a top-level segment
    without children (what ``apply`` accepts)."""
    segments, index = [], start
    while index <= end:
        if not draw(st.booleans()):
            index += 1
            continue
        last = draw(st.integers(index, end))
        children = []
        if not nested and draw(st.booleans()):
            children = [child for child in draw(segment_lists(index, last, policies, True))
                        if (child.start, child.end) != (index, last)]
        policy = None if nested or children else draw(policies)
        segments.append(Segment(index, last, children, policy))
        index = last + 1
    return segments


def flattened(segments: list[Segment]) -> list[Segment]:
    return [item for segment in segments for item in (segment, *flattened(segment.children))]


STRATEGY_NAMES = ["none", "every-layer", "sqrt", "chen-greedy", "optimal"]
INSTALLERS = ("enable", "strategy", "segments", "engine", "modules")


@dataclass
class InstallSpec:
    installer: str  # one of INSTALLERS
    strategy: str = "optimal"
    budget_fraction: float = 1.0  # of the way from the least peak to the plain one
    optimizer: str = "none"  # the optimizer of the step planned for
    percent: bool = False  # enable's budget given as a percentage of the plain peak
    segments: list[Segment] = field(default_factory=list)
    modules: dict[int, Any] = field(default_factory=dict)  # block -> checkpoint_module policy


@st.composite
def install_specs(draw: st.DrawFn, blocks: int, installers: tuple[str, ...] = INSTALLERS
                  ) -> InstallSpec:
    installer = draw(st.sampled_from(installers))
    spec = InstallSpec(installer)
    if installer in ("strategy", "enable"):
        spec.strategy = draw(st.sampled_from(STRATEGY_NAMES))
        spec.budget_fraction = draw(st.floats(0.0, 1.2))
        spec.optimizer = draw(st.sampled_from(["none", "sgd", "adamw"]))
        spec.percent = installer == "enable" and draw(st.booleans())
    elif installer == "segments":
        spec.segments = draw(segment_lists(0, blocks - 1, named_policies))
    elif installer == "engine":
        spec.segments = draw(segment_lists(0, blocks - 1, any_policies))
    else:
        assert installer == "modules"
        # Alone, or beside a plan's segments (inside one: the strict xfail at the end).
        spec.segments = draw(st.one_of(st.just([]), segment_lists(0, blocks - 1, st.none())))
        in_segments = {index for segment in spec.segments for index in segment.blocks()}
        free = [index for index in range(blocks) if index not in in_segments]
        if not free:
            spec.segments, free = [], list(range(blocks))
        chosen = draw(st.sets(st.sampled_from(free), min_size=1))
        spec.modules = {index: draw(any_policies) for index in sorted(chosen)}
    return spec


def loss_of(output: torch.Tensor) -> torch.Tensor:
    weights = torch.linspace(-1, 1, output.numel(), dtype=output.dtype)
    return (output * weights.view_as(output)).sum()


def sample(spec: ModelSpec) -> torch.Tensor:
    generator = torch.Generator().manual_seed(spec.seed + 1)
    x = torch.randn(BATCH, spec.seq, spec.width, generator=generator, dtype=spec.dtype)
    return x.requires_grad_(spec.input_requires_grad)


PROFILED = ("strategy", "enable")  # the installers that measure the model


def profile_fails_on(spec: ModelSpec) -> bool:
    """Whether ``gradckpt.profile`` fails on the model: the first block's output needs no
    grad, as neither its input, its gate nor its parameters (frozen, or none) do (the strict
    xfail at the end)."""
    return not (spec.input_requires_grad or spec.gated or trains(spec.blocks[0]))


def least_peak_bytes(profile: gradckpt.Profile, strategy: str) -> int:
    """The least peak ``strategy`` reaches: what ``BudgetError`` tells for a 1-byte budget."""
    with pytest.raises(gradckpt.BudgetError) as raised:
        gradckpt.solve(profile, 1, strategy)
    return raised.value.minimum_bytes


def budget_between(spec: ModelSpec, install: InstallSpec) -> tuple[gradckpt.Profile, int]:
    """The profile of another instance of the model, and a budget ``budget_fraction`` of the
    way from the least peak ``install.strategy`` reaches to the plain step's peak (above it for
    a fraction over 1)."""
    profile = gradckpt.profile(FuzzNet(spec), sample(spec), loss_fn=loss_of, repeats=1,
                               optimizer=install.optimizer)
    least = least_peak_bytes(profile, install.strategy)
    return profile, least + int(install.budget_fraction * max(profile.peak_bytes - least, 0))


def planned(spec: ModelSpec, install: InstallSpec) -> Plan:
    """The plan ``install.strategy`` makes for the budget drawn: a budget between the least
    and the plain peak must give a plan within it."""
    profile, budget = budget_between(spec, install)
    plan = gradckpt.solve(profile, budget, install.strategy)
    assert plan.predicted_peak_bytes <= budget
    return plan


def hand_made(model: FuzzNet, segments: list[Segment]) -> Plan:
    names = [name for name, _ in gradckpt.find_blocks(model)]
    assert names == [f"blocks.{index}" for index in range(len(model.blocks))]
    return Plan("fuzz", None, copy.deepcopy(segments), 0, 0.0, 0.0, block_names=names)


class Installer:
    """Installs ``InstallSpec`` on models; ``install(model)`` returns what takes it off. The
    plan of a strategy, or the one ``enable`` made, is applied again as it is."""

    def __init__(self, spec: ModelSpec, install: InstallSpec) -> None:
        self.spec = spec
        self.install_spec = install
        self.plan: Plan | None = planned(spec, install) if install.installer == "strategy" else None

    def install(self, model: FuzzNet) -> Callable[[], None]:
        install = self.install_spec
        if install.installer == "enable" and self.plan is None:
            profile, budget = budget_between(self.spec, install)
            # As a percentage of the plain peak (at most 100%), rounded up: still feasible.
            percent = f"{math.ceil(100 * budget / profile.peak_bytes)}%"
            as_percent = install.percent and budget <= profile.peak_bytes
            self.plan = gradckpt.enable(model, sample(self.spec),
                                        budget=percent if as_percent else budget,
                                        strategy=install.strategy, loss_fn=loss_of,
                                        optimizer=install.optimizer)
            assert self.plan.predicted_peak_bytes <= self.plan.budget_bytes
            assert self.plan.budget_bytes >= budget
            return functools.partial(gradckpt.disable, model)
        if self.plan is not None:
            gradckpt.apply(model, self.plan)
            return functools.partial(gradckpt.disable, model)
        if install.installer == "engine":
            segments = flattened(install.segments)
            handle = checkpoint_segments(
                list(model.blocks), [(s.start, s.end) for s in segments],
                policies=[s.policy for s in segments])
            return handle.remove
        # "segments", "modules": a hand-made plan, then (for "modules") the module form.
        gradckpt.apply(model, hand_made(model, install.segments))
        for index, policy in install.modules.items():
            gradckpt.checkpoint_module(model.blocks[index], policy=policy)

        def remove() -> None:
            for index in install.modules:
                gradckpt.uncheckpoint_module(model.blocks[index])
            gradckpt.disable(model)

        return remove


# ---- running and comparing ------------------------------------------------------------------


def step(model: FuzzNet, spec: ModelSpec, seed: int = 2) -> dict[str, Any]:
    """One training step's results: from no gradients, under one seed for dropout."""
    model.zero_grad(set_to_none=True)
    x = sample(spec)
    torch.manual_seed(seed)
    output = model(x)
    loss_of(output).backward()
    return {"output": output.detach(), "input grad": x.grad, "grads": gradients(model),
            "buffers": buffers(model), "rng after": torch.get_rng_state()}


def output_without_grad(model: FuzzNet, spec: ModelSpec) -> torch.Tensor:
    with torch.no_grad():
        torch.manual_seed(5)
        return model(sample(spec))


def assert_same_step(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    for key, value in expected.items():
        assert_identical(actual[key], value, key)


def _identity(value: Any) -> Any:
    """What identifies an attribute's value: plain values themselves, containers by what
    they hold, anything else by ``id`` (a hook function, a tensor, a submodule)."""
    if isinstance(value, (bool, int, float, str, type(None))):
        return value
    if isinstance(value, dict):
        return tuple((key, _identity(item)) for key, item in value.items())
    if isinstance(value, (list, tuple, set)):
        return (type(value), tuple(id(item) for item in value))
    return id(value)


def module_state(model: nn.Module) -> dict[str, Any]:
    """Every module's class and attributes (hooks, parameters, buffers, submodules included)."""
    return {name: (type(module), {key: _identity(value) for key, value in vars(module).items()})
            for name, module in model.named_modules()}


def torch_state() -> dict[str, Any]:
    """torch's grad mode, saved-tensor hooks and modes on this thread."""
    return {
        "grad": torch.is_grad_enabled(),
        "saved tensors hooks": torch._C._autograd._top_saved_tensors_default_hooks(True),
        "dispatch modes": torch._C._len_torch_dispatch_stack(),
        "function modes": torch._C._len_torch_function_stack(),
    }


def global_state() -> dict[str, Any]:
    """``torch_state``; gradckpt's thread-local and module-level state."""
    return {
        **torch_state(),
        "engine internal work": tensors._internal_work.active,
        "debug": debug._debug_state.enabled,
        "suspended": dict(suspension._suspended.counts),
        "segment handles": {id(handle) for handle in suspension._segment_handles},
        "installed": {id(model) for model in _installed.keys()},
    }


# Plans on models of earlier examples that the garbage collector has not taken yet may go
# meanwhile: of these, nothing may come.
ONLY_FEWER = ("segment handles", "installed")


def assert_nothing_left(model: FuzzNet, model_before: dict, globals_before: dict) -> None:
    after = module_state(model)
    for name, state in model_before.items():
        assert after[name] == state, name
    assert not gradckpt.is_checkpointed(model)
    assert gradckpt.get_plan(model) is None
    globals_after = global_state()
    for key, value in globals_before.items():
        if key in ONLY_FEWER:
            assert globals_after[key] <= value, key
        else:
            assert globals_after[key] == value, key


def drawn_case(data: st.DataObject) -> tuple[ModelSpec, InstallSpec]:
    """A model and how it is checkpointed, noted for a failure's report and
    ``--hypothesis-show-statistics``."""
    spec = data.draw(model_specs(), label="model")
    install = data.draw(install_specs(len(spec.blocks)), label="install")
    assume(install.installer not in PROFILED or not profile_fails_on(spec))
    event(f"installed by: {install.installer}")
    kinds = {kind for block in spec.blocks for kind in block.layers}
    if kinds & set(IN_PLACE):
        event("an in-place layer")
    note(f"install: {install}")
    return spec, install


# ---- the properties -------------------------------------------------------------------------


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.data())
def test_a_random_model_under_a_random_plan_trains_as_the_plain_model(data: st.DataObject
                                                                      ) -> None:
    """Invariants 1 and 2: with any plan, a random model's output, gradients, buffers and
    random stream after each of two steps are the plain model's bit for bit, and so is a
    forward pass without grad (invariant 3); once the plan is taken off the model has the
    hooks, classes and attributes it had, no saved-tensor hook or engine state is left on, and
    its next step is its plain twin's."""
    spec, install = drawn_case(data)
    plain, model = FuzzNet(spec), FuzzNet(spec)
    model_before, globals_before = module_state(model), global_state()
    remove = Installer(spec, install).install(model)
    for seed in (2, 3):  # two steps: running statistics from a planned step on
        assert_same_step(step(model, spec, seed), step(plain, spec, seed))
    # Invariant 3: without grad the plan does nothing (BatchNorm's statistics are compared
    # after the next step).
    assert_identical(output_without_grad(model, spec), output_without_grad(plain, spec))
    remove()
    assert_nothing_left(model, model_before, globals_before)
    assert_same_step(step(model, spec, seed=4), step(plain, spec, seed=4))


ERRORS: dict[str, Callable[[str], BaseException]] = {
    "exception": RuntimeError,
    "interrupt": KeyboardInterrupt,
}


WHERE = {
    # where the fault strikes: how the tripwire fails, and which of its calls may
    "forward": "raise",
    "recomputation": "raise",
    "tensor hook in backward": "hook",
}


def fault_calls(log: CallLog, where: str) -> list[int]:
    """The calls (from 1) of a tripwire where a fault ``where`` surely strikes: a forward
    call, a call in backward (a recomputation), or a forward call whose input's hook backward
    reached."""
    return [number for number, call in enumerate(log.calls, start=1)
            if (call.in_backward if where == "recomputation"
                else not call.in_backward and (where == "forward" or call.hook_fired))]


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.data())
def test_an_error_in_a_random_planned_step_propagates_and_leaves_nothing(
        data: st.DataObject) -> None:
    """Failure safety: an exception or a ``KeyboardInterrupt`` raised by a block on its k-th
    call (forward or recomputation) or by a tensor hook in backward reaches the caller as it
    was raised; with the plan taken off nothing is left behind; the same model with the plan
    put back then trains as its plain copy does, and so does a fresh model."""
    spec, install = drawn_case(data)
    installer = Installer(spec, install)
    model = FuzzNet(spec)
    model_before, globals_before = module_state(model), global_state()
    remove = installer.install(model)
    for wire in tripwires(model):
        wire.log.calls.clear()  # enable ran the model
    step(model, spec)  # a step without fault: the calls each tripwire sees
    where = data.draw(st.sampled_from(sorted(WHERE)), label="where")
    wires = [wire for wire in tripwires(model) if fault_calls(wire.log, where)]
    assume(wires)  # no recomputation in a plan without segments
    wire = data.draw(st.sampled_from(wires), label="tripwire")
    number = data.draw(st.sampled_from(fault_calls(wire.log, where)), label="call")
    # An interrupt on a third of the draws: Hypothesis favours a list's first item.
    kind = data.draw(st.sampled_from(["interrupt", "exception", "exception"]), label="error")
    event(f"fault: {kind} in {where}")
    error = ERRORS[kind](f"injected: {kind} in {where}")
    wire.log.calls.clear()
    wire.log.fault = Fault(number, WHERE[where], error)
    with pytest.raises(type(error)) as raised:
        step(model, spec)
    assert raised.value is error
    # Nothing of the plan's is on in torch, while the plan stays installed.
    assert torch_state() == {key: globals_before[key] for key in torch_state()}
    raised = None  # its traceback holds the step's tensors
    wire.log.fault = None
    remove()
    assert_nothing_left(model, model_before, globals_before)
    # The same model, the plan put back, trains as its plain copy (the failed forward has moved
    # BatchNorm's running statistics: the copy starts from where the model is).
    twin = copy.deepcopy(model)
    remove = installer.install(model)
    assert_same_step(step(model, spec), step(twin, spec))
    # And a fresh model with the plan trains as a fresh plain one.
    fresh = FuzzNet(spec)
    remove_fresh = installer.install(fresh)
    assert_same_step(step(fresh, spec), step(FuzzNet(spec), spec))
    remove_fresh()
    remove()


def test_a_block_of_a_planned_segment_cannot_also_be_checkpointed_as_a_module() -> None:
    """``checkpoint_module`` wraps a block's whole call, a segment's hooks included, so a
    segment cannot hold such a block (the two regions would nest one way in the forward pass
    and the other in recomputation): either order is refused with what to do, the plan and
    the model left as they were; a module inside the block nests as any region does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.ReLU()), nn.Linear(4, 4))
    x = torch.randn(2, 4, requires_grad=True)
    model(x).sum().backward()
    expected = gradients(model)
    model.zero_grad(set_to_none=True)
    plan = Plan("fuzz", None, [Segment(0, 0)], 0, 0.0, 0.0, block_names=["0", "1"])
    gradckpt.apply(model, plan)
    with pytest.raises(gradckpt.UsageError, match="a block of a segment of the plan applied"):
        gradckpt.checkpoint_module(model[0])
    assert type(model[0]) is nn.Sequential  # not checkpointed as a module
    gradckpt.disable(model)
    gradckpt.checkpoint_module(model[0])
    with pytest.raises(gradckpt.UsageError, match="'0' is checkpointed by gradckpt.checkpoint_mo"):
        gradckpt.apply(model, plan)
    assert gradckpt.get_plan(model) is None
    gradckpt.uncheckpoint_module(model[0])
    gradckpt.apply(model, plan)
    gradckpt.checkpoint_module(model[0][0])  # inside the block: nested regions
    try:
        model(x).sum().backward()
    finally:
        gradckpt.uncheckpoint_module(model[0][0])
        gradckpt.disable(model)
    assert_identical(gradients(model), expected, "grads")


def test_a_chain_whose_first_block_is_frozen_can_be_profiled() -> None:
    """Frozen parameters are ordinary inputs: ``profile`` measures a chain whose first block
    is frozen, its input needing no grad (frozen embeddings, a frozen first layer)."""
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    model[0].requires_grad_(False)
    measured = gradckpt.profile(model, torch.randn(2, 4), repeats=1)
    assert [block.name for block in measured.blocks] == ["0", "1"]
