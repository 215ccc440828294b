"""``peak_memory()``: the measured peak of a block of code, as a budget is judged.

A budget is the peak memory of a training step on the model's device (docs/planning.md), and
this is the public way to measure it around your own code, with the same meter ``profile``
uses (``meter.MemoryMeter``):

- on CUDA, the caching allocator's statistics: ``torch.cuda.reset_peak_memory_stats`` at entry,
  ``torch.cuda.max_memory_allocated`` at exit. Everything allocated on the device counts,
  whether or not it is passed in ``track``.
- on CPU, MemTracker. It sees the tensors created inside the block and the objects passed in
  ``track``, nothing else: pass everything that exists before the block and lives through it
  (the model, the optimizer, the batch, an output kept from an earlier step), or the peak
  leaves them out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import warn_once
from .device import infer_device
from .meter import MemoryMeter

__all__ = ["PeakMemory", "peak_memory"]


class PeakMemory:
    """What ``peak_memory()`` measured on ``device``.

    - ``start_bytes``: allocated on the device when the block began (on CPU: what the meter
      sees of it, the tracked objects).
    - ``bytes``: the most allocated at any moment inside the block, ``start_bytes`` included;
      read inside the block, the most so far. Final once the block has ended.
    """

    def __init__(self, device: torch.device, meter: MemoryMeter) -> None:
        self.device = device
        self.start_bytes = 0
        self._meter: MemoryMeter | None = meter
        self._final_bytes: int | None = None

    @property
    def bytes(self) -> int:
        if self._meter is not None:
            return self._meter.peak()
        return self._final_bytes or 0

    @property
    def added_bytes(self) -> int:
        """``bytes - start_bytes``: how far the block rose above what it started with."""
        return self.bytes - self.start_bytes

    def _finish(self) -> None:
        if self._meter is not None:
            self._final_bytes = self._meter.peak()
            self._meter = None

    def __repr__(self) -> str:
        return (f"PeakMemory(device={str(self.device)!r}, bytes={self.bytes}, "
                f"start_bytes={self.start_bytes})")


@contextlib.contextmanager
def peak_memory(
    *track: Any, device: torch.device | str | None = None
) -> Iterator[PeakMemory]:
    """Measure the peak memory of the code inside the ``with`` block on one device.

    ``peak.bytes`` is then the peak of everything allocated on the device (parameters,
    gradients, optimizer state, batch and activations included): the number a
    ``gradckpt.enable(..., budget=...)`` budget and a plan's ``predicted_peak_bytes`` are
    about. ``peak.start_bytes`` is what was allocated when the block began.

    Args:
        track: on CPU, the objects that exist before the block and live through it: the
            model, the optimizer, the batch, any output kept from an earlier step. MemTracker
            (the CPU meter) sees only these and the tensors created inside the block. On CUDA
            they are not needed (the allocator sees everything) and only choose the device.
        device: where to measure; by default the device ``track`` lives on, else CUDA where
            there is one, else the CPU.

    Returns:
        A ``PeakMemory`` whose ``bytes`` is final once the block has ended.

    Raises:
        ValueError: a device other than CPU or CUDA.

    On CUDA the block resets the allocator's peak statistics (as ``profile`` does), so a
    ``max_memory_allocated`` read around it covers only the time since. On CPU nothing tracked
    is allowed (everything may be created inside the block) but warns once, since it is
    usually a mistake. Blocks do not nest on CUDA (the inner one resets the outer's peak).

    Example:
        >>> import torch, gradckpt
        >>> model = torch.nn.Linear(1024, 1024)
        >>> optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        >>> batch = torch.randn(64, 1024)
        >>> with gradckpt.peak_memory(model, optimizer, batch) as peak:
        ...     model(batch).sum().backward()
        ...     optimizer.step()
        ...     optimizer.zero_grad()
        >>> parameter_bytes = 4 * (1024 * 1024 + 1024)
        >>> peak.start_bytes >= parameter_bytes  # the weights and the batch were there before
        True
        >>> peak.bytes >= 2 * parameter_bytes  # weights and their gradients, at least
        True
    """
    tracked = [obj for obj in track if obj is not None]
    if device is not None:
        where = torch.device(device)
    elif tracked:
        where = infer_device(*tracked)
    else:
        where = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if where.type == "cpu" and not tracked:
        warn_once(
            "peak_memory-nothing-tracked",
            "gradckpt.peak_memory() on the CPU sees only the tensors created inside the block "
            "and the objects passed to it; nothing was passed, so the model, optimizer and "
            "batch made before the block are left out of peak.bytes. Pass them: "
            "gradckpt.peak_memory(model, optimizer, batch)",
            stacklevel=4,
        )
    meter = MemoryMeter(where, *tracked)
    # Hold nothing passed in: the block may let it go (a loop rebinding its previous ``out``),
    # and the meter counts that free only if nothing here keeps the tensors alive.
    del track, tracked
    peak = PeakMemory(where, meter)
    with meter:
        peak.start_bytes = meter.current()
        try:
            yield peak
        finally:  # final even when the block raised (an out-of-memory error, say)
            peak._finish()
