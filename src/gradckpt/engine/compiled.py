"""Checkpointing inside ``torch.compile``: a region lowered to ``torch.utils.checkpoint``.

The engine's regions run on saved-tensor hooks in eager mode. Inside a compiled graph those
hooks see the graph's own saved tensors (AOTAutograd chooses them), which an eager
recomputation does not reproduce, so a compiled region would fail its recomputation check.
``torch.utils.checkpoint`` (non-reentrant) is what the compiler understands: Dynamo traces it as
a checkpointed sub-graph and the partitioner recomputes it in the backward graph, with
selective checkpointing (``create_selective_checkpoint_contexts``) deciding per operation.

What survives compilation, per fate:

- **recompute**: yes (the region's operations are recomputed in the backward graph);
- **keep** under a policy (``"save-matmuls"``): yes, as ``CheckpointPolicy.MUST_SAVE``;
  everything else in the region as ``PREFER_RECOMPUTE``;
- **offload**: no; the compiled graph recomputes those tensors instead (more time, the same
  memory goal);
- a policy that looks at the output tensor: the compiler asks before the operation runs, so
  the policy gets ``None`` as its output.

Multi-block and nested segments are lowered block by block (``segments.py``): each block of a
recomputed segment becomes its own region, so the boundaries between them are kept.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import (
    CheckpointPolicy,
    checkpoint,
    create_selective_checkpoint_contexts,
)

from .fates import Fate, PolicyLike, resolve_policy
from .module import replace_forward

__all__ = ["compiling", "lower_for_compile", "torch_checkpoint"]


def compiling() -> bool:
    """Whether the code is being traced by ``torch.compile`` (Dynamo) right now."""
    return torch.compiler.is_compiling()


def torch_checkpoint(
    fn: Callable[..., Any], args: tuple, kwargs: dict, policy: PolicyLike = None
) -> Any:
    """``fn(*args, **kwargs)`` as one ``torch.utils.checkpoint`` region (non-reentrant, RNG
    state preserved), ``policy`` as selective checkpointing.

    Example:
        >>> import torch
        >>> layer = torch.nn.Linear(4, 4)
        >>> x = torch.randn(2, 4, requires_grad=True)
        >>> torch_checkpoint(layer, (x,), {}, "save-matmuls").sum().backward()
        >>> x.grad.shape
        torch.Size([2, 4])
    """
    resolved = resolve_policy(policy)
    if resolved is None:
        return checkpoint(fn, *args, use_reentrant=False, **kwargs)
    contexts = functools.partial(create_selective_checkpoint_contexts,
                                 functools.partial(_selective, resolved))
    return checkpoint(fn, *args, use_reentrant=False, context_fn=contexts, **kwargs)


def _selective(policy: Callable, ctx: Any, op: Any, *args: Any, **kwargs: Any
               ) -> CheckpointPolicy:
    """Our policy as torch's: keep -> must save; recompute and offload -> prefer recompute."""
    if policy(op, None) is Fate.KEEP:
        return CheckpointPolicy.MUST_SAVE
    return CheckpointPolicy.PREFER_RECOMPUTE


def lower_for_compile(
    block: nn.Module, policy: PolicyLike, interrupted: Callable[[], None],
    starting: Callable[[], None],
) -> Callable[[], None]:
    """Give ``block`` a forward that, while ``torch.compile`` traces it with gradients, runs
    as one ``torch.utils.checkpoint`` region under ``policy``, and otherwise is the block's
    own forward (calling ``starting`` first, and ``interrupted`` if either raises a
    ``KeyboardInterrupt``); return what puts the block's forward back."""
    return replace_forward(block, _CompiledForward(block, policy, interrupted, starting))


class _CompiledForward:
    """A planned block's ``forward`` (see ``lower_for_compile``).

    An object holding the block rather than a closure over its bound ``forward``: a deep copy
    of the model (a reference model, an EMA copy) copies it with the block, so the copy's
    forward runs the copy's parameters, where a copied closure would run the original's.
    """

    def __init__(
        self, block: nn.Module, policy: PolicyLike, interrupted: Callable[[], None],
        starting: Callable[[], None],
    ) -> None:
        self.block = block
        self.policy = policy
        self.interrupted = interrupted
        self.starting = starting
        self.own = block.__dict__.get("forward")  # a forward set on the instance, if any
        # Its name, doc and signature; not the wrapped one's __dict__ (updated=()): where that
        # is another _CompiledForward (a block measured on its own while planned), it would
        # overwrite ours with the other handle's callbacks and policy.
        functools.update_wrapper(self, block.forward, updated=())

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        forward = self.own or functools.partial(type(self.block).forward, self.block)
        if compiling():
            if torch.is_grad_enabled():
                return torch_checkpoint(forward, args, kwargs, self.policy)
            return forward(*args, **kwargs)
        try:
            self.starting()  # the regions' hooks on (segments.py: Failure safety)
            return forward(*args, **kwargs)
        except Exception:
            raise  # the block's post-hook runs (always_call) and cleans up
        except BaseException:
            self.interrupted()  # torch runs no post-hook for these
            raise
