"""Hugging Face causal language models whose plan computes the loss in chunks of tokens.

``gradckpt/integrations/hf_head.py``: while a plan with a chunked output head is applied, a
causal language model's training step with ``labels`` computes its loss with
``gradckpt.linear_cross_entropy`` (the whole logits never exist; ``out.logits`` is an empty
``(batch, seq, 0)`` tensor); evaluation, ``generate()`` and steps without labels are the
model's own. Models are built from configs (random weights, nothing downloaded) and trained
the way fine-tuning scripts do: ``labels`` in the batch with some -100 padding, ``out`` held
through backward, AdamW. Checked:

- GPT-2 (tied embeddings), Llama, Qwen2, a head with a bias, Gemma 2 (soft-capping, tied),
  PEFT's LoRA on a frozen Llama (on its head too, planned after PEFT or before it), ProphetNet
  (its own loss over two streams of tokens, unshifted; its first stream alone) and a plain
  PyTorch model calling ``linear_cross_entropy``
  train as an identical plain copy within float rounding (the largest differences measured are
  in ``FAMILY_TOLERANCES``);
- what stays the model's own, bit for bit; ``num_items_in_batch`` and ``shift_labels``;
- planning: ``profile.chunked_heads`` (and ``estimate``'s, to the byte), the memory table's
  split of the chunked head, ``solve``/``enable``'s ``output_head``, the least
  budget fits as predicted, and a model whose logits the chunked loss would not repeat is
  offered no chunked head, nor is ProphetNet smoothing its labels (it trains bit for bit);
- ``disable`` and bad requests.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

import gradckpt
from gradckpt.engine import planned_head_chunks
from gradckpt.measure.memory_parts import (
    HEAD_CHUNK,
    HEAD_UNDIVIDED,
    OUTPUT_HEAD,
    memory_parts,
    one_head_chunk_bytes,
)
from gradckpt.solvers.optimal import minimum_peak_bytes
from gradckpt.toy_models import GPTConfig, TinyGPT

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, BATCH, SEQ, PADDED = 256, 2, 32, 5  # the last PADDED labels of row 1 are -100
STEPS, LEARNING_RATE = 3, 1e-3
ALLOWANCE = 0.03  # measured over budget, and prediction against measured


# ---------------------------------------------------------------------------------------------
# Models and batches
# ---------------------------------------------------------------------------------------------


def causal_batch(vocab: int = VOCAB, seq: int = SEQ) -> dict[str, torch.Tensor]:
    """ids, an attention mask and labels as a collator pads them: the tail of row 1 is padding
    (mask 0, label -100)."""
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(3, vocab, (BATCH, seq), generator=generator)
    labels = ids.clone()
    labels[1, -PADDED:] = -100
    mask = torch.ones_like(ids)
    mask[1, -PADDED:] = 0
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


DECODER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)


def llama(vocab: int = VOCAB) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=vocab, **DECODER)
    return transformers.LlamaForCausalLM(config).train()


def qwen2(vocab: int = VOCAB) -> nn.Module:
    torch.manual_seed(0)
    return transformers.Qwen2ForCausalLM(transformers.Qwen2Config(vocab_size=vocab,
                                                                  **DECODER)).train()


def gpt2(vocab: int = VOCAB) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=vocab, n_embd=32, n_layer=2, n_head=2,
                                     n_positions=64, bos_token_id=0, eos_token_id=0,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    return transformers.GPT2LMHeadModel(config).train()


def gemma2(vocab: int = VOCAB) -> nn.Module:
    """Soft-capping at 5 (Gemma 2's is 30): the random logits reach past it."""
    torch.manual_seed(0)
    config = transformers.Gemma2Config(vocab_size=vocab, head_dim=16,
                                       final_logit_softcapping=5.0, **DECODER)
    return transformers.Gemma2ForCausalLM(config).train()


def prophetnet(vocab: int = VOCAB, **config: Any) -> nn.Module:
    """ProphetNet's decoder as a causal language model: two streams of tokens predicted
    (``ngram=2``), its own loss (``_compute_loss``); dropout off (the runs compared draw no
    masks)."""
    torch.manual_seed(0)
    return transformers.ProphetNetForCausalLM(transformers.ProphetNetConfig(
        vocab_size=vocab, hidden_size=64, encoder_ffn_dim=128, decoder_ffn_dim=128,
        num_encoder_layers=2, num_decoder_layers=2, num_encoder_attention_heads=4,
        num_decoder_attention_heads=4, max_position_embeddings=64, dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, is_decoder=True,
        add_cross_attention=False, **config)).train()


def prophetnet_first_stream_only() -> nn.Module:
    model = prophetnet()
    model.disable_ngram_loss = True  # as set_disable_ngram_loss(): the first stream's loss
    return model


def llama_with_a_biased_head() -> nn.Module:
    model = llama()
    head = nn.Linear(DECODER["hidden_size"], VOCAB, bias=True)
    with torch.no_grad():
        head.weight.copy_(model.lm_head.weight)
        head.bias.normal_()
    model.lm_head = head
    return model


def peft_llama(targets: tuple[str, ...] = ("q_proj", "v_proj"), vocab: int = VOCAB
               ) -> nn.Module:
    """PEFT's LoRA on a frozen Llama (with ``"lm_head"`` in ``targets``: on its head too)."""
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), lora_dropout=0.0)
    return peft.get_peft_model(llama(vocab), config)


def peft_llama_with_lora_on_its_head() -> nn.Module:
    return peft_llama(("q_proj", "v_proj", "lm_head"))


class ChunkedLossGPT(TinyGPT):
    """Any PyTorch model: TinyGPT whose loss is ``gradckpt.linear_cross_entropy``."""

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        if targets is None:
            return super().forward(idx)
        positions = torch.arange(idx.shape[1], device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(positions))
        for block in self.transformer.h:
            x = block(x)
        return gradckpt.linear_cross_entropy(self.transformer.ln_f(x), self.lm_head, targets)


def chunked_loss_gpt() -> nn.Module:
    torch.manual_seed(0)
    config = GPTConfig(n_layer=2, n_embd=32, n_head=2, block_size=SEQ, vocab_size=VOCAB,
                       dropout=0.0)
    return ChunkedLossGPT(config).train()


def gpt_batch() -> tuple[torch.Tensor, torch.Tensor]:
    batch = causal_batch()
    return batch["input_ids"], batch["labels"].roll(-1, 1)


def loss_of(out: Any) -> torch.Tensor:
    return out if isinstance(out, torch.Tensor) else out.loss


def call(model: nn.Module, batch: Any, **kwargs: Any) -> Any:
    return model(**batch, **kwargs) if isinstance(batch, dict) else model(*batch)


# Per family: how it is built, its batch, and how far its run may be from the plain one's:
# the loss of each step, the gradients of step 1, the parameters after 3 AdamW steps. The
# largest differences measured (torch 2.13, CPU, float32, lr 1e-3, 2 chunks):
#   gpt2      loss 4.8e-7  gradients 1.5e-8  parameters 1.2e-6 (h.0.attn.c_attn.bias)
#   llama     loss 9.5e-7  gradients 1.9e-8  parameters 1.5e-8
#   qwen2     loss 9.5e-7  gradients 1.5e-8  parameters 2.0e-7 (layers.1.self_attn.k_proj.bias)
#   gemma2    loss 4.8e-7  gradients 3.0e-8  parameters 3.1e-7 (layers.1.mlp.up_proj.weight)
#   bias      loss 4.8e-7  gradients 1.9e-8  parameters 2.2e-8
#   peft      loss 9.5e-7  gradients 0       parameters 0
#   peft-lm-head (LoRA on the head too): loss 4.8e-7, gradients 1.5e-8, parameters 4.5e-8
#   tinygpt   loss 0       gradients 1.5e-8  parameters 1.1e-6 (h.0.attn.c_attn.bias)
#   llama, 7 chunks: loss 4.8e-7, gradients 2.2e-8, parameters 3.2e-8
#   prophetnet (two streams, 4 chunks): loss 4.8e-7, gradients 2.0e-8, parameters 1.3e-7
#     (decoder.layers.1.self_attn.key_proj.bias); its first stream alone (2 chunks): loss 0,
#     gradients 3.0e-8, parameters 2.1e-7 (layers.0's key_proj.bias)
# (a loss of 5.5 in float32: 4.8e-7 is one ulp). The key projection's bias has no gradient in
# exact arithmetic (softmax ignores a shift common to all keys): its gradient is rounding
# noise, which AdamW scales to steps of up to a good fraction of the learning rate, so that bias
# moves by noise whatever the order of the sums. A wrong loss would move every parameter by
# about the learning rate (1e-3) per step.
LOSS_TOLERANCE, GRADIENT_TOLERANCE = 4e-6, 1e-7
PARAMETER_TOLERANCE = {"gpt2": 5e-6, "tinygpt": 5e-6, "qwen2": 1e-6, "gemma2": 1.5e-6,
                       "prophetnet-first-stream": 5e-7}
DEFAULT_PARAMETER_TOLERANCE = 2e-7


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    build: Callable[[], nn.Module]
    batch: Callable[[], Any]


FAMILIES = [
    Family("gpt2", gpt2, causal_batch),
    Family("llama", llama, causal_batch),
    Family("qwen2", qwen2, causal_batch),
    Family("gemma2", gemma2, causal_batch),
    Family("bias", llama_with_a_biased_head, causal_batch),
    Family("peft", peft_llama, causal_batch),
    Family("peft-lm-head", peft_llama_with_lora_on_its_head, causal_batch),
    Family("tinygpt", chunked_loss_gpt, gpt_batch),
    Family("prophetnet", prophetnet, causal_batch),
    Family("prophetnet-first-stream", prophetnet_first_stream_only, causal_batch),
]


def plan_chunking_the_head(model: nn.Module, batch: Any,
                           output_head: str = "chunked") -> gradckpt.Plan:
    """Profile, then the plan that recomputes no block, with the head as ``output_head``."""
    measured = gradckpt.profile(model, batch, optimizer="adamw", repeats=1)
    return gradckpt.solve(measured, None, "none", output_head=output_head)


@dataclasses.dataclass
class Run:
    losses: list[torch.Tensor]
    gradients: dict[str, torch.Tensor | None]  # after step 1's backward
    parameters: dict[str, torch.Tensor]  # after the last step
    logits_shape: tuple[int, ...] | None


def train(model: nn.Module, batch: Any, steps: int = STEPS) -> Run:
    """The fine-tuning loop: ``out`` alive through backward and until the next forward."""
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=LEARNING_RATE)
    losses, gradients, out = [], {}, None
    for step in range(steps):
        out = call(model, batch)
        loss_of(out).backward()
        if step == 0:
            gradients = {name: None if p.grad is None else p.grad.clone()
                         for name, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss_of(out).detach())
    logits = getattr(out, "logits", None)
    parameters = {name: p.detach().clone() for name, p in model.named_parameters()}
    return Run(losses, gradients, parameters, None if logits is None else tuple(logits.shape))


def train_planned_and_plain(model: nn.Module, plain: nn.Module, batch: Any,
                            plan: gradckpt.Plan) -> tuple[Run, Run]:
    """``model`` trained with ``plan`` applied, then ``plain``, its copy, without."""
    gradckpt.apply(model, plan)
    try:
        got = train(model, batch)
    finally:
        gradckpt.disable(model)
    return got, train(plain, batch)


def largest_difference(got: dict, expected: dict) -> float:
    assert got.keys() == expected.keys()
    differences = [0.0]
    for name, value in expected.items():
        assert (got[name] is None) == (value is None), name
        if value is not None:
            differences.append((got[name] - value).abs().max().item())
    return max(differences)


# ---------------------------------------------------------------------------------------------
# Training: as the plain model, within float rounding
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", FAMILIES, ids=lambda family: family.name)
def test_a_chunked_head_trains_as_the_plain_model(family: Family) -> None:
    model, batch = family.build(), family.batch()
    plain = copy.deepcopy(model)
    plan = plan_chunking_the_head(model, batch)
    assert plan.head_chunks > 1
    assert plan.head_name.endswith("lm_head")
    assert f"{plan.head_name} (output head)" in str(plan)
    got, expected = train_planned_and_plain(model, plain, batch, plan)
    if family.name != "tinygpt":
        assert got.logits_shape == (BATCH, SEQ, 0)
        assert expected.logits_shape == (BATCH, SEQ, VOCAB)
    for step, (loss, plain_loss) in enumerate(zip(got.losses, expected.losses, strict=True)):
        assert abs(loss - plain_loss).item() <= LOSS_TOLERANCE, (step, loss, plain_loss)
    gradient_difference = largest_difference(got.gradients, expected.gradients)
    assert gradient_difference <= GRADIENT_TOLERANCE, gradient_difference
    parameter_difference = largest_difference(got.parameters, expected.parameters)
    assert parameter_difference <= PARAMETER_TOLERANCE.get(
        family.name, DEFAULT_PARAMETER_TOLERANCE), (
        parameter_difference)
    assert expected.losses[-1] < expected.losses[0]  # it did train


@pytest.mark.parametrize("targets", [
    ("q_proj", "v_proj"),
    ("q_proj", "v_proj", "lm_head"),
], ids=["attention", "attention-and-head"])
def test_peft_applied_after_the_plan_trains_as_the_plain_peft_model(targets) -> None:
    model, batch = llama(), causal_batch()
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=list(targets), lora_dropout=0.0)
    plain = peft.get_peft_model(copy.deepcopy(model), config)
    gradckpt.apply(model, plan_chunking_the_head(model, batch))
    try:
        wrapped = peft.get_peft_model(model, config)
        wrapped.load_state_dict(plain.state_dict())  # the same LoRA weights
        got = train(wrapped, batch)
    finally:
        gradckpt.disable(model)
    expected = train(plain, batch)
    assert got.logits_shape == (BATCH, SEQ, 0)
    assert largest_difference(got.gradients, expected.gradients) <= GRADIENT_TOLERANCE
    assert largest_difference(got.parameters, expected.parameters) <= DEFAULT_PARAMETER_TOLERANCE


def test_the_plain_pytorch_model_without_a_plan_is_tinygpts_own_loss_bit_for_bit() -> None:
    model = chunked_loss_gpt()
    own = TinyGPT(model.config)
    own.load_state_dict(model.state_dict())
    idx, targets = gpt_batch()
    assert torch.equal(model(idx, targets), own(idx, targets))


def test_a_chunk_count_that_does_not_divide_the_tokens_trains_the_same() -> None:
    model, batch = llama(), causal_batch()
    plain = copy.deepcopy(model)
    plan = dataclasses.replace(plan_chunking_the_head(model, batch), head_chunks=7)
    gradckpt.apply(model, plan)  # 64 tokens: 6 chunks of 10, one of 4 (ceil(64 / 7) = 10)
    try:
        got = train(model, batch)
    finally:
        gradckpt.disable(model)
    expected = train(plain, batch)
    assert largest_difference(got.gradients, expected.gradients) <= GRADIENT_TOLERANCE
    assert largest_difference(got.parameters, expected.parameters) <= DEFAULT_PARAMETER_TOLERANCE


def test_a_plain_head_plan_returns_the_whole_logits() -> None:
    model, batch = llama(), causal_batch()
    plan = plan_chunking_the_head(model, batch, output_head="plain")
    assert plan.head_chunks == 1 and plan.head_name == "lm_head"
    assert "lm_head (output head)" in str(plan)
    gradckpt.apply(model, plan)
    try:
        out = model(**batch)
        assert out.logits.shape == (BATCH, SEQ, VOCAB)
        assert planned_head_chunks(model.lm_head) == 1
    finally:
        gradckpt.disable(model)


def test_disable_brings_the_whole_logits_back() -> None:
    model, batch = gpt2(), causal_batch()
    gradckpt.apply(model, plan_chunking_the_head(model, batch))
    assert model(**batch).logits.shape == (BATCH, SEQ, 0)
    gradckpt.disable(model)
    assert gradckpt.get_plan(model) is None
    assert planned_head_chunks(model.lm_head) == 1
    assert "forward" not in vars(model)  # the wrapped forward is gone
    out = model(**batch)
    assert out.logits.shape == (BATCH, SEQ, VOCAB)
    out.loss.backward()


def test_a_plan_for_a_head_the_model_lacks_is_refused() -> None:
    model, batch = llama(), causal_batch()
    plan = dataclasses.replace(plan_chunking_the_head(model, batch), head_name="decoder.head")
    with pytest.raises(gradckpt.UsageError, match="made for another model.*'decoder.head'"):
        gradckpt.apply(model, plan)
    assert gradckpt.get_plan(model) is None
    assert model(**batch).logits.shape == (BATCH, SEQ, VOCAB)


def test_the_plan_keeps_its_head_through_json() -> None:
    model, batch = llama(), causal_batch()
    plan = plan_chunking_the_head(model, batch)
    again = gradckpt.Plan.from_json(plan.to_json())
    assert (again.head_name, again.head_chunks) == ("lm_head", plan.head_chunks)


# ---------------------------------------------------------------------------------------------
# What stays the model's own
# ---------------------------------------------------------------------------------------------


def planned_and_plain(build: Callable[[], nn.Module] = llama) -> tuple[nn.Module, nn.Module]:
    model = build()
    plain = copy.deepcopy(model)
    gradckpt.apply(model, plan_chunking_the_head(model, causal_batch()))
    return model, plain


def test_evaluation_generation_and_steps_without_labels_are_the_models_own() -> None:
    model, plain = planned_and_plain()
    batch = causal_batch()
    try:
        assert model(**batch).logits.shape == (BATCH, SEQ, 0)  # a training step is chunked
        without_labels = {k: v for k, v in batch.items() if k != "labels"}
        ours, theirs = model(**without_labels), plain(**without_labels)
        assert torch.equal(ours.logits, theirs.logits) and ours.loss is None
        ours.logits.sum().backward()  # a loop of its own on the logits trains as before
        with torch.no_grad():  # in training mode, without grad
            assert torch.equal(model(**batch).logits, plain(**batch).logits)
        model.eval()
        plain.eval()
        with torch.no_grad():
            ours, theirs = model(**batch), plain(**batch)
        assert torch.equal(ours.logits, theirs.logits) and torch.equal(ours.loss, theirs.loss)
        ours, theirs = model(**batch), plain(**batch)  # eval mode, grad enabled
        assert torch.equal(ours.logits, theirs.logits) and torch.equal(ours.loss, theirs.loss)
        prompt = batch["input_ids"][:, :8]
        generated = model.generate(prompt, max_new_tokens=3, do_sample=False)
        assert torch.equal(generated, plain.generate(prompt, max_new_tokens=3, do_sample=False))
        assert generated.shape == (BATCH, 11)
        model.train()
        assert model(**batch).logits.shape == (BATCH, SEQ, 0)  # chunked again
    finally:
        gradckpt.disable(model)


def test_num_items_in_batch_divides_the_summed_loss_as_the_models_own() -> None:
    """The Trainer's gradient accumulation passes ``num_items_in_batch`` to forward."""
    model, plain = planned_and_plain()
    batch = causal_batch()
    try:
        for num_items in (torch.tensor(100), 100):
            ours = model(**batch, num_items_in_batch=num_items)
            theirs = plain(**batch, num_items_in_batch=num_items)
            assert ours.logits.shape == (BATCH, SEQ, 0)
            torch.testing.assert_close(ours.loss, theirs.loss, atol=LOSS_TOLERANCE, rtol=0)
        mean = model(**batch).loss
        counted = int((batch["labels"][:, 1:] != -100).sum())  # after the shift
        torch.testing.assert_close(ours.loss, mean * counted / 100, atol=LOSS_TOLERANCE,
                                   rtol=1e-6)
    finally:
        gradckpt.disable(model)


def test_shift_labels_given_are_used_as_the_models_own() -> None:
    model, plain = planned_and_plain()
    batch = causal_batch()
    shifted = torch.nn.functional.pad(batch["labels"], (0, 1), value=-100)[:, 1:].clone()
    shifted[0, :4] = -100  # differs from the labels' own shift: it must be the one used
    try:
        ours = model(**batch, shift_labels=shifted)
        theirs = plain(**batch, shift_labels=shifted)
        assert ours.logits.shape == (BATCH, SEQ, 0)
        torch.testing.assert_close(ours.loss, theirs.loss, atol=LOSS_TOLERANCE, rtol=0)
        assert abs(ours.loss - plain(**batch).loss) > 1e-4
    finally:
        gradckpt.disable(model)


def test_return_dict_false_gives_the_loss_first_as_the_models_own() -> None:
    model, plain = planned_and_plain()
    batch = causal_batch()
    try:
        ours, theirs = model(**batch, return_dict=False), plain(**batch, return_dict=False)
        assert isinstance(ours, tuple) and isinstance(theirs, tuple)
        torch.testing.assert_close(ours[0], theirs[0], atol=LOSS_TOLERANCE, rtol=0)
        assert ours[1].shape == (BATCH, SEQ, 0)
    finally:
        gradckpt.disable(model)


# ---------------------------------------------------------------------------------------------
# Planning
# ---------------------------------------------------------------------------------------------

BIG_VOCAB = 8000  # its logits (64 x 8000 floats, 2 MB) and head weigh in the step


def big_vocabulary_llama() -> nn.Module:
    return llama(BIG_VOCAB)


def least_budget(measured: gradckpt.Profile) -> int:
    return min(minimum_peak_bytes(measured.with_chunked_head(head.chunks))
               for head in measured.chunked_heads)


def assert_fits_as_predicted(plan: gradckpt.Plan, measured_bytes: int) -> None:
    """The measured peak within the plan's budget + 3%, and within 3% of its prediction."""
    report = (f"budget {plan.budget_bytes}, predicted {plan.predicted_peak_bytes}, "
              f"measured {measured_bytes}")
    assert measured_bytes <= plan.budget_bytes * (1 + ALLOWANCE), report
    assert abs(measured_bytes - plan.predicted_peak_bytes) <= ALLOWANCE * measured_bytes, report


def test_enable_at_the_least_budget_chunks_the_head_and_fits_as_predicted() -> None:
    model, batch = big_vocabulary_llama(), causal_batch(BIG_VOCAB)
    measured = gradckpt.profile(model, batch, optimizer="adamw", repeats=1)
    assert [head.chunks for head in measured.chunked_heads] == sorted(
        head.chunks for head in measured.chunked_heads)
    assert all(head.name == "lm_head" and head.chunks >= 2 for head in measured.chunked_heads)
    assert min(head.peak_bytes for head in measured.chunked_heads) < measured.peak_bytes
    budget = least_budget(measured)
    assert budget < minimum_peak_bytes(measured)  # only a chunked head reaches it
    optimizer = torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE)
    plan = gradckpt.enable(model, batch, budget=budget, optimizer=optimizer)
    try:
        assert plan.head_chunks > 1, str(plan)
        out = model(**batch)  # step 1, outside the meter: the optimizer's state appears
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        with gradckpt.peak_memory(model, optimizer, *batch.values()) as peak:
            for _ in range(2):  # steps 2 and 3
                out = model(**batch)
                assert out.logits.shape == (BATCH, SEQ, 0)
                out.loss.backward()
                optimizer.step()
                optimizer.zero_grad()
        assert_fits_as_predicted(plan, peak.bytes)
    finally:
        gradckpt.disable(model)


@pytest.mark.slow
@pytest.mark.parametrize("build", [gpt2, qwen2, gemma2, lambda vocab: peft_llama(vocab=vocab),
                                   prophetnet],
                         ids=["gpt2-tied", "qwen2", "gemma2-softcapped", "peft-lora-llama",
                              "prophetnet-two-streams"])
@pytest.mark.parametrize("where", ["least", "between"])
def test_plans_with_a_chunked_head_fit_and_are_predicted_on_each_family(build, where) -> None:
    """At the least budget a chunked head reaches, and halfway from it to the least the plain
    head reaches: AdamW steps 2-3 measured within the budget + 3%, predicted within 3%."""
    model, batch = build(BIG_VOCAB), causal_batch(BIG_VOCAB)
    measured = gradckpt.profile(model, batch, optimizer="adamw", repeats=1)
    least = least_budget(measured)
    budget = least if where == "least" else (least + minimum_peak_bytes(measured)) // 2
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad],
                                  lr=LEARNING_RATE)
    plan = gradckpt.enable(model, batch, budget=budget, optimizer=optimizer)
    try:
        assert plan.head_chunks > 1, str(plan)
        model(**batch).loss.backward()  # step 1, outside the meter: the optimizer's state
        optimizer.step()
        optimizer.zero_grad()
        with gradckpt.peak_memory(model, optimizer, *batch.values()) as peak:
            for _ in range(2):
                out = model(**batch)
                out.loss.backward()
                optimizer.step()
                optimizer.zero_grad()
            del out
        assert_fits_as_predicted(plan, peak.bytes)
    finally:
        gradckpt.disable(model)


CHUNKED_STEP_FIELDS = ("name", "chunks", "head_bytes", "head_gradient_bytes",
                       "optimizer_step_bytes", "previous_output_bytes")
# Predicted as the plain step's are: off by what the plain step's prediction is off (PEFT's
# LoRA Llama: 49,152 B of the peak, 2,048 B outside the chain, estimated low), the head's
# chunks adding nothing to it.
OFF_AS_THE_PLAIN_STEP = ("other_peak_bytes", "peak_bytes")


@pytest.mark.parametrize("build", [llama, lambda vocab: peft_llama(vocab=vocab), prophetnet],
                         ids=["llama", "peft-lora-llama", "prophetnet"])
def test_estimate_predicts_each_chunked_step_to_the_byte(build) -> None:
    """``estimate`` runs the chunked steps on fake tensors: the same counts, and each step's
    bytes equal to the measured ones (what ``gradckpt plan --estimate`` plans with); on Llama
    every byte, with LoRA the chunked steps as far off as the plain step."""
    batch = causal_batch(BIG_VOCAB)
    measured = gradckpt.profile(build(BIG_VOCAB), batch, optimizer="adamw", repeats=1)
    model = build(BIG_VOCAB)
    predicted = gradckpt.estimate(model, batch, optimizer="adamw", device="this")

    def steps(profile: gradckpt.Profile) -> list[tuple]:
        return [tuple(getattr(head, field) for field in CHUNKED_STEP_FIELDS)
                for head in profile.chunked_heads]

    assert len(measured.chunked_heads) == 3
    assert steps(predicted) == steps(measured)
    for field in OFF_AS_THE_PLAIN_STEP:
        plain_off = getattr(measured, field) - getattr(predicted, field)
        assert [getattr(ours, field) + plain_off for ours in predicted.chunked_heads] == [
            getattr(theirs, field) for theirs in measured.chunked_heads], field
        if build is llama:
            assert plain_off == 0, field
    assert all(head.extra_seconds > 0 for head in predicted.chunked_heads)
    plan = gradckpt.solve(predicted, least_budget(measured))  # the least: only chunks fit
    assert plan.head_chunks > 1 and plan.predicted_peak_bytes <= least_budget(measured)
    assert gradckpt.get_plan(model) is None  # estimate leaves the model as it was


def test_a_chunked_plans_breakdown_shows_one_chunks_logits_apart() -> None:
    """The plan's memory table splits the chunked head's part: one chunk's logits, loss and
    their gradients (read from the measured counts' 1/k line), and the rest, which chunking
    does not divide; a plain-head plan keeps the one head line."""
    model, batch = big_vocabulary_llama(), causal_batch(BIG_VOCAB)
    measured = gradckpt.profile(model, batch, repeats=1)
    fewest, middle, most = measured.chunked_heads
    # The head's bytes fall as a + b/k: the line through the fewest and the most chunks
    # meets the middle count's measured bytes.
    per_unit = (fewest.head_bytes - most.head_bytes) / (1 / fewest.chunks - 1 / most.chunks)
    on_line = most.head_bytes + per_unit * (1 / middle.chunks - 1 / most.chunks)
    assert on_line == pytest.approx(middle.head_bytes, rel=0.01)

    plan = gradckpt.solve(measured, least_budget(measured))
    parts = dict(memory_parts(model, measured, plan).parts)
    head = measured.chunked_head(plan.head_chunks)
    assert OUTPUT_HEAD not in parts
    assert parts[HEAD_CHUNK] == one_head_chunk_bytes(measured, plan.head_chunks)
    assert parts[HEAD_CHUNK] + parts.get(HEAD_UNDIVIDED, 0) == (
        head.head_bytes - head.head_gradient_bytes)
    # One chunk's float32 logits, made at least once: the part is at least their size.
    one_chunks_logits = BATCH * SEQ * BIG_VOCAB * 4 / plan.head_chunks
    assert one_chunks_logits <= parts[HEAD_CHUNK] <= 4 * one_chunks_logits
    plain = gradckpt.solve(measured, minimum_peak_bytes(measured), output_head="plain")
    plain_parts = dict(memory_parts(model, measured, plain).parts)
    assert OUTPUT_HEAD in plain_parts and HEAD_CHUNK not in plain_parts


def test_output_head_plain_never_chunks_even_where_only_chunks_fit() -> None:
    model, batch = big_vocabulary_llama(), causal_batch(BIG_VOCAB)
    measured = gradckpt.profile(model, batch, optimizer="adamw", repeats=1)
    plain_least, chunked_least = minimum_peak_bytes(measured), least_budget(measured)
    between = (plain_least + chunked_least) // 2  # only a chunked head fits
    assert gradckpt.solve(measured, between, "optimal").head_chunks > 1  # "auto"
    with pytest.raises(gradckpt.BudgetError) as error:
        gradckpt.enable(model, batch, budget=between, optimizer="adamw", output_head="plain")
    assert error.value.minimum_bytes == plain_least
    assert gradckpt.get_plan(model) is None
    plan = gradckpt.enable(model, batch, budget=plain_least, optimizer="adamw",
                           output_head="plain")
    try:
        assert plan.head_chunks == 1 and plan.head_name == "lm_head"
        assert model(**batch).logits.shape == (BATCH, SEQ, BIG_VOCAB)
    finally:
        gradckpt.disable(model)


def test_an_unknown_output_head_is_refused_and_leaves_the_model_unplanned() -> None:
    model, batch = llama(), causal_batch()
    valid = "output_head 'bogus'; valid: 'auto', 'plain', 'chunked'"
    with pytest.raises(gradckpt.UsageError, match=valid):
        gradckpt.enable(model, batch, budget="100%", optimizer="adamw", output_head="bogus")
    assert gradckpt.get_plan(model) is None
    measured = gradckpt.profile(model, batch, repeats=1)
    with pytest.raises(gradckpt.UsageError, match="output_head 'bogus'"):
        gradckpt.solve(measured, None, "none", output_head="bogus")
    from gradckpt.integrations.hf_trainer import GradckptCallback

    with pytest.raises(gradckpt.UsageError, match=r"GradckptCallback\(.*output_head='bogus'"):
        GradckptCallback("80%", output_head="bogus")


def test_a_model_that_is_not_a_causal_language_model_has_no_chunked_head() -> None:
    torch.manual_seed(0)
    bert = transformers.BertForMaskedLM(transformers.BertConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=64)).train()
    batch = causal_batch()
    mlp = gradckpt.toy_models.mlp_chain(2, 32, dropout=0.0)
    for model, sample in ((bert, batch), (mlp, torch.randn(4, 32))):
        measured = gradckpt.profile(model, sample, repeats=1)
        assert measured.chunked_heads == []
        assert "linear_cross_entropy" in measured.notes["chunked_head"]
        with pytest.raises(gradckpt.UsageError, match="output_head='chunked'.*no chunked head"):
            gradckpt.solve(measured, None, "none", output_head="chunked")
        plan = gradckpt.solve(measured, None, "none")
        assert plan.head_name is None and plan.head_chunks == 1


class ScaledLogitsLlama(transformers.LlamaForCausalLM):
    """Halves its logits before the loss: a change the chunked loss does not repeat. A user's
    subclass of a Transformers causal language model is taken for one."""

    def forward(self, input_ids=None, attention_mask=None, labels=None, **kwargs):
        out = super().forward(input_ids=input_ids, attention_mask=attention_mask, **kwargs)
        out.logits = out.logits * 0.5
        if labels is not None:
            out.loss = self.loss_function(out.logits, labels, self.config.vocab_size)
        return out


def test_a_model_whose_logits_are_scaled_after_the_head_gets_no_chunked_head() -> None:
    torch.manual_seed(0)
    model = ScaledLogitsLlama(transformers.LlamaConfig(vocab_size=VOCAB, **DECODER)).train()
    batch = causal_batch()
    measured = gradckpt.profile(model, batch, optimizer="adamw", repeats=1)
    assert measured.chunked_heads == []
    assert "is not the model's own" in measured.notes["chunked_head"]
    with pytest.raises(gradckpt.UsageError, match="is not the model's own"):
        gradckpt.solve(measured, None, "none", output_head="chunked")
    plan = gradckpt.solve(measured, None, "none")
    assert plan.head_chunks == 1
    gradckpt.apply(model, plan)
    try:
        out = model(**batch)
        assert out.logits.shape == (BATCH, SEQ, VOCAB)
    finally:
        gradckpt.disable(model)


def test_prophetnet_smoothing_its_labels_keeps_its_own_loss_and_trains_bit_for_bit() -> None:
    # config.eps > 0: ProphetNet's loss smooths its labels, which linear_cross_entropy does
    # not: the model is not wrapped, no chunked head is offered, and a plan trains exactly as
    # the plain model (the loss whole, the model's own).
    model, batch = prophetnet(eps=0.1), causal_batch()
    plain = copy.deepcopy(model)
    measured = gradckpt.profile(model, batch, optimizer="adamw", repeats=1)
    assert measured.chunked_heads == []
    with pytest.raises(gradckpt.UsageError, match="output_head='chunked'.*no chunked head"):
        gradckpt.solve(measured, None, "none", output_head="chunked")
    plan = gradckpt.solve(measured, None, "every-layer")
    assert plan.head_chunks == 1 and plan.segments
    got, expected = train_planned_and_plain(model, plain, batch, plan)
    assert got.logits_shape == expected.logits_shape == (BATCH, SEQ, VOCAB)
    assert [loss.item() for loss in got.losses] == [loss.item() for loss in expected.losses]
    assert largest_difference(got.gradients, expected.gradients) == 0
    assert largest_difference(got.parameters, expected.parameters) == 0
