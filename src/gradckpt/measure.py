"""Measuring a training step: peak memory and side-by-side time ratios.

Memory is measured, never guessed, with the two reference measures the budget is defined by:

- on CUDA, ``torch.cuda.max_memory_allocated()`` around the step (after resetting the peak);
- on CPU, ``torch.distributed._tools.mem_tracker.MemTracker``, the "Total" of its "peak"
  snapshot. MemTracker only sees tensors created inside it and tensors registered with it, so
  pass everything that lives across the step (model, optimizer, inputs) as ``track``.

Time is only ever quoted as a ratio measured in one run, alternating the two contenders
(A, B, A, B, ... after a warm-up) and taking medians, because these machines are noisy.

Example:
    >>> import torch
    >>> from gradckpt.measure import measure_peak_bytes
    >>> model = torch.nn.Linear(256, 256)
    >>> x = torch.randn(64, 256)
    >>> peak_bytes = measure_peak_bytes(lambda: model(x).sum().backward(), model, x)
    >>> peak_bytes > 0
    True
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

__all__ = ["measure_peak_bytes", "compare_step_times", "infer_device"]


def infer_device(*objects: Any) -> torch.device:
    """The device of the first tensor, module parameter or optimizer parameter in ``objects``.

    CPU when none of them holds a tensor.

    Example:
        >>> infer_device(torch.nn.Linear(2, 2), torch.zeros(1))
        device(type='cpu')
    """
    for obj in objects:
        if isinstance(obj, torch.Tensor):
            return obj.device
        if isinstance(obj, nn.Module):
            for tensor in (*obj.parameters(), *obj.buffers()):
                return tensor.device
        if isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                for parameter in group["params"]:
                    return parameter.device
        if isinstance(obj, (list, tuple)):
            device = infer_device(*obj)
            if device.type != "cpu":
                return device
        if isinstance(obj, dict):
            device = infer_device(*obj.values())
            if device.type != "cpu":
                return device
    return torch.device("cpu")


def measure_peak_bytes(
    step_fn: Callable[[], Any], *track: Any, device: torch.device | str | None = None
) -> int:
    """Run ``step_fn()`` once and return the peak memory in bytes on ``device`` while it ran.

    ``track``: the modules, optimizers and tensors that exist before the step and stay alive
    through it (model, optimizer, inputs, targets). On CPU they are registered with MemTracker so
    that the peak counts them, as ``torch.cuda.max_memory_allocated()`` does on CUDA. The device
    defaults to the one the tracked objects live on.

    The peak is of everything allocated on the device, not just the activations: parameters,
    gradients, optimizer state and inputs are included, which is what a memory budget is about.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(1024, 1024)
        >>> x = torch.randn(32, 1024)
        >>> step = lambda: model(x).sum().backward()
        >>> parameter_bytes = 4 * (1024 * 1024 + 1024)
        >>> measure_peak_bytes(step, model, x) >= 2 * parameter_bytes  # weights + gradients
        True
    """
    device = torch.device(device) if device is not None else infer_device(*track)

    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        step_fn()
        torch.cuda.synchronize(device)
        return int(torch.cuda.max_memory_allocated(device))

    if device.type != "cpu":
        raise ValueError(f"measure_peak_bytes supports cpu and cuda devices, not {device.type!r}")

    # Imported here: torch.distributed is not built into every torch wheel (e.g. some macOS ones).
    from torch.distributed._tools.mem_tracker import MemTracker

    tracker = MemTracker()
    external = [obj for obj in track if obj is not None]
    if external:
        tracker.track_external(*external)
    with tracker:
        step_fn()
    peak_snapshot = tracker.get_tracker_snapshot("peak")
    for snapshot_device, breakdown in peak_snapshot.items():
        if torch.device(snapshot_device) == device:
            return int(breakdown["Total"])
    return 0


def _synchronize(device: torch.device | None) -> None:
    if device is not None and device.type == "cuda":
        torch.cuda.synchronize(device)


def compare_step_times(
    step_a: Callable[[], Any],
    step_b: Callable[[], Any],
    repeats: int = 5,
    warmup: int = 1,
    device: torch.device | str | None = None,
) -> tuple[float, float]:
    """Time ``step_a`` and ``step_b`` alternately; return their median times in seconds.

    Runs ``warmup`` untimed rounds of A then B, then ``repeats`` timed rounds A, B, A, B, ...
    so that drift in the machine's speed hits both alike. Quote the ratio
    ``median_b / median_a``, not the absolute times, unless the run was on a quiet GPU.
    On CUDA pass ``device`` so that each step is timed to completion.

    Example:
        >>> median_a, median_b = compare_step_times(lambda: sum(range(1000)),
        ...                                         lambda: sum(range(2000)), repeats=3)
        >>> median_a > 0 and median_b > 0
        True
    """
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    device = torch.device(device) if device is not None else None
    for _ in range(warmup):
        step_a()
        step_b()
    _synchronize(device)
    times_a: list[float] = []
    times_b: list[float] = []
    for _ in range(repeats):
        for step, times in ((step_a, times_a), (step_b, times_b)):
            start = time.perf_counter()
            step()
            _synchronize(device)
            times.append(time.perf_counter() - start)
    return statistics.median(times_a), statistics.median(times_b)
