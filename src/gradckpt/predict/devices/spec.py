"""``DeviceSpec``: a device's memory, dense throughput per dtype and bandwidth; the roofline."""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import torch

from ...errors import UsageError

__all__ = ["DeviceSpec"]

TERA = 10**12
GIGA = 10**9

# NVIDIA's "80GB", "24GB", "141GB" are binary: DRAM comes in power-of-two sizes, and the devices
# report them so (nvidia-smi shows an A100 80GB as 81920 MiB). So memory_bytes is the vendor's
# number times 2**30. What CUDA reports as total_memory is somewhat below it (the driver and
# firmware reserve some; GDDR cards with ECC on lose more), and a process loses more again to its
# CUDA context: estimate counts those as a separate allowance, not here.
GIB = 2**30


def _check_positive(what: str, value: Any, *, integer: bool = False) -> None:
    kind = numbers.Integral if integer else numbers.Real
    if (
        isinstance(value, bool)
        or not isinstance(value, kind)
        or not math.isfinite(value)
        or value <= 0
    ):
        raise UsageError(
            f"{what} must be a positive {'int' if integer else 'number'}, got {value!r}"
        )


@dataclass(frozen=True)
class DeviceSpec:
    """One device's memory, dense throughput per dtype and memory bandwidth.

    Attributes:
        name: short lowercase identifier, e.g. ``"h100-80gb"`` (``"this"`` for this machine,
            ``"custom"`` for user-given numbers).
        description: what the device is, e.g. ``"NVIDIA H100 SXM5 80GB"``.
        memory_bytes: the device's memory capacity (presets: the vendor's figure, binary).
        flops_per_second: dense throughput per dtype (no 2:4 sparsity): tensor-core figures for
            ``torch.bfloat16`` / ``torch.float16``, the plain FP32 (non-tensor) figure for
            ``torch.float32``, because PyTorch does not use TF32 for fp32 matmuls unless told to
            (``torch.backends.cuda.matmul.allow_tf32`` is off by default). ``torch.int8``:
            the dense INT8 tensor-core rate (operations per second, a multiply-add counted as
            two), at which the int8 matmul of an 8-bit base is timed; GPU presets have it
            where the card has INT8 tensor cores (not the V100). Must include
            ``torch.float32``: other dtypes fall back to it.
        memory_bandwidth_bytes_per_second: peak DRAM bandwidth (HBM / GDDR / system RAM).
        source: where the numbers come from (a datasheet, or how they were measured).
        kind: ``"cuda"`` for GPUs, ``"cpu"`` for a CPU.
        compute_capability: a GPU's CUDA compute capability, ``(9, 0)`` for Hopper: which
            fused attention kernel PyTorch picks depends on it (``measure.attention``). ``None``
            for a CPU; for a GPU given by numbers, the rules of ``(8, 0)`` are assumed.
        unsupported_dtypes: floating dtypes the device has no hardware for, such as
            ``torch.bfloat16`` on a V100 or T4 (Volta and Turing tensor cores take fp16 only):
            ``check_dtypes`` refuses a step in one (``estimate`` asks before it traces the
            step), where a dtype merely without a figure falls back to float32's.

    Example:
        >>> import torch
        >>> spec = DeviceSpec(
        ...     name="toy", description="1 TFLOP/s fp32, 2 bf16, 1 GB/s", memory_bytes=2**30,
        ...     flops_per_second={torch.float32: 1e12, torch.bfloat16: 2e12},
        ...     memory_bandwidth_bytes_per_second=1e9, source="example")
        >>> spec.seconds(4e12, 1e6, torch.bfloat16)  # compute-bound: 4e12 / 2e12
        2.0
        >>> spec.seconds(1e6, 3e9, torch.bfloat16)  # bandwidth-bound: 3e9 / 1e9
        3.0
    """

    name: str
    description: str
    memory_bytes: int
    # hash=False: a mapping has no hash, and the name already tells specs apart.
    flops_per_second: Mapping[torch.dtype, float] = field(hash=False)
    memory_bandwidth_bytes_per_second: float
    source: str
    kind: str = "cuda"
    compute_capability: tuple[int, int] | None = None
    unsupported_dtypes: tuple[torch.dtype, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise UsageError(f"DeviceSpec name must be a non-empty str, got {self.name!r}")
        _check_positive(f"DeviceSpec {self.name!r} memory_bytes", self.memory_bytes, integer=True)
        _check_positive(
            f"DeviceSpec {self.name!r} memory_bandwidth_bytes_per_second",
            self.memory_bandwidth_bytes_per_second,
        )
        if not isinstance(self.flops_per_second, Mapping) or torch.float32 not in (
            self.flops_per_second
        ):
            raise UsageError(
                f"DeviceSpec {self.name!r} flops_per_second must be a dict from torch dtypes to "
                f"FLOP/s that includes torch.float32 (other dtypes fall back to it), got "
                f"{self.flops_per_second!r}"
            )
        for dtype, rate in self.flops_per_second.items():
            if not isinstance(dtype, torch.dtype):
                raise UsageError(
                    f"DeviceSpec {self.name!r} flops_per_second keys must be torch dtypes, got "
                    f"{dtype!r}"
                )
            _check_positive(f"DeviceSpec {self.name!r} flops_per_second[{dtype}]", rate)
        if self.kind not in ("cuda", "cpu"):
            raise UsageError(
                f"DeviceSpec {self.name!r} kind must be 'cuda' or 'cpu', got {self.kind!r}"
            )
        capability = self.compute_capability
        if capability is not None and not (
            isinstance(capability, tuple) and len(capability) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0
                    for n in capability)
        ):
            raise UsageError(
                f"DeviceSpec {self.name!r} compute_capability must be a (major, minor) tuple of "
                f"ints such as (9, 0), got {capability!r}"
            )
        unsupported = self.unsupported_dtypes
        if not isinstance(unsupported, tuple) or any(
            not isinstance(dtype, torch.dtype) or dtype in self.flops_per_second
            for dtype in unsupported
        ):
            raise UsageError(
                f"DeviceSpec {self.name!r} unsupported_dtypes must be a tuple of torch dtypes "
                f"that have no figure in flops_per_second, got {unsupported!r}"
            )
        # Read-only, so that a preset shared by the whole process cannot be edited by accident.
        object.__setattr__(self, "flops_per_second", MappingProxyType(dict(self.flops_per_second)))

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        # A read-only mapping cannot be pickled or deep-copied: rebuild from a plain dict.
        return (
            DeviceSpec,
            (
                self.name,
                self.description,
                self.memory_bytes,
                dict(self.flops_per_second),
                self.memory_bandwidth_bytes_per_second,
                self.source,
                self.kind,
                self.compute_capability,
                self.unsupported_dtypes,
            ),
        )

    def seconds(self, flops: float, bytes_moved: float, dtype: torch.dtype) -> float:
        """The roofline time of one operation: the larger of its compute and its memory time.

        ``dtype`` picks the throughput; dtypes without a figure of their own use float32's:
        integer and bool operations in a training step are elementwise and bandwidth-bound, so
        the figure hardly matters (float64 math is slower than float32's on most GPUs: give it
        a figure of its own where it matters). The exception is the int8 matmul of an 8-bit
        base, timed at ``torch.int8``'s figure where the device has one, else at float32's
        (a V100 has no INT8 tensor cores; this machine's CPU is not measured in int8). A
        roofline is the fastest the device could go; real kernels reach a fraction of it. A
        dtype in ``unsupported_dtypes`` falls back the same way, because raising inside a
        traced step can abort the process: ``estimate`` refuses such a step before it traces
        it (``check_dtypes``).

        Example:
            >>> import torch
            >>> from gradckpt.predict.devices import DEVICES
            >>> h100 = DEVICES["h100-80gb"]
            >>> round(h100.seconds(989.5e12, 0, torch.bfloat16), 9)  # one second of bf16 math
            1.0
            >>> h100.seconds(0, 3.35e12, torch.int64)  # one second of memory traffic
            1.0
        """
        rate = self.flops_per_second.get(dtype)
        if rate is None:
            rate = self.flops_per_second[torch.float32]
        return max(flops / rate, bytes_moved / self.memory_bandwidth_bytes_per_second)

    def check_dtypes(self, dtypes: Iterable[torch.dtype | None]) -> None:
        """Raise ``UsageError`` if a step computing in any of ``dtypes`` cannot be timed here:
        one of them is in ``unsupported_dtypes`` (bf16 on a V100 or T4). The message says which
        dtype to estimate in instead. ``None`` entries are ignored.

        Example:
            >>> import torch
            >>> from gradckpt.predict.devices import DEVICES
            >>> DEVICES["t4-16gb"].check_dtypes([torch.float16, torch.float32, None])
            >>> DEVICES["t4-16gb"].check_dtypes([torch.bfloat16])
            Traceback (most recent call last):
            ...
            gradckpt.errors.UsageError: t4-16gb (NVIDIA T4 16GB) has no bfloat16 hardware ...
        """
        for dtype in dtypes:
            if dtype in self.unsupported_dtypes:
                raise UsageError(_unsupported_dtype_message(self, dtype))


def _unsupported_dtype_message(spec: DeviceSpec, dtype: torch.dtype) -> str:
    """Why ``spec`` cannot time ``dtype``, and which dtype to estimate in instead.

    Example:
        >>> import textwrap, torch
        >>> from gradckpt.predict.devices import DEVICES
        >>> print(textwrap.fill(_unsupported_dtype_message(DEVICES["t4-16gb"], torch.bfloat16), 88))
        t4-16gb (NVIDIA T4 16GB) has no bfloat16 hardware (compute capability 7.5; bfloat16
        tensor cores came with Ampere, 8.0), so a bfloat16 step has no speed to predict there.
        Estimate it in float16 instead: dtype=torch.float16 (or autocast=torch.float16) from
        Python, --dtype fp16 on the command line.
    """
    name = str(dtype).removeprefix("torch.")
    why = []
    if spec.compute_capability is not None:
        why.append(f"compute capability {spec.compute_capability[0]}.{spec.compute_capability[1]}")
    if dtype == torch.bfloat16:
        why.append("bfloat16 tensor cores came with Ampere, 8.0")
    detail = f" ({'; '.join(why)})" if why else ""
    if torch.float16 in spec.flops_per_second:
        instead = ("float16 instead: dtype=torch.float16 (or autocast=torch.float16) from "
                   "Python, --dtype fp16 on the command line")
    else:
        instead = ("float32 instead: dtype=torch.float32 from Python, --dtype fp32 on the "
                   "command line")
    return (
        f"{spec.name} ({spec.description}) has no {name} hardware{detail}, so a {name} step has "
        f"no speed to predict there. Estimate it in {instead}."
    )
