"""Shared pytest setup: tests marked ``cuda`` are skipped on machines without a CUDA GPU."""

from __future__ import annotations

import pytest
import torch


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if torch.cuda.is_available():
        return
    skip_cuda = pytest.mark.skip(reason="needs a CUDA GPU; torch sees none")
    for item in items:
        if "cuda" in item.keywords:
            item.add_marker(skip_cuda)
