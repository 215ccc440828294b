"""A block's times on a modeled clock (``estimate``) are read from the runs that measure its
peaks (``gradckpt.measure.one_block``): the same seconds as timing each run apart, every run's
backward from no gradients, as a training step's."""

from __future__ import annotations

import types

import pytest
import torch
from torch import nn

import gradckpt
from gradckpt.integrations.hf_families import hf_model
from gradckpt.measure import clock, one_block

TIME_FIELDS = ("forward_seconds", "backward_seconds", "checkpointed_extra_seconds",
               "policy_extra_seconds", "matmul_seconds")


def _llama(lora: bool) -> nn.Module:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = hf_model("llama", num_hidden_layers=3, attention_dropout=0.0)
    if not lora:
        return model
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(model.to(torch.bfloat16),
                               peft.LoraConfig(r=4, target_modules="all-linear"))


def _estimate(model: nn.Module) -> gradckpt.Profile:
    ids = torch.randint(0, 512, (2, 64), device="meta")
    return gradckpt.estimate(model, {"input_ids": ids, "labels": ids}, device="h100-80gb",
                             dtype=torch.bfloat16, optimizer="adamw")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_modeled_times_are_those_of_runs_timed_apart_from_no_gradients(
    monkeypatch: pytest.MonkeyPatch, lora: bool
) -> None:
    """Every block's times equal, to the last bit, those of its forward, backward,
    checkpointed and policy runs timed one by one, each backward from no gradients (a run
    accumulating into the last one's gradients would add their read and write)."""
    read = _estimate(_llama(lora))
    timed_apart = types.SimpleNamespace(modeled=lambda: False, now=clock.now)
    with monkeypatch.context() as patch:
        patch.setattr(one_block, "clock", timed_apart)
        apart = _estimate(_llama(lora))
    for block_read, block_apart in zip(read.blocks, apart.blocks, strict=True):
        for field in TIME_FIELDS:
            assert getattr(block_read, field) == getattr(block_apart, field), (block_read.name,
                                                                               field)
        assert block_read.checkpointed_extra_seconds > 0
