"""Progress bars (``gradckpt.progress``): shown for slow work, quiet for quick work, with or
without tqdm."""

from __future__ import annotations

import sys

import pytest

from gradckpt.progress import progress


def run(steps: int, **options: object) -> None:
    with progress(steps, "measuring blocks", **options) as bar:
        for _ in range(steps):
            bar.update()


def test_a_bar_with_tqdm(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tqdm")
    run(3, delay=0.0)
    assert "measuring blocks" in capsys.readouterr().err


def test_plain_lines_without_tqdm(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import tqdm now raises ImportError
    run(3, delay=0.0)
    assert capsys.readouterr().err.splitlines()[0] == "measuring blocks: 1/3"


@pytest.mark.parametrize("options", [{"enabled": False}, {"delay": 60.0}])
def test_quiet_when_disabled_or_quick(
    options: dict, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    for tqdm_missing in (False, True):
        if tqdm_missing:
            monkeypatch.setitem(sys.modules, "tqdm", None)
        run(3, **options)
        captured = capsys.readouterr()
        assert captured.err == "" and captured.out == ""
