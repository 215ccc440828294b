"""Memory budgets: what a user may write, and how many bytes it means.

A budget is the peak memory of one training step (forward + backward) on the model's device, as
``torch.cuda.max_memory_allocated()`` measures it on CUDA and MemTracker on CPU: the number a user
compares with their GPU (README.md, "Usage"). ``parse_budget`` accepts:

- an ``int``: bytes;
- a size with a unit, case-insensitive, with or without a space: binary ``"512MiB"``,
  ``"6GiB"``, ``"1.5 GiB"`` (KiB, MiB, GiB, TiB, PiB: powers of 1024), decimal ``"500MB"``,
  ``"6GB"`` (KB, MB, GB, TB, PB: powers of 1000), or bytes ``"1024"`` / ``"1024B"``. A bare
  ``"6G"`` is refused: tools disagree on whether it means 2^30 or 10^9;
- a percentage ``"60%"``: that share of the step's peak without checkpointing, which only a
  profile knows (pass it as ``unconstrained_peak_bytes``);
- ``"auto"``: as much as the device can give this step, described at ``available_bytes``.

Example:
    >>> from gradckpt.budget import format_bytes, parse_budget
    >>> parse_budget("6GiB")
    6442450944
    >>> parse_budget("60%", unconstrained_peak_bytes=1_000_000)
    600000
    >>> format_bytes(parse_budget("1.5 GiB"))
    '1.50 GiB'
"""

from __future__ import annotations

import math
import numbers
import os
import re
from decimal import Decimal, InvalidOperation

import torch

from .errors import UsageError

__all__ = ["parse_budget", "format_bytes", "available_bytes"]

_UNIT_BYTES = {
    "": 1,
    "b": 1,
    "kb": 1000,
    "mb": 1000**2,
    "gb": 1000**3,
    "tb": 1000**4,
    "pb": 1000**5,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
    "pib": 1024**5,
}
_BINARY_UNITS = ["B", "KiB", "MiB", "GiB", "TiB", "PiB"]

# A number (optionally signed, with a fraction or an exponent), optional spaces, letters.
_SIZE_PATTERN = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?)\s*([a-z]*)")
_PERCENT_PATTERN = re.compile(r"([+-]?(?:\d+\.?\d*|\.\d+))\s*%")

_ACCEPTED_FORMS = "use bytes (int), '6GiB', '512MiB', '6GB', '500MB', '60%' or 'auto'"

# "auto" promises only this share of the memory a step could still get: the allocator loses some
# to fragmentation (blocks cached but too small to reuse), which the GPU counts and
# max_memory_allocated() does not.
_AUTO_USABLE_SHARE = 0.9

# Where Linux reports memory; module attributes so that tests can point them at fake files.
_PROC_MEMINFO = "/proc/meminfo"
_CGROUP_ROOT = "/sys/fs/cgroup"


def parse_budget(
    budget: int | str,
    *,
    unconstrained_peak_bytes: int | None = None,
    device: torch.device | str | None = None,
) -> int:
    """The budget in bytes, from any of the forms listed at the top of this module.

    Args:
        budget: bytes (int), a size such as ``"6GiB"`` or ``"500MB"``, a percentage such as
            ``"60%"``, or ``"auto"``.
        unconstrained_peak_bytes: the step's peak without checkpointing; needed by percentages.
        device: where the step runs, for ``"auto"``; see ``available_bytes``.

    Raises ``UsageError`` for anything else, for a negative budget or one of zero bytes, and
    for a percentage outside (0, 100].

    Example:
        >>> parse_budget(2048), parse_budget("2 KiB"), parse_budget("2kb"), parse_budget("2048B")
        (2048, 2048, 2000, 2048)
        >>> parse_budget("0.5%", unconstrained_peak_bytes=10_000)
        50
        >>> parse_budget("auto", device="cpu") > 0
        True
        >>> parse_budget("6 gigs")
        Traceback (most recent call last):
        ...
        gradckpt.errors.UsageError: budget '6 gigs' not understood; use bytes (int), '6GiB', ...
    """
    if isinstance(budget, bool):  # bool is an int subclass: True would otherwise mean 1 byte
        raise UsageError(f"budget {budget!r} is a bool, not a memory size; {_ACCEPTED_FORMS}")
    if isinstance(budget, numbers.Integral):
        return _positive(int(budget), given=budget)
    if isinstance(budget, float):
        if not math.isfinite(budget) or not budget.is_integer():
            raise UsageError(f"budget {budget!r} is not a whole number of bytes; {_ACCEPTED_FORMS}")
        return _positive(int(budget), given=budget)
    if not isinstance(budget, str):
        raise UsageError(
            f"budget must be an int or a str, got {type(budget).__name__}; {_ACCEPTED_FORMS}"
        )

    text = budget.strip().lower()
    if text == "auto":
        return available_bytes(device)

    percent_match = _PERCENT_PATTERN.fullmatch(text)
    if percent_match:
        percent = Decimal(percent_match.group(1))
        if not 0 < percent <= 100:
            raise UsageError(
                f"budget {budget!r}: a percentage must be above 0% and at most 100% of the "
                f"peak without checkpointing"
            )
        if unconstrained_peak_bytes is None:
            raise UsageError(
                f"budget {budget!r} is a share of the step's peak memory without "
                f"checkpointing, which is only known from a profile: pass "
                f"unconstrained_peak_bytes=profile.peak_bytes, or give the budget in bytes "
                f"('6GiB')"
            )
        if (
            isinstance(unconstrained_peak_bytes, bool)
            or not isinstance(unconstrained_peak_bytes, numbers.Integral)
            or unconstrained_peak_bytes <= 0
        ):
            raise UsageError(
                f"unconstrained_peak_bytes must be a positive int (the step's peak without "
                f"checkpointing, in bytes), got {unconstrained_peak_bytes!r}"
            )
        return _positive(int(unconstrained_peak_bytes * percent / 100), given=budget)

    size_match = _SIZE_PATTERN.fullmatch(text)
    if size_match:
        number, unit = size_match.groups()
        if unit in ("k", "m", "g", "t", "p"):
            power = "kmgtp".index(unit) + 1
            prefix = unit.upper()
            raise UsageError(
                f"budget {budget!r} is ambiguous: write '{number}{prefix}iB' for "
                f"{number} * 2**{10 * power} bytes or '{number}{prefix}B' for "
                f"{number} * 10**{3 * power} bytes"
            )
        if unit in _UNIT_BYTES:
            try:
                size = Decimal(number) * _UNIT_BYTES[unit]  # exact: "1.1 GiB" is no float
            except InvalidOperation:  # pragma: no cover - the pattern only lets numbers in
                size = None
            if size is not None:
                return _positive(int(size), given=budget)

    raise UsageError(f"budget {budget!r} not understood; {_ACCEPTED_FORMS}")


def available_bytes(device: torch.device | str | None = None) -> int:
    """What ``"auto"`` means: the largest peak a training step on ``device`` should reach.

    The budget is judged on the step's peak as measured, and that peak counts every tensor the
    process holds, the model's parameters included (README.md). So:

    - CUDA: what this process's tensors hold already (``torch.cuda.memory_allocated``), plus
      90% of what they could still get: the memory free on the device
      (``torch.cuda.mem_get_info``) and the memory PyTorch's allocator has cached but is not
      using (``memory_reserved - memory_allocated``). The 10% held back covers the allocator's
      fragmentation, which the GPU counts and ``max_memory_allocated`` does not. Memory other
      processes use is not free, and so is not counted.
    - CPU: 90% of the memory the system can give without swapping: ``MemAvailable`` from
      ``/proc/meminfo``, capped by the room left under a cgroup memory limit (a container's),
      or free pages from ``os.sysconf`` where there is no ``/proc/meminfo``. Tensors already
      alive are not added (on CPU nothing tells their bytes apart from the rest of the
      process), so on CPU "auto" is low by the size of the model's parameters.

    ``device=None`` means the current CUDA device when there is one, else the CPU.

    Example:
        >>> available_bytes("cpu") > 0
        True
    """
    if device is None:
        device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(device)

    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise UsageError(
                f"budget 'auto' on {device}: torch sees no CUDA device; pass device='cpu' or a "
                f"budget in bytes"
            )
        free_bytes, _ = torch.cuda.mem_get_info(device)
        allocated_bytes = torch.cuda.memory_allocated(device)
        cached_unused_bytes = torch.cuda.memory_reserved(device) - allocated_bytes
        obtainable_bytes = free_bytes + cached_unused_bytes
        return allocated_bytes + int(_AUTO_USABLE_SHARE * obtainable_bytes)

    if device.type == "cpu":
        return int(_AUTO_USABLE_SHARE * _cpu_obtainable_bytes())

    raise UsageError(
        f"budget 'auto' supports cuda and cpu devices, not {device.type!r}; give the budget in "
        f"bytes ('6GiB')"
    )


def format_bytes(n: int) -> str:
    """``n`` bytes in binary units with two decimals, for messages and tables.

    ``parse_budget`` reads the result back (to within the rounding of the last digit).

    Example:
        >>> format_bytes(123), format_bytes(512 * 2**20), format_bytes(3 * 2**29)
        ('123 B', '512.00 MiB', '1.50 GiB')
        >>> format_bytes(-2048)
        '-2.00 KiB'
    """
    sign = "-" if n < 0 else ""
    magnitude = abs(int(n))
    if magnitude < 1024:
        return f"{sign}{magnitude} B"
    exponent = 0
    while exponent < len(_BINARY_UNITS) - 1 and magnitude >= 1024 ** (exponent + 1):
        exponent += 1
    value = magnitude / 1024**exponent
    if f"{value:.2f}" == "1024.00" and exponent < len(_BINARY_UNITS) - 1:
        exponent, value = exponent + 1, value / 1024  # 1048575 B is "1.00 MiB", not "1024.00 KiB"
    return f"{sign}{value:.2f} {_BINARY_UNITS[exponent]}"


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _positive(size: int, *, given: object) -> int:
    if size < 0:  # "-1GiB" is no typo of a size: say what a budget is rather than its bytes
        raise UsageError(
            f"budget {given!r} is negative; a budget is the step's peak memory, a positive "
            f"size ({_ACCEPTED_FORMS})"
        )
    if size == 0:
        raise UsageError(
            f"budget {given!r} is {size} bytes; a budget must be more than 0 bytes "
            f"({_ACCEPTED_FORMS})"
        )
    return size


def _cpu_obtainable_bytes() -> int:
    """Bytes a new allocation can get on this machine without swapping."""
    meminfo = _read_key_values(_PROC_MEMINFO)
    if "MemAvailable" in meminfo:
        obtainable = meminfo["MemAvailable"] * 1024  # /proc/meminfo counts kB
    else:
        try:
            obtainable = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        except (AttributeError, ValueError, OSError) as error:
            raise UsageError(
                "budget 'auto': cannot tell how much memory this machine has free (no "
                "/proc/meminfo, no os.sysconf('SC_AVPHYS_PAGES')); give the budget in bytes "
                "('6GiB')"
            ) from error
    cgroup_room = _cgroup_room_bytes()
    return obtainable if cgroup_room is None else min(obtainable, cgroup_room)


def _cgroup_room_bytes() -> int | None:
    """Room left under this process's cgroup memory limit (v2, else v1); None without a limit.

    Page cache counts as used in a cgroup but is given back under pressure, so the inactive part
    of it counts as room (as ``docker stats`` does).
    """
    for limit_file, usage_file, stat_file, inactive_key in (
        ("memory.max", "memory.current", "memory.stat", "inactive_file"),
        (
            "memory/memory.limit_in_bytes",
            "memory/memory.usage_in_bytes",
            "memory/memory.stat",
            "total_inactive_file",
        ),
    ):
        limit = _read_int(os.path.join(_CGROUP_ROOT, limit_file))
        usage = _read_int(os.path.join(_CGROUP_ROOT, usage_file))
        if limit is None or usage is None:
            continue
        if limit >= 2**60:  # "no limit" in cgroup v1 is a huge number (v2 writes "max")
            return None
        inactive = _read_key_values(os.path.join(_CGROUP_ROOT, stat_file)).get(inactive_key, 0)
        return max(limit - usage + inactive, 0)
    return None


def _read_int(path: str) -> int | None:
    try:
        with open(path) as file:
            return int(file.read().strip())
    except (OSError, ValueError):  # missing, unreadable, or "max" (no limit)
        return None


def _read_key_values(path: str) -> dict[str, int]:
    """``key value`` or ``Key: value kB`` lines as {key: value}; {} when the file is missing."""
    values: dict[str, int] = {}
    try:
        with open(path) as file:
            for line in file:
                parts = line.replace(":", " ").split()
                if len(parts) >= 2 and parts[1].isdigit():
                    values[parts[0]] = int(parts[1])
    except OSError:
        pass
    return values
