"""Segments: consecutive blocks called by the model's own loop, checkpointed as one region.

Engine invariants 1, 3, 5 and 6 for ``gradckpt.engine.segments.checkpoint_segments``, which
plans with segments longer than one block (sqrt, optimal) rely on: bit-identical training with
disjoint and nested segments, exactly the segment inputs kept through the forward pass, nothing
installed without grad, and clear errors for segments that cannot work.
"""

from __future__ import annotations

import copy
import gc
import weakref
from collections.abc import Callable

import pytest
import torch
from hf_models import tiny_llama
from torch import nn

from gradckpt import UsageError
from gradckpt.engine import checkpoint_segments
from gradckpt.measure import MemoryMeter
from gradckpt.toy_models import GPTConfig, TinyGPT

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

LAYERS = 6
CONFIG = GPTConfig(n_layer=LAYERS, n_embd=32, n_head=2, block_size=16, dropout=0.1)


def tiny_gpt() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(CONFIG)


def tokens() -> torch.Tensor:
    return torch.randint(0, CONFIG.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))


def training_step(model: nn.Module) -> tuple[torch.Tensor, list[torch.Tensor]]:
    idx = tokens()
    torch.manual_seed(3)  # dropout masks
    loss = model(idx, targets=idx)
    loss.backward()
    return loss.detach(), [p.grad for p in model.parameters()]


def hooks_on_top() -> object:
    return torch._C._autograd._top_saved_tensors_default_hooks(False)


LAYOUTS = {
    "two-halves": [(0, 2), (3, 5)],
    "one-segment": [(0, 5)],
    "nested": [(0, 5), (0, 2), (3, 5), (0, 0), (4, 4)],
    "mixed": [(1, 1), (2, 4), (3, 3)],
}


@pytest.mark.parametrize("policy", [None, "save-matmuls", "offload-matmuls"])
@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_training_step_is_bit_identical(layout: list[tuple[int, int]], policy: str | None) -> None:
    """Invariants 1 and 5: loss and every gradient equal the plain model's, dropout included,
    with every segment under the same op-level policy."""
    plain = tiny_gpt()
    expected_loss, expected_grads = training_step(plain)
    model = tiny_gpt()
    handle = checkpoint_segments(
        list(model.transformer.h), layout, policies=[policy] * len(layout)
    )
    loss, grads = training_step(model)
    assert torch.equal(loss, expected_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads, strict=True))
    assert hooks_on_top() is None  # every segment closed its hooks
    handle.remove()


def test_nested_segments_recompute_inner_blocks_again() -> None:
    """Invariant 6 with nesting, counting *completed* block calls. Every block completes in the
    forward pass. (0, 5)'s recomputation stops at block 3, as soon as (3, 5)'s input (its last
    saved tensor) exists: blocks 0-2 complete again. (0, 2)'s recomputation completes blocks 0
    and 1 and stops inside block 2 (the last saving op); (3, 5)'s completes 3 and 4 and stops
    inside 5; (0, 0)'s and (4, 4)'s stop inside their block."""
    model = tiny_gpt()
    calls = [0] * LAYERS
    for index, block in enumerate(model.transformer.h):
        block.register_forward_hook(lambda *_, i=index: calls.__setitem__(i, calls[i] + 1))
    checkpoint_segments(list(model.transformer.h), LAYOUTS["nested"])
    training_step(model)
    assert calls == [3, 3, 2, 2, 2, 1]


def retained_after_forward(model: TinyGPT) -> int:
    """Bytes held after the forward pass beyond parameters (activations kept for backward)."""
    idx = tokens()
    with MemoryMeter("cpu", model, idx) as meter:
        before = meter.current()
        loss = model(idx, targets=idx)
        after = meter.current()
    del loss
    return after - before


def test_a_segment_keeps_only_its_first_blocks_input() -> None:
    """Invariant 6 (memory): per-block checkpointing keeps six block inputs through the forward
    pass, two segments of three blocks keep two; measured, the difference is exactly four."""
    hidden_bytes = 2 * 16 * CONFIG.n_embd * 4  # batch x seq x n_embd float32
    per_block = tiny_gpt()
    checkpoint_segments(list(per_block.transformer.h), [(i, i) for i in range(LAYERS)])
    halves = tiny_gpt()
    checkpoint_segments(list(halves.transformer.h), LAYOUTS["two-halves"])
    assert retained_after_forward(per_block) - retained_after_forward(halves) == 4 * hidden_bytes


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_a_finished_segment_frees_its_input_without_the_garbage_collector(
    layout: list[tuple[int, int]],
) -> None:
    """A segment's kept input is freed as soon as its backward is done, by reference counting:
    a reference cycle between the region and its run kept one hidden state per segment alive
    until the garbage collector ran (the whole rest of the backward pass, in practice)."""
    model = tiny_gpt()
    checkpoint_segments(list(model.transformer.h), layout)
    inputs = []
    for block in model.transformer.h:
        block.register_forward_pre_hook(lambda _, args: inputs.append(weakref.ref(args[0])))
    gc.disable()
    try:
        idx = tokens()
        model(idx, targets=idx).backward()
        alive = [i for i, ref in enumerate(inputs) if ref() is not None]
    finally:
        gc.enable()
    assert alive == []


def test_without_grad_nothing_is_installed() -> None:
    """Invariant 3: under no_grad the hooks do nothing and outputs are the plain model's."""
    plain = tiny_gpt().eval()
    model = tiny_gpt().eval()
    checkpoint_segments(list(model.transformer.h), LAYOUTS["nested"])
    seen = []
    model.transformer.h[2].register_forward_hook(lambda *_: seen.append(hooks_on_top()))
    with torch.no_grad():
        assert torch.equal(model(tokens()), plain(tokens()))
    assert seen == [None]


def test_remove_restores_the_plain_model() -> None:
    model = tiny_gpt()
    handle = checkpoint_segments(list(model.transformer.h), LAYOUTS["two-halves"])
    handle.remove()
    seen = []
    model.transformer.h[1].register_forward_hook(lambda *_: seen.append(hooks_on_top()))
    training_step(model)
    assert seen == [None]


def test_a_block_that_raises_leaves_no_hooks_behind() -> None:
    model = tiny_gpt()
    checkpoint_segments(list(model.transformer.h), LAYOUTS["nested"])

    def fail(*_: object) -> None:
        raise RuntimeError("boom")

    hook = model.transformer.h[3].register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="boom"):
        training_step(model)
    assert hooks_on_top() is None
    hook.remove()
    model.zero_grad(set_to_none=True)
    expected_loss, _ = training_step(tiny_gpt())
    assert torch.equal(training_step(model)[0], expected_loss)  # and it still trains


class Interrupted(nn.Module):
    """A chain whose loop does work between blocks: not a pure chain."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(3))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x) * 2.0
        return x




def test_single_block_segments_work_with_work_between_blocks() -> None:
    plain, model = Interrupted(), Interrupted()
    model.load_state_dict(plain.state_dict())
    checkpoint_segments(list(model.blocks), [(0, 0), (1, 1), (2, 2)])
    x = torch.randn(2, 4, requires_grad=True)
    expected = torch.autograd.grad(plain(x).sum(), [x, *plain.parameters()])
    actual = torch.autograd.grad(model(x).sum(), [x, *model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(actual, expected, strict=True))


class CrossAttending(nn.Module):
    """Block 1 reads block 0's output only as context, its hidden state is its own (a BART
    decoder layer reads the encoder's output as ``encoder_hidden_states``)."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Mixer() for _ in range(2))
        self.start = nn.Parameter(torch.randn(2, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        memory = self.blocks[0](x, context=x)
        return self.blocks[1](self.start * 1.0, context=memory)


class Mixer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, context: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.linear(x) + context)


@pytest.mark.parametrize(
    "build",
    # Work between the blocks; block 1 taking block 0's output as context only.
    [Interrupted, CrossAttending], ids=["work-between-blocks", "previous-output-as-context"],
)
def test_a_segment_across_a_chain_break_is_a_clear_error(build: type[nn.Module]) -> None:
    model = build()
    checkpoint_segments(list(model.blocks), [(0, len(model.blocks) - 1)])
    with pytest.raises(UsageError, match="not called with the output of block 0"):
        model(torch.randn(2, 4, requires_grad=True))
    assert hooks_on_top() is None


def test_the_previous_output_passed_twice_is_replayed_in_both_places() -> None:
    # Block 0 gets x as hidden state and as context: both are the chain's input.
    plain, model = CrossAttending(), CrossAttending()
    model.load_state_dict(plain.state_dict())

    def chain(m: CrossAttending, x: torch.Tensor) -> torch.Tensor:
        hidden = m.blocks[0](x, context=x)
        return m.blocks[1](hidden, context=hidden)

    checkpoint_segments(list(model.blocks), [(0, 1)])
    x = torch.randn(2, 4, requires_grad=True)
    expected = torch.autograd.grad(chain(plain, x).sum(), [x, *plain.blocks.parameters()])
    actual = torch.autograd.grad(chain(model, x).sum(), [x, *model.blocks.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(actual, expected, strict=True))

    # The record of block 1's call keeps neither copy of block 0's output: the segment holds
    # as much after its forward as when block 1 takes the chain's input as context instead.
    def context_from_input(m: CrossAttending, x: torch.Tensor) -> torch.Tensor:
        return m.blocks[1](m.blocks[0](x, context=x), context=x)

    x = torch.randn(256, 4, requires_grad=True)
    assert held_after_forward(lambda: chain(model, x), model, x) == held_after_forward(
        lambda: context_from_input(model, x), model, x
    )


def held_after_forward(forward: Callable[[], torch.Tensor], *existing: object) -> int:
    """Bytes a forward pass leaves allocated (its output included) beyond ``existing``."""
    with MemoryMeter("cpu", *existing) as meter:
        before = meter.current()
        output = forward()
        after = meter.current()
    del output
    return after - before


@pytest.mark.parametrize(
    ("segments", "message"),
    [
        ([(0, 6)], "0 <= start <= end < 6"),
        ([(3, 2)], "0 <= start <= end < 6"),
        ([(0, 3), (2, 4)], "overlap without one containing the other"),
        ([(1, 2), (1, 2)], "given twice"),
        ([(0, 1.5)], "not a range of block indices"),
    ],
)
def test_bad_segments_are_usage_errors(segments: list, message: str) -> None:
    model = tiny_gpt()
    with pytest.raises(UsageError, match=message):
        checkpoint_segments(list(model.transformer.h), segments)


def test_hugging_face_llama_layers_as_segments() -> None:
    """Decoder layers called with keyword arguments (position embeddings, masks) replay them."""
    pytest.importorskip("transformers")
    plain = tiny_llama(layers=4)
    model = copy.deepcopy(plain)
    checkpoint_segments(list(model.model.layers), [(0, 3), (0, 1), (2, 3)])
    input_ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))

    def step(m: nn.Module) -> tuple:
        torch.manual_seed(3)
        loss = m(input_ids=input_ids, labels=input_ids).loss
        loss.backward()
        return loss.detach(), [p.grad for p in m.parameters()]

    expected_loss, expected_grads = step(plain)
    loss, grads = step(model)
    assert torch.equal(loss, expected_loss)
    assert all(torch.equal(a, b) for a, b in zip(grads, expected_grads, strict=True))


class _DrawsBetweenBlocks(nn.Module):
    """A loop that draws a random number before each block (LayerDrop's draw), skipping the
    block when ``skip`` says so."""

    def __init__(self, skip: float) -> None:
        super().__init__()
        self.skip = skip
        self.layers = nn.ModuleList(_ResidualDropout() for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            if torch.rand([]) < self.skip:
                continue
            x = layer(x)
        return x.sum()


class _ResidualDropout(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(8, 8)
        self.dropout = nn.Dropout(0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.linear(x)).relu() + x


@pytest.mark.parametrize("skip", [0.0, 0.5], ids=["drawn", "layers-dropped"])
def test_a_segment_replays_random_draws_made_between_its_blocks(skip: float) -> None:
    torch.manual_seed(0)
    model = _DrawsBetweenBlocks(skip)
    x = torch.randn(4, 8, requires_grad=True)

    def gradients(seed: int) -> list[torch.Tensor | None]:
        model.zero_grad(set_to_none=True)
        x.grad = None
        torch.manual_seed(seed)
        model(x).backward()
        return [p.grad for p in model.parameters()] + [x.grad]

    plain = [gradients(seed) for seed in range(6)]
    handle = checkpoint_segments(list(model.layers), [(0, 3)])
    segmented = [gradients(seed) for seed in range(6)]
    handle.remove()
    for expected, got in zip(plain, segmented, strict=True):
        assert [g is None for g in expected] == [g is None for g in got]
        assert all(torch.equal(a, b) for a, b in zip(expected, got, strict=True)
                   if a is not None)
