"""The training loop on the command line (issue 26, item 2): ``--trainer``,
``--accumulation-steps N``, ``--autocast bf16`` and ``--budget`` defaulting to what the device
has, for ``gradckpt plan`` measured and ``--estimate``; their bad values as one usage error."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from test_cli_commands import error_lines

from gradckpt.cli import main
from gradckpt.measure.memory_parts import DDP_BUCKETS, GRADIENTS, MIXED_PRECISION_COPIES

pytestmark = pytest.mark.usefixtures("one_thread")

ESTIMATE = ["plan", "mlp-chain", "--estimate", "--device", "h100", "--batch", "8", "--seq", "64",
            "--strategy", "none"]
MEASURED = ["plan", "mlp-chain", "--device", "cpu", "--batch", "8", "--seq", "64",
            "--strategy", "none"]


def estimated(arguments: list[str], path: Path, capsys) -> tuple[list[str], dict]:
    assert main([*ESTIMATE, *arguments, "--json", str(path)]) == 0
    return capsys.readouterr().out.splitlines(), json.loads(path.read_text())


def measured_peak(arguments: list[str], capsys) -> tuple[str, float]:
    """The header line and the measured peak without checkpointing, in MiB."""
    assert main([*MEASURED, *arguments]) == 0
    lines = capsys.readouterr().out.splitlines()
    peak = re.search(r"peak without checkpointing ([\d.]+) MiB", lines[1]).group(1)
    return lines[0], float(peak)


def test_trainer_is_the_output_dropped_and_adamw(tmp_path, capsys):
    lines, trainer = estimated(["--trainer"], tmp_path / "trainer.json", capsys)
    _, spelt_out = estimated(["--drop-output", "--optimizer", "adamw"], tmp_path / "out.json",
                             capsys)
    assert lines[1].endswith("optimizer adamw, output dropped before backward (Trainer)")
    assert trainer["optimizer"] == "adamw" and trainer["plan"] == spelt_out["plan"]
    assert trainer["profile"] == spelt_out["profile"]
    # An optimizer given is kept: the Trainer's optim need not be AdamW.
    _, sgd = estimated(["--trainer", "--optimizer", "sgd"], tmp_path / "sgd.json", capsys)
    assert sgd["optimizer"] == "sgd"


def test_accumulation_holds_the_gradients_through_the_micro_batches(tmp_path, capsys):
    lines, accumulated = estimated(["--accumulation-steps", "4"], tmp_path / "four.json", capsys)
    _, one = estimated([], tmp_path / "one.json", capsys)
    assert "float32, optimizer none, 4 micro-batches accumulated" in lines[1]
    gradients = one["memory_parts"][GRADIENTS]
    fixed = accumulated["profile"]["fixed_bytes"] - one["profile"]["fixed_bytes"]
    assert fixed == gradients > 0  # the earlier micro-batches' gradients, held all step
    header, peak = measured_peak(["--accumulation-steps", "2"], capsys)
    assert header.endswith(", cpu, 2 micro-batches accumulated")
    assert peak > measured_peak([], capsys)[1]


def test_autocast_keeps_fp32_weights_and_their_bf16_copies(tmp_path, capsys):
    lines, mixed = estimated(["--autocast", "bf16"], tmp_path / "mixed.json", capsys)
    _, plain = estimated([], tmp_path / "plain.json", capsys)
    assert "float32, optimizer none, bf16 autocast" in lines[1] and mixed["dtype"] == "float32"
    parameters = plain["memory_parts"]["parameters"]
    assert mixed["memory_parts"][MIXED_PRECISION_COPIES] == parameters // 2
    assert mixed["profile"]["peak_bytes"] < plain["profile"]["peak_bytes"]  # bf16 activations
    header, peak = measured_peak(["--autocast", "bf16"], capsys)
    assert header.endswith(", cpu, bf16 autocast")
    assert peak < measured_peak([], capsys)[1]


def test_the_budget_defaults_to_what_the_device_has(capsys):
    assert main(["plan", "mlp-chain", "--device", "cpu", "--batch", "2", "--seq", "4"]) == 0
    out = capsys.readouterr().out
    assert "strategy optimal within " in out and "predicted extra time +0.0%" in out


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["--accumulation-steps", "0"],
         "argument --accumulation-steps: expected a positive integer, got '0'"),
        (["--autocast", "fp8"],
         "argument --autocast: invalid choice: 'fp8' (choose from 'bf16', 'fp16')"),
        (["--autocast", "bf16f"], "invalid choice: 'bf16f'; did you mean 'bf16'?"),
        (["--trainer=yes"], "argument --trainer: ignored explicit argument 'yes'"),
    ],
)
def test_bad_values_are_usage_errors(arguments, expected, capsys):
    with pytest.raises(SystemExit) as exited:
        main([*ESTIMATE, *arguments])
    assert exited.value.code == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert expected in line, line


def test_autocast_with_a_16_bit_dtype_says_which_to_drop(capsys):
    assert main([*ESTIMATE, "--autocast", "bf16", "--dtype", "fp16"]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert line == (
        "gradckpt plan: usage error: --autocast bf16 is mixed precision: fp32 parameters, the "
        "forward under autocast; with --dtype fp16 the whole model is fp16 already: drop "
        "--autocast (pure fp16) or --dtype (mixed precision)"
    )


def test_ddp_counts_its_buckets_estimated_and_measured(tmp_path, capsys):
    lines, ddp = estimated(["--ddp"], tmp_path / "ddp.json", capsys)
    _, one = estimated([], tmp_path / "one.json", capsys)
    assert lines[1].endswith("float32, optimizer none, DDP's buckets counted")
    gradients = one["memory_parts"][GRADIENTS]
    assert ddp["memory_parts"][DDP_BUCKETS] == gradients > 0  # a copy of every gradient
    assert ddp["profile"]["fixed_bytes"] - one["profile"]["fixed_bytes"] == gradients
    header, peak = measured_peak(["--ddp"], capsys)
    assert header.endswith(", cpu, DDP's buckets counted")
    assert peak > measured_peak([], capsys)[1]


def test_ddp_with_a_world_size_is_an_error(capsys):
    for command in (ESTIMATE, ["fit", "mlp-chain", "--device", "h100"]):
        assert main([*command, "--ddp", "--world-size", "2"]) != 0
        assert "world_size" in capsys.readouterr().err
