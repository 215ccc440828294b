"""The clock measuring reads: the wall clock, or, for ``estimate``, time modeled per operation.

``profile`` times a real step with ``time.perf_counter``. ``estimate`` runs the same measuring
code on fake tensors, where an operation takes no time worth knowing; there a modeled clock
(``gradckpt.predict.clock.ModeledClock``) is active, and ``now()`` reads the seconds the
operations dispatched so far would take on the target device. This module is only the switch
between the two, so that measuring needs nothing of prediction.

A modeled clock counts in ``Seconds``: floats that also hold their value exactly, so that the
time between two readings is the exact sum of the operations in between, rounded once, however
long the clock had run before. With plain floats, ``(t + d) - t`` loses the low bits of ``d``
to the size of ``t``: the same block timed at two moments of an estimate differed in its last
bits, and the op-level choices built from those times (a knapsack over equal-time operations)
came out differently with what the estimate had measured before.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator
from typing import Any, Protocol

__all__ = ["BOOKKEEPING", "ModeledTime", "Seconds", "bookkeeping", "entered", "left", "modeled",
           "modeled_device_kind", "now", "set_aside"]

# Every float is a whole multiple of 2**-1074 (the smallest subnormal): in these ticks any sum
# of floats is exact.
_TICKS_PER_SECOND = 1 << 1074


class Seconds(float):
    """A time in seconds that also keeps its exact value in ticks: differences, sums and
    whole multiples of two ``Seconds`` are exact (then rounded once to the float they are);
    anything else is float arithmetic.

    Example:
        >>> start, step = Seconds.of(1e9), Seconds.of(1e-9)
        >>> (start + step) - start == step  # with floats: 0.0
        True
        >>> float((1e9 + 1e-9) - 1e9)
        0.0
    """

    __slots__ = ("ticks",)
    ticks: int

    def __new__(cls, ticks: int) -> Seconds:
        value = super().__new__(cls, ticks / _TICKS_PER_SECOND)  # int / int: rounded once
        value.ticks = ticks
        return value

    @classmethod
    def of(cls, seconds: float) -> Seconds:
        """``seconds`` (a float, or ``Seconds``) in exact ticks."""
        if isinstance(seconds, Seconds):
            return seconds
        numerator, denominator = float(seconds).as_integer_ratio()
        return cls(numerator * (_TICKS_PER_SECOND // denominator))

    def __add__(self, other: Any) -> Any:
        if isinstance(other, Seconds):
            return Seconds(self.ticks + other.ticks)
        return float(self) + other

    def __radd__(self, other: Any) -> Any:
        return other + float(self)

    def __sub__(self, other: Any) -> Any:
        if isinstance(other, Seconds):
            return Seconds(self.ticks - other.ticks)
        return float(self) - other

    def __rsub__(self, other: Any) -> Any:
        return other - float(self)

    def __mul__(self, other: Any) -> Any:
        if isinstance(other, int) and not isinstance(other, bool):
            return Seconds(self.ticks * other)
        return float(self) * other

    __rmul__ = __mul__

    def __reduce__(self) -> Any:
        return (float, (float(self),))  # pickled, copied, sent: a plain float


class ModeledTime(Protocol):
    """What ``now()`` reads of a modeled clock: the seconds modeled so far (``Seconds``, for
    exact differences, or a float), and the device they are modeled for (its ``kind``,
    ``"cuda"`` or ``"cpu"``, if it says)."""

    elapsed: float
    device: Any


class _ActiveClocks(threading.local):
    """The modeled clocks entered on this thread, innermost last. Per thread, as torch's
    dispatch modes are: a modeled clock counts this thread's operations only, so another
    thread profiling a real model at the same time must keep reading the wall clock."""

    def __init__(self) -> None:
        self.stack: list[ModeledTime] = []
        self.bookkeeping = 0  # inside a meter's own bookkeeping (``Bookkeeping``), how deep

    def __bool__(self) -> bool:
        return bool(self.stack)

    def __getitem__(self, index: int) -> ModeledTime:
        return self.stack[index]

    def append(self, clock: ModeledTime) -> None:
        self.stack.append(clock)

    def remove(self, clock: ModeledTime) -> None:
        self.stack.remove(clock)


_active = _ActiveClocks()


def now() -> float:
    """Seconds on the active clock: the innermost modeled one, else the wall's."""
    if _active:
        return _active[-1].elapsed
    return time.perf_counter()


def modeled() -> bool:
    """Whether ``now()`` reads a modeled clock (the step runs on fake tensors)."""
    return bool(_active)


def modeled_device_kind() -> str | None:
    """The kind of device (``"cuda"``, ``"cpu"``) the active modeled clock times, if it
    says (``DeviceSpec.kind``); None outside one. Code that picks an implementation by device
    (an optimizer's ``foreach``) picks the target's, not the fake tensors' CPU."""
    if not _active:
        return None
    return getattr(_active[-1].device, "kind", None)


def entered(clock: ModeledTime) -> None:
    """``clock`` is now what ``now()`` reads on this thread (until ``left(clock)``)."""
    _active.append(clock)


def left(clock: ModeledTime) -> None:
    """``clock`` is no longer read; the one entered before it, or the wall clock, is."""
    _active.remove(clock)


@contextlib.contextmanager
def set_aside() -> Iterator[None]:
    """Operations inside run untimed, for work that measures nothing (checking that two blocks
    compute alike): the active modeled clock, where it is the innermost dispatch mode, steps out
    for the duration and its reading stays as it was. Elsewhere nothing changes.

    Example:
        >>> before = now()
        >>> with set_aside():  # no modeled clock here: the wall clock goes on
        ...     pass
        >>> now() >= before
        True
    """
    from torch.utils._python_dispatch import _get_current_dispatch_mode, _pop_mode_temporarily

    if _active and _get_current_dispatch_mode() is _active[-1]:
        with _pop_mode_temporarily():
            yield
    else:
        yield


class _Bookkeeping:
    """``with BOOKKEEPING:`` marks a meter's own work between the step's operations (asking
    fake tensors about their storage, which fake tensors answer with operations of their own):
    a modeled clock does not time it, so that a step metered takes the time it takes unmetered.
    """

    def __enter__(self) -> None:
        _active.bookkeeping += 1

    def __exit__(self, *exc: object) -> None:
        _active.bookkeeping -= 1


BOOKKEEPING = _Bookkeeping()


def bookkeeping() -> bool:
    """Whether this thread is inside ``BOOKKEEPING`` (a modeled clock times nothing then).

    Example:
        >>> with BOOKKEEPING:
        ...     inside = bookkeeping()
        >>> inside, bookkeeping()
        (True, False)
    """
    return _active.bookkeeping > 0
