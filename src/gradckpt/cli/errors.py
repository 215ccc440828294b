"""The command line's own error, errors told in one line, and "did you mean" hints (the
core's, ``gradckpt.errors.did_you_mean``, which names unknown devices and blocks too).

A ``CommandLineError`` is the user's command line being wrong (exit status 2); any other error
is one while working (exit status 1). Either is told as one line on stderr.
"""

from __future__ import annotations

import contextlib
import sys
import textwrap
from collections.abc import Iterator

from ..budget import rounded_up_budget
from ..errors import BudgetError, close_matches, did_you_mean, either

__all__ = [
    "CommandLineError", "budget_at_least", "close_matches", "did_you_mean", "either",
    "explained_for_the_command_line", "one_line",
]


class CommandLineError(Exception):
    """The command line is wrong (exit status 2); the message says what to write instead."""


def one_line(error: BaseException) -> str:
    """The error's message on one line (its type's name where it has none).

    Example:
        >>> one_line(ValueError("no such file:   missing.json  "))
        'no such file: missing.json'
        >>> one_line(KeyboardInterrupt())
        'KeyboardInterrupt'
    """
    return " ".join(str(error).split()) or type(error).__name__


@contextlib.contextmanager
def explained_for_the_command_line() -> Iterator[None]:
    """A ``BudgetError`` inside becomes, on the command line, a paragraph on stderr (its
    ``explanation``: what the least plan's peak is made of, the levers) and an error line with
    the ``--budget`` to rerun with; the Python-level retry it offers (``error.profile``) means
    nothing here."""
    try:
        yield
    except BudgetError as error:
        if error.explanation:
            print(textwrap.fill(error.explanation, width=100), file=sys.stderr)
        # The message's first line: the budget and the smallest that works.
        headline = str(error).partition("\n")[0].split("; raise the budget")[0]
        raise BudgetError(
            f"{headline}: rerun with --budget {budget_at_least(error.minimum_bytes)}",
            minimum_bytes=error.minimum_bytes, profile=error.profile,
            explanation=error.explanation,
        ) from None


def budget_at_least(n_bytes: int) -> str:
    """A ``--budget`` of at least ``n_bytes``, as a user types it: two decimals of the largest
    binary unit it has one of, rounded up, so that rerunning with it always works
    (``gradckpt.budget.rounded_up_budget``).

    Example:
        >>> budget_at_least(26_876_283), budget_at_least(65_326_459_290)
        ('25.64MiB', '60.85GiB')
    """
    return rounded_up_budget(n_bytes)
