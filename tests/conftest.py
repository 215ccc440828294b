"""Shared pytest setup: tests marked ``cuda`` are skipped on machines without a CUDA GPU, and
Hypothesis runs derandomized in CI (``CI`` set): the ``ci`` profile."""

from __future__ import annotations

import os

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
