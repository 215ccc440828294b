"""Target devices: what a GPU can hold and how fast it can go, for ``gradckpt.estimate``.

``estimate`` predicts a training step's memory and time for a device this machine may not have.
Its time model is a roofline per operation: the larger of the operation's FLOPs over the
device's dense throughput for the operation's dtype and the bytes it moves over the device's
memory bandwidth (``DeviceSpec.seconds``). This module holds those numbers:

- presets for the GPUs people train on (``DEVICES``), the vendor's figures, each with its
  source; other names for them (``ALIASES``), among them what ``torch.cuda.get_device_name()``
  prints;
- ``"this"``: the machine at hand, its GPU if torch sees one, else its CPU; its throughput and
  bandwidth are measured once and cached (``device_spec``);
- a dict of numbers a user gives for any other device.

``device_spec`` turns any of these into a ``DeviceSpec``; ``format_device`` prints one in a line.
docs/devices.md lists every figure and where it comes from.

Example:
    >>> from gradckpt.predict.devices import device_spec, format_device
    >>> h100 = device_spec("H100")
    >>> h100.name, h100.memory_bytes == 80 * 2**30
    ('h100-80gb', True)
    >>> print(format_device(h100))
    h100-80gb (NVIDIA H100 SXM5 80GB: 80.00 GiB, 989.5 TFLOP/s bf16, 67 TFLOP/s fp32, 3.35 TB/s)
"""

from __future__ import annotations

import math
import numbers
import re
from collections.abc import Mapping
from decimal import Decimal
from typing import Any

import torch

from ...errors import UsageError, did_you_mean, either
from .presets import (
    ALIASES,
    AMBIGUOUS,
    DEVICES,
    FAMILIES,
    HOST_LINKS,
    family_of,
    host_link_bytes_per_second,
)
from .spec import GIB, GIGA, TERA, DeviceSpec
from .this_machine import THIS, _this_device

__all__ = [
    "ALIASES", "AMBIGUOUS", "DEVICES", "FAMILIES", "HOST_LINKS", "THIS", "DeviceSpec",
    "device_spec", "family_of", "format_device", "host_link_bytes_per_second",
]


def device_spec(
    device: str | DeviceSpec | Mapping[str, Any] | None = THIS, *, refresh: bool = False
) -> DeviceSpec:
    """The ``DeviceSpec`` a device argument means.

    Args:
        device: one of
            - a preset name from ``DEVICES`` (``"h100-80gb"``), case-insensitive, spaces and
              ``_`` read as ``-``, with aliases from ``ALIASES`` (``"H100"``, ``"a100"``,
              ``"4090"``, ``"A6000"``) and an optional ``"nvidia "`` / ``"geforce "`` /
              ``"tesla "`` in front, so what ``torch.cuda.get_device_name()`` prints works
              (``"NVIDIA RTX A6000"``, ``"Tesla T4"``);
            - ``"this"`` or ``None``: this machine, its current CUDA GPU when torch sees one,
              else its CPU. Throughput and bandwidth are measured once (about a second) and
              cached in ``$GRADCKPT_CACHE_DIR`` (default ``$XDG_CACHE_HOME/gradckpt``, i.e.
              ``~/.cache/gradckpt``), file ``this-device.json``, per machine, device, torch
              version, thread count and fp32 matmul precision; memory is read each time;
            - a dict of numbers for any other device: ``memory`` (bytes, or a size such as
              ``"24GiB"``), ``bf16_tflops``, ``fp32_tflops``, ``bandwidth_gbps`` (GB/s,
              10**9 bytes per second, as datasheets print it), and optionally ``fp16_tflops``
              (default: ``bf16_tflops``), ``int8_tops`` (dense INT8 tensor-core TOPS, the rate
              of an 8-bit base's int8 matmul; default: none, which times it at
              ``fp32_tflops``), ``name`` (default ``"custom"``), ``description``,
              ``kind`` (``"cuda"`` or ``"cpu"``) and ``compute_capability`` (``"9.0"``; it
              decides which attention kernel the estimate assumes; default ``"8.0"``'s rules);
            - a ``DeviceSpec``, returned as it is.
        refresh: measure ``"this"`` again even when the cache holds it (other devices ignore it).

    Raises ``UsageError`` for an unknown name (listing the known ones and, for a name of a
    product line gradckpt knows, the closest presets of that line only: an unknown RTX
    workstation name is never offered an A100), for a name of several presets (``"v100"``:
    ``AMBIGUOUS``, listing them) and for a dict with a missing, unknown, mistyped or
    non-positive entry (naming it).

    Example:
        >>> device_spec("a100").name, device_spec("NVIDIA GeForce RTX 4090").name
        ('a100-80gb', 'rtx4090-24gb')
        >>> device_spec("A6000").name, device_spec("Tesla V100-SXM2-16GB").name
        ('a6000-48gb', 'v100-16gb')
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
    if key in AMBIGUOUS:
        choices = [f"{name!r} ({DEVICES[name].description})" for name in AMBIGUOUS[key]]
        raise UsageError(
            f"device {device!r} could be any of {len(choices)} presets that differ in memory or "
            f"speed: {either(choices, quote=False)}; name one"
        )
    raise UsageError(_unknown_device_message(device, key))


def format_device(spec: DeviceSpec) -> str:
    """One line naming ``spec`` and its headline figures, for plans and the CLI.

    Throughput is shown to 4 significant digits in TFLOP/s, bandwidth in TB/s (10**12 B/s).

    A device without bf16 hardware shows its fp16 figure instead.

    Example:
        >>> print(format_device(DEVICES["l4-24gb"]))
        l4-24gb (NVIDIA L4 24GB: 24.00 GiB, 121 TFLOP/s bf16, 30.3 TFLOP/s fp32, 0.3 TB/s)
        >>> print(format_device(DEVICES["t4-16gb"]))
        t4-16gb (NVIDIA T4 16GB: 16.00 GiB, 65 TFLOP/s fp16 (no bf16), 8.1 TFLOP/s fp32, 0.32 TB/s)
    """
    rates = spec.flops_per_second
    if torch.bfloat16 in spec.unsupported_dtypes:
        half = f"{rates[torch.float16] / TERA:.4g} TFLOP/s fp16 (no bf16)"
    else:
        half = f"{rates.get(torch.bfloat16, rates[torch.float32]) / TERA:.4g} TFLOP/s bf16"
    return (
        f"{spec.name} ({spec.description}: {spec.memory_bytes / GIB:.2f} GiB, {half}, "
        f"{rates[torch.float32] / TERA:.4g} TFLOP/s fp32, "
        f"{spec.memory_bandwidth_bytes_per_second / TERA:.4g} TB/s)"
    )


# --------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------


def _normalize(name: str) -> str:
    key = "-".join(name.strip().lower().replace("_", " ").split())
    for prefix in ("nvidia-", "geforce-", "tesla-"):
        key = key.removeprefix(prefix)
    return key


def _unknown_device_message(given: str, key: str) -> str:
    """Did-you-mean only within the name's product line (``FAMILIES``): a misspelt card is
    offered the close presets of its own line, or that line's presets when none is close, and
    never a card of another line; a name of no line is offered no card.

    Example:
        >>> import textwrap
        >>> print(textwrap.fill(_unknown_device_message("A30", "a30").split(" known")[0], 80))
        unknown device 'A30'; no preset is close to it in the NVIDIA A100 / A10G line,
        whose presets are 'a100-80gb', 'a100-40gb' or 'a10g-24gb';
    """
    known = sorted(DEVICES)
    family = family_of(key)
    if family is None:
        hint = did_you_mean(key, [THIS]) or ";"
    else:
        # Match against the line's aliases too ("h10" is nearest "h100"), then name the preset
        # they mean.
        names = [*family.presets,
                 *(alias for alias, name in ALIASES.items() if name in family.presets)]
        hint = did_you_mean(key, names, aliases=ALIASES) or (
            f"; no preset is close to it in {family.description}, whose presets are "
            f"{either(list(family.presets))};"
        )
    return (
        f"unknown device {given!r}{hint} known devices: {', '.join(known)}, and 'this' (this "
        f"machine, measured); names as torch.cuda.get_device_name() prints them and the "
        f"aliases in docs/devices.md work too; or pass a dict of numbers "
        f"({', '.join(_REQUIRED_KEYS)}) for another device"
    )


# --------------------------------------------------------------------------------------------
# User-given numbers
# --------------------------------------------------------------------------------------------

_REQUIRED_KEYS = ("memory", "bf16_tflops", "fp32_tflops", "bandwidth_gbps")
_OPTIONAL_KEYS = ("fp16_tflops", "int8_tops", "name", "description", "kind",
                  "compute_capability")


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
    flops = {torch.bfloat16: bf16 * TERA, torch.float16: fp16 * TERA, torch.float32: fp32 * TERA}
    if "int8_tops" in numbers_given:
        flops[torch.int8] = _positive_number("int8_tops", numbers_given["int8_tops"]) * TERA
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
        flops_per_second=flops,
        memory_bandwidth_bytes_per_second=bandwidth * GIGA,
        source="given by the user",
        kind=text["kind"],
        compute_capability=_capability(numbers_given.get("compute_capability")),
    )


def _capability(value: Any) -> tuple[int, int] | None:
    """``"9.0"``, ``9.0``, ``[9, 0]`` or ``(9, 0)`` as ``(9, 0)``; ``None`` stays ``None``."""
    if value is None:
        return None
    if isinstance(value, (list, tuple)) and len(value) == 2:
        parts: Any = value
    else:
        parts = str(value).strip().split(".")
    try:
        major, minor = (int(part) for part in parts)
    except (TypeError, ValueError):
        raise UsageError(
            f"device dict: 'compute_capability' must look like \"9.0\" or [9, 0] (the GPU's "
            f"CUDA compute capability), got {value!r}"
        ) from None
    return (major, minor)


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
