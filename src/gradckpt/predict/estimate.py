"""Predicting a model's profile without running it: ``estimate``.

``estimate(model, sample, device="h100-80gb")`` runs exactly what ``profile`` runs (the user's
step, each block on its own, the meter), but on fake tensors (``FakeTensorMode``): every tensor
has its shape, dtype and storage size and none has memory or values. So the bytes come out as
``profile`` measures them (the same recording, the same meter), and the model can be one this
machine could never hold, built on the meta device. Times come from a ``ModeledClock``: each
operation's roofline on the target device (``gradckpt.predict.devices``).

The model is left exactly as it was: its parameters and buffers are replaced by fake ones for
the duration and put back.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map

from ..ecosystem_hooks import ESTIMATING, ecosystem_hooks_on
from ..engine import storage_key
from ..engine.module import replace_forward
from ..errors import UsageError
from ..measure.given_blocks import resolve_blocks
from ..measure.memory_parts import CUDA_RESERVE, CUDA_RESERVE_BYTES, memory_parts
from ..measure.profile import profile
from ..measure.step import run_model
from ..measure.tensors import tensor_bytes
from ..measure.training_state import check_ddp
from ..profile_types import Profile
from .attention import TargetAttention
from .clock import ModeledClock
from .devices import DeviceSpec, device_spec, host_link_bytes_per_second
from .per_rank import BLOCK_PARAMETERS, shard

__all__ = ["estimate"]


def estimate(
    model: nn.Module,
    sample: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    blocks: Any = None,
    *,
    device: str | DeviceSpec | dict | None = "this",
    optimizer: torch.optim.Optimizer | str | None = None,
    accumulation_steps: int = 1,
    ddp: bool = False,
    world_size: int = 1,
    dtype: torch.dtype | None = None,
    autocast: torch.dtype | None = None,
    keep_output: bool = True,
    progress: Callable[[int, int], None] | None = None,
) -> Profile:
    """Predict what ``gradckpt.profile`` would measure, without running the model for real.

    Args:
        model: the model; its parameters may be real, or on the meta device (a model too big
            for this machine: ``with torch.device("meta"): model = Model(config)``).
        sample: one batch, as for ``profile``; its tensors may be real or on the meta device.
        loss_fn, blocks, keep_output, progress: as for ``profile``.
        device: the device the step will run on: a preset name (``"h100-80gb"``, see
            ``gradckpt.predict.devices.DEVICES``), ``"this"`` (this machine, its throughput measured
            once), a ``DeviceSpec`` or a dict of numbers. Only times depend on it.
        optimizer, accumulation_steps: as for ``profile``: the optimizer's state, alive from
            the second step on, is counted in ``fixed_bytes`` (so every plan solved from this
            profile holds it) and ``optimizer.step()``'s peak in ``optimizer_step_bytes``, its
            implementation the one PyTorch picks on the target (``foreach`` on a GPU):
            ``"adamw"`` / ``"adam"`` (two moments per trainable parameter), ``"sgd"`` (none),
            ``"adamw-8bit"`` (bitsandbytes: two bytes per parameter, counted), an optimizer
            object, or ``None`` (no optimizer step).
        ddp: as for ``profile``: one rank of a run under ``DistributedDataParallel``, whose
            buckets (a copy of the trainable gradients, alive all run) are counted, and named
            in the memory parts. DDP does not shard, so ``world_size`` stays 1 with it.
        world_size: the ranks that shard parameters, gradients and optimizer state as FSDP2
            does with ``fully_shard`` on each block and on the root (``per_rank.shard``); the
            profile is then one rank's and ``sample`` is one rank's batch.
        dtype: train in this floating dtype (parameters and floating buffers cast, as
            ``model.to(dtype)`` would); default: as the model is. A step in bf16 (by
            ``dtype``, ``autocast`` or the model's own) on a device without bf16 hardware (a
            V100, a T4) raises ``UsageError``, which suggests fp16.
        autocast: mixed precision as ``torch.autocast`` (and Accelerate, and the Trainer's
            ``bf16=True``) applies it: the parameters stay as they are (fp32) and the model's
            forward runs under autocast to this dtype, so matmuls compute and save in it and
            each weight they use is cast, a copy that lives through the step ("mixed-precision
            copies" in the memory parts). CPU autocast's operation lists stand for the GPU's.

    What the memory is made of is in ``notes["memory_parts"]`` (parameters, gradients of the
    trainable ones, optimizer state, the activations a step without checkpointing keeps, the
    logits and loss, and, on a GPU, the CUDA context and allocator reserve, which the device
    loses but the peak, as ``max_memory_allocated`` measures it, does not count), the largest
    in ``notes["largest_part"]``, and what the device has for the peak in
    ``notes["device_usable_bytes"]``; ``notes["attention"]`` names the attention kernels the
    step ran: on a GPU target, each ``scaled_dot_product_attention`` call runs the kernel
    PyTorch would pick on that GPU (cuDNN, FlashAttention-2, memory-efficient or the math
    path: ``gradckpt.predict.attention``), so the bytes it saves are the target's.
    ``notes["estimated_for"]`` names the device, and the
    times are rooflines (the fastest the device could run each operation): an extra time
    predicted from them is a share of the step, which real kernels keep better than seconds.

    Example:
        >>> import torch, gradckpt
        >>> from gradckpt.toy_models import GPTConfig, TinyGPT
        >>> with torch.device("meta"):  # no memory for weights
        ...     model = TinyGPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
        >>> idx = torch.randint(0, 512, (2, 16), device="meta")
        >>> predicted = estimate(model, {"idx": idx, "targets": idx}, device="h100-80gb")
        >>> predicted.blocks[0].input_bytes == 2 * 16 * 32 * 4, predicted.notes["estimated_for"]
        (True, 'h100-80gb')
        >>> one_rank = estimate(model, {"idx": idx, "targets": idx}, device="h100-80gb",
        ...                     ddp=True)  # under DistributedDataParallel
        >>> buckets = one_rank.notes["memory_parts"]["DDP's buckets (a copy of the trainable "
        ...                                         "gradients)"]
        >>> buckets == sum(p.numel() * 4 for p in model.parameters())
        True
    """
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise UsageError(f"world_size must be a positive int (the ranks sharding the model), "
                         f"got {world_size!r}")
    if check_ddp(ddp) and world_size > 1:
        raise UsageError(
            f"ddp=True with world_size={world_size}: world_size is the ranks sharding the model "
            f"as FSDP2 does, and DDP shards nothing; estimate one DDP rank with world_size=1 "
            f"(its sample one rank's batch)"
        )
    spec = device_spec(device)
    for name, value in (("dtype", dtype), ("autocast", autocast)):
        if value is not None and not (isinstance(value, torch.dtype) and value.is_floating_point):
            raise UsageError(f"{name} must be a floating torch.dtype such as torch.bfloat16, "
                             f"got {value!r}")
    # A device without bf16 hardware (a V100, a T4) refuses a bf16 step before it is traced.
    computed_in = [dtype] if dtype is not None else [
        tensor.dtype for tensor in (*model.parameters(), *model.buffers())]
    spec.check_dtypes([*computed_in, autocast])
    mode = _FakeTensors(allow_non_fake_inputs=False)
    # Integrations whose models read values to choose a code path choose as for a real batch
    # (Transformers: attention without padding takes its fused kernel).
    with (
        ecosystem_hooks_on(model, ESTIMATING),
        _fake_state(model, mode, dtype),
        _forward_under_autocast(model, autocast),
    ):
        fake_sample = _fake_tree(sample, mode)
        # On a GPU, attention runs the kernel that GPU would pick (not this CPU's choice).
        target = TargetAttention(spec.compute_capability) if spec.kind == "cuda" else None
        with mode, ModeledClock(spec) as clock, target or contextlib.nullcontext():
            predicted = profile(
                model, fake_sample, loss_fn=loss_fn, blocks=blocks, optimizer=optimizer,
                accumulation_steps=accumulation_steps, ddp=ddp, keep_output=keep_output,
                repeats=1,
                progress=progress,
            )
            copies = _parameter_copy_bytes(model, fake_sample) if autocast is not None else 0
        reserve_bytes = CUDA_RESERVE_BYTES if spec.kind == "cuda" else 0
        parts = dict(memory_parts(model, predicted, mixed_precision_copy_bytes=copies,
                                  cuda_reserve_bytes=reserve_bytes).parts)
        block_parameter_bytes = [
            sum(tensor_bytes(p) for p in module.parameters())
            for _, module in resolve_blocks(model, [b.name for b in predicted.blocks])]
        predicted.notes["largest_block_parameter_bytes"] = max(block_parameter_bytes, default=0)
    predicted.device = spec.kind
    predicted.notes["attention"] = _attention_note(clock, target, spec)
    predicted.notes.update(
        estimated_for=spec.name,
        host_link_bytes_per_second=host_link_bytes_per_second(spec.name),
        memory_parts=parts,
        largest_part=max(parts, key=parts.get),
        device_usable_bytes=spec.memory_bytes - parts.get(CUDA_RESERVE, 0),
    )
    if world_size == 1:
        return predicted
    predicted.notes[BLOCK_PARAMETERS] = block_parameter_bytes
    return shard(predicted, world_size)


class _FakeTensors(FakeTensorMode):
    """``FakeTensorMode`` without the Dynamo guard ``TorchDispatchMode`` puts around each
    subclass's dispatch (a fifth of what a traced operation costs): nothing is compiled on an
    estimate's fake tensors."""

    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    # FakeTensorMode's own dispatch, as defined, under the guard's wrapper (if torch has one).
    __torch_dispatch__ = getattr(FakeTensorMode.__dict__["__torch_dispatch__"], "__wrapped__",
                                 FakeTensorMode.__dict__["__torch_dispatch__"])


_KERNEL_NAMES = {
    "cudnn": "cuDNN attention", "flash": "FlashAttention-2",
    "efficient": "memory-efficient attention", "math": "the math path (matmuls and softmax)",
}


def _attention_note(clock: ModeledClock, target: TargetAttention | None, spec: DeviceSpec
                    ) -> str:
    """Which attention kernels the estimate ran: the target GPU's choice, or on a CPU what
    PyTorch ran on the fake CPU tensors."""
    if target is not None:
        if not target.kernels:
            return "no scaled_dot_product_attention call (attention, if any, in matmuls)"
        chosen = ", ".join(_KERNEL_NAMES[kernel] for kernel in sorted(target.kernels))
        major, minor = target.capability
        return (f"{chosen}: what PyTorch picks on {spec.name} (compute capability "
                f"{major}.{minor}) for these tensors")
    ran = sorted(k for k in clock.attention_kernels if not k.endswith("_backward"))
    return (", ".join(ran) if ran
            else "no fused attention kernel ran (any attention was matmuls and softmax)")


def _fake(tensor: torch.Tensor, mode: FakeTensorMode, dtype: torch.dtype | None) -> torch.Tensor:
    """A fake CPU tensor of ``tensor``'s shape and strides (``dtype`` for floating ones)."""
    cast = dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype
    with mode:
        return torch.empty_strided(tensor.shape, tensor.stride(), dtype=cast, device="cpu")


def _fake_tree(tree: Any, mode: FakeTensorMode) -> Any:
    """The sample with fake tensors; one tensor passed twice stays one (``labels=input_ids``)."""
    fakes: dict[int, torch.Tensor] = {}

    def fake(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if id(x) not in fakes:
            fakes[id(x)] = _fake(x, mode, None)
        return fakes[id(x)]

    return tree_map(fake, tree)


@contextlib.contextmanager
def _fake_state(
    model: nn.Module, mode: FakeTensorMode, dtype: torch.dtype | None
) -> Iterator[None]:
    """Fake parameters and buffers in ``model`` for the duration; tied ones stay tied."""
    originals: list[tuple[dict, str, Any]] = []
    fakes: dict[int, Any] = {}
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, value in table.items():
                if value is None:
                    continue
                if id(value) not in fakes:
                    fake = _fake(value.detach(), mode, dtype)
                    if isinstance(value, nn.Parameter):
                        fake = nn.Parameter(fake, requires_grad=value.requires_grad)
                    fakes[id(value)] = fake
                originals.append((table, name, value))
                table[name] = fakes[id(value)]
    try:
        yield
    finally:
        for table, name, value in originals:
            table[name] = value


@contextlib.contextmanager
def _forward_under_autocast(model: nn.Module, dtype: torch.dtype | None) -> Iterator[None]:
    """The model's forward wrapped in ``torch.autocast`` for the duration, as Accelerate does."""
    if dtype is None:
        yield
        return
    restore = replace_forward(model, torch.autocast("cpu", dtype=dtype)(model.forward))
    try:
        yield
    finally:
        restore()


class _ParameterCasts(TorchDispatchMode):
    """Bytes of the casts of parameters (autocast's copies), each parameter counted once."""

    def __init__(self, parameters: dict[int, torch.Tensor]) -> None:
        super().__init__()
        self.parameters = parameters
        self.cast: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        output = func(*args, **(kwargs or {}))
        if func.overloadpacket is torch.ops.aten._to_copy and args:
            key = storage_key(args[0])
            if key in self.parameters and isinstance(output, torch.Tensor):
                self.cast[key] = tensor_bytes(output)
        return output


def _parameter_copy_bytes(model: nn.Module, sample: Any) -> int:
    """What one forward under autocast casts of the parameters."""
    parameters = {storage_key(p): p for p in model.parameters()}
    with _ParameterCasts(parameters) as casts:
        run_model(model, sample)
    return sum(casts.cast.values())
