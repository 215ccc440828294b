"""``gradckpt plan MODEL --estimate``: the plan predicted for a target device without running the
model, for config.json files and the known configs of well-known models (docs/cli.md). Run as
a user runs it (a subprocess) once, in-process (``main([...])``) for the rest."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from test_cli_commands import error_lines, run_gradckpt

from gradckpt.cli import known_configs as known_configs_module
from gradckpt.cli import main
from gradckpt.cli.known_configs import KNOWN_CONFIGS, KnownConfig
from gradckpt.cli.model_lookup import build_known_model
from gradckpt.measure.memory_parts import FSDP_GATHERED, GRADIENTS, PARAMETERS
from gradckpt.plan import Plan

transformers = pytest.importorskip("transformers")

# The keys docs/cli.md promises in the --json object of an estimate.
JSON_KEYS = {
    "model", "description", "batch", "seq", "dtype", "optimizer", "world_size", "plan",
    "profile", "device",
    "memory_parts", "memory_parts_without_checkpointing", "largest_part",
    "device_usable_bytes", "fits",
}


def llama_config(folder: Path, vocab: int) -> Path:
    """A two-layer Llama's config.json in ``folder``, with a vocabulary of ``vocab``."""
    transformers.LlamaConfig(
        vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    ).save_pretrained(folder)
    return folder / "config.json"


@pytest.fixture(scope="module")
def tiny_llama_config(tmp_path_factory) -> Path:
    return llama_config(tmp_path_factory.mktemp("llama"), 128)


@pytest.fixture(scope="module")
def estimated(tiny_llama_config, tmp_path_factory):
    json_path = tmp_path_factory.mktemp("estimate") / "estimate.json"
    result = run_gradckpt(
        "plan", str(tiny_llama_config), "--estimate", "--device", "h100-80gb", "--batch", "2",
        "--seq", "32", "--budget", "70GiB", "--optimizer", "adamw", "--json", str(json_path),
    )
    return result, json_path


def test_a_config_json_estimated_for_an_h100_prints_plan_breakdown_and_fit(estimated):
    result, _ = estimated
    assert result.returncode == 0, result.stderr
    out = result.stdout
    first, second = out.splitlines()[:2]
    assert first.startswith("fits: predicted peak ") and "predicted extra time +" in first
    assert out.splitlines().count(first) == 2  # the answer first, and again after the tables
    assert second.startswith("LlamaForCausalLM from ")
    assert "batch 2 x 32, float32, optimizer adamw" in out
    assert "estimated for h100-80gb (NVIDIA H100 SXM5 80GB: 80.00 GiB" in out
    assert "model.layers.0" in out and "model.layers.1" in out  # the per-block table
    assert "strategy optimal within 70.00 GiB: predicted peak" in out
    for part in ("parameters", "gradients (trainable parameters)", "optimizer state (AdamW)",
                 "activations kept for backward (under this plan)",
                 "logits, loss and their gradients", "CUDA context and allocator reserve"):
        assert part in out, part
    assert "largest part: " in out
    assert "fits: predicted peak " in out and "of 78.00 GiB usable on h100-80gb" in out
    assert "sizes, not one instant" in out and "rooflines" in out
    assert "per rank" not in out and FSDP_GATHERED not in out  # one process: nothing sharded


def test_the_estimate_json_holds_the_documented_keys(estimated):
    result, json_path = estimated
    assert result.returncode == 0, result.stderr
    report = json.loads(json_path.read_text())
    assert set(report) == JSON_KEYS
    plan = Plan.from_json(json.dumps(report["plan"]))
    assert str(plan) in result.stdout
    assert set(report["profile"]) == {"peak_bytes", "fixed_bytes", "step_seconds"}
    assert report["device"]["name"] == "h100-80gb"
    assert report["device_usable_bytes"] == 78 * 2**30
    assert report["largest_part"] in report["memory_parts"]
    assert report["fits"] is True and plan.predicted_peak_bytes <= report["device_usable_bytes"]
    assert report["world_size"] == 1
    # The optimizer's state is in every plan's peak: two fp32 moments per parameter, and
    # AdamW's step counter per parameter tensor (4 bytes each).
    parameters = report["memory_parts"]["parameters"]
    counters = report["memory_parts"]["optimizer state (AdamW)"] - 2 * parameters
    assert 0 <= counters <= 4 * 1024, counters


def test_list_shows_the_known_configs(capsys):
    assert main(["plan", "--list"]) == 0
    out = capsys.readouterr().out
    assert out.split()[0] == "tinygpt"
    for name in ("llama-3-8b", "mistral-7b", "qwen2.5-7b", "gpt2-xl"):
        assert f"\n{name} " in out, name
    assert "meta-llama/Meta-Llama-3-8B" in out


def test_an_unknown_target_device_is_a_usage_error_listing_the_known_ones(
    tiny_llama_config, capsys
):
    status = main(["plan", str(tiny_llama_config), "--estimate", "--device", "h1000",
                   "--strategy", "sqrt"])
    assert status == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and lines[0].startswith("gradckpt plan: usage error: --device: ")
    assert "did you mean 'h100-80gb'?" in lines[0]
    for name in ("a100-40gb", "h200-141gb", "l4-24gb", "rtx4090-24gb", "'this'"):
        assert name in lines[0]


@pytest.mark.parametrize(
    ("arguments", "expected"),
    [
        (["plan", "tinygpt", "--strategy", "sqrt", "--device", "h100"],
         "names a target device: add --estimate"),
        (["plan", "tinygpt", "--strategy", "sqrt", "--dtype", "bf16"], "--dtype is for --estimate"),
        (["plan", "llama-3-8b", "--strategy", "sqrt", "--device", "cpu"],
         "predict its plan with --estimate instead"),
        (["plan", "tinygpt", "--estimate", "--strategy", "sqrt", "--device", "{memory"],
         "not a JSON object of numbers"),
        (["plan", "llama3-8b", "--estimate", "--strategy", "sqrt", "--device", "h100"],
         "unknown model 'llama3-8b'; did you mean 'llama-3-8b'?"),
        (["plan", "tinygpt", "--strategy", "sqrt", "--world-size", "8"],
         "--world-size 8 is for --estimate: a measured plan profiles one process"),
    ],
)
def test_usage_errors_of_estimates_are_one_line_and_exit_2(arguments, expected, capsys):
    assert main(arguments) == 2
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and "usage error: " in lines[0] and expected in lines[0], lines


def test_llama_3_8b_has_its_published_hyper_parameters():
    settings = KNOWN_CONFIGS["llama-3-8b"].settings
    assert (settings["num_hidden_layers"], settings["hidden_size"],
            settings["intermediate_size"], settings["num_key_value_heads"],
            settings["vocab_size"]) == (32, 4096, 14336, 8, 128256)
    model = build_known_model("llama-3-8b", on_meta=True)  # shapes only: no memory
    assert type(model).__name__ == "LlamaForCausalLM"
    # Transformers 5 keeps rope_theta in rope_parameters; older versions as an attribute.
    rope = getattr(model.config, "rope_parameters", None) or {"rope_theta": model.config.rope_theta}
    assert rope["rope_theta"] == 500000.0
    assert sum(p.numel() for p in model.parameters()) == 8_030_261_248  # "8B"
    assert all(p.device.type == "meta" for p in model.parameters())


@pytest.mark.parametrize(("name", "parameters"), [
    ("mistral-7b", 7_241_732_096), ("qwen2.5-7b", 7_615_616_512), ("gpt2-xl", 1_557_611_200),
])
def test_the_other_known_configs_have_their_published_sizes(name, parameters):
    model = build_known_model(name, on_meta=True)
    assert sum(p.numel() for p in model.parameters()) == parameters


def test_a_reduced_known_config_estimates_end_to_end(monkeypatch, tmp_path, capsys):
    """The known-config path, on Llama-3-8B's settings shrunk to two small layers: built on the
    meta device, trained in the published dtype (bf16) unless --dtype says otherwise; a target
    device given as numbers; a plan that does not fit says so and what would."""
    llama = KNOWN_CONFIGS["llama-3-8b"]
    reduced = {**llama.settings, "vocab_size": 256, "hidden_size": 64, "intermediate_size": 128,
               "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2}
    monkeypatch.setitem(known_configs_module.KNOWN_CONFIGS, "llama-tiny",
                        KnownConfig("reduced Llama-3-8B", reduced, "bfloat16", llama.source))
    device = json.dumps({"memory": "64KiB", "bf16_tflops": 10, "fp32_tflops": 5,
                         "bandwidth_gbps": 100, "name": "toy", "kind": "cpu"})
    assert main(["plan", "llama-tiny", "--estimate", "--device", device, "--batch", "1",
                 "--seq", "16", "--strategy", "none", "--json", str(tmp_path / "e.json")]) == 0
    out = capsys.readouterr().out
    assert out.startswith("does not fit: predicted peak ")
    assert out.splitlines()[1].startswith(
        "LlamaForCausalLM llama-tiny (meta-llama/Meta-Llama-3-8B's config")
    assert "batch 1 x 16, bfloat16, optimizer none" in out
    assert "does not fit: predicted peak " in out and "usable on toy" in out
    assert "CUDA context" not in out  # a CPU has none
    report = json.loads((tmp_path / "e.json").read_text())
    assert report["fits"] is False and report["dtype"] == "bfloat16"
    parameters = report["memory_parts"]["parameters"]

    assert main(["plan", "llama-tiny", "--estimate", "--device", device, "--batch", "1",
                 "--seq", "16", "--strategy", "none", "--dtype", "fp32", "--json",
                 str(tmp_path / "e.json")]) == 0
    assert "batch 1 x 16, float32" in capsys.readouterr().out
    assert json.loads((tmp_path / "e.json").read_text())["memory_parts"]["parameters"] == (
        2 * parameters)


def test_a_measured_plan_names_the_optimizer_it_counts(capsys):
    assert main(["plan", "mlp-chain", "--batch", "1", "--seq", "2", "--strategy", "sqrt",
                 "--optimizer", "adamw", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "optimizer state (AdamW)" in out and "with AdamW's state" in out


@pytest.mark.parametrize(
    ("config", "expected"),
    [
        ('{"hidden_size": 8}', "has no 'model_type'"),
        ('{"model_type": "vit", "hidden_size": 32}', "no causal language model for model_type"),
        ("{not json", "is not valid JSON"),
    ],
    ids=["no-model-type", "no-language-model", "not-json"],
)
def test_a_config_that_cannot_be_built_says_why(config, expected, tmp_path, capsys):
    path = tmp_path / "config.json"
    path.write_text(config)
    assert main(["plan", str(path), "--estimate", "--device", "h100", "--strategy", "sqrt"]) == 1
    lines = error_lines(capsys.readouterr().err)
    assert len(lines) == 1 and expected in lines[0], lines


# --------------------------------------------------------------------------------------------
# --world-size N: one rank of N sharding the model (FSDP2, ZeRO-3)
# --------------------------------------------------------------------------------------------


def _estimate_json(arguments: list[str], json_path: Path, capsys) -> tuple[str, dict]:
    assert main([*arguments, "--json", str(json_path)]) == 0
    return capsys.readouterr().out, json.loads(json_path.read_text())


def test_world_size_estimates_one_rank_of_a_sharded_run(tiny_llama_config, tmp_path, capsys):
    arguments = ["plan", str(tiny_llama_config), "--estimate", "--device", "h100-80gb",
                 "--batch", "2", "--seq", "32", "--strategy", "sqrt", "--optimizer", "adamw"]
    _, whole = _estimate_json(arguments, tmp_path / "whole.json", capsys)
    out, rank = _estimate_json([*arguments, "--world-size", "4"], tmp_path / "rank.json", capsys)

    assert "batch 2 x 32, float32, optimizer adamw, per rank of 4 (FSDP2/ZeRO-3 sharding)\n" in out
    assert "peak without checkpointing " in out and " per rank, the optimizer's state" in out
    for label in ("parameters (1/4 per rank)", "gradients (trainable parameters, 1/4 per rank)",
                  "optimizer state (AdamW, 1/4 per rank)", FSDP_GATHERED,
                  "activations kept for backward (under this plan)"):
        assert f"\n{label} " in out, label
    assert "fits: predicted peak per rank " in out and "usable on each h100-80gb" in out
    assert "Per rank of 4: each keeps 1/4 of the parameters" in out

    # The JSON keeps the parts' plain names; what each rank keeps is a quarter of the whole.
    assert set(rank) == JSON_KEYS and (whole["world_size"], rank["world_size"]) == (1, 4)
    for name in (PARAMETERS, GRADIENTS, "optimizer state (AdamW)"):
        assert rank["memory_parts"][name] == whole["memory_parts"][name] // 4, name
    assert rank["memory_parts"][FSDP_GATHERED] > 0 and FSDP_GATHERED not in whole["memory_parts"]
    gathered = rank["memory_parts"][FSDP_GATHERED]
    assert rank["memory_parts_without_checkpointing"][FSDP_GATHERED] == gathered
    # Activations are one rank's batch's either way.
    activations = "activations kept for backward (under this plan)"
    assert rank["memory_parts"][activations] == whole["memory_parts"][activations]


def test_world_size_1_is_the_default_and_prints_no_ranks(tmp_path, capsys):
    arguments = ["plan", "mlp-chain", "--estimate", "--device", "l4", "--batch", "2", "--seq",
                 "4", "--strategy", "none"]
    default_out, default = _estimate_json(arguments, tmp_path / "default.json", capsys)
    one_out, one = _estimate_json([*arguments, "--world-size", "1"], tmp_path / "one.json",
                                  capsys)
    assert default == one and default["world_size"] == 1
    assert default_out.replace(str(tmp_path / "default.json"), "") == one_out.replace(
        str(tmp_path / "one.json"), "")
    assert "per rank" not in one_out and "Per rank" not in one_out


def test_a_plan_that_does_not_fit_one_rank_suggests_more_ranks(tmp_path, capsys):
    device = json.dumps({"memory": "64KiB", "bf16_tflops": 10, "fp32_tflops": 5,
                         "bandwidth_gbps": 100, "name": "toy", "kind": "cpu"})
    assert main(["plan", "mlp-chain", "--estimate", "--device", device, "--batch", "2", "--seq",
                 "4", "--strategy", "none", "--world-size", "2"]) == 0
    out = capsys.readouterr().out
    assert "does not fit: predicted peak per rank " in out and "usable on each toy" in out
    assert "no plan fits" in out and "more ranks or a larger device" in out


@pytest.mark.parametrize("value", ["0", "-1", "two", "1.5"])
def test_a_world_size_that_is_not_a_positive_integer_is_a_usage_error(value, capsys):
    with pytest.raises(SystemExit) as exit_info:  # argparse's own errors exit from parse_args
        main(["plan", "mlp-chain", "--estimate", "--strategy", "none", "--world-size", value])
    assert exit_info.value.code == 2
    lines = error_lines(capsys.readouterr().err)
    assert lines == [
        f"gradckpt plan: usage error: argument --world-size: expected a positive integer, got "
        f"{value!r} (see 'gradckpt plan --help')"
    ]


def test_the_help_says_the_budget_is_per_rank(capsys):
    with pytest.raises(SystemExit):
        main(["plan", "--help"])
    help_text = " ".join(capsys.readouterr().out.split())
    assert "--world-size N with --estimate: predict one of N ranks" in help_text
    assert "the budget, the peak and the memory parts are then per rank" in help_text


@pytest.mark.slow
def test_llama_3_8b_on_8_ranks_keeps_an_eighth_of_its_parameters_per_rank(tmp_path, capsys):
    """The whole 8B model on the meta device, estimated once (about 10 s): one process would
    hold its 8,030,261,248 parameters in bf16 (the known config's published size, as the
    --world-size 1 run reports them: docs/cli.md); each of 8 ranks holds an eighth."""
    whole_parameter_bytes = 2 * 8_030_261_248
    out, rank = _estimate_json(
        ["plan", "llama-3-8b", "--estimate", "--device", "h100-80gb", "--batch", "1", "--seq",
         "8192", "--strategy", "none", "--optimizer", "adamw", "--world-size", "8"],
        tmp_path / "rank.json", capsys,
    )
    assert "8.03B parameters" in out and "per rank of 8 (FSDP2/ZeRO-3 sharding)" in out
    parts = rank["memory_parts"]
    assert parts[PARAMETERS] == whole_parameter_bytes // 8
    assert parts[GRADIENTS] == whole_parameter_bytes // 8
    # Two bf16 moments per parameter, and a 4-byte step counter per parameter tensor.
    counters = parts["optimizer state (AdamW)"] - 2 * whole_parameter_bytes // 8
    assert 0 <= counters <= 4 * 1024, counters
    assert parts[FSDP_GATHERED] > 0  # FSDP's buffers: sharding.py's model, tested there
    # Without checkpointing one process needs 107.86 GiB; sharded 8 ways, it fits an H100.
    assert rank["fits"] is True


# --------------------------------------------------------------------------------------------
# --output-head: the chunked loss forced, ruled out, or misspelt
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def big_vocabulary_config(tmp_path_factory) -> Path:
    return llama_config(tmp_path_factory.mktemp("big-vocabulary"), 4096)


def _plan_output_head(config: Path, choice: str, capsys) -> str:
    assert main(["plan", str(config), "--estimate", "--device", "h100-80gb", "--batch", "2",
                 "--seq", "64", "--output-head", choice]) == 0
    return capsys.readouterr().out


def test_output_head_chunked_computes_the_loss_in_chunks_and_lists_the_counts(
        big_vocabulary_config, capsys):
    out = _plan_output_head(big_vocabulary_config, "chunked", capsys)
    assert "lm_head (output head)  recomputed: loss in " in out
    assert "logits, loss and their gradients (the output head: one chunk at a time)" in out
    options = out.split("the output head's loss in chunks (")[1].splitlines()[1]
    assert options.count(" chunks ") == 3 and "; this plan: " in options
    assert "this plan: the plain head" not in options


def test_output_head_plain_keeps_the_logits_whole(big_vocabulary_config, capsys):
    out = _plan_output_head(big_vocabulary_config, "plain", capsys)
    assert "lm_head (output head)  kept: the logits whole" in out
    assert "logits, loss and their gradients (the output head)" in out
    assert "this plan: the plain head (logits whole)" in out


def test_a_misspelt_output_head_is_a_usage_error_naming_the_choices(big_vocabulary_config,
                                                                      capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", str(big_vocabulary_config), "--estimate", "--output-head", "chunk"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--output-head" in err and "'chunked'" in err and "'plain'" in err
