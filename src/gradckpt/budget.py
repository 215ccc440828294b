"""Memory budgets: what a user may write, and how many bytes it means.

A budget is the peak memory of one training step (forward + backward) on the model's device, as
``torch.cuda.max_memory_allocated()`` measures it on CUDA and MemTracker on CPU: the number a user
compares with their GPU (README.md, "Usage"). ``parse_budget`` accepts:

- an ``int``: bytes (a ``float`` that is a whole number of bytes too);
- a size with a unit, case-insensitive, with or without a space: binary ``"512MiB"``,
  ``"6GiB"``, ``"1.5 GiB"`` (KiB, MiB, GiB, TiB, PiB: powers of 1024), decimal ``"500MB"``,
  ``"6GB"`` (KB, MB, GB, TB, PB: powers of 1000), or bytes ``"1024B"``;
- a percentage ``"60%"``: that share of the step's peak without checkpointing, which only a
  profile knows (pass it as ``unconstrained_peak_bytes``);
- ``"auto"``: as much as the device can give this step, described at ``available_bytes``; for a
  profile estimated for another device, what that device has (``device_bytes``).

Refused at once, before anything runs (``check_budget`` checks the form alone), with what was
probably meant: a number in a string without a unit (``"60"``: did you mean ``"60%"`` or
``"60GiB"``? bytes are ``"60B"`` or the int ``60``); a float between 0 and 1 (``0.6``: did you
mean ``"60%"``?); and ``"6G"``, since tools disagree on whether it means 2^30 or 10^9.

Example:
    >>> from gradckpt.budget import format_bytes, parse_budget
    >>> parse_budget("6GiB")
    6442450944
    >>> parse_budget("60%", unconstrained_peak_bytes=1_000_000)
    600000
    >>> format_bytes(parse_budget("1.5 GiB"))
    '1.50 GiB'
    >>> parse_budget("60")
    Traceback (most recent call last):
    ...
    gradckpt.errors.UsageError: budget '60': a bare number is bytes; did you mean '60%' or ...
"""

from __future__ import annotations

import math
import numbers
import os
import re
from decimal import Decimal, InvalidOperation

import torch

from .errors import UsageError

__all__ = ["parse_budget", "check_budget", "format_bytes", "rounded_up_budget",
           "available_bytes"]

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

# Any peak will do to check a percentage's form: the real one is only known from a profile. A
# small one (such as 1) would turn "60%" into 0 bytes, which parse_budget rightly refuses.
_PEAK_FOR_FORM_CHECK_BYTES = 1 << 50

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
    device_bytes: int | None = None,
) -> int:
    """The budget in bytes, from any of the forms listed at the top of this module.

    Args:
        budget: bytes (int), a size such as ``"6GiB"`` or ``"500MB"``, a percentage such as
            ``"60%"``, or ``"auto"``.
        unconstrained_peak_bytes: the step's peak without checkpointing; needed by percentages.
        device: where the step runs, for ``"auto"``; see ``available_bytes``.
        device_bytes: for ``"auto"`` on a device other than this machine's (a profile from
            ``gradckpt.estimate``): what that device has for the step's peak, its
            ``notes["device_usable_bytes"]``. Given, ``"auto"`` is this and ``device`` is not
            read; ``gradckpt.solve`` passes it for every estimated profile.

    Raises ``UsageError`` for anything else, for a negative budget or one of zero bytes, for
    a percentage outside (0, 100], and for the slips the module names (``"60"``, ``0.6``).

    Example:
        >>> parse_budget(2048), parse_budget("2 KiB"), parse_budget("2kb"), parse_budget("2048B")
        (2048, 2048, 2000, 2048)
        >>> parse_budget("0.5%", unconstrained_peak_bytes=10_000)
        50
        >>> parse_budget("auto", device="cpu") > 0
        True
        >>> parse_budget("auto", device_bytes=22 * 2**30) == 22 * 2**30  # an estimate's target
        True
        >>> parse_budget("6 gigs")
        Traceback (most recent call last):
        ...
        gradckpt.errors.UsageError: budget '6 gigs' not understood; use bytes (int), '6GiB', ...
        >>> parse_budget(0.6)
        Traceback (most recent call last):
        ...
        gradckpt.errors.UsageError: budget 0.6: a bare number is bytes, and 0.6 is less than one; did you mean '60%'?
    """  # noqa: E501  (a doctest's output is one line)
    if isinstance(budget, bool):  # bool is an int subclass: True would otherwise mean 1 byte
        raise UsageError(f"budget {budget!r} is a bool, not a memory size; {_ACCEPTED_FORMS}")
    if isinstance(budget, numbers.Integral):
        return _positive(int(budget), given=budget)
    if isinstance(budget, float):
        if 0 < budget < 1:  # a share written as a fraction, surely not a fraction of a byte
            raise UsageError(_bare_number_message(budget, Decimal(repr(budget))))
        if not math.isfinite(budget) or not budget.is_integer():
            raise UsageError(f"budget {budget!r} is not a whole number of bytes; {_ACCEPTED_FORMS}")
        return _positive(int(budget), given=budget)
    if not isinstance(budget, str):
        raise UsageError(
            f"budget must be an int or a str, got {type(budget).__name__}; {_ACCEPTED_FORMS}"
        )

    text = budget.strip().lower()
    if text == "auto":
        if device_bytes is None:
            return available_bytes(device)
        if isinstance(device_bytes, bool) or not isinstance(device_bytes, numbers.Integral):
            raise UsageError(f"device_bytes must be an int (bytes the device has for the "
                             f"step's peak) or None, got {device_bytes!r}")
        return _positive(int(device_bytes), given=budget)

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
                if not unit and size > 0:  # "60": bytes by the letter, a slip by the intent
                    raise UsageError(_bare_number_message(budget, size))
                return _positive(int(size), given=budget)

    raise UsageError(f"budget {budget!r} not understood; {_ACCEPTED_FORMS}")


def check_budget(budget: int | str) -> None:
    """Raise ``UsageError`` now if ``budget`` is not a budget ``parse_budget`` reads, before
    anything slow runs: its form alone, with no profile and no device needed (``"auto"`` and
    percentages pass; what they come to is known later).

    Example:
        >>> check_budget("6GiB"), check_budget("60%"), check_budget("auto"), check_budget(2**30)
        (None, None, None, None)
        >>> check_budget("150%")
        Traceback (most recent call last):
        ...
        gradckpt.errors.UsageError: budget '150%': a percentage must be above 0% and at most ...
        >>> check_budget("60")
        Traceback (most recent call last):
        ...
        gradckpt.errors.UsageError: budget '60': a bare number is bytes; did you mean '60%' or ...
    """
    if isinstance(budget, str) and budget.strip().lower() == "auto":
        return  # read when the step's device is known: reading it now could start CUDA
    parse_budget(budget, unconstrained_peak_bytes=_PEAK_FOR_FORM_CHECK_BYTES)


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


def rounded_up_budget(n_bytes: int) -> str:
    """A budget of at least ``n_bytes`` as a user types it: two decimals of the largest binary
    unit it has one of, rounded up, so that planning again with it always works (what
    ``gradckpt plan`` says to rerun with, after a ``BudgetError``'s ``minimum_bytes``).

    ``parse_budget`` reads it back as at least ``n_bytes`` and at most a hundredth of its unit
    more.

    Example:
        >>> rounded_up_budget(65_326_459_290)  # 62300.10 MiB is 60.84 GiB and a bit
        '60.85GiB'
        >>> rounded_up_budget(26_876_283), rounded_up_budget(2**20), rounded_up_budget(1000)
        ('25.64MiB', '1.00MiB', '1000B')
        >>> rounded_up_budget(2**30 - 1)  # 1023.999... MiB: not '1024.00MiB'
        '1.00GiB'
    """
    if n_bytes < 1024:
        return f"{max(int(n_bytes), 1)}B"
    exponent = 1
    while exponent < len(_BINARY_UNITS) - 1 and n_bytes >= 1024 ** (exponent + 1):
        exponent += 1
    hundredths = -(-int(n_bytes) * 100 // 1024**exponent)  # integers: rounded up exactly
    if hundredths >= 1024 * 100 and exponent < len(_BINARY_UNITS) - 1:
        exponent, hundredths = exponent + 1, 100  # 1024.00 of a unit is 1.00 of the next
    return f"{hundredths // 100}.{hundredths % 100:02d}{_BINARY_UNITS[exponent]}"


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


def _bare_number_message(given: float | str, value: Decimal) -> str:
    """Why a unitless number in a string (or a float below 1) is refused, and what was meant.

    Example:
        >>> _bare_number_message("60", Decimal(60))
        "budget '60': a bare number is bytes; did you mean '60%' or '60GiB'? (for 60 bytes write '60B' or pass the int 60)"
        >>> _bare_number_message(0.6, Decimal("0.6"))
        "budget 0.6: a bare number is bytes, and 0.6 is less than one; did you mean '60%'?"
        >>> _bare_number_message("8000", Decimal(8000))
        "budget '8000': a bare number is bytes; did you mean '8000MiB'? (for 8000 bytes write '8000B' or pass the int 8000)"
        >>> _bare_number_message("6e9", Decimal("6e9"))
        "budget '6e9': a bare number is bytes; write '6e9B' (5.59 GiB) or pass the int 6000000000"
    """  # noqa: E501  (a doctest's output is one line)
    written = given.strip() if isinstance(given, str) else repr(given)
    if value < 1:  # a share written as a fraction
        percent = f"{float(value * 100):g}"
        return (f"budget {given!r}: a bare number is bytes, and {written} is less than one; "
                f"did you mean '{percent}%'?")
    whole = int(value)
    if value >= 2**20:  # bytes, most likely: say how to write them
        return (f"budget {given!r}: a bare number is bytes; write '{written}B' "
                f"({format_bytes(whole)}) or pass the int {whole}")
    # Up to 100: a share or GiB, what budgets of a GPU usually are; above: MiB.
    meant = f"'{written}%' or '{written}GiB'" if value <= 100 else f"'{written}MiB'"
    as_bytes = ""
    if value == whole:
        unit = "byte" if whole == 1 else "bytes"
        as_bytes = f" (for {whole} {unit} write '{written}B' or pass the int {whole})"
    return f"budget {given!r}: a bare number is bytes; did you mean {meant}?{as_bytes}"


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
