"""The optimizer's step measured on a replica: with parameters of one kind many times over
(LoRA's adapters, one set per layer), the replica steps a fraction of them and scales. That
must give exactly what the whole replica gives, on the loop's path and on foreach's."""

from __future__ import annotations

import pytest
import torch

from gradckpt.measure import optimizer_step
from gradckpt.measure.optimizer_step import measure_optimizer_step

pytestmark = pytest.mark.usefixtures("one_thread")


def _lora_llama(layers: int = 4) -> torch.nn.Module:
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))


def _whole_replica(monkeypatch: pytest.MonkeyPatch, *args):
    with monkeypatch.context() as patched:
        patched.setattr(optimizer_step, "_fewer_alike", lambda groups, cls: (groups, 1))
        return measure_optimizer_step(*args)


# The loop's path (CPU), and foreach's (PyTorch's default on CUDA: no GPU needed, fake tensors).
PATHS = pytest.mark.parametrize("device", ["cpu", "cuda"], ids=["loop", "foreach"])


@PATHS
@pytest.mark.parametrize("name", ["adamw", "adam", "sgd", "radam", "adagrad"])
def test_a_fraction_of_alike_parameters_scaled_is_the_whole_replica(
        monkeypatch: pytest.MonkeyPatch, name: str, device: str) -> None:
    model = _lora_llama()
    cut = []
    original = optimizer_step._fewer_alike

    def spy(groups, cls):
        fewer, times = original(groups, cls)
        cut.append(times)
        return fewer, times

    monkeypatch.setattr(optimizer_step, "_fewer_alike", spy)
    fewer = measure_optimizer_step(name, model, device)
    assert cut == [4]  # 4 layers, each with the same adapters: a quarter stepped
    assert fewer == _whole_replica(monkeypatch, name, model, device)


@PATHS
def test_groups_of_the_users_optimizer_are_cut_alike(
        monkeypatch: pytest.MonkeyPatch, device: str) -> None:
    model = _lora_llama()
    trainable = [p for p in model.parameters() if p.requires_grad]
    # Decay on the A matrices only, and foreach forced on where PyTorch would loop.
    groups = [{"params": [p for n, p in model.named_parameters() if "lora_A" in n]},
              {"params": [p for n, p in model.named_parameters() if "lora_B" in n],
               "weight_decay": 0.0}]
    assert sum(len(g["params"]) for g in groups) == len(trainable)
    for optimizer in (torch.optim.AdamW(groups, foreach=True), torch.optim.AdamW(groups)):
        assert measure_optimizer_step(optimizer, model, device) == _whole_replica(
            monkeypatch, optimizer, model, device)


def test_parameters_of_no_common_count_are_stepped_whole(monkeypatch) -> None:
    layer = torch.nn.Linear(100, 100)  # a weight and a bias: one of each kind
    assert measure_optimizer_step("adamw", layer, "cuda") == _whole_replica(
        monkeypatch, "adamw", layer, "cuda")
    assert measure_optimizer_step("adamw", layer, "cuda").temporary_bytes == 40400
