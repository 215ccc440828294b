"""``gradckpt.integrations.fit.fit``: the cheapest configurations of a step that fit a budget
(issue 26, item 3) — the order of change, the levers with values against brute force, an
impossible budget, the model left alone, and a suggested option run for real within its
budget + 3%."""

from __future__ import annotations

import pytest
import torch

import gradckpt
from gradckpt.budget import format_bytes
from gradckpt.errors import BudgetError, UsageError
from gradckpt.integrations.fit import (
    LEVERS,
    _change,
    _meta_copy,
    _subsets_by_change,
    check_levers,
    fit,
)
from gradckpt.side_by_side import measure_users_step
from gradckpt.toy_models import mlp_chain

pytestmark = pytest.mark.usefixtures("one_thread")

MiB = 2**20
ALLOWANCE = 0.03  # a measured peak may exceed its budget by this share (issue 26)


def least_peak(profile: gradckpt.Profile) -> int:
    """The least peak any plan of ``profile`` reaches."""
    with pytest.raises(BudgetError) as error:
        gradckpt.solve(profile, 1)
    return error.value.minimum_bytes


# --- what "cheapest" means ------------------------------------------------------------------


def test_change_orders_by_the_largest_rank_then_how_many_levers_of_it():
    names = [("fsdp",), ("lora",), ("bf16",), ("autocast", "micro-batch"), ("autocast",),
             ("recompute", "chunked-head", "drop-output"), ("lora", "autocast"),
             ("recompute", "chunked-head"), ("autocast", "drop-output")]
    ordered = sorted(names, key=_change)
    assert ordered == [("recompute", "chunked-head"), ("recompute", "chunked-head", "drop-output"),
                       ("autocast",), ("autocast", "drop-output"), ("autocast", "micro-batch"),
                       ("bf16",), ("lora",), ("lora", "autocast"), ("fsdp",)]
    assert _change(("recompute", "chunked-head")) == ()  # the plan is no change
    assert [lever.rank for lever in LEVERS] == sorted(lever.rank for lever in LEVERS)


def test_one_precision_and_one_kind_of_adapters_at_a_time():
    subsets = _subsets_by_change([lever.name for lever in LEVERS])
    assert not any({"autocast", "bf16"} <= set(s) or {"lora", "4bit"} <= set(s) for s in subsets)
    assert [_change(s) for s in subsets] == sorted(_change(s) for s in subsets)


@pytest.mark.parametrize(
    ("levers", "message"),
    [(["recompte"], "unknown lever 'recompte'; did you mean 'recompute'?"),
     ("lora,qlora", "unknown lever 'qlora'"),
     ([], "no lever named; levers: recompute, chunked-head, drop-output")],
)
def test_unknown_levers_are_a_usage_error_naming_the_levers(levers, message):
    with pytest.raises(UsageError, match=message):
        check_levers(levers)
    with pytest.raises(UsageError, match=message):
        fit(mlp_chain(2, 8), torch.randn(4, 8), "1MiB", device="h100", levers=levers)


@pytest.mark.parametrize(
    ("keywords", "message"),
    [({"count": 0}, "count must be a positive int"),
     ({"max_world_size": 1.5}, "max_world_size must be a positive int"),
     ({"lora_rank": True}, "lora_rank must be a positive int"),
     ({"output_head": "whole"}, "unknown output_head 'whole'")],
)
def test_bad_arguments_are_told_before_estimating(keywords, message):
    with pytest.raises(UsageError, match=message):
        fit(mlp_chain(2, 8), torch.randn(4, 8), "1MiB", device="h100", **keywords)


def test_the_meta_copy_keeps_shapes_ties_and_what_trains_without_touching_the_model():
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4), torch.nn.Linear(4, 10))
    model[1].weight = model[0].weight  # tied, as language models tie their head
    model[0].weight.requires_grad_(False)
    copy = _meta_copy(model)
    assert copy[1].weight is copy[0].weight and copy[0].weight.device.type == "meta"
    assert [p.requires_grad for p in copy.parameters()] == [False, True]
    assert model[0].weight.device.type == "cpu"


# --- the search on steps estimated ------------------------------------------------------------


def test_a_step_that_fits_as_it_is_is_the_one_option_after_one_estimate():
    search = fit(mlp_chain(4, 64), torch.randn(8, 64), device="h100")  # budget "auto": 78 GiB
    assert [option.levers for option in search.options] == [()]
    assert search.estimated == 1 and search.options[0].relative_time == 1.0


def test_the_micro_batch_is_the_largest_that_fits_for_the_same_effective_batch():
    model, sample = mlp_chain(8, 128), torch.randn(32, 64, 128)
    budget = 4 * MiB
    search = fit(model, sample, budget, device="h100", levers=["recompute", "micro-batch"])
    (option,) = search.options
    assert "micro-batch" in option.levers
    config = option.configuration
    assert config.effective_batch == 32 and config.batch * config.accumulation_steps == 32
    # Brute force: every micro-batch estimated; the largest whose least peak fits.
    fitting = [size for size in (16, 8, 4, 2, 1)
               if least_peak(gradckpt.estimate(model, sample[:size], device="h100",
                                               accumulation_steps=32 // size)) <= budget]
    assert config.batch == max(fitting) == 8
    assert option.predicted_peak_bytes <= budget and search.as_is_least_peak_bytes > budget


def test_fsdp_takes_the_fewest_gpus_that_fit():
    model, sample = mlp_chain(8, 256), torch.randn(8, 16, 256)
    budget = 3 * MiB
    search = fit(model, sample, budget, device="h100", optimizer="adamw",
                 levers=["recompute", "fsdp"])
    (option,) = search.options
    assert option.levers[-1] == "fsdp" and option.configuration.effective_batch == 8
    fitting = [ranks for ranks in (2, 4, 8)
               if least_peak(gradckpt.estimate(model, sample[:8 // ranks], device="h100",
                                               optimizer="adamw", world_size=ranks)) <= budget]
    assert option.configuration.world_size == min(fitting) == 4
    assert option.description.startswith("FSDP2 over 4 GPUs")


def test_under_ddp_every_option_counts_the_buckets_and_fsdp_replaces_ddp():
    """``ddp=True``: each configuration is estimated with DDP's buckets, and the ``fsdp`` lever
    is FSDP2 instead of DDP over N GPUs, each keeping its batch (DDP's is one rank's)."""
    model, sample = mlp_chain(8, 256), torch.randn(8, 16, 256)
    budget = 5 * MiB
    search = fit(model, sample, budget, device="h100", optimizer="adamw", ddp=True,
                 levers=["recompute", "fsdp"])
    as_is = gradckpt.estimate(model, sample, device="h100", optimizer="adamw", ddp=True)
    buckets = as_is.notes["ddp_bucket_bytes"]
    assert buckets == sum(p.numel() * 4 for p in model.parameters())
    assert search.as_is_least_peak_bytes == least_peak(as_is) > budget
    assert least_peak(gradckpt.estimate(model, sample, device="h100", optimizer="adamw")) \
        <= least_peak(as_is) - buckets  # without DDP, the buckets' copy goes
    (option,) = search.options
    config = option.configuration
    assert option.levers[-1] == "fsdp" and not config.ddp and config.batch == 8
    fitting = [ranks for ranks in (2, 4, 8)
               if least_peak(gradckpt.estimate(model, sample, device="h100",
                                               optimizer="adamw", world_size=ranks)) <= budget]
    assert config.world_size == min(fitting)
    assert option.description.startswith(f"FSDP2 over {config.world_size} GPUs instead of DDP;")
    assert "effective batch" not in option.description  # each GPU keeps its batch


def test_lora_under_ddp_buckets_only_the_adapters_gradients():
    pytest.importorskip("peft")
    model, sample = mlp_chain(8, 256), torch.randn(8, 16, 256)
    search = fit(model, sample, 4 * MiB, device="h100", optimizer="adamw", ddp=True,
                 levers=["recompute", "lora"], lora_rank=4)
    (option,) = search.options
    assert "lora" in option.levers and option.configuration.ddp
    trained = 8 * 2 * 4 * 256 * 4  # per layer A (4 x 256) and B (256 x 4), fp32
    assert option.profile.notes["ddp_bucket_bytes"] == trained
    assert option.predicted_peak_bytes <= 4 * MiB


def test_a_budget_nothing_reaches_says_the_least_peak_with_every_lever():
    model, sample = mlp_chain(8, 128), torch.randn(32, 64, 128)
    with pytest.raises(BudgetError) as raised:
        fit(model, sample, "1MiB", device="h100", levers=["recompute", "micro-batch"])
    least = least_peak(gradckpt.estimate(model, sample[:1], device="h100",
                                         accumulation_steps=32))
    assert raised.value.minimum_bytes == least
    message, least_text = str(raised.value), format_bytes(least)
    assert message.startswith("nothing fits the budget of 1.00 MiB: with every lever "
                              f"(recompute, micro-batch) the least predicted peak is {least_text}")
    assert f"a budget (a GPU) of at least {least_text} would fit it" in message


def test_lora_is_tried_on_a_copy_and_the_model_is_left_as_it_was():
    pytest.importorskip("peft")
    model, sample = mlp_chain(8, 256), torch.randn(8, 16, 256)
    before = {name: p.clone() for name, p in model.named_parameters()}
    search = fit(model, sample, 4 * MiB, device="h100", optimizer="adamw",
                 levers=["recompute", "lora"], lora_rank=4)
    (option,) = search.options
    assert "lora" in option.levers and option.configuration.adapters.rank == 4
    assert option.description.startswith("LoRA r=4 on all-linear")
    assert {name for name, _ in model.named_parameters()} == set(before)
    assert all(torch.equal(p, before[name]) and p.requires_grad
               for name, p in model.named_parameters())


@pytest.mark.parametrize(("base", "layer"), [("4-bit", "Linear4bit"), ("8-bit", "Linear8bitLt")])
def test_the_step_as_it_is_may_train_adapters_on_a_quantised_base(base, layer):
    """``adapters=`` with a quantised base: ``fit`` builds it on its meta copy as Transformers
    loads it (``lora_adapters``), estimates it, and leaves the model as it was."""
    pytest.importorskip("peft")
    pytest.importorskip("bitsandbytes")
    from gradckpt.integrations.fit import Adapters, lora_adapters

    with torch.device("meta"):
        wrapped = lora_adapters(mlp_chain(4, 64), Adapters(2, None, base), torch.bfloat16)
    assert {type(m).__name__ for m in wrapped.modules()} >= {layer, "Linear"}
    assert all(not p.requires_grad for n, p in wrapped.named_parameters() if "lora_" not in n)
    model, sample = mlp_chain(4, 64), torch.randn(4, 8, 64)
    before = {name: p.clone() for name, p in model.named_parameters()}
    search = fit(model, sample, "auto", device="h100", optimizer="adamw", dtype=torch.bfloat16,
                 adapters=Adapters(2, None, base), levers=["recompute"], count=1)
    (option,) = search.options  # fits an H100 as it is
    assert option.levers == () and option.configuration.adapters.base == base
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())


# --- an option, run for real ------------------------------------------------------------------


def test_a_suggested_option_runs_within_its_budget():
    """The cheapest option for an fp32 AdamW step a 13 MiB budget cannot hold: bf16 with a
    plan. Run for real on this CPU (the model cast, the plan applied, the loop's second step
    measured) its peak is within the budget + 3%, and within 3% of the prediction."""
    model, sample = mlp_chain(16, 256), torch.randn(8, 64, 256)
    budget = 13 * MiB
    search = fit(model, sample, budget, device="this", optimizer="adamw",
                 levers=["recompute", "drop-output", "bf16"])
    best = search.options[0]
    assert "bf16" in best.levers and search.as_is_least_peak_bytes > budget, best.description
    config = best.configuration
    model, sample = model.to(config.dtype), sample.to(config.dtype)
    optimizer = torch.optim.AdamW(model.parameters())
    measured = measure_users_step(model, sample, best.plan, optimizer=optimizer,
                                  keep_output=config.keep_output).peak_bytes
    report = f"budget {budget}, predicted {best.predicted_peak_bytes}, measured {measured}"
    assert measured <= budget * (1 + ALLOWANCE), report
    assert abs(measured - best.predicted_peak_bytes) <= ALLOWANCE * measured, report


def test_a_language_model_fits_with_its_head_in_chunks_for_real():
    """A two-layer Llama with AdamW whose plain head no plan fits in 4.2 MB: the option is a
    plan computing the loss in chunks; run for real, within the budget + 3%."""
    pytest.importorskip("transformers")
    from gradckpt.integrations.hf_families import causal_batch, hf_model

    torch.manual_seed(0)
    model, batch = hf_model("llama", num_hidden_layers=2), causal_batch(2, 64)
    budget = 4_200_000
    search = fit(model, batch, budget, device="this", optimizer="adamw",
                 levers=["recompute", "chunked-head", "drop-output"])
    (best,) = search.options
    assert "chunked-head" in best.levers and best.plan.head_chunks > 1, best.description
    assert set(best.levers) <= {"recompute", "chunked-head"}  # the step as it is, planned
    optimizer = torch.optim.AdamW(model.parameters())
    measured = measure_users_step(model, batch, best.plan, optimizer=optimizer).peak_bytes
    report = f"budget {budget}, predicted {best.predicted_peak_bytes}, measured {measured}"
    assert measured <= budget * (1 + ALLOWANCE), report
    assert abs(measured - best.predicted_peak_bytes) <= ALLOWANCE * measured, report
