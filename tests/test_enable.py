"""End to end: ``gradckpt.enable`` picks a plan for a budget, and the step then measured fits it
with gradients equal to the plain model's (the promise: "told before it runs, and right").
``enable`` is ``plan_and_apply``, the one profile → solve → apply path the Trainer callback
takes too, with a warning when no optimizer is given; a bad request is refused before anything
runs."""

from __future__ import annotations

import importlib
import warnings

import pytest
import torch
from engine_models import assert_trains_as_plain
from hf_models import tiny_clip, tiny_llama
from torch import nn

import gradckpt
from gradckpt import BudgetError, UsageError
from gradckpt.cost import simulate
from gradckpt.enable import check_request, plan_and_apply
from gradckpt.errors import forget_warnings
from gradckpt.measure import loss_of, measure_peak_bytes
from gradckpt.measure.memory_parts import DDP_BUCKETS, memory_parts
from gradckpt.plan import Segment
from gradckpt.solvers.optimal import minimum_peak_bytes
from gradckpt.toy_models import GPTConfig, TinyGPT

CONFIG = GPTConfig(n_layer=6, n_embd=64, n_head=4, block_size=64, dropout=0.1)
ALLOWANCE = 1.03  # allocator noise the planning issue allows on a measured peak

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread


def tiny_gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(CONFIG)


def gpt_sample() -> dict:
    generator = torch.Generator().manual_seed(1)
    idx = torch.randint(0, CONFIG.vocab_size, (4, 64), generator=generator)
    return {"idx": idx, "targets": idx}


def step(model: nn.Module, sample: dict) -> tuple[int, torch.Tensor, list[torch.Tensor]]:
    """Peak of one step (MemTracker), its loss and gradients, dropout seeded alike."""
    model.zero_grad(set_to_none=True)
    result = {}

    def run() -> None:
        torch.manual_seed(3)
        # The step as users write it: the output (HF: with its logits) alive through backward.
        output = model(**sample)
        result["loss"] = loss = loss_of(output)  # TinyGPT's loss, or HF's output.loss
        loss.backward()

    peak = measure_peak_bytes(run, model, *sample.values())
    return peak, result["loss"].detach(), [p.grad for p in model.parameters()]


def smallest_feasible_budget(model: nn.Module, sample: dict) -> int:
    with pytest.raises(BudgetError) as error:
        gradckpt.solve(gradckpt.profile(model, sample, repeats=1), 1)
    return error.value.minimum_bytes


def plain_step_and_least_budget(model: nn.Module, sample: dict
                                ) -> tuple[int, torch.Tensor, list[torch.Tensor], int]:
    """The plain model's peak, loss and gradients, and the smallest feasible budget: the same
    for every budget a test tries, so measured once per model (a module-scoped fixture)."""
    return (*step(model, sample), smallest_feasible_budget(model, sample))


@pytest.fixture(scope="module")
def plain_gpt_step() -> tuple[int, torch.Tensor, list[torch.Tensor], int]:
    return plain_step_and_least_budget(tiny_gpt(), gpt_sample())


@pytest.mark.slow
@pytest.mark.parametrize("position", [0.0, 0.3, 0.6, 0.9])
def test_gpt_fits_the_budget_with_identical_gradients(
    plain_gpt_step: tuple, position: float
) -> None:
    """Budgets from the smallest feasible one (position 0) towards the unconstrained peak."""
    plain_peak, plain_loss, plain_grads, minimum = plain_gpt_step
    sample = gpt_sample()
    model = tiny_gpt()
    budget = int(minimum + position * (plain_peak - minimum))
    plan = gradckpt.enable(model, sample, budget=budget)
    assert plan.predicted_peak_bytes <= budget
    peak, loss, grads = step(model, sample)
    assert peak <= budget * ALLOWANCE, (peak, budget, str(plan.segments))
    # and told right: the prediction is the measured peak (within a few hundred bytes here)
    assert abs(plan.predicted_peak_bytes - peak) <= 0.005 * peak, (peak, str(plan.segments))
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))
    gradckpt.disable(model)


def test_a_budget_that_fits_changes_nothing() -> None:
    model = tiny_gpt()
    plan = gradckpt.enable(model, gpt_sample(), budget="auto")  # CPU: most of free memory
    assert plan.segments == [] and plan.predicted_overhead == 0.0
    assert all(not b._forward_pre_hooks for b in model.transformer.h)


def test_an_impossible_budget_names_the_smallest_feasible_one() -> None:
    model, sample = tiny_gpt(), gpt_sample()
    with pytest.raises(BudgetError) as error:
        gradckpt.enable(model, sample, budget=1024)
    minimum = error.value.minimum_bytes
    assert minimum > 1024 and "raise the budget" in str(error.value)
    plan = gradckpt.enable(model, sample, budget=minimum)  # exactly that much works
    assert plan.predicted_peak_bytes <= minimum
    gradckpt.disable(model)


def llama_sample() -> dict:
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 256, (4, 64), generator=generator)
    return {"input_ids": input_ids, "labels": input_ids}


@pytest.fixture(scope="module")
def plain_llama_step() -> tuple[int, torch.Tensor, list[torch.Tensor], int]:
    pytest.importorskip("transformers")
    return plain_step_and_least_budget(tiny_llama(layers=6, vocab_size=256), llama_sample())


@pytest.mark.slow
@pytest.mark.parametrize("position", [0.0, 0.3, 0.6, 0.9])
def test_llama_from_a_config_fits_the_budget_with_identical_gradients(
    plain_llama_step: tuple, position: float
) -> None:
    """Budgets from the smallest feasible one (position 0) towards the unconstrained peak."""
    plain_peak, plain_loss, plain_grads, minimum = plain_llama_step
    model = tiny_llama(layers=6, vocab_size=256)
    # config.use_cache is true: the layers get a DynamicCache in training unless gradckpt turns
    # it off in training steps (recomputed layers would append to it again); the step below
    # recomputes and matches the plain one, which it could not do with a cache.
    assert model.config.use_cache
    budget = int(minimum + position * (plain_peak - minimum))
    plan = gradckpt.enable(model, llama_sample(), budget=budget)
    assert (plan.segments or plan.head_chunks > 1) and model.config.use_cache  # off in steps only
    assert plan.predicted_peak_bytes <= budget
    peak, loss, grads = step(model, llama_sample())
    assert peak <= budget * ALLOWANCE, (peak, budget, str(plan.segments))
    assert abs(plan.predicted_peak_bytes - peak) <= 0.01 * peak, (plan.predicted_peak_bytes, peak)
    # Bit for bit; within float rounding where the plan computes the loss in chunks.
    assert_trains_as_plain(plan, [loss, *grads], [plain_loss, *plain_grads])
    gradckpt.disable(model)
    gradckpt.disable(model)
    assert model.config.use_cache


def tiny_transformer() -> nn.Transformer:
    torch.manual_seed(0)
    return nn.Transformer(d_model=32, nhead=2, num_encoder_layers=2, num_decoder_layers=3,
                          dim_feedforward=64, batch_first=True)


def mean_square(output: torch.Tensor) -> torch.Tensor:
    return output.square().mean()


def test_encoder_decoder_plans_stop_at_the_decoder_and_train_identically() -> None:
    """Encoder then decoder layers form one chain with a break: the decoder's first layer takes
    the target, not the encoder's output. No plan may recompute across it (the segment would
    fail at its first step); every strategy plans around it and trains exactly as before."""
    generator = torch.Generator().manual_seed(1)
    sample = (torch.randn(4, 24, 32, generator=generator),
              torch.randn(4, 16, 32, generator=generator))

    def run(model: nn.Module) -> tuple[int, torch.Tensor, list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        result = {}

        def one_step() -> None:
            torch.manual_seed(3)  # the same dropout masks
            result["loss"] = loss = mean_square(model(*sample))
            loss.backward()

        peak = measure_peak_bytes(one_step, model, *sample)
        return peak, result["loss"].detach(), [p.grad.clone() for p in model.parameters()]

    _, plain_loss, plain_grads = run(tiny_transformer())
    model = tiny_transformer()
    measured = gradckpt.profile(model, sample, loss_fn=mean_square, repeats=1)
    assert measured.chain_breaks == [2]
    lowest = minimum_peak_bytes(measured)
    middle = (lowest + measured.peak_bytes) // 2
    cases = [("sqrt", None), ("chen-greedy", middle), ("optimal", lowest), ("optimal", middle)]
    for strategy, budget in cases:
        plan = gradckpt.solve(measured, budget, strategy)
        assert all(s.end < 2 or s.start >= 2 for s in plan.segments), plan.segments
        gradckpt.apply(model, plan)
        peak, loss, grads = run(model)
        gradckpt.disable(model)
        assert torch.equal(loss, plain_loss), strategy
        assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True)), strategy
        if budget is not None:
            assert peak <= budget * ALLOWANCE, (strategy, peak, budget, plan.segments)


def test_two_towers_are_profiled_in_the_order_they_run() -> None:
    """CLIP creates its text tower first and runs its vision tower first: find_blocks returns
    them in creation order, profile in run order, with a break between the towers; a plan then
    trains exactly as the plain model does."""
    pytest.importorskip("transformers")
    generator = torch.Generator().manual_seed(1)
    sample = {
        "input_ids": torch.randint(3, 64, (4, 8), generator=generator),
        "pixel_values": torch.randn(4, 3, 16, 16, generator=generator),
        "return_loss": True,
    }
    model = tiny_clip().train()
    measured = gradckpt.profile(model, sample, repeats=1)
    names = [block.name for block in measured.blocks]
    assert names == [f"vision_model.encoder.layers.{i}" for i in range(2)] + [
        f"text_model.encoder.layers.{i}" for i in range(2)]
    assert measured.chain_breaks == [2]

    def clip_step(m: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
        m.zero_grad(set_to_none=True)
        loss = m(**sample).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in m.parameters()]

    plain_loss, plain_grads = clip_step(tiny_clip().train())
    plan = gradckpt.solve(measured, None, "sqrt")
    assert [(s.start, s.end) for s in plan.segments] == [(0, 1), (2, 3)]  # one per tower
    gradckpt.apply(model, plan)
    loss, grads = clip_step(model)
    gradckpt.disable(model)
    assert torch.equal(loss, plain_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, plain_grads, strict=True))


def test_blocks_given_out_of_run_order_are_refused() -> None:
    pytest.importorskip("transformers")
    model = tiny_clip()
    sample = {"input_ids": torch.randint(3, 64, (2, 8)),
              "pixel_values": torch.randn(2, 3, 16, 16), "return_loss": True}
    created_order = [name for name, _ in gradckpt.find_blocks(model)]
    with pytest.raises(gradckpt.UsageError, match="in the order they run.*vision_model"):
        gradckpt.profile(model, sample, blocks=created_order, repeats=1)


@pytest.mark.parametrize("k", [2, 3])
def test_optimal_never_loses_to_every_kth_layer_at_its_own_peak(k: int) -> None:
    """Users measure Transformers' every-n-layers layouts and ask for a plan within that peak.
    On a 4-layer TinyGPT, every 2nd layer peaks as low as every layer; at exactly that budget
    the rounded tables hid it, and optimal answered every layer (twice the recomputation)."""
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(n_layer=4, n_embd=64, n_head=2, block_size=32))
    idx = torch.randint(0, 512, (2, 32), generator=torch.Generator().manual_seed(1))
    measured = gradckpt.profile(model, {"idx": idx, "targets": idx}, repeats=1)
    layout = [Segment(i, i) for i in range(0, 4, k)]
    peak, seconds = simulate(measured, layout)
    # Exact (time_noise=0): on the wall's clock solve otherwise takes, of plans within the
    # timing noise of the fastest, the least peak, which may be up to the band slower.
    plan = gradckpt.solve(measured, measured.fixed_bytes + peak, "optimal", time_noise=0)
    assert plan.predicted_extra_seconds <= seconds + 1e-12, plan.segments


def small_gpt() -> tuple[TinyGPT, dict]:
    torch.manual_seed(0)
    model = TinyGPT(GPTConfig(n_layer=3, n_embd=32, n_head=2, block_size=16))
    idx = torch.randint(0, 512, (2, 16), generator=torch.Generator().manual_seed(1))
    return model, {"idx": idx, "targets": idx}


def test_enable_takes_plan_and_apply_which_gives_the_plan_and_its_profile(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """enable's work is plan_and_apply's: what it is called with, the plan it returns."""
    enable_module = importlib.import_module("gradckpt.enable")
    calls = []

    def recording(*args, **kwargs):
        calls.append((args, kwargs))
        return plan_and_apply(*args, **kwargs)

    monkeypatch.setattr(enable_module, "plan_and_apply", recording)
    model, sample = small_gpt()
    plan = gradckpt.enable(model, sample, None, "sqrt", optimizer="sgd", accumulation_steps=2,
                           keep_output=False)
    assert calls == [((model, sample, None, "sqrt", None, None),
                      {"optimizer": "sgd", "accumulation_steps": 2, "ddp": False,
                       "keep_output": False, "output_head": "auto"})]
    assert gradckpt.get_plan(model) is plan and plan.segments
    gradckpt.disable(model)

    progress = []
    again, measured = plan_and_apply(model, sample, None, "sqrt", optimizer="sgd",
                                     accumulation_steps=2, keep_output=False,
                                     progress=lambda done, total: progress.append((done, total)))
    assert gradckpt.get_plan(model) is again and again.segments == plan.segments
    assert isinstance(measured, gradckpt.Profile) and measured.accumulated_gradient_bytes > 0
    assert measured.notes["keep_output"] is False
    total = progress[-1][1]
    assert progress == [(done, total) for done in range(1, total + 1)]
    gradckpt.disable(model)


def test_only_enable_warns_without_an_optimizer() -> None:
    """The warning is enable's, pointing at the user's call; plan_and_apply's callers (the
    Trainer callback) pass the optimizer their loop steps, ``None`` for none."""
    model, sample = small_gpt()
    forget_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan_and_apply(model, sample, None, "sqrt", optimizer=None)
        gradckpt.enable(model, sample, None, "sqrt")
    forget_warnings()
    gradckpt.disable(model)
    ours = [w for w in caught if issubclass(w.category, gradckpt.GradckptWarning)]
    assert len(ours) == 1 and "gradckpt.enable() got no optimizer=" in str(ours[0].message)
    assert ours[0].filename == __file__


@pytest.mark.parametrize(
    ("budget", "strategy", "message"),
    [
        ("6 gigs", "optimal", r"budget '6 gigs' not understood"),
        ("60%", "fastest", r"unknown strategy 'fastest'; valid strategies: none, every-layer"),
        ("60%", "optimial", r"unknown strategy 'optimial'; .*optimal; did you mean 'optimal'\?$"),
        (None, "optimal", r"strategy 'optimal' chooses its plan for a budget.*'sqrt'"),
        (None, "chen-greedy", r"strategy 'chen-greedy' chooses its plan for a budget"),
    ],
)
def test_a_bad_request_is_refused_before_anything_runs(
    monkeypatch: pytest.MonkeyPatch, budget: object, strategy: str, message: str
) -> None:
    def must_not_run(*args, **kwargs):
        raise AssertionError("profiled a request that check_request refuses")

    monkeypatch.setattr(importlib.import_module("gradckpt.enable"), "profile", must_not_run)
    model, sample = small_gpt()
    with pytest.raises(UsageError, match=message):
        check_request(budget, strategy)
    with pytest.raises(UsageError, match=message):
        gradckpt.enable(model, sample, budget, strategy, optimizer="none")
    with pytest.raises(UsageError, match=message):
        plan_and_apply(model, sample, budget, strategy, optimizer="none")
    assert gradckpt.get_plan(model) is None


@pytest.mark.parametrize("ddp", ["yes", 1, None])
def test_ddp_that_is_not_a_bool_is_refused_before_anything_runs(
    monkeypatch: pytest.MonkeyPatch, ddp: object
) -> None:
    def must_not_run(*args, **kwargs):
        raise AssertionError("profiled with a ddp= that is not a bool")

    model, sample = small_gpt()
    message = r"ddp must be True \(the model trains wrapped in DistributedDataParallel.*got "
    with pytest.raises(UsageError, match=message):
        gradckpt.profile(model, sample, ddp=ddp)
    with pytest.raises(UsageError, match=message):
        gradckpt.estimate(model, sample, ddp=ddp)
    monkeypatch.setattr(importlib.import_module("gradckpt.enable"), "profile", must_not_run)
    with pytest.raises(UsageError, match=message):
        gradckpt.enable(model, sample, "60%", optimizer="none", ddp=ddp)
    with pytest.raises(UsageError, match=message):
        plan_and_apply(model, sample, "60%", "optimal", optimizer="none", ddp=ddp)
    assert gradckpt.get_plan(model) is None


def test_an_estimate_under_ddp_is_one_ranks_and_refuses_a_world_size() -> None:
    model, sample = small_gpt()
    with pytest.raises(UsageError, match=r"ddp=True with world_size=2: .*DDP shards nothing"):
        gradckpt.estimate(model, sample, ddp=True, world_size=2)


def test_ddp_counts_the_trainable_parameters_all_step() -> None:
    """DDP's buckets are held all step: in fixed_bytes, the peak and the memory parts, each
    trainable parameter once (the meter confirms the size on two ranks:
    tests/integrations/test_integrations_ddp.py)."""
    model, sample = small_gpt()
    model.transformer.wte.weight.requires_grad_(False)  # a frozen part is no bucket's
    buckets = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    plain = gradckpt.profile(model, sample, repeats=1, optimizer="adamw")
    under_ddp = gradckpt.profile(model, sample, repeats=1, optimizer="adamw", ddp=True)
    assert "ddp_bucket_bytes" not in plain.notes
    assert under_ddp.notes["ddp_bucket_bytes"] == buckets
    assert under_ddp.fixed_bytes - plain.fixed_bytes == buckets
    assert under_ddp.peak_bytes - plain.peak_bytes == buckets
    parts = dict(memory_parts(model, under_ddp).parts)
    assert parts[DDP_BUCKETS] == buckets and DDP_BUCKETS not in dict(
        memory_parts(model, plain).parts)
