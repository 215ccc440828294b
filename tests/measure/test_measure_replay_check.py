"""What a plan cannot replay is said (``gradckpt.measure.replay_check``): ``profile`` and
``enable`` warn when the model's forward does not repeat itself from the same torch RNG state
(randomness drawn outside torch), or computes otherwise with the changes gradckpt makes while it
works (the ecosystem hooks: a Hugging Face cache off); models that replay, Hugging Face ones
with their cache and dropout, LoRA included, get no warning, and nothing is left changed."""

from __future__ import annotations

import random
import warnings

import pytest
import torch
from hf_models import causal_sample, tiny_llama, with_lora
from torch import nn

import gradckpt
from gradckpt.ecosystem_hooks import register_ecosystem_hook, unregister_ecosystem_hook
from gradckpt.errors import GradckptWarning, forget_warnings

pytestmark = pytest.mark.usefixtures("one_thread")


class _Block(nn.Module):
    def __init__(self, noise: bool = False) -> None:
        super().__init__()
        self.linear, self.noise = nn.Linear(64, 64), noise
        self.flag = 0.0  # set by the test's ecosystem hook

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = 1.0 + (random.random() if self.noise else 0.0) + self.flag
        return torch.relu(self.linear(x)) * scale


def _chain(noise_in: int | None = None) -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(*(_Block(noise=index == noise_in) for index in range(4)),
                         nn.Dropout(0.1))


def _replay_warnings(run) -> list[str]:
    forget_warnings()  # each finding is said once per process
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run()
    forget_warnings()
    return [str(w.message) for w in caught
            if issubclass(w.category, GradckptWarning) and "forward pass" in str(w.message)]


def test_randomness_drawn_outside_torch_is_said_by_profile_and_enable() -> None:
    model, sample = _chain(noise_in=2), torch.randn(256, 64)
    rng = torch.get_rng_state()
    said = _replay_warnings(lambda: gradckpt.profile(model, sample, repeats=1))
    assert len(said) == 1 and said[0].startswith(
        "Sequential's forward pass does not repeat itself: run twice on the sample from the "
        "same torch RNG state and buffers, its output's 'output' (shape [256, 64]) differed")
    assert "Draw the randomness from torch" in said[0]
    assert torch.equal(torch.get_rng_state(), rng)  # the checks draw nothing
    said = _replay_warnings(lambda: gradckpt.enable(model, sample, budget="90%",
                                                    optimizer="sgd"))
    assert len(said) == 1 and "does not repeat itself" in said[0]
    gradckpt.disable(model)


def test_a_forward_changed_by_an_ecosystem_hook_is_said() -> None:
    def hook(model: nn.Module, occasion) -> object:
        blocks = [m for m in model.modules() if isinstance(m, _Block)]
        if not blocks:
            return None
        for block in blocks:
            block.flag = 0.5

        def undo() -> None:
            for block in blocks:
                block.flag = 0.0

        return undo

    model, sample = _chain(), torch.randn(256, 64)
    register_ecosystem_hook(hook)
    try:
        said = _replay_warnings(lambda: gradckpt.profile(model, sample, repeats=1))
    finally:
        unregister_ecosystem_hook(hook)
    assert len(said) == 1 and said[0].startswith(
        "Sequential's forward pass computes otherwise with the changes gradckpt makes while "
        "it measures and while a plan is applied")
    assert all(block.flag == 0.0 for block in model[:4])


@pytest.mark.parametrize("lora", [False, True], ids=["llama", "lora"])
def test_hugging_face_models_with_their_cache_and_dropout_replay(lora: bool) -> None:
    pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = tiny_llama(3)  # attention dropout 0.1: torch's generator, which is replayed
    model = with_lora(model) if lora else model
    assert model.config.use_cache  # the hook turns it off: the outputs must agree
    sample = causal_sample()
    assert _replay_warnings(lambda: gradckpt.profile(model, sample, repeats=1)) == []
    assert model.config.use_cache


def test_a_model_that_cannot_run_without_gradients_is_not_checked() -> None:
    class NeedsGradients(nn.Sequential):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            if not torch.is_grad_enabled():
                raise RuntimeError("this model only trains")
            return super().forward(x)

    torch.manual_seed(0)
    model = NeedsGradients(nn.Linear(8, 8), nn.Linear(8, 8))
    said = _replay_warnings(lambda: gradckpt.profile(model, torch.randn(2, 8), repeats=1))
    assert said == []
