"""Every public function's docstring example runs and shows what it claims (style rule)."""

from __future__ import annotations

import doctest
import importlib
import pkgutil

import pytest

import gradckpt

MODULES = sorted(
    name
    for _, name, _ in pkgutil.walk_packages(gradckpt.__path__, prefix="gradckpt.")
    if not name.endswith("__main__")
)

# The examples run tiny models: one torch thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples_run(module_name: str) -> None:
    module = importlib.import_module(module_name)
    result = doctest.testmod(module, optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.failed == 0, f"{result.failed} docstring example(s) failed in {module_name}"


def test_public_api_has_examples() -> None:
    """Each name exported by gradckpt that is a function carries a runnable example."""
    missing = [
        name
        for name in gradckpt.__all__
        if callable(getattr(gradckpt, name))
        and not isinstance(getattr(gradckpt, name), type)
        and ">>>" not in (getattr(gradckpt, name).__doc__ or "")
    ]
    assert missing == []
