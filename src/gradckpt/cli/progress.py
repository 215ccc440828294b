"""Progress on stderr for work that may take a while (profiling, the demo, ``gradckpt plan``).

The one place gradckpt shows progress; stdout is left to the results. The library itself draws
nothing: ``gradckpt.profile`` reports ``(done, total)`` to a callback, and ``progress_bar`` is
the callback the command line passes it.

- ``progress(total, description)``: a context manager yielding an object with ``update(n)``;
- ``progress_bar(description)``: a context manager yielding a ``(done, total)`` callback;
- ``with_progress(items, description)``: yields ``items``, counting them with ``progress``;
- ``stage(description)``: one line saying that a stage with no steps to count has started.

With the ``progress`` extra (tqdm) a bar is drawn; without it, a plain line now and then. Either
way nothing is shown for work that finishes within ``delay`` seconds, and nothing at all when
``enabled`` is false (library calls inside tests).

Example:
    >>> with progress(3, "measuring", enabled=False) as bar:
    ...     for _ in range(3):
    ...         bar.update()
    >>> list(with_progress("abc", "reading", enabled=False))
    ['a', 'b', 'c']
"""

from __future__ import annotations

import contextlib
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

__all__ = ["DELAY_SECONDS", "progress", "progress_bar", "with_progress", "stage"]

# Seconds before anything is shown: quick work stays quiet.
DELAY_SECONDS = 2.0

_Item = TypeVar("_Item")


class _Lines:
    """The fallback without tqdm: a line now and then, once the work has run ``delay`` s."""

    def __init__(self, total: int | None, description: str, delay: float) -> None:
        self.total, self.description, self.delay = total, description, delay
        self.done = 0
        self.started = time.monotonic()
        self.last_line = 0.0

    def update(self, n: int = 1) -> None:
        self.done += n
        now = time.monotonic()
        if now - self.started >= self.delay and now - self.last_line >= 1.0:
            self.last_line = now
            count = f"{self.done}/{self.total}" if self.total is not None else str(self.done)
            print(f"{self.description}: {count}", file=sys.stderr, flush=True)


class _Silent:
    total: int | None = None

    def update(self, n: int = 1) -> None:
        pass


@contextlib.contextmanager
def progress(
    total: int | None, description: str, *, enabled: bool = True, delay: float = DELAY_SECONDS
) -> Iterator[Any]:
    """A progress bar over ``total`` steps, shown only once the work has taken ``delay`` s.

    ``total`` may be None when the number of steps is not known (a count without a bar).

    Example:
        >>> with progress(2, "gradckpt: timing", delay=60) as bar:  # quick: nothing shown
        ...     bar.update()
        ...     bar.update()
    """
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


@contextlib.contextmanager
def progress_bar(
    description: str, *, enabled: bool = True, delay: float = DELAY_SECONDS
) -> Iterator[Callable[[int, int], None]]:
    """A ``progress`` bar driven by a callback ``(done, total)``, as ``gradckpt.profile`` calls.

    For work that counts its own steps and says how many there are only once it has started:
    each call sets the bar's total and moves it to ``done``.

    Example:
        >>> import gradckpt
        >>> from gradckpt.toy_models import mlp_chain
        >>> import torch
        >>> with progress_bar("gradckpt: profiling") as report:  # quick: nothing shown
        ...     measured = gradckpt.profile(mlp_chain(2, 8), torch.randn(4, 8), progress=report)
        >>> len(measured.blocks)
        2
    """
    with progress(None, description, enabled=enabled, delay=delay) as bar:
        reported = 0

        def report(done: int, total: int) -> None:
            nonlocal reported
            bar.total = total  # known only once the work has begun
            bar.update(done - reported)
            reported = done

        yield report


def with_progress(
    items: Iterable[_Item],
    description: str,
    *,
    total: int | None = None,
    enabled: bool = True,
    delay: float = DELAY_SECONDS,
) -> Iterator[_Item]:
    """Yield ``items``, counting them on a ``progress`` bar (``total``: ``len(items)`` if any).

    Example:
        >>> sum(with_progress(range(3), "gradckpt: adding"))  # quick: nothing shown
        3
    """
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    with progress(total, description, enabled=enabled, delay=delay) as bar:
        for item in items:
            yield item
            bar.update()


def stage(description: str, *, enabled: bool = True) -> None:
    """Say on stderr, at once, that a stage with no steps to count has started.

    Example:
        >>> stage("profiling", enabled=False)  # else prints "gradckpt: profiling ..." on stderr
    """
    if enabled:
        print(f"gradckpt: {description} ...", file=sys.stderr, flush=True)
