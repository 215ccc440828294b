"""``gradckpt.linear_cross_entropy``: the output head and its loss in chunks of tokens.

The op (``gradckpt/engine/chunked_head.py``) runs the head and the cross-entropy on one chunk of
tokens at a time, each chunk a checkpointed region whose logits are made again in backward.
Checked here, on tiny heads on the CPU:

- with one chunk it is ``F.cross_entropy`` of the whole logits, bit for bit (loss and grads);
  with more it equals that within float rounding, for the loss and the gradients of the hidden
  states, the weight and the bias: ``ignore_index``, the causal shift (Transformers'
  ``ForCausalLMLoss``), ``num_items``, Gemma 2's soft-capping, an uneven last chunk and more
  chunks than tokens;
- any head: a non-Linear module, a frozen head, a LoRA-style head, hidden states that need no
  gradient; ``torch.autograd.grad`` and a retained graph;
- the weight gradient of a trainable ``nn.Linear`` head exists once (one weight-sized buffer
  the chunks add into), measured with the memory meter; a head autograd sums per chunk needs
  more;
- without grad it is the plain loss and nothing is made again (invariant 3);
- bad input is a ``UsageError`` naming what was wrong;
- the plan's side: ``chunk_head``, ``planned_head_chunks``, ``head_chunks_forced``,
  ``heads_called`` and ``plans_suspended``.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import gradckpt
from gradckpt import UsageError
from gradckpt.engine import (
    AUTO,
    chunk_head,
    default_head_chunks,
    head_chunks_forced,
    heads_called,
    planned_head_chunks,
    plans_suspended,
)
from gradckpt.measure import MemoryMeter

pytestmark = pytest.mark.usefixtures("one_thread")

BATCH, SEQ, HIDDEN, VOCAB = 2, 16, 32, 200
TOKENS = BATCH * SEQ
# float32, the sum over tokens in another order. The largest differences measured here (2, 3,
# 7 and 32 chunks): the loss 9.5e-7 (2 ulp of 5.35, relative 1.8e-7), the weight gradient
# 3.0e-8, the bias gradient 1.5e-8, the hidden gradient 5.1e-9. The tolerance is a few times
# that.
ATOL, RTOL = 1e-6, 1e-5


def hidden_states(seed: int = 0, shape: tuple[int, ...] = (BATCH, SEQ, HIDDEN)) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=generator).requires_grad_(True)


def targets_for(shape: tuple[int, ...] = (BATCH, SEQ), vocab: int = VOCAB,
                ignored: int = 0, seed: int = 1) -> torch.Tensor:
    """Random class indices, the first ``ignored`` positions of each row set to -100."""
    generator = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, vocab, shape, generator=generator)
    targets[..., :ignored] = -100
    return targets


def linear_head(bias: bool = True, vocab: int = VOCAB, hidden: int = HIDDEN) -> nn.Linear:
    torch.manual_seed(2)
    return nn.Linear(hidden, vocab, bias=bias)


def plain_loss(
    hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, **options
) -> torch.Tensor:
    """The reference: the whole logits, then ``F.cross_entropy``."""
    logits = head(hidden).float()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), **options)


def loss_and_gradients(
    loss_fn, head: nn.Module, hidden: torch.Tensor, targets: torch.Tensor, **options
) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """The loss and the gradients of ``hidden`` and of every head parameter, from a fresh
    copy of ``hidden`` and no gradients on the head."""
    hidden = hidden.detach().clone().requires_grad_(hidden.requires_grad)
    head.zero_grad(set_to_none=True)
    loss = loss_fn(hidden, head, targets, **options)
    loss.backward()
    grads = {"hidden": hidden.grad}
    grads.update({name: p.grad for name, p in head.named_parameters()})
    head.zero_grad(set_to_none=True)
    return loss.detach(), grads


def assert_close(got: dict, expected: dict, record: list[float] | None = None) -> None:
    assert got.keys() == expected.keys()
    for name in expected:
        if expected[name] is None:
            assert got[name] is None, name
            continue
        assert got[name] is not None, name
        if record is not None:
            record.append((got[name] - expected[name]).abs().max().item())
        torch.testing.assert_close(got[name], expected[name], atol=ATOL, rtol=RTOL,
                                   msg=lambda message, name=name: f"{name}: {message}")


def chunked(chunks: int, **fixed):
    def loss_fn(hidden, head, targets, **options):
        return gradckpt.linear_cross_entropy(hidden, head, targets, chunks=chunks,
                                             **fixed, **options)

    return loss_fn


# ---------------------------------------------------------------------------------------------
# The loss and its gradients
# ---------------------------------------------------------------------------------------------


def test_one_chunk_is_the_plain_cross_entropy_bit_for_bit() -> None:
    head, hidden, targets = linear_head(), hidden_states(), targets_for(ignored=3)
    expected_loss, expected = loss_and_gradients(plain_loss, head, hidden, targets)
    for loss_fn in (chunked(1), gradckpt.linear_cross_entropy):  # None: no plan, so 1
        loss, got = loss_and_gradients(loss_fn, head, hidden, targets)
        assert torch.equal(loss, expected_loss)
        for name in expected:
            assert torch.equal(got[name], expected[name]), name


@pytest.mark.parametrize("chunks", [2, 3, 7, TOKENS])
def test_chunks_give_the_plain_loss_and_gradients_within_rounding(chunks: int) -> None:
    head, hidden, targets = linear_head(), hidden_states(), targets_for(ignored=3)
    expected_loss, expected = loss_and_gradients(plain_loss, head, hidden, targets)
    loss, got = loss_and_gradients(chunked(chunks), head, hidden, targets)
    assert loss.dtype == torch.float32 and loss.shape == ()
    torch.testing.assert_close(loss, expected_loss, atol=ATOL, rtol=RTOL)
    assert set(got) == {"hidden", "weight", "bias"}
    assert_close(got, expected)


def test_ignored_targets_are_counted_out_of_the_mean_and_get_no_gradient() -> None:
    head, hidden = linear_head(), hidden_states()
    targets = targets_for(ignored=5)
    loss, got = loss_and_gradients(chunked(4), head, hidden, targets)
    counted = targets[:, 5:]
    expected_loss, _ = loss_and_gradients(plain_loss, head, hidden[:, 5:], counted)
    torch.testing.assert_close(loss, expected_loss, atol=ATOL, rtol=RTOL)
    assert torch.count_nonzero(got["hidden"][:, :5]) == 0
    assert torch.count_nonzero(got["hidden"][:, 5:]) > 0


def test_a_custom_ignore_index_is_respected() -> None:
    head, hidden = linear_head(), hidden_states()
    targets = targets_for()
    targets[:, :4] = 0
    expected_loss, expected = loss_and_gradients(plain_loss, head, hidden, targets,
                                                 ignore_index=0)
    loss, got = loss_and_gradients(chunked(3), head, hidden, targets, ignore_index=0)
    torch.testing.assert_close(loss, expected_loss, atol=ATOL, rtol=RTOL)
    assert_close(got, expected)


def test_the_shift_is_transformers_causal_lm_loss() -> None:
    from transformers.loss.loss_utils import ForCausalLMLoss

    def reference(hidden, head, labels, **options):
        return ForCausalLMLoss(head(hidden), labels, VOCAB, **options)

    head, hidden, labels = linear_head(bias=False), hidden_states(), targets_for(ignored=2)
    for chunks in (1, 5):
        expected_loss, expected = loss_and_gradients(reference, head, hidden, labels)
        loss, got = loss_and_gradients(chunked(chunks, shift=True), head, hidden, labels)
        torch.testing.assert_close(loss, expected_loss, atol=ATOL, rtol=RTOL)
        assert_close(got, expected)
        # with the Trainer's normalisation, as Transformers gets it
        expected_loss, expected = loss_and_gradients(reference, head, hidden, labels,
                                                     num_items_in_batch=torch.tensor(50))
        loss, got = loss_and_gradients(chunked(chunks, shift=True, num_items=torch.tensor(50)),
                                       head, hidden, labels)
        torch.testing.assert_close(loss, expected_loss, atol=ATOL, rtol=RTOL)
        assert_close(got, expected)
    # the last position of each row predicts nothing: its hidden state gets no gradient
    assert torch.count_nonzero(got["hidden"][:, -1]) == 0


@pytest.mark.parametrize("num_items", [7, torch.tensor(7)], ids=["int", "tensor"])
def test_num_items_divides_the_summed_loss(num_items) -> None:
    def reference(hidden, head, targets):
        return plain_loss(hidden, head, targets, reduction="sum") / 7

    head, hidden, targets = linear_head(), hidden_states(), targets_for(ignored=3)
    expected_loss, expected = loss_and_gradients(reference, head, hidden, targets)
    for chunks in (1, 4):
        loss, got = loss_and_gradients(chunked(chunks, num_items=num_items), head, hidden,
                                       targets)
        torch.testing.assert_close(loss, expected_loss, atol=ATOL, rtol=RTOL)
        assert_close(got, expected)


def test_softcap_is_tanh_of_the_scaled_logits_before_the_loss() -> None:
    def reference(hidden, head, targets):
        logits = torch.tanh(head(hidden) / 3.0) * 3.0
        return F.cross_entropy(logits.view(-1, VOCAB), targets.view(-1))

    head, hidden, targets = linear_head(), hidden_states(), targets_for(ignored=1)
    with torch.no_grad():
        head.weight.mul_(20)  # logits well past the cap, where tanh bends them
    expected_loss, expected = loss_and_gradients(reference, head, hidden, targets)
    uncapped, _ = loss_and_gradients(plain_loss, head, hidden, targets)
    assert not torch.allclose(expected_loss, uncapped)  # the cap does change the loss here
    loss, _ = loss_and_gradients(chunked(1, softcap=3.0), head, hidden, targets)
    assert torch.equal(loss, expected_loss)
    loss, got = loss_and_gradients(chunked(6, softcap=3.0), head, hidden, targets)
    torch.testing.assert_close(loss, expected_loss, atol=ATOL, rtol=RTOL)
    assert_close(got, expected)


def test_an_uneven_last_chunk_and_more_chunks_than_tokens_are_fine() -> None:
    head = linear_head()
    hidden, targets = hidden_states(shape=(1, 5, HIDDEN)), targets_for((1, 5))
    expected_loss, expected = loss_and_gradients(plain_loss, head, hidden, targets)
    for chunks in (2, 4, 5, 7, 100):  # 3+2, 2+2+1, one per token, more chunks than tokens
        loss, got = loss_and_gradients(chunked(chunks), head, hidden, targets)
        torch.testing.assert_close(loss, expected_loss, atol=ATOL, rtol=RTOL)
        assert_close(got, expected)


def test_targets_all_ignored_give_the_plain_nan_loss_and_zero_gradients() -> None:
    head, hidden = linear_head(), hidden_states()
    targets = torch.full((BATCH, SEQ), -100)
    expected_loss, expected = loss_and_gradients(plain_loss, head, hidden, targets)
    loss, got = loss_and_gradients(chunked(4), head, hidden, targets)
    assert expected_loss.isnan() and loss.isnan()  # 0 / 0, as F.cross_entropy's mean
    for name, gradient in got.items():
        assert torch.equal(gradient, torch.zeros_like(gradient)), name
        assert torch.equal(expected[name], gradient), name


def test_a_bfloat16_head_gives_a_float32_loss_and_gradients_within_a_few_ulp() -> None:
    """Each chunk's weight gradient is rounded to bfloat16 before the next is added (as
    autograd's sum of per-chunk gradients would be): measured, 1 ulp (4.9e-4 at 0.12) with 4
    chunks, 3 ulp (1.5e-3) with 32; the hidden gradient and the loss as in float32."""
    head = linear_head().to(torch.bfloat16)
    hidden = hidden_states().detach().to(torch.bfloat16).requires_grad_(True)
    targets = targets_for(ignored=2)
    expected_loss, expected = loss_and_gradients(plain_loss, head, hidden, targets)
    for chunks in (4, TOKENS):
        loss, got = loss_and_gradients(chunked(chunks), head, hidden, targets)
        assert loss.dtype == torch.float32
        torch.testing.assert_close(loss, expected_loss, atol=ATOL, rtol=RTOL)
        for name in expected:
            assert got[name].dtype == torch.bfloat16, name
            torch.testing.assert_close(got[name], expected[name], atol=4e-3, rtol=0,
                                       msg=lambda message, name=name: f"{name}: {message}")


def test_hidden_states_of_any_leading_shape_and_a_single_token() -> None:
    head = linear_head()
    for shape in ((TOKENS, HIDDEN), (2, 2, 8, HIDDEN), (1, HIDDEN)):
        hidden, targets = hidden_states(shape=shape), targets_for(shape[:-1])
        expected_loss, expected = loss_and_gradients(plain_loss, head, hidden, targets)
        loss, got = loss_and_gradients(chunked(3), head, hidden, targets)
        torch.testing.assert_close(loss, expected_loss, atol=ATOL, rtol=RTOL)
        assert_close(got, expected)


def test_the_largest_difference_from_the_plain_head_is_float_rounding() -> None:
    """The differences the comment at the top states, held to a few times what was seen:
    the loss within a few ulp, the gradients within 2e-7."""
    head, hidden, targets = linear_head(), hidden_states(), targets_for(ignored=3)
    expected_loss, expected = loss_and_gradients(plain_loss, head, hidden, targets)
    loss_differences: list[float] = []
    gradient_differences: list[float] = []
    for chunks in (2, 3, 7, TOKENS):
        loss, got = loss_and_gradients(chunked(chunks), head, hidden, targets)
        loss_differences.append((loss - expected_loss).abs().item() / expected_loss.item())
        assert_close(got, expected, gradient_differences)
    assert max(loss_differences) < 1e-6, loss_differences
    assert max(gradient_differences) < 2e-7, gradient_differences


# ---------------------------------------------------------------------------------------------
# Any head
# ---------------------------------------------------------------------------------------------


class ScaledProjection(nn.Module):
    """Not an ``nn.Linear``: a norm, then a projection through its own weight, then a scale."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.norm = nn.LayerNorm(HIDDEN)
        self.weight = nn.Parameter(torch.randn(VOCAB, HIDDEN) / HIDDEN**0.5)
        self.scale = nn.Parameter(torch.tensor(1.5))
        self.calls = 0

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return self.norm(hidden) @ self.weight.t() * self.scale


class LoRAHead(nn.Module):
    """A frozen base projection plus a trainable low-rank update, as LoRA wraps a head."""

    def __init__(self, rank: int = 4) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.base = nn.Linear(HIDDEN, VOCAB, bias=False).requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, HIDDEN) / HIDDEN**0.5)
        self.lora_b = nn.Parameter(torch.randn(VOCAB, rank) / rank)
        self.out_features = VOCAB

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.base(hidden) + hidden @ self.lora_a.t() @ self.lora_b.t()


HEADS = {
    "linear-with-bias": lambda: linear_head(bias=True),
    "linear-without-bias": lambda: linear_head(bias=False),
    "sequential": lambda: nn.Sequential(nn.LayerNorm(HIDDEN), linear_head()),
    "custom-module": ScaledProjection,
    "frozen-linear": lambda: linear_head().requires_grad_(False),
    "lora": LoRAHead,
    "linear-with-a-hook": lambda: _hooked(linear_head()),
}


def _hooked(head: nn.Linear) -> nn.Linear:
    head.register_forward_hook(lambda module, args, output: output * 0.5)
    return head


@pytest.mark.parametrize("make_head", HEADS.values(), ids=HEADS.keys())
def test_any_head_gets_the_plain_gradients(make_head) -> None:
    head, hidden, targets = make_head(), hidden_states(), targets_for(ignored=2)
    expected_loss, expected = loss_and_gradients(plain_loss, head, hidden, targets)
    loss, got = loss_and_gradients(chunked(4), head, hidden, targets)
    torch.testing.assert_close(loss, expected_loss, atol=ATOL, rtol=RTOL)
    assert_close(got, expected)
    assert got["hidden"] is not None
    for name, parameter in head.named_parameters():
        assert (got[name] is None) == (not parameter.requires_grad), name


def test_a_trainable_head_on_hidden_states_that_need_no_gradient() -> None:
    head, targets = linear_head(), targets_for(ignored=2)
    hidden = hidden_states().detach()
    expected_loss, expected = loss_and_gradients(plain_loss, head, hidden, targets)
    loss, got = loss_and_gradients(chunked(4), head, hidden, targets)
    torch.testing.assert_close(loss, expected_loss, atol=ATOL, rtol=RTOL)
    assert got["hidden"] is None and expected["hidden"] is None
    assert_close(got, expected)


def test_each_chunk_is_made_again_in_backward() -> None:
    head, hidden, targets = ScaledProjection(), hidden_states(), targets_for()
    loss = gradckpt.linear_cross_entropy(hidden, head, targets, chunks=4)
    assert head.calls == 4
    loss.backward()
    assert head.calls == 8


def test_autograd_grad_and_a_retained_graph_work_as_for_the_plain_head() -> None:
    head, hidden, targets = linear_head(), hidden_states(), targets_for(ignored=2)
    expected = torch.autograd.grad(plain_loss(hidden, head, targets),
                                   [hidden, head.weight, head.bias])
    got = torch.autograd.grad(gradckpt.linear_cross_entropy(hidden, head, targets, chunks=3),
                              [hidden, head.weight, head.bias])
    for name, a, b in zip(("hidden", "weight", "bias"), got, expected, strict=True):
        torch.testing.assert_close(a, b, atol=ATOL, rtol=RTOL, msg=name)
    assert head.weight.grad is None  # autograd.grad leaves .grad alone
    # backward twice through one graph adds the gradients twice
    loss = gradckpt.linear_cross_entropy(hidden, head, targets, chunks=3)
    loss.backward(retain_graph=True)
    loss.backward()
    torch.testing.assert_close(head.weight.grad, 2 * expected[1], atol=2 * ATOL, rtol=RTOL)
    torch.testing.assert_close(hidden.grad, 2 * expected[0], atol=2 * ATOL, rtol=RTOL)


def test_a_backward_that_skips_the_weight_leaves_nothing_for_the_next_one() -> None:
    head, hidden, targets = linear_head(), hidden_states(), targets_for(ignored=2)
    expected = torch.autograd.grad(plain_loss(hidden, head, targets), [head.weight])[0]
    loss = gradckpt.linear_cross_entropy(hidden, head, targets, chunks=4)
    torch.autograd.grad(loss, [hidden], retain_graph=True)  # a gradient penalty, say
    loss.backward(inputs=[head.weight])
    torch.testing.assert_close(head.weight.grad, expected, atol=ATOL, rtol=RTOL)  # got 2x


def test_a_weight_also_used_outside_the_head_gets_both_gradients() -> None:
    """Tied embeddings: the head's weight is the input embedding's too."""
    torch.manual_seed(5)
    embedding = nn.Embedding(VOCAB, HIDDEN)
    head = nn.Linear(HIDDEN, VOCAB, bias=False)
    head.weight = embedding.weight
    ids = targets_for()

    def run(chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
        embedding.zero_grad(set_to_none=True)
        hidden = torch.tanh(embedding(ids))
        loss = gradckpt.linear_cross_entropy(hidden, head, ids.roll(-1, 1), chunks=chunks)
        loss.backward()
        return loss.detach(), embedding.weight.grad

    expected_loss, expected = run(1)
    loss, got = run(5)
    torch.testing.assert_close(loss, expected_loss, atol=ATOL, rtol=RTOL)
    torch.testing.assert_close(got, expected, atol=ATOL, rtol=RTOL)


# ---------------------------------------------------------------------------------------------
# Memory: one weight-sized gradient
# ---------------------------------------------------------------------------------------------

MEMORY_VOCAB, MEMORY_HIDDEN, MEMORY_CHUNKS = 4000, 256, 8  # weight 4 MB; all logits 1 MB
MEMORY_SHAPE = (2, 32, MEMORY_HIDDEN)  # 64 tokens


def backward_added_bytes(head: nn.Module, chunks: int) -> int:
    """The peak above the start of the loss's forward and backward (head, hidden states and
    targets made before the meter and tracked)."""
    hidden = hidden_states(shape=MEMORY_SHAPE)
    targets = targets_for(MEMORY_SHAPE[:-1], MEMORY_VOCAB)
    with MemoryMeter("cpu", head, hidden, targets) as meter:
        start = meter.current()
        loss = gradckpt.linear_cross_entropy(hidden, head, targets, chunks=chunks)
        loss.backward()
        del loss
    gradient = next(p.grad for p in head.parameters() if p.requires_grad)
    assert gradient is not None and gradient.abs().sum() > 0
    return meter.peak() - start


def test_the_weight_gradient_of_a_linear_head_is_held_once() -> None:
    torch.manual_seed(6)
    head = nn.Linear(MEMORY_HIDDEN, MEMORY_VOCAB, bias=False)
    weight_bytes = head.weight.numel() * 4
    logits_bytes = MEMORY_VOCAB * 64 * 4
    plain = backward_added_bytes(head, 1)
    head.weight.grad = None
    chunked_peak = backward_added_bytes(head, MEMORY_CHUNKS)
    # Measured: plain 5,185,544 bytes above the start, chunked 4,537,352: the weight's
    # gradient (4,096,000) and 3.5 chunks' logits (128,000 each).
    assert chunked_peak < weight_bytes + 5 * logits_bytes // MEMORY_CHUNKS, (chunked_peak,
                                                                             weight_bytes)
    assert chunked_peak < plain - logits_bytes // 2, (chunked_peak, plain)
    assert plain >= weight_bytes + logits_bytes, plain  # the logits whole, with the gradient


def test_a_head_autograd_sums_per_chunk_holds_more_than_one_weight_gradient() -> None:
    """What the buffer saves: the same Linear behind a forward hook goes through autograd per
    chunk, and weight-sized gradients meet while autograd sums them."""
    torch.manual_seed(6)
    head = nn.Linear(MEMORY_HIDDEN, MEMORY_VOCAB, bias=False)
    weight_bytes = head.weight.numel() * 4
    summed_into_one = backward_added_bytes(head, MEMORY_CHUNKS)
    head.weight.grad = None
    head.register_forward_hook(lambda module, args, output: output)
    per_chunk = backward_added_bytes(head, MEMORY_CHUNKS)
    # Measured: 12,353,544 bytes (three weight-sized tensors) against 4,537,352.
    assert per_chunk >= 2 * weight_bytes, (per_chunk, weight_bytes)
    assert summed_into_one < 1.2 * weight_bytes, (summed_into_one, weight_bytes)


# ---------------------------------------------------------------------------------------------
# Without grad
# ---------------------------------------------------------------------------------------------


def test_without_grad_the_loss_is_the_plain_one_and_nothing_is_made_again() -> None:
    head, hidden, targets = ScaledProjection(), hidden_states(), targets_for(ignored=2)
    with torch.no_grad():
        expected = plain_loss(hidden, head, targets)
        head.calls = 0
        loss = gradckpt.linear_cross_entropy(hidden, head, targets, chunks=4)
    assert head.calls == 4  # one call per chunk, in forward only
    assert not loss.requires_grad and loss.grad_fn is None
    torch.testing.assert_close(loss, expected, atol=ATOL, rtol=RTOL)
    with torch.inference_mode():
        loss = gradckpt.linear_cross_entropy(hidden, linear_head(), targets, chunks=4)
    assert not loss.requires_grad


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("targets", [torch.zeros(BATCH, SEQ + 1, dtype=torch.long),
                                     torch.zeros(TOKENS, dtype=torch.long),
                                     [[0] * SEQ] * BATCH],
                         ids=["longer", "flattened", "a-list"])
def test_targets_of_the_wrong_shape_are_a_usage_error_naming_the_shapes(targets) -> None:
    with pytest.raises(UsageError, match=r"targets must have hidden's shape.*\[2, 16\]"):
        gradckpt.linear_cross_entropy(hidden_states(), linear_head(), targets, chunks=2)


@pytest.mark.parametrize("chunks", [-1, 1.5, True, "4"])
def test_a_chunk_count_that_is_not_a_positive_int_is_a_usage_error(chunks) -> None:
    with pytest.raises(UsageError, match=rf"chunks must be a positive int.*{chunks!r}"):
        gradckpt.linear_cross_entropy(hidden_states(), linear_head(), targets_for(),
                                      chunks=chunks)
    with pytest.raises(UsageError, match="chunks must be a positive int"):
        chunk_head(linear_head(), chunks)


def test_hidden_states_that_are_not_a_tensor_are_a_usage_error() -> None:
    with pytest.raises(UsageError, match="hidden must be a tensor"):
        gradckpt.linear_cross_entropy([[0.0] * HIDDEN], linear_head(), targets_for((1,)))


# ---------------------------------------------------------------------------------------------
# The plan's side: what apply installs and profile listens for
# ---------------------------------------------------------------------------------------------


def test_chunk_head_sets_the_count_linear_cross_entropy_uses_and_remove_undoes_it() -> None:
    head, hidden, targets = ScaledProjection(), hidden_states(), targets_for()
    assert planned_head_chunks(head) == 1
    handle = chunk_head(head, 4)
    try:
        assert planned_head_chunks(head) == 4
        assert planned_head_chunks(linear_head()) == 1  # only that head
        head.calls = 0
        gradckpt.linear_cross_entropy(hidden, head, targets)
        assert head.calls == 4
        head.calls = 0
        gradckpt.linear_cross_entropy(hidden, head, targets, chunks=2)  # given wins
        assert head.calls == 2
    finally:
        handle.remove()
    assert planned_head_chunks(head) == 1
    handle.remove()  # twice is harmless


def test_head_chunks_forced_wins_over_the_plan_and_restores_it() -> None:
    head = linear_head()
    handle = chunk_head(head, 4)
    try:
        with head_chunks_forced(head, 2) as used:
            assert planned_head_chunks(head) == 2
            with head_chunks_forced(head, 1):
                assert planned_head_chunks(head) == 1
            assert planned_head_chunks(head) == 2
        assert used == {"chunks": 2}
        assert planned_head_chunks(head) == 4
    finally:
        handle.remove()


def test_head_chunks_forced_auto_reports_the_count_it_chose() -> None:
    head, hidden, targets = linear_head(), hidden_states(), targets_for()
    with head_chunks_forced(head, AUTO) as used:
        gradckpt.linear_cross_entropy(hidden, head, targets)
    assert used["chunks"] == default_head_chunks(TOKENS, VOCAB, HIDDEN) == 8  # 200 / 32 -> 8
    assert planned_head_chunks(head) == 1


def test_default_head_chunks_is_a_power_of_two_at_most_one_per_token() -> None:
    assert default_head_chunks(8192, 128256, 4096) == 32
    assert default_head_chunks(8192, 128256, 4096, 2) == 64  # bf16 hidden states: half as big
    assert default_head_chunks(4, 128256, 64) == 4  # one per token
    assert default_head_chunks(100, 10, 64) == 1  # a vocabulary narrower than the hidden size
    for tokens, vocab, hidden in [(64, 1000, 64), (512, 32000, 128), (30, 500, 100)]:
        chunks = default_head_chunks(tokens, vocab, hidden)
        assert chunks & (chunks - 1) == 0 or chunks == tokens
        assert 1 <= chunks <= tokens
        assert chunks * hidden >= min(vocab, tokens * hidden)


def test_heads_called_lists_each_head_asked_once_in_order() -> None:
    first, second = linear_head(), ScaledProjection()
    hidden, targets = hidden_states(), targets_for()
    with heads_called() as heads:
        gradckpt.linear_cross_entropy(hidden, second, targets)
        gradckpt.linear_cross_entropy(hidden, first, targets)
        gradckpt.linear_cross_entropy(hidden, second, targets)
    assert [id(head) for head in heads] == [id(second), id(first)]
    with heads_called() as given:
        gradckpt.linear_cross_entropy(hidden, first, targets, chunks=2)
    assert given == []  # a count given is not asked of the plan
    with heads_called() as outside:
        pass
    assert outside == []


def test_plans_suspended_makes_a_planned_head_plain() -> None:
    model = nn.Sequential(nn.Linear(HIDDEN, HIDDEN), ScaledProjection())
    head = model[1]
    handle = chunk_head(head, 4)
    try:
        with plans_suspended(model):
            assert planned_head_chunks(head) == 1
            with head_chunks_forced(head, 2):  # measuring still forces a count
                assert planned_head_chunks(head) == 2
        assert planned_head_chunks(head) == 4
    finally:
        handle.remove()
