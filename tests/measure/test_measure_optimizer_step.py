"""The optimizer's step measured on a replica: on the ``foreach`` path each kind of parameter is
stepped alone and the whole summed (a handful of kinds where Llama-3-8B has hundreds of
parameters). That must give exactly what the whole replica gives."""

from __future__ import annotations

import pytest
import torch

from gradckpt.errors import UsageError
from gradckpt.measure import optimizer_step
from gradckpt.measure.optimizer_step import measure_optimizer_step
from gradckpt.measure.training_state import optimizer_state_bytes

pytestmark = pytest.mark.usefixtures("one_thread")

# PyTorch's default path on CUDA (fake tensors: no GPU needed), and the loop over parameters.
FOREACH, LOOP = "cuda", "cpu"


def _llama(layers: int = 3, lora: bool = False, dtype: torch.dtype = torch.float32):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(config).to(dtype)
    if not lora:
        return model
    peft = pytest.importorskip("peft")
    return peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules="all-linear"))


def _whole_replica(monkeypatch: pytest.MonkeyPatch, *args):
    with monkeypatch.context() as patched:
        patched.setattr(optimizer_step, "_kind_by_kind", lambda cls, groups: None)
        return measure_optimizer_step(*args)


def _stepped_by_kind(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """A list that says, for each measurement after this, whether it went kind by kind."""
    used = []
    original = optimizer_step._kind_by_kind

    def spy(cls, groups):
        found = original(cls, groups)
        used.append(found is not None)
        return found

    monkeypatch.setattr(optimizer_step, "_kind_by_kind", spy)
    return used


@pytest.mark.parametrize("name", ["adamw", "adam", "sgd", "radam", "adagrad", "nadam",
                                  "rmsprop"])
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_kind_by_kind_is_the_whole_replica(monkeypatch, name: str, lora: bool) -> None:
    model = _llama(lora=lora, dtype=torch.bfloat16)
    used = _stepped_by_kind(monkeypatch)
    by_kind = measure_optimizer_step(name, model, FOREACH)
    assert used == [True]
    assert by_kind == _whole_replica(monkeypatch, name, model, FOREACH)


def test_the_users_groups_are_stepped_kind_by_kind_too(monkeypatch) -> None:
    model = _llama(lora=True)
    decay = [p for n, p in model.named_parameters() if "lora_A" in n]
    no_decay = [p for n, p in model.named_parameters() if "lora_B" in n]
    used = _stepped_by_kind(monkeypatch)
    for optimizer in (torch.optim.AdamW([{"params": decay},
                                         {"params": no_decay, "weight_decay": 0.0}]),
                      torch.optim.AdamW(decay + no_decay, foreach=True, amsgrad=True)):
        for device in (FOREACH, LOOP):
            assert measure_optimizer_step(optimizer, model, device) == _whole_replica(
                monkeypatch, optimizer, model, device)
    # foreach=True is kept on the CPU too; the loop (PyTorch's choice there) is stepped whole.
    assert used == [True, False, True, True]


def test_mixed_dtypes_and_the_loop_are_stepped_whole(monkeypatch) -> None:
    model = _llama()
    model.model.norm.to(torch.bfloat16)  # two dtypes in one group: foreach splits the list
    used = _stepped_by_kind(monkeypatch)
    assert measure_optimizer_step("adamw", model, FOREACH) == _whole_replica(
        monkeypatch, "adamw", model, FOREACH)
    measure_optimizer_step("adamw", model, LOOP)
    assert used == [False, False]


def test_a_linear_layers_step_is_its_weights_and_its_bias() -> None:
    layer = torch.nn.Linear(100, 100)  # two kinds, one of each
    assert measure_optimizer_step("adamw", layer, FOREACH).temporary_bytes == 40400
    assert measure_optimizer_step("adamw", layer, LOOP).temporary_bytes == 80000


@pytest.mark.parametrize("name", ["rmsprop", "adagrad", "adamw", "sgd"])
def test_an_optimizer_by_name_keeps_the_state_its_class_keeps(name: str) -> None:
    """The state counted for an optimizer given by name is what that optimizer, with its
    defaults, holds after a step (its ``step`` counters, scalars, aside)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 4))
    model[0].requires_grad_(False)  # a frozen part keeps no state
    cls, groups, _ = optimizer_step._what_to_replicate(name, model)
    optimizer = cls(groups)
    model(torch.randn(2, 8)).sum().backward()
    optimizer.step()
    held = sum(value.numel() * value.element_size() for state in optimizer.state.values()
               for key, value in state.items() if key != "step")
    assert optimizer_state_bytes(name, model) == held


@pytest.mark.parametrize(("name", "close"), [("adamww", "adamw"), ("RMSProp", None),
                                             ("adam8bit", "adam-8bit")])
def test_a_misspelt_optimizer_is_told_the_name_it_is_close_to(name: str, close: str) -> None:
    if close is None:  # names are not case-sensitive
        assert optimizer_step.check_optimizer(name) == name
        return
    with pytest.raises(UsageError, match=f"; did you mean '{close}'"):
        optimizer_step.check_optimizer(name)
    with pytest.raises(UsageError, match=f"; did you mean '{close}'"):
        optimizer_state_bytes(name, torch.nn.Linear(2, 2))


class _WithUnusedPart(torch.nn.Module):
    """A layer that trains and one its forward never calls (a decoder-only BART's
    cross-attention, given no encoder output)."""

    def __init__(self) -> None:
        super().__init__()
        self.used = torch.nn.Linear(16, 16)
        self.unused = torch.nn.Linear(16, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)


@pytest.mark.parametrize("optimizer", ["adamw", "users"])
def test_a_parameter_the_step_gives_no_gradient_gets_no_state(optimizer: str) -> None:
    """AdamW makes no state for a parameter whose gradient stays None: profile counts the
    state of those the step trains, what the real optimizer holds from step 2 on."""
    import gradckpt

    torch.manual_seed(0)
    model = torch.nn.Sequential(_WithUnusedPart(), _WithUnusedPart())
    sample = torch.randn(4, 16)
    real = torch.optim.AdamW(model.parameters())
    measured = gradckpt.profile(model, sample, optimizer=real if optimizer == "users" else
                                optimizer, repeats=1)
    for _ in range(2):
        model(sample).sum().backward()
        real.step()
        real.zero_grad(set_to_none=True)
    held = sum(value.numel() * value.element_size() for state in real.state.values()
               for value in state.values())
    assert len(real.state) == 4  # the used layers' weights and biases
    assert measured.optimizer_state_bytes == held
