"""trl's ``SFTTrainer`` with PEFT LoRA and ``GradckptCallback``: the run trains exactly as the
same run without the callback, its steps fit the budget as predicted, and ``disable`` leaves the
model as it was when training began.

SFTTrainer (trl 1.x) computes the loss through a fused LM head it patches onto the model
(``model(**batch, fused_lm_head=True)``), not through ``output.loss`` of the plain forward; the
callback profiles that call (``hf_trainer._has_trl_fused_head``), so the predicted peak is the
measured one. A tiny Llama (random weights) and a character-level tokenizer built here: nothing
is downloaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import hf_models
import pytest
import torch
from test_integrations_hf_trainer import MeterTheSteps, losses, plan_is_applied

import gradckpt
from gradckpt.integrations.hf_trainer import GradckptCallback

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")

pytestmark = pytest.mark.usefixtures("one_thread")

CHARACTERS = "abcdefghijklmnopqrstuvwxyz .,"
# Above trl's fused head alone (a fixed 8 MiB at this vocabulary), low enough that the plan
# recomputes blocks.
BUDGET = "90%"


def character_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """One token per character, with pad and end-of-sequence tokens: 32 ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocabulary = {"<pad>": 0, "<eos>": 1, "<unk>": 2}
    vocabulary.update({character: 3 + index for index, character in enumerate(CHARACTERS)})
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return transformers.PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")


def text_dataset() -> Any:
    texts = ["the quick brown fox jumps over the lazy dog, twice over the dog",
             "a stitch in time saves nine, said the tailor",
             "hello world, this is a tiny model trained on characters"] * 4
    return datasets.Dataset.from_dict({"text": texts})


def sft_trainer(output_dir: Path, callbacks: list[Any]) -> Any:
    model = hf_models.tiny_llama(4, vocab_size=64)
    torch.manual_seed(1)  # LoRA's A matrices: the same in every run
    lora = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "gate_proj"],
                           lora_dropout=0.0, task_type="CAUSAL_LM")
    args = trl.SFTConfig(
        output_dir=str(output_dir), per_device_train_batch_size=2, max_steps=3,
        learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
        seed=0, disable_tqdm=True, max_length=64,
    )
    return trl.SFTTrainer(model=model, args=args, train_dataset=text_dataset(),
                          processing_class=character_tokenizer(), peft_config=lora,
                          callbacks=callbacks)


def hooks_and_forwards(model: torch.nn.Module) -> list[tuple]:
    """What a plan could leave on each module: hooks, and a forward set on the instance."""
    return [(name, len(module._forward_hooks), len(module._forward_pre_hooks),
             len(module._backward_hooks), len(module._backward_pre_hooks),
             vars(module).get("forward"))
            for name, module in model.named_modules()]


class HooksBeforePlanning(transformers.TrainerCallback):
    """``hooks_and_forwards`` when training begins, before the callback after this one plans
    (Accelerate has wrapped the model's forward by then)."""

    def __init__(self) -> None:
        self.seen: list[tuple] | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs) -> None:
        self.seen = hooks_and_forwards(model)


def test_sft_trainer_with_lora_trains_exactly_as_without_the_callback_within_budget(
    tmp_path: Path,
) -> None:
    # SFTConfig turns Transformers' per-layer checkpointing on by default: the plain run uses
    # it, the planned one has the plan instead (the callback turns it off, with a warning).
    plain = sft_trainer(tmp_path / "plain", [])
    plain.train()

    before = HooksBeforePlanning()
    callback, metering = GradckptCallback(budget=BUDGET), MeterTheSteps()
    trainer = sft_trainer(tmp_path / "planned", [before, callback, metering])
    model = trainer.model
    trainer.train()

    plan = callback.plan
    assert plan is not None and plan.segments and plan_is_applied(model)
    # Bit for bit: the callback restores every random state it advances (attention dropout is
    # on), and recomputation replays each block's random numbers.
    assert losses(trainer) == losses(plain)
    peak = metering.meter.peak()
    assert peak <= plan.budget_bytes * 1.03, (peak, plan.budget_bytes)
    # The step profiled is the one SFTTrainer runs, through its fused head: predicted as
    # measured (132 B apart when written).
    assert abs(plan.predicted_peak_bytes - peak) <= 0.01 * peak, (plan.predicted_peak_bytes, peak)
    gradckpt.disable(model)
    assert not plan_is_applied(model)
    assert hooks_and_forwards(model) == before.seen
