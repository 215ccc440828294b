"""Measuring: memory with one meter, on CPU and CUDA, for everything gradckpt measures.

- ``MemoryMeter``: bytes allocated on a device now and at their highest (the caching allocator
  on CUDA, MemTracker on CPU, models with frozen parameters included); ``measure_peak_bytes``
  runs one step under it. ``profile``, the tests and ``bench/`` all measure with it.
- ``infer_device``: the device a model, optimizer or batch lives on.

Time is never measured here: ``profile`` times blocks in the step (``gradckpt.step_timer``),
and ``bench/`` compares step times side by side.

Example:
    >>> import torch
    >>> from gradckpt.measure import measure_peak_bytes
    >>> model = torch.nn.Linear(256, 256)
    >>> x = torch.randn(64, 256)
    >>> peak_bytes = measure_peak_bytes(lambda: model(x).sum().backward(), model, x)
    >>> peak_bytes > 0
    True
"""

from .device import infer_device
from .meter import MemoryMeter, measure_peak_bytes

__all__ = ["MemoryMeter", "measure_peak_bytes", "infer_device"]
