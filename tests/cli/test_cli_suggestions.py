"""What the command line says when it is wrong in the ways a newcomer gets it wrong (issues 17
and 22): a negative size, a bare number as a budget, a misspelt flag, command, model name or
config ``model_type``. Each error names what was wrong and, where something close exists, what
was meant; a budget too small names the ``--budget`` to rerun with, as a user would type it."""

from __future__ import annotations

import json
import time

import pytest

import gradckpt
from gradckpt.budget import parse_budget, rounded_up_budget
from gradckpt.cli import build_parser, main
from gradckpt.cli.errors import CommandLineError, budget_at_least, did_you_mean
from gradckpt.cli.model_lookup import check_model_name
from gradckpt.errors import close_matches
from gradckpt.integrations import hf


def run(arguments: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, list[str]]:
    """The exit status of ``gradckpt ARGUMENTS`` run in-process, and its error lines."""
    try:
        status = main(arguments)
    except SystemExit as exit_info:  # argparse's own errors exit from parse_args
        status = exit_info.code
    stderr = capsys.readouterr().err
    return status, [line for line in stderr.splitlines() if "error" in line]


def assert_one_usage_error(arguments: list[str], expected: str, capsys) -> None:
    status, lines = run(arguments, capsys)
    assert status == 2
    assert len(lines) == 1 and "usage error: " in lines[0] and expected in lines[0], lines


# 1. Negative sizes are read as sizes and refused with a reason
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["plan", "tinygpt", "--budget", "-1GiB"],
         "--budget: budget '-1GiB' is negative; a budget is the step's peak memory, a positive "
         "size"),
        (["plan", "tinygpt", "--budget", "-.5GiB"], "budget '-.5GiB' is negative"),
        (["plan", "tinygpt", "--budget", "-60%"], "a percentage must be above 0%"),
        (["plan", "tinygpt", "--budget", "6GiB", "--batch", "-2"],
         "argument --batch: expected a positive integer, got '-2'"),
        (["plan", "tinygpt", "--budget", "6GiB", "--seq", "-1e3"],
         "argument --seq: expected a positive integer, got '-1e3'"),
        (["plan", "llama-3-8b", "--estimate", "--budget", "6GiB", "--world-size", "-8"],
         "argument --world-size: expected a positive integer, got '-8'"),
        (["demo", "--layers", "-4"], "argument --layers: expected a positive integer, got '-4'"),
    ],
)
def test_negative_sizes_are_refused_as_negative(arguments, expected, capsys):
    assert_one_usage_error(arguments, expected, capsys)


def test_a_value_starting_with_minus_and_a_digit_is_a_value_not_a_flag():
    # argparse alone reads only plain numbers ("-2") so; "-1GiB" was "expected one argument".
    args = build_parser().parse_args(["plan", "tinygpt", "--budget", "-1GiB", "--seed", "-3"])
    assert (args.budget, args.seed) == ("-1GiB", -3)


def test_parse_budget_refuses_a_negative_size_as_negative():
    with pytest.raises(gradckpt.UsageError, match="'-1GiB' is negative; a budget is the step's"):
        parse_budget("-1GiB", unconstrained_peak_bytes=2**30)


@pytest.mark.parametrize(
    ("budget", "expected"),
    [
        ("60", "--budget: budget '60': a bare number is bytes; did you mean '60%' or '60GiB'? "
         "(for 60 bytes write '60B' or pass the int 60)"),
        ("0.6", "--budget: budget '0.6': a bare number is bytes, and 0.6 is less than one; did "
         "you mean '60%'?"),
    ],
)
def test_a_bare_number_as_budget_is_refused_at_once_with_what_was_meant(budget, expected,
                                                                        capsys):
    started = time.perf_counter()
    assert_one_usage_error(["plan", "tinygpt", "--budget", budget], expected, capsys)
    assert time.perf_counter() - started < 1  # before the model is built or profiled


# 2. Did you mean, for flags and commands
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["plan", "tinygpt", "--bugdet", "6GiB"],
         "gradckpt plan: usage error: unrecognized arguments: --bugdet 6GiB; did you mean "
         "--budget? (see 'gradckpt plan --help')"),
        (["plan", "tinygpt", "--bugdet=6GiB"], "--bugdet=6GiB; did you mean --budget?"),
        (["demo", "--quik"],
         "gradckpt demo: usage error: unrecognized arguments: --quik; did you mean --quick?"),
        (["--quik", "demo"], "unrecognized arguments: --quik; did you mean --quick?"),
        (["plan", "tinygpt", "--bugdet", "6GiB", "--sqe", "8"],
         "did you mean --budget for --bugdet, --seq or --seed for --sqe?"),
        (["plna"], "argument COMMAND: invalid choice: 'plna'; did you mean 'plan'? (choose "
         "from 'demo', 'plan', 'fit')"),
        (["plan", "tinygpt", "--optimizer", "adamw8bit"],
         "invalid choice: 'adamw8bit'; did you mean 'adamw-8bit'?"),
    ],
)
def test_a_misspelt_flag_or_command_gets_the_close_ones(arguments, expected, capsys):
    assert_one_usage_error(arguments, expected, capsys)


def test_an_unknown_flag_with_nothing_close_gets_no_suggestion(capsys):
    status, lines = run(["plan", "tinygpt", "--zzzzzz"], capsys)
    assert status == 2 and "unrecognized arguments: --zzzzzz (see" in lines[0]
    assert "did you mean" not in lines[0]


def test_a_correct_command_still_parses():
    args = build_parser().parse_args(
        ["plan", "tinygpt", "--budget", "6GiB", "--batch", "2", "--optimizer", "adamw-8bit"]
    )
    assert (args.command, args.model, args.budget, args.batch, args.optimizer) == (
        "plan", "tinygpt", "6GiB", 2, "adamw-8bit"
    )
    assert build_parser().parse_args(["demo", "--quick"]).quick is True


# 3. Did you mean, for model names
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["plan", "tinygtp", "--budget", "1GiB"], "unknown model 'tinygtp'; did you mean "
         "'tinygpt'? (see 'gradckpt plan --list'"),
        (["plan", "lama-3-8b", "--estimate", "--device", "h100", "--budget", "70GiB"],
         "unknown model 'lama-3-8b'; did you mean 'llama-3-8b'?"),
    ],
)
def test_a_misspelt_model_name_gets_the_close_ones(arguments, expected, capsys):
    assert_one_usage_error(arguments, expected, capsys)


def test_check_model_name_refuses_before_building_anything():
    check_model_name("tinygpt")
    check_model_name("mypackage.models:build")  # a factory is only imported when planned
    with pytest.raises(CommandLineError, match="did you mean 'mistral-7b'"):
        check_model_name("mistrall-7b")


# 4. Did you mean, for a config's model_type
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("model_type", "meant"), [("lama", "'llama'"), ("gpt-2", "'gpt2'")])
def test_an_unknown_model_type_names_the_close_ones_not_all(tmp_path, model_type, meant, capsys):
    transformers = pytest.importorskip("transformers")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": model_type}))
    status, lines = run(
        ["plan", str(tmp_path), "--batch", "1", "--seq", "8", "--strategy", "sqrt"], capsys
    )
    assert status == 1  # the file is wrong, not the command line
    assert len(lines) == 1, lines
    known = len(list(transformers.CONFIG_MAPPING.keys()))  # the lazy mapping has no len()
    assert (
        f"unknown model_type {model_type!r} in {tmp_path / 'config.json'}; did you mean "
        f"{meant}" in lines[0]
    )
    assert (
        f"(Transformers {transformers.__version__} knows {known} model types; see "
        "transformers.CONFIG_MAPPING)" in lines[0]
    )
    assert len(lines[0]) < 400  # close matches only, never the whole list


def test_an_unknown_model_type_is_refused_from_python_too(tmp_path):
    """``hf.model_from_config_json`` itself names the close ones, not Transformers' whole list;
    the command line only tells its error."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path / "config.json"
    path.write_text(json.dumps({"model_type": "lama", "vocab_size": 64}))
    with pytest.raises(ValueError) as raised:
        hf.model_from_config_json(path)
    message = str(raised.value)
    known = len(list(transformers.CONFIG_MAPPING.keys()))
    assert message.startswith(f"unknown model_type 'lama' in {path}; did you mean 'llama'")
    assert message.endswith(
        f"? (Transformers {transformers.__version__} knows {known} model types; see "
        "transformers.CONFIG_MAPPING)"
    )
    assert len(message) < 400  # close matches only, never the whole list


# The shared helper
# --------------------------------------------------------------------------------------------


def test_did_you_mean_names_only_the_close_ones():
    assert did_you_mean("--bugdet", ["--budget", "--debug"], quote=False) == (
        "; did you mean --budget?"
    )
    assert did_you_mean("Mistral-7B", ["mistral-7b"]) == "; did you mean 'mistral-7b'?"
    assert did_you_mean("xyzzy", ["demo", "plan"]) == ""


def test_the_command_line_shares_the_core_helper():
    """One helper (``gradckpt.errors``) for the command line, devices and block names."""
    assert did_you_mean is gradckpt.errors.did_you_mean


def test_close_matches_name_what_aliases_stand_for_each_once():
    aliases = {"h100": "h100-80gb", "h100-sxm": "h100-80gb", "a100": "a100-80gb"}
    assert close_matches("h10", aliases, aliases=aliases) == ["h100-80gb"]
    assert close_matches("h100-sx", aliases, aliases=aliases) == ["h100-80gb"]
    assert close_matches("h10", aliases) == ["h100"]
    assert close_matches("xyzzy", aliases, aliases=aliases) == []


# The --budget to rerun with
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n_bytes", "typed"),
    [
        (65_326_459_290, "60.85GiB"),  # 62300.10 MiB: in GiB, rounded up
        (26_876_283, "25.64MiB"),
        (2**20, "1.00MiB"),
        (2**20 + 1, "1.01MiB"),  # never below: 1.00MiB would not do
        (2**30 - 1, "1.00GiB"),  # not 1024.00MiB
        (1536, "1.50KiB"),
        (1023, "1023B"),
        (3 * 2**40, "3.00TiB"),
    ],
)
def test_the_budget_to_rerun_with_is_typed_in_the_largest_unit_rounded_up(n_bytes, typed):
    assert budget_at_least(n_bytes) == typed == rounded_up_budget(n_bytes)
