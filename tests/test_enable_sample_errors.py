"""A sample the model cannot run (issue 27, item 3): ``profile``, ``estimate`` and ``enable`` say
that gradckpt ran the model's training step on the sample, the model's own error chained; the
model is left as it was, and the next call in the process plans and trains it, with the plain
model's gradients."""

from __future__ import annotations

import pytest
import torch
from hf_models import tiny_llama, with_lora

import gradckpt

pytestmark = pytest.mark.usefixtures("one_thread")

VOCAB, BATCH, SEQ = 64, 2, 48


def _llama(lora: bool) -> torch.nn.Module:
    model = tiny_llama(3, vocab_size=VOCAB)
    return with_lora(model) if lora else model


def _batch(labels_length: int = SEQ) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    return {"input_ids": torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
            "labels": torch.randint(0, VOCAB, (BATCH, labels_length), generator=generator)}


def _state(model: torch.nn.Module) -> dict:
    return {"values": {k: v.clone() for k, v in model.state_dict().items()},
            "trains": {n: p.requires_grad for n, p in model.named_parameters()},
            "hooks": sum(len(m._forward_hooks) + len(m._forward_pre_hooks)
                         for m in model.modules()),
            "forwards": sum("forward" in m.__dict__ for m in model.modules())}


def _same(before: dict, after: dict) -> bool:
    return (before["trains"] == after["trains"] and before["hooks"] == after["hooks"]
            and before["forwards"] == after["forwards"]
            and all(torch.equal(v, after["values"][k]) for k, v in before["values"].items()))


def _train(model: torch.nn.Module, steps: int = 2) -> dict[str, torch.Tensor]:
    torch.manual_seed(2)  # the same dropout for both models
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    for _ in range(steps):
        out = model(**_batch())
        out.loss.backward()
        gradients = {n: p.grad.clone() for n, p in model.named_parameters()
                     if p.grad is not None}
        optimizer.step()
        optimizer.zero_grad()
    return gradients


CALLS = {
    "profile": lambda model, sample: gradckpt.profile(model, sample, repeats=1),
    "estimate": lambda model, sample: gradckpt.estimate(model, sample, device="h100"),
    "enable": lambda model, sample: gradckpt.enable(model, sample, budget="90%"),
}


@pytest.mark.parametrize("lora", [False, True], ids=["llama", "lora"])
@pytest.mark.parametrize("call", list(CALLS))
def test_a_sample_the_model_cannot_run_says_so_and_leaves_nothing_behind(call, lora) -> None:
    model = _llama(lora)
    before = _state(model)
    with pytest.raises(gradckpt.UsageError) as raised:
        CALLS[call](model, _batch(labels_length=SEQ + 1))  # labels one token too long
    message = str(raised.value)
    assert message.startswith(f"gradckpt ran one training step of {type(model).__name__} on "
                              "the sample given")
    assert "the model raised ValueError: Expected input batch_size" in message
    assert "Check the sample" in message
    assert isinstance(raised.value.__cause__, ValueError)  # the model's own, chained
    assert ("on fake tensors" in message) == (call == "estimate")
    assert _same(before, _state(model))
    # The process is not poisoned: the same model plans and trains on a good sample, with the
    # gradients of the same model trained plain.
    plain = _llama(lora)
    gradckpt.enable(model, _batch(), budget="90%")
    assert all(torch.equal(gradient, expected)
               for gradient, expected in zip(_train(model).values(), _train(plain).values(),
                                             strict=True))


def test_gradckpts_own_errors_are_not_said_to_be_the_samples() -> None:
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    with pytest.raises(gradckpt.UsageError, match="^the loss must be a scalar tensor"):
        gradckpt.profile(model, torch.randn(2, 4), repeats=1, loss_fn=lambda output: output)
