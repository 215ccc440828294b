"""The exceptions gradckpt raises. Every one says what went wrong and how to fix it, naming
what was meant where a name was misspelt (``did_you_mean``)."""

from __future__ import annotations

import difflib
import warnings
from collections.abc import Iterable, Mapping
from typing import Any


class GradckptError(Exception):
    """Base class of every error gradckpt raises on purpose."""


class UsageError(GradckptError, ValueError):
    """An argument is wrong: the message names it, says what was given and what is accepted."""


class CheckpointError(GradckptError, RuntimeError):
    """Recomputation did not reproduce the forward pass of a checkpointed region.

    The message names the region and the first tensor (or operation) that differed. Without this
    error the backward pass would silently use wrong activations (invariant 7 in docs/engine.md).
    """


class BudgetError(GradckptError, ValueError):
    """No plan fits the memory budget.

    ``minimum_bytes`` is the smallest budget that any plan can meet; the message states it too,
    with ``explanation``: what the least plan's peak is made of and what would lower it (one
    paragraph, unwrapped; ``""`` where there is none). ``profile`` is the
    ``gradckpt.Profile`` the plan was solved from (``None`` where it is not at hand: on the
    ranks that did not solve), so that retrying needs no second measurement: the profile is of
    the whole step, the optimizer's state included::

        try:
            plan = gradckpt.enable(model, batch, budget="60%", optimizer=optimizer)
        except gradckpt.BudgetError as error:
            plan = gradckpt.solve(error.profile, error.minimum_bytes)
            gradckpt.apply(model, plan)
    """

    def __init__(
        self, message: str, minimum_bytes: int, profile: Any = None, explanation: str = ""
    ) -> None:
        super().__init__(message)
        self.minimum_bytes = minimum_bytes
        self.profile = profile
        self.explanation = explanation


class GradckptWarning(UserWarning):
    """Something that would silently cost memory, time or correct gradients; the message names
    the fix. Each kind is issued once per process (``warn_once``)."""


_warned: set[str] = set()


def warn_once(key: str, message: str, *, stacklevel: int = 3) -> bool:
    """Issue ``message`` as a ``GradckptWarning`` the first time ``key`` is seen in this
    process; return whether it was issued.

    Example:
        >>> import warnings
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     warn_once("example", "first"), warn_once("example", "second")
        (True, False)
        >>> [str(w.message) for w in caught]
        ['first']
        >>> forget_warnings()
    """
    if key in _warned:
        return False
    _warned.add(key)
    warnings.warn(message, GradckptWarning, stacklevel=stacklevel)
    return True


def forget_warnings() -> None:
    """Let every ``warn_once`` warning be issued again (for tests)."""
    _warned.clear()


def did_you_mean(
    word: str,
    choices: Iterable[str],
    *,
    quote: bool = True,
    aliases: Mapping[str, str] | None = None,
) -> str:
    """A clause to append to an error about ``word``: ``"; did you mean X?"`` naming up to three
    of ``choices`` close to it (``close_matches``; ``aliases`` as there), or ``""`` when none
    is; ``quote=False`` for flags, which are written as they are typed.

    Example:
        >>> did_you_mean("lama", ["llama", "mllama", "llama4", "gpt2"])
        "; did you mean 'llama', 'mllama' or 'llama4'?"
        >>> did_you_mean("--bugdet", ["--budget", "--batch", "--seq"], quote=False)
        '; did you mean --budget?'
        >>> did_you_mean("xyzzy", ["demo", "plan"])
        ''
        >>> did_you_mean("h10", ["h100-80gb", "h100"], aliases={"h100": "h100-80gb"})
        "; did you mean 'h100-80gb'?"
    """
    close = close_matches(word, choices, aliases=aliases)
    if not close:
        return ""
    return f"; did you mean {either(close, quote=quote)}?"


def close_matches(
    word: str, choices: Iterable[str], *, aliases: Mapping[str, str] | None = None
) -> list[str]:
    """Up to three of ``choices`` close to ``word``, case aside, the closest first; those far
    behind the closest are left out ("--bugdet": "--budget", not also "--debug"). A choice that
    is one of ``aliases`` is named as the name it stands for, each name once.

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
    near = [match for match in close if _similarity(word.lower(), match) >= best - _NEAR_THE_BEST]
    named = (by_lower_case[match] for match in near)
    return list(dict.fromkeys((aliases or {}).get(name, name) for name in named))


# How far behind the closest match another is still worth naming: "lama" names llama, mllama
# and llama4 (0.89, 0.80, 0.80), "--bugdet" only --budget (0.88; --debug 0.67).
_NEAR_THE_BEST = 0.1


def _similarity(word: str, choice: str) -> float:
    return difflib.SequenceMatcher(None, word, choice).ratio()


def either(names: list[str], *, quote: bool = True, joined_by: str = "or") -> str:
    """``names`` as alternatives in a sentence (``joined_by="and"``: all of them).

    Example:
        >>> either(["gpt2", "gptj", "gpt-sw3"]), either(["--seq"], quote=False)
        ("'gpt2', 'gptj' or 'gpt-sw3'", '--seq')
        >>> either(["h.1", "h.2"], joined_by="and")
        "'h.1' and 'h.2'"
    """
    words = [repr(name) for name in names] if quote else names
    return words[0] if len(words) == 1 else f"{', '.join(words[:-1])} {joined_by} {words[-1]}"
