"""``gradckpt plan ... --lora R``: fine-tuning with LoRA adapters on a frozen base, measured and
estimated (issue 26), and its bad inputs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli_commands import error_lines
from test_cli_estimate import llama_config

from gradckpt.cli import main
from gradckpt.measure.memory_parts import GRADIENTS, OPTIMIZER_STATE

pytest.importorskip("transformers")
pytest.importorskip("peft")


@pytest.fixture(scope="module")
def config(tmp_path_factory) -> Path:
    return llama_config(tmp_path_factory.mktemp("llama"), 128)


def _plan_json(arguments: list[str], path: Path, capsys) -> tuple[str, dict]:
    assert main([*arguments, "--json", str(path)]) == 0
    return capsys.readouterr().out, json.loads(path.read_text())


def test_an_estimate_with_lora_counts_the_adapters_only(config, tmp_path, capsys):
    arguments = ["plan", str(config), "--estimate", "--device", "h100-80gb", "--batch", "2",
                 "--seq", "32", "--strategy", "sqrt", "--optimizer", "adamw"]
    _, full = _plan_json(arguments, tmp_path / "full.json", capsys)
    out, lora = _plan_json([*arguments, "--lora", "4"], tmp_path / "lora.json", capsys)

    assert out.splitlines()[1].startswith("LlamaForCausalLM from ")
    assert "+ LoRA r=4 on all-linear (" in out and " trainable of " in out
    parts, full_parts = lora["memory_parts"], full["memory_parts"]
    state = f"{OPTIMIZER_STATE} (AdamW)"
    # Gradients and AdamW's two moments of the adapters only: a small share of full training's.
    assert 0 < parts[GRADIENTS] < full_parts[GRADIENTS] / 4
    assert 0 < parts[state] < full_parts[state] / 4
    # fp32 adapters: 2 moments each, and AdamW's step counter, one 4-byte scalar per tensor
    assert 0 <= parts[state] - 2 * parts[GRADIENTS] <= 4 * 64
    # The frozen base is still held, with the adapters on top.
    assert parts["parameters"] > full_parts["parameters"]


def test_a_measured_plan_with_lora_trains_a_peft_model(config, capsys):
    assert main(["plan", str(config), "--batch", "2", "--seq", "16", "--budget", "80%",
                 "--optimizer", "adamw", "--lora", "4", "--lora-targets", "q_proj,v_proj",
                 "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "+ LoRA r=4 on q_proj, v_proj (" in out
    assert "strategy optimal within " in out and "optimizer state (AdamW)" in out


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["--lora", "4", "--lora-targets", "qproj"],
         "--lora-targets qproj: Target modules {'qproj'} not found"),
        (["--lora-targets", "q_proj"], "--lora-targets names the modules that get adapters: "
         "add --lora R"),
    ],
    ids=["unknown-module", "targets-without-rank"],
)
def test_bad_lora_arguments_are_one_line_usage_errors(config, arguments, expected, capsys):
    assert main(["plan", str(config), "--estimate", "--device", "h100-80gb", "--strategy",
                 "sqrt", *arguments]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "usage error: " in lines[0] and expected in lines[0], lines


def test_a_rank_that_is_not_a_positive_integer_is_a_usage_error(config, capsys):
    with pytest.raises(SystemExit) as exited:
        main(["plan", str(config), "--estimate", "--strategy", "sqrt", "--lora", "0"])
    assert exited.value.code == 2
    assert "argument --lora: expected a positive integer, got '0'" in capsys.readouterr().err


def test_an_unknown_target_module_lists_the_linear_layers(config, capsys):
    main(["plan", str(config), "--estimate", "--device", "h100-80gb", "--strategy", "sqrt",
          "--lora", "4", "--lora-targets", "qproj"])
    line = error_lines(capsys.readouterr().err)[0]
    for name in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"):
        assert name in line
    assert "or pass --lora-targets all-linear" in line


# --- --qlora and --8bit: a 4-bit or an 8-bit base (issue 26, items 1 and 2) ------------------

BASES = {
    "--qlora": (4, "on a 4-bit NF4 base (double quantisation, computing in bf16)"),
    "--8bit": (8, "on an 8-bit base (LLM.int8(), outlier threshold 6.0)"),
}


@pytest.mark.parametrize("flag", sorted(BASES))
def test_a_quantised_estimate_holds_the_base_in_its_bits_under_fp32_adapters(
        config, flag, tmp_path, capsys):
    pytest.importorskip("bitsandbytes")
    bits, phrase = BASES[flag]
    arguments = ["plan", str(config), "--estimate", "--device", "h100-80gb", "--batch", "2",
                 "--seq", "32", "--strategy", "sqrt", "--optimizer", "adamw"]
    _, lora = _plan_json([*arguments, "--lora", "8"], tmp_path / "lora.json", capsys)
    out, quantised = _plan_json([*arguments, flag, "--lora", "8"], tmp_path / "q.json", capsys)

    assert "+ LoRA r=8 on all-linear (" in out and phrase in out
    parts, lora_parts = quantised["memory_parts"], lora["memory_parts"]
    # The same adapters, in fp32 (PEFT upcasts them), with their gradients and AdamW's state.
    assert parts[GRADIENTS] == lora_parts[GRADIENTS]
    # The config names no dtype, so the base is fp32; its linear layers (two layers of q, o
    # 32x32; k, v 32x16; gate, up, down 32x64) held in 4 bits (half a byte a weight) or 8.
    # (Their scales are buffers, in "the rest".)
    linear_weights = 2 * (2 * 32 * 32 + 2 * 32 * 16 + 3 * 32 * 64)
    fp32_bytes, quantised_bytes = linear_weights * 4, linear_weights * bits // 8
    assert lora_parts["parameters"] - parts["parameters"] == fp32_bytes - quantised_bytes


@pytest.mark.parametrize("flag", sorted(BASES))
def test_a_quantised_base_alone_gets_adapters_of_rank_16(config, flag, capsys):
    pytest.importorskip("bitsandbytes")
    assert main(["plan", str(config), "--estimate", "--device", "rtx4090", "--batch", "1",
                 "--seq", "16", "--strategy", "none", flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith("fits: predicted peak ")
    assert "+ LoRA r=16 on all-linear (" in out and BASES[flag][1] in out


def test_a_measured_qlora_plan_runs_the_real_4bit_layers(config, capsys):
    pytest.importorskip("bitsandbytes")
    assert main(["plan", str(config), "--batch", "2", "--seq", "16", "--budget", "80%",
                 "--optimizer", "adamw", "--qlora", "--lora", "4", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "+ LoRA r=4 on all-linear (" in out and "4-bit NF4 base" in out
    assert "strategy optimal within " in out


@pytest.mark.parametrize(("flag", "layers"), [("--qlora", "4-bit"), ("--8bit", "8-bit")])
def test_a_quantised_base_without_bitsandbytes_says_how_to_install_it(
        config, flag, layers, capsys, monkeypatch):
    monkeypatch.setitem(__import__("sys").modules, "bitsandbytes", None)  # import fails
    assert main(["plan", str(config), "--estimate", "--strategy", "sqrt", flag]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and f"{flag} needs bitsandbytes for its {layers} layers" in lines[0]
    assert "pip install bitsandbytes" in lines[0]


def test_qlora_and_8bit_together_are_one_usage_error(config, capsys):
    assert main(["plan", str(config), "--estimate", "--strategy", "sqrt", "--qlora",
                 "--8bit"]) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "--qlora and --8bit both quantise the base" in lines[0], lines
