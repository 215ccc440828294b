"""One checkpointed call: the region, its slots, its recomputation (rules R1-R6 in the
package docstring). Where a policy keeps or offloads what the region saves: fate_per_op.py."""

from __future__ import annotations

import contextlib
import functools
import itertools
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import CheckpointError, UsageError, warn_once
from .ambient import _AmbientState, _BufferGuard
from .debug import _debug_state
from .fate_per_op import _FatePerOpMode, _FateTape
from .fates import Policy, PolicyLike, resolve_policy
from .tensors import _describe, _engine_internal, _metadata, _producer, _version_of


def checkpoint(
    fn: Callable[..., Any],
    *args: Any,
    preserve_rng_state: bool = True,
    policy: PolicyLike = None,
    **kwargs: Any,
) -> Any:
    """Run ``fn(*args, **kwargs)`` and recompute what it saves for backward instead of storing it.

    Only the region's inputs are kept (plus what ``policy`` chooses to keep or offload); the
    backward pass runs ``fn`` again to rebuild the rest. Gradients equal those of calling ``fn``
    directly. Without grad (``torch.no_grad()``, ``torch.inference_mode()``) this is exactly
    ``fn(*args, **kwargs)``.

    Args:
        fn: any callable; a module, a function, a lambda.
        preserve_rng_state: replay the CPU's and every accelerator's RNG state in recomputation,
            so dropout draws the same masks. Turn off only for regions without randomness.
        policy: ``None`` (recompute everything), a preset name (``"save-matmuls"``,
            ``"offload-matmuls"``) or a callable ``(op, output) -> Fate``.

    Example:
        >>> import torch, gradckpt
        >>> layer = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.GELU())
        >>> x = torch.randn(4, 8, requires_grad=True)
        >>> y = gradckpt.checkpoint(layer, x, policy="save-matmuls")
        >>> y.sum().backward()
        >>> x.grad.shape
        torch.Size([4, 8])
    """
    return _run_checkpointed(
        fn, args, kwargs, name=None, policy=policy, preserve_rng_state=preserve_rng_state
    )

class _RecomputationComplete(Exception):
    """Raised from inside recomputation once every slot is filled (R5)."""


class _SaveInputs(torch.autograd.Function):
    """A no-op node whose only job is to save the region's inputs (R2).

    ``anchor`` requires grad so the node exists even when no input does (frozen inputs,
    invariant 4). The node is never part of the loss's graph; the region holds it.
    """

    @staticmethod
    def forward(ctx: Any, anchor: torch.Tensor, *tensors: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(*tensors)
        return anchor.new_empty(0)

    @staticmethod
    def backward(ctx: Any, *grads: Any) -> Any:  # never runs: nothing depends on the output
        raise AssertionError("gradckpt: the input-saving node cannot be differentiated")


class _Slot:
    """What autograd stores in place of a saved tensor: per backward pass, the recomputed tensor.

    Its position in ``region.slots`` is the order in which the forward pass saved it, which is
    the order in which recomputation saves it again.
    """

    __slots__ = ("region", "tensors", "__weakref__")

    def __init__(self, region: _Region) -> None:
        self.region = region
        self.tensors: dict[int, torch.Tensor] = {}  # graph task id -> recomputed tensor


_outside_backward_ids = itertools.count(-2, -1)  # graph ids for unpacks outside any backward


class _Region:
    """The state of one ``checkpoint`` call, alive as long as its part of the graph is."""

    def __init__(
        self,
        fn: Callable[..., Any],
        name: str,
        policy: Policy | None,
        preserve_rng_state: bool,
        debug: bool,
    ) -> None:
        self.fn = fn
        self.name = name
        self.preserve_rng_state = preserve_rng_state
        self.slots: list[weakref.ref[_Slot]] = []
        self.saved_metadata: list[tuple[torch.Size, torch.dtype, torch.device]] = []
        self.saved_by: list[type | None] = []  # what made each saved tensor (_producer)
        self.saved_versions: list[int | None] = []  # its version counter when it was saved
        self.fates = _FateTape(policy, debug)  # each operation's fate, where a policy decides
        self.graphs_with_cleanup: set[int] = set()

    # ---- forward ----------------------------------------------------------------------------

    def forward_hooks(self) -> list[contextlib.AbstractContextManager]:
        """What is on around the region's forward pass, outermost first: the mode that gives
        each operation its fate (where there is a policy or debug mode), then the saved-tensor
        hooks that hand us what autograd saves. Each can be entered again after it exits
        (segments.py enters them around each block's call)."""
        return _hooks(self.fates.forward_mode(), self.pack_during_forward, _unpack)

    def save_inputs(self, args: tuple, kwargs: dict) -> None:
        leaves, self.input_spec = tree_flatten((args, kwargs))
        self.tensor_positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        tensors = [leaves[i] for i in self.tensor_positions]
        self.input_requires_grad = [t.requires_grad for t in tensors]
        self.other_leaves = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        anchor = torch.empty(0, requires_grad=True)
        self.input_node = _SaveInputs.apply(anchor, *tensors).grad_fn
        self.ambient = _AmbientState(tensors, self.preserve_rng_state)

    def pack_during_forward(self, tensor: torch.Tensor) -> _Slot:
        slot = _Slot(self)
        self.slots.append(weakref.ref(slot))
        self.saved_metadata.append(_metadata(tensor))
        self.saved_by.append(_producer(tensor))
        self.saved_versions.append(_version_of(tensor))
        return slot

    # ---- backward ---------------------------------------------------------------------------

    def unpack(self, slot: _Slot) -> torch.Tensor:
        graph_id = torch._C._current_graph_task_id()
        outside_backward = graph_id == -1
        if outside_backward:  # e.g. someone reads grad_fn._saved_self by hand
            graph_id = next(_outside_backward_ids)
        if graph_id not in slot.tensors:
            self.recompute(graph_id)
        tensor = slot.tensors.pop(graph_id)  # R4: handed out once, then ours no longer
        if outside_backward:
            self.drop_recomputed(graph_id)
        return tensor

    def recompute(self, graph_id: int) -> None:
        if graph_id >= 0 and graph_id not in self.graphs_with_cleanup:
            # R4: whatever this backward never unpacks is dropped when it ends.
            self.graphs_with_cleanup.add(graph_id)
            torch.autograd.Variable._execution_engine.queue_callback(
                functools.partial(_drop_recomputed, weakref.ref(self), graph_id)
            )
        args, kwargs = self.recompute_inputs()
        recomputation = _Recomputation(self, graph_id)
        try:
            with contextlib.ExitStack() as stack:
                stack.enter_context(torch.enable_grad())
                stack.enter_context(self.ambient.replayed())
                stack.enter_context(_BufferGuard())
                # Made in the replayed state: the mode starts bringing offloaded tensors back.
                mode = self.fates.recompute_mode(self.mismatch)
                for hook in _hooks(mode, recomputation.pack, _unpack_recomputed):
                    stack.enter_context(hook)
                try:
                    self.fn(*args, **kwargs)
                except _RecomputationComplete:
                    pass
        finally:
            recomputation.release()  # R6
        if recomputation.filled < len(self.slots):
            raise self.mismatch(
                f"saved {recomputation.filled} tensors for backward but its forward pass saved "
                f"{len(self.slots)}"
            )

    def pack_during_recompute(
        self, recomputation: _Recomputation, tensor: torch.Tensor
    ) -> _RecomputedSave:
        index = recomputation.filled
        recomputation.filled += 1
        save = _RecomputedSave(tensor)
        recomputation.saves.append(save)
        if index >= len(self.slots):
            # Only reachable when the forward itself ran backward before finishing (R5 normally
            # stops us at len(slots)); then the extra tensors are the forward's own business.
            return save
        if _metadata(tensor) != self.saved_metadata[index]:
            raise self.mismatch(
                f"produced a different saved tensor #{index}: the forward pass saved "
                f"{_describe(self.saved_metadata[index])}, recomputation saved "
                f"{_describe(_metadata(tensor))}"
            )
        # A tensor the region did not make (a parameter, a buffer, a tensor it closes over) is
        # saved as itself again: changed in place since the forward pass, it would silently
        # change the gradient. Autograd checks this for the tensors it keeps; we keep none, so
        # we check instead. What the region makes comes back at the version it had then.
        version = _version_of(tensor)
        if version != self.saved_versions[index]:
            raise CheckpointError(
                f"gradckpt: recomputing region {self.name!r} saved tensor #{index} "
                f"({_describe(_metadata(tensor))}) at version {version}, where the forward "
                f"pass saved it at version {self.saved_versions[index]}: a tensor the region "
                "uses (a parameter, a buffer, a tensor it closes over) was changed in place "
                "between the forward pass and backward, for example by optimizer.step() before "
                "backward(). Plain autograd refuses this too: finish backward before changing "
                "it, or change a copy."
            )
        # Same shape, another operation (relu in the forward, sigmoid in recomputation): the
        # node that produced it tells. Region inputs are fresh leaves in recomputation (no node).
        producer = _producer(tensor)
        forward_producer = self.saved_by[index]
        if None not in (producer, forward_producer) and producer is not forward_producer:
            raise self.mismatch(
                f"produced saved tensor #{index} ({_describe(_metadata(tensor))}) with "
                f"{producer.__name__}, where the forward pass produced it with "
                f"{forward_producer.__name__}"
            )
        # Detached: the slot must not keep the recomputed graph (and a cycle through it) alive.
        with _engine_internal():
            tensor = tensor.detach()
        slot = self.slots[index]()
        if slot is not None:  # None: that part of the graph is gone already
            slot.tensors[recomputation.graph_id] = tensor
        if recomputation.filled == len(self.slots):
            raise _RecomputationComplete
        return save

    def recompute_inputs(self) -> tuple[tuple, dict]:
        # Unpacking may recompute a parent region first (R2).
        try:
            saved = self.input_node.saved_tensors
        except RuntimeError as error:
            if "modified by an inplace operation" not in str(error):
                raise
            raise CheckpointError(
                f"gradckpt: an input of region {self.name!r} was changed in place after the "
                "region ran, and recomputation starts from the inputs. Change a copy instead "
                "(x = x.clone() before the in-place operation), or run backward first. "
                f"Autograd's message: {error}"
            ) from error
        leaves = list(self.other_leaves)
        for position, tensor, requires_grad in zip(
            self.tensor_positions, saved, self.input_requires_grad, strict=True
        ):
            # Detached so the recomputed graph stays separate from the real one, with the same
            # requires_grad so autograd saves exactly what it saved in the forward pass.
            leaves[position] = tensor.detach().requires_grad_(requires_grad)
        return tree_unflatten(leaves, self.input_spec)

    def drop_recomputed(self, graph_id: int) -> None:
        for slot_ref in self.slots:
            slot = slot_ref()
            if slot is not None:
                slot.tensors.pop(graph_id, None)

    def mismatch(self, what_differed: str) -> CheckpointError:
        """The error for a recomputation that did not reproduce the forward (invariant 7)."""
        return CheckpointError(
            f"gradckpt: recomputing region {self.name!r} {what_differed}. The region does not "
            "compute the same thing twice (data-dependent control flow, or state that changed "
            "between forward and backward)." + self.fates.where_diverged()
        )


class _Recomputation:
    """One recomputation of a region for one backward pass (graph task ``graph_id``): how many
    saved tensors it has filled, and what the graph it builds holds (R6).

    That graph is thrown away when recomputation ends, unless the region left a reference to
    it behind: a module that keeps a state it computed as an attribute (a recurrent block's
    last state, ``self.state = h``). Through its saved tensors the graph holds what they were
    packed into (``_RecomputedSave``) and the pack hook, this object's ``pack``; ``release``
    empties both, so that all it keeps is a few bytes of nodes and not the block's
    recomputed activations and, through the region, its inputs, until the next forward pass
    replaces the attribute.
    """

    __slots__ = ("region", "graph_id", "filled", "saves")

    def __init__(self, region: _Region, graph_id: int) -> None:
        self.region: _Region | None = region
        self.graph_id = graph_id
        self.filled = 0
        self.saves: list[_RecomputedSave] = []

    def pack(self, tensor: torch.Tensor) -> _RecomputedSave:
        return self.region.pack_during_recompute(self, tensor)

    def release(self) -> None:
        for save in self.saves:
            save.tensor = None
        self.saves.clear()
        self.region = None


def _drop_recomputed(region_ref: weakref.ref[_Region], graph_id: int) -> None:
    region = region_ref()
    if region is not None:
        region.drop_recomputed(graph_id)
        region.graphs_with_cleanup.discard(graph_id)


def _unpack(slot: _Slot) -> torch.Tensor:
    return slot.region.unpack(slot)


class _RecomputedSave:
    """What the graph built by recomputation saves in place of a tensor: the tensor while
    recomputation runs (a forward that runs backward inside itself reads it), nothing after
    (R6)."""

    __slots__ = ("tensor",)

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor: torch.Tensor | None = tensor


def _unpack_recomputed(save: _RecomputedSave) -> torch.Tensor:
    if save.tensor is None:
        raise CheckpointError(
            "gradckpt: backward through a graph that recomputation built, after the "
            "recomputation ended (a tensor the region kept somewhere, such as a module "
            "attribute, read again after its backward): its saved tensors are freed, as "
            "autograd frees a graph's after backward. Use the tensor the forward pass returned."
        )
    return save.tensor


def _hooks(
    mode: _FatePerOpMode | None,
    pack: Callable[[torch.Tensor], Any],
    unpack: Callable[[Any], torch.Tensor],
) -> list[contextlib.AbstractContextManager]:
    """The context managers of one pass of a region, to enter in this order."""
    saved_tensors = torch.autograd.graph.saved_tensors_hooks(pack, unpack)
    return [saved_tensors] if mode is None else [mode, saved_tensors]


def _run_checkpointed(
    fn: Callable[..., Any],
    args: tuple,
    kwargs: dict,
    *,
    name: str | None,
    policy: PolicyLike,
    preserve_rng_state: bool,
) -> Any:
    if not callable(fn):
        raise UsageError(
            f"checkpoint() needs a callable as its first argument (a module or function), "
            f"got {type(fn).__name__}"
        )
    if not torch.is_grad_enabled():  # invariant 3: nothing to recompute without a backward
        return fn(*args, **kwargs)
    region = _Region(
        fn,
        name=name or _name_of(fn),
        policy=resolve_policy(policy),
        preserve_rng_state=preserve_rng_state,
        debug=_debug_state.enabled,
    )
    region.save_inputs(args, kwargs)
    with contextlib.ExitStack() as stack:
        for hook in region.forward_hooks():
            stack.enter_context(hook)
        output = fn(*args, **kwargs)
    if region.ambient.random_without_replay():
        warn_once(
            "random-without-replay",
            f"checkpointed region {region.name!r} draws random numbers (dropout?) with "
            "preserve_rng_state=False: its recomputation draws different ones, so its "
            "gradients are not those of the forward pass. Leave preserve_rng_state=True, or "
            "turn the randomness off (model.eval(), dropout p=0).",
            stacklevel=4,
        )
    return output


def _name_of(fn: Callable[..., Any]) -> str:
    # _get_name: the class name as the user wrote it (and repr shows it), not our wrapper's.
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        return owner._get_name()
    if isinstance(fn, torch.nn.Module):
        return fn._get_name()
    return getattr(fn, "__qualname__", None) or type(fn).__name__

