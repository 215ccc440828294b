"""What does gradckpt guarantee, and which test holds each guarantee? Writes docs/guarantees.md.

The page has four parts, none of them typed by hand where a program can say it:

- the engine's invariants, as docs/engine.md states them (its "Guarantees" list), each with
  the tests that hold it;
- what is supported (model kinds, integrations, devices, dtypes, quantised bases, compile,
  DDP/FSDP2) and what is not, with the error or warning a user gets, each with its test;
- the bad-input catalogue: the script runs each bad input on a tiny model (TinyGPT, an
  ``nn.Linear``, a Transformers Llama built from a config: nothing downloads), records the
  exception's class and its message as raised, and checks that the model is as it was
  (``state_dict`` equal, the same parameters trainable, the same hooks, forwards and plan);
- the counts: inputs in the catalogue, invariants, and the examples the fuzz suite runs in CI
  (``EXAMPLES_IN_CI`` in tests/test_apply_fuzz.py, per property test); it prints the test
  functions per area of ``tests/`` too, which the page leaves out (any test added would make it
  stale).

Every test the page names is looked up in its file (parsed, not imported): a test renamed or
removed stops the script with the names it could not find.

Run it (about 15 s on a 2-core CPU):

    .venv/bin/python bench/guarantees.py            # write docs/guarantees.md, print the counts
    .venv/bin/python bench/guarantees.py --check    # exit 1 with a diff if the page is stale

``tests/docs/test_docs_guarantees.py`` runs the check in CI.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import re
import sys
import time
import types
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "guarantees.md"
ENGINE_PAGE = ROOT / "docs" / "engine.md"
FUZZ_TESTS = ROOT / "tests" / "test_apply_fuzz.py"
COMMAND = "python bench/guarantees.py"


# ---- the tests named on the page ----------------------------------------------------------------


def defined_tests(path: Path) -> set[str]:
    """The test functions ``path`` defines, as pytest names them without parameters:
    ``test_x`` at module level, ``TestY::test_x`` in a class."""
    tree = ast.parse(path.read_text(), filename=str(path))
    names = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name.startswith(
                "test"):
            names.add(node.name)
        elif isinstance(node, ast.ClassDef) and node.name.startswith("Test"):
            names.update(f"{node.name}::{item.name}" for item in node.body
                         if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef))
                         and item.name.startswith("test"))
    return names


def missing_tests(test_ids: list[str]) -> list[str]:
    """Those of ``test_ids`` (``tests/file.py::test_name``) that do not exist."""
    missing = []
    found: dict[str, set[str]] = {}
    for test_id in dict.fromkeys(test_ids):
        file, _, name = test_id.partition("::")
        path = ROOT / file
        if not path.is_file():
            missing.append(f"{test_id} (no file {file})")
            continue
        if file not in found:
            found[file] = defined_tests(path)
        if name not in found[file]:
            missing.append(test_id)
    return missing


def count_test_functions() -> dict[str, int]:
    """Test functions defined under each folder of ``tests/`` (``tests/`` itself: "root")."""
    counts: dict[str, int] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        folder = path.parent.relative_to(ROOT / "tests").as_posix()
        area = "root" if folder == "." else folder
        counts[area] = counts.get(area, 0) + len(defined_tests(path))
    return counts


@dataclass
class Fuzzing:
    examples_per_test: int  # EXAMPLES_IN_CI
    property_tests: int  # the test functions Hypothesis drives (decorated with @given)


def fuzzing_in_ci() -> Fuzzing | None:
    """What tests/test_apply_fuzz.py runs in CI: its module-level ``EXAMPLES_IN_CI`` (examples
    per property test) and how many property tests it has; ``None`` while that file is not in
    the suite."""
    if not FUZZ_TESTS.is_file():
        return None
    tree = ast.parse(FUZZ_TESTS.read_text())
    examples = None
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == "EXAMPLES_IN_CI" for t in targets):
            examples = ast.literal_eval(node.value)
    if not isinstance(examples, int):
        raise SystemExit(f"{FUZZ_TESTS.relative_to(ROOT)} sets no module-level "
                         f"EXAMPLES_IN_CI = <int>")

    def driven_by_hypothesis(node: ast.AST) -> bool:
        return isinstance(node, ast.FunctionDef) and node.name.startswith("test") and any(
            isinstance(d, ast.Call) and getattr(d.func, "id", getattr(d.func, "attr", None))
            == "given" for d in node.decorator_list)

    return Fuzzing(examples, sum(map(driven_by_hypothesis, tree.body)))


# ---- part 1: the engine's invariants -------------------------------------------------------------

EQUIVALENCE = "tests/engine/test_engine_equivalence.py"
BEHAVIOUR = "tests/engine/test_engine_behaviour.py"
REAL_WORLD = "tests/engine/test_engine_real_world.py"
MEMORY = "tests/engine/test_engine_memory.py"

# By number, as docs/engine.md lists them.
INVARIANT_TESTS = {
    1: [f"{EQUIVALENCE}::test_training_step_is_bit_identical",
        f"{EQUIVALENCE}::test_adamw_steps_end_with_identical_parameters",
        "tests/engine/test_engine_properties.py::test_random_checkpointed_chain_matches_plain_chain",
        f"{BEHAVIOUR}::test_global_rng_state_after_a_step_is_the_plain_steps",
        f"{REAL_WORLD}::test_global_settings_of_the_forward_pass_are_replayed_and_put_back",
        "tests/engine/test_engine_cuda.py::test_dropout_on_the_device_is_replayed"],
    2: [f"{EQUIVALENCE}::test_batchnorm_statistics_after_one_and_several_steps",
        f"{REAL_WORLD}::test_buffers_end_the_step_with_their_plain_values_and_versions",
        f"{BEHAVIOUR}::test_forward_pre_hooks_run_again_during_recomputation"],
    3: [f"{BEHAVIOUR}::test_without_grad_the_engine_does_nothing",
        f"{BEHAVIOUR}::test_without_grad_a_checkpointed_module_runs_exactly_like_the_plain_one",
        "tests/integrations/test_integrations_hf.py::"
        "test_generate_in_eval_runs_as_without_gradckpt_and_train_brings_the_plan_back"],
    4: [f"{EQUIVALENCE}::test_frozen_base_adapters_get_plain_gradients",
        f"{REAL_WORLD}::test_hand_written_lora_on_a_subclass_input_changed_after_each_block"],
    5: [f"{EQUIVALENCE}::test_autograd_grad_wrt_inputs_and_parameters",
        f"{EQUIVALENCE}::test_backward_twice_with_retain_graph",
        f"{EQUIVALENCE}::test_autocast_bfloat16_on_cpu",
        f"{EQUIVALENCE}::test_checkpoint_inside_checkpointed_function"],
    6: [f"{BEHAVIOUR}::test_recomputation_stops_after_the_last_saving_op",
        f"{BEHAVIOUR}::test_recomputation_runs_the_region_once_per_backward",
        f"{MEMORY}::test_after_backward_only_gradients_and_the_held_output_remain",
        f"{MEMORY}::test_retain_graph_backward_frees_recomputed_tensors_each_time"],
    7: [f"{BEHAVIOUR}::test_differing_recomputation_raises_checkpoint_error",
        f"{REAL_WORLD}::test_parameter_changed_before_backward_is_a_clear_error",
        f"{REAL_WORLD}::test_region_input_changed_in_place_before_backward_is_a_clear_error"],
}


@dataclass
class Invariant:
    number: int
    title: str  # "Same numbers."
    statement: str  # the first sentence after the title


def engine_invariants() -> list[Invariant]:
    """The numbered list under "## Guarantees" in docs/engine.md: each item's bold title and
    its first sentence."""
    text = ENGINE_PAGE.read_text().split("\n## Guarantees\n", 1)[1].split("\n## ", 1)[0]
    items = re.findall(r"^(\d+)\. \*\*(.+?)\*\* (.+?)(?=^\d+\. |\Z)", text, re.M | re.S)
    invariants = []
    for number, title, body in items:
        body = " ".join(body.split())
        statement = re.match(r"(.+?\.)(?: |$)", body)[1]
        invariants.append(Invariant(int(number), title, statement))
    if [i.number for i in invariants] != sorted(INVARIANT_TESTS):
        raise SystemExit(f"docs/engine.md lists invariants {[i.number for i in invariants]}, "
                         f"this script has tests for {sorted(INVARIANT_TESTS)}")
    return invariants


# ---- part 2: what is supported and what is not ---------------------------------------------------

HF = "tests/integrations/test_integrations_hf.py"
QUANTIZED = "tests/integrations/test_integrations_quantized.py"
REPLAY = "tests/measure/test_measure_replay_check.py"


@dataclass
class Support:
    area: str
    what: str
    tests: list[str]
    # For what is not supported: the catalogue's cases whose error or warning a user gets.
    cases: list[str] = field(default_factory=list)


SUPPORTED = [
    Support("model kinds", "chains of blocks found by structure: `nn.Sequential`, "
            "`nn.ModuleList` stacks (`model.layers`, `transformer.h`), TinyGPT, CNNs",
            ["tests/measure/test_measure_chain.py::test_tiny_gpt",
             "tests/measure/test_measure_chain.py::test_small_cnn_blocks_include_the_head",
             "tests/test_enable.py::test_gpt_fits_the_budget_with_identical_gradients"]),
    Support("model kinds", "blocks given by hand (`blocks=`: modules, names or a ModuleList)",
            ["tests/measure/test_measure_chain.py::"
             "test_resolve_modules_names_and_mixtures_in_the_order_given"]),
    Support("model kinds", "Transformers families: GPT-2, Llama, Qwen2, BERT, T5, ViT (built "
            "from configs), encoder-decoders, two-tower models (CLIP)",
            ["tests/integrations/test_integrations_families.py::"
             "test_plans_fit_and_are_predicted_on_each_family",
             "tests/test_enable.py::"
             "test_encoder_decoder_plans_stop_at_the_decoder_and_train_identically",
             "tests/test_enable.py::test_two_towers_are_profiled_in_the_order_they_run"]),
    Support("model kinds", "BatchNorm and other modules with buffers",
            [f"{EQUIVALENCE}::test_batchnorm_statistics_after_one_and_several_steps"]),
    Support("integrations", "the Transformers Trainer (`GradckptCallback`)",
            ["tests/integrations/test_integrations_hf_trainer.py::"
             "test_trains_exactly_as_without_the_callback",
             "tests/integrations/test_integrations_hf_trainer.py::"
             "test_budget_holds_with_the_optimizer_state_and_accumulated_gradients"]),
    Support("integrations", "PEFT and LoRA on a frozen base, applied before or after `enable`",
            [f"{HF}::test_peft_before_or_after_enable_gives_the_plain_peft_gradients",
             "tests/integrations/test_integrations_hf_trainer.py::"
             "test_lora_trains_exactly_as_without_the_callback"]),
    Support("integrations", "the output head and its loss in chunks (causal language models)",
            ["tests/integrations/test_integrations_hf_head.py::"
             "test_a_chunked_head_trains_as_the_plain_model"]),
    Support("integrations", "`generate()` in eval mode, with the cache",
            [f"{HF}::test_generate_in_eval_runs_as_without_gradckpt_and_train_brings_the_plan_back"
             ]),
    Support("integrations", "`torch.compile` of a planned model (`torch.compile(model)`, "
            "`model.compile()`, Inductor)",
            ["tests/engine/test_engine_compiled.py::test_a_compiled_plan_trains_like_the_plain_model",
             "tests/engine/test_engine_compiled.py::"
             "test_model_compile_and_inductor_train_like_the_plain_model"]),
    Support("integrations", "DDP, gradient accumulation under `no_sync()`",
            ["tests/integrations/test_integrations_ddp.py::"
             "test_ddp_with_a_plan_gives_the_gradients_of_one_plain_process",
             "tests/integrations/test_integrations_ddp.py::test_gradient_accumulation_under_no_sync",
             "tests/test_distributed.py::test_ranks_that_time_differently_get_rank_0s_plan"]),
    Support("integrations", "FSDP2 (`fully_shard`), planned before or after sharding",
            ["tests/integrations/test_integrations_fsdp.py::"
             "test_fsdp2_with_a_plan_gives_the_gradients_without_one"]),
    Support("devices", "CPU (the whole suite runs there)",
            ["tests/test_enable_training_loop.py::"
             "test_readme_example_fits_its_60_percent_budget_and_trains_the_same"]),
    Support("devices", "CUDA: RNG replay on the device, offload on side streams (run where a "
            "GPU is present)",
            ["tests/engine/test_engine_cuda.py::test_dropout_on_the_device_is_replayed",
             "tests/engine/test_engine_cuda.py::test_offload_through_side_streams_is_exact"]),
    Support("devices", "the meta device and fake tensors (`estimate`, models too big for the "
            "machine)",
            [f"{REAL_WORLD}::test_meta_model_under_every_policy",
             "tests/predict/test_predict_estimate.py::test_a_model_on_the_meta_device_is_estimated_in_bf16"
             ]),
    Support("dtypes", "float32; bf16 autocast (as Accelerate and the Trainer's `bf16=True` "
            "apply it); a bf16 base with fp32 adapters; float64",
            [f"{EQUIVALENCE}::test_autocast_bfloat16_on_cpu",
             f"{HF}::test_mixed_precision_as_accelerate_applies_it_is_planned_as_it_runs",
             f"{HF}::test_a_bf16_frozen_base_with_fp32_adapters",
             f"{REAL_WORLD}::test_peft_llama_with_a_float64_default_dtype_in_the_forward_pass"]),
    Support("quantised bases", "bitsandbytes 4-bit (QLoRA) and 8-bit with frozen weights "
            "(`load_in_8bit=True`), measured on bitsandbytes' CPU backend; GPT-2's `Conv1D` "
            "layers quantised as Transformers' loading quantises them",
            [f"{QUANTIZED}::test_a_planned_qlora_loop_fits_its_budget_and_trains_bit_for_bit",
             f"{QUANTIZED}::test_a_conv1d_is_quantised_as_the_linear_layer_of_its_transposed_weight",
             "tests/integrations/test_integrations_quantized_8bit.py::"
             "test_a_planned_8bit_lora_loop_fits_its_budget_and_trains_bit_for_bit"]),
]

NOT_SUPPORTED = [
    Support("model kinds", "a model with no chain of blocks gradckpt can find, without "
            "`blocks=`", ["tests/measure/test_measure_chain.py::"
                          "test_no_chain_is_a_usage_error_explaining_blocks"],
            ["no-blocks"]),
    Support("quantised bases", "other quantisers (GPTQ, AWQ, HQQ, torchao, quanto, EETQ, AQLM) "
            "and bitsandbytes 8-bit training its fp16 weights",
            [f"{QUANTIZED}::test_a_quantiser_gradckpt_does_not_model_is_named_and_the_model_left_alone"],
            ["foreign-quantiser"]),
    Support("dtypes", "an estimate in bf16 for a card without bf16 (V100, T4)",
            ["tests/predict/test_predict_device_presets.py::"
             "test_a_bf16_estimate_on_a_card_without_bf16_is_refused"],
            ["bf16-without-bf16"]),
    Support("integrations", "Transformers' own checkpointing together with a plan (one "
            "mechanism checkpoints a layer: the plan's)",
            [f"{HF}::test_enable_on_a_model_with_transformers_checkpointing_on_replaces_it_until_disable",
             f"{HF}::test_a_later_transformers_enable_keeps_the_plan_and_warns_once"],
            ["transformers-checkpointing-on"]),
    Support("integrations", "`preserve_rng_state=False` around dropout (recomputation draws "
            "other random numbers)",
            [f"{HF}::test_gradckpt_checkpoint_without_rng_replay_around_dropout_warns_once"],
            ["no-rng-replay"]),
    Support("model kinds", "a forward pass that does not repeat itself from the same torch RNG "
            "state (randomness from numpy or Python's `random`): recomputation computes "
            "otherwise",
            [f"{REPLAY}::test_randomness_drawn_outside_torch_is_said_by_profile_and_enable"],
            ["randomness-outside-torch"]),
    Support("model kinds", "a forward pass that computes otherwise with what gradckpt changes "
            "while it works (a Hugging Face cache off): it trains as the changed model",
            [f"{REPLAY}::test_a_forward_changed_by_an_ecosystem_hook_is_said",
             f"{REPLAY}::test_hugging_face_models_with_their_cache_and_dropout_replay"],
            ["forward-changed-by-hooks"]),
    Support("integrations", "multi-process Trainer runs (DDP, FSDP or DeepSpeed under the "
            "Trainer), DeepSpeed itself: no error, not tested", []),
    Support("devices", "accelerators other than CUDA (MPS, XPU): no error, not tested", []),
]


# ---- part 3: the bad-input catalogue -------------------------------------------------------------


def tiny_gpt() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """TinyGPT, 2 blocks of width 32, and a batch of 2 x 16 tokens with targets: its forward
    returns the loss."""
    from gradckpt.toy_models import GPTConfig, TinyGPT

    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(vocab_size=64, block_size=16, n_layer=2, n_head=2, n_embd=32))
    tokens = torch.randint(0, 64, (2, 17))
    return model.train(), (tokens[:, :-1], tokens[:, 1:])


def tiny_llama() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A Transformers Llama from a config (2 layers, width 64, vocabulary 64), a batch of 2 x
    16 tokens with labels."""
    from gradckpt.integrations import hf_families

    torch.manual_seed(0)
    model = hf_families.hf_model("llama", num_hidden_layers=2, vocab_size=64,
                                 max_position_embeddings=32).train()
    ids = torch.randint(0, 64, (2, 16))
    return model, {"input_ids": ids, "labels": ids}


def linear() -> tuple[nn.Module, torch.Tensor]:
    """One ``nn.Linear(8, 8)`` and a batch of 4."""
    torch.manual_seed(0)
    return nn.Linear(8, 8), torch.randn(4, 8)


MODELS: dict[str, tuple[str, Callable[[], tuple[nn.Module, Any]]]] = {
    "gpt": ("TinyGPT (2 blocks)", tiny_gpt),
    "llama": ("Llama (2 layers)", tiny_llama),
    "linear": ("`nn.Linear(8, 8)`", linear),
}


@dataclass
class Case:
    """One bad input: ``call`` (Python, run with ``model``, ``sample``, ``gradckpt``,
    ``torch``, ``nn`` and what ``setup`` defined) on a fresh ``MODELS[model]``.

    ``outcome``: "error" (it must raise a gradckpt error and leave the model as it was),
    "warning" (it warns, and goes on), or "replaced" (no error: the call replaces what the
    first did)."""

    name: str
    what: str
    model: str
    call: str
    tests: list[str]
    setup: str = ""
    outcome: str = "error"
    # Packages the call needs imported, as empty stand-ins (GPTQ itself needs a GPU to install).
    stand_in_packages: tuple[str, ...] = ()
    given: str = ""  # what ``setup`` made, for the page (default: ``setup`` itself, one line)


BUDGET = "tests/test_budget.py"
CHAIN = "tests/measure/test_measure_chain.py"
PROFILE = "tests/measure/test_measure_profile.py"
ENABLE = "tests/test_enable.py"
DOCS = "tests/docs/test_docs_guarantees.py"
CATALOGUE_TEST = f"{DOCS}::test_every_bad_input_is_refused_and_leaves_the_model_as_it_was"


def budget_case(name: str, what: str, budget: str, test: str) -> Case:
    """``enable`` on TinyGPT with ``budget`` (as written in Python), held by ``test`` of
    tests/test_budget.py."""
    return Case(name, what, "gpt",
                f'gradckpt.enable(model, sample, budget={budget}, optimizer="none")',
                [f"{BUDGET}::{test}"])


CASES = [
    # Budgets: refused before anything runs.
    budget_case("budget-unit", "a budget with an unknown unit", '"6XB"',
                "test_strings_not_understood_list_the_accepted_forms"),
    budget_case("budget-ambiguous", "a budget unit without B", '"6G"',
                "test_unit_without_b_is_ambiguous"),
    budget_case("budget-bare-number", "a number in a string, no unit", '"60"',
                "test_a_bare_number_in_a_string_is_refused_with_what_was_meant"),
    budget_case("budget-fraction", "a fraction for a share", '0.6',
                "test_a_fraction_below_one_is_refused_as_the_share_it_surely_is"),
    budget_case("budget-negative", "a negative budget", '"-5GiB"',
                "test_negative_budgets_are_refused_as_negative"),
    budget_case("budget-negative-int", "a negative budget in bytes", '-1',
                "test_negative_budgets_are_refused_as_negative"),
    budget_case("budget-zero", "a zero budget", '0',
                "test_zero_budgets_are_refused"),
    budget_case("budget-bool", "a bool for a budget", 'True',
                "test_bools_are_refused"),
    budget_case("budget-percent", "a share above 100%", '"150%"',
                "test_percentage_outside_0_to_100_is_refused"),
    Case("infeasible", "a budget below every plan", "gpt",
         'gradckpt.enable(model, sample, budget="100KiB", optimizer="adamw")',
         [f"{ENABLE}::test_an_impossible_budget_names_the_smallest_feasible_one",
          "tests/solvers/test_solvers_strategies.py::test_budget_error_states_the_exact_minimum"]),
    # The other arguments of enable, profile and estimate.
    Case("strategy", "a misspelt strategy name", "gpt",
         'gradckpt.enable(model, sample, budget="60%", strategy="optimial", optimizer="none")',
         [f"{ENABLE}::test_a_bad_request_is_refused_before_anything_runs",
          "tests/solvers/test_solvers_strategies.py::test_unknown_strategy_lists_valid_names"]),
    Case("strategy-without-budget", "a budget-driven strategy without a budget", "gpt",
         'gradckpt.enable(model, sample, budget=None, strategy="optimal", optimizer="none")',
         [f"{ENABLE}::test_a_bad_request_is_refused_before_anything_runs"]),
    Case("output-head", "an unknown `output_head`", "gpt",
         'gradckpt.enable(model, sample, budget="60%", optimizer="none", output_head="bogus")',
         ["tests/integrations/test_integrations_hf_head.py::"
          "test_an_unknown_output_head_is_refused_and_leaves_the_model_unplanned"]),
    Case("optimizer-name", "a misspelt optimizer name", "gpt",
         'gradckpt.enable(model, sample, budget="60%", optimizer="adamww")',
         [CATALOGUE_TEST]),
    Case("optimizer-name-estimate", "a misspelt optimizer name, estimating", "gpt",
         'gradckpt.estimate(model, sample, device="a100-80gb", optimizer="adafactorr")',
         ["tests/predict/test_predict_estimate.py::"
          "test_the_optimizer_state_is_in_the_peak_and_the_memory_is_broken_down"]),
    Case("keep-output", "`keep_output` not a bool", "gpt",
         'gradckpt.profile(model, sample, keep_output="no")',
         [f"{PROFILE}::test_keep_output_that_is_not_a_bool_is_a_usage_error"]),
    Case("repeats", "`repeats` below 1", "gpt",
         "gradckpt.profile(model, sample, repeats=0)", [CATALOGUE_TEST]),
    Case("accumulation-steps", "`accumulation_steps` below 1", "gpt",
         'gradckpt.enable(model, sample, budget="60%", optimizer="none", accumulation_steps=0)',
         [CATALOGUE_TEST]),
    Case("ddp", "`ddp` not a bool", "gpt",
         'gradckpt.enable(model, sample, budget="60%", optimizer="none", ddp="yes")',
         [f"{ENABLE}::test_ddp_that_is_not_a_bool_is_refused_before_anything_runs"]),
    Case("ddp-world-size", "`ddp=True` with a `world_size`, estimating", "gpt",
         'gradckpt.estimate(model, sample, device="h100-80gb", ddp=True, world_size=2)',
         [f"{ENABLE}::test_an_estimate_under_ddp_is_one_ranks_and_refuses_a_world_size"]),
    Case("device-preset", "an unknown device preset", "gpt",
         'gradckpt.estimate(model, sample, device="h100-80g")',
         ["tests/predict/test_predict_estimate.py::test_an_unknown_device_lists_the_known_ones",
          "tests/predict/test_predict_devices.py::"
          "test_unknown_name_lists_the_known_ones_and_suggests_the_closest"]),
    Case("dtype", "a dtype that is not floating, estimating", "gpt",
         'gradckpt.estimate(model, sample, device="h100-80gb", dtype=torch.int8)',
         ["tests/predict/test_predict_estimate.py::test_a_dtype_that_is_not_floating_is_refused"]),
    Case("bf16-without-bf16", "a bf16 estimate for a card without bf16", "gpt",
         'gradckpt.estimate(model, sample, device="v100-32gb", dtype=torch.bfloat16)',
         ["tests/predict/test_predict_device_presets.py::"
          "test_a_bf16_estimate_on_a_card_without_bf16_is_refused"]),
    Case("world-size", "`world_size` below 1, estimating", "gpt",
         'gradckpt.estimate(model, sample, device="h100-80gb", world_size=0)',
         [CATALOGUE_TEST]),
    # The model and the sample.
    Case("no-blocks", "no detectable blocks", "linear",
         'gradckpt.enable(model, sample, budget="60%", optimizer="none")',
         [f"{CHAIN}::test_no_chain_is_a_usage_error_explaining_blocks"]),
    Case("blocks-misspelt", "a misspelt block name", "gpt",
         'gradckpt.enable(model, sample, budget="60%", optimizer="none", '
         'blocks=["transfomer.h.1"])',
         [f"{CHAIN}::test_resolve_unknown_name_suggests_close_matches"]),
    Case("blocks-order", "blocks given out of the order they run", "gpt",
         'gradckpt.enable(model, sample, budget="60%", optimizer="none", '
         'blocks=["transformer.h.1", "transformer.h.0"])',
         [f"{ENABLE}::test_blocks_given_out_of_run_order_are_refused"]),
    Case("sample-type", "no sample (neither a tensor, a tuple nor a dict)", "gpt",
         'gradckpt.enable(model, None, budget="60%", optimizer="none")',
         [f"{PROFILE}::test_bad_samples_and_losses_are_usage_errors"]),
    Case("sample-fails", "a sample the model cannot run (a sequence too long)", "gpt",
         'gradckpt.enable(model, (torch.zeros(2, 40, dtype=torch.long),) * 2, budget="60%", '
         'optimizer="none")',
         ["tests/test_enable_sample_errors.py::"
          "test_a_sample_the_model_cannot_run_says_so_and_leaves_nothing_behind"]),
    Case("sample-fails-hf", "a sample the model cannot run (labels one token too long)",
         "llama",
         'gradckpt.enable(model, {**sample, "labels": torch.zeros(2, 17, dtype=torch.long)}, '
         'budget="60%", optimizer="none")',
         ["tests/test_enable_sample_errors.py::"
          "test_a_sample_the_model_cannot_run_says_so_and_leaves_nothing_behind"]),
    Case("no-loss", "an output gradckpt cannot take the loss of", "gpt",
         'gradckpt.enable(model, sample[0], budget="60%", optimizer="none", '
         'loss_fn=lambda logits: (logits, logits))',
         [f"{PROFILE}::test_bad_samples_and_losses_are_usage_errors"]),
    Case("foreign-quantiser", "a quantiser gradckpt does not model (GPTQ)", "linear",
         "gradckpt.estimate(nn.Sequential(model, gptq_layer), sample)",
         [f"{QUANTIZED}::test_a_quantiser_gradckpt_does_not_model_is_named_and_the_model_left_alone"],
         given="`gptq_layer`: an `nn.Linear` of a class from `auto_gptq`",
         setup="class QuantLinear(nn.Linear): pass\n"
               "QuantLinear.__module__ = 'auto_gptq.nn_modules.qlinear'\n"
               "gptq_layer = QuantLinear(8, 8)",
         stand_in_packages=("auto_gptq",)),
    # Plans.
    Case("other-model", "a plan made for another model (one block deeper) applied", "gpt",
         "gradckpt.apply(model, plan)",
         ["tests/test_apply_other_model.py::test_a_plan_on_another_model_says_how_it_differs",
          "tests/test_apply.py::test_a_plan_for_another_model_is_a_usage_error"],
         setup="from gradckpt.toy_models import GPTConfig, TinyGPT\n"
               "other = TinyGPT(GPTConfig(vocab_size=64, block_size=16, n_layer=3, n_head=2, "
               "n_embd=32))\n"
               'plan = gradckpt.solve(gradckpt.profile(other, sample, optimizer="none"), '
               'strategy="every-layer")',
         given="`plan`: every layer of a TinyGPT of 3 blocks"),
    Case("plan-before-wrapping", "a plan made before the model was wrapped (PEFT, DDP)", "gpt",
         "gradckpt.apply(wrapped, plan)",
         ["tests/test_apply_other_model.py::test_a_plan_on_another_model_says_how_it_differs"],
         setup='plan = gradckpt.solve(gradckpt.profile(model, sample, optimizer="none"), '
               'strategy="every-layer")\n'
               "wrapped = nn.Sequential()\n"
               "wrapped.add_module('module', model)",
         given="`plan`: every layer of the model; `wrapped`: the model inside a wrapper "
               "(`wrapped.module`)"),
    Case("module-in-a-segment", "a block both checkpointed as a module and in a plan's segment",
         "gpt", "gradckpt.apply(model, plan)",
         ["tests/test_apply_fuzz.py::"
          "test_a_block_of_a_planned_segment_cannot_also_be_checkpointed_as_a_module"],
         setup='plan = gradckpt.solve(gradckpt.profile(model, sample, optimizer="none"), '
               'strategy="every-layer")\n'
               "gradckpt.checkpoint_module(model.transformer.h[0])",
         given="`plan`: every layer; block `transformer.h.0` checkpointed with "
               "`gradckpt.checkpoint_module`"),
    Case("not-a-plan", "something else than a plan", "gpt",
         'gradckpt.apply(model, "every-layer")', ["tests/test_apply.py::test_apply_needs_a_plan"]),
    Case("enable-twice", "`enable` on a model that carries a plan", "gpt",
         'gradckpt.enable(model, sample, budget="95%", optimizer="none")',
         ["tests/test_enable_replanning.py::"
          "test_enable_twice_replaces_the_plan_and_trains_as_the_plain_model",
          "tests/test_enable_replanning.py::test_enable_after_the_reported_crash_and_on_a_fresh_model"],
         setup='gradckpt.enable(model, sample, budget=None, strategy="every-layer", '
               'optimizer="none")',
         outcome="replaced"),
    # The engine.
    Case("policy-name", "an unknown checkpoint policy", "linear",
         'gradckpt.checkpoint(model, sample, policy="save-everything")',
         [f"{BEHAVIOUR}::test_unknown_policy_name_lists_the_valid_names"]),
    Case("not-callable", "checkpointing something that is not callable", "linear",
         "gradckpt.checkpoint(42, sample)",
         [f"{BEHAVIOUR}::test_non_callable_fn_is_a_usage_error"]),
    Case("recomputation-differs", "a region whose recomputation differs from its forward",
         "linear", "gradckpt.checkpoint(changes_each_call, sample).sum().backward()",
         [f"{BEHAVIOUR}::test_differing_recomputation_raises_checkpoint_error",
          f"{BEHAVIOUR}::test_function_that_branches_on_a_global_counter_raises"],
         given="`changes_each_call(x)`: `model(x)` in the forward pass, `model(x[:2])` in "
               "recomputation",
         setup="calls = []\n"
               "def changes_each_call(x):\n"
               "    calls.append(1)\n"
               "    return model(x) if len(calls) == 1 else model(x[:2])"),
    Case("nondeterministic-block", "a block that recomputes otherwise (data-dependent shapes "
         "from state no replay restores)", "linear",
         'gradckpt.enable(chain, sample, budget=None, strategy="every-layer", '
         'optimizer="none", blocks=list(chain))',
         ["tests/test_enable_nondeterministic_block.py::"
          "test_enable_names_the_block_that_recomputes_otherwise_and_changes_nothing",
          "tests/test_enable_nondeterministic_block.py::"
          "test_a_planned_step_names_the_block_that_recomputes_otherwise"],
         given="`chain`: `model` then a block keeping the rows above a threshold that moves "
               "with a Python call counter",
         setup="class RowsByCallCount(nn.Module):\n"
               "    def __init__(self):\n"
               "        super().__init__()\n"
               "        self.linear = nn.Linear(8, 8)\n"
               "        self.calls = 0\n"
               "    def forward(self, x):\n"
               "        self.calls += 1\n"
               "        rows = x[:, 0] > (self.calls % 3) * 0.5 - 0.5\n"
               "        return x * self.linear(x[rows]).mean()\n"
               "chain = nn.Sequential(model, RowsByCallCount())"),
    # Warnings: the call goes on.
    Case("transformers-checkpointing-on", "Transformers' own checkpointing on, then `enable`",
         "llama", 'gradckpt.enable(model, sample, budget=None, strategy="every-layer", '
         'optimizer="none")',
         [f"{HF}::test_enable_on_a_model_with_transformers_checkpointing_on_replaces_it_until_disable"],
         setup="model.gradient_checkpointing_enable()", outcome="warning"),
    Case("randomness-outside-torch", "a forward drawing randomness outside torch", "linear",
         "gradckpt.profile(chain, sample, repeats=1)",
         [f"{REPLAY}::test_randomness_drawn_outside_torch_is_said_by_profile_and_enable"],
         given="`chain`: `model` then a module scaling by Python's `random.random()`",
         setup="import random\n"
               "random.seed(0)  # the page the same each time it is written\n"
               "class PythonNoise(nn.Module):\n"
               "    def forward(self, x):\n"
               "        return x * random.random()\n"
               "chain = nn.Sequential(model, PythonNoise())", outcome="warning"),
    Case("forward-changed-by-hooks", "a forward that computes otherwise with its cache off",
         "linear", "profiled_with_cache_off(chain, sample)",
         [f"{REPLAY}::test_a_forward_changed_by_an_ecosystem_hook_is_said"],
         given="`chain`: `model` then a module that doubles its input while its `use_cache` is "
               "on; an ecosystem hook (as the Hugging Face one) turns it off while gradckpt works",
         setup="from gradckpt.ecosystem_hooks import (register_ecosystem_hook,\n"
               "                                      unregister_ecosystem_hook)\n"
               "class Cached(nn.Module):\n"
               "    use_cache = True\n"
               "    def forward(self, x):\n"
               "        return x * (2.0 if self.use_cache else 1.0)\n"
               "chain = nn.Sequential(model, Cached())\n"
               "def cache_off(module, occasion):\n"
               "    if not isinstance(module, nn.Sequential) or not isinstance(\n"
               "            module[-1], Cached):\n"
               "        return None\n"
               "    module[-1].use_cache = False\n"
               "    return lambda: setattr(module[-1], 'use_cache', True)\n"
               "def profiled_with_cache_off(chain, sample):\n"
               "    register_ecosystem_hook(cache_off)\n"
               "    try:\n"
               "        return gradckpt.profile(chain, sample, repeats=1)\n"
               "    finally:\n"
               "        unregister_ecosystem_hook(cache_off)", outcome="warning"),
    Case("no-rng-replay", "`preserve_rng_state=False` around dropout", "linear",
         "gradckpt.checkpoint(with_dropout, sample, preserve_rng_state=False)",
         [f"{HF}::test_gradckpt_checkpoint_without_rng_replay_around_dropout_warns_once"],
         setup="with_dropout = nn.Sequential(model, nn.Dropout(0.1))", outcome="warning"),
]


@dataclass
class Result:
    case: Case
    error: str  # the class's name, or "GradckptWarning", or "" where nothing was raised
    message: str
    changed: list[str]  # what the call left changed in the model (empty: nothing)


def model_state(model: nn.Module) -> dict[str, Any]:
    """What a failed call must leave as it was: values, what trains, modes, hooks on every
    module (and torch's global module hooks), forwards set on instances, classes, the plan."""
    from torch.nn.modules import module as torch_module

    import gradckpt

    def hooks(m: nn.Module) -> tuple[int, ...]:
        return tuple(len(getattr(m, name)) for name in (
            "_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks",
            "_state_dict_hooks", "_load_state_dict_pre_hooks"))

    return {
        "state_dict values": {k: v.detach().clone() for k, v in model.state_dict().items()},
        "trainable parameters": {n: p.requires_grad for n, p in model.named_parameters()},
        "training modes": {n: m.training for n, m in model.named_modules()},
        "module hooks": {n: hooks(m) for n, m in model.named_modules()},
        "global module hooks": (len(torch_module._global_forward_hooks),
                                len(torch_module._global_forward_pre_hooks),
                                len(torch_module._global_backward_hooks)),
        "forwards set on modules": sorted(n for n, m in model.named_modules()
                                          if "forward" in m.__dict__),
        "module classes": {n: type(m) for n, m in model.named_modules()},
        "plan": gradckpt.get_plan(model),
    }


def what_changed(before: dict[str, Any], after: dict[str, Any]) -> list[str]:
    changed = []
    for key, value in before.items():
        if key == "state_dict values":
            other = after[key]
            same = value.keys() == other.keys() and all(
                torch.equal(v, other[k]) for k, v in value.items())
        elif key == "plan":
            same = after[key] is value
        else:
            same = after[key] == value
        if not same:
            changed.append(key)
    return changed


def one_line(text: str) -> str:
    """A message as one line of a table cell: whitespace collapsed, memory addresses
    masked, pipes escaped."""
    text = re.sub(r"0x[0-9a-f]{6,}", "0x…", " ".join(text.split()))
    return text.replace("|", "\\|")


def run_case(case: Case) -> Result:
    """Run ``case`` on a fresh tiny model; see ``Case``."""
    import gradckpt
    from gradckpt.errors import forget_warnings

    model, sample = MODELS[case.model][1]()
    namespace: dict[str, Any] = {"gradckpt": gradckpt, "torch": torch, "nn": nn,
                                 "model": model, "sample": sample}
    original = model_state(model)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the setup's own (no optimizer given, ...)
        exec(case.setup, namespace)
    before = model_state(model)
    forget_warnings()  # warn-once warnings of earlier calls in this process warn again
    error, message = "", ""
    stand_ins = [name for name in case.stand_in_packages if name not in sys.modules]
    sys.modules.update({name: types.ModuleType(name) for name in stand_ins})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            exec(case.call, namespace)
        except gradckpt.GradckptError as raised:
            error, message = type(raised).__name__, str(raised)
        finally:
            for name in stand_ins:
                del sys.modules[name]
            forget_warnings()
    ours = [w for w in caught if issubclass(w.category, gradckpt.GradckptWarning)]
    if case.outcome == "warning":
        if error or not ours:
            raise SystemExit(f"case {case.name}: expected a warning, got {error or 'none'}")
        gradckpt.disable(model)
        return Result(case, "GradckptWarning", str(ours[0].message), [])
    if case.outcome == "replaced":
        if error:
            raise SystemExit(f"case {case.name}: {error}: {message}")
        # Nothing of the first plan left: once the second is removed, the model is as it was
        # before either.
        plan = gradckpt.get_plan(model)
        gradckpt.disable(model)
        replaced = (f"no error: the plan is replaced (the new one: {plan.strategy}, budget "
                    f"{plan.budget_bytes:,} B)")
        return Result(case, "", replaced, what_changed(original, model_state(model)))
    if not error:
        raise SystemExit(f"case {case.name}: {case.call} raised no gradckpt error")
    return Result(case, error, message, what_changed(before, model_state(model)))


def run_catalogue() -> list[Result]:
    """Every case, in order, on one torch thread (tiny models run fastest so), with torch's RNG
    and thread count put back afterwards."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.random.fork_rng(devices=[]):
            return [run_case(case) for case in CASES]
    finally:
        torch.set_num_threads(threads)


# ---- the page ------------------------------------------------------------------------------------


def tests_cell(test_ids: list[str]) -> str:
    return "<br>".join(f"`{test_id}`" for test_id in test_ids) or "none"


def render(results: list[Result], fuzzing: Fuzzing | None) -> str:
    invariants = engine_invariants()
    by_name = {result.case.name: result for result in results}
    kinds = {outcome: [r for r in results if r.case.outcome == outcome]
             for outcome in ("error", "replaced", "warning")}
    checked = [*kinds["error"], *kinds["replaced"]]
    changed = [r.case.name for r in checked if r.changed]
    lines = [
        "# What gradckpt guarantees, and the test behind each guarantee",
        "",
        f"This page is written by `{COMMAND}`, which checks what it says: every test it names "
        "exists (it reads the test files), and every message in the catalogue is the one "
        "gradckpt gave when the script ran that bad input on a tiny model. "
        "`tests/docs/test_docs_guarantees.py` fails when the page differs from what the script "
        "writes now; after a change, run the script again to bring the page up to date.",
        "",
        "## In numbers",
        "",
        f"- {len(invariants)} engine invariants, each held by the tests named under it;",
        f"- {len(results)} bad inputs run: {len(kinds['error'])} refused with a gradckpt error, "
        f"{len(kinds['replaced'])} replacing the plan, {len(kinds['warning'])} warned about; "
        + (f"after each of the {len(checked)} refused or replaced the model was as it was "
           "(values, trainable parameters, modes, hooks, forwards, plan);" if not changed else
           f"after {len(checked) - len(changed)} of the {len(checked)} refused or replaced the "
           f"model was as it was, after {', '.join(changed)} it was not (marked below);"),
        ("- fuzzing: not yet in the suite;" if fuzzing is None else
         f"- fuzzing: {fuzzing.property_tests} property tests (`tests/test_apply_fuzz.py`: "
         "random models under random plans, and random failures in their steps), "
         f"{fuzzing.examples_per_test} examples each in CI, "
         f"{fuzzing.property_tests * fuzzing.examples_per_test} in all."),
        # The suite's size is printed by the script, not written here: a page naming it would
        # be stale after every test added anywhere.
        "",
        "## The engine's invariants",
        "",
        "As [engine.md](engine.md#guarantees) states them, where each is explained in full.",
        "",
    ]
    for invariant in invariants:
        lines.append(f"{invariant.number}. **{invariant.title}** {invariant.statement} Held by: "
                     + ", ".join(f"`{t}`" for t in INVARIANT_TESTS[invariant.number]) + ".")
    lines += [
        "",
        "## What is supported",
        "",
        "| area | what | held by |",
        "|---|---|---|",
        *(f"| {s.area} | {s.what} | {tests_cell(s.tests)} |" for s in SUPPORTED),
        "",
        "## What is not supported, and what you get",
        "",
        "| area | what | what you get | held by |",
        "|---|---|---|---|",
    ]
    for s in NOT_SUPPORTED:
        got = "<br>".join(f"`{by_name[name].error}`: {one_line(by_name[name].message)}"
                          for name in s.cases) or "no error or warning"
        lines.append(f"| {s.area} | {s.what} | {got} | {tests_cell(s.tests)} |")
    lines += [
        "",
        "## Bad input: what gradckpt says, and what it leaves",
        "",
        "Each call ran on a fresh tiny model: TinyGPT (`gradckpt.toy_models`, 2 blocks) with "
        "`sample` a batch of tokens and targets, a Transformers Llama built from a config "
        "(2 layers) with `sample` its `input_ids` and `labels`, or an `nn.Linear(8, 8)` with "
        "`sample` a batch of 4. The error and the message are as raised; \"model after\" is "
        "what the script compared before and after the call. More inputs and their messages, "
        "abridged: [errors.md](errors.md).",
        "",
        "| bad input | model | call | error | message | model after | held by |",
        "|---|---|---|---|---|---|---|",
    ]
    for result in results:
        case = result.case
        if case.outcome == "warning":
            after = "the call went on (a warning)"
        elif result.changed:
            after = "CHANGED: " + ", ".join(result.changed)
        elif case.outcome == "replaced":
            after = ("the second plan in place of the first; after `gradckpt.disable(model)` "
                     "as it was before either")
        else:
            after = "as it was"
        given = case.given or (f"after `{one_line(case.setup)}`" if case.setup else "")
        given = f" ({given})" if given else ""
        lines.append(
            f"| {case.what} | {MODELS[case.model][0]} | `{one_line(case.call)}`{given} | "
            f"{f'`{result.error}`' if result.error else '-'} | {one_line(result.message)} | "
            f"{after} | {tests_cell(case.tests)} |")
    return "\n".join(lines) + "\n"


def named_tests() -> list[str]:
    return [*(t for tests in INVARIANT_TESTS.values() for t in tests),
            *(t for s in [*SUPPORTED, *NOT_SUPPORTED] for t in s.tests),
            *(t for case in CASES for t in case.tests)]


@dataclass
class Page:
    text: str
    results: list[Result]
    counts: dict[str, int]
    fuzzing: Fuzzing | None


def build_page() -> Page:
    """The page as the script writes it now; a ``SystemExit`` naming each test the page
    names that does not exist."""
    missing = missing_tests(named_tests())
    if missing:
        raise SystemExit("tests named on the page that do not exist:\n  " + "\n  ".join(missing))
    results = run_catalogue()
    counts = count_test_functions()
    fuzzing = fuzzing_in_ci()
    return Page(render(results, fuzzing), results, counts, fuzzing)


def staleness(page: Page) -> str:
    """A unified diff from the page on disk to ``page``; "" when they are the same."""
    on_disk = PAGE.read_text() if PAGE.exists() else ""
    return "".join(difflib.unified_diff(
        on_disk.splitlines(keepends=True), page.text.splitlines(keepends=True),
        fromfile="docs/guarantees.md (on disk)", tofile=f"docs/guarantees.md ({COMMAND})"))


def print_counts(page: Page) -> None:
    checked = [r for r in page.results if r.case.outcome != "warning"]
    changed = [r for r in checked if r.changed]
    print(f"catalogue: {len(page.results)} inputs run ({len(checked)} refused or replacing the "
          f"plan, {len(page.results) - len(checked)} warnings); the model as it was after "
          f"{len(checked) - len(changed)} of {len(checked)}")
    for result in changed:
        print(f"  changed after {result.case.name}: {', '.join(result.changed)}")
    print(f"invariants: {len(INVARIANT_TESTS)}; tests named on the page: "
          f"{len(set(named_tests()))}, all found")
    fuzzing = page.fuzzing
    print("fuzzing: not yet in the suite" if fuzzing is None else
          f"fuzzing: {fuzzing.property_tests} property tests x {fuzzing.examples_per_test} "
          f"examples in CI = {fuzzing.property_tests * fuzzing.examples_per_test} "
          "(tests/test_apply_fuzz.py)")
    print(f"test functions: {sum(page.counts.values())} ("
          + ", ".join(f"{area} {count}" for area, count in page.counts.items()) + ")")
    print("verdict: " + ("every bad input refused or replaced with the model as it was"
                         if not changed else
                         f"{len(changed)} bad inputs left the model changed"))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true",
                        help="write nothing; exit 1 with a diff if docs/guarantees.md is stale")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    print(f"bench/guarantees.py: the guarantees page{' (check)' if args.check else ''}")
    print(f"torch {torch.__version__}; the catalogue's tiny models on 1 CPU thread")
    print()
    page = build_page()
    print_counts(page)
    diff = staleness(page)
    seconds = time.perf_counter() - started
    if args.check:
        if diff:
            print(f"\ndocs/guarantees.md is stale ({seconds:.1f} s); run `{COMMAND}` to "
                  f"write it:\n{diff}")
            return 1
        print(f"\ndocs/guarantees.md is up to date ({seconds:.1f} s)")
        return 0
    PAGE.write_text(page.text)
    print(f"\nwrote docs/guarantees.md ({'changed' if diff else 'unchanged'}; {seconds:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
