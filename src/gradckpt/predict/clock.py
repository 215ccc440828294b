"""The modeled clock ``estimate`` times a step with: a roofline per operation on the target.

While a ``ModeledClock`` is active (inside the ``FakeTensorMode`` the step runs in), measuring's
``now()`` (``gradckpt.measure.clock``) reads the seconds the operations dispatched so far would
take on the target device: per ATen operation, a roofline, the larger of its FLOPs over the
device's dense throughput for its dtype and the bytes it reads and writes over the memory
bandwidth (FLOPs from ``torch.utils.flop_counter``'s registry; views move no bytes). A
roofline is the fastest the device could go: real kernels reach part of it.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from ..measure import clock
from ..measure.clock import Seconds
from ..measure.tensors import tensor_bytes

__all__ = ["ModeledClock", "Roofline"]


class Roofline(Protocol):
    """What the modeled clock needs of a device (``gradckpt.predict.devices.DeviceSpec`` has it)."""

    def seconds(self, flops: float, bytes_moved: float, dtype: torch.dtype) -> float: ...


class ModeledClock(TorchDispatchMode):
    """While active, every ATen operation advances ``elapsed`` by its roofline time on
    ``device``; ``now()`` reads it. Enter it inside the ``FakeTensorMode`` the step runs in.

    Example:
        >>> import torch
        >>> class Device:  # 1 TFLOP/s, 1 GB/s
        ...     def seconds(self, flops, bytes_moved, dtype):
        ...         return max(flops / 1e12, bytes_moved / 1e9)
        >>> a = torch.randn(1000, 1000)
        >>> with ModeledClock(Device()) as modeled:
        ...     _ = a @ a  # 2e9 FLOPs (2 ms), 12 MB read and written (12 ms)
        >>> round(modeled.elapsed, 4), modeled.flops
        (0.012, 2000000000)
    """

    def __init__(self, device: Roofline) -> None:
        super().__init__()
        self.device = device
        self._elapsed = Seconds(0)
        self.flops = 0
        self.bytes_moved = 0
        self.attention_kernels: set[str] = set()  # which fused attention ran, if any

    @property
    def elapsed(self) -> Seconds:
        """The seconds modeled so far, exactly (``Seconds``: readings subtract exactly)."""
        return self._elapsed

    def __enter__(self) -> ModeledClock:
        clock.entered(self)
        return super().__enter__()

    def __exit__(self, *exc: Any) -> None:
        clock.left(self)
        super().__exit__(*exc)

    # No Dynamo guard around the dispatch (TorchDispatchMode wraps each subclass's in one):
    # this mode only runs on fake tensors inside ``estimate``, never under torch.compile, and
    # the guard cost a fifth of each traced operation.
    @classmethod
    def _should_skip_dynamo(cls) -> bool:
        return False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        output = func(*args, **kwargs)
        if clock.bookkeeping():  # a meter asking about a tensor, not the step's own work
            return output
        facts = _FACTS.get(func)
        if facts is None:
            facts = _FACTS[func] = _facts_of(func)
        attention, free, count = facts
        if attention is not None:
            self.attention_kernels.add(attention)
        if free:
            return output
        flops = 0
        if count is not None:
            flops = count(*args, **kwargs, out_val=output)
        inputs = _tensors(args)
        if kwargs:
            inputs += _tensors(kwargs.values())
        outputs = _tensors((output,))
        moved = 0
        for tensor in inputs:
            moved += tensor_bytes(tensor)
        for tensor in outputs:
            moved += tensor_bytes(tensor)
        dtype = next((t.dtype for t in (*outputs, *inputs) if t.is_floating_point()),
                     torch.float32)
        self.flops += flops
        self.bytes_moved += moved
        self._elapsed += Seconds.of(self.device.seconds(flops, moved, dtype))
        return output


# Per operation, what the clock needs to know of it, looked up once: the fused attention kernel
# it is (or None), whether it is free (a view, or only makes or describes tensors), and its
# FLOP formula (or None).
_FACTS: dict[Any, tuple[str | None, bool, Any]] = {}


def _facts_of(func: Any) -> tuple[str | None, bool, Any]:
    name = func.overloadpacket.__name__
    return ("attention" in name and name or None,
            func.is_view or func.overloadpacket in _FREE,
            flop_registry.get(func.overloadpacket))


def _tensors(values: Any) -> list[torch.Tensor]:
    """The tensors among ``values``, lists and tuples among them opened (an ATen operation's
    arguments and outputs nest no deeper: ``Tensor[]``, ``Tensor?[]``); anything else is
    flattened as a pytree, so that nothing is missed."""
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, torch.Tensor):
                    found.append(item)
                elif isinstance(item, (list, tuple, dict)):
                    found += [t for t in tree_flatten(item)[0] if isinstance(t, torch.Tensor)]
        elif isinstance(value, dict):
            found += [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return found


# Operations that only make or describe tensors: an allocation, not a kernel worth timing.
# ``prim.device`` is a fake tensor's answer to ``.device`` (the autograd engine asks it of
# every gradient): a real tensor's is a field, read on the host. Timed as a read of the
# tensor, it made Llama-3-8B's modeled step at 1k tokens 0.156 s, where its kernels take 0.072.
_FREE = {
    torch.ops.prim.device,
    torch.ops.aten.empty, torch.ops.aten.empty_strided, torch.ops.aten.empty_like,
    torch.ops.aten.detach, torch.ops.aten.lift_fresh, torch.ops.aten._local_scalar_dense,
    torch.ops.aten.sym_size, torch.ops.aten.sym_stride, torch.ops.aten.sym_numel,
}
