"""Tiny Hugging Face models for the tests, at the tests' sizes (vocabulary 128, 64 positions):
seeded builds of the package's catalogue, ``gradckpt.integrations.hf_families``."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gradckpt.integrations import hf_families


def tiny_llama(layers: int, vocab_size: int = 128) -> nn.Module:
    """A seeded LlamaForCausalLM in training mode, attention dropout on (RNG replay matters)."""
    torch.manual_seed(0)
    return hf_families.hf_model("llama", num_hidden_layers=layers, vocab_size=vocab_size,
                                max_position_embeddings=64).train()


def with_lora(model: nn.Module, rank: int = 4) -> nn.Module:
    """``model`` frozen under PEFT LoRA adapters of ``rank`` on every linear layer (skips the
    test where PEFT is not installed)."""
    import pytest

    peft = pytest.importorskip("peft")
    return peft.get_peft_model(model, peft.LoraConfig(r=rank, target_modules="all-linear"))


def tiny_clip(vocab_size: int = 64) -> nn.Module:
    """A seeded CLIPModel: two towers, text created first, vision run first (2 layers each)."""
    torch.manual_seed(0)
    return hf_families.clip(text_vocab_size=vocab_size)


def tiny_t5(layers: int = 2, vocab_size: int = 128) -> nn.Module:
    """A seeded T5ForConditionalGeneration, ``layers`` encoder and decoder blocks, dropout off
    (its memory is what the tests look at)."""
    torch.manual_seed(0)
    return hf_families.hf_model("t5", vocab_size=vocab_size, num_layers=layers,
                                num_decoder_layers=layers, dropout_rate=0.0).train()


def tiny_bart(
    layers: int = 2, vocab_size: int = 128, decoder_layers: int | None = None
) -> nn.Module:
    """A seeded BartForConditionalGeneration, ``layers`` encoder layers and as many decoder
    layers unless ``decoder_layers`` says otherwise."""
    torch.manual_seed(0)
    return hf_families.hf_model(
        "bart", vocab_size=vocab_size, encoder_layers=layers,
        decoder_layers=layers if decoder_layers is None else decoder_layers,
    ).train()


def seq2seq_sample(vocab_size: int = 128, source: int = 24, target: int = 16) -> dict:
    """Four source sequences and their labels (the decoder's inputs are derived from them)."""
    generator = torch.Generator().manual_seed(0)
    return hf_families.seq2seq_batch(4, source, target, vocab_size, generator=generator)


def causal_sample(vocab_size: int = 128, batch: int = 2, seq: int = 32) -> dict:
    """A causal language model's batch as fine-tuning scripts pass it: ids and labels."""
    return hf_families.causal_batch(batch, seq, vocab_size, first_id=0, seed=1)


def tiny_eager(class_name: str, config_name: str, **config) -> nn.Module:
    """A seeded Transformers ``class_name`` in training mode, built from ``config_name`` with
    the fields ``config``, eager attention (its memory is what the tests look at)."""
    import pytest

    transformers = pytest.importorskip("transformers")
    settings = getattr(transformers, config_name)(**config)
    settings._attn_implementation = "eager"
    torch.manual_seed(0)
    return getattr(transformers, class_name)(settings).train()


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    """AdamW over the parameters that train (a LoRA model's adapters)."""
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)


def trained_as_a_loop(
    model: nn.Module, optimizer: torch.optim.Optimizer, batch_of: Any, steps: int
) -> tuple[int, dict[str, torch.Tensor], dict[str, torch.Tensor | None]]:
    """``steps`` steps of ``out = model(**batch_of(index)); out.loss.backward();
    optimizer.step()``, each batch made as a data loader makes it: the peak of steps 2+ (step 1
    makes the optimizer's state; ``MemoryMeter``), the parameters after, and the gradients of
    one more forward and backward from them."""
    from gradckpt.measure import MemoryMeter

    out = None  # the loop's output, alive until the next forward returns

    def step(index: int) -> None:
        nonlocal out
        batch = batch_of(index)
        torch.manual_seed(index)  # the same dropout masks in both runs
        out = model(**batch)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    step(0)
    with MemoryMeter("cpu", model, optimizer) as meter:
        for index in range(1, steps):
            step(index)
    out = None
    parameters = {name: p.detach().clone() for name, p in model.named_parameters()}
    torch.manual_seed(steps)
    model(**batch_of(steps)).loss.backward()
    gradients = {name: None if p.grad is None else p.grad.clone()
                 for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return meter.peak(), parameters, gradients


def assert_tensors_equal(got: dict, expected: dict, what: str) -> None:
    """Bit for bit (``torch.equal``), name by name; ``None`` (no gradient) where expected."""
    assert got.keys() == expected.keys(), what
    for name, tensor in expected.items():
        if tensor is None:
            assert got[name] is None, f"{what}: {name}"
        else:
            assert torch.equal(got[name], tensor), f"{what}: {name}"


def assert_trains_as_plain(plan: Any, plain: tuple, planned: tuple, steps: int,
                           over_budget: float = 1.03) -> None:
    """``plain`` and ``planned``: ``trained_as_a_loop``'s results without and with ``plan``.
    Parameters after and gradients from them bit for bit equal, the planned peak within the
    plan's budget times ``over_budget`` and under the plain one."""
    plain_peak, plain_parameters, plain_gradients = plain
    peak, parameters, gradients = planned
    assert_tensors_equal(parameters, plain_parameters, f"parameters after {steps} steps")
    assert_tensors_equal(gradients, plain_gradients, "gradients from them")
    print(f"plain {plain_peak}, budget {plan.budget_bytes}, predicted "
          f"{plan.predicted_peak_bytes}, measured {peak} bytes")
    assert peak <= plan.budget_bytes * over_budget, (peak, plan.budget_bytes)
    assert peak < plain_peak
