"""``gradckpt fit MODEL``: the cheapest changes that make a step fit (issue 26, item 3), as
the command line prints them; each option's ``gradckpt plan`` command predicts the same peak;
an impossible budget and bad input are one error line."""

from __future__ import annotations

import re

import pytest
from test_cli_commands import error_lines
from test_cli_estimate import llama_config

from gradckpt.cli import main

pytestmark = pytest.mark.usefixtures("one_thread")

# mlp-chain at 32 x 64: over 20 MiB at the least with any plan (h100 preset, no optimizer).
MLP = ["mlp-chain", "--device", "h100", "--batch", "32", "--seq", "64"]


def fit_output(arguments: list[str], capsys) -> list[str]:
    assert main(["fit", *arguments]) == 0
    return capsys.readouterr().out.splitlines()


def plan_commands(lines: list[str]) -> list[list[str]]:
    """The arguments of each option's ``gradckpt plan`` command, as printed."""
    return [line.split(": gradckpt ", 1)[1].split() for line in lines
            if re.match(r"  \d+: gradckpt plan ", line)]


def predicted_peak(plan_arguments: list[str], capsys) -> str:
    """What ``gradckpt plan ... --estimate`` predicts, from its first line."""
    assert main(plan_arguments) == 0
    first = capsys.readouterr().out.splitlines()[0]
    return re.match(r"fits: predicted peak (?:per rank )?([\d.]+ [KMG]iB)", first).group(1)


def test_a_smaller_micro_batch_that_fits_and_its_plan_command(capsys):
    lines = fit_output([*MLP, "--budget", "14MiB", "--levers", "recompute,micro-batch"], capsys)
    assert re.fullmatch(r"does not fit as it is: the least predicted peak of any plan is "
                        r"2\d\.\d\d MiB, above the budget of 14\.00 MiB on h100-80gb", lines[0])
    assert lines[1] == ("mlp_chain(16, 256): 1.05M parameters, batch 32 x 64, float32, "
                        "optimizer none")
    assert lines[3].startswith("the cheapest change that fits, least change to what is trained "
                               "first, then the fastest (")
    row = next(line for line in lines if line.startswith("1  "))
    micro, steps = map(int, re.search(r"micro-batch (\d+) x (\d+) accumulated", row).groups())
    assert micro * steps == 32 and micro < 32  # the same effective batch
    (command,) = plan_commands(lines)
    assert command == ["plan", "mlp-chain", "--estimate", "--device", "h100-80gb", "--batch",
                       str(micro), "--seq", "64", "--budget", "14MiB", "--accumulation-steps",
                       str(steps)]
    assert predicted_peak(command, capsys) in row


def test_a_step_that_fits_as_it_is_needs_no_change(capsys):
    lines = fit_output([*MLP, "--budget", "1GiB"], capsys)
    assert re.fullmatch(r"fits as it is: predicted peak [\d.]+ MiB within the budget of "
                        r"1\.00 GiB on h100-80gb, no change needed", lines[0])
    assert not plan_commands(lines)


def test_a_step_a_plan_makes_fit_is_answered_with_the_plan(capsys):
    lines = fit_output([*MLP, "--budget", "30MiB"], capsys)
    assert lines[0].startswith("fits with a plan: predicted peak ")
    (command,) = plan_commands(lines)
    assert command[-2:] == ["--budget", "30MiB"]


def test_a_budget_nothing_reaches_is_one_error_line_with_the_least_peak(capsys):
    assert main(["fit", *MLP, "--budget", "2MiB", "--levers", "recompute,micro-batch"]) == 1
    (line,) = error_lines(capsys.readouterr().err)
    assert line.startswith("gradckpt: error: nothing fits the budget of 2.00 MiB: with every "
                           "lever (recompute, micro-batch) the least predicted peak is ")
    assert "would fit it, or a smaller batch or shorter sequences" in line


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        ([*MLP, "--levers", "recompte"],
         "--levers: unknown lever 'recompte'; did you mean 'recompute'? (levers: recompute, "
         "chunked-head, drop-output, autocast, micro-batch, bf16, lora, 4bit, fsdp)"),
        ([*MLP, "--levers", " , "], "--levers: no lever named"),
        (["--budget", "6GiB"], "MODEL is missing"),
        ([*MLP[:1], "--device", "h1000"], "--device: unknown device 'h1000'"),
        ([*MLP, "--budget", "6G"], "'6G' is ambiguous"),
        ([*MLP, "--dtype", "bf16", "--autocast", "bf16"], "--autocast bf16 is mixed precision"),
        (["mlp-chian"], "unknown model 'mlp-chian'; did you mean 'mlp-chain'?"),
    ],
    ids=["unknown-lever", "no-lever", "no-model", "unknown-device", "ambiguous-budget",
         "autocast-and-dtype", "misspelt-model"],
)
def test_bad_input_is_one_usage_error_line(arguments, expected, capsys):
    assert main(["fit", *arguments]) == 2
    (line,) = error_lines(capsys.readouterr().err)
    assert line.startswith("gradckpt fit: usage error: ") and expected in line, line


@pytest.mark.parametrize("flag", ["--count", "--max-gpus", "--adapter-rank"])
def test_counts_must_be_positive_integers(flag, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["fit", *MLP, flag, "0"])
    assert exited.value.code == 2
    assert f"argument {flag}: expected a positive integer, got '0'" in capsys.readouterr().err


def test_under_ddp_each_option_and_its_plan_command_count_the_buckets(capsys):
    """``gradckpt fit --ddp``: the step as it is and each option trained under DDP carry its
    buckets (the header says so, each plan command has ``--ddp`` and predicts the same peak);
    FSDP2 instead of DDP, over as many GPUs as fit, each keeping its batch, does not."""
    pytest.importorskip("peft")
    lines = fit_output(["mlp-chain", "--device", "h100", "--batch", "8", "--seq", "16",
                        "--optimizer", "adamw", "--ddp", "--budget", "13MiB", "--levers",
                        "recompute,fsdp,bf16,lora", "--adapter-rank", "4"], capsys)
    assert lines[1].endswith("optimizer adamw, DDP's buckets counted")
    rows = [line for line in lines if re.match(r"\d  ", line)]
    assert [row.split(";")[0] for row in rows] == [
        "1  bf16 throughout", "2  LoRA r=4 on all-linear", "3  FSDP2 over 2 GPUs instead of DDP"]
    commands = plan_commands(lines)
    assert [command[-1] for command in commands] == ["--ddp", "--ddp", "2"]
    assert all(command[command.index("--batch") + 1] == "8" for command in commands)
    for row, command in zip(rows, commands, strict=True):
        assert predicted_peak(command, capsys) in row


@pytest.mark.slow
def test_lora_and_a_4bit_base_for_a_language_model(tmp_path, capsys):
    """A two-layer Llama whose full fine-tuning with AdamW no plan fits: LoRA and QLoRA do,
    each option's plan command (--lora R, --qlora) predicting the same peak."""
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    config = llama_config(tmp_path, 512)
    lines = fit_output([str(config), "--device", "rtx4090", "--batch", "2", "--seq", "32",
                        "--optimizer", "adamw", "--budget", "0.9MiB", "--levers",
                        "recompute,chunked-head,lora,4bit", "--adapter-rank", "4"], capsys)
    assert lines[0].startswith("does not fit as it is: ")
    rows = [line for line in lines if re.match(r"\d  ", line)]
    assert rows[0].startswith("1  LoRA r=4 on all-linear; ")
    assert rows[1].startswith("2  QLoRA: 4-bit base + LoRA r=4 on all-linear; ")
    commands = plan_commands(lines)
    assert commands[0][-2:] == ["--lora", "4"] and commands[1][-3:] == ["--lora", "4", "--qlora"]
    for row, command in zip(rows, commands, strict=True):
        assert predicted_peak(command, capsys) in row
