"""The modeled clock ``estimate`` times a step with: a roofline per operation on the target.

While a ``ModeledClock`` is active (inside the ``FakeTensorMode`` the step runs in), measuring's
``now()`` (``gradckpt.measure.clock``) reads the seconds the operations dispatched so far would
take on the target device: per ATen operation, a roofline, the larger of its FLOPs over the
device's dense throughput for its dtype and the bytes it reads and writes over the memory
bandwidth (FLOPs from ``torch.utils.flop_counter``'s registry, or, for a custom operation it
does not know, from ``register_flop_formula``; views move no bytes). An operation on integers
alone is timed at its inputs' dtype: an int8 matmul at the device's int8 figure. A roofline is
the fastest the device could go: real kernels reach part of it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.flop_counter import flop_registry

from ..measure import clock
from ..measure.clock import Seconds
from ..measure.tensors import tensor_bytes

__all__ = ["ModeledClock", "Roofline", "register_flop_formula"]


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
        # The floating dtype it computes in; on integers alone, what it reads (an int8 matmul
        # writes int32 but runs at the int8 rate).
        dtype = next((t.dtype for t in (*outputs, *inputs) if t.is_floating_point()),
                     inputs[0].dtype if inputs else torch.float32)
        self.flops += flops
        self.bytes_moved += moved
        self._elapsed += Seconds.of(self.device.seconds(flops, moved, dtype))
        return output


def register_flop_formula(op: str, formula: Callable[..., int]) -> Callable[[], None]:
    """Have the modeled clock count the FLOPs of ``op``, an operation torch's FLOP registry
    has no formula for, named as ``"namespace::name"`` (so that its library need not be
    imported to name it): ``formula(*args, out_val=output, **kwargs)``, called with the
    operation's own arguments and output (fake tensors), returns its FLOPs. Returns a function
    that removes it. ``gradckpt.integrations.quantized_8bit`` registers bitsandbytes' int8
    matmul so.

    Example:
        >>> import torch
        >>> class Device:  # 1 TFLOP/s, 2 int8 TOP/s; bytes take no time
        ...     def seconds(self, flops, bytes_moved, dtype):
        ...         return flops / {torch.int8: 2e12}.get(dtype, 1e12)
        >>> a, b = torch.ones(64, 32, dtype=torch.int8), torch.ones(32, 16, dtype=torch.int8)
        >>> remove = register_flop_formula(
        ...     "aten::_int_mm", lambda a, b, out_val: 2 * a.shape[0] * a.shape[1] * b.shape[1])
        >>> with ModeledClock(Device()) as modeled:
        ...     _ = torch._int_mm(a, b)  # int8 in, int32 out: timed at the int8 rate
        >>> modeled.flops, float(modeled.elapsed)
        (65536, 3.2768e-08)
        >>> remove()
    """
    _FORMULAS[op] = formula
    _FACTS.clear()

    def remove() -> None:
        if _FORMULAS.get(op) is formula:
            del _FORMULAS[op]
            _FACTS.clear()

    return remove


# FLOP formulas of operations torch's registry does not know, by qualified name.
_FORMULAS: dict[str, Callable[..., int]] = {}

# Per operation, what the clock needs to know of it, looked up once: the fused attention kernel
# it is (or None), whether it is free (a view, or only makes or describes tensors), and its
# FLOP formula (or None).
_FACTS: dict[Any, tuple[str | None, bool, Any]] = {}


def _facts_of(func: Any) -> tuple[str | None, bool, Any]:
    packet = func.overloadpacket
    name = packet.__name__
    return ("attention" in name and name or None,
            func.is_view or packet in _FREE,
            flop_registry.get(packet) or _FORMULAS.get(packet._qualified_op_name))


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
