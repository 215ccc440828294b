"""Putting a model back as it was after gradckpt ran it to learn something about it.

``find_blocks(model, sample=...)`` runs a forward pass and ``profile`` runs whole training steps;
neither may change training. What a run can change: buffers (BatchNorm's running statistics
move even under ``no_grad`` in train mode; a module may replace a buffer outright), the RNG
state (dropout draws numbers) and, with backward, the gradients.

Example:
    >>> import torch
    >>> norm = torch.nn.BatchNorm1d(4).train()
    >>> before = norm.running_mean.clone()
    >>> with buffers_and_rng_preserved(norm):
    ...     _ = norm(torch.randn(8, 4)), torch.rand(1)
    >>> torch.equal(norm.running_mean, before)
    True
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn

__all__ = ["buffers_and_rng_preserved", "gradients_preserved"]


@contextlib.contextmanager
def buffers_and_rng_preserved(model: nn.Module) -> Iterator[None]:
    """Put back every buffer's values (and the tensor itself, if a module replaced it) and the
    CPU and CUDA RNG state."""
    buffers = [
        (module, name, buffer, buffer.detach().clone())
        for module in model.modules()
        for name, buffer in module.named_buffers(recurse=False)
    ]
    cpu_rng = torch.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    try:
        yield
    finally:
        with torch.no_grad():
            for module, name, buffer, saved in buffers:
                buffer.copy_(saved)
                if getattr(module, name, None) is not buffer:
                    setattr(module, name, buffer)
        torch.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)


@contextlib.contextmanager
def gradients_preserved(model: nn.Module) -> Iterator[None]:
    """Gradients set to None inside (as after ``optimizer.zero_grad()``), the model's own put
    back afterwards.

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(2, 2)
        >>> layer(torch.ones(1, 2)).sum().backward()
        >>> before = layer.weight.grad
        >>> with gradients_preserved(layer):
        ...     print(layer.weight.grad)
        ...     layer(torch.ones(1, 2)).sum().backward()
        None
        >>> layer.weight.grad is before
        True
    """
    grads = {parameter: parameter.grad for parameter in model.parameters()}
    for parameter in grads:
        parameter.grad = None
    try:
        yield
    finally:
        # The parameters registered now: FSDP2 swaps a module's sharded parameters for
        # unsharded ones while it computes (and a forward without gradients leaves the root's
        # unsharded), so those registered at the end may be others than at the start, holding
        # gradients of the steps run inside.
        for parameter in model.parameters():
            if parameter not in grads:
                parameter.grad = None
        for parameter, grad in grads.items():
            parameter.grad = grad
