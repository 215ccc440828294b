"""The command line's own error, errors told in one line, and "did you mean" hints (the
core's, ``gradckpt.errors.did_you_mean``, which names unknown devices and blocks too).

A ``CommandLineError`` is the user's command line being wrong (exit status 2); any other error
is one while working (exit status 1). Either is told as one line on stderr.
"""

from __future__ import annotations

from ..errors import close_matches, did_you_mean, either

__all__ = ["CommandLineError", "close_matches", "did_you_mean", "either", "one_line"]


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
