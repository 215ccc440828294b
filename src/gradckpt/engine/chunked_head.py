"""The output head and its loss in chunks of tokens: the whole logits never exist.

A language model's last step projects every token's hidden state onto the vocabulary (the
logits: tokens x vocabulary, 8,192 x 128,256 in float32 is 3.9 GiB) and takes a cross-entropy
of them. Those logits are in-between results like any other, so gradient checkpointing's trick
applies one level further: ``linear_cross_entropy`` runs the head and the loss on one chunk of
tokens at a time, each chunk a checkpointed region (``checkpoint``) that keeps only its slice
of the hidden states; in backward each chunk's logits are computed again, used and freed. At
most one chunk's logits and their gradient exist at once, forward or backward, for one more
forward pass of the head.

The loss is the model's own: the mean over the tokens whose target is not ``ignore_index``
(or the sum over ``num_items``, the Hugging Face Trainer's normalisation for gradient
accumulation), with the causal label shift and the final logit soft-capping (Gemma 2) where
asked. Only the order of the sum changes, so the loss and the gradients equal the plain head's
within float rounding.

How many chunks: ``chunks=`` when given; otherwise what the plan applied to the model chose
for this head (``chunk_head``, installed by ``gradckpt.apply``), and 1 (the plain head, the
logits whole, bit for bit the model's own computation) when it chose none. A head the loss
runs through is noted where ``heads_called`` listens: that is how ``profile`` finds a head it
can plan.

Example:
    >>> import torch
    >>> head = torch.nn.Linear(16, 100)
    >>> hidden = torch.randn(2, 8, 16, requires_grad=True)
    >>> targets = torch.randint(0, 100, (2, 8))
    >>> plain = torch.nn.functional.cross_entropy(head(hidden).view(-1, 100), targets.view(-1))
    >>> chunked = linear_cross_entropy(hidden, head, targets, chunks=4)
    >>> torch.allclose(plain, chunked)
    True
"""

from __future__ import annotations

import contextlib
import functools
import math
import threading
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn
from torch.nn import functional

from ..errors import UsageError
from .region import checkpoint
from .suspension import _standing_aside

__all__ = [
    "chunk_head", "default_head_chunks", "head_chunk_calls", "head_chunks_forced", "heads_called",
    "linear_cross_entropy", "planned_head_chunks", "vocabulary_size",
]

AUTO = 0
"""A chunk count meaning "as many as ``default_head_chunks`` says for this call's shapes"."""


def linear_cross_entropy(
    hidden: torch.Tensor,
    head: nn.Module,
    targets: torch.Tensor,
    *,
    chunks: int | None = None,
    ignore_index: int = -100,
    shift: bool = False,
    softcap: float | None = None,
    num_items: int | torch.Tensor | None = None,
) -> torch.Tensor:
    """The cross-entropy of ``head(hidden)`` against ``targets``, computed in chunks of tokens.

    Args:
        hidden: the hidden states the head reads, shape ``(..., hidden_size)``.
        head: the projection onto the vocabulary: any module mapping the last dimension to
            the vocabulary (``nn.Linear``, a LoRA-wrapped one, a tied embedding's linear).
        targets: class indices, shape ``hidden.shape[:-1]``.
        chunks: how many pieces the tokens are cut into; ``None`` (default): what the plan
            applied to the model chose for ``head``, 1 (the plain head) if none. With 1 the
            logits are computed whole, exactly as ``functional.cross_entropy(head(hidden))``;
            0: as many as ``default_head_chunks`` says for these shapes.
        ignore_index: targets with this value do not count.
        shift: the causal language model's shift: position t predicts target t + 1 (the last
            position predicts nothing), as Hugging Face's ``labels`` are given.
        softcap: Gemma 2's final logit soft-capping, ``tanh(logits / softcap) * softcap``.
        num_items: divide the summed loss by this instead of the number of counted targets
            (the Hugging Face Trainer's ``num_items_in_batch``).

    Returns the loss, a float32 scalar.

    Raises ``UsageError`` for shapes that do not fit together or a chunk count below 1.

    Example:
        >>> import torch, gradckpt
        >>> head = torch.nn.Linear(16, 100, bias=False)
        >>> hidden = torch.randn(2, 8, 16, requires_grad=True)
        >>> targets = torch.randint(0, 100, (2, 8))
        >>> loss = gradckpt.linear_cross_entropy(hidden, head, targets, chunks=4, shift=True)
        >>> loss.backward()
        >>> hidden.grad.shape, head.weight.grad.shape
        (torch.Size([2, 8, 16]), torch.Size([100, 16]))
    """
    if chunks is None:
        chunks = planned_head_chunks(head)
    _check_arguments(hidden, targets, chunks)
    if shift:  # as Transformers' ForCausalLMLoss: pad, then drop the first target
        targets = functional.pad(targets, (0, 1), value=ignore_index)[..., 1:]
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_targets = targets.reshape(-1).to(hidden.device)
    if chunks == AUTO:
        chunks = default_head_chunks(flat_hidden.shape[0], vocabulary_size(head),
                                     hidden.shape[-1], hidden.element_size())
        _local.chosen[id(head)] = chunks
    if chunks == 1 or flat_hidden.shape[0] <= 1:
        return _plain(flat_hidden, head, flat_targets, ignore_index, softcap, num_items)
    return _chunked(flat_hidden, head, flat_targets, chunks, ignore_index, softcap, num_items)


# Run as written under torch.compile (a graph break around it): the engine's regions and the
# weight gradient's buffer are Python state a compiled graph cannot hold; the blocks around it
# compile as usual.
@torch.compiler.disable
def _chunked(
    hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, chunks: int,
    ignore_index: int, softcap: float | None, num_items: int | torch.Tensor | None,
) -> torch.Tensor:
    size = math.ceil(hidden.shape[0] / chunks)
    head_call: Any = head
    if _is_plain_linear(head) and head.weight.requires_grad and torch.is_grad_enabled():
        head_call = _LinearSummingIntoOneGradient(head)
    computed_by = _local.chunk_calls.get(id(head))  # measuring only (head_chunk_calls)
    hidden_chunks = hidden.split(size)
    total = None
    for index, (hidden_chunk, target_chunk) in enumerate(
            zip(hidden_chunks, targets.split(size), strict=True)):
        # One region per chunk: it keeps its slice of the hidden states (a view, no copy) and
        # its targets; its logits are freed here and made again in backward.
        compute = functools.partial(checkpoint, _summed_loss, hidden_chunk, head_call,
                                    target_chunk, ignore_index, softcap)
        part = compute() if computed_by is None else computed_by(
            index, len(hidden_chunks), hidden_chunk, compute)
        total = part if total is None else total + part
    assert total is not None
    if num_items is None:
        return total / (targets != ignore_index).sum()
    return total / _on(num_items, total.device)


def _is_plain_linear(head: nn.Module) -> bool:
    """An ``nn.Linear`` whose call is its forward alone (no hooks, no forward put on it)."""
    return (isinstance(head, nn.Linear) and type(head).forward is nn.Linear.forward
            and "forward" not in vars(head) and not head._forward_hooks
            and not head._forward_pre_hooks)


class _LinearSummingIntoOneGradient:
    """A linear head whose weight gradient the chunks add into one buffer, in place.

    Left to autograd, each chunk's backward makes a whole weight-sized gradient and autograd
    sums them: two or three weight-sized tensors at once (for a 128,256-word vocabulary in
    bf16 at 4,096 wide, 1 GiB each). Here each chunk's backward adds its share into one buffer
    with ``addmm_``, and a node ahead of every chunk hands that buffer to the weight once all
    chunks are done: one weight-sized gradient, as without chunks.
    """

    def __init__(self, head: nn.Linear) -> None:
        self.weight_gradient = _WeightGradientBuffer()
        # Every chunk reads the weight through this one alias; its backward runs after theirs.
        self.weight = _HandOverWeightGradient.apply(head.weight, self.weight_gradient)
        self.bias = head.bias

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        return _LinearAddingWeightGradient.apply(hidden, self.weight, self.bias,
                                                 self.weight_gradient)


class _WeightGradientBuffer:
    # Holds no autograd node: a node holding it back would make a reference cycle that keeps
    # the step's graph (and, under DDP, its hooks) alive until the garbage collector runs.
    def __init__(self) -> None:
        self.buffer: torch.Tensor | None = None

    def add(self, output_gradient: torch.Tensor, hidden: torch.Tensor) -> None:
        gradient = output_gradient.reshape(-1, output_gradient.shape[-1]).t()
        hidden = hidden.reshape(-1, hidden.shape[-1])
        if self.buffer is None:
            self.buffer = gradient.mm(hidden)
        else:
            self.buffer.addmm_(gradient, hidden)

    def take(self) -> torch.Tensor | None:
        buffer, self.buffer = self.buffer, None
        return buffer


class _HandOverWeightGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor, buffer: _WeightGradientBuffer) -> torch.Tensor:
        ctx.buffer = buffer
        ctx.set_materialize_grads(False)
        return weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor | None) -> tuple[Any, None]:
        total = ctx.buffer.take()
        if gradient is not None:  # someone used the alias outside the chunks
            total = gradient if total is None else total + gradient
        return total, None


class _LinearAddingWeightGradient(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None, buffer: _WeightGradientBuffer) -> torch.Tensor:
        ctx.save_for_backward(hidden, weight)
        ctx.buffer = buffer
        return functional.linear(hidden, weight, bias)

    @staticmethod
    def backward(ctx: Any, gradient: torch.Tensor) -> tuple[Any, ...]:
        hidden, weight = ctx.saved_tensors
        hidden_gradient = gradient.matmul(weight) if ctx.needs_input_grad[0] else None
        # Not in a backward pass asked only for other gradients (torch.autograd.grad(loss,
        # [hidden]), backward(inputs=...)): the hand-over would not run, and the additions
        # would stay in the buffer for the next backward.
        if ctx.needs_input_grad[1] and torch._C._will_engine_execute_node(weight.grad_fn):
            ctx.buffer.add(gradient, hidden)
        bias_gradient = (gradient.reshape(-1, gradient.shape[-1]).sum(0)
                         if ctx.needs_input_grad[2] else None)
        return hidden_gradient, None, bias_gradient, None


def _plain(
    hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, ignore_index: int,
    softcap: float | None, num_items: int | torch.Tensor | None,
) -> torch.Tensor:
    """The loss as Transformers' ``ForCausalLMLoss`` computes it: the logits whole."""
    logits = _capped(head(hidden), softcap).float()
    if num_items is None:
        return functional.cross_entropy(logits, targets, ignore_index=ignore_index)
    summed = functional.cross_entropy(logits, targets, ignore_index=ignore_index,
                                      reduction="sum")
    return summed / _on(num_items, summed.device)


def _summed_loss(
    hidden: torch.Tensor, head: nn.Module, targets: torch.Tensor, ignore_index: int,
    softcap: float | None,
) -> torch.Tensor:
    logits = _capped(head(hidden), softcap).float()
    return functional.cross_entropy(logits, targets, ignore_index=ignore_index, reduction="sum")


def _capped(logits: torch.Tensor, softcap: float | None) -> torch.Tensor:
    if softcap is None:
        return logits
    # The operations, in the order and dtype Gemma 2's forward applies them.
    return torch.tanh(logits / softcap) * softcap


def _on(count: int | torch.Tensor, device: torch.device) -> int | torch.Tensor:
    return count.to(device) if isinstance(count, torch.Tensor) else count


def _check_arguments(hidden: Any, targets: Any, chunks: Any) -> None:
    if not isinstance(hidden, torch.Tensor) or hidden.dim() < 1:
        raise UsageError(f"hidden must be a tensor of shape (..., hidden_size), got "
                         f"{type(hidden).__name__}")
    if not isinstance(targets, torch.Tensor) or targets.shape != hidden.shape[:-1]:
        shape = list(targets.shape) if isinstance(targets, torch.Tensor) else type(targets)
        raise UsageError(
            f"targets must have hidden's shape without its last dimension, "
            f"{list(hidden.shape[:-1])}; got {shape}"
        )
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 0:
        raise UsageError(f"chunks must be a positive int (pieces the tokens are cut into) or "
                         f"0 (as many as default_head_chunks says), got {chunks!r}")


def vocabulary_size(head: nn.Module) -> int:
    """The width of the head's output: ``out_features`` (``nn.Linear`` and the wrappers LoRA
    puts around it), else its weight's first dimension.

    Example:
        >>> vocabulary_size(torch.nn.Linear(8, 500))
        500
    """
    size = getattr(head, "out_features", None)
    if isinstance(size, int):
        return size
    weight = getattr(head, "weight", None)
    if isinstance(weight, torch.Tensor) and weight.dim() == 2:
        return int(weight.shape[0])
    raise UsageError(
        f"cannot tell the vocabulary size of a {type(head).__name__} head (no out_features, "
        "no 2-d weight); pass chunks= to linear_cross_entropy"
    )


def default_head_chunks(
    tokens: int, vocabulary: int, hidden_size: int, hidden_element_bytes: int = 4
) -> int:
    """How many chunks ``AUTO`` cuts ``tokens`` into: enough that one chunk's logits, in
    float32 as the loss takes them, are no larger than the hidden states of all the tokens
    (``hidden_element_bytes`` per element), as a power of two, at most one per token.

    Example:
        >>> default_head_chunks(8192, 128256, 4096, 2)  # Llama-3-8B at 8k tokens, bf16
        64
        >>> default_head_chunks(512, 32000, 128)
        256
    """
    ratio = max(1, math.ceil(4 * vocabulary / max(hidden_size * hidden_element_bytes, 1)))
    return max(1, min(tokens, 1 << (ratio - 1).bit_length()))


# --- chunking a head: what apply installs, and what profile forces and listens for ---------

# The chunk count the applied plan chose per head (AUTO: decided per call from the shapes).
_planned: weakref.WeakKeyDictionary[nn.Module, int] = weakref.WeakKeyDictionary()


class _HeadState(threading.local):
    """Per thread: chunk counts forced while measuring (head id -> count), the lists of heads
    ``heads_called`` blocks are listening with, the count AUTO chose per head, and what
    computes each chunk's loss while measuring (``head_chunk_calls``)."""

    def __init__(self) -> None:
        self.forced: dict[int, int] = {}
        self.listeners: list[list[nn.Module]] = []
        self.chosen: dict[int, int] = {}
        self.chunk_calls: dict[int, Callable[..., torch.Tensor]] = {}


_local = _HeadState()


class HeadChunking:
    """What ``chunk_head`` installed; ``remove()`` puts the plain head back."""

    def __init__(self, head: nn.Module) -> None:
        self._head = weakref.ref(head)

    def remove(self) -> None:
        head = self._head()
        if head is not None:
            _planned.pop(head, None)


def chunk_head(head: nn.Module, chunks: int) -> HeadChunking:
    """From now on ``linear_cross_entropy`` without ``chunks=`` cuts ``head``'s tokens into
    ``chunks`` pieces (``AUTO``: as ``default_head_chunks`` says per call). What
    ``gradckpt.apply`` does for a plan with a chunked head.

    Example:
        >>> head = torch.nn.Linear(4, 10)
        >>> chunking = chunk_head(head, 8)
        >>> planned_head_chunks(head)
        8
        >>> chunking.remove()
        >>> planned_head_chunks(head)
        1
    """
    _check_arguments(torch.zeros(1), torch.zeros(()), chunks)
    _planned[head] = chunks
    return HeadChunking(head)


def planned_head_chunks(head: nn.Module) -> int:
    """The chunk count for ``head`` now: forced by ``head_chunks_forced``, else the applied
    plan's (1 where ``plans_suspended`` makes plans stand aside, or none chose any). Notes the
    head for ``heads_called``: an integration whose model computes its loss itself calls this
    to ask, in each training step with targets, whether to run ``linear_cross_entropy``.
    """
    for heads in _local.listeners:
        if all(seen is not head for seen in heads):
            heads.append(head)
    forced = _local.forced.get(id(head))
    if forced is not None:
        return forced
    if _standing_aside(head):
        return 1
    return _planned.get(head, 1)


@contextlib.contextmanager
def heads_called() -> Iterator[list[nn.Module]]:
    """Listen, on this thread, for the heads whose chunk count is asked within the block (the
    heads a training step's loss can be chunked at), in the order first asked.

    Example:
        >>> head = torch.nn.Linear(4, 10)
        >>> with heads_called() as heads:
        ...     _ = linear_cross_entropy(torch.randn(3, 4), head, torch.tensor([1, 2, 3]))
        >>> heads == [head]
        True
    """
    heads: list[nn.Module] = []
    _local.listeners.append(heads)
    try:
        yield heads
    finally:
        _local.listeners.remove(heads)


@contextlib.contextmanager
def head_chunks_forced(head: nn.Module, chunks: int) -> Iterator[dict[str, int]]:
    """Within the block, on this thread, ``head`` is cut into ``chunks`` pieces whatever the
    plan (``AUTO`` included); yields a dict whose ``"chunks"`` is the count last used.

    Example:
        >>> head = torch.nn.Linear(4, 10)
        >>> with head_chunks_forced(head, AUTO) as used:
        ...     _ = linear_cross_entropy(torch.randn(6, 4), head, torch.zeros(6, dtype=torch.long))
        >>> used["chunks"]  # 10 / 4 rounded up to a power of two
        4
    """
    key = id(head)
    before = _local.forced.get(key)
    _local.forced[key] = chunks
    used = {"chunks": chunks}
    try:
        yield used
    finally:
        if chunks == AUTO and key in _local.chosen:
            used["chunks"] = _local.chosen.pop(key)
        if before is None:
            _local.forced.pop(key, None)
        else:
            _local.forced[key] = before


@contextlib.contextmanager
def head_chunk_calls(
    head: nn.Module, call: Callable[[int, int, torch.Tensor, Callable[[], torch.Tensor]],
                                    torch.Tensor],
) -> Iterator[None]:
    """Within the block, on this thread, each chunk of ``head``'s loss cut in chunks is
    computed by ``call(index, count, hidden_chunk, compute)`` in place of ``compute()`` (the
    chunk's checkpointed summed loss, a float32 scalar); ``count`` is how many chunks there
    are. Measuring puts chunks that repeat one another aside with it; the loss it returns is
    the sum of what ``call`` returns.

    Example:
        >>> head = torch.nn.Linear(4, 10)
        >>> seen = []
        >>> def call(index, count, hidden_chunk, compute):
        ...     seen.append((index, count, len(hidden_chunk)))
        ...     return compute()
        >>> with head_chunk_calls(head, call):
        ...     _ = linear_cross_entropy(torch.randn(5, 4), head, torch.zeros(5, dtype=torch.long),
        ...                              chunks=2)
        >>> seen
        [(0, 2, 3), (1, 2, 2)]
    """
    key = id(head)
    before = _local.chunk_calls.get(key)
    _local.chunk_calls[key] = call
    try:
        yield
    finally:
        if before is None:
            _local.chunk_calls.pop(key, None)
        else:
            _local.chunk_calls[key] = before
