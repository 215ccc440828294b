"""Shared pytest setup: tests marked ``cuda`` are skipped on machines without a CUDA GPU,
Hypothesis runs derandomized in CI (``CI`` set): the ``ci`` profile, and ``one_thread`` for
modules of tiny models (``pytestmark = pytest.mark.usefixtures("one_thread")``)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest
import torch
from hypothesis import settings

# CI runs the same examples every time, so a red build is the change's fault and reruns alike;
# random exploration happens on developers' machines. Per-test settings (max_examples, deadline)
# still apply on top. print_blob: a failure prints the blob that reproduces it anywhere.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU; torch sees none")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    """torch on one thread for a module's tests: tiny matrices run fastest and steadiest so,
    and OpenMP threads spinning for a core another process holds made such tests ten times
    slower on a busy 2-core machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
