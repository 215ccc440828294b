"""Checkpointed and plain models compute bit-identical results (docs/engine.md, invariants).

Every case runs the same model three ways and compares with ``torch.equal``:

- plain (no checkpointing): the ground truth of invariant 1;
- ``gradckpt`` (``checkpoint`` in the model's forward, or ``checkpoint_module`` on its blocks);
- ``torch.utils.checkpoint.checkpoint(..., use_reentrant=False)`` as a second reference, with
  ``create_selective_checkpoint_contexts`` standing in for gradckpt's policies where it can
  express them. On the CPU ``OFFLOAD`` is ``KEEP`` (policies.py), so offloading policies are
  compared with torch's ``MUST_SAVE``.

Buffers are compared with the plain model only: torch's reference runs BatchNorm twice per step
and so updates its running statistics twice, which is exactly what invariant 2 forbids.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import pytest
import torch
from engine_models import (
    AttentionNet,
    LoRANet,
    MLPChain,
    NestedNet,
    Routed,
    SmallCNN,
    assert_identical,
    buffers,
    detached,
    gradckpt_call,
    gradients,
    parameters,
    plain_call,
    reference_is_matmul,
    reference_makes_new_tensor,
    set_call,
    torch_call,
)

import gradckpt
from gradckpt import Fate

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

# ---------------------------------------------------------------------------------------------
# The matrix: cases x policies x (function | module form) x (plain | torch reference)
# ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Case:
    name: str
    build: Callable[[], Routed]
    inputs: Callable[[torch.Generator], tuple[tuple, dict]]
    loss: Callable[[Any], torch.Tensor]


def _vector_input(generator: torch.Generator) -> tuple[tuple, dict]:
    return (torch.randn(4, 8, generator=generator).requires_grad_(),), {}


def _frozen_input(generator: torch.Generator) -> tuple[tuple, dict]:
    return (torch.randn(4, 8, generator=generator),), {}  # invariant 4: no grad on the input


def _images(generator: torch.Generator) -> tuple[tuple, dict]:
    return (torch.randn(4, 3, 6, 6, generator=generator),), {}


def _tokens_and_mask(generator: torch.Generator) -> tuple[tuple, dict]:
    hidden = torch.randn(2, 5, 8, generator=generator).requires_grad_()
    mask = torch.ones(5, 5, dtype=torch.bool).tril()  # True = may attend
    return (hidden,), {"attention_mask": mask}


def _square_mean(output: torch.Tensor) -> torch.Tensor:
    return output.float().square().mean()


def _transformer_loss(output: tuple) -> torch.Tensor:
    hidden, aux_loss, lengths = output
    assert lengths == [5, 5]  # invariant 5: the non-tensor outputs come through unchanged
    return hidden.float().square().mean() + 0.1 * aux_loss.float()


CASES = [
    Case(
        "mlp-dropout",  # invariant 1: dropout masks replayed
        lambda: MLPChain([8, 12, 12, 8], ["gelu", "relu", "tanh"], [0.3, 0.3, 0.0]),
        _vector_input,
        _square_mean,
    ),
    Case("cnn-batchnorm", SmallCNN, _images, _square_mean),  # invariant 2
    Case("transformer-kwargs", AttentionNet, _tokens_and_mask, _transformer_loss),  # inv. 5
    Case("frozen-lora", LoRANet, _frozen_input, _square_mean),  # invariant 4
    Case("nested", NestedNet, _vector_input, _square_mean),  # invariant 5: nesting
]


def offload_everything(op: Any, output: torch.Tensor) -> Fate:
    return Fate.OFFLOAD


def keep_everything(op: Any, output: torch.Tensor) -> Fate:
    return Fate.KEEP


def keep_large_outputs(op: Any, output: torch.Tensor) -> Fate:
    # Decides on the output tensor itself, which torch's selective checkpointing cannot express.
    return Fate.KEEP if output.numel() >= 40 else Fate.RECOMPUTE


NO_TORCH_REFERENCE = object()

# id -> (what gradckpt gets as policy=, what torch's reference saves)
POLICIES: dict[str, tuple[Any, Any]] = {
    "none": (None, None),
    "save-matmuls": ("save-matmuls", reference_is_matmul),
    "offload-matmuls": ("offload-matmuls", reference_is_matmul),
    "save_matmuls-function": (gradckpt.save_matmuls, reference_is_matmul),
    "offload_matmuls-function": (gradckpt.offload_matmuls, reference_is_matmul),
    "offload-everything": (offload_everything, reference_makes_new_tensor),
    "keep-everything": (keep_everything, reference_makes_new_tensor),
    "keep-large-outputs": (keep_large_outputs, NO_TORCH_REFERENCE),
}
CORE_POLICIES = ["none", "save-matmuls", "offload-matmuls", "offload-everything", "keep-everything"]


def _matrix(
    policy_ids: list[str], methods: tuple[str, ...], torch_selective: bool = True
) -> list[Any]:
    """Every case x policy x method x reference; ``torch_selective=False``: where torch's
    selective checkpointing cannot serve as reference, compare against plain only."""
    params = []
    for case in CASES:
        for policy_id in policy_ids:
            for method in methods:
                for reference in ("plain", "torch"):
                    torch_saves = POLICIES[policy_id][1]
                    if reference == "torch" and (
                        torch_saves is NO_TORCH_REFERENCE
                        or (torch_saves is not None and not torch_selective)
                    ):
                        continue  # only against plain
                    params.append(
                        pytest.param(
                            case,
                            policy_id,
                            method,
                            reference,
                            id=f"{case.name}-{policy_id}-{method}-vs-{reference}",
                        )
                    )
    return params


FULL_MATRIX = _matrix(list(POLICIES), ("function", "module"))
CORE_MATRIX = _matrix(CORE_POLICIES, ("function", "module"))
FUNCTION_MATRIX = _matrix(CORE_POLICIES, ("function",))
# torch's selective checkpointing refuses a second backward through the same region.
RETAIN_GRAPH_MATRIX = _matrix(CORE_POLICIES, ("function", "module"), torch_selective=False)


# ---------------------------------------------------------------------------------------------
# Running one model one way
# ---------------------------------------------------------------------------------------------


def build(case: Case) -> Routed:
    torch.manual_seed(0)
    return case.build()


def checkpointed_model(case: Case, policy_id: str, method: str) -> Routed:
    model = build(case)
    policy = POLICIES[policy_id][0]
    if method == "module":
        for region in model.regions():
            gradckpt.checkpoint_module(region, policy=policy)
        set_call(model, plain_call)
    else:
        set_call(model, gradckpt_call(policy))
    return model


def reference_model(case: Case, policy_id: str, reference: str) -> Routed:
    model = build(case)
    if reference == "plain":
        set_call(model, plain_call)
    else:
        set_call(model, torch_call(POLICIES[policy_id][1]))
    return model


def step_inputs(case: Case, step: int) -> tuple[tuple, dict]:
    return case.inputs(torch.Generator().manual_seed(100 + step))


def forward(
    model: Routed, case: Case, step: int, autocast: bool = False
) -> tuple[tuple, Any, torch.Tensor]:
    args, kwargs = step_inputs(case, step)
    torch.manual_seed(10_000 + step)  # the same dropout stream for every variant
    context = torch.autocast("cpu", dtype=torch.bfloat16) if autocast else contextlib.nullcontext()
    with context:
        output = model(*args, **kwargs)
        loss = case.loss(output)
    return args, output, loss


def input_grads(args: tuple) -> list[torch.Tensor | None]:
    return [a.grad for a in args if isinstance(a, torch.Tensor)]


def training_step(model: Routed, case: Case, step: int = 0, autocast: bool = False) -> dict:
    args, output, loss = forward(model, case, step, autocast)
    loss.backward()
    return {
        "output": detached(output),
        "loss": loss.detach(),
        "grads": gradients(model),
        "input_grads": input_grads(args),
        "buffers": buffers(model),
    }


def assert_same_step(actual: dict, expected: dict, reference: str) -> None:
    assert_identical(actual["output"], expected["output"], "output")
    assert_identical(actual["loss"], expected["loss"], "loss")
    assert_identical(actual["grads"], expected["grads"], "grads")
    assert_identical(actual["input_grads"], expected["input_grads"], "input grads")
    if reference == "plain":  # torch's reference updates BatchNorm statistics twice
        assert_identical(actual["buffers"], expected["buffers"], "buffers")


# ---------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("case", "policy_id", "method", "reference"), FULL_MATRIX)
def test_training_step_is_bit_identical(
    case: Case, policy_id: str, method: str, reference: str
) -> None:
    """Invariant 1 (and 2, 4, 5 per case): one forward + backward, outputs/grads/buffers."""
    expected = training_step(reference_model(case, policy_id, reference), case)
    actual = training_step(checkpointed_model(case, policy_id, method), case)
    assert_same_step(actual, expected, reference)
    trained = [g for g in actual["grads"].values() if g is not None]
    assert trained and any(g.abs().sum() > 0 for g in trained)  # something was differentiated


@pytest.mark.parametrize(("case", "policy_id", "method", "reference"), CORE_MATRIX)
def test_autograd_grad_wrt_inputs_and_parameters(
    case: Case, policy_id: str, method: str, reference: str
) -> None:
    """Invariant 5: ``torch.autograd.grad`` w.r.t. inputs and parameters."""

    def grads_of(model: Routed) -> tuple:
        args, output, loss = forward(model, case, step=0)
        wrt = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        wrt += [p for p in model.parameters() if p.requires_grad]
        result = torch.autograd.grad(loss, wrt)
        assert all(p.grad is None for p in model.parameters())  # grad() does not accumulate
        return detached(result)

    expected = grads_of(reference_model(case, policy_id, reference))
    actual = grads_of(checkpointed_model(case, policy_id, method))
    assert_identical(actual, expected, "autograd.grad")


@pytest.mark.parametrize(("case", "policy_id", "method", "reference"), RETAIN_GRAPH_MATRIX)
def test_backward_twice_with_retain_graph(
    case: Case, policy_id: str, method: str, reference: str
) -> None:
    """Invariant 5: ``backward(retain_graph=True)`` twice accumulates exactly 2x the grads."""

    def twice(model: Routed) -> dict:
        args, output, loss = forward(model, case, step=0)
        loss.backward(retain_graph=True)
        loss.backward()
        return {"grads": gradients(model), "inputs": input_grads(args), "buffers": buffers(model)}

    expected = twice(reference_model(case, policy_id, reference))
    actual = twice(checkpointed_model(case, policy_id, method))
    assert_identical(actual["grads"], expected["grads"], "grads")
    assert_identical(actual["inputs"], expected["inputs"], "input grads")
    if reference == "plain":
        assert_identical(actual["buffers"], expected["buffers"], "buffers")
        once = training_step(reference_model(case, policy_id, "plain"), case)
        doubled = {k: None if g is None else 2 * g for k, g in once["grads"].items()}
        assert_identical(actual["grads"], doubled, "grads vs 2x one backward")


@pytest.mark.parametrize(("case", "policy_id", "method", "reference"), CORE_MATRIX)
def test_autocast_bfloat16_on_cpu(case: Case, policy_id: str, method: str, reference: str) -> None:
    """Invariant 5: autocast is replayed in recomputation (bfloat16 on the CPU)."""
    expected = training_step(reference_model(case, policy_id, reference), case, autocast=True)
    actual = training_step(checkpointed_model(case, policy_id, method), case, autocast=True)
    assert_same_step(actual, expected, reference)
    full_precision = training_step(reference_model(case, policy_id, "plain"), case)
    assert not torch.equal(actual["loss"], full_precision["loss"])  # autocast really was on


@pytest.mark.parametrize(("case", "policy_id", "method", "reference"), FUNCTION_MATRIX)
def test_adamw_steps_end_with_identical_parameters(
    case: Case, policy_id: str, method: str, reference: str
) -> None:
    """Invariant 1: parameter updates (several AdamW steps) match; invariant 2 over steps."""

    def train(model: Routed) -> dict:
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=1e-2)
        for step in range(3):
            optimizer.zero_grad()
            training_step(model, case, step)
            optimizer.step()
        return {"parameters": parameters(model), "buffers": buffers(model)}

    initial = parameters(build(case))
    expected = train(reference_model(case, policy_id, reference))
    actual = train(checkpointed_model(case, policy_id, method))
    assert_identical(actual["parameters"], expected["parameters"], "parameters")
    if reference == "plain":
        assert_identical(actual["buffers"], expected["buffers"], "buffers")
    changed = [n for n, p in actual["parameters"].items() if not torch.equal(p, initial[n])]
    assert changed  # the optimizer did update something


@pytest.mark.parametrize("policy_id", CORE_POLICIES)
@pytest.mark.parametrize("method", ["function", "module"])
def test_batchnorm_statistics_after_one_and_several_steps(policy_id: str, method: str) -> None:
    """Invariant 2: running_mean/var/num_batches_tracked as if each block ran forward once."""
    case = CASES[1]
    assert case.name == "cnn-batchnorm"
    plain = reference_model(case, policy_id, "plain")
    checkpointed = checkpointed_model(case, policy_id, method)
    initial = buffers(plain)
    for steps_done in range(1, 5):
        training_step(plain, case, step=steps_done)
        training_step(checkpointed, case, step=steps_done)
        actual, expected = buffers(checkpointed), buffers(plain)
        assert_identical(actual, expected, f"buffers after {steps_done} steps")
        for name, value in actual.items():
            if name.endswith("num_batches_tracked"):
                assert value.item() == steps_done
            else:
                assert not torch.equal(value, initial[name])  # statistics did move


@pytest.mark.parametrize("policy_id", CORE_POLICIES)
@pytest.mark.parametrize("method", ["function", "module"])
def test_frozen_base_adapters_get_plain_gradients(policy_id: str, method: str) -> None:
    """Invariant 4: inputs and base frozen, adapters trainable: adapters get the plain grads."""
    case = CASES[3]
    assert case.name == "frozen-lora"
    expected = training_step(reference_model(case, policy_id, "plain"), case)
    actual = training_step(checkpointed_model(case, policy_id, method), case)
    assert actual["input_grads"] == [None]
    for name, grad in actual["grads"].items():
        if ".base." in name:
            assert grad is None, name
        else:
            assert grad is not None and grad.abs().sum() > 0, name
    assert_identical(actual["grads"], expected["grads"], "adapter grads")


@pytest.mark.parametrize("policy_id", CORE_POLICIES)
def test_checkpoint_inside_checkpointed_function(policy_id: str) -> None:
    """Invariant 5: a ``checkpoint`` call inside a function run by ``checkpoint``."""
    policy = POLICIES[policy_id][0]
    torch.manual_seed(0)
    first, second, third = (torch.nn.Linear(6, 6) for _ in range(3))
    dropout = torch.nn.Dropout(0.4)

    def inner(h: torch.Tensor, *, scale: float) -> torch.Tensor:
        return dropout(torch.tanh(second(h))) * scale

    def outer(x: torch.Tensor, nest: Callable[..., Any]) -> torch.Tensor:
        h = torch.relu(first(x))
        h = nest(inner, h, scale=0.5)
        return third(torch.sigmoid(h))

    def run(top: Callable[..., Any], nest: Callable[..., Any]) -> tuple:
        x = torch.randn(5, 6, generator=torch.Generator().manual_seed(1)).requires_grad_()
        torch.manual_seed(7)
        y = top(outer, x, nest)
        y.square().sum().backward()
        grads = [p.grad.clone() for m in (first, second, third) for p in m.parameters()]
        for m in (first, second, third):
            m.zero_grad(set_to_none=True)
        return detached(y), x.grad, grads

    expected = run(plain_call, plain_call)
    reference = run(torch_call(POLICIES[policy_id][1]), torch_call(POLICIES[policy_id][1]))
    actual = run(gradckpt_call(policy), gradckpt_call(policy))
    assert_identical(actual, expected, "nested vs plain")
    assert_identical(actual, reference, "nested vs torch")
