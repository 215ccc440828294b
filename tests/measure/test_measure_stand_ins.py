"""Identical blocks traced once (``gradckpt.measure.stand_ins``): on fake tensors, a long chain's
steps run with its first blocks only and are put together as the whole chain's (the chunked
head's steps with the first block alone, ``head_splice``); every field of the profile comes out
as tracing every block gives it, and as ``profile`` measures it; chains whose blocks compute
otherwise are traced whole."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import gradckpt
from gradckpt.integrations.hf_families import causal_batch, hf_model
from gradckpt.measure import stand_ins
from gradckpt.measure.head_splice import head_replaced
from gradckpt.measure.step_memory import Mark, StepMemory
from gradckpt.toy_models import GPTConfig, TinyGPT


def _every_block_traced(monkeypatch: pytest.MonkeyPatch, estimate) -> gradckpt.Profile:
    with monkeypatch.context() as patch:
        patch.setattr(stand_ins.StandIns, "of", classmethod(lambda cls, blocks: None))
        return estimate()


def _fields(profile: gradckpt.Profile) -> dict:
    fields = json.loads(profile.to_json())
    fields["notes"].pop("blocks_traced_in_steps")
    return fields


def _llama(layers: int, **config) -> nn.Module:
    torch.manual_seed(0)
    with torch.device("meta"):
        return hf_model("llama", num_hidden_layers=layers, **config)


def _lora(model: nn.Module) -> nn.Module:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear")
    return peft.get_peft_model(model.to(torch.bfloat16), config)


def _meta_batch(seq: int = 64) -> dict:
    ids = torch.randint(0, 512, (2, seq), device="meta")
    return {"input_ids": ids, "labels": ids}


CASES = {
    # A toy GPT on this machine's clock.
    "tinygpt": lambda: (TinyGPT(GPTConfig(n_layer=7, n_embd=32, n_head=2, block_size=16)),
                        {"idx": torch.randint(0, 512, (2, 16), device="meta"),
                         "targets": torch.randint(0, 512, (2, 16), device="meta")},
                        {"device": "this"}),
    # Full fine-tuning in bf16 with AdamW on an H100 (cuDNN attention), the chunked head.
    "llama": lambda: (_llama(7, attention_dropout=0.0), _meta_batch(),
                      {"device": "h100-80gb", "dtype": torch.bfloat16, "optimizer": "adamw"}),
    # LoRA on every linear layer of a frozen bf16 base: the first block's input needs no
    # gradient, so it is a kind of its own.
    "lora": lambda: (_lora(_llama(7, attention_dropout=0.0)), _meta_batch(),
                     {"device": "rtx4090", "optimizer": "adamw"}),
    # The head tied to the embedding, fully fine-tuned: its weight's gradient is summed with
    # the embedding's after the chain's backward.
    "tied": lambda: (hf_model("qwen2", num_hidden_layers=7, tie_word_embeddings=True),
                     _meta_batch(), {"device": "h100-80gb", "optimizer": "adamw"}),
    # Attention dropout (the math path on a GPU target), the loop dropping its output.
    "gpt2": lambda: (hf_model("gpt2", n_layer=6), _meta_batch(),
                     {"device": "a100-80gb", "keep_output": False}),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_a_long_chain_is_estimated_from_its_first_blocks_as_from_all(case, monkeypatch) -> None:
    pytest.importorskip("transformers")
    model, sample, options = CASES[case]()

    def estimate() -> gradckpt.Profile:
        return gradckpt.estimate(model, sample, **options)

    fast = estimate()
    whole = _every_block_traced(monkeypatch, estimate)
    assert fast.notes["blocks_traced_in_steps"] == stand_ins.KEPT
    assert whole.notes["blocks_traced_in_steps"] == len(whole.blocks)
    assert _fields(fast) == _fields(whole)  # every byte and every second


@pytest.mark.slow
def test_a_long_chain_estimated_from_its_first_blocks_is_what_profile_measures() -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = hf_model("llama", num_hidden_layers=7)
    sample = causal_batch(2, 64)
    measured = gradckpt.profile(model, sample, repeats=1)
    predicted = gradckpt.estimate(model, sample, device="this")
    assert predicted.notes["blocks_traced_in_steps"] == stand_ins.KEPT
    for ours, theirs in zip(predicted.blocks, measured.blocks, strict=True):
        assert (ours.saved_bytes, ours.input_bytes, ours.forward_peak_bytes,
                ours.backward_peak_bytes, ours.checkpointed_backward_peak_bytes) == (
            theirs.saved_bytes, theirs.input_bytes, theirs.forward_peak_bytes,
            theirs.backward_peak_bytes, theirs.checkpointed_backward_peak_bytes), ours.name
    assert (predicted.peak_bytes, predicted.fixed_bytes, predicted.head_bytes,
            predicted.head_gradient_bytes, predicted.other_peak_bytes) == (
        measured.peak_bytes, measured.fixed_bytes, measured.head_bytes,
        measured.head_gradient_bytes, measured.other_peak_bytes)
    assert [head.peak_bytes for head in predicted.chunked_heads] == [
        head.peak_bytes for head in measured.chunked_heads]


class _Block(nn.Module):
    """Built alike at every index; the one at ``odd`` computes one operation more."""

    def __init__(self, index: int, odd: int) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.twice = index == odd

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.relu(self.linear(x))
        return y * 2 if self.twice else y


class _Pair(nn.Module):
    """Returns its hidden state and another tensor: no identity stands for it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.linear(x), x.sum()


@pytest.mark.parametrize("odd", [2, 6])  # a kept middle, a block standing in
def test_blocks_built_alike_that_compute_otherwise_are_traced_whole(odd, monkeypatch) -> None:
    with torch.device("meta"):
        model = nn.Sequential(*(_Block(index, odd) for index in range(8)))
    sample = torch.ones(4, 16, device="meta")
    predicted = gradckpt.estimate(model, sample)
    whole = _every_block_traced(monkeypatch, lambda: gradckpt.estimate(model, sample))
    assert predicted.notes["blocks_traced_in_steps"] == 8  # it fell back
    assert _fields(predicted) == _fields(whole)


def test_blocks_returning_more_than_their_hidden_state_are_traced_whole() -> None:
    class Returning(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.layers = nn.ModuleList(_Pair() for _ in range(6))

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            for layer in self.layers:
                x = layer(x)
                x = x[0] if isinstance(x, tuple) else x
            return x

    with torch.device("meta"):
        model = Returning()
    predicted = gradckpt.estimate(model, torch.ones(4, 16, device="meta"))
    assert predicted.notes["blocks_traced_in_steps"] == 6


def test_marks_that_are_not_a_chains_do_not_splice() -> None:
    memory = StepMemory(nn.Linear(1, 1), nn.Linear(1, 1), torch.device("cpu"))
    memory.marks = [Mark("forward", None, "before", 0, 0, 0.0, 0),
                    Mark("head", None, "forward", 0, 0, 0.0, 0)]
    with pytest.raises(stand_ins.NotSpliceable, match="not a chain's"):
        stand_ins.splice(memory, stand_ins.KEPT, 8)


def test_a_head_stretch_is_spliced_only_between_the_chains_output_and_its_gradient() -> None:
    def step(*marks: Mark) -> StepMemory:
        memory = StepMemory(nn.Linear(1, 1), nn.Linear(1, 1), torch.device("cpu"))
        memory.marks, memory.trace = list(marks), [0] * marks[-1].operations
        return memory

    before, head = Mark("forward", None, "before", 0, 0, 0.0, 1), Mark(
        "head", None, "forward", 0, 0, 0.0, 2)
    plain = step(before, head, Mark("backward", None, "head", 0, 0, 0.0, 3))
    # a block's mark inside the head's stretch: it is not the head alone
    other = step(before, head, Mark("forward", 1, "head", 0, 0, 0.0, 3),
                 Mark("backward", None, "head", 0, 0, 0.0, 4))
    with pytest.raises(stand_ins.NotSpliceable, match="head's stretch"):
        head_replaced(plain, other)
    # more operations before the chain: the steps differ there
    longer = step(Mark("forward", None, "before", 0, 0, 0.0, 2), Mark(
        "head", None, "forward", 0, 0, 0.0, 3), Mark("backward", None, "head", 0, 0, 0.0, 4))
    with pytest.raises(stand_ins.NotSpliceable, match="differ before the chain"):
        head_replaced(plain, longer)


def test_only_long_chains_of_blocks_built_alike_stand_in() -> None:
    alike = [nn.Linear(4, 4) for _ in range(6)]
    assert stand_ins.StandIns.of(alike).standing_in == range(4, 6)
    assert stand_ins.StandIns.of(alike[:4]) is None  # nothing to leave out
    assert stand_ins.StandIns.of([*alike[:5], nn.Linear(4, 5)]) is None  # another shape
    frozen = [nn.Linear(4, 4) for _ in range(6)]
    frozen[5].weight.requires_grad_(False)
    assert stand_ins.StandIns.of(frozen) is None  # trained otherwise
    shared = nn.Linear(4, 4)
    assert stand_ins.StandIns.of([shared] * 6) is None  # one parameter in several blocks
