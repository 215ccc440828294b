"""The ``gradckpt`` command line: run as a user runs it (a subprocess) where that matters, and
in-process (``main([...])``) for the many ways of getting the command line wrong."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import gradckpt
from gradckpt.budget import parse_budget
from gradckpt.cli import main
from gradckpt.plan import Plan

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"

FACTORIES = '''
import torch
from gradckpt.toy_models import mlp_chain

def build(batch, seq):
    return mlp_chain(4, 16), torch.randn(batch, seq, 16)

def module_only():
    return mlp_chain(4, 16)

def broken():
    raise ValueError("no weights here")
'''


def run_gradckpt(
    *arguments: str, cwd: Path | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    # One thread keeps the runs fast and their timings undisturbed on small CI machines.
    environment = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    return subprocess.run(
        [sys.executable, "-m", "gradckpt", *arguments],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=environment,
        cwd=cwd,
    )


def error_lines(stderr: str) -> list[str]:
    """The lines of stderr that report an error (the others show progress)."""
    return [line for line in stderr.splitlines() if "error" in line]


@pytest.fixture(scope="module")
def quick_demo(tmp_path_factory) -> tuple[subprocess.CompletedProcess[str], Path]:
    out = tmp_path_factory.mktemp("demo")
    return run_gradckpt("demo", "--quick", "--device", "cpu", "--out", str(out)), out


@pytest.fixture()
def tiny_llama_config(tmp_path) -> Path:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )
    config.save_pretrained(tmp_path / "llama")
    return tmp_path / "llama"


# --------------------------------------------------------------------------------------------
# gradckpt demo
# --------------------------------------------------------------------------------------------


def test_quick_demo_exits_zero(quick_demo):
    result, _ = quick_demo
    assert result.returncode == 0, result.stderr


def test_quick_demo_measures_each_strategy(quick_demo):
    result, _ = quick_demo
    rows = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    for strategy in ("none", "every-layer", "sqrt", "optimal"):
        assert strategy in rows, result.stdout
    assert "measured peak" in result.stdout and "step time" in result.stdout
    none_peak = _mebibytes(rows["none"])[1]
    every_layer_peak = _mebibytes(rows["every-layer"])[1]
    assert every_layer_peak < none_peak


def test_quick_demo_training_is_bit_identical(quick_demo):
    # Engine invariant 1: no plan changes losses or parameters, dropout included.
    result, _ = quick_demo
    plan_rows = [line for line in result.stdout.splitlines() if line.startswith("optimal")]
    assert plan_rows and all(row.rstrip().endswith("identical") for row in plan_rows)
    assert "DIFFERENT" not in result.stdout


def test_quick_demo_reproduces_the_sqrt_claim(quick_demo):
    result, _ = quick_demo
    row = next(line for line in result.stdout.splitlines() if line.lstrip().startswith("100 "))
    cells = re.findall(r"([\d.]+) / \+([\d.]+)", row)
    (none_memory, _), (_, every_extra), (sqrt_memory, sqrt_extra), (_, optimal_extra) = [
        (float(memory), float(extra)) for memory, extra in cells
    ]
    assert none_memory >= 100
    assert 10 <= sqrt_memory <= 20 and sqrt_extra == pytest.approx(1.0, abs=0.05)
    assert optimal_extra <= sqrt_extra and every_extra == pytest.approx(1.0, abs=0.05)
    measured_row = next(line for line in result.stdout.splitlines() if line.startswith("  4 "))
    assert re.search(r"[\d.]+ / [\d.]+ / [\d.]+$", measured_row)  # short chains: measured


def test_quick_demo_writes_the_plots(quick_demo):
    result, out = quick_demo
    for name in ("frontier.png", "memory_vs_depth.png"):
        assert (out / name).read_bytes()[:8] == PNG_SIGNATURE, result.stdout
    pyplot = pytest.importorskip("matplotlib.pyplot")
    assert pyplot.imread(out / "frontier.png").ndim == 3  # decodes as an image


def test_demo_without_matplotlib_prints_the_tables_and_says_plots_were_skipped(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    arguments = ["demo", "--quick", "--layers", "2", "--batch", "2", "--seq", "16"]
    assert main([*arguments, "--steps", "1", "--device", "cpu", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "measured peak" in out and "sqrt(n)" in out
    assert "plots skipped: plots need matplotlib" in out
    assert list(tmp_path.iterdir()) == []


def _mebibytes(row: str) -> list[float]:
    return [float(number) for number in re.findall(r"([\d.]+) MiB", row)]


# --------------------------------------------------------------------------------------------
# gradckpt plan, with each form of MODEL
# --------------------------------------------------------------------------------------------


def test_plan_builtin_writes_json_that_round_trips_and_a_plot(tmp_path):
    json_path, plot_path = tmp_path / "plan.json", tmp_path / "plan.png"
    result = run_gradckpt(
        "plan", "tinygpt", "--batch", "8", "--seq", "64", "--budget", "70%",
        "--json", str(json_path), "--plot", str(plot_path), "--device", "cpu",
    )
    assert result.returncode == 0, result.stderr
    assert "transformer.h.7" in result.stdout  # the per-block table
    assert "strategy optimal within" in result.stdout
    assert "what takes the memory" in result.stdout
    data = json.loads(json_path.read_text())
    assert data["strategy"] == "optimal" and len(data["block_names"]) == 8
    plan = Plan.from_json(json_path.read_text())
    assert plan.to_json() == json_path.read_text()
    assert plan.predicted_peak_bytes <= plan.budget_bytes
    assert str(plan) in result.stdout
    assert plot_path.read_bytes()[:8] == PNG_SIGNATURE


def test_plan_config_json_with_adam(tiny_llama_config):
    result = run_gradckpt(
        "plan", str(tiny_llama_config / "config.json"), "--batch", "2", "--seq", "16",
        "--strategy", "sqrt", "--optimizer", "adam", "--device", "cpu",
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("LlamaForCausalLM from")
    for block in ("model.layers.0", "model.layers.2"):
        assert block in result.stdout
    for part in ("parameters", "gradients", "optimizer state (Adam)", "activations"):
        assert part in result.stdout
    assert "with Adam's state" in result.stdout


def test_plan_encoder_decoder_config(tmp_path):
    """A T5 config trains as a sequence-to-sequence model; no segment crosses from the
    encoder's last block to the decoder's first."""
    transformers = pytest.importorskip("transformers")
    transformers.T5Config(
        vocab_size=128, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
        num_heads=4, decoder_start_token_id=0, pad_token_id=0,
    ).save_pretrained(tmp_path / "t5")
    result = run_gradckpt("plan", str(tmp_path / "t5"), "--batch", "2", "--seq", "16",
                          "--strategy", "sqrt", "--device", "cpu")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("T5ForConditionalGeneration from")
    assert "recomputed: segment 0-1" in result.stdout and "recomputed: segment 2-3" in result.stdout


def test_a_config_with_no_language_model_is_one_line_error(tmp_path):
    transformers = pytest.importorskip("transformers")
    transformers.ViTConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                           intermediate_size=64).save_pretrained(tmp_path / "vit")
    result = run_gradckpt("plan", str(tmp_path / "vit"), "--strategy", "sqrt")
    assert result.returncode == 1
    lines = error_lines(result.stderr)
    assert len(lines) == 1 and "no causal language model for model_type 'vit'" in lines[0]
    assert "package.module:factory" in lines[0]


def test_plan_folder_holding_a_config_in_process(tiny_llama_config, capsys):
    assert main(["plan", str(tiny_llama_config), "--batch", "1", "--seq", "8",
                 "--strategy", "every-layer", "--device", "cpu"]) == 0
    assert "recomputed: segment 2-2" in capsys.readouterr().out


def test_plan_drop_output_plans_for_a_loop_without_the_logits(tiny_llama_config, capsys):
    """--drop-output: the step planned for drops the output (logits) before backward, as the
    Hugging Face Trainer does; its peak without checkpointing is lower by at least the logits."""

    def plain_peak(*extra: str) -> str:
        assert main(["plan", str(tiny_llama_config), "--batch", "2", "--seq", "16",
                     "--strategy", "none", "--device", "cpu", *extra]) == 0
        out = capsys.readouterr().out
        return out.split("peak without checkpointing ")[1].split(",")[0]

    held, dropped = plain_peak(), plain_peak("--drop-output")
    assert parse_budget(dropped) < parse_budget(held)


def test_plan_factory(tmp_path):
    (tmp_path / "factories.py").write_text(FACTORIES)
    result = run_gradckpt(
        "plan", "factories:build", "--batch", "2", "--seq", "4", "--strategy", "sqrt",
        cwd=tmp_path,
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("Sequential from factories:build: 4 blocks")


def test_plan_profiles_with_a_progress_callback(monkeypatch, capsys):
    """The library draws no bar: the command passes ``profile`` a callback that draws it."""
    callbacks = []
    real_profile = gradckpt.profile

    def recording_profile(*arguments, **options):
        callbacks.append(options.get("progress"))
        return real_profile(*arguments, **options)

    monkeypatch.setattr(gradckpt, "profile", recording_profile)
    assert main(["plan", "mlp-chain", "--batch", "1", "--seq", "2", "--strategy", "sqrt",
                 "--device", "cpu"]) == 0
    assert len(callbacks) == 1 and callable(callbacks[0])


def test_plan_list(capsys):
    assert main(["plan", "--list"]) == 0
    assert capsys.readouterr().out.split()[0] == "tinygpt"


# --------------------------------------------------------------------------------------------
# Bad input: one line, exit 1 (an error while working) or 2 (the command line is wrong)
# --------------------------------------------------------------------------------------------


def test_version():
    result = run_gradckpt("--version")
    assert result.returncode == 0
    assert result.stdout.strip() == f"gradckpt {gradckpt.__version__}"


def test_help_shows_examples(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    assert "gradckpt plan tinygpt" in capsys.readouterr().out


def test_unknown_model_in_a_subprocess_is_one_line_exit_2():
    result = run_gradckpt("plan", "no-such-model", "--strategy", "sqrt")
    assert result.returncode == 2
    assert error_lines(result.stderr) == [
        "gradckpt plan: usage error: unknown model 'no-such-model': give a Hugging Face "
        "config.json (or a folder holding one), a built-in name (tinygpt, tinygpt-24, "
        "mlp-chain; see 'gradckpt plan --list') or package.module:factory"
    ]


def test_factory_that_raises_in_a_subprocess_is_one_line_exit_1(tmp_path):
    (tmp_path / "factories.py").write_text(FACTORIES)
    result = run_gradckpt("plan", "factories:broken", "--strategy", "sqrt", cwd=tmp_path)
    assert result.returncode == 1
    assert error_lines(result.stderr) == [
        "gradckpt: error: factory factories:broken raised ValueError: no weights here "
        "(rerun with --debug for the traceback)"
    ]


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["demo", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["demo", "--layers", "0"], "expected a positive integer, got '0'"),
        (["no-such-command"], "invalid choice: 'no-such-command'"),
        ([], "the following arguments are required: COMMAND"),
        (["plan"], "MODEL is missing"),
        (["plan", "tinygpt", "--budget", "6 gigs"], "budget '6 gigs' not understood"),
        (["plan", "tinygpt", "--budget", "6G"], "'6G' is ambiguous"),
        (["plan", "tinygpt", "--estimate", "--dtype", "bf16", "--autocast", "bf16"],
         "--autocast bf16 is mixed precision"),
        (["plan", "tinygpt", "--strategy", "fast"], "unknown strategy 'fast'"),
        (["plan", "gpt-17", "--strategy", "sqrt"], "unknown model 'gpt-17'"),
    ],
)
def test_usage_errors_are_one_line_and_exit_2(arguments, expected, capsys):
    try:
        status = main(arguments)
    except SystemExit as exit_info:  # argparse's own errors exit from parse_args
        status = exit_info.code
    assert status == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "usage error: " in lines[0] and expected in lines[0], lines


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["plan", "missing/config.json", "--strategy", "sqrt"],
         "no such file: missing/config.json"),
        (["plan", "no_such_module:build", "--strategy", "sqrt"],
         "cannot import 'no_such_module'"),
        (["plan", "factories:module_only", "--strategy", "sqrt"], "return (model, sample)"),
        (["plan", "factories:build", "--budget", "1KiB"], "rerun with --budget"),
        (["plan", "bad.json", "--strategy", "sqrt"], "has no 'model_type'"),
        (["plan", "empty-folder", "--strategy", "sqrt"], "holds no config.json"),
        (["demo", "--quick", "--device", "tpu"], "unknown device 'tpu'"),
    ],
)
def test_errors_while_working_are_one_line_and_exit_1(
    arguments, expected, tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "factories.py").write_text(FACTORIES)
    (tmp_path / "bad.json").write_text('{"hidden_size": 8}')
    (tmp_path / "empty-folder").mkdir()
    assert main(arguments) == 1
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1, lines
    assert lines[0].startswith("gradckpt: error: ") and expected in lines[0]
    assert lines[0].endswith("(rerun with --debug for the traceback)")


def test_debug_shows_the_traceback():
    result = run_gradckpt("plan", "missing/config.json", "--strategy", "sqrt", "--debug")
    assert result.returncode == 1
    assert "Traceback" in result.stderr and "FileNotFoundError" in result.stderr
