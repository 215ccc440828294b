"""The engine under real-world tensors and settings: what users porting from
``torch.utils.checkpoint`` run into (default-device contexts, tensor subclasses, fake and meta
tensors, global settings, in-place changes after a region).

Each test names the engine invariant it checks (``src/gradckpt/engine/__init__.py``):

- Invariant 1 (same numbers): recomputation runs under the ambient state of the forward pass
  (default device and dtype, deterministic algorithms, matmul precision, attention backends,
  autocast, fake-tensor mode), whatever the caller has set by the time backward runs.
- Invariant 7 (loud mismatches): queries that return no tensor (``aten.sym_size`` from a
  subclass) are not operations of the region; a kept or offloaded output changed in place after
  the region gives the true gradient; a region input, parameter or buffer changed in place
  before backward raises ``CheckpointError``, never a silently wrong gradient.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from typing import Any

import hf_models
import pytest
import torch
import torch.nn.functional as F
from engine_models import LoRANet, SizesThroughDispatch, assert_identical, gradients
from torch import nn

import gradckpt
from gradckpt import Fate

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread


def keep_all(op: Any, output: torch.Tensor) -> Fate:
    return Fate.KEEP


def offload_all(op: Any, output: torch.Tensor) -> Fate:
    return Fate.OFFLOAD


def recompute_all(op: Any, output: torch.Tensor) -> Fate:
    return Fate.RECOMPUTE


POLICIES = [None, "save-matmuls", "offload-matmuls", keep_all, offload_all, recompute_all]
POLICY_IDS = ["none", "save-matmuls", "offload-matmuls", "keep-all", "offload-all", "recompute"]


def makes_tensors(x: torch.Tensor) -> torch.Tensor:
    """A region that creates tensors with factory functions, on the default device and dtype."""
    scale = torch.ones(())
    shift = torch.arange(x.shape[-1])
    return (x * scale + shift).sin() @ torch.eye(x.shape[-1])


class Block(nn.Module):
    """Linear, GELU, Linear: matmuls a policy can keep, element-wise work it recomputes."""

    def __init__(self, width: int = 6) -> None:
        super().__init__()
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x))).tanh()


# --------------------------------------------------------------------------------------------
# Ambient state: replayed in recomputation, then put back (invariant 1)
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("backward_inside", [True, False], ids=["backward-inside", "outside"])
@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_device_context_of_the_forward_pass_is_replayed(backward_inside: bool, policy) -> None:
    """Invariant 1: tensors a region creates in recomputation land on the device they landed on
    in the forward pass (meta), whether or not backward runs inside the ``torch.device`` block.
    Before the fix: "the forward pass saved float32[] on meta, recomputation saved float32[] on
    cpu"."""
    with torch.device("meta"):
        x = torch.randn(3, 4, requires_grad=True)
        y = gradckpt.checkpoint(makes_tensors, x, policy=policy)
        if backward_inside:
            y.sum().backward()
    if not backward_inside:
        y.sum().backward()
    assert x.grad.device.type == "meta" and x.grad.shape == x.shape


def test_set_default_device_of_the_forward_pass_is_replayed() -> None:
    """Invariant 1: ``torch.set_default_device`` in effect in the forward pass only."""
    torch.set_default_device("meta")
    try:
        x = torch.randn(3, 4, requires_grad=True)
        y = gradckpt.checkpoint(makes_tensors, x, policy="save-matmuls")
    finally:
        torch.set_default_device(None)
    y.sum().backward()
    assert x.grad.device.type == "meta"


def run_plain_and_checkpointed(
    build: Callable[[], nn.Module], make_input: Callable[[], torch.Tensor], policy: Any
) -> tuple[dict, dict]:
    """One step of the same seeded model, plain and checkpointed; outputs and gradients."""

    def step(checkpointed: bool) -> dict:
        torch.manual_seed(0)
        model = build()
        x = make_input()
        y = gradckpt.checkpoint(model, x, policy=policy) if checkpointed else model(x)
        y.sum().backward()
        return {"output": y.detach(), "input_grad": x.grad, "grads": gradients(model)}

    return step(False), step(True)


def test_default_dtype_of_the_forward_pass_is_replayed() -> None:
    """Invariant 1: a float64 default dtype in the forward pass only; the gradients equal the
    plain model's bit for bit (recomputation used to make float32 tensors)."""

    def float64_forward(checkpointed: bool) -> dict:
        torch.manual_seed(0)
        block = Block().double()
        x = torch.randn(5, 6, dtype=torch.float64, requires_grad=True)
        torch.set_default_dtype(torch.float64)
        try:
            region = lambda t: makes_tensors(block(t))  # noqa: E731
            y = gradckpt.checkpoint(region, x, policy="save-matmuls") if checkpointed else region(x)
        finally:
            torch.set_default_dtype(torch.float32)
        y.sum().backward()
        return {"input_grad": x.grad, "grads": gradients(block)}

    assert_identical(float64_forward(True), float64_forward(False))


def _set_deterministic(value: tuple[bool, bool]) -> None:
    torch.use_deterministic_algorithms(value[0], warn_only=value[1])


def _attribute(owner: Any, name: str) -> tuple[Callable[[], Any], Callable[[Any], None]]:
    return (lambda: getattr(owner, name)), (lambda value: setattr(owner, name, value))


def _flipped(value: Any) -> Any:
    return not value


cuda_backends = torch.backends.cuda
GLOBAL_SETTINGS = {
    # name: (get, set, the value the forward pass runs with, given the current one)
    "default dtype": (
        torch.get_default_dtype, torch.set_default_dtype, lambda _: torch.float64
    ),
    "deterministic algorithms": (
        lambda: (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        _set_deterministic,
        lambda current: (not current[0], True),
    ),
    "float32 matmul precision": (
        torch.get_float32_matmul_precision,
        torch.set_float32_matmul_precision,
        lambda current: "medium" if current != "medium" else "highest",
    ),
    "cudnn.allow_tf32": (*_attribute(torch.backends.cudnn, "allow_tf32"), _flipped),
    "cudnn.deterministic": (*_attribute(torch.backends.cudnn, "deterministic"), _flipped),
    "cudnn.benchmark": (*_attribute(torch.backends.cudnn, "benchmark"), _flipped),
    "fp16 reduced-precision reduction": (
        *_attribute(cuda_backends.matmul, "allow_fp16_reduced_precision_reduction"),
        _flipped,
    ),
    "bf16 reduced-precision reduction": (
        *_attribute(cuda_backends.matmul, "allow_bf16_reduced_precision_reduction"),
        _flipped,
    ),
    **{
        f"{kind} attention": (
            getattr(cuda_backends, f"{kind}_sdp_enabled"),
            getattr(cuda_backends, f"enable_{kind}_sdp"),
            _flipped,
        )
        for kind in ("flash", "mem_efficient", "math", "cudnn")
    },
}


@pytest.mark.parametrize("policy", [None, "save-matmuls"], ids=["none", "save-matmuls"])
@pytest.mark.parametrize("name", sorted(GLOBAL_SETTINGS))
def test_global_settings_of_the_forward_pass_are_replayed_and_put_back(name: str, policy) -> None:
    """Invariant 1: each global setting that changes what operations compute is, during
    recomputation, what it was in the forward pass; after backward it is the caller's again."""
    get, set_, forward_value_for = GLOBAL_SETTINGS[name]
    callers_value = get()
    forward_value = forward_value_for(callers_value)
    seen: list[Any] = []

    def region(x: torch.Tensor) -> torch.Tensor:
        seen.append(get())
        return (x @ x.t()).sin().sum(dim=0)

    x = torch.randn(4, 4, requires_grad=True)
    set_(forward_value)
    try:
        y = gradckpt.checkpoint(region, x, policy=policy)
    finally:
        set_(callers_value)
    y.sum().backward()
    assert seen == [forward_value, forward_value]  # the forward pass, then recomputation
    assert get() == callers_value


def test_backward_under_no_grad_still_recomputes_with_grad() -> None:
    """Invariant 1: grad mode needs no replay; recomputation enables it even when the caller
    runs backward inside ``torch.no_grad()``."""
    expected, actual = run_plain_and_checkpointed(
        Block, lambda: torch.randn(5, 6, requires_grad=True), "save-matmuls"
    )
    torch.manual_seed(0)
    block = Block()
    x = torch.randn(5, 6, requires_grad=True)
    loss = gradckpt.checkpoint(block, x, policy="save-matmuls").sum()
    with torch.no_grad():
        loss.backward()
    assert_identical(x.grad, expected["input_grad"])
    assert_identical(actual, expected)


# --------------------------------------------------------------------------------------------
# Fake tensors and the meta device
# --------------------------------------------------------------------------------------------


def fake_step(policy: Any, backward_in_mode: bool) -> tuple[dict, dict]:
    """One step under a ``FakeTensorMode``: the parameters and their gradients."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        torch.manual_seed(0)
        block = nn.Sequential(Block(), nn.Dropout(0.1), Block())
        x = torch.randn(5, 6, requires_grad=True)
        y = gradckpt.checkpoint(lambda t: makes_tensors(block(t)), x, policy=policy)
        if backward_in_mode:
            y.sum().backward()
    if not backward_in_mode:
        y.sum().backward()
    return {"input": x, **dict(block.named_parameters())}, {"input": x.grad, **gradients(block)}


def metadata(tensors: dict) -> dict:
    return {name: (t.shape, t.dtype, t.device, type(t).__name__) for name, t in tensors.items()}


@pytest.mark.parametrize("backward_in_mode", [True, False], ids=["backward-in-mode", "outside"])
@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_fake_tensors_under_every_policy(policy, backward_in_mode: bool) -> None:
    """Invariant 1 for ``FakeTensor`` (what ``estimate`` runs regions under): every gradient
    exists, as a fake tensor like its parameter; the fake mode of the forward pass is replayed
    when backward runs outside it (recomputation's factory tensors must be fake too)."""
    parameters, grads = fake_step(policy, backward_in_mode)
    assert metadata(grads) == metadata(parameters)
    assert all(type(grad).__name__ == "FakeTensor" for grad in grads.values())


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_meta_model_under_every_policy(policy) -> None:
    """Invariant 1 on the meta device: a model built on meta trains through the engine and
    its gradients have the plain model's shapes, dtypes and device."""

    def step(checkpointed: bool) -> dict:
        with torch.device("meta"):
            block = nn.Sequential(Block(), nn.Dropout(0.1), Block())
            x = torch.randn(5, 6, requires_grad=True)
        region = lambda t: makes_tensors(block(t))  # noqa: E731
        with torch.device("meta"):
            y = gradckpt.checkpoint(region, x, policy=policy) if checkpointed else region(x)
        y.sum().backward()
        return metadata({"input_grad": x.grad, **dict(gradients(block))})

    assert step(True) == step(False)


# --------------------------------------------------------------------------------------------
# Tensor subclasses that answer size queries through dispatch (invariant 7)
# --------------------------------------------------------------------------------------------


def unwrap(value: Any) -> Any:
    return value.unwrapped() if isinstance(value, SizesThroughDispatch) else value


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_subclass_that_reports_sizes_through_dispatch(policy) -> None:
    """Invariant 7: ``aten.sym_size`` calls are not operations of the region. Before the fix,
    any policy failed with "ran aten.sym_size.default as operation #1, where the forward pass
    ran aten.sin.default"; now the gradients equal the plain model's bit for bit."""

    def step(wrapped: bool, checkpointed: bool) -> dict:
        torch.manual_seed(0)
        block = Block()
        x = torch.randn(5, 6, requires_grad=True)
        x_in = SizesThroughDispatch.of(x) if wrapped else x
        region = lambda t: (block(t) * 2).sin()  # noqa: E731
        y = gradckpt.checkpoint(region, x_in, policy=policy) if checkpointed else region(x_in)
        y.sum().backward()
        return {"output": unwrap(y).detach(), "input_grad": unwrap(x_in.grad), **gradients(block)}

    assert_identical(step(wrapped=True, checkpointed=True), step(wrapped=False, checkpointed=False))


def jagged_step(policy: Any, checkpointed: bool) -> dict:
    torch.manual_seed(0)
    linear = nn.Linear(4, 4)
    pieces = [torch.randn(2, 4), torch.randn(3, 4)]
    x = torch.nested.nested_tensor(pieces, layout=torch.jagged, requires_grad=True)
    region = lambda t: F.gelu(linear(t)).sin()  # noqa: E731
    y = gradckpt.checkpoint(region, x, policy=policy) if checkpointed else region(x)
    y.values().sum().backward()
    return {"output": y.values().detach(), "input_grad": x.grad.values(), **gradients(linear)}


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_jagged_nested_tensor_under_every_policy(policy) -> None:
    """Invariant 7 for a jagged NestedTensor input: the same gradients as the plain region."""
    expected = jagged_step(policy, checkpointed=False)
    assert_identical(jagged_step(policy, checkpointed=True), expected)


def test_jagged_nested_tensor_with_a_policy_does_not_abort_the_process() -> None:
    """A checkpointing library must never take the process down. Before the fix this aborted
    the interpreter (``terminate called after throwing an instance of 'python_error'``, exit
    134): an error raised inside a size query that C++ cannot pass on. Run in a child process so
    that a regression fails this test instead of killing the test session."""
    script = textwrap.dedent(
        """
        import torch, torch.nn.functional as F, gradckpt
        linear = torch.nn.Linear(4, 4)
        x = torch.nested.nested_tensor(
            [torch.randn(2, 4), torch.randn(3, 4)], layout=torch.jagged, requires_grad=True
        )
        y = gradckpt.checkpoint(lambda t: F.gelu(linear(t)).sin(), x, policy="save-matmuls")
        y.values().sum().backward()
        print("gradient", tuple(x.grad.values().shape))
        """
    )
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr[-2000:]
    assert "gradient (5, 4)" in result.stdout


@pytest.fixture(scope="module")
def device_mesh() -> Iterator[Any]:
    """A one-process gloo group and its CPU mesh: DTensor without a second process."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    started_here = not dist.is_initialized()
    if started_here:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield DeviceMesh("cpu", [0])
    finally:
        if started_here:
            dist.destroy_process_group()


@pytest.mark.parametrize("placement", ["replicate", "shard"])
@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_dtensor_parameters_and_input_under_every_policy(device_mesh, policy, placement) -> None:
    """Invariant 1 for DTensor (FSDP2's parameters are DTensors): parameters distributed over
    the mesh, input replicated or sharded; gradients equal the plain run's bit for bit."""
    from torch.distributed.tensor import Replicate, Shard, distribute_module, distribute_tensor

    def step(checkpointed: bool) -> dict:
        torch.manual_seed(0)
        block = distribute_module(Block(), device_mesh)
        full = torch.randn(5, 6)
        x = distribute_tensor(
            full, device_mesh, [Replicate() if placement == "replicate" else Shard(0)]
        ).requires_grad_()
        y = gradckpt.checkpoint(block, x, policy=policy) if checkpointed else block(x)
        y.sum().backward()
        grads = {name: grad.full_tensor() for name, grad in gradients(block).items()}
        return {"output": y.full_tensor().detach(), "input_grad": x.grad.full_tensor(), **grads}

    assert_identical(step(checkpointed=True), step(checkpointed=False))


# --------------------------------------------------------------------------------------------
# Tensors changed in place before backward (invariant 7)
# --------------------------------------------------------------------------------------------

FATES = [Fate.KEEP, Fate.OFFLOAD, Fate.RECOMPUTE, None]
FATE_IDS = ["keep", "offload", "recompute", "no-policy"]


def policy_for(fate: Fate | None) -> Any:
    return None if fate is None else (lambda op, output: fate)


CHANGES = {
    # how the region's output is changed after the region, and the same change out of place
    "mul_": (lambda y: y.mul_(10), lambda y: y * 10),
    "mul_ on a view": (lambda y: y[1:].mul_(10), lambda y: torch.cat([y[:1], y[1:] * 10])),
    # Changes autograd does not record: the true gradient is that of exp alone.
    "mul_ under no_grad": (lambda y: torch.no_grad()(y.mul_)(10), lambda y: y),
    "mul_ of a detached alias": (lambda y: y.detach().mul_(10), lambda y: y),
}


@pytest.mark.parametrize("change", sorted(CHANGES))
@pytest.mark.parametrize("fate", FATES, ids=FATE_IDS)
def test_output_changed_in_place_after_the_region_gives_the_true_gradient(fate, change) -> None:
    """Invariant 7: a kept (or offloaded) output changed in place after the region returns is
    noticed by its version counter, and recomputation runs that operation again. Before the
    fix KEEP and OFFLOAD gave [100, 271.8, 738.9] for the true [10, 27.2, 73.9], silently."""
    in_place, out_of_place = CHANGES[change]
    x = torch.tensor([0.0, 1.0, 2.0], requires_grad=True)
    y = gradckpt.checkpoint(torch.exp, x, policy=policy_for(fate))
    in_place(y)
    y.sum().backward()

    reference = torch.tensor([0.0, 1.0, 2.0], requires_grad=True)
    out_of_place(torch.exp(reference)).sum().backward()
    assert_identical(x.grad, reference.grad)


@pytest.mark.parametrize("fate", FATES, ids=FATE_IDS)
def test_output_of_a_subclass_changed_in_place_inside_and_after_the_region(fate) -> None:
    """Invariant 7 where storages cannot be compared (a wrapper subclass has none): the
    region changes a kept output in place, and so does the caller after the region."""

    def region(t: torch.Tensor) -> torch.Tensor:
        y = t * 2
        y.add_(1)  # in the region, after the policy kept mul's output
        return y.sin()

    def step(wrapped: bool, checkpointed: bool) -> torch.Tensor:
        x = torch.tensor([0.0, 1.0, 2.0], requires_grad=True)
        x_in = SizesThroughDispatch.of(x) if wrapped else x
        if checkpointed:
            y = gradckpt.checkpoint(region, x_in, policy=policy_for(fate))
            y.mul_(3)
        else:
            y = region(x_in) * 3
        y.sum().backward()
        return unwrap(x_in.grad)

    assert_identical(step(wrapped=True, checkpointed=True), step(wrapped=False, checkpointed=False))


def test_region_input_changed_in_place_before_backward_is_a_clear_error() -> None:
    """Invariant 7: recomputation starts from the region's inputs, so an input changed in place
    after the region cannot be recomputed from; the error names the region and the fix."""
    base = torch.randn(4, requires_grad=True)
    x = base * 1
    y = gradckpt.checkpoint(Block(4), x, policy="save-matmuls")
    x.mul_(2)
    with pytest.raises(gradckpt.CheckpointError, match=r"input of region 'Block'.*clone"):
        y.sum().backward()


@pytest.mark.parametrize("policy", [None, "save-matmuls"], ids=["none", "save-matmuls"])
def test_parameter_changed_before_backward_is_a_clear_error(policy) -> None:
    """Invariant 7: ``optimizer.step()`` before ``backward()`` changes a weight the region
    saved. Plain autograd refuses; the engine keeps no saved tensor of its own for autograd to
    check, so it compares version counters itself instead of recomputing with the new weight."""
    block = Block(4)
    x = torch.randn(3, 4, requires_grad=True)
    plain = block(x).sum()
    y = gradckpt.checkpoint(block, x, policy=policy).sum()
    torch.optim.SGD(block.parameters(), lr=0.1).step()  # no grads yet: bump by hand instead
    with torch.no_grad():
        block.up.weight.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        plain.backward()
    with pytest.raises(gradckpt.CheckpointError, match=r"changed in place between the forward"):
        y.backward()


def test_buffers_end_the_step_with_their_plain_values_and_versions() -> None:
    """Invariant 2, and why the version check needs it: BatchNorm saves its running statistics
    for backward; recomputation puts them back as they were, version counter included, so a
    second backward (``retain_graph=True``) recomputes without a false alarm."""

    def step(checkpointed: bool) -> dict:
        torch.manual_seed(0)
        block = nn.Sequential(nn.Conv2d(2, 3, 3), nn.BatchNorm2d(3), nn.ReLU())
        x = torch.randn(2, 2, 6, 6, requires_grad=True)
        y = gradckpt.checkpoint(block, x) if checkpointed else block(x)
        loss = y.sum()
        loss.backward(retain_graph=True)
        loss.backward()
        norm = block[1]
        return {
            "buffers": {name: b.clone() for name, b in norm.named_buffers()},
            "versions": {name: b._version for name, b in norm.named_buffers()},
            "grads": gradients(block),
        }

    assert_identical(step(checkpointed=True), step(checkpointed=False))


# --------------------------------------------------------------------------------------------
# Frozen bases with adapters: hand-written LoRA and PEFT on a Transformers model
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", POLICIES, ids=POLICY_IDS)
def test_hand_written_lora_on_a_subclass_input_changed_after_each_block(policy) -> None:
    """Invariants 1, 4 and 7 together: frozen base Linear plus trainable adapters, input that
    does not require grad and reports sizes through dispatch, each block's output changed in
    place by the caller's loop; the adapters' gradients equal the plain model's bit for bit."""

    def step(checkpointed: bool) -> dict:
        torch.manual_seed(0)
        model = LoRANet(width=8, depth=3)
        x = torch.randn(4, 8)
        h = SizesThroughDispatch.of(x) if checkpointed else x
        torch.manual_seed(1)  # dropout masks
        for block in model.blocks:
            if checkpointed:
                h = gradckpt.checkpoint(block, h, policy=policy)
                h.mul_(0.5)
            else:
                h = block(h) * 0.5
        h.pow(2).sum().backward()
        return {"output": unwrap(h).detach(), **gradients(model)}

    expected = step(checkpointed=False)
    assert any(grad is not None for grad in expected.values())
    assert_identical(step(checkpointed=True), expected)


def lora_llama() -> nn.Module:
    """A 2-layer Llama from a config with PEFT LoRA adapters on q and v (base frozen)."""
    peft = pytest.importorskip("peft")
    model = hf_models.tiny_llama(layers=2)
    config = peft.LoraConfig(
        r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.1
    )
    torch.manual_seed(1)
    return peft.get_peft_model(model, config)


def checkpoint_layers(model: nn.Module, policy: Any) -> None:
    for layer in model.base_model.model.model.layers:
        gradckpt.checkpoint_module(layer, policy=policy)


def trainable_grads(model: nn.Module) -> dict:
    return {name: p.grad for name, p in model.named_parameters() if p.requires_grad}


@pytest.mark.parametrize("policy", [None, "save-matmuls", keep_all], ids=POLICY_IDS[:2] + ["keep"])
def test_peft_llama_with_a_float64_default_dtype_in_the_forward_pass(policy) -> None:
    """Invariants 1 and 4 on the models people fine-tune: PEFT LoRA on a frozen Llama in
    float64, its forward pass (``labels`` in the batch, the output kept alive through backward)
    run under a float64 default dtype that the caller resets before backward; the adapters'
    gradients and the loss equal the plain model's bit for bit, attention dropout included."""
    input_ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))

    def step(checkpointed: bool) -> dict:
        torch.manual_seed(0)
        model = lora_llama().double()
        if checkpointed:
            checkpoint_layers(model, policy)
        torch.manual_seed(3)
        torch.set_default_dtype(torch.float64)
        try:
            output = model(input_ids=input_ids, labels=input_ids)
        finally:
            torch.set_default_dtype(torch.float32)
        output.loss.backward()
        return {"loss": output.loss.detach(), **trainable_grads(model)}

    expected = step(checkpointed=False)
    assert all(grad is not None for grad in expected.values())
    assert_identical(step(checkpointed=True), expected)


@pytest.mark.parametrize("policy", [None, "save-matmuls", keep_all], ids=POLICY_IDS[:2] + ["keep"])
def test_peft_llama_built_and_run_on_meta(policy) -> None:
    """Invariant 1 on the meta device, the way models too big for the machine are built:
    PEFT LoRA Llama created under ``torch.device("meta")``, its step run there with ``labels``,
    backward outside the context; every adapter gets a gradient like the plain meta run's."""
    input_ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))

    def step(checkpointed: bool) -> dict:
        with torch.device("meta"):
            model = lora_llama()
        if checkpointed:
            checkpoint_layers(model, policy)
        with torch.device("meta"):
            output = model(input_ids=input_ids.to("meta"), labels=input_ids.to("meta"))
        output.loss.backward()
        return metadata(trainable_grads(model))

    expected = step(checkpointed=False)
    assert expected and all(device.type == "meta" for *_, device, _ in expected.values())
    assert step(checkpointed=True) == expected
