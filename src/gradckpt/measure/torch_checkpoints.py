"""``torch.utils.checkpoint`` inside the model, seen while ``profile`` records its step.

Three classic silent failures live there, and ``profile`` (so ``enable``) warns once for each,
naming the fix:

- **double checkpointing**: a block that checkpoints itself is recomputed twice when a plan
  recomputes it too (twice the extra time, for no memory);
- **reentrant checkpointing with frozen inputs** (``use_reentrant=True`` where no input
  requires grad, as under LoRA on a frozen base without ``enable_input_require_grads()``): the
  parameters inside get no gradient at all, and training quietly does nothing;
- **``preserve_rng_state=False`` around dropout**: the recomputation draws other random
  numbers, so the gradients are not those of the forward pass.

How it sees them: ``torch.utils.checkpoint.checkpoint`` hands its work to two module-level
names, ``CheckpointFunction`` (reentrant) and ``_checkpoint_without_reentrant_generator``
(non-reentrant); they are looked up when it runs, so replacing them for the duration of the
recording catches every call, however the model imported ``checkpoint``. Private names of
torch: where they are missing (another torch version), nothing is watched and nothing breaks.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import torch.utils.checkpoint as torch_checkpoint
from torch import nn

from ..engine import RngSnapshot
from ..errors import warn_once

__all__ = ["torch_checkpoints_watched"]


class _Watch:
    """What the watched step did: the block running now, and what was found."""

    def __init__(self) -> None:
        self.running: list[str] = []
        self.nested_in: list[str] = []  # blocks that called torch.utils.checkpoint
        self.frozen_reentrant = False
        self.random_without_replay = False

    def saw_checkpoint(self, *, reentrant: bool, inputs: tuple) -> None:
        if self.running and self.running[-1] not in self.nested_in:
            self.nested_in.append(self.running[-1])
        tensors = _tensors(inputs)
        if reentrant and torch.is_grad_enabled() and not any(t.requires_grad for t in tensors):
            self.frozen_reentrant = True

    def report(self) -> None:
        if self.nested_in:
            shown = ", ".join(repr(name) for name in self.nested_in[:3])
            more = f" and {len(self.nested_in) - 3} more" if len(self.nested_in) > 3 else ""
            warn_once(
                "double-checkpointing",
                f"block {shown}{more} calls torch.utils.checkpoint itself; a gradckpt plan that "
                "recomputes it would recompute it twice, costing twice the time for no memory. "
                "Remove the inner checkpoint (for Transformers models gradckpt turns theirs off "
                "itself), or pass blocks= with the modules inside it.",
            )
        if self.frozen_reentrant:
            warn_once(
                "reentrant-frozen-inputs",
                "torch.utils.checkpoint(use_reentrant=True) was called with no input that "
                "requires grad (a frozen base, as with LoRA): the parameters inside get no "
                "gradient and training silently does nothing there. Use use_reentrant=False, "
                "or let gradckpt checkpoint the model (it needs no enable_input_require_grads()).",
            )
        if self.random_without_replay:
            warn_once(
                "random-without-replay",
                "torch.utils.checkpoint(preserve_rng_state=False) wraps code that draws random "
                "numbers (dropout?): its recomputation draws different ones, so the gradients "
                "are not those of the forward pass. Leave preserve_rng_state=True.",
            )


def _tensors(inputs: tuple) -> list[torch.Tensor]:
    return [x for x in inputs if isinstance(x, torch.Tensor)]


def _watching_reentrant(original: Any, watch: _Watch) -> Any:
    class WatchedCheckpointFunction(original):  # type: ignore[misc, valid-type]
        @classmethod
        def apply(cls, function: Any, preserve_rng_state: bool, *args: Any) -> Any:
            watch.saw_checkpoint(reentrant=True, inputs=args)
            before = None if preserve_rng_state else RngSnapshot(_tensors(args))
            output = original.apply(function, preserve_rng_state, *args)
            if before is not None and before.moved():
                watch.random_without_replay = True
            return output

    return WatchedCheckpointFunction


def _watching_non_reentrant(original: Any, watch: _Watch) -> Any:
    def watched(fn: Any, preserve_rng_state: bool = True, *rest: Any, **kwargs: Any) -> Any:
        # rest: context_fn, determinism_check, debug, early_stop, then the inputs.
        watch.saw_checkpoint(reentrant=False, inputs=rest[4:])
        before = None if preserve_rng_state else RngSnapshot(_tensors(rest[4:]))
        inner = original(fn, preserve_rng_state, *rest, **kwargs)
        next(inner)  # torch's pre-forward part; then the caller runs the forward
        try:
            yield
        except BaseException as error:
            inner.throw(error)
            raise
        if before is not None and before.moved():
            watch.random_without_replay = True
        yield from inner  # torch's post-forward part

    return watched


@contextlib.contextmanager
def torch_checkpoints_watched(named_blocks: list[tuple[str, nn.Module]]) -> Iterator[None]:
    """Within, note calls of ``torch.utils.checkpoint`` and the block they run in; on leaving,
    even by an exception, warn once per kind of silent failure found (see the module's
    docstring).

    Example:
        >>> import warnings, torch
        >>> from torch.utils.checkpoint import checkpoint
        >>> class Block(torch.nn.Linear):
        ...     def forward(self, x):
        ...         return checkpoint(super().forward, x, use_reentrant=False)
        >>> block = Block(2, 2)
        >>> with warnings.catch_warnings(record=True) as caught:
        ...     warnings.simplefilter("always")
        ...     with torch_checkpoints_watched([("block", block)]):
        ...         _ = block(torch.ones(1, 2))
        >>> "calls torch.utils.checkpoint itself" in str(caught[0].message)
        True
        >>> from gradckpt.errors import forget_warnings; forget_warnings()
    """
    reentrant = getattr(torch_checkpoint, "CheckpointFunction", None)
    non_reentrant = getattr(torch_checkpoint, "_checkpoint_without_reentrant_generator", None)
    if reentrant is None or non_reentrant is None:  # another torch: watch nothing
        yield
        return
    watch = _Watch()

    def enter(name: str) -> Any:
        return lambda module, args: watch.running.append(name)

    def leave(module: nn.Module, args: Any, output: Any) -> None:
        watch.running.pop()

    handles = []
    for name, module in named_blocks:
        handles.append(module.register_forward_pre_hook(enter(name)))
        handles.append(module.register_forward_hook(leave, always_call=True))
    torch_checkpoint.CheckpointFunction = _watching_reentrant(reentrant, watch)
    torch_checkpoint._checkpoint_without_reentrant_generator = _watching_non_reentrant(
        non_reentrant, watch
    )
    try:
        yield
    finally:
        torch_checkpoint.CheckpointFunction = reentrant
        torch_checkpoint._checkpoint_without_reentrant_generator = non_reentrant
        for handle in handles:
            handle.remove()
        # Also when the step failed: frozen reentrant inputs leave a loss without grad, and
        # the warning says why.
        watch.report()
