"""Is the model's forward pass something a plan can replay? Two cheap checks before measuring.

Recomputation gives a block's gradients those of the plain model only if running the block
again computes what its forward computed. gradckpt replays what torch keeps (the CPU and CUDA
random generators, which dropout draws from; buffers as they were), so two kinds of model break
the promise "gradients equal to the plain model's" whatever the engine does:

1. **A model that does not repeat itself**: run twice on the same sample from the same torch
   RNG state and buffers, it computes other values (randomness drawn from numpy or Python's
   ``random``, a kernel whose result depends on timing). A block of it recomputed in backward
   computes other values than its forward did; its gradients under a plan differ from the
   plain model's as much as two plain runs do.
2. **A model whose forward changes with what gradckpt changes while it works** (the registered
   ecosystem hooks; for a Hugging Face model: its key/value cache off, as Transformers' own
   gradient checkpointing turns it off): trained under a plan it is the model with those
   changes, which computes otherwise.

``replay_warnings`` runs the model's forward pass without gradients, twice with the hooks on
(check 1) and, where a hook changes the model, once with them off (check 2), each from the same
RNG state and buffers, compares every tensor of the outputs bit for bit, and warns
(``GradckptWarning``, once per model class and finding) with what differed. It costs two or
three forward passes without gradients, under a step's worth; ``profile`` runs it on real
tensors (fake ones have no values to compare).

Example:
    >>> import random, warnings, torch
    >>> class PythonNoise(torch.nn.Module):  # noise from outside torch's generators
    ...     def forward(self, x):
    ...         return x * random.random()
    >>> with warnings.catch_warnings(record=True) as caught:
    ...     warnings.simplefilter("always")
    ...     replay_warnings(PythonNoise(), torch.ones(2))
    >>> "does not repeat itself" in str(caught[0].message)
    True
    >>> from gradckpt.errors import forget_warnings; forget_warnings()
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ..ecosystem_hooks import ecosystem_hooks_on
from ..errors import warn_once
from .model_state import buffers_and_rng_preserved
from .step import run_model
from .tensors import tensors_in

__all__ = ["replay_warnings"]


def replay_warnings(model: nn.Module, sample: Any) -> None:
    """Warn if ``model``'s forward pass on ``sample`` does not repeat itself, or changes with
    the ecosystem hooks (see the module). The model, its buffers and the RNG state are left as
    they were."""
    name = type(model).__name__
    with ecosystem_hooks_on(model) as hooks_change_it:
        first = _forward(model, sample)
        second = _forward(model, sample)
    without = _forward(model, sample) if hooks_change_it else first
    if first is None or second is None or without is None:
        return  # a model that cannot run without gradients: no check (its step ran)
    where = _first_difference(first, second)
    if where is not None:
        warn_once(f"replay: {name} does not repeat", (
            f"{name}'s forward pass does not repeat itself: run twice on the sample from the "
            f"same torch RNG state and buffers, {where}. gradckpt replays torch's random "
            "generators, not randomness drawn elsewhere (numpy, Python's random) nor kernels "
            "whose results vary from run to run: a block recomputed under a plan computes "
            "otherwise than its forward did, and gradients differ from the plain model's as "
            "much as two plain runs do. Draw the randomness from torch, or leave the blocks "
            "that draw it out of the chain (blocks=)"), stacklevel=4)
        return
    where = _first_difference(first, without)
    if where is not None:
        warn_once(f"replay: {name} without hooks", (
            f"{name}'s forward pass computes otherwise with the changes gradckpt makes while it "
            f"measures and while a plan is applied (the registered ecosystem hooks; for a "
            f"Hugging Face model its key/value cache off, use_cache=False, as Transformers' "
            f"own gradient checkpointing does): {where}. Under a plan it trains as the model "
            f"with those changes, whose gradients are not the unchanged model's"),
                  stacklevel=4)


def _forward(model: nn.Module, sample: Any) -> dict[str, list[tuple]] | None:
    """A fingerprint of each tensor of the output, by entry where the output is a mapping (a
    Hugging Face output: ``loss``, ``logits``, ...), else under ``"output"``; None where the
    model raises an error without gradients (the check is not worth an error of its own).
    Fingerprints, not copies: a language model's logits can be gigabytes, on a device already
    near full."""
    with buffers_and_rng_preserved(model), torch.no_grad():
        try:
            output = run_model(model, sample)
        except Exception:
            return None
        entries = dict(output.items()) if isinstance(output, Mapping) else {"output": output}
        return {key: [_fingerprint(tensor) for tensor in tensors_in(value)]
                for key, value in entries.items()}


def _fingerprint(tensor: torch.Tensor) -> tuple:
    """Shape, dtype, the XOR of its bits (``torch.hash_tensor``: any changed value changes it,
    but for collisions far rarer than any real difference) and its sum, to say by how much."""
    if tensor.is_complex():
        tensor = torch.view_as_real(tensor)
    total = tensor.double().sum().item() if tensor.numel() else 0.0
    try:
        bits = torch.hash_tensor(tensor).view(torch.int64).item()
    except (RuntimeError, TypeError, NotImplementedError):  # a dtype it does not take
        bits = total
    return (list(tensor.shape), tensor.dtype, bits, total)


def _first_difference(first: dict[str, list[tuple]],
                      second: dict[str, list[tuple]]) -> str | None:
    """Where two runs' outputs differ, in words, or None where every entry both have is the
    same (an entry one run alone has is a cache it was asked for, not a difference)."""
    for key in first.keys() & second.keys():
        ones, others = first[key], second[key]
        if len(ones) != len(others):
            return f"its output's {key!r} held {len(ones)} tensors, then {len(others)}"
        for (shape, dtype, bits, total), (shape_2, dtype_2, bits_2, total_2) in zip(
                ones, others, strict=True):
            if (shape, dtype) != (shape_2, dtype_2):
                return (f"its output's {key!r} came out as {shape} {dtype}, then as "
                        f"{shape_2} {dtype_2}")
            if (bits, total) != (bits_2, total_2):
                return (f"its output's {key!r} (shape {shape}) differed: sums {total:.8g}, "
                        f"then {total_2:.8g}")
    return None
