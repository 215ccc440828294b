"""Exact memory accounting of checkpointed regions, measured with the memory meter on the CPU.

docs/planning.md, "What `profile` measures": memory is measured by the reference measure (on the CPU
``torch.distributed._tools.mem_tracker.MemTracker``, its "Total", read by ``MemoryMeter``), never
guessed. MemTracker sees every storage created inside its context and those registered with it;
here the parameters are registered and every activation is created inside, so each number below
is exact to the byte.

- (a) ``policy=None``: after the forward pass a region retains exactly its inputs (those the
  caller no longer holds) -- nothing else. This is what checkpointing is for.
- (b) ``"save-matmuls"`` / ``"offload-matmuls"`` (= keep on the CPU): inputs plus exactly the
  outputs of the matmuls and attention kernels in the region.
- (c) the same region without checkpointing retains strictly more.
- (d) invariant 6: recomputed tensors are freed after use: after backward, after a partial
  ``torch.autograd.grad`` and after ``backward(retain_graph=True)`` the memory is what it was
  after forward, plus the gradients.
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.nn.functional as F
from engine_models import storage_bytes
from torch import nn

import gradckpt
from gradckpt.measure import MemoryMeter

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

CPU = torch.device("cpu")
BATCH, WIDTH = 16, 32
FLOAT_BYTES = 4


def current_bytes(meter: MemoryMeter) -> int:
    return meter.current()


def tracker_for(*external: object) -> MemoryMeter:
    """gradckpt's memory meter on the CPU: MemTracker's "Total", the objects made before it
    registered with it."""
    return MemoryMeter(CPU, *external)


def mlp_region() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(WIDTH, WIDTH),
        nn.GELU(),
        nn.Dropout(0.25),
        nn.Linear(WIDTH, WIDTH),
        nn.GELU(),
    )


MLP_MATMUL_OUTPUT_BYTES = 2 * BATCH * WIDTH * FLOAT_BYTES  # two addmm outputs (BATCH, WIDTH)


class AttentionRegion(nn.Module):
    """qkv projection, causal SDPA, output projection with a residual."""

    def __init__(self, dim: int = 16, heads: int = 2) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, dim = x.shape
        q, k, v = self.qkv(x).split(dim, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = y.transpose(1, 2).reshape(batch, seq, dim)
        return x + self.proj(F.gelu(torch.tanh(y)))


def attention_matmul_output_bytes(batch: int, seq: int, dim: int, heads: int) -> int:
    qkv = batch * seq * 3 * dim  # addmm
    attention = batch * seq * dim + batch * heads * seq  # output + logsumexp (flash, CPU)
    proj = batch * seq * dim  # addmm
    return (qkv + attention + proj) * FLOAT_BYTES


def region_and_input(region_kind: str):
    """A fresh region of that kind and the function that makes its input."""
    if region_kind == "attention":
        torch.manual_seed(0)
        return AttentionRegion(), attention_input()
    return mlp_region(), mlp_input()


def retained_by_forward(region: nn.Module, make_input, policy, checkpointing: bool = True):
    """Bytes the region retains after forward beyond its output, and its input's bytes.

    The input is made inside the tracked section from a leaf outside it, and the caller drops
    its reference before measuring: whatever still holds it is the region.
    """
    tracker = tracker_for(region)
    with tracker:
        before = current_bytes(tracker)
        x = make_input()
        input_bytes = storage_bytes(x)
        if checkpointing:
            y = gradckpt.checkpoint(region, x, policy=policy)
        else:
            y = region(x)
        del x
        retained = current_bytes(tracker) - before - storage_bytes(y)
    return retained, input_bytes


def mlp_input():
    leaf = torch.randn(BATCH, WIDTH, requires_grad=True)
    return lambda: leaf * 2  # an activation: MulBackward with a scalar saves no tensor


def attention_input():
    leaf = torch.randn(2, 8, 16, requires_grad=True)
    return lambda: leaf * 2


# ---------------------------------------------------------------------------------------------
# (a) policy=None keeps exactly the inputs
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("region_kind", ["mlp-with-dropout", "attention"])
def test_policy_none_retains_exactly_the_inputs(region_kind: str) -> None:
    """(a) With policy=None the region keeps its input and nothing else after forward."""
    region, make_input = region_and_input(region_kind)
    retained, input_bytes = retained_by_forward(region, make_input, policy=None)
    assert input_bytes > 0
    assert retained == input_bytes


def test_input_still_held_by_the_caller_costs_nothing_more() -> None:
    """(a) When the caller holds the input, a region with policy=None retains zero bytes."""
    region = mlp_region()
    leaf = torch.randn(BATCH, WIDTH, requires_grad=True)
    tracker = tracker_for(region)
    with tracker:
        x = leaf * 2
        before = current_bytes(tracker)
        y = gradckpt.checkpoint(region, x)
        assert current_bytes(tracker) - before == storage_bytes(y)


def test_several_inputs_and_keyword_tensors_are_all_that_is_retained() -> None:
    """(a) Positional and keyword tensor inputs (one frozen) are exactly what stays."""
    torch.manual_seed(0)
    first, second = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def region(a: torch.Tensor, b: torch.Tensor, *, shift: torch.Tensor, scale: float):
        return torch.tanh(first(a)) * torch.sigmoid(second(b)) * scale + shift

    leaf_a = torch.randn(BATCH, WIDTH, requires_grad=True)
    leaf_b = torch.randn(BATCH, WIDTH, requires_grad=True)
    tracker = tracker_for(first, second)
    with tracker:
        before = current_bytes(tracker)
        a, b = leaf_a * 2, leaf_b * 2
        shift = torch.randn(BATCH, WIDTH)  # does not require grad
        input_bytes = storage_bytes(a, b, shift)
        y = gradckpt.checkpoint(region, a, b, shift=shift, scale=0.5)
        del a, b, shift
        retained = current_bytes(tracker) - before - storage_bytes(y)
    assert retained == input_bytes == 3 * BATCH * WIDTH * FLOAT_BYTES


def test_nested_checkpoint_retains_only_the_outer_inputs() -> None:
    """(a) + rule R2: an inner region's inputs are the outer region's to drop."""
    inner_region = mlp_region()
    torch.manual_seed(1)
    head = nn.Linear(WIDTH, WIDTH)

    def outer(x: torch.Tensor) -> torch.Tensor:
        h = gradckpt.checkpoint(inner_region, torch.relu(head(x)))
        return torch.tanh(h)

    leaf = torch.randn(BATCH, WIDTH, requires_grad=True)
    tracker = tracker_for(inner_region, head)
    with tracker:
        before = current_bytes(tracker)
        x = leaf * 2
        input_bytes = storage_bytes(x)
        y = gradckpt.checkpoint(outer, x)
        del x
        retained = current_bytes(tracker) - before - storage_bytes(y)
    assert retained == input_bytes


# ---------------------------------------------------------------------------------------------
# (b) save-matmuls keeps inputs + matmul/attention outputs; (c) plain keeps more
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["save-matmuls", "offload-matmuls"])
def test_save_matmuls_retains_inputs_plus_matmul_outputs(policy: str) -> None:
    """(b) An MLP region: its input plus its two Linear (addmm) outputs, nothing else."""
    retained, input_bytes = retained_by_forward(mlp_region(), mlp_input(), policy=policy)
    assert retained == input_bytes + MLP_MATMUL_OUTPUT_BYTES


@pytest.mark.parametrize("policy", ["save-matmuls", "offload-matmuls"])
def test_save_matmuls_retains_attention_outputs(policy: str) -> None:
    """(b) An attention region: input + qkv and proj addmm outputs + the attention outputs."""
    torch.manual_seed(0)
    region = AttentionRegion(dim=16, heads=2)
    retained, input_bytes = retained_by_forward(region, attention_input(), policy=policy)
    expected = input_bytes + attention_matmul_output_bytes(batch=2, seq=8, dim=16, heads=2)
    assert retained == expected


@pytest.mark.parametrize("region_kind", ["mlp-with-dropout", "attention"])
def test_without_checkpointing_the_region_retains_strictly_more(region_kind: str) -> None:
    """(c) The plain region keeps more than with save-matmuls, which keeps more than None."""
    region, make_input = region_and_input(region_kind)
    plain, input_bytes = retained_by_forward(region, make_input, None, checkpointing=False)
    selective, _ = retained_by_forward(region, make_input, "save-matmuls")
    everything, _ = retained_by_forward(region, make_input, None)
    assert plain > selective > everything == input_bytes


# ---------------------------------------------------------------------------------------------
# (d) invariant 6: recomputed tensors are freed after use
# ---------------------------------------------------------------------------------------------


def parameter_bytes(*modules: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for m in modules for p in m.parameters())


@pytest.mark.parametrize("policy", [None, "save-matmuls"])
@pytest.mark.parametrize("checkpointing", [True, False], ids=["checkpointed", "plain"])
def test_after_backward_only_gradients_and_the_held_output_remain(
    policy: str | None, checkpointing: bool
) -> None:
    """(d) After backward: the level before forward, plus the grads, plus the output we hold."""
    region = mlp_region()
    leaf = torch.randn(BATCH, WIDTH, requires_grad=True)
    tracker = tracker_for(region)
    with tracker:
        before = current_bytes(tracker)
        x = leaf * 2
        y = gradckpt.checkpoint(region, x, policy=policy) if checkpointing else region(x)
        del x
        y.square().sum().backward()
        after = current_bytes(tracker)
    grad_bytes = parameter_bytes(region) + storage_bytes(leaf.grad)
    assert after - before == grad_bytes + storage_bytes(y)


@pytest.mark.parametrize("policy", [None, "save-matmuls"])
def test_partial_autograd_grad_frees_what_it_did_not_use(policy: str | None) -> None:
    """(d) ``autograd.grad`` w.r.t. one input: the other branch's recomputed tensors go too."""
    torch.manual_seed(0)
    first, second = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)

    def region(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
        return first(a) * F.gelu(second(b))

    leaf_a = torch.randn(BATCH, WIDTH, requires_grad=True)
    leaf_b = torch.randn(BATCH, WIDTH, requires_grad=True)
    tracker = tracker_for(first, second)
    with tracker:
        a, b = leaf_a * 2, leaf_b * 2
        y = gradckpt.checkpoint(region, a, b, policy=policy)
        after_forward = current_bytes(tracker)
        (grad_a,) = torch.autograd.grad(y.sum(), [a])
        after_grad = current_bytes(tracker)
    # The kept matmul outputs (first(a), second(b)) were handed to the recomputation and freed
    # with it, as torch's selective checkpointing does; a later backward would recompute them.
    handed_out = 2 * BATCH * WIDTH * FLOAT_BYTES if policy == "save-matmuls" else 0
    assert after_grad - after_forward == storage_bytes(grad_a) - handed_out
    # And the result is right: d/da sum(first(a) * g) = g @ W1.
    expected = (F.gelu(second(b)) @ first.weight).detach()
    torch.testing.assert_close(grad_a, expected)


@pytest.mark.parametrize("policy", [None, "save-matmuls"])
def test_retain_graph_backward_frees_recomputed_tensors_each_time(policy: str | None) -> None:
    """(d) backward(retain_graph=True), twice: each time memory returns to the after-forward
    level plus the grads (they accumulate in place), less the kept matmul outputs: the first
    recomputation took them over and freed them with its graph (later ones recompute those
    matmuls). A last backward without retain_graph releases the graph, and with it the input."""
    region = mlp_region()
    leaf = torch.randn(BATCH, WIDTH, requires_grad=True)
    tracker = tracker_for(region)
    with tracker:
        x = leaf * 2
        input_bytes = storage_bytes(x)
        y = gradckpt.checkpoint(region, x, policy=policy)
        del x
        loss = y.square().sum()
        after_forward = current_bytes(tracker)
        levels = []
        for retain_graph in (True, True, False):
            loss.backward(retain_graph=retain_graph)
            levels.append(current_bytes(tracker) - after_forward)
    grad_bytes = parameter_bytes(region) + storage_bytes(leaf.grad)
    handed_out = MLP_MATMUL_OUTPUT_BYTES if policy == "save-matmuls" else 0
    after_retained = grad_bytes - handed_out
    assert levels == [after_retained, after_retained, after_retained - input_bytes]
    assert math.isfinite(loss.item())


def test_kept_outputs_backward_does_not_save_are_freed_during_recomputation() -> None:
    """A kept matmul output that backward never saves (here: scaled by a constant before the
    next layer) is freed as soon as the recomputation has used it, so the backward peaks no
    higher than under torch's own selective checkpointing with the same choices."""
    from torch.utils.checkpoint import (
        CheckpointPolicy,
        checkpoint,
        create_selective_checkpoint_contexts,
    )

    from gradckpt.engine import is_matmul_or_attention

    torch.manual_seed(0)
    first, second = nn.Linear(WIDTH, 8 * WIDTH), nn.Linear(8 * WIDTH, WIDTH)

    def region(x: torch.Tensor) -> torch.Tensor:
        return F.gelu(second(first(x) * 2.0))  # mul by a number saves nothing

    def torch_policy(ctx, op, *args, **kwargs):  # noqa: ANN001
        if is_matmul_or_attention(op):
            return CheckpointPolicy.MUST_SAVE
        return CheckpointPolicy.PREFER_RECOMPUTE

    def peak_of_step(run) -> int:  # noqa: ANN001
        leaf = torch.randn(4 * BATCH, WIDTH, requires_grad=True)
        tracker = tracker_for(first, second, leaf)
        with tracker:
            run(leaf * 2).square().sum().backward()
        first.zero_grad(set_to_none=True)
        second.zero_grad(set_to_none=True)
        return tracker.peak()

    ours = peak_of_step(lambda x: gradckpt.checkpoint(region, x, policy="save-matmuls"))
    context = functools.partial(create_selective_checkpoint_contexts, torch_policy)
    theirs = peak_of_step(
        lambda x: checkpoint(region, x, use_reentrant=False, context_fn=context)
    )
    assert ours == theirs


class StatefulCell(nn.Module):
    """Keeps the state it computes as an attribute, as a recurrent layer keeps its last state
    (``self.state = h``): a reference to its graph that outlives the call."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(WIDTH, WIDTH)
        self.state: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.state = F.gelu(self.linear(x))
        return self.state


class StatefulLayer(nn.Module):
    """Resets its cell's state before each call, then runs it (RecurrentGemma's recurrent
    block does both), and projects."""

    def __init__(self) -> None:
        super().__init__()
        self.cell = StatefulCell()
        self.out = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.cell.state = None
        return self.out(self.cell(x))


@pytest.mark.parametrize("policy", [None, "save-matmuls"])
def test_a_state_kept_as_an_attribute_ends_as_the_forward_pass_left_it(
    policy: str | None,
) -> None:
    """(d) and invariant 2: after backward the cell's attribute is the tensor the forward pass
    stored, not the recomputed one, and the memory is the plain model's: the recomputed one
    would hold the graph recomputation built (the layer's activations and input) until the
    next forward pass."""
    levels = {}
    for checkpointing in (False, True):
        torch.manual_seed(0)
        layer = StatefulLayer()
        leaf = torch.randn(BATCH, WIDTH, requires_grad=True)
        tracker = tracker_for(layer, leaf)
        with tracker:
            before = current_bytes(tracker)
            x = leaf * 2
            y = gradckpt.checkpoint(layer, x, policy=policy) if checkpointing else layer(x)
            stored = layer.cell.state
            del x
            y.square().sum().backward()
            assert layer.cell.state is stored
            del stored
            levels[checkpointing] = current_bytes(tracker) - before
    state_bytes = BATCH * WIDTH * FLOAT_BYTES
    grad_bytes = parameter_bytes(layer) + storage_bytes(leaf.grad)
    assert levels[True] == levels[False] == grad_bytes + storage_bytes(y) + state_bytes


def test_a_graph_recomputation_leaves_elsewhere_holds_none_of_its_saved_tensors() -> None:
    """(d) A region that hands a tensor it computes to something outside (a list, a cache),
    where recomputation hands it over again: after backward the list holds the two tensors,
    and the graph behind the recomputed one holds none of what it saved (the first linear's
    input and output), freed when recomputation ended."""
    torch.manual_seed(0)
    first, second = nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, WIDTH)
    handed_out: list[torch.Tensor] = []

    def region(x: torch.Tensor) -> torch.Tensor:
        hidden = F.gelu(first(x))
        handed_out.append(hidden)
        return second(hidden)

    tracker = tracker_for(first, second)
    with tracker:
        before = current_bytes(tracker)
        x = torch.randn(BATCH, WIDTH)  # a frozen input (invariant 4): no leaf's node holds it
        y = gradckpt.checkpoint(region, x)
        del x
        y.square().sum().backward()
        after = current_bytes(tracker)
    assert len(handed_out) == 2 and handed_out[1].grad_fn is not None
    tensor_bytes = BATCH * WIDTH * FLOAT_BYTES
    assert after - before == parameter_bytes(first, second) + storage_bytes(y) + 2 * tensor_bytes
    with pytest.raises(gradckpt.CheckpointError, match="after the recomputation ended"):
        handed_out[1].sum().backward()
