"""Progress bars for work that may take a while (profiling, the demo).

``progress(total, description)`` is a context manager yielding an object with ``update(n)``.
With the ``progress`` extra (tqdm) it draws a bar on stderr; without it, plain lines. Either way
nothing is shown for work that finishes within ``delay`` seconds, and nothing at all when
``enabled`` is false (library calls inside tests, ``--quiet``).

Example:
    >>> with progress(3, "measuring", enabled=False) as bar:
    ...     for _ in range(3):
    ...         bar.update()
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Iterator
from typing import Any

__all__ = ["progress"]

# Seconds before anything is shown: quick work stays quiet.
DELAY_SECONDS = 2.0


class _Lines:
    """The fallback without tqdm: a line now and then, once the work has run ``delay`` s."""

    def __init__(self, total: int, description: str, delay: float) -> None:
        self.total, self.description, self.delay = total, description, delay
        self.done = 0
        self.started = time.monotonic()
        self.last_line = 0.0

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.started >= self.delay and now - self.last_line >= 1.0:
            self.last_line = now
            print(f"{self.description}: {self.done}/{self.total}", file=sys.stderr, flush=True)


class _Silent:
    def update(self, n: int = 1) -> None:
        pass


@contextlib.contextmanager
def progress(
    total: int, description: str, *, enabled: bool = True, delay: float = DELAY_SECONDS
) -> Iterator[Any]:
    """A progress bar over ``total`` steps, shown only once the work has taken ``delay`` s."""
    if not enabled:
        yield _Silent()
        return
    try:
        from tqdm import tqdm
    except ImportError:
        yield _Lines(total, description, delay)
        return
    with tqdm(total=total, desc=description, delay=delay, leave=False, file=sys.stderr) as bar:
        yield bar
