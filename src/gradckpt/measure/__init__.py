"""Measuring: model + sample -> ``Profile``, and the tools every measurement shares.

- ``profile``: one real training step of the model, and each block of its chain on its own
  (``profile.py`` assembles what the package's other modules measure).
- ``clock``: what every timing here reads: the wall clock, or the modeled one that
  ``gradckpt.predict`` enters to run this same measuring on fake tensors.
- ``find_blocks`` / ``resolve_blocks``: the chain of blocks checkpointing works on.
- ``MemoryMeter``: bytes allocated on a device now and at their highest (the caching allocator
  on CUDA, MemTracker on CPU, models with frozen parameters included); ``measure_peak_bytes``
  runs one step under it. ``profile``, the tests and ``bench/`` all measure with it.
- ``peak_memory``: the public ``with`` block around the user's own code (``peak.bytes``), on
  the same meter.
- ``memory_parts``: what a step's memory is made of (parameters, gradients, optimizer state,
  activations, the output head, ...), for a measured or predicted profile and for a plan;
  ``report`` renders it.
- ``infer_device``: the device a model, optimizer or batch lives on.
- ``run_model``, ``loss_of``, ``training_step``: the user's step (how the model is called on a
  sample, its loss, what stays alive until backward ends).

Example:
    >>> import torch
    >>> from gradckpt.measure import measure_peak_bytes
    >>> model = torch.nn.Linear(256, 256)
    >>> x = torch.randn(64, 256)
    >>> peak_bytes = measure_peak_bytes(lambda: model(x).sum().backward(), model, x)
    >>> peak_bytes > 0
    True
"""

from .chain import find_blocks
from .device import infer_device
from .given_blocks import resolve_blocks
from .meter import MemoryMeter, measure_peak_bytes
from .peak import PeakMemory, peak_memory
from .profile import profile
from .step import loss_of, run_model, training_step

__all__ = [
    "profile",
    "find_blocks",
    "resolve_blocks",
    "MemoryMeter",
    "measure_peak_bytes",
    "peak_memory",
    "PeakMemory",
    "infer_device",
    "run_model",
    "loss_of",
    "training_step",
]
