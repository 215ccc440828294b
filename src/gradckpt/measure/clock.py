"""The clock measuring reads: the wall clock, or, for ``estimate``, time modeled per operation.

``profile`` times a real step with ``time.perf_counter``. ``estimate`` runs the same measuring
code on fake tensors, where an operation takes no time worth knowing; there a modeled clock
(``gradckpt.predict.clock.ModeledClock``) is active, and ``now()`` reads the seconds the
operations dispatched so far would take on the target device. This module is only the switch
between the two, so that measuring needs nothing of prediction.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Protocol

__all__ = ["ModeledTime", "entered", "left", "modeled", "modeled_device_kind", "now"]


class ModeledTime(Protocol):
    """What ``now()`` reads of a modeled clock: the seconds modeled so far, and the device
    they are modeled for (its ``kind``, ``"cuda"`` or ``"cpu"``, if it says)."""

    elapsed: float
    device: Any


class _ActiveClocks(threading.local):
    """The modeled clocks entered on this thread, innermost last. Per thread, as torch's
    dispatch modes are: a modeled clock counts this thread's operations only, so another
    thread profiling a real model at the same time must keep reading the wall clock."""

    def __init__(self) -> None:
        self.stack: list[ModeledTime] = []

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
