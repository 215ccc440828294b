"""Identical blocks traced once (``gradckpt.measure.stand_ins``): on fake tensors, a long chain's
steps run with its first blocks only and are put together as the whole chain's (the chunked
head's steps with the first block alone, ``head_splice``, and its middle chunks standing in,
``chunk_stand_ins``); every field of the profile comes out as tracing every block and every
chunk gives it, and as ``profile`` measures it; chains whose blocks compute otherwise are
traced whole, heads whose chunks do with every chunk traced."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import gradckpt
from gradckpt.engine import linear_cross_entropy
from gradckpt.integrations.hf_families import causal_batch, hf_model
from gradckpt.measure import chunk_stand_ins, stand_ins
from gradckpt.measure.head_splice import head_replaced
from gradckpt.measure.meter import MemoryMeter
from gradckpt.measure.output_head import HeadPhaseTimer, _metered_standing_in
from gradckpt.measure.step_memory import Mark, StepMemory
from gradckpt.predict.clock import ModeledClock
from gradckpt.toy_models import GPTConfig, TinyGPT


def _every_block_traced(monkeypatch: pytest.MonkeyPatch, estimate) -> gradckpt.Profile:
    with monkeypatch.context() as patch:
        patch.setattr(stand_ins.StandIns, "of", classmethod(lambda cls, blocks: None))
        return estimate()


def _every_chunk_traced(monkeypatch: pytest.MonkeyPatch, estimate) -> gradckpt.Profile:
    with monkeypatch.context() as patch:
        patch.setattr(chunk_stand_ins, "KEPT", 1 << 30)  # no chunked loss has as many chunks
        return estimate()


def _chunks_put_back(monkeypatch: pytest.MonkeyPatch) -> list:
    """The chunk counts whose stand-ins are put back from now on (or why not)."""
    put_back = []
    real = chunk_stand_ins._put_back

    def noted(chunks, *arguments):
        try:
            stretch = real(chunks, *arguments)
        except chunk_stand_ins.ChunksNotSpliceable as error:
            put_back.append(str(error))
            raise
        put_back.append(chunks.count)
        return stretch

    monkeypatch.setattr(chunk_stand_ins, "_put_back", noted)
    return put_back


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
    # A stem whose ReLU saves the chain's input, alive past the chain's backward.
    "cnn stem": lambda: (_StemmedCNN(), torch.empty(2, 3, 16, 16, device="meta"),
                         {"device": "this", "loss_fn": lambda out: out.square().mean()}),
}


class _StemmedCNN(nn.Module):
    def __init__(self, width: int = 8, layers: int = 7) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.ReLU())
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Conv2d(width, width, 3, padding=1), nn.ReLU())
            for _ in range(layers))
        self.head = nn.Linear(width, 4)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        hidden = self.stem(images)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.head(hidden.mean((2, 3)))


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


# Each with the chunks its steps put back together: where there are more than KEPT + 1.
CHUNKED = {
    # 122 tokens: the last chunk shorter (32 chunks asked, of 4 tokens: 30 and one of 2; 8 of
    # 16: 7 and one of 10), full fine-tuning (the head's weight gradient summed in one
    # buffer), the head apart from the embedding.
    "llama ragged": (lambda: (_llama(7, attention_dropout=0.0), _meta_batch(61),
                              {"device": "h100-80gb", "dtype": torch.bfloat16,
                               "optimizer": "adamw"}), [8, 31]),
    # LoRA, the frozen head: only the hidden state's gradient comes out of the chunks.
    "lora ragged": (lambda: (_lora(_llama(7, attention_dropout=0.0)), _meta_batch(61),
                             {"device": "rtx4090", "optimizer": "adamw"}), [8, 31]),
    # The head tied to the embedding, at 16 chunks of 8 tokens.
    "tied": (CASES["tied"], [16]),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", CHUNKED)
def test_a_chunked_heads_middle_chunks_stand_in_as_if_every_chunk_ran(case, monkeypatch) -> None:
    pytest.importorskip("transformers")
    build, chunks_put_back = CHUNKED[case]
    model, sample, options = build()

    def estimate() -> gradckpt.Profile:
        return gradckpt.estimate(model, sample, **options)

    put_back = _chunks_put_back(monkeypatch)
    fast = estimate()
    assert put_back == chunks_put_back
    whole = _every_chunk_traced(monkeypatch, estimate)
    assert put_back == chunks_put_back  # none since
    assert _fields(fast) == _fields(whole)  # every byte and every second


class _SliceHead(nn.Module):
    """A vocabulary projection that computes one operation more on the slice at ``odd``."""

    def __init__(self, width: int, vocabulary: int, odd: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(vocabulary, width))
        self.odd = odd

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = hidden @ self.weight.t()
        return logits * 2 if hidden.storage_offset() == self.odd else logits


class _ChunkedLM(nn.Module):
    """A chain of identical blocks whose loss runs through ``linear_cross_entropy``."""

    def __init__(self, head: nn.Module, width: int = 16, vocabulary: int = 512) -> None:
        super().__init__()
        self.embedding = nn.Embedding(vocabulary, width)
        self.layers = nn.ModuleList(_Block(index, odd=-1, width=width) for index in range(6))
        self.head = head

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embedding(ids)
        for layer in self.layers:
            hidden = layer(hidden)
        return linear_cross_entropy(hidden, self.head, ids, shift=True)


@pytest.mark.parametrize("odd_chunk", [3, None])  # a middle compared with the one before; none
def test_chunks_that_compute_otherwise_are_traced_every_one(odd_chunk, monkeypatch) -> None:
    width, tokens = 16, 64  # 512 fp32 logits per 16 wide: 32 chunks of 2 tokens at most
    odd = -1 if odd_chunk is None else odd_chunk * 2 * width
    with torch.device("meta"):
        model = _ChunkedLM(_SliceHead(width, 512, odd))
    ids = torch.randint(0, 512, (1, tokens), device="meta")

    def estimate() -> gradckpt.Profile:
        return gradckpt.estimate(model, ids, loss_fn=lambda loss: loss)

    put_back = _chunks_put_back(monkeypatch)
    fast = estimate()
    assert [head.chunks for head in fast.chunked_heads] == [2, 8, 32]
    # the odd slice starts chunk 3 of 32 (2 tokens each); at 8 chunks it is inside the first
    assert put_back == ([8, "the middle chunks differ"] if odd_chunk else [8, 32])
    assert _fields(fast) == _fields(_every_chunk_traced(monkeypatch, estimate))


def test_chunks_standing_in_where_nothing_puts_them_back_are_metered_again() -> None:
    # A metered step (a meter keeping its trace, a modeled clock) whose chunks stood in but
    # that nothing put back (no ``head_stretch`` of it): metered again with every chunk.
    head = nn.Linear(8, 64, bias=False)
    hidden = torch.randn(24, 8, requires_grad=True)
    targets = torch.randint(0, 64, (24,))
    operations = []

    def metered() -> tuple[int, float]:
        with MemoryMeter("cpu", head, hidden) as meter:
            meter.trace = []
            linear_cross_entropy(hidden, head, targets, chunks=8).backward()
        operations.append(meter.operations)
        return meter.operations, 0.0

    class Device:
        def seconds(self, flops: float, bytes_moved: float, dtype: torch.dtype) -> float:
            return flops / 1e12

    timer, expected = HeadPhaseTimer(nn.Identity(), torch.device("cpu")), []
    with ModeledClock(Device()):
        got, _ = _metered_standing_in(head, metered, timer, expected.append)
    assert operations[0] < operations[1] == got  # 3 of the 8 chunks stood in, then none
    assert expected == [1]  # one more step


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

    def __init__(self, index: int, odd: int, width: int = 16) -> None:
        super().__init__()
        self.linear = nn.Linear(width, width)
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
