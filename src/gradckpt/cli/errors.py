"""The command line's own error, errors told in one line, and "did you mean" hints.

A ``CommandLineError`` is the user's command line being wrong (exit status 2); any other error
is one while working (exit status 1). Either is told as one line on stderr.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable

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


def did_you_mean(word: str, choices: Iterable[str], *, quote: bool = True) -> str:
    """A clause to append to an error about ``word``: ``"; did you mean X?"`` naming up to three
    of ``choices`` close to it, or ``""`` when none is; ``quote=False`` for flags, which are
    written as they are typed.

    Example:
        >>> did_you_mean("lama", ["llama", "mllama", "llama4", "gpt2"])
        "; did you mean 'llama', 'mllama' or 'llama4'?"
        >>> did_you_mean("--bugdet", ["--budget", "--batch", "--seq"], quote=False)
        '; did you mean --budget?'
        >>> did_you_mean("xyzzy", ["demo", "plan"])
        ''
    """
    close = close_matches(word, choices)
    if not close:
        return ""
    return f"; did you mean {either(close, quote=quote)}?"


def close_matches(word: str, choices: Iterable[str]) -> list[str]:
    """Up to three of ``choices`` close to ``word``, case aside, the closest first; those far
    behind the closest are left out ("--bugdet": "--budget", not also "--debug").

    Example:
        >>> close_matches("Llama-3-8B", ["mistral-7b", "llama-3-8b"])
        ['llama-3-8b']
        >>> close_matches("--bugdet", ["--budget", "--debug", "--batch"])
        ['--budget']
    """
    by_lower_case = {choice.lower(): choice for choice in choices}
    close = difflib.get_close_matches(word.lower(), by_lower_case, n=3)
    if not close:
        return []
    best = _similarity(word.lower(), close[0])
    return [
        by_lower_case[match]
        for match in close
        if _similarity(word.lower(), match) >= best - _NEAR_THE_BEST
    ]


# How far behind the closest match another is still worth naming: "lama" names llama, mllama
# and llama4 (0.89, 0.80, 0.80), "--bugdet" only --budget (0.88; --debug 0.67).
_NEAR_THE_BEST = 0.1


def _similarity(word: str, choice: str) -> float:
    return difflib.SequenceMatcher(None, word, choice).ratio()


def either(names: list[str], *, quote: bool = True) -> str:
    """``names`` as alternatives in a sentence.

    Example:
        >>> either(["gpt2", "gptj", "gpt-sw3"]), either(["--seq"], quote=False)
        ("'gpt2', 'gptj' or 'gpt-sw3'", '--seq')
    """
    words = [repr(name) for name in names] if quote else names
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} or {words[-1]}"
