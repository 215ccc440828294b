"""Every example in docs/integrations.md runs as it stands. Each ```python block is run on its
own, in a fresh namespace, in the order of the page."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from gradckpt.errors import forget_warnings

pytest.importorskip("transformers")
pytest.importorskip("peft")

PAGE = Path(__file__).resolve().parents[2] / "docs" / "integrations.md"
BLOCKS = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.DOTALL)
# Scripts for several processes: run with torchrun, two processes on CPU.
SCRIPTS = re.findall(r"```python torchrun\n(.*?)```", PAGE.read_text(), flags=re.DOTALL)

# The examples run tiny models: one torch thread (see conftest.one_thread).
pytestmark = pytest.mark.usefixtures("one_thread")


def _title(block: str) -> str:
    heading = None
    for line in PAGE.read_text()[: PAGE.read_text().index(block)].splitlines():
        if line.startswith("## "):
            heading = line[3:]
    return heading or "top"


def test_the_page_has_an_example_per_path() -> None:
    titles = [_title(block) for block in BLOCKS]
    for path in ("A plain training loop", "The Trainer", "PEFT and LoRA on a frozen base",
                 "`TrainingArguments(gradient_checkpointing=True)` and "
                 "`gradient_checkpointing_enable()`", "torch.compile", "TRL `SFTTrainer`"):
        assert path in titles, titles
    scripts = [_title(script) for script in SCRIPTS]
    for path in ("More than one process (torchrun)", "DDP and torchrun", "FSDP2"):
        assert path in scripts, scripts


@pytest.mark.slow
@pytest.mark.parametrize("block", BLOCKS, ids=_title)
def test_example_runs(block: str) -> None:
    forget_warnings()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # Transformers 5's renamed methods
            exec(compile(block, str(PAGE), "exec"), {"__name__": "docs_example"})
    finally:
        forget_warnings()
        # The QLoRA example's quantized load leaves torch's cached factory-function list
        # without torch.linspace (see test_hf_integration's QLoRA test): start it afresh.
        torch.utils._device._device_constructors.cache_clear()


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS, ids=_title)
def test_torchrun_example_runs(script: str, tmp_path: Path) -> None:
    path = tmp_path / "train.py"
    path.write_text(script)
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(path)],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
