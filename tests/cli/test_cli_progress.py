"""Progress bars (``gradckpt.cli.progress``): shown for slow work, quiet for quick work, with or
without tqdm."""

from __future__ import annotations

import sys
import types
from collections.abc import Callable

import pytest

from gradckpt.cli.progress import progress, progress_bar, stage, with_progress


def run(steps: int, **options: object) -> None:
    with progress(steps, "measuring blocks", **options) as bar:
        for _ in range(steps):
            bar.update()


def drive(steps: int, **options: object) -> None:
    """Report as ``gradckpt.profile`` does: ``(done, total)`` after each step."""
    with progress_bar("measuring blocks", **options) as report:
        for done in range(1, steps + 1):
            report(done, steps)


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


@pytest.mark.parametrize("bar", [run, drive], ids=["progress", "progress_bar"])
@pytest.mark.parametrize("options", [{"enabled": False}, {"delay": 60.0}])
def test_quiet_when_disabled_or_quick(
    bar: Callable[..., None],
    options: dict,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for tqdm_missing in (False, True):
        if tqdm_missing:
            monkeypatch.setitem(sys.modules, "tqdm", None)
        bar(3, **options)
        captured = capsys.readouterr()
        assert captured.err == "" and captured.out == ""


class RecordingTqdm:
    """Stands in for ``tqdm.tqdm``: remembers what the bar was told."""

    bars: list[RecordingTqdm] = []

    def __init__(self, total: int | None = None, **options: object) -> None:
        self.total, self.n, self.options = total, 0, options
        RecordingTqdm.bars.append(self)

    def __enter__(self) -> RecordingTqdm:
        return self

    def __exit__(self, *exception: object) -> None:
        pass

    def update(self, n: int = 1) -> None:
        self.n += n


def test_progress_bar_calls_through_to_tqdm(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=RecordingTqdm))
    RecordingTqdm.bars.clear()
    drive(3, delay=0.5)
    (bar,) = RecordingTqdm.bars
    assert (bar.total, bar.n) == (3, 3)
    assert bar.options["desc"] == "measuring blocks" and bar.options["delay"] == 0.5


def test_progress_bar_draws_on_stderr_with_tqdm(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tqdm")
    drive(3, delay=0.0)
    captured = capsys.readouterr()
    assert captured.out == "" and "measuring blocks" in captured.err


def test_progress_bar_calls_through_to_plain_lines_without_tqdm(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    drive(3, delay=0.0)
    assert capsys.readouterr().err.splitlines()[0] == "measuring blocks: 1/3"


def test_with_progress_yields_the_items_and_counts_them(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    assert list(with_progress([1, 2, 3], "counting", delay=0.0)) == [1, 2, 3]
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err.splitlines()[0] == "counting: 1/3"


def test_with_progress_without_a_length_counts_without_a_total(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)
    assert list(with_progress(iter("ab"), "reading", delay=0.0)) == ["a", "b"]
    assert capsys.readouterr().err.splitlines()[0] == "reading: 1"


def test_with_progress_bar_stays_off_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("tqdm")
    assert list(with_progress(range(2), "counting", delay=0.0)) == [0, 1]
    captured = capsys.readouterr()
    assert captured.out == "" and "counting" in captured.err


def test_stage_is_one_line_on_stderr_at_once(capsys: pytest.CaptureFixture[str]) -> None:
    stage("profiling")
    stage("hidden", enabled=False)
    captured = capsys.readouterr()
    assert captured.out == "" and captured.err == "gradckpt: profiling ...\n"
