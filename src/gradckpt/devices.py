"""Target devices: what a GPU can hold and how fast it can go, for ``gradckpt.estimate``.

``estimate`` predicts a training step's memory and time for a device this machine may not have.
Its time model is a roofline per operation: the larger of the operation's FLOPs over the
device's dense throughput for the operation's dtype and the bytes it moves over the device's
memory bandwidth (``DeviceSpec.seconds``). This module holds those numbers:

- presets for common GPUs (``DEVICES``), the vendor's datasheet figures, each with its source;
- ``"this"``: the machine at hand, its GPU if torch sees one, else its CPU; its throughput and
  bandwidth are measured once and cached (``device_spec``);
- a dict of numbers a user gives for any other device.

``device_spec`` turns any of these into a ``DeviceSpec``; ``format_device`` prints one in a line.
docs/devices.md lists every figure and where it comes from.

Example:
    >>> from gradckpt.devices import device_spec, format_device
    >>> h100 = device_spec("H100")
    >>> h100.name, h100.memory_bytes == 80 * 2**30
    ('h100-80gb', True)
    >>> print(format_device(h100))
    h100-80gb (NVIDIA H100 SXM5 80GB: 80.00 GiB, 989.5 TFLOP/s bf16, 67 TFLOP/s fp32, 3.35 TB/s)
"""

from __future__ import annotations

import datetime
import difflib
import json
import math
import numbers
import os
import platform
import re
import socket
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from decimal import Decimal
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

from .errors import UsageError, warn_once

__all__ = ["DeviceSpec", "DEVICES", "ALIASES", "device_spec", "format_device"]

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
            (``torch.backends.cuda.matmul.allow_tf32`` is off by default). Must include
            ``torch.float32``: other dtypes fall back to it.
        memory_bandwidth_bytes_per_second: peak DRAM bandwidth (HBM / GDDR / system RAM).
        source: where the numbers come from (a datasheet, or how they were measured).
        kind: ``"cuda"`` for GPUs, ``"cpu"`` for a CPU.

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
            ),
        )

    def seconds(self, flops: float, bytes_moved: float, dtype: torch.dtype) -> float:
        """The roofline time of one operation: the larger of its compute and its memory time.

        ``dtype`` picks the throughput; dtypes without a figure of their own use float32's:
        integer and bool operations in a training step are elementwise and bandwidth-bound, so
        the figure hardly matters (float64 math is slower than float32's on most GPUs: give it
        a figure of its own where it matters). A roofline is the fastest the device could go;
        real kernels reach a fraction of it.

        Example:
            >>> import torch
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


def _preset(
    name: str,
    description: str,
    memory_gib: int,
    bf16_tflops: float,
    fp32_tflops: float,
    bandwidth_gb_per_second: float,
    source: str,
) -> DeviceSpec:
    # FP16 and BF16 tensor-core rates are equal on every GPU listed (the datasheets print one
    # figure for both), and PyTorch accumulates both in fp32.
    return DeviceSpec(
        name=name,
        description=description,
        memory_bytes=memory_gib * GIB,
        flops_per_second={
            torch.bfloat16: bf16_tflops * TERA,
            torch.float16: bf16_tflops * TERA,
            torch.float32: fp32_tflops * TERA,
        },
        memory_bandwidth_bytes_per_second=bandwidth_gb_per_second * GIGA,
        source=source,
    )


# Dense figures: NVIDIA prints Hopper/Ada tensor-core rates "with sparsity" (marked *, 2:4
# structured sparsity, which training does not use); the dense rate is half of that.
_DENSE = "tensor-core figures printed with sparsity (*), halved"

DEVICES: dict[str, DeviceSpec] = {
    spec.name: spec
    for spec in (
        _preset(
            name="h100-80gb",
            description="NVIDIA H100 SXM5 80GB",
            memory_gib=80,
            bf16_tflops=1979 / 2,
            fp32_tflops=67,
            bandwidth_gb_per_second=3350,
            source=(
                f"NVIDIA H100 Tensor Core GPU datasheet, H100 SXM column: FP32 67 TFLOPS, BF16 "
                f"Tensor Core 1,979 TFLOPS*, 80GB HBM3 at 3.35TB/s; {_DENSE}"
            ),
        ),
        _preset(
            name="h100-pcie-80gb",
            description="NVIDIA H100 PCIe 80GB",
            memory_gib=80,
            bf16_tflops=1513 / 2,
            fp32_tflops=51,
            bandwidth_gb_per_second=2000,
            source=(
                f"NVIDIA H100 Tensor Core GPU datasheet, H100 PCIe column: FP32 51 TFLOPS, BF16 "
                f"Tensor Core 1,513 TFLOPS*, 80GB HBM2e at 2TB/s; {_DENSE}"
            ),
        ),
        _preset(
            name="h200-141gb",
            description="NVIDIA H200 SXM 141GB",
            memory_gib=141,
            bf16_tflops=1979 / 2,
            fp32_tflops=67,
            bandwidth_gb_per_second=4800,
            source=(
                f"NVIDIA H200 Tensor Core GPU datasheet, H200 SXM column: BF16 Tensor Core 1,979 "
                f"TFLOPS*, 141GB HBM3e at 4.8TB/s; {_DENSE}; FP32 67 TFLOPS as the H100 SXM (the "
                f"same GH100 compute), from memory: verify"
            ),
        ),
        _preset(
            name="a100-80gb",
            description="NVIDIA A100 SXM4 80GB",
            memory_gib=80,
            bf16_tflops=312,
            fp32_tflops=19.5,
            bandwidth_gb_per_second=2039,
            source=(
                "NVIDIA A100 Tensor Core GPU datasheet, A100 80GB SXM column: FP32 19.5 TFLOPS, "
                "BF16 Tensor Core 312 TFLOPS (624* with sparsity), 80GB HBM2e at 2,039GB/s"
            ),
        ),
        _preset(
            name="a100-40gb",
            description="NVIDIA A100 SXM4 40GB",
            memory_gib=40,
            bf16_tflops=312,
            fp32_tflops=19.5,
            bandwidth_gb_per_second=1555,
            source=(
                "NVIDIA A100 Tensor Core GPU datasheet, A100 40GB SXM column: FP32 19.5 TFLOPS, "
                "BF16 Tensor Core 312 TFLOPS (624* with sparsity), 40GB HBM2 at 1,555GB/s"
            ),
        ),
        _preset(
            name="l4-24gb",
            description="NVIDIA L4 24GB",
            memory_gib=24,
            bf16_tflops=242 / 2,
            fp32_tflops=30.3,
            bandwidth_gb_per_second=300,
            source=(
                f"NVIDIA L4 Tensor Core GPU datasheet: FP32 30.3 TFLOPS, BF16 Tensor Core 242 "
                f"TFLOPS*, 24GB GDDR6 at 300GB/s; {_DENSE}"
            ),
        ),
        _preset(
            name="rtx4090-24gb",
            description="NVIDIA GeForce RTX 4090 24GB",
            memory_gib=24,
            bf16_tflops=165.2,
            fp32_tflops=82.6,
            bandwidth_gb_per_second=1008,
            source=(
                "NVIDIA Ada GPU architecture whitepaper, appendix table for the GeForce RTX 4090: "
                "FP32 82.6 TFLOPS, FP16/BF16 Tensor with FP32 accumulate 165.2 TFLOPS dense (330.4 "
                "with sparsity; GeForce runs FP32-accumulate at half the FP16-accumulate rate, and "
                "PyTorch accumulates in FP32), 24GB GDDR6X at 1,008GB/s; the tensor figure is from "
                "memory, matched by third-party spec tables (165.15 TFLOPS): verify"
            ),
        ),
    )
}

# Other names people use, lowercased and with "-" for spaces and "_"; documented in
# docs/devices.md. A bare model name means its most common variant today: the SXM board, and for
# the A100 the 80GB one (the 40GB part was replaced by it).
ALIASES: dict[str, str] = {
    "h100": "h100-80gb",
    "h100-sxm": "h100-80gb",
    "h100-sxm5": "h100-80gb",
    "h100-sxm-80gb": "h100-80gb",
    "h100-sxm5-80gb": "h100-80gb",
    "h100-80gb-hbm3": "h100-80gb",  # what torch.cuda.get_device_name() says
    "h100-pcie": "h100-pcie-80gb",
    "h200": "h200-141gb",
    "h200-sxm": "h200-141gb",
    "a100": "a100-80gb",
    "a100-sxm": "a100-80gb",
    "a100-sxm4-80gb": "a100-80gb",
    "a100-sxm4-40gb": "a100-40gb",
    "l4": "l4-24gb",
    "4090": "rtx4090-24gb",
    "rtx4090": "rtx4090-24gb",
    "rtx-4090": "rtx4090-24gb",
    "rtx-4090-24gb": "rtx4090-24gb",
}

THIS = "this"


def device_spec(
    device: str | DeviceSpec | Mapping[str, Any] | None = THIS, *, refresh: bool = False
) -> DeviceSpec:
    """The ``DeviceSpec`` a device argument means.

    Args:
        device: one of
            - a preset name from ``DEVICES`` (``"h100-80gb"``), case-insensitive, spaces and
              ``_`` read as ``-``, with aliases from ``ALIASES`` (``"H100"``, ``"a100"``,
              ``"4090"``) and an optional ``"nvidia "`` / ``"geforce "`` in front;
            - ``"this"`` or ``None``: this machine, its current CUDA GPU when torch sees one,
              else its CPU. Throughput and bandwidth are measured once (about a second) and
              cached in ``$GRADCKPT_CACHE_DIR`` (default ``$XDG_CACHE_HOME/gradckpt``, i.e.
              ``~/.cache/gradckpt``), file ``this-device.json``, per machine, device, torch
              version, thread count and fp32 matmul precision; memory is read each time;
            - a dict of numbers for any other device: ``memory`` (bytes, or a size such as
              ``"24GiB"``), ``bf16_tflops``, ``fp32_tflops``, ``bandwidth_gbps`` (GB/s,
              10**9 bytes per second, as datasheets print it), and optionally ``fp16_tflops``
              (default: ``bf16_tflops``), ``name`` (default ``"custom"``), ``description`` and
              ``kind`` (``"cuda"`` or ``"cpu"``);
            - a ``DeviceSpec``, returned as it is.
        refresh: measure ``"this"`` again even when the cache holds it (other devices ignore it).

    Raises ``UsageError`` for an unknown name (listing the known ones and the closest) and for
    a dict with a missing, unknown, mistyped or non-positive entry (naming it).

    Example:
        >>> device_spec("a100").name, device_spec("NVIDIA GeForce RTX 4090").name
        ('a100-80gb', 'rtx4090-24gb')
        >>> mine = device_spec({"memory": "48GiB", "bf16_tflops": 180, "fp32_tflops": 90,
        ...                     "bandwidth_gbps": 960})
        >>> mine.name, mine.memory_bytes == 48 * 2**30, mine.flops_per_second[torch.float16]
        ('custom', True, 180000000000000.0)
        >>> device_spec("h10")
        Traceback (most recent call last):
        ...
        gradckpt.errors.UsageError: unknown device 'h10'; did you mean 'h100-80gb'? ...
    """
    if isinstance(device, DeviceSpec):
        return device
    if device is None:
        device = THIS
    if isinstance(device, Mapping):
        return _spec_from_numbers(device)
    if not isinstance(device, str):
        raise UsageError(
            f"device must be a preset name such as 'h100-80gb', 'this', a dict of numbers or a "
            f"DeviceSpec, got {type(device).__name__}: {device!r}"
        )
    key = _normalize(device)
    if key == THIS:
        return _this_device(refresh=refresh)
    key = ALIASES.get(key, key)
    if key in DEVICES:
        return DEVICES[key]
    raise UsageError(_unknown_device_message(device, key))


def format_device(spec: DeviceSpec) -> str:
    """One line naming ``spec`` and its headline figures, for plans and the CLI.

    Throughput is shown to 4 significant digits in TFLOP/s, bandwidth in TB/s (10**12 B/s).

    Example:
        >>> print(format_device(DEVICES["l4-24gb"]))
        l4-24gb (NVIDIA L4 24GB: 24.00 GiB, 121 TFLOP/s bf16, 30.3 TFLOP/s fp32, 0.3 TB/s)
    """
    rates = spec.flops_per_second
    bf16 = rates.get(torch.bfloat16, rates[torch.float32])
    return (
        f"{spec.name} ({spec.description}: {spec.memory_bytes / GIB:.2f} GiB, "
        f"{bf16 / TERA:.4g} TFLOP/s bf16, {rates[torch.float32] / TERA:.4g} TFLOP/s fp32, "
        f"{spec.memory_bandwidth_bytes_per_second / TERA:.4g} TB/s)"
    )


# --------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------


def _normalize(name: str) -> str:
    key = "-".join(name.strip().lower().replace("_", " ").split())
    for prefix in ("nvidia-", "geforce-"):
        key = key.removeprefix(prefix)
    return key


def _unknown_device_message(given: str, key: str) -> str:
    known = sorted(DEVICES)
    # Match against aliases too ("h10" is nearest "h100"), then name the preset they mean.
    candidates = [*known, *ALIASES, THIS]
    close = difflib.get_close_matches(key, candidates, n=1, cutoff=0.5)
    hint = ""
    if close:
        hint = f"did you mean {ALIASES.get(close[0], close[0])!r}? "
    return (
        f"unknown device {given!r}; {hint}known devices: {', '.join(known)}, and 'this' (this "
        f"machine, measured); aliases: {', '.join(sorted(ALIASES))}; or pass a dict of numbers "
        f"({', '.join(_REQUIRED_KEYS)}) for another device"
    )


# --------------------------------------------------------------------------------------------
# User-given numbers
# --------------------------------------------------------------------------------------------

_REQUIRED_KEYS = ("memory", "bf16_tflops", "fp32_tflops", "bandwidth_gbps")
_OPTIONAL_KEYS = ("fp16_tflops", "name", "description", "kind")


def _spec_from_numbers(numbers_given: Mapping[str, Any]) -> DeviceSpec:
    accepted = (*_REQUIRED_KEYS, *_OPTIONAL_KEYS)
    unknown = [key for key in numbers_given if key not in accepted]
    if unknown:
        raise UsageError(
            f"device dict: unknown key {unknown[0]!r}; accepted keys: {', '.join(accepted)}"
        )
    missing = [key for key in _REQUIRED_KEYS if key not in numbers_given]
    if missing:
        raise UsageError(
            f"device dict: missing key {missing[0]!r}; required keys: "
            f"{', '.join(_REQUIRED_KEYS)} (memory as bytes or '24GiB', throughput in TFLOP/s, "
            f"bandwidth in GB/s)"
        )
    memory_bytes = _memory_bytes(numbers_given["memory"])
    bf16 = _positive_number("bf16_tflops", numbers_given["bf16_tflops"])
    fp32 = _positive_number("fp32_tflops", numbers_given["fp32_tflops"])
    fp16 = _positive_number("fp16_tflops", numbers_given.get("fp16_tflops", bf16))
    bandwidth = _positive_number("bandwidth_gbps", numbers_given["bandwidth_gbps"])
    text = {}
    for key, default in (
        ("name", "custom"),
        ("description", "user-given numbers"),
        ("kind", "cuda"),
    ):
        value = numbers_given.get(key, default)
        if not isinstance(value, str) or not value.strip():
            raise UsageError(f"device dict: {key!r} must be a non-empty str, got {value!r}")
        text[key] = value.strip()
    if text["kind"] not in ("cuda", "cpu"):
        raise UsageError(f"device dict: 'kind' must be 'cuda' or 'cpu', got {text['kind']!r}")
    return DeviceSpec(
        name=text["name"].lower(),
        description=text["description"],
        memory_bytes=memory_bytes,
        flops_per_second={
            torch.bfloat16: bf16 * TERA,
            torch.float16: fp16 * TERA,
            torch.float32: fp32 * TERA,
        },
        memory_bandwidth_bytes_per_second=bandwidth * GIGA,
        source="given by the user",
        kind=text["kind"],
    )


# The sizes ``gradckpt.budget.parse_budget`` reads, less its budget-only forms ("auto", "60%").
# Not imported from there: devices sits beside budget in the import layers (pyproject.toml).
_SIZE_PATTERN = re.compile(r"(\d+\.?\d*|\.\d+)\s*([a-z]*)")
_UNIT_BYTES = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}


def _memory_bytes(value: Any) -> int:
    """A device's memory from a user: int bytes, or a size such as ``"24GiB"`` / ``"80GB"``."""
    size = None
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        size = int(value)
    elif isinstance(value, str):
        match = _SIZE_PATTERN.fullmatch(value.strip().lower())
        if match and match.group(2) in _UNIT_BYTES:
            size = int(Decimal(match.group(1)) * _UNIT_BYTES[match.group(2)])
    if size is None or size <= 0:
        raise UsageError(
            f"device dict: 'memory' must be bytes (a positive int) or a size such as '24GiB' "
            f"(powers of 1024: KiB, MiB, GiB, TiB) or '80GB' (powers of 1000: KB, MB, GB, TB), "
            f"got {value!r}"
        )
    return size


def _positive_number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise UsageError(
            f"device dict: {key!r} must be a positive number, got {type(value).__name__} {value!r}"
        )
    if not math.isfinite(value) or value <= 0:
        raise UsageError(f"device dict: {key!r} must be a positive number, got {value!r}")
    return float(value)


# --------------------------------------------------------------------------------------------
# "this": the machine at hand, measured once and cached
# --------------------------------------------------------------------------------------------

CACHE_FILE_NAME = "this-device.json"
# Bump when the way of measuring changes, so that old cached numbers are measured over.
_METHOD_VERSION = 1
# Measured dtypes. float16 too: on CPUs it can be 100x slower than float32 (no native support),
# and falling back to float32's figure would then be far off.
_MEASURED_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# A timed sample lasts about this long: long enough to dwarf timer and launch overheads, short
# enough that all of "this" takes about a second on a 2-core CPU.
_SAMPLE_SECONDS = 0.04
_SAMPLES = 3  # best of: noise on a shared machine only ever makes a run slower


def _this_device(*, refresh: bool) -> DeviceSpec:
    kind = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device("cuda", torch.cuda.current_device()) if kind == "cuda" else None
    description, memory_bytes = _cuda_identity(device) if device is not None else _cpu_identity()
    fingerprint = _fingerprint(kind, description)
    path = _cache_path()
    entry = None if refresh else _read_cache(path).get(fingerprint)
    if entry is None or not _valid_entry(entry):
        entry = _measure(device)
        _write_cache(path, fingerprint, entry)
    flops = {getattr(torch, name): rate for name, rate in entry["flops_per_second"].items()}
    return DeviceSpec(
        name=THIS,
        description=f"this machine's {'GPU' if kind == 'cuda' else 'CPU'}: {description}",
        memory_bytes=memory_bytes,
        flops_per_second=flops,
        memory_bandwidth_bytes_per_second=entry["memory_bandwidth_bytes_per_second"],
        source=f"measured here on {entry['measured_at']} ({entry['method']}); cached in {path}",
        kind=kind,
    )


def _cuda_identity(device: torch.device) -> tuple[str, int]:
    properties = torch.cuda.get_device_properties(device)
    return properties.name, int(properties.total_memory)


def _cpu_identity() -> tuple[str, int]:
    """The CPU's model name with the threads torch uses, and the memory this process can have.

    Memory is the capacity, as for a GPU (not what is free now, which is ``"auto"``'s
    business, ``gradckpt.budget.available_bytes``): total RAM, capped by a cgroup (container)
    memory limit where there is one.
    """
    model = platform.processor() or platform.machine() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as file:
            for line in file:
                if line.startswith("model name"):
                    model = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    description = f"{model}, {torch.get_num_threads()} threads"
    memory_bytes = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    limit = _cgroup_limit_bytes()
    if limit is not None:
        memory_bytes = min(memory_bytes, limit)
    return description, int(memory_bytes)


_CGROUP_LIMIT_FILES = (
    "/sys/fs/cgroup/memory.max",  # cgroup v2: "max" when unlimited
    "/sys/fs/cgroup/memory/memory.limit_in_bytes",  # v1: a huge number when unlimited
)


def _cgroup_limit_bytes() -> int | None:
    for path in _CGROUP_LIMIT_FILES:
        try:
            with open(path) as file:
                limit = int(file.read().strip())
        except (OSError, ValueError):
            continue
        return limit if limit < 2**60 else None
    return None


def _fingerprint(kind: str, description: str) -> str:
    """What the measured numbers depend on; a cached entry is used only where all of it agrees."""
    parts = {
        "host": socket.gethostname(),
        "kind": kind,
        "device": description,  # the CPU's model and thread count, or the GPU's name
        "cpus": os.cpu_count(),
        "torch": torch.__version__,
        # "high"/"medium" let fp32 matmuls use TF32/bf16 tensor cores: another fp32 figure.
        "fp32_matmul_precision": torch.get_float32_matmul_precision(),
        "method": _METHOD_VERSION,
    }
    return json.dumps(parts, sort_keys=True)


def _cache_path() -> Path:
    directory = os.environ.get("GRADCKPT_CACHE_DIR")
    if not directory:
        base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        directory = os.path.join(base, "gradckpt")
    return Path(directory) / CACHE_FILE_NAME


def _read_cache(path: Path) -> dict[str, Any]:
    """The cached entries by fingerprint; {} when the file is missing or unreadable (a corrupt
    file is measured over, never an error)."""
    try:
        with open(path) as file:
            content = json.load(file)
    except (OSError, ValueError):
        return {}
    entries = content.get("entries") if isinstance(content, dict) else None
    return entries if isinstance(entries, dict) else {}


def _valid_entry(entry: Any) -> bool:
    try:
        rates = entry["flops_per_second"]
        values = [*rates.values(), entry["memory_bandwidth_bytes_per_second"]]
        return (
            "float32" in rates
            and all(isinstance(getattr(torch, name, None), torch.dtype) for name in rates)
            and all(
                isinstance(value, (int, float)) and math.isfinite(value) and value > 0
                for value in values
            )
            and isinstance(entry["measured_at"], str)
            and isinstance(entry["method"], str)
        )
    except (KeyError, TypeError, AttributeError):
        return False


def _write_cache(path: Path, fingerprint: str, entry: dict[str, Any]) -> None:
    entries = _read_cache(path)
    entries[fingerprint] = entry
    temporary = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # Write a temporary file and rename it: a reader never sees half a file.
        with tempfile.NamedTemporaryFile(
            "w", dir=path.parent, prefix=".this-device-", suffix=".json", delete=False
        ) as file:
            temporary = file.name
            json.dump({"version": 1, "entries": entries}, file, indent=1, sort_keys=True)
        os.replace(temporary, path)
    except OSError as error:
        if temporary is not None and os.path.exists(temporary):
            os.remove(temporary)
        warn_once(
            "devices-cache-unwritable",
            f"gradckpt could not cache this device's measured speed in {path} ({error}); it "
            f"will be measured again in every process. Set GRADCKPT_CACHE_DIR to a writable "
            f"directory.",
        )


def _measure(device: torch.device | None) -> dict[str, Any]:
    """Measure this device's dense matmul throughput per dtype and its copy bandwidth.

    Each benchmark is sized first, then all are timed in turns, ``_SAMPLES`` rounds, keeping
    each one's fastest sample: a burst of load from another process then spoils a sample of
    each rather than every sample of one (the numbers are cached, so a spoiled one would stay).
    """
    benchmarks = {
        str(dtype).removeprefix("torch."): _matmul_benchmark(dtype, device)
        for dtype in _MEASURED_DTYPES
    }
    benchmarks["copy"] = _copy_benchmark(device)
    fastest = dict.fromkeys(benchmarks, math.inf)
    for _ in range(_SAMPLES):
        for key, benchmark in benchmarks.items():
            fastest[key] = min(fastest[key], _timed(benchmark.run, device))
    rates = {key: benchmark.amount / fastest[key] for key, benchmark in benchmarks.items()}
    bandwidth = rates.pop("copy")
    method = (
        f"fastest of {_SAMPLES} rounds: square matmuls ("
        + ", ".join(f"{key} n={benchmarks[key].size}" for key in rates)
        + f"), a copy of {benchmarks['copy'].size / 2**20:.0f} MiB counting bytes read and "
        "written"
    )
    return {
        "flops_per_second": rates,
        "memory_bandwidth_bytes_per_second": bandwidth,
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "method": method,
    }


@dataclass
class _Benchmark:
    run: Callable[[], None]  # one timed sample
    amount: float  # FLOPs or bytes one sample does
    size: int  # matrix side, or bytes copied


def _matmul_benchmark(dtype: torch.dtype, device: torch.device | None) -> _Benchmark:
    """Products of two n x n ``dtype`` matrices (2 n**3 FLOPs each), repeated to fill a sample.

    n grows until one product takes a fair part of a sample (small matrices measure call
    overheads, not the math units) or reaches the largest size allowed.
    """
    largest = 4096
    if device is not None and torch.cuda.mem_get_info(device)[0] >= 16 * GIB:
        largest = 8192  # 8192 x 8192 fp32 operands and product: 768 MiB, held while measuring
    generator = torch.Generator(device=device or "cpu").manual_seed(0)  # the global RNG untouched
    n = 256
    while True:
        a = torch.rand(n, n, generator=generator, device=device).to(dtype)
        b = torch.rand(n, n, generator=generator, device=device).to(dtype)
        # The first calls at a size pay one-off setup (oneDNN builds its kernel, cuBLAS picks
        # one): the fastest of a few is the product's own time.
        seconds = min(_timed(lambda: a @ b, device) for _ in range(3))  # noqa: B023 - used here
        # Past an eighth of a sample, overheads are small and repeats fill the rest; doubling n
        # costs 8x the time (seconds, on a CPU without fp16 units).
        if seconds >= _SAMPLE_SECONDS / 8 or n >= largest:
            break
        # Time grows as n**3: jump most of the way at once, to a multiple of 256.
        grow = (_SAMPLE_SECONDS / max(seconds, 1e-7)) ** (1 / 3)
        n = min(largest, max(2 * n, int(n * grow) // 256 * 256))
    repeats = max(1, math.ceil(_SAMPLE_SECONDS / max(seconds, 1e-7)))

    def products() -> None:
        for _ in range(repeats):
            a @ b

    return _Benchmark(run=products, amount=2 * n**3 * repeats, size=n)


def _copy_benchmark(device: torch.device | None) -> _Benchmark:
    """``b.copy_(a)`` on tensors far larger than any cache, counting the bytes read and the
    bytes written (as STREAM's copy does)."""
    if device is not None:
        free_bytes, _ = torch.cuda.mem_get_info(device)
        size = min(GIB, free_bytes // 8)
    else:
        size = min(256 * 2**20, os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 32)
    a = torch.ones(max(size // 4, 1), dtype=torch.float32, device=device)
    b = torch.zeros_like(a)  # both written once: their pages are mapped before timing
    seconds = min(_timed(lambda: b.copy_(a), device) for _ in range(2))
    repeats = max(1, math.ceil(_SAMPLE_SECONDS / max(seconds, 1e-7)))

    def copies() -> None:
        for _ in range(repeats):
            b.copy_(a)

    return _Benchmark(run=copies, amount=2 * a.nbytes * repeats, size=a.nbytes)


def _timed(work: Callable[[], Any], device: torch.device | None) -> float:
    if device is not None:
        torch.cuda.synchronize(device)  # CUDA runs asynchronously: wait for work queued before
    start = time.perf_counter()
    work()
    if device is not None:
        torch.cuda.synchronize(device)
    return time.perf_counter() - start
