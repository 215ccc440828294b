"""Blocks that run more than once in one forward pass: a recurrent model looping over its layers
(``gradckpt.measure.recording``).

A run without gradients (under ``torch.no_grad()``) saves nothing for backward, and a plan does
nothing there: the chain is each block's run with gradients. A model whose blocks run once with
them is planned and predicted to the byte (HRM with its low-level cycles under ``no_grad``: the
recording took the first run, without gradients, and predicted 2.3% over; 1.5% with LoRA).

A block that runs more than once with gradients gets every run checkpointed alike, which the
cost model, walking each block once, cannot predict (HRM's default cycles: 73% over the
measured peak). ``profile``, ``estimate`` and ``enable`` refuse it, naming the blocks and their
runs, with the model left as it was.
"""

from __future__ import annotations

import contextlib

import pytest
import torch
from hf_models import causal_sample, tiny_eager, with_lora
from torch import nn

import gradckpt
from gradckpt.side_by_side import compare_plans

pytestmark = pytest.mark.usefixtures("one_thread")

WIDTH, VOCAB, SEQ = 32, 128, 64


class Residual(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class Looped(nn.Module):
    """Its layers run ``cycles`` times over a state the input is added to at each cycle, the
    first ``without_gradients`` cycles under ``torch.no_grad()`` (as HRM's are)."""

    def __init__(self, cycles: int, without_gradients: int, layers: int = 3) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.cycles, self.without_gradients = cycles, without_gradients
        self.embed = nn.Linear(WIDTH, WIDTH)
        self.layers = nn.ModuleList(Residual(WIDTH) for _ in range(layers))
        self.head = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x)
        state = torch.zeros_like(hidden)
        for cycle in range(self.cycles):
            gradients = cycle >= self.without_gradients
            with contextlib.nullcontext() if gradients else torch.no_grad():
                state = state + hidden
                for layer in self.layers:
                    state = layer(state)
        return self.head(state)


def toy_sample() -> torch.Tensor:
    return torch.randn(4, 64, WIDTH, generator=torch.Generator().manual_seed(0))


def hrm(cycles: int, low_cycles: int, with_gradients: list[int]) -> nn.Module:
    """A seeded tiny HrmTextForCausalLM: ``cycles`` high-level cycles of ``low_cycles``
    low-level ones, of which the last ``with_gradients[h]`` of cycle h run with gradients."""
    return tiny_eager(
        "HrmTextForCausalLM", "HrmTextConfig", vocab_size=VOCAB, hidden_size=64,
        intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, H_cycles=cycles, L_cycles=low_cycles,
        L_bp_cycles=with_gradients, max_position_embeddings=SEQ)


def assert_predicted_to_the_byte(model: nn.Module, sample, strategy: str) -> None:
    """The plan ``strategy`` makes (optimal: at 60% of the plain peak, or the least budget
    that is feasible) predicts the measured peak of the loop's second step with AdamW to the
    byte, and trains bit for bit as the plain model (within float rounding where it computes
    the loss in chunks, which sums in another order)."""
    optimizer = torch.optim.AdamW(p for p in model.parameters() if p.requires_grad)
    measured = gradckpt.profile(model, sample, optimizer=optimizer, repeats=1)
    budget = int(0.6 * measured.peak_bytes) if strategy == "optimal" else None
    try:
        plan = gradckpt.solve(measured, budget, strategy=strategy)
    except gradckpt.BudgetError as error:
        plan = gradckpt.solve(measured, error.minimum_bytes)
    assert plan.segments
    comparison = compare_plans(model, sample, {"plain": None, "plan": plan},
                               optimizer=optimizer, rounds=0)
    assert plan.predicted_peak_bytes == comparison.peak_bytes["plan"]
    if plan.head_chunks == 1:
        assert comparison.identical("plan"), comparison.gradients.differing["plan"]
    else:
        assert comparison.largest_difference("plan") < 1e-5


def assert_refused(model: nn.Module, sample, *runs: str) -> None:
    """``profile``, ``enable`` and ``estimate`` refuse the model, naming the runs; the model
    is left as it was: the same weights, no plan, no hooks."""
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    for attempt in (lambda: gradckpt.profile(model, sample, repeats=1),
                    lambda: gradckpt.enable(model, sample, budget="60%", optimizer="adamw"),
                    lambda: gradckpt.estimate(model, sample, device="this")):
        with pytest.raises(gradckpt.UsageError, match="ran more than once with gradients") as error:
            attempt()
        for run in runs:
            assert run in str(error.value)
        assert "gradient_checkpointing_enable" in str(error.value)
    assert gradckpt.get_plan(model) is None
    assert all(not module._forward_pre_hooks and not module._forward_hooks
               for module in model.modules())
    after = model.state_dict()
    assert all(torch.equal(after[name], tensor) for name, tensor in before.items())
    assert all(parameter.grad is None for parameter in model.parameters())


def test_runs_without_gradients_are_no_part_of_the_chain() -> None:
    model = Looped(cycles=3, without_gradients=2)
    recorded = gradckpt.profile(model, toy_sample(), repeats=1)
    assert [block.name for block in recorded.blocks] == ["layers.0", "layers.1", "layers.2"]
    # The run recorded is the one with gradients: its input (the state plus the input) needs
    # one, and the chain does not break between its blocks.
    assert recorded.chain_breaks == [] and not recorded.chain_input_fixed
    assert all(block.saved_bytes > 0 for block in recorded.blocks)


@pytest.mark.parametrize("strategy", ["every-layer", "optimal"])
def test_blocks_run_once_with_gradients_are_predicted_to_the_byte(strategy: str) -> None:
    assert_predicted_to_the_byte(Looped(cycles=3, without_gradients=2), toy_sample(), strategy)


def test_a_block_run_twice_with_gradients_is_refused() -> None:
    assert_refused(Looped(cycles=2, without_gradients=0), toy_sample(),
                   "layers.0 2 times", "layers.2 2 times")


def test_runs_without_gradients_are_counted_in_the_refusal() -> None:
    assert_refused(Looped(cycles=4, without_gradients=2), toy_sample(),
                   "layers.1 2 times (and 2 more without gradients)")


@pytest.mark.slow
@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_hrm_with_its_low_cycles_without_gradients_is_predicted_to_the_byte(lora: bool) -> None:
    model = hrm(1, 3, [1])  # each layer: once with gradients; L's twice more without
    assert_predicted_to_the_byte(with_lora(model) if lora else model,
                                 causal_sample(VOCAB, seq=SEQ), "optimal")


@pytest.mark.slow
def test_hrm_is_estimated_as_it_is_measured() -> None:
    sample = causal_sample(VOCAB, seq=SEQ)
    measured = gradckpt.profile(hrm(1, 3, [1]), sample, optimizer="adamw", repeats=1)
    predicted = gradckpt.estimate(hrm(1, 3, [1]), sample, optimizer="adamw", device="this")
    fields = ("name", "input_bytes", "output_bytes", "saved_bytes", "gradient_bytes",
              "side_bytes", "held_side_bytes", "checkpointed_backward_peak_bytes")
    assert ([[getattr(block, field) for field in fields] for block in predicted.blocks]
            == [[getattr(block, field) for field in fields] for block in measured.blocks])
    for field in ("peak_bytes", "fixed_bytes", "before_chain_bytes", "head_bytes",
                  "head_gradient_bytes", "optimizer_state_bytes", "other_peak_bytes"):
        assert getattr(predicted, field) == getattr(measured, field), field


@pytest.mark.slow
def test_hrm_running_its_layers_twice_with_gradients_is_refused() -> None:
    # Two high-level cycles: each layer runs twice with gradients, L's twice more without.
    assert_refused(hrm(2, 2, [1, 1]), causal_sample(VOCAB, seq=SEQ),
                   "model.L_module.layers.0 2 times (and 2 more without gradients)",
                   "model.H_module.layers.1 2 times.")
