"""The engine on a CUDA device: RNG replay, offload through side streams, measured memory.

Skipped without a CUDA GPU. Invariant 1 on the device (dropout masks drawn by the device's
generator are replayed, also for tensors a region creates on a device none of its inputs are
on); ``offload-matmuls`` copies through a side stream and still gives bit-identical grads, also
when the user runs the step on a stream of their own; and it lowers the step's peak memory as
``torch.cuda.max_memory_allocated`` measures it (docs/planning.md, "What `profile` measures").
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
from engine_models import MLPChain, assert_identical, gradckpt_call, gradients, set_call, torch_call
from torch import nn

import gradckpt

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

DEVICE = "cuda"
POLICIES = [None, "save-matmuls", "offload-matmuls"]


def chain() -> MLPChain:
    torch.manual_seed(0)
    return MLPChain([64, 128, 128, 64], ["gelu", "relu", "tanh"], [0.3, 0.3, 0.3]).to(DEVICE)


def step(model: nn.Module, seed: int = 5) -> dict:
    generator = torch.Generator(device=DEVICE).manual_seed(1)
    x = torch.randn(32, 64, device=DEVICE, generator=generator).requires_grad_()
    torch.manual_seed(seed)  # seeds the CPU and every CUDA generator
    y = model(x)
    y.square().mean().backward()
    torch.cuda.synchronize()
    return {
        "output": y.detach(),
        "input_grad": x.grad,
        "grads": gradients(model),
        "cpu_rng": torch.get_rng_state(),
        "cuda_rng": torch.cuda.get_rng_state(),
    }


@pytest.mark.parametrize("policy", POLICIES)
def test_dropout_on_the_device_is_replayed(policy: str | None) -> None:
    """Invariant 1 on CUDA: grads equal the plain model's and torch's checkpoint's, and the
    CPU and CUDA random streams end where the plain step leaves them."""
    expected = step(chain())
    reference_model = chain()
    set_call(reference_model, torch_call())
    reference = step(reference_model)
    model = chain()
    set_call(model, gradckpt_call(policy))
    actual = step(model)
    assert_identical(actual, expected, "vs plain")
    for key in ("output", "input_grad", "grads"):
        assert_identical(actual[key], reference[key], f"vs torch {key}")


def test_random_tensors_made_on_the_device_from_cpu_inputs() -> None:
    """Invariant 1: a region whose inputs are on the CPU but which draws random numbers on the
    GPU gets the device's RNG replayed too."""
    torch.manual_seed(0)
    linear = nn.Linear(16, 16).to(DEVICE)

    def region(x: torch.Tensor) -> torch.Tensor:
        noise = torch.rand(x.shape, device=DEVICE)  # drawn on the device
        return torch.tanh(linear(x.to(DEVICE)) * noise)

    def run(call: Any) -> tuple:
        x = torch.randn(8, 16, generator=torch.Generator().manual_seed(2)).requires_grad_()
        torch.manual_seed(9)
        torch.rand(3, device=DEVICE)  # make sure CUDA is initialized before the region
        y = call(region, x)
        y.square().sum().backward()
        result = (y.detach(), x.grad, linear.weight.grad.clone(), linear.bias.grad.clone())
        linear.zero_grad(set_to_none=True)
        return result

    expected = run(lambda fn, x: fn(x))
    actual = run(gradckpt.checkpoint)
    assert_identical(actual, expected, "region drawing on the device")


@pytest.mark.parametrize("user_stream", [False, True], ids=["default-stream", "user-stream"])
def test_offload_through_side_streams_is_exact(user_stream: bool) -> None:
    """Offload copies run on a side stream; the grads are still bit-identical, also when the
    step itself runs on a non-default stream."""
    expected = step(chain())
    model = chain()
    set_call(model, gradckpt_call("offload-matmuls"))
    stream = torch.cuda.Stream() if user_stream else torch.cuda.current_stream()
    stream.wait_stream(torch.cuda.current_stream())  # the parameters were made on the default
    with torch.cuda.stream(stream):
        actual = step(model)
    torch.cuda.synchronize()
    assert_identical(actual, expected, "offloaded step")


def wide_chain(blocks: int) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(
        *(
            nn.Sequential(nn.Linear(512, 2048), nn.GELU(), nn.Linear(2048, 512))
            for _ in range(blocks)
        )
    ).to(DEVICE)


def peak_bytes(model: nn.Sequential, policy: str) -> tuple[int, list]:
    x = torch.randn(1024, 512, device=DEVICE, requires_grad=True)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    start = torch.cuda.max_memory_allocated()
    h = x
    for block in model:
        h = gradckpt.checkpoint(block, h, policy=policy)
    h.square().mean().backward()
    torch.cuda.synchronize()
    return torch.cuda.max_memory_allocated() - start, [p.grad.clone() for p in model.parameters()]


def test_offload_lowers_the_measured_peak() -> None:
    """Offloading the matmul outputs to CPU memory lowers torch.cuda.max_memory_allocated
    compared with keeping them on the device, with the same grads."""
    blocks = 8
    kept_per_block = (1024 * 2048 + 1024 * 512) * 4  # the two addmm outputs, float32
    keep_model = wide_chain(blocks)
    offload_model = copy.deepcopy(keep_model)
    keep_peak, keep_grads = peak_bytes(keep_model, "save-matmuls")
    offload_peak, offload_grads = peak_bytes(offload_model, "offload-matmuls")
    assert_identical(offload_grads, keep_grads, "grads")
    # Keeping holds all blocks' matmul outputs at the end of forward; offloading at most a
    # couple of blocks' worth while one block's backward runs.
    assert keep_peak - offload_peak >= (blocks // 2) * kept_per_block, (keep_peak, offload_peak)


def offload_all(op: Any, output: torch.Tensor) -> gradckpt.Fate:
    return gradckpt.Fate.OFFLOAD


@pytest.mark.parametrize("change", ["mul_", "mul_ of a detached alias"])
def test_offloaded_output_changed_while_its_copy_may_still_run(change: str) -> None:
    """Invariant 7 on CUDA: an offloaded output changed in place right after the region, while
    its copy to pinned memory runs on the side stream, is noticed (the tensor is watched
    through a weak reference) and recomputed: the true gradient, never the changed values."""
    x = torch.linspace(0, 2, 1 << 20, device=DEVICE).requires_grad_()
    y = gradckpt.checkpoint(torch.exp, x, policy=offload_all)
    if change == "mul_":
        y.mul_(10)
        expected = 10 * torch.exp(x.detach())
    else:
        y.detach().mul_(10)
        expected = torch.exp(x.detach())  # the change autograd does not record
    y.sum().backward()
    torch.cuda.synchronize()
    assert_identical(x.grad, expected)


def test_cuda_device_context_of_the_forward_pass_is_replayed() -> None:
    """Invariant 1: a region that creates tensors on the default device, run forward inside
    ``with torch.device("cuda")`` and backward outside it (on autograd's device thread), gives
    the plain gradients on the GPU."""

    def region(t: torch.Tensor) -> torch.Tensor:
        return (t * torch.ones(()) + torch.arange(t.shape[-1])).sin()

    def run(checkpointed: bool) -> torch.Tensor:
        with torch.device(DEVICE):
            x = torch.linspace(-1, 1, 64).reshape(4, 16).requires_grad_()
            y = gradckpt.checkpoint(region, x, policy="save-matmuls") if checkpointed else region(x)
        y.sum().backward()
        torch.cuda.synchronize()
        return x.grad

    expected = run(checkpointed=False)
    assert expected.device.type == "cuda"
    assert_identical(run(checkpointed=True), expected)
