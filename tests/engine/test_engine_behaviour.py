"""Behaviour of the checkpoint engine beyond numerical equality (docs/engine.md, invariants).

- invariant 3: without grad the engine does nothing (no hooks, no dispatch mode, one call);
- invariant 6: recomputation stops after the last saving op and runs once per backward;
- invariant 7: a recomputation that differs raises ``CheckpointError`` naming the region and
  the tensor; ``debug_mode()`` shows the first differing op and where it was called;
- the caller's random stream, module hooks, the module form (``checkpoint_module``,
  ``uncheckpoint_module``, deepcopy, ``torch.save``), policies' contract and bad input.
"""

from __future__ import annotations

import copy
import io
import itertools
import pathlib
import re
from typing import Any

import pytest
import torch
import torch.nn.functional as F
from engine_models import CallCounter, assert_identical, gradients
from torch import nn

import gradckpt
from gradckpt import CheckpointError, Fate, GradckptError, UsageError
from gradckpt.measure import MemoryMeter

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

THIS_FILE = pathlib.Path(__file__)


def line_of(marker: str) -> int:
    """The line number of the (single) line of this file that ends with ``# <marker>``."""
    lines = [
        number
        for number, text in enumerate(THIS_FILE.read_text().splitlines(), start=1)
        if text.rstrip().endswith(f"# {marker}")
    ]
    assert len(lines) == 1, (marker, lines)
    return lines[0]


class Switchable(nn.Module):
    """Linear, dropout, ReLU -- and, on demand, a recomputation that differs from the forward.

    Odd calls are forward passes, even calls recomputations (one of each per training step).
    """

    def __init__(self, width: int = 8, variant: str = "stable") -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
        self.dropout = nn.Dropout(0.3)
        self.calls = 0
        self.variant = variant

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.dropout(self.linear(x))
        if self.variant == "stable" or self.calls % 2 == 1:
            return torch.relu(h)  # forward-branch
        if self.variant == "shape":
            return torch.relu(h[:, :4])  # recompute-shape-branch
        if self.variant == "dtype":
            return torch.relu(h.double())
        if self.variant == "fewer":
            return h * 2.0  # multiplying by a number saves nothing: one saved tensor fewer
        if self.variant == "op":
            return torch.sigmoid(h)  # recompute-op-branch
        raise AssertionError(self.variant)


def make_block(variant: str = "stable") -> Switchable:
    torch.manual_seed(0)
    return Switchable(variant=variant)


def block_input() -> torch.Tensor:
    return torch.randn(4, 8, generator=torch.Generator().manual_seed(1)).requires_grad_()


def step(module: nn.Module, x: torch.Tensor | None = None, seed: int = 3) -> dict:
    x = block_input() if x is None else x
    torch.manual_seed(seed)
    y = module(x)
    y.square().sum().backward()
    return {"output": y.detach(), "input_grad": x.grad, "grads": gradients(module)}


# ---------------------------------------------------------------------------------------------
# Invariant 3: without grad the engine does nothing
# ---------------------------------------------------------------------------------------------


def _probe() -> tuple[Any, int]:
    """What the engine would have installed: saved-tensor hooks and dispatch modes."""
    return (
        torch._C._autograd._top_saved_tensors_default_hooks(False),
        torch._C._len_torch_dispatch_stack(),
    )


class AskLog:
    """A policy that records every question it is asked."""

    def __init__(self, fate: Fate = Fate.KEEP) -> None:
        self.fate = fate
        self.asked: list[tuple[Any, torch.Tensor]] = []

    def __call__(self, op: Any, output: torch.Tensor) -> Fate:
        self.asked.append((op, output))
        return self.fate


@pytest.mark.parametrize("no_grad", [torch.no_grad, torch.inference_mode])
@pytest.mark.parametrize("debug", [False, True], ids=["", "debug"])
def test_without_grad_the_engine_does_nothing(no_grad: Any, debug: bool) -> None:
    """Invariant 3: fn called once, no saved-tensor hooks, no dispatch mode, policy not asked."""
    torch.manual_seed(0)
    linear = nn.Linear(8, 8)
    probes: list[tuple[Any, int]] = []
    policy = AskLog()

    def region(x: torch.Tensor, *, scale: float) -> torch.Tensor:
        probes.append(_probe())
        return torch.tanh(linear(x)) * scale

    x = block_input()
    with no_grad(), gradckpt.debug_mode(debug):
        expected = torch.tanh(linear(x)) * 0.5
        y = gradckpt.checkpoint(region, x, policy=policy, scale=0.5)
    assert probes == [(None, 0)]
    assert policy.asked == []
    assert y.grad_fn is None and not y.requires_grad
    assert torch.equal(y, expected)


def test_the_probe_sees_the_engine_when_grad_is_enabled() -> None:
    """Control for the test above: with grad the same probe does see hooks and the policy."""
    probes: list[tuple[Any, int]] = []
    policy = AskLog()

    def region(x: torch.Tensor) -> torch.Tensor:
        probes.append(_probe())
        return x.sin()

    gradckpt.checkpoint(region, block_input(), policy=policy)
    ((hooks, modes),) = probes
    assert hooks is not None and modes >= 1
    assert [op for op, _ in policy.asked] == [torch.ops.aten.sin.default]


@pytest.mark.parametrize("no_grad", [torch.no_grad, torch.inference_mode])
def test_without_grad_a_checkpointed_module_runs_exactly_like_the_plain_one(no_grad: Any) -> None:
    """Invariant 3 (module form): same output, one call, same peak memory as unwrapped."""
    plain, checkpointed = make_block(), make_block()
    gradckpt.checkpoint_module(checkpointed, policy="save-matmuls")
    # An input without grad, as in inference (MemTracker's module hooks fail under
    # inference_mode on inputs that require grad).
    x = block_input().detach()
    peaks = []
    for module in (plain, checkpointed):
        module.eval()
        with MemoryMeter("cpu", module, x) as meter, no_grad():
            y = module(x)
        peaks.append(meter.peak())
        assert y.grad_fn is None
        assert module.calls == 1
    assert peaks[0] == peaks[1]
    with no_grad():
        assert torch.equal(plain(x), checkpointed(x))


# ---------------------------------------------------------------------------------------------
# Invariant 6: recomputation stops early and runs once per backward
# ---------------------------------------------------------------------------------------------


class Tail(nn.Module):
    """Ops that save nothing for backward (adding and scaling by numbers); counts its calls."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return (x + 1.0) * 3.0


@pytest.mark.parametrize("policy", [None, "save-matmuls", "offload-matmuls"])
def test_recomputation_stops_after_the_last_saving_op(policy: str | None) -> None:
    """Invariant 6: ops after the last one that saves a tensor are not run in recomputation."""
    torch.manual_seed(0)
    head, tail = CallCounter(), Tail()
    region = nn.Sequential(head, nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8), tail)
    plain = copy.deepcopy(region)
    x = block_input()
    y = gradckpt.checkpoint(region, x, policy=policy)
    assert (head.calls, tail.calls) == (1, 1)
    y.square().sum().backward()
    assert head.calls == 2  # the region was recomputed ...
    assert tail.calls == 1  # ... but not its tail, which saves nothing
    expected = step(plain, block_input())
    assert_identical(gradients(region), expected["grads"], "grads")
    assert_identical(x.grad, expected["input_grad"], "input grad")


def test_recomputation_runs_the_region_once_per_backward() -> None:
    """Invariant 6: one recomputation per backward, however many tensors it unpacks."""
    counter = CallCounter()
    torch.manual_seed(0)
    region = nn.Sequential(
        counter, *(layer for _ in range(4) for layer in (nn.Linear(8, 8), nn.Tanh()))
    )
    y = gradckpt.checkpoint(region, block_input())
    loss = y.square().sum()
    assert counter.calls == 1
    loss.backward(retain_graph=True)
    assert counter.calls == 2
    loss.backward(retain_graph=True)
    assert counter.calls == 3
    torch.autograd.grad(loss, [region[1].weight])
    assert counter.calls == 4


def test_nested_regions_run_a_bounded_number_of_times() -> None:
    """Invariant 6 with nesting (rule R3): per step the outer region runs twice (forward,
    recomputation) and the inner one three times (forward, inside the outer recomputation,
    its own recomputation)."""
    torch.manual_seed(0)
    outer_counter, inner_counter = CallCounter(), CallCounter()
    inner = nn.Sequential(inner_counter, nn.Linear(8, 8), nn.GELU())
    first = nn.Linear(8, 8)

    def outer(x: torch.Tensor) -> torch.Tensor:
        outer_counter(x)
        return torch.tanh(gradckpt.checkpoint(inner, torch.sigmoid(first(x))))

    y = gradckpt.checkpoint(outer, block_input())
    y.square().sum().backward()
    assert (outer_counter.calls, inner_counter.calls) == (2, 3)


# ---------------------------------------------------------------------------------------------
# Invariant 7: a differing recomputation is an error, never a wrong gradient
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("variant", "describes"),
    [
        ("shape", ["float32[4, 8]", "float32[4, 4]"]),
        ("dtype", ["float32[4, 8]", "float64[4, 8]"]),
        ("fewer", ["saved 3 tensors", "saved 4"]),  # x, weight, dropout mask (, relu output)
        ("op", []),  # same shapes and dtypes, a different operation
    ],
)
def test_differing_recomputation_raises_checkpoint_error(variant: str, describes: list) -> None:
    """Invariant 7: CheckpointError naming the region and describing the mismatching tensor."""
    block = gradckpt.checkpoint_module(make_block(variant), name="encoder.layer3")
    y = block(block_input())
    with pytest.raises(CheckpointError) as error:
        y.square().sum().backward()
    message = str(error.value)
    assert "encoder.layer3" in message
    for text in describes:
        assert text in message
    assert "debug_mode" in message  # says how to find out more
    assert isinstance(error.value, RuntimeError) and isinstance(error.value, GradckptError)


_global_calls = {"count": 0}


def _branches_on_a_global_counter(x: torch.Tensor) -> torch.Tensor:
    _global_calls["count"] += 1
    if _global_calls["count"] == 1:
        return torch.exp(x)
    return torch.exp(x[:2])


def test_function_that_branches_on_a_global_counter_raises() -> None:
    """Invariant 7: the functional form; the default region name is the function's name."""
    _global_calls["count"] = 0
    y = gradckpt.checkpoint(_branches_on_a_global_counter, block_input())
    with pytest.raises(CheckpointError, match="_branches_on_a_global_counter") as error:
        y.sum().backward()
    assert "float32[4, 8]" in str(error.value) and "float32[2, 8]" in str(error.value)


def test_default_region_name_of_a_module_is_its_own_class_name() -> None:
    """Invariant 7 + checkpoint_module docs: without name=, errors name the module's class as
    the user wrote it (and as ``repr`` shows it), not the generated wrapper class."""
    block = gradckpt.checkpoint_module(make_block("shape"))
    y = block(block_input())
    with pytest.raises(CheckpointError) as error:
        y.square().sum().backward()
    assert "'Switchable'" in str(error.value)


@pytest.mark.parametrize("policy", [None, "save-matmuls"])
def test_debug_mode_shows_the_first_differing_op_and_where_it_ran(policy: str | None) -> None:
    """Invariant 7 under ``debug_mode()`` (with and without a policy): the message shows the
    first op that differed, with the line of this file each was called from."""
    block = gradckpt.checkpoint_module(make_block("shape"), policy=policy, name="stage2")
    with gradckpt.debug_mode():
        y = block(block_input())
    with pytest.raises(CheckpointError) as error:
        y.square().sum().backward()
    message = str(error.value)
    assert "stage2" in message
    first_difference = message[message.index("First operation that differed") :]
    forward_line = re.search(r"forward:\s+(\S+)\s+\((.*)\)", first_difference)
    recompute_line = re.search(r"recomputation:\s+(\S+)\s+\((.*)\)", first_difference)
    assert forward_line and recompute_line, message
    assert forward_line.group(1) == "aten.relu.default"
    assert recompute_line.group(1) == "aten.slice.Tensor"
    assert f"{THIS_FILE.name}:{line_of('forward-branch')}" in forward_line.group(2)
    assert f"{THIS_FILE.name}:{line_of('recompute-shape-branch')}" in recompute_line.group(2)


def test_debug_mode_with_a_policy_catches_a_different_op_of_the_same_shape() -> None:
    """Invariant 7: with a policy the engine sees the op sequence; debug_mode says where."""
    block = gradckpt.checkpoint_module(make_block("op"), policy="save-matmuls", name="stage3")
    with gradckpt.debug_mode():
        y = block(block_input())
    with pytest.raises(CheckpointError) as error:
        y.square().sum().backward()
    message = str(error.value)
    assert "stage3" in message and "aten.sigmoid" in message and "aten.relu" in message
    assert f"{THIS_FILE.name}:{line_of('recompute-op-branch')}" in message


def test_debug_mode_does_not_change_results() -> None:
    """debug_mode only records: the grads stay bit-identical to the plain module's."""
    expected = step(make_block())
    block = gradckpt.checkpoint_module(make_block(), policy="save-matmuls")
    with gradckpt.debug_mode():
        actual = step(block)
    assert_identical(actual, expected, "debug-mode step")


# ---------------------------------------------------------------------------------------------
# RNG: recomputation does not shift the caller's random stream (invariants 1, 2)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", [None, "save-matmuls"])
def test_global_rng_state_after_a_step_is_the_plain_steps(policy: str | None) -> None:
    """After a checkpointed step (dropout inside) the CPU RNG is where the plain step left it."""
    expected = step(make_block(), seed=11)
    expected_state, expected_draw = torch.get_rng_state(), torch.rand(5)
    block = gradckpt.checkpoint_module(make_block(), policy=policy)
    actual = step(block, seed=11)
    actual_state, actual_draw = torch.get_rng_state(), torch.rand(5)
    assert block.calls == 2  # it did recompute, drawing its dropout mask again
    assert torch.equal(actual_state, expected_state)
    assert torch.equal(actual_draw, expected_draw)
    assert_identical(actual, expected, "step")


def test_preserve_rng_state_false_is_exact_for_regions_without_randomness() -> None:
    """preserve_rng_state=False skips the replay; without randomness results are unchanged."""
    torch.manual_seed(0)
    region = nn.Sequential(nn.Linear(8, 8), nn.GELU(), nn.Linear(8, 8))
    plain = copy.deepcopy(region)
    expected = step(plain)
    x = block_input()
    y = gradckpt.checkpoint(region, x, preserve_rng_state=False)
    y.square().sum().backward()
    assert_identical(gradients(region), expected["grads"], "grads")
    assert_identical(x.grad, expected["input_grad"], "input grad")


# ---------------------------------------------------------------------------------------------
# Module hooks run again in recomputation (invariant 2, documented)
# ---------------------------------------------------------------------------------------------


def test_forward_pre_hooks_run_again_during_recomputation() -> None:
    """Invariant 2: hooks do run again (FSDP2 relies on it). Per training step: the checkpointed
    module's and its children's forward pre-hooks run twice; its forward (post) hook runs once,
    because recomputation stops before the module returns (invariant 6)."""
    block = gradckpt.checkpoint_module(make_block())
    counts = {"pre": 0, "child_pre": 0, "post": 0}

    def count(key: str) -> Any:
        def hook(*args: Any) -> None:
            counts[key] += 1

        return hook

    block.register_forward_pre_hook(count("pre"))
    block.linear.register_forward_pre_hook(count("child_pre"))
    block.register_forward_hook(count("post"))
    y = block(block_input())
    assert counts == {"pre": 1, "child_pre": 1, "post": 1}
    y.square().sum().backward()
    assert counts == {"pre": 2, "child_pre": 2, "post": 1}
    with torch.no_grad():
        block(block_input())
    assert counts == {"pre": 3, "child_pre": 3, "post": 2}


# ---------------------------------------------------------------------------------------------
# The module form
# ---------------------------------------------------------------------------------------------


def describe_module(module: nn.Module) -> dict:
    return {
        "state_dict_keys": list(module.state_dict()),
        "parameter_names": [name for name, _ in module.named_parameters()],
        "buffer_names": [name for name, _ in module.named_buffers()],
        "module_names": [name for name, _ in module.named_modules()],
        "repr": repr(module),
    }


def test_checkpoint_module_keeps_names_state_dict_and_repr() -> None:
    """checkpoint_module swaps the class only: names, state_dict keys and repr are unchanged."""
    torch.manual_seed(0)
    model = nn.Sequential(Switchable(), nn.BatchNorm1d(8), Switchable())
    before = describe_module(model)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    gradckpt.checkpoint_module(model[0], policy="save-matmuls", name="first")
    gradckpt.checkpoint_module(model)
    assert describe_module(model) == before
    assert_identical(dict(model.state_dict()), state, "state_dict")
    assert gradckpt.is_checkpointed(model) and gradckpt.is_checkpointed(model[0])
    assert not gradckpt.is_checkpointed(model[2])
    assert isinstance(model[0], Switchable) and isinstance(model, nn.Sequential)


def test_checkpoint_module_twice_replaces_the_settings() -> None:
    """Calling checkpoint_module again does not wrap twice: still one recomputation."""
    block = make_block()
    gradckpt.checkpoint_module(block, policy="save-matmuls")
    gradckpt.checkpoint_module(block, policy=None, name="again")
    assert type(block).__mro__.count(Switchable) == 1
    step(block)
    assert block.calls == 2


def test_uncheckpoint_module_restores_the_original_class() -> None:
    """uncheckpoint_module: the original class and behaviour come back (no recomputation)."""
    block = make_block()
    gradckpt.checkpoint_module(block, policy="save-matmuls")
    assert type(block) is not Switchable
    assert gradckpt.uncheckpoint_module(block) is block
    assert type(block) is Switchable
    assert not gradckpt.is_checkpointed(block)
    assert "_gradckpt_settings" not in vars(block)
    actual = step(block)
    assert block.calls == 1  # forward only: nothing is recomputed any more
    assert_identical(actual, step(make_block()), "step after uncheckpoint")
    assert gradckpt.uncheckpoint_module(block) is block  # a no-op on a plain module
    assert type(block) is Switchable


def round_trip_with_torch_save(module: nn.Module) -> nn.Module:
    buffer = io.BytesIO()
    torch.save(module, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=False)


@pytest.mark.parametrize("duplicate", [copy.deepcopy, round_trip_with_torch_save])
def test_copies_of_a_checkpointed_module_stay_checkpointed_and_correct(duplicate: Any) -> None:
    """deepcopy and torch.save/torch.load keep the module checkpointed, with its settings."""
    block = gradckpt.checkpoint_module(make_block(), policy="save-matmuls", name="saved-block")
    twin = duplicate(block)
    assert twin is not block and gradckpt.is_checkpointed(twin)
    assert type(twin) is type(block)
    assert describe_module(twin) == describe_module(block)
    assert_identical(dict(twin.state_dict()), dict(block.state_dict()), "state_dict")
    calls_before = twin.calls
    assert_identical(step(twin), step(make_block()), "step of the copy")
    assert twin.calls - calls_before == 2  # it still recomputes
    assert block.calls == 0  # the original was not run
    # The region name travelled with it: a differing recomputation names it.
    twin.variant = "shape"
    twin.calls = 0
    y = twin(block_input())
    with pytest.raises(CheckpointError, match="saved-block"):
        y.square().sum().backward()


# ---------------------------------------------------------------------------------------------
# Policies' contract
# ---------------------------------------------------------------------------------------------


def test_policy_is_asked_only_about_new_tensors_and_only_in_forward() -> None:
    """The policy sees (OpOverload, Tensor) for ops that are neither views nor in-place, once
    each, in the forward pass; recomputation never asks again."""
    torch.manual_seed(0)
    linear = nn.Linear(8, 8)

    def region(x: torch.Tensor) -> torch.Tensor:
        h = linear(x).t().contiguous()  # t: a view
        h = h.view(2, 16).relu_()  # view, in-place
        h.add_(1.0)  # in-place
        return torch.tanh(h).unsqueeze(0)

    policy = AskLog(Fate.RECOMPUTE)
    y = gradckpt.checkpoint(region, block_input(), policy=policy)
    asked = [op for op, _ in policy.asked]
    assert torch.ops.aten.addmm.default in asked and torch.ops.aten.tanh.default in asked
    for op, output in policy.asked:
        assert isinstance(op, torch._ops.OpOverload)
        assert isinstance(output, torch.Tensor)
        assert not op.is_view and not op._schema.is_mutable, op
    asked_in_forward = len(policy.asked)
    y.sum().backward()
    assert len(policy.asked) == asked_in_forward


def test_inner_policy_work_is_invisible_to_the_outer_regions_policy() -> None:
    """Invariants 5 and 7: an inner region is run (and its policy asked) again whenever its
    parent is recomputed. The inner policy's answers and the engine's own copies must not count
    as operations of the parent, or a policy that answers differently the second time (here:
    one that cycles through fates) would make the parent's recomputation look different."""
    answers = itertools.cycle([Fate.KEEP, Fate.KEEP, Fate.RECOMPUTE])

    def cycling_policy(op: Any, output: torch.Tensor) -> Fate:
        return next(answers)

    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(4, 4), nn.GELU(), nn.Dropout(0.5))

    def outer(x: torch.Tensor) -> torch.Tensor:
        return F.gelu(gradckpt.checkpoint(inner, x, policy=cycling_policy))

    def plain(x: torch.Tensor) -> torch.Tensor:
        return F.gelu(inner(x))

    x = torch.randn(3, 4, requires_grad=True)
    torch.manual_seed(5)
    expected = torch.autograd.grad(plain(x).sum(), [x, *inner.parameters()])
    torch.manual_seed(5)
    y = gradckpt.checkpoint(outer, x, policy="save-matmuls")
    got = torch.autograd.grad(y.sum(), [x, *inner.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True))


def test_presets_decide_as_documented() -> None:
    """save_matmuls keeps, offload_matmuls offloads matmuls; everything else is recomputed."""
    aten = torch.ops.aten
    out = torch.zeros(2, 2)
    for op in (aten.mm.default, aten.addmm.default, aten.bmm.default):
        assert gradckpt.save_matmuls(op, out) is Fate.KEEP
        assert gradckpt.offload_matmuls(op, out) is Fate.OFFLOAD
    for op in (aten.gelu.default, aten.add.Tensor, aten.native_dropout.default):
        assert gradckpt.save_matmuls(op, out) is Fate.RECOMPUTE
        assert gradckpt.offload_matmuls(op, out) is Fate.RECOMPUTE


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


def test_non_callable_fn_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="callable"):
        gradckpt.checkpoint(42, block_input())
    assert issubclass(UsageError, ValueError) and issubclass(UsageError, GradckptError)


@pytest.mark.parametrize(
    "apply",
    [
        lambda policy: gradckpt.checkpoint(torch.sin, block_input(), policy=policy),
        lambda policy: gradckpt.checkpoint_module(nn.Linear(2, 2), policy=policy),
    ],
    ids=["checkpoint", "checkpoint_module"],
)
def test_unknown_policy_name_lists_the_valid_names(apply: Any) -> None:
    with pytest.raises(UsageError) as error:
        apply("save-everything")
    message = str(error.value)
    assert "save-everything" in message
    assert "save-matmuls" in message and "offload-matmuls" in message


def test_policy_of_the_wrong_type_is_a_usage_error() -> None:
    with pytest.raises(UsageError, match="policy"):
        gradckpt.checkpoint(torch.sin, block_input(), policy=3)


@pytest.mark.parametrize("answer", ["keep", True, None, Fate])
def test_policy_returning_a_non_fate_is_a_usage_error(answer: Any) -> None:
    with pytest.raises(UsageError, match="Fate"):
        gradckpt.checkpoint(
            lambda x: F.gelu(x) * 2, block_input(), policy=lambda op, output: answer
        )


@pytest.mark.parametrize("not_a_module", [torch.sin, "model", None])
def test_checkpoint_module_on_a_non_module_is_a_usage_error(not_a_module: Any) -> None:
    with pytest.raises(UsageError, match="Module"):
        gradckpt.checkpoint_module(not_a_module)
