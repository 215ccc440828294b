"""Measuring a model: one real training step, and each block of its chain on its own.

``profile(model, sample)`` runs a warm-up step and a few measured steps of the model as it is
(no checkpointing) and records what ``Profile`` holds:

- the step's peak memory (MemTracker's "Total" on CPU, ``max_memory_allocated`` on CUDA) and
  its median time;
- per block, from the block's real inputs in that step, re-run on its own: input and output
  bytes; the bytes its autograd graph keeps (the distinct storages of the tensors it saves for
  backward, parameters excluded, its input included when saved); the transient memory of its
  forward and backward pass (MemTracker / the CUDA allocator, above what existed before); its
  forward and backward time (medians); and the outputs and share of forward time of its matrix
  multiplies and attention kernels (what ``policy="save-matmuls"`` keeps).

``fixed_bytes`` is then whatever of the measured peak the chain model (``gradckpt.plan``) does not
explain: parameters, gradients, embeddings, logits. The model's parameters, gradients, buffers
and the RNG state are as they were before profiling.
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_unflatten

from .blocks import resolve_blocks
from .engine import _detached_like, _first_tensor, _storage_key
from .errors import UsageError
from .measure import infer_device, measure_peak_bytes
from .plan import simulate
from .policies import is_matmul_or_attention
from .profile_types import BlockProfile, Profile

__all__ = ["profile", "run_model", "loss_of"]


def run_model(model: nn.Module, sample: Any) -> Any:
    """Call the model on a sample the way DESIGN.md says: tensor, tuple (positional) or dict.

    Example:
        >>> run_model(torch.nn.Linear(2, 1), torch.ones(3, 2)).shape
        torch.Size([3, 1])
    """
    if isinstance(sample, dict):
        return model(**sample)
    if isinstance(sample, (tuple, list)):
        return model(*sample)
    if isinstance(sample, torch.Tensor):
        return model(sample)
    raise UsageError(
        f"sample must be a tensor (model(sample)), a tuple (model(*sample)) or a dict "
        f"(model(**sample)); got {type(sample).__name__}"
    )


def loss_of(output: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None) -> torch.Tensor:
    """The scalar to call backward on: ``loss_fn(output)``, else ``output.loss``, else the sum.

    Example:
        >>> loss_of(torch.ones(2, 3, requires_grad=True))
        tensor(6., grad_fn=<SumBackward0>)
    """
    if loss_fn is not None:
        loss = loss_fn(output)
    elif isinstance(getattr(output, "loss", None), torch.Tensor):
        loss = output.loss  # Hugging Face models given labels
    elif isinstance(output, torch.Tensor):
        loss = output.sum()
    else:
        raise UsageError(
            f"cannot tell the loss of a {type(output).__name__} output: pass loss_fn= "
            "(a function from the model's output to a scalar tensor), or give the model what "
            "it needs to return .loss (e.g. labels for Hugging Face models)"
        )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise UsageError(f"the loss must be a scalar tensor, got {_describe(loss)}")
    if not loss.requires_grad:
        raise UsageError(
            "the loss does not require grad: no parameter of the model is trainable, or the "
            "model ran without grad"
        )
    return loss


def profile(
    model: nn.Module,
    sample: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    blocks: Any = None,
    *,
    repeats: int = 3,
) -> Profile:
    """Measure one training step of ``model`` on ``sample`` and each block of its chain.

    Args:
        model: the model, as it will be trained (its device, dtype, train/eval mode).
        sample: one batch: a tensor, a tuple of positional arguments or a dict of keywords.
        loss_fn: turns the output into the loss; default ``output.loss`` or ``output.sum()``.
        blocks: the chain (default: ``gradckpt.find_blocks(model)``); see ``resolve_blocks``.
        repeats: measured repetitions for every time (the median is kept).

    Example:
        >>> import torch, gradckpt
        >>> from gradckpt.models import GPTConfig, TinyGPT
        >>> model = TinyGPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=16))
        >>> idx = torch.randint(0, 512, (2, 16))
        >>> measured = gradckpt.profile(model, {"idx": idx, "targets": idx}, repeats=1)
        >>> [block.name for block in measured.blocks]
        ['transformer.h.0', 'transformer.h.1']
        >>> measured.blocks[0].input_bytes == 2 * 16 * 32 * 4
        True
    """
    named_blocks = resolve_blocks(model, blocks)
    if repeats < 1:
        raise UsageError(f"repeats must be at least 1, got {repeats}")
    device = infer_device(model)
    with _model_state_preserved(model):
        calls = _record_block_calls(model, sample, loss_fn, [m for _, m in named_blocks])

        def step() -> None:
            # As a training loop runs it: gradients start out as None (optimizer.zero_grad()).
            model.zero_grad(set_to_none=True)
            loss_of(run_model(model, sample), loss_fn).backward()

        step()  # warm-up: lazy initialisations, allocator caches
        step_seconds = _median_seconds(step, repeats, device)
        peak_bytes = measure_peak_bytes(step, model, *_tensors(sample), device=device)
        measured = [
            _measure_block(name, module, call, repeats, device)
            for (name, module), call in zip(named_blocks, calls, strict=True)
        ]
    chain = Profile(
        measured, peak_bytes, fixed_bytes=0, step_seconds=step_seconds, device=str(device)
    )
    chain.fixed_bytes = peak_bytes - simulate(chain, [])[0]
    return chain


# --------------------------------------------------------------------------------------------
# The step: recording each block's inputs, keeping the model as it was
# --------------------------------------------------------------------------------------------


class _BlockCall:
    """A block's arguments in the step, detached, and which leaf is the hidden state."""

    def __init__(self, args: tuple, kwargs: dict) -> None:
        leaves, self.spec = tree_flatten((args, kwargs))
        self.leaves = [
            _detached_like(leaf) if isinstance(leaf, torch.Tensor) else leaf
            for leaf in leaves
        ]
        tensors = [i for i, leaf in enumerate(self.leaves) if isinstance(leaf, torch.Tensor)]
        if not tensors:
            raise UsageError("a block was called without a tensor argument: not a chain block")
        self.hidden = tensors[0]  # the chain's hidden state comes first (x = block(x, ...))

    def fresh(self) -> tuple[tuple, dict, torch.Tensor]:
        """The arguments with a fresh copy of the hidden state (so memory measures are clean)."""
        leaves = list(self.leaves)
        original = leaves[self.hidden]
        hidden = original.detach().clone().requires_grad_(original.requires_grad)
        leaves[self.hidden] = hidden
        args, kwargs = tree_unflatten(leaves, self.spec)
        return args, kwargs, hidden


def _record_block_calls(
    model: nn.Module, sample: Any, loss_fn: Any, blocks: list[nn.Module]
) -> list[_BlockCall]:
    calls: dict[int, _BlockCall] = {}

    def record(index: int, module: nn.Module, args: tuple, kwargs: dict) -> None:
        calls.setdefault(index, _BlockCall(args, kwargs))  # the first call, if called twice

    hooks = [
        block.register_forward_pre_hook(functools.partial(record, index), with_kwargs=True)
        for index, block in enumerate(blocks)
    ]
    try:
        loss_of(run_model(model, sample), loss_fn).backward()
    finally:
        for hook in hooks:
            hook.remove()
    missing = [index for index in range(len(blocks)) if index not in calls]
    if missing:
        raise UsageError(
            f"blocks {missing} did not run in the model's forward pass on this sample; pass "
            "blocks= with the blocks that run, in order"
        )
    return [calls[index] for index in range(len(blocks))]


@contextlib.contextmanager
def _model_state_preserved(model: nn.Module) -> Iterator[None]:
    """Profiling runs real steps: put gradients, buffers and RNG back afterwards."""
    grads = {p: p.grad for p in model.parameters()}
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    for parameter in grads:
        parameter.grad = None
    try:
        yield
    finally:
        for parameter, grad in grads.items():
            parameter.grad = grad
        with torch.no_grad():
            for buffer, copy in buffers:
                buffer.copy_(copy)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


# --------------------------------------------------------------------------------------------
# One block on its own
# --------------------------------------------------------------------------------------------


def _measure_block(
    name: str, block: nn.Module, call: _BlockCall, repeats: int, device: torch.device
) -> BlockProfile:
    parameter_storages = {_storage_key(p) for p in block.parameters()}
    parameter_storages |= {_storage_key(b) for b in block.buffers()}

    args, kwargs, hidden = call.fresh()
    saved: dict[int, int] = {}  # storage -> bytes, each storage once

    def remember(tensor: torch.Tensor) -> torch.Tensor:
        key = _storage_key(tensor)
        if key not in parameter_storages:
            saved[key] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(remember, lambda tensor: tensor):
        forward_peak, output = _transient_peak(lambda: block(*args, **kwargs), device)
    chain_output = _block_output(output)
    input_saved = _storage_key(hidden) in saved
    gradient = torch.ones_like(chain_output)
    backward_peak, _ = _transient_peak(lambda: chain_output.backward(gradient), device)
    block.zero_grad(set_to_none=True)

    def forward_only() -> Any:
        a, k, _ = call.fresh()
        return block(*a, **k)

    def forward_and_backward() -> None:
        out = _block_output(forward_only())
        out.backward(torch.ones_like(out))

    forward_seconds = _median_seconds(forward_only, repeats, device)
    both_seconds = _median_seconds(forward_and_backward, repeats, device)
    block.zero_grad(set_to_none=True)
    matmul_bytes, matmul_share = _matmul_outputs(block, call)
    return BlockProfile(
        name=name,
        input_bytes=_nbytes(hidden),
        output_bytes=_nbytes(chain_output),
        saved_bytes=sum(saved.values()),
        input_saved=input_saved,
        forward_seconds=forward_seconds,
        backward_seconds=max(both_seconds - forward_seconds, 0.0),
        forward_peak_bytes=forward_peak,
        backward_peak_bytes=backward_peak,
        matmul_bytes=matmul_bytes,
        matmul_seconds=matmul_share * forward_seconds,
    )


def _transient_peak(fn: Callable[[], Any], device: torch.device) -> tuple[int, Any]:
    """Run fn; the most memory it held at once beyond what existed before it started."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        result = fn()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before, result
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()  # knows only what is made inside it: exactly the transient
    with tracker:
        result = fn()
    peak = tracker.get_tracker_snapshot("peak").get(device, {}).get("Total", 0)
    return int(peak), result


class _OpTimer(TorchDispatchMode):
    """Times every ATen operation and adds up the matmul/attention outputs and time."""

    def __init__(self) -> None:
        super().__init__()
        self.total_seconds = 0.0
        self.matmul_seconds = 0.0
        self.matmul_bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        start = time.perf_counter()
        output = func(*args, **(kwargs or {}))
        elapsed = time.perf_counter() - start
        self.total_seconds += elapsed
        if is_matmul_or_attention(func):
            self.matmul_seconds += elapsed
            self.matmul_bytes += sum(
                _nbytes(t) for t in tree_flatten(output)[0] if isinstance(t, torch.Tensor)
            )
        return output


def _matmul_outputs(block: nn.Module, call: _BlockCall) -> tuple[int, float]:
    """Bytes of the block's matmul/attention outputs and their share of its forward time."""
    args, kwargs, _ = call.fresh()
    with _OpTimer() as timer:  # with grad, as in training: kernels can differ without it
        block(*args, **kwargs)
    share = timer.matmul_seconds / timer.total_seconds if timer.total_seconds else 0.0
    return timer.matmul_bytes, share


# --------------------------------------------------------------------------------------------
# Small helpers
# --------------------------------------------------------------------------------------------


def _median_seconds(fn: Callable[[], Any], repeats: int, device: torch.device) -> float:
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _block_output(output: Any) -> torch.Tensor:
    tensor = _first_tensor(output)
    if tensor is None:
        raise UsageError("a block returned no tensor: it cannot be part of a chain")
    return tensor


def _tensors(sample: Any) -> list[torch.Tensor]:
    return [leaf for leaf in tree_flatten(sample)[0] if isinstance(leaf, torch.Tensor)]


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()




def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}"
