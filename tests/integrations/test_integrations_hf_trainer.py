"""``GradckptCallback``: a Hugging Face Trainer run with it trains exactly as without it, within
the budget, the optimizer's state and accumulated gradients counted; it plans through
``gradckpt.enable``'s own path and so makes the plan ``enable`` makes for the Trainer's step;
bad input is refused before anything is applied.

Every run is a few real Trainer steps of a tiny Llama (random weights, nothing downloaded) on
CPU; the plain runs the checkpointed ones are compared with are computed once per module.
"""

from __future__ import annotations

import functools
import importlib
import logging
import random
import re
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import hf_models
import numpy as np
import pytest
import torch
import transformers
from torch import nn
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import CausalLMOutput

import gradckpt
from gradckpt import BudgetError, UsageError
from gradckpt.budget import format_bytes, parse_budget
from gradckpt.integrations import hf_trainer
from gradckpt.integrations.hf_trainer import GradckptCallback
from gradckpt.measure import MemoryMeter, profile
from gradckpt.measure.training_state import optimizer_state_bytes
from gradckpt.predict.clock import ModeledClock

SEQUENCE_LENGTH = 32
# Low enough that the plan recomputes something, high enough to be feasible with Adam's state
# and, in the accumulation test, the accumulated gradients counted.
BUDGET = "85%"


def tiny_llama() -> transformers.LlamaForCausalLM:
    """Seeded, attention dropout on: the callback must not change the dropout masks either."""
    return hf_models.tiny_llama(4, vocab_size=256)


def token_dataset(size: int = 16) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (size, SEQUENCE_LENGTH), generator=generator)
    return [{"input_ids": row, "labels": row.clone()} for row in tokens]


def training_args(output_dir: Path, **overrides: Any) -> transformers.TrainingArguments:
    settings: dict[str, Any] = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=2,
        max_steps=3,
        learning_rate=1e-3,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    settings.update(overrides)
    return transformers.TrainingArguments(**settings)


def trainer_for(
    model: nn.Module, output_dir: Path, callbacks: list[Any] = (), dataset: Any = None, **args: Any
) -> transformers.Trainer:
    return transformers.Trainer(
        model=model,
        args=training_args(output_dir, **args),
        train_dataset=token_dataset() if dataset is None else dataset,
        callbacks=list(callbacks),
    )


def losses(trainer: transformers.Trainer) -> list[float]:
    return [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]


def parameters(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def assert_same_parameters(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        torch.testing.assert_close(got[name], expected[name], rtol=0, atol=1e-6, msg=name)


def plan_is_applied(model: nn.Module) -> bool:
    # gradckpt.apply is the function; the module holds the registry of applied plans.
    return model in importlib.import_module("gradckpt.apply")._installed


def lora(model: nn.Module) -> nn.Module:
    import peft

    torch.manual_seed(1)  # LoRA's A matrices: the same in both runs
    config = peft.LoraConfig(
        r=4, target_modules=["q_proj", "v_proj", "gate_proj"], lora_dropout=0.0
    )
    return peft.get_peft_model(model, config)


def count_profile_calls(monkeypatch: pytest.MonkeyPatch) -> list[Any]:
    """The samples ``gradckpt.profile`` is called with by the callback, from now on: on
    ``enable``'s path (``gradckpt.enable.plan_and_apply``), which the callback takes."""
    samples: list[Any] = []

    def counting_profile(model: nn.Module, sample: Any, *args: Any, **kwargs: Any) -> Any:
        samples.append(sample)
        return profile(model, sample, *args, **kwargs)

    monkeypatch.setattr(importlib.import_module("gradckpt.enable"), "profile", counting_profile)
    return samples


@functools.cache
def plain_run(
    tmp_root: Path, accumulation_steps: int = 1, with_lora: bool = False
) -> tuple[list[float], dict[str, torch.Tensor]]:
    """The losses and final parameters of the run without the callback."""
    model = tiny_llama()
    if with_lora:
        model = lora(model)
    trainer = trainer_for(
        model, tmp_root / f"plain-{accumulation_steps}-{with_lora}",
        gradient_accumulation_steps=accumulation_steps,
    )
    trainer.train()
    return losses(trainer), parameters(model)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("hf_trainer")


class RecordAtFirstStep(transformers.TrainerCallback):
    """Whether a plan is applied when the first step begins (after every on_train_begin)."""

    def __init__(self) -> None:
        self.applied_at_first_step: bool | None = None

    def on_step_begin(self, args, state, control, model=None, **kwargs) -> None:
        if self.applied_at_first_step is None:
            self.applied_at_first_step = plan_is_applied(model)


class MeterTheSteps(transformers.TrainerCallback):
    """The memory meter around the training steps only: from the first step's beginning to the
    last step's end, after profiling (whose steps run without checkpointing, above the budget)."""

    def __init__(self) -> None:
        self.meter: MemoryMeter | None = None

    def on_step_begin(self, args, state, control, model=None, **kwargs) -> None:
        if self.meter is None:
            self.meter = MemoryMeter("cpu", model).__enter__()

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if state.global_step >= state.max_steps:
            self.meter.__exit__(None, None, None)


def test_trains_exactly_as_without_the_callback(tmp_root: Path) -> None:
    expected_losses, expected_parameters = plain_run(tmp_root)
    model = tiny_llama()
    callback = GradckptCallback(budget=BUDGET)
    trainer = trainer_for(model, tmp_root / "exact", [callback])
    trainer.train()
    assert callback.plan is not None and callback.plan.segments  # something is recomputed
    assert losses(trainer) == pytest.approx(expected_losses, rel=0, abs=1e-6)
    assert_same_parameters(parameters(model), expected_parameters)


def test_plans_once_before_the_first_step_and_logs_the_plan_once(
    tmp_root: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    profiled = count_profile_calls(monkeypatch)
    model = tiny_llama()
    callback, recorder = GradckptCallback(budget=BUDGET), RecordAtFirstStep()
    trainer = trainer_for(model, tmp_root / "once", [callback, recorder])
    with caplog.at_level(logging.INFO, logger="gradckpt"):
        trainer.train()
        plan, measured = callback.plan, callback.profile
        trainer.train()  # the same callback again: the plan is kept, nothing is profiled
    assert recorder.applied_at_first_step is True
    assert len(profiled) == 1 and callback.plan is plan and callback.profile is measured
    records = [r for r in caplog.records if r.name == "gradckpt"]
    # One line at WARNING, which Python shows by default; the plan's table at INFO.
    assert [r.levelno for r in records] == [logging.WARNING, logging.INFO]
    summary, table = (r.getMessage() for r in records)
    assert "\n" not in summary
    recomputed = len({i for segment in plan.segments for i in segment.blocks()})
    for part in (f"plan optimal recomputes {recomputed} of 4 blocks", "predicted peak",
                 f"budget {format_bytes(plan.budget_bytes)} ('{BUDGET}')",
                 "without checkpointing", "time per step"):
        assert part in summary, summary
    assert table.endswith(str(plan))
    assert plan_is_applied(model)  # left applied when training ends ...
    gradckpt.disable(model)  # ... until disabled
    assert not plan_is_applied(model)


class FixedRoofline:
    """A device for ``ModeledClock``: every time measured is the operations' roofline on it,
    the same in every run, so that two profiles of one step solve to one plan."""

    def seconds(self, flops: float, bytes_moved: float, dtype: torch.dtype) -> float:
        return max(flops / 1e12, bytes_moved / 1e9)


def token_sample() -> dict[str, torch.Tensor]:
    tokens = torch.randint(0, 256, (2, SEQUENCE_LENGTH), generator=torch.Generator().manual_seed(4))
    return {"input_ids": tokens, "labels": tokens.clone()}


@pytest.mark.parametrize("with_lora", [False, True], ids=["llama", "lora"])
def test_the_callback_makes_the_plan_enable_makes_for_the_trainers_step(
    tmp_root: Path, with_lora: bool
) -> None:
    """The same model, batch, optimizer and accumulation: the callback and ``enable`` (told
    that the loop drops the output first, as the Trainer's does) give the same plan and the
    same measured step. Times come from a modeled clock, so that both solve the same numbers
(measured, they differ from run to run and could tip the choice between two plans)."""

    def model() -> nn.Module:
        built = tiny_llama()
        return (lora(built) if with_lora else built).train()

    def adamw(planned: nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW([p for p in planned.parameters() if p.requires_grad])

    by_callback, by_enable = model(), model()
    callback = GradckptCallback(budget=BUDGET, sample=token_sample())
    with ModeledClock(FixedRoofline()):
        measured = gradckpt.profile(by_enable, token_sample(), optimizer=adamw(by_enable),
                                    accumulation_steps=2, keep_output=False, repeats=1)
        callback.on_train_begin(
            training_args(tmp_root / f"as-enable-{with_lora}", gradient_accumulation_steps=2),
            transformers.TrainerState(), transformers.TrainerControl(), model=by_callback,
            optimizer=adamw(by_callback),
        )
        plan = gradckpt.enable(by_enable, token_sample(), BUDGET, optimizer=adamw(by_enable),
                               accumulation_steps=2, keep_output=False)
    got = callback.plan
    assert plan.segments and (got.strategy, got.budget_bytes, got.segments) == (
        plan.strategy, plan.budget_bytes, plan.segments)
    assert got.predicted_peak_bytes == plan.predicted_peak_bytes
    # Modeled seconds are sums of floats, equal to rounding.
    assert got.predicted_overhead == pytest.approx(plan.predicted_overhead, rel=1e-9)
    assert gradckpt.get_plan(by_callback) is callback.plan
    assert gradckpt.get_plan(by_enable) is plan
    for field in ("peak_bytes", "fixed_bytes", "optimizer_state_bytes",
                  "accumulated_gradient_bytes"):
        assert getattr(callback.profile, field) == getattr(measured, field), field
    gradckpt.disable(by_callback)
    gradckpt.disable(by_enable)


def test_budget_holds_with_the_optimizer_state_and_accumulated_gradients(tmp_root: Path) -> None:
    expected_losses, expected_parameters = plain_run(tmp_root, accumulation_steps=2)
    model = tiny_llama()
    callback, metering = GradckptCallback(budget=BUDGET), MeterTheSteps()
    trainer = trainer_for(
        model, tmp_root / "memory", [callback, metering], gradient_accumulation_steps=2
    )
    trainer.train()
    parameter_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    counters = 4 * len(list(model.parameters()))  # AdamW's step counter per parameter tensor
    # AdamW's two moments, and the gradients the first micro-batch leaves for the second.
    assert callback.profile.optimizer_state_bytes == 2 * parameter_bytes + counters
    assert callback.profile.accumulated_gradient_bytes == parameter_bytes
    assert callback.reserved_bytes == 2 * parameter_bytes + counters + parameter_bytes
    plan = callback.plan
    # A percentage is of the whole step the Trainer runs, the optimizer's state included.
    assert plan.budget_bytes == parse_budget(
        BUDGET, unconstrained_peak_bytes=callback.profile.peak_bytes)
    assert plan.segments and plan.predicted_peak_bytes <= plan.budget_bytes
    assert metering.meter.peak() <= plan.budget_bytes * 1.03
    assert losses(trainer) == pytest.approx(expected_losses, rel=0, abs=1e-6)
    assert_same_parameters(parameters(model), expected_parameters)


def test_lora_trains_exactly_as_without_the_callback(tmp_root: Path) -> None:
    expected_losses, expected_parameters = plain_run(tmp_root, with_lora=True)
    model = lora(tiny_llama())
    callback = GradckptCallback(budget=BUDGET)
    trainer = trainer_for(model, tmp_root / "lora", [callback])
    trainer.train()
    assert callback.plan.segments
    assert losses(trainer) == pytest.approx(expected_losses, rel=0, abs=1e-6)
    assert_same_parameters(parameters(model), expected_parameters)


def test_transformers_own_checkpointing_gives_way_to_the_plan(tmp_root: Path) -> None:
    expected_losses, expected_parameters = plain_run(tmp_root)
    model = tiny_llama()
    callback = GradckptCallback(budget=BUDGET)
    trainer = trainer_for(model, tmp_root / "hf-gc", [callback], activation_checkpointing=True)
    trainer.train()
    assert losses(trainer) == pytest.approx(expected_losses, rel=0, abs=1e-6)
    assert_same_parameters(parameters(model), expected_parameters)
    assert plan_is_applied(model) and callback.plan.segments
    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    assert layers and not any(layer.gradient_checkpointing for layer in layers)


class ShortBatches:
    """A collator padding dynamically, to 20 tokens here, with the ``max_length`` and
    ``tokenizer`` attributes of Transformers' padding collators."""

    max_length = 48
    tokenizer = SimpleNamespace(pad_token_id=7)

    def __call__(self, features: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        input_ids = torch.stack([f["input_ids"][:20] for f in features])
        return {
            "input_ids": input_ids,
            "attention_mask": torch.ones_like(input_ids),
            "labels": input_ids.clone(),
        }


def random_states(loader: torch.utils.data.DataLoader) -> list[Any]:
    return [torch.get_rng_state(), random.getstate(), np.random.get_state()[1].tolist(),
            loader.generator.get_state()]


def test_profiles_the_first_batch_padded_without_disturbing_any_random_state(
    tmp_root: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    profiled = count_profile_calls(monkeypatch)
    model = tiny_llama()
    loader = torch.utils.data.DataLoader(
        token_dataset(), batch_size=2, shuffle=True, collate_fn=ShortBatches(),
        generator=torch.Generator().manual_seed(5),
    )
    first_batch = next(iter(loader))  # what the run will see first
    loader.generator.manual_seed(5)
    before = random_states(loader)
    callback = GradckptCallback(budget="100%")
    callback.on_train_begin(
        training_args(tmp_root / "direct"), transformers.TrainerState(),
        transformers.TrainerControl(), model=model, train_dataloader=loader, optimizer=None,
    )
    gradckpt.disable(model)
    assert all(_same(a, b) for a, b in zip(random_states(loader), before, strict=True))
    sample = profiled[0]
    assert sample["input_ids"].shape == (2, 48)
    assert torch.equal(sample["input_ids"][:, :20], first_batch["input_ids"])
    assert (sample["input_ids"][:, 20:] == 7).all() and (sample["labels"][:, 20:] == -100).all()
    assert (sample["attention_mask"][:, 20:] == 0).all()
    assert callback.profile.blocks[0].input_bytes == 2 * 48 * 64 * 4  # the padded length
    # No optimizer yet: the Trainer's default, AdamW, is counted (and its step counters).
    assert callback.profile.notes["optimizer"] == "AdamW"
    counters = 4 * len(list(model.parameters()))
    assert callback.reserved_bytes == optimizer_state_bytes("adamw", model) + counters


def _same(a: Any, b: Any) -> bool:
    return torch.equal(a, b) if isinstance(a, torch.Tensor) else a == b


def test_an_unreadable_budget_or_strategy_is_refused_at_construction() -> None:
    with pytest.raises(UsageError, match=r"GradckptCallback.*'6 gigs'.*'6GiB'.*'60%'"):
        GradckptCallback(budget="6 gigs")
    valid = "none, every-layer, sqrt, chen-greedy, optimal"
    with pytest.raises(UsageError, match=rf"'fastest'.*{valid}"):
        GradckptCallback(budget="60%", strategy="fastest")
    with pytest.raises(UsageError, match=r"budget=None.*'optimal'"):
        GradckptCallback(budget=None)
    GradckptCallback(budget=None, strategy="sqrt")  # a fixed plan needs no budget


@pytest.mark.parametrize("above_optimizer_state", [False, True])
def test_an_infeasible_budget_leaves_the_model_as_it_was(
    tmp_root: Path, above_optimizer_state: bool
) -> None:
    model = tiny_llama()
    inputs = torch.randint(0, 256, (2, SEQUENCE_LENGTH), generator=torch.Generator().manual_seed(2))
    expected = logits(model, inputs)
    # Below AdamW's state alone, or above it by less than any step needs.
    budget_bytes = 1024 + above_optimizer_state * optimizer_state_bytes("adamw", model)
    callback = GradckptCallback(budget=budget_bytes)
    trainer = trainer_for(model, tmp_root / f"infeasible-{above_optimizer_state}", [callback])
    modes, use_cache = [m.training for m in model.modules()], model.config.use_cache
    with pytest.raises(BudgetError, match=r"(?s)raise the budget.*the optimizer's state") as caught:
        trainer.train()
    assert caught.value.minimum_bytes > budget_bytes
    # The message says what to pass to the callback, a budget that fits.
    advised = re.search(r"GradckptCallback\(budget='([^']+)'\)", str(caught.value)).group(1)
    assert parse_budget(advised) >= caught.value.minimum_bytes
    assert callback.plan is None
    assert not plan_is_applied(model)
    assert [m.training for m in model.modules()] == modes
    assert model.config.use_cache is use_cache  # the adapters were undone after profiling
    assert torch.equal(logits(model, inputs), expected)


@pytest.mark.parametrize("failure", ["infeasible budget", "bad loss_fn"])
def test_bad_input_leaves_a_planned_model_with_its_plan(tmp_root: Path, failure: str) -> None:
    """A model ``enable`` planned: the callback would replace that plan (enable's path), but
    a budget no plan meets or a loss it cannot use gets the callback's clear error and leaves
    enable's plan on, the model computing what it computed."""
    model = tiny_llama()
    earlier = gradckpt.enable(model, token_sample(), budget=None, strategy="sqrt",
                              optimizer="adamw", keep_output=False)
    model.eval()  # the callback profiles in training mode, and puts the modes back
    modes, inputs = [m.training for m in model.modules()], token_sample()["input_ids"]
    expected = logits(model, inputs)
    if failure == "infeasible budget":
        callback = GradckptCallback(budget=1024, sample=token_sample())
        raised = BudgetError
        message = r"(?s)GradckptCallback\(budget=1024\): .*GradckptCallback\(budget='[^']+'\)\."
    else:
        not_a_scalar = lambda output: output.logits  # noqa: E731
        callback = GradckptCallback(budget=BUDGET, sample=token_sample(), loss_fn=not_a_scalar)
        raised = UsageError
        message = r"GradckptCallback could not profile LlamaForCausalLM: .*scalar.*loss_fn="
    with pytest.raises(raised, match=message):
        callback.on_train_begin(
            training_args(tmp_root / f"planned-{failure}"), transformers.TrainerState(),
            transformers.TrainerControl(), model=model,
        )
    assert callback.plan is None and gradckpt.get_plan(model) is earlier
    assert [m.training for m in model.modules()] == modes
    assert torch.equal(logits(model, inputs), expected)
    gradckpt.disable(model)


def logits(model: nn.Module, inputs: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(3)  # the same dropout masks each time
    with torch.no_grad():
        return model(input_ids=inputs).logits


class OneLinear(nn.Module):
    """A model without a chain of blocks: one Linear."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 1)

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> CausalLMOutput:
        prediction = self.linear(x).squeeze(-1)
        return CausalLMOutput(loss=nn.functional.mse_loss(prediction, labels), logits=prediction)


def test_a_model_without_blocks_asks_for_blocks(tmp_root: Path) -> None:
    model = OneLinear()
    features = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    dataset = [{"x": row, "labels": row.sum()} for row in features]
    trainer = trainer_for(model, tmp_root / "no-blocks", [GradckptCallback(budget="90%")], dataset)
    with pytest.raises(UsageError, match="blocks="):
        trainer.train()
    assert not plan_is_applied(model)


def test_without_a_data_loader_asks_for_a_sample(tmp_root: Path) -> None:
    with pytest.raises(UsageError, match=r"sample="):
        GradckptCallback(budget="60%").on_train_begin(
            training_args(tmp_root / "no-loader"), transformers.TrainerState(),
            transformers.TrainerControl(), model=tiny_llama(),
        )


def test_bf16_mixed_precision_steps_are_predicted_and_fit(tmp_root: Path) -> None:
    """``bf16=True``: Accelerate runs the forward under autocast; the plan is made for that
    (the blocks are profiled under it) and the measured steps stay within budget + 3%. The
    prediction is not exact under autocast: the measured peak comes out above it (116 KiB,
    2.5%, before issue 22; 130 KiB, 3.9%, on the tighter steady-state plan since), where from
    is not pinned down (the same run in fp32 is exact: test_budget_holds_with_...). Bounded
    here at 5% so that a growing gap is seen."""
    model = tiny_llama()
    callback, metering = GradckptCallback(budget=BUDGET), MeterTheSteps()
    trainer = trainer_for(model, tmp_root / "bf16", [callback, metering], bf16=True)
    trainer.train()
    plan = callback.plan
    peak = metering.meter.peak()
    assert plan.segments
    assert peak <= plan.budget_bytes * 1.03
    assert abs(plan.predicted_peak_bytes - peak) <= 0.05 * peak, (plan.predicted_peak_bytes, peak)


def test_on_a_gpu_the_measured_peak_of_the_first_steps_is_logged_once(
    tmp_root: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The plan's CUDA watch (gradckpt.budget_watch) measures the first steps; the callback logs
    what it saw at WARNING once it is done. Stubbed here: this machine has no GPU."""
    callback = GradckptCallback(budget=BUDGET)
    callback.plan = SimpleNamespace(budget_bytes=100)  # planned already
    watch = SimpleNamespace(reason="", measured_peaks=[90, 95], active=True, peak_bytes=95,
                            summary=lambda: "measured peak 95 B over the first 2 training steps")
    monkeypatch.setattr(hf_trainer, "watch_of", lambda model: watch)
    model = nn.Linear(2, 2)
    with caplog.at_level(logging.INFO, logger="gradckpt"):
        callback.on_step_end(None, None, None, model=model)  # still watching: nothing yet
        assert not caplog.records and callback.measured_peak_bytes is None
        watch.active = False
        callback.on_step_end(None, None, None, model=model)
        callback.on_step_end(None, None, None, model=model)  # once only
        callback.on_train_end(None, None, None, model=model)
    assert [r.getMessage() for r in caplog.records] == [
        "gradckpt: measured peak 95 B over the first 2 training steps"]
    assert [r.levelno for r in caplog.records] == [logging.WARNING]
    assert callback.measured_peak_bytes == 95


def test_a_watch_cut_short_by_the_end_of_training_is_reported_then(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    callback = GradckptCallback(budget=BUDGET)
    callback.plan = SimpleNamespace(budget_bytes=100)
    watch = SimpleNamespace(reason="", measured_peaks=[120], active=True, peak_bytes=120,
                            summary=lambda: "measured peak 120 B, above it from step 1")
    monkeypatch.setattr(hf_trainer, "watch_of", lambda model: watch)
    with caplog.at_level(logging.WARNING, logger="gradckpt"):
        callback.on_train_end(None, None, None, model=nn.Linear(2, 2))
    assert callback.measured_peak_bytes == 120 and len(caplog.records) == 1


def padded_dataset(size: int = 16) -> list[dict[str, torch.Tensor]]:
    """Rows whose first tokens do not count (-100), a different number in each: the Trainer
    then divides each micro-batch's summed loss by the tokens counted over the whole
    accumulation (num_items_in_batch), not by its own."""
    rows = token_dataset(size)
    for index, row in enumerate(rows):
        row["labels"][: index % 5 * 3] = -100
    return rows


@pytest.mark.parametrize("output_head", ["chunked", "plain"])
def test_the_chunked_loss_trains_as_the_plain_model_with_gradient_accumulation(
    tmp_root: Path, output_head: str
) -> None:
    """With ``gradient_accumulation_steps=2``, padding in the labels and the loss in chunks,
    the run's losses and parameters are the plain run's within float rounding; ruled out, bit
    for bit. AdamW turns rounding in the smallest gradients into visible steps: the largest
    parameter difference measured after 3 steps at lr 1e-3 is 7.7e-6 (lm_head.weight; the
    rest below 5e-7), held here to 1% of the learning rate per step."""
    expected = tiny_llama()
    plain = trainer_for(expected, tmp_root / f"padded-plain-{output_head}",
                        dataset=padded_dataset(), gradient_accumulation_steps=2)
    plain.train()
    model = tiny_llama()
    callback = GradckptCallback(budget=None, strategy="none", output_head=output_head)
    trainer = trainer_for(model, tmp_root / f"padded-{output_head}", [callback],
                          dataset=padded_dataset(), gradient_accumulation_steps=2)
    trainer.train()
    assert callback.plan.head_chunks > 1 if output_head == "chunked" else (
        callback.plan.head_chunks == 1)
    tolerance = 3 * 0.01 * 1e-3 if output_head == "chunked" else 0.0
    assert losses(trainer) == pytest.approx(losses(plain), rel=0, abs=tolerance)
    got = parameters(model)
    differences = {name: (got[name] - parameter).abs().max().item()
                   for name, parameter in parameters(expected).items()}
    assert max(differences.values()) <= tolerance, sorted(differences.items(),
                                                          key=lambda item: -item[1])[:3]
    gradckpt.disable(model)
