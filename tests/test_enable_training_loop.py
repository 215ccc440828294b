"""The budget holds for the whole training loop users write (issue 22).

``gradckpt.enable(model, sample, budget, optimizer=optimizer)`` plans the steady-state step of

    for batch in loader:
        out = model(**batch)          # the previous ``out`` is released only once this returns
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()

from the second step on: the optimizer's state alive, ``optimizer.step()``'s own peak, the
previous step's output alive through the next forward and, with gradient accumulation, the
gradients held between micro-batches. Each test runs that loop on a real model (built from a
config, random weights, nothing downloaded), first without a plan and then, on an identical
model, with the plan ``enable`` makes, and checks that steps 2+ stay within the budget (+3%),
how close the prediction is, and that the run trains bit for bit as the plain one.

How the loop is measured (``train``): step 1 runs outside the meter, steps 2-4 inside a
``MemoryMeter`` that tracks the model, the optimizer (its state exists after step 1) and the
batches. The output step 1 leaves is deliberately *not* passed to the meter: the meter keeps a
reference to what it tracks, which would keep that output alive through every measured step
(an output too many, 2 MB of logits for the README's Llama). Untracked, it is missing from the
meter's total only while step 2's forward runs; steps 3 and 4 find their previous output made
inside the meter, so they are the loop's exact steady state and the peak is theirs.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hf_models
import pytest
import torch
import torch.nn.functional as F
from engine_models import (
    SmallCNN,
    assert_identical,
    assert_trains_as_plain,
    buffers,
    gradients,
    parameters,
)
from torch import nn

import gradckpt
from gradckpt.errors import GradckptWarning, forget_warnings
from gradckpt.measure import MemoryMeter

transformers = pytest.importorskip("transformers")

STEPS = 4  # step 1 unmetered, steps 2-4 metered
OVER_BUDGET = 1.03  # what the meter may see above the budget
PREDICTION_GAP = 0.03  # the prediction against the measured peak, either way

# The README's example: its logits (2 x 256 x 1000 floats, 2 MB) are the output a loop keeps.
README_VOCAB, README_BATCH, README_SEQ = 1000, 2, 256
SMALL_VOCAB, SMALL_SEQ = 1000, 64  # for the other Llamas: logits still weigh in the step


pytestmark = pytest.mark.usefixtures("one_thread")


# ---------------------------------------------------------------------------------------------
# The loop
# ---------------------------------------------------------------------------------------------


def forward(model: nn.Module, batch: Any) -> Any:
    return model(**batch) if isinstance(batch, dict) else model(batch)


def hf_loss(out: Any) -> torch.Tensor:
    return out.loss


class Loop:
    """The user's loop; ``self.out`` is their ``out`` variable, carried from step to step."""

    def __init__(
        self, model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[Any],
        loss_of: Callable[[Any], torch.Tensor],
    ) -> None:
        self.model, self.optimizer = model, optimizer
        self.micro_batches, self.loss_of = micro_batches, loss_of
        self.out: Any = None

    def step(self) -> None:
        accumulation_steps = len(self.micro_batches)
        for batch in self.micro_batches:
            # Assigned once the model returns: the previous output is alive through forward.
            self.out = forward(self.model, batch)
            if accumulation_steps == 1:
                self.loss_of(self.out).backward()
            else:
                (self.loss_of(self.out) / accumulation_steps).backward()
        self.optimizer.step()
        self.optimizer.zero_grad()


@dataclass
class Run:
    peak_bytes: int  # steps 2+ (see the module docstring)
    parameters: dict[str, torch.Tensor]
    gradients: dict[str, torch.Tensor | None]  # of one more forward and backward
    buffers: dict[str, torch.Tensor]


def train(
    model: nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[Any],
    loss_of: Callable[[Any], torch.Tensor] = hf_loss,
) -> Run:
    """``STEPS`` optimizer steps; the peak of steps 2+ and what the run leaves."""
    torch.manual_seed(7)  # the same dropout masks in every run
    loop = Loop(model, optimizer, micro_batches, loss_of)
    loop.step()
    batch_tensors = [t for b in micro_batches for t in (b.values() if isinstance(b, dict) else [b])]
    with MemoryMeter("cpu", model, optimizer, *batch_tensors) as meter:
        for _ in range(STEPS - 1):
            loop.step()
    loop.out = None
    trained = parameters(model)
    loss_of(forward(model, micro_batches[0])).backward()
    run = Run(meter.peak(), trained, gradients(model), buffers(model))
    model.zero_grad(set_to_none=True)
    return run


def assert_same_training(got: Run, expected: Run, plan: gradckpt.Plan | None = None) -> None:
    """Bit for bit; within float rounding where ``plan`` computes the loss in chunks."""
    assert_trains_as_plain(plan, got.parameters, expected.parameters, "parameters")
    assert_trains_as_plain(plan, got.gradients, expected.gradients, "gradients")
    assert_identical(got.buffers, expected.buffers, "buffers")


@dataclass
class Case:
    plain: Run
    planned: Run
    plan: gradckpt.Plan
    profile: gradckpt.Profile | None  # of the plain model, for percentage budgets

    def report(self) -> str:
        measured, predicted = self.planned.peak_bytes, self.plan.predicted_peak_bytes
        profiled = self.profile.peak_bytes if self.profile is not None else None
        return (f"plain measured {self.plain.peak_bytes}, profile.peak_bytes {profiled}, "
                f"budget {self.plan.budget_bytes}, predicted {predicted}, measured {measured} "
                f"(predicted - measured = {predicted - measured}, "
                f"{(predicted - measured) / measured:+.2%})")


def run_case(
    build: Callable[[], nn.Module], make_optimizer: Callable[[nn.Module], Any],
    micro_batches: list[Any], budget: int | str, *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None, with_profile: bool = False,
    plain: Run | None = None,
) -> Case:
    """The plain run (unless given), then an identical model with ``enable``'s plan."""
    loss_of = loss_fn or hf_loss
    measured_profile = None
    if plain is None or with_profile:
        model = build()
        optimizer = make_optimizer(model)
        if with_profile:  # as enable sees it: a fresh optimizer, no state yet
            measured_profile = gradckpt.profile(
                model, micro_batches[0], loss_fn=loss_fn, optimizer=optimizer,
                accumulation_steps=len(micro_batches), repeats=1)
        if plain is None:
            plain = train(model, optimizer, micro_batches, loss_of)
    model = build()
    optimizer = make_optimizer(model)
    plan = gradckpt.enable(
        model, micro_batches[0], budget, loss_fn=loss_fn, optimizer=optimizer,
        accumulation_steps=len(micro_batches))
    planned = train(model, optimizer, micro_batches, loss_of)
    return Case(plain, planned, plan, measured_profile)


def assert_fits_and_trains_the_same(case: Case) -> None:
    plan = case.plan
    assert plan.segments or plan.head_chunks > 1, f"nothing recomputed: {case.report()}"
    assert case.planned.peak_bytes < case.plain.peak_bytes, case.report()
    assert case.planned.peak_bytes <= plan.budget_bytes * OVER_BUDGET, case.report()
    # Never below the measured peak by more than the tolerance: a plan trusted to fit, fits.
    assert plan.predicted_peak_bytes >= case.planned.peak_bytes * (1 - PREDICTION_GAP), (
        case.report())
    assert_same_training(case.planned, case.plain, case.plan)


def assert_predicted_both_ways(case: Case) -> None:
    gap = abs(case.plan.predicted_peak_bytes - case.planned.peak_bytes)
    assert gap <= PREDICTION_GAP * case.planned.peak_bytes, case.report()


def assert_percentage_of_the_plain_loop(case: Case, share: float) -> None:
    """A percentage budget is of the plain loop's steady-state peak: the profile measures it."""
    plain_peak = case.plain.peak_bytes
    assert abs(case.profile.peak_bytes - plain_peak) <= 0.01 * plain_peak, case.report()
    assert abs(case.plan.budget_bytes - int(plain_peak * share)) <= 0.01 * plain_peak * share, (
        case.report())


# ---------------------------------------------------------------------------------------------
# Models and batches
# ---------------------------------------------------------------------------------------------


def readme_llama() -> nn.Module:
    config = transformers.LlamaConfig(
        vocab_size=README_VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=README_SEQ,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).train()


def readme_batch() -> dict[str, torch.Tensor]:
    batch = hf_models.causal_sample(README_VOCAB, batch=README_BATCH, seq=README_SEQ)
    return {**batch, "attention_mask": torch.ones_like(batch["input_ids"])}  # as the README


def small_llama() -> nn.Module:
    """Seeded, attention dropout on: the plan must replay the dropout masks."""
    return hf_models.tiny_llama(4, vocab_size=SMALL_VOCAB)


def small_batches(count: int = 1) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(2)
    batches = []
    for _ in range(count):
        input_ids = torch.randint(0, SMALL_VOCAB, (2, SMALL_SEQ), generator=generator)
        batches.append({"input_ids": input_ids, "labels": input_ids})
    return batches


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-4)


@functools.cache
def readme_plain_and_profile() -> tuple[Run, gradckpt.Profile]:
    model = readme_llama()
    optimizer = adamw(model)
    measured = gradckpt.profile(model, readme_batch(), optimizer=optimizer, repeats=1)
    return train(model, optimizer, [readme_batch()]), measured


@functools.cache
def readme_case() -> Case:
    plain, measured = readme_plain_and_profile()
    case = run_case(readme_llama, adamw, [readme_batch()], "60%", plain=plain)
    case.profile = measured
    return case


@functools.cache
def byte_budget_case() -> Case:
    plain, _ = readme_plain_and_profile()
    budget = int(0.75 * plain.peak_bytes)
    case = run_case(readme_llama, adamw, [readme_batch()], budget, plain=plain)
    assert case.plan.budget_bytes == budget
    return case


# ---------------------------------------------------------------------------------------------
# 1. The README example; 2. the same Llama at a byte budget
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_readme_example_fits_its_60_percent_budget_and_trains_the_same() -> None:
    case = readme_case()
    print(case.report())
    assert_fits_and_trains_the_same(case)


@pytest.mark.slow
def test_readme_example_60_percent_is_of_the_plain_loop_and_predicted_exactly() -> None:
    case = readme_case()
    assert_percentage_of_the_plain_loop(case, 0.6)
    assert_predicted_both_ways(case)


@pytest.mark.slow
def test_llama_with_adamw_fits_a_byte_budget_and_trains_the_same() -> None:
    case = byte_budget_case()
    print(case.report())
    assert_fits_and_trains_the_same(case)


@pytest.mark.slow
def test_llama_with_adamw_at_a_byte_budget_is_predicted_exactly() -> None:
    assert_predicted_both_ways(byte_budget_case())


# ---------------------------------------------------------------------------------------------
# 3. PEFT LoRA, AdamW on the adapters only
# ---------------------------------------------------------------------------------------------


def lora_llama(use_cache: bool = False) -> nn.Module:
    """``use_cache=False`` as fine-tuning scripts set it (with it on, the plain loop without
    gradckpt holds the cache too; gradckpt turns caches off in training: docs/planning.md)."""
    import peft

    model = small_llama()
    model.config.use_cache = use_cache
    torch.manual_seed(1)  # LoRA's A matrices: the same in both runs
    config = peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    return peft.get_peft_model(model, config)


def adamw_on_trainable(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


@functools.cache
def lora_case() -> Case:
    return run_case(lora_llama, adamw_on_trainable, small_batches(), "60%", with_profile=True)


def test_lora_fits_its_budget_and_trains_the_same() -> None:
    case = lora_case()
    print(case.report())
    assert_fits_and_trains_the_same(case)


def test_lora_60_percent_is_of_the_plain_loop_and_predicted_exactly() -> None:
    case = lora_case()
    assert_percentage_of_the_plain_loop(case, 0.6)
    assert_predicted_both_ways(case)


def partly_frozen_llama() -> nn.Module:
    """Partial fine-tuning: the embeddings and the first two of four layers frozen, so the
    first blocks' outputs need no gradient (they have no backward)."""
    model = small_llama()
    model.model.embed_tokens.requires_grad_(False)
    for layer in model.model.layers[:2]:
        layer.requires_grad_(False)
    return model


@functools.cache
def partly_frozen_case() -> Case:
    return run_case(partly_frozen_llama, adamw_on_trainable, small_batches(), "80%",
                    with_profile=True)


def test_first_layers_frozen_fits_its_budget_and_trains_the_same() -> None:
    case = partly_frozen_case()
    print(case.report())
    assert_fits_and_trains_the_same(case)
    assert_predicted_both_ways(case)
    frozen = [block for block in case.profile.blocks[:2]]
    assert all(block.backward_seconds == 0 and block.saved_bytes == 0 for block in frozen)


def qlora_builder(directory: Path) -> Callable[[], nn.Module]:
    """QLoRA as recipes set it up: the small Llama saved, loaded with a 4-bit NF4 base
    (bitsandbytes' CPU backend), ``prepare_model_for_kbit_training``, then LoRA."""
    import peft

    small_llama().save_pretrained(directory)

    def build() -> nn.Module:
        quantized = transformers.AutoModelForCausalLM.from_pretrained(
            directory, device_map="cpu", quantization_config=transformers.BitsAndBytesConfig(
                load_in_4bit=True, bnb_4bit_quant_type="nf4",
                bnb_4bit_compute_dtype=torch.float32))
        quantized.config.use_cache = False
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            prepared = peft.prepare_model_for_kbit_training(
                quantized, use_gradient_checkpointing=False)
        torch.manual_seed(1)
        config = peft.LoraConfig(r=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
        return peft.get_peft_model(prepared, config).train()

    return build


def test_qlora_with_adamw_on_the_adapters_fits_and_is_predicted(
    tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    pytest.importorskip("bitsandbytes")
    # Loading a quantized model fills torch's cached list of factory functions while some are
    # patched (torch 2.13, transformers 5.25); start that cache afresh after.
    request.addfinalizer(torch.utils._device._device_constructors.cache_clear)
    build = qlora_builder(tmp_path)
    case = run_case(build, adamw_on_trainable, small_batches(), "60%", with_profile=True)
    print(case.report())
    layer = case.profile.blocks[0]
    assert layer.gradient_bytes > 0  # the adapters train; the 4-bit base does not
    assert_fits_and_trains_the_same(case)
    assert_percentage_of_the_plain_loop(case, 0.6)
    assert_predicted_both_ways(case)


# ---------------------------------------------------------------------------------------------
# 4. A CNN with SGD and momentum, a loss_fn, BatchNorm's running statistics
# ---------------------------------------------------------------------------------------------

CNN_CLASSES = 10


def cnn() -> nn.Module:
    torch.manual_seed(0)
    return SmallCNN(channels=3, width=16, depth=6, classes=CNN_CLASSES).train()


def sgd_with_momentum(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


generator = torch.Generator().manual_seed(3)
CNN_IMAGES = torch.randn(8, 3, 32, 32, generator=generator)
CNN_LABELS = torch.randint(0, CNN_CLASSES, (8,), generator=generator)
del generator


def cnn_loss(logits: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits, CNN_LABELS)


@functools.cache
def cnn_case() -> Case:
    return run_case(cnn, sgd_with_momentum, [CNN_IMAGES], "60%", loss_fn=cnn_loss,
                    with_profile=True)


def test_cnn_with_sgd_momentum_fits_its_budget_and_trains_the_same() -> None:
    case = cnn_case()
    print(case.report())
    assert_fits_and_trains_the_same(case)  # buffers: BatchNorm's running statistics too


def test_cnn_60_percent_is_of_the_plain_loop_and_predicted_exactly() -> None:
    # Its output (8 x 10 logits) is too small for the over-count to show.
    case = cnn_case()
    assert_percentage_of_the_plain_loop(case, 0.6)
    assert_predicted_both_ways(case)


# ---------------------------------------------------------------------------------------------
# 5. Gradient accumulation over 4 micro-batches
# ---------------------------------------------------------------------------------------------


def test_gradient_accumulation_fits_its_budget_and_trains_the_same() -> None:
    # Steps 2-4, four micro-batches each; the gradients the first three leave are held. The
    # prediction may over-count, never under-count (assert_fits_and_trains_the_same).
    case = run_case(small_llama, adamw, small_batches(4), "70%")
    print(case.report())
    assert_fits_and_trains_the_same(case)


# ---------------------------------------------------------------------------------------------
# 6. No optimizer: a warning, once; optimizer="none": none
# ---------------------------------------------------------------------------------------------


@pytest.fixture
def fresh_warnings() -> Iterator[None]:
    forget_warnings()
    yield
    forget_warnings()


def optimizer_warnings(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught
            if issubclass(w.category, GradckptWarning) and "optimizer=" in str(w.message)]


def test_enable_without_an_optimizer_warns_once_and_optimizer_none_does_not(
    fresh_warnings: None,
) -> None:
    model = hf_models.tiny_llama(2)
    sample = hf_models.causal_sample(seq=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gradckpt.enable(model, sample, None, "every-layer")
        gradckpt.enable(model, sample, None, "sqrt")  # again: the warning is not repeated
    messages = optimizer_warnings(caught)
    assert len(messages) == 1, messages
    assert "enable(model, sample, budget, optimizer=optimizer)" in messages[0]
    assert "'none'" in messages[0]

    forget_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gradckpt.enable(model, sample, None, "every-layer", optimizer="none")
    assert optimizer_warnings(caught) == []
    gradckpt.disable(model)


def test_enable_with_nothing_to_train_does_not_warn(fresh_warnings: None) -> None:
    model = SmallCNN()
    model.blocks.requires_grad_(False)
    model.head.requires_grad_(False)
    images = torch.randn(2, 3, 8, 8, requires_grad=True)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gradckpt.enable(model, images, None, "every-layer")
    assert optimizer_warnings(caught) == []
    gradckpt.disable(model)


# ---------------------------------------------------------------------------------------------
# 7. The Hugging Face Trainer with GradckptCallback
# ---------------------------------------------------------------------------------------------
#
# Measured directly: a callback starts a meter when the Trainer's second step begins (the
# optimizer's state exists by then; the meter tracks the model and the optimizer) and stops it
# when the last step ends. The Trainer drops the model's output before backward
# (keep_output=False), so nothing of step 1 but the model and the optimizer is alive then; only
# the batch the Trainer fetched before step 2 begins is untracked (2 x 512 bytes here).

TRAINER_VOCAB, TRAINER_SEQ, TRAINER_BATCH = 256, 64, 4


def trainer_llama() -> nn.Module:
    return hf_models.tiny_llama(4, vocab_size=TRAINER_VOCAB)


def token_dataset(size: int = 16) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, TRAINER_VOCAB, (size, TRAINER_SEQ), generator=generator)
    return [{"input_ids": row, "labels": row.clone()} for row in tokens]


def run_trainer(model: nn.Module, output_dir: Path, callbacks: list[Any]) -> Any:
    args = transformers.TrainingArguments(
        output_dir=str(output_dir), per_device_train_batch_size=TRAINER_BATCH, max_steps=STEPS,
        learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
        seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=token_dataset(), callbacks=callbacks)
    trainer.train()
    return trainer


class MeterStepsAfterTheFirst(transformers.TrainerCallback):
    """The meter around the Trainer's steps 2+ (after the callbacks before it in the list)."""

    def __init__(self) -> None:
        self.meter: MemoryMeter | None = None

    def on_step_begin(self, args, state, control, model=None, optimizer=None, **kwargs) -> None:
        if state.global_step == 1 and self.meter is None:
            while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
                optimizer = optimizer.optimizer  # Accelerate's wrapper
            self.meter = MemoryMeter("cpu", model, optimizer).__enter__()

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if self.meter is not None and state.global_step >= state.max_steps:
            self.meter.__exit__(None, None, None)

    def peak_bytes(self) -> int:
        assert self.meter is not None
        return self.meter.peak()


@dataclass
class TrainerRun:
    peak_bytes: int
    parameters: dict[str, torch.Tensor]
    losses: list[float]
    callback: Any = None


def trainer_run(output_dir: Path, budget: int | str | None) -> TrainerRun:
    from gradckpt.integrations.hf_trainer import GradckptCallback

    model = trainer_llama()
    metering = MeterStepsAfterTheFirst()
    callback = GradckptCallback(budget=budget) if budget is not None else None
    trainer = run_trainer(model, output_dir, [c for c in (callback, metering) if c is not None])
    if callback is not None:
        gradckpt.disable(model)
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    return TrainerRun(metering.peak_bytes(), parameters(model), losses, callback)


@pytest.fixture(scope="module")
def plain_trainer_run(tmp_path_factory: pytest.TempPathFactory) -> TrainerRun:
    return trainer_run(tmp_path_factory.mktemp("trainer-plain"), None)


def trainer_report(run: TrainerRun, plain: TrainerRun) -> str:
    plan, measured = run.callback.plan, run.callback.profile
    gap = plan.predicted_peak_bytes - run.peak_bytes
    return (f"Trainer: plain measured {plain.peak_bytes}, profile.peak_bytes "
            f"{measured.peak_bytes}, budget {plan.budget_bytes}, predicted "
            f"{plan.predicted_peak_bytes}, measured {run.peak_bytes} (predicted - measured = "
            f"{gap}, {gap / run.peak_bytes:+.2%})")


def assert_trainer_fits_and_trains_the_same(run: TrainerRun, plain: TrainerRun) -> None:
    plan = run.callback.plan
    report = trainer_report(run, plain)
    print(report)
    assert plan.segments, report
    assert run.peak_bytes < plain.peak_bytes, report
    assert run.peak_bytes <= plan.budget_bytes * OVER_BUDGET, report
    assert abs(plan.predicted_peak_bytes - run.peak_bytes) <= PREDICTION_GAP * run.peak_bytes, (
        report)
    if plan.head_chunks == 1:
        assert run.losses == plain.losses
    else:
        assert run.losses == pytest.approx(plain.losses, rel=1e-5)
    assert_trains_as_plain(plan, run.parameters, plain.parameters, "parameters")


def test_trainer_callback_60_percent_is_of_the_trainers_step_and_fits(
    plain_trainer_run: TrainerRun, tmp_path: Path,
) -> None:
    run = trainer_run(tmp_path, "60%")
    callback = run.callback
    # The callback's profile is the Trainer's step: the plain Trainer's measured steps 2+.
    plain_peak = plain_trainer_run.peak_bytes
    assert abs(callback.profile.peak_bytes - plain_peak) <= 0.01 * plain_peak, (
        trainer_report(run, plain_trainer_run))
    assert callback.plan.budget_bytes == int(callback.profile.peak_bytes * 0.6)
    assert_trainer_fits_and_trains_the_same(run, plain_trainer_run)


def test_trainer_callback_fits_a_byte_budget(
    plain_trainer_run: TrainerRun, tmp_path: Path,
) -> None:
    budget = int(0.75 * plain_trainer_run.peak_bytes)
    run = trainer_run(tmp_path, budget)
    assert run.callback.plan.budget_bytes == budget
    assert_trainer_fits_and_trains_the_same(run, plain_trainer_run)


@pytest.mark.parametrize("optimizer", ["adamm", 3, torch.nn.Linear(2, 2)])
def test_an_unknown_optimizer_is_refused_before_anything_runs(optimizer: Any) -> None:
    model = small_llama()
    forwards = []
    model.register_forward_pre_hook(lambda module, args: forwards.append(1))
    with pytest.raises(gradckpt.UsageError, match="optimizer") as caught:
        gradckpt.enable(model, small_batches()[0], "60%", optimizer=optimizer)
    assert "adamw" in str(caught.value)  # the names it takes
    assert not forwards and gradckpt.get_plan(model) is None
