"""The checkpoint engine: run a region so that what it saves for backward gets a fate.

``checkpoint(fn, *args, **kwargs)`` runs ``fn`` once, normally, but every tensor that autograd
would save for the backward pass is handed to us instead (``saved_tensors_hooks``). We keep only a
small "slot" per saved tensor; when backward asks for one, we run ``fn`` again on the same inputs
(with the same RNG and autocast state) and hand out the tensors this recomputation saves. A policy
can mark operations whose outputs are kept, or offloaded to CPU memory, instead of recomputed.

Invariants (DESIGN.md, "Engine invariants"; tests cite them by number):

1. Gradients, outputs and parameter updates equal the plain model's, bit for bit where the ops
   are deterministic, dropout included: RNG state is replayed for the CPU and every device.
2. Recomputation has no side effect a user can see: module buffers (BatchNorm running
   statistics) end the step as if each block ran forward once. Module hooks do run again.
3. Without grad (``no_grad``, ``inference_mode``) the engine does nothing at all.
4. Frozen inputs work: a region whose inputs do not require grad still gives its parameters
   their gradients.
5. Keyword arguments, non-tensor outputs, nested checkpoints, ``torch.autograd.grad``,
   ``backward(retain_graph=True)`` twice and autocast behave as without checkpointing.
6. Recomputation stops as soon as the tensors backward needs exist, and frees them after use.
7. A mismatch between forward and recomputation is a ``CheckpointError``, never a wrong grad.

How nesting and lifetimes work (the rules the code below implements):

R1. A saved tensor belongs to the innermost active checkpoint only (its hooks are on top).
R2. A checkpoint saves its own inputs through a no-op autograd node. At top level that simply
    keeps them; inside another checkpoint they become that parent's saved tensors, so the parent
    drops them and recomputing the parent brings them back. Recomputing a tensor therefore
    recomputes every checkpoint around it, outermost first.
R3. Recomputation starts as if no checkpoint were active; checkpoints met while recomputing are
    respected (so a nested schedule recomputes the inner segment again, with bounded memory).
R4. Recomputed tensors belong to one backward pass (its graph task id). Each is handed out once
    and dropped; whatever that backward never asked for is dropped when it ends.
R5. Recomputation raises ``_RecomputationComplete`` the moment the last slot is filled, which
    skips the rest of the region (invariant 6).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import threading
import traceback
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten, tree_map_only, tree_unflatten

from .errors import CheckpointError, UsageError
from .policies import Fate, Policy, PolicyLike, resolve_policy

__all__ = [
    "checkpoint",
    "checkpoint_module",
    "uncheckpoint_module",
    "is_checkpointed",
    "debug_mode",
]


# --------------------------------------------------------------------------------------------
# Public entry points
# --------------------------------------------------------------------------------------------


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


@contextlib.contextmanager
def debug_mode(enabled: bool = True) -> Iterator[None]:
    """Record every operation (with its source line) in checkpointed regions run inside.

    When recomputation then diverges from the forward pass, the ``CheckpointError`` shows the
    first operation that differed and where each was called from. It works together with
    policies. Costly: use it to find a bug, not to train. ``GRADCKPT_DEBUG=1`` turns it on
    for the whole process.

    Example:
        >>> import torch, gradckpt
        >>> with gradckpt.debug_mode():
        ...     y = gradckpt.checkpoint(torch.sin, torch.ones(2, requires_grad=True))
        >>> y.sum().backward()
    """
    previous = _debug_state.enabled
    _debug_state.enabled = enabled
    try:
        yield
    finally:
        _debug_state.enabled = previous


class _DebugState(threading.local):
    enabled = os.environ.get("GRADCKPT_DEBUG", "") not in ("", "0")


_debug_state = _DebugState()


class _InternalWork(threading.local):
    """Set while the engine itself runs tensor operations inside a region (copying buffers,
    detaching saved tensors): the policy mode must neither count nor log those, or forward and
    recomputation would seem to differ. Outer modes (e.g. MemTracker) still see them."""

    active = False


_internal_work = _InternalWork()


@contextlib.contextmanager
def _engine_internal() -> Iterator[None]:
    previous = _internal_work.active
    _internal_work.active = True
    try:
        yield
    finally:
        _internal_work.active = previous


# --------------------------------------------------------------------------------------------
# One checkpointed call: the region
# --------------------------------------------------------------------------------------------


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
        self.policy = policy
        self.debug = debug
        self.preserve_rng_state = preserve_rng_state
        self.slots: list[weakref.ref[_Slot]] = []
        self.saved_metadata: list[tuple[torch.Size, torch.dtype, torch.device]] = []
        self.saved_by: list[type | None] = []  # what made each saved tensor (_producer)
        self.op_records: list[_OpRecord] = []
        self.forward_log: list[str] = []
        self.recompute_log: list[str] = []
        self.graphs_with_cleanup: set[int] = set()

    # ---- forward ----------------------------------------------------------------------------

    def save_inputs(self, args: tuple, kwargs: dict) -> None:
        leaves, self.input_spec = tree_flatten((args, kwargs))
        self.tensor_positions = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        tensors = [leaves[i] for i in self.tensor_positions]
        self.input_requires_grad = [t.requires_grad for t in tensors]
        self.other_leaves = [None if isinstance(x, torch.Tensor) else x for x in leaves]
        anchor = torch.empty(0, requires_grad=True)
        self.input_node = _SaveInputs.apply(anchor, *tensors).grad_fn
        self.rng = _RngSnapshot(tensors) if self.preserve_rng_state else None
        self.autocast = _AutocastSnapshot(tensors)

    def pack_during_forward(self, tensor: torch.Tensor) -> _Slot:
        slot = _Slot(self)
        self.slots.append(weakref.ref(slot))
        self.saved_metadata.append(_metadata(tensor))
        self.saved_by.append(_producer(tensor))
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
        filled = _FillCounter()
        self.recompute_log = []
        with contextlib.ExitStack() as stack:
            stack.enter_context(torch.enable_grad())
            if self.rng is not None:
                stack.enter_context(self.rng.replayed())
            stack.enter_context(self.autocast.replayed())
            stack.enter_context(_BufferGuard())
            if self.policy is not None or self.debug:
                stack.enter_context(_PolicyMode(self, recomputing=True))
            stack.enter_context(
                torch.autograd.graph.saved_tensors_hooks(
                    functools.partial(self.pack_during_recompute, graph_id, filled),
                    _identity,
                )
            )
            try:
                self.fn(*args, **kwargs)
            except _RecomputationComplete:
                pass
        if filled.count < len(self.slots):
            raise self.mismatch(
                f"saved {filled.count} tensors for backward but its forward pass saved "
                f"{len(self.slots)}"
            )

    def pack_during_recompute(
        self, graph_id: int, filled: _FillCounter, tensor: torch.Tensor
    ) -> torch.Tensor:
        index = filled.count
        filled.count += 1
        if index >= len(self.slots):
            # Only reachable when the forward itself ran backward before finishing (R5 normally
            # stops us at len(slots)); then the extra tensors are the forward's own business.
            return tensor
        if _metadata(tensor) != self.saved_metadata[index]:
            raise self.mismatch(
                f"produced a different saved tensor #{index}: the forward pass saved "
                f"{_describe(self.saved_metadata[index])}, recomputation saved "
                f"{_describe(_metadata(tensor))}"
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
            slot.tensors[graph_id] = tensor
        if filled.count == len(self.slots):
            raise _RecomputationComplete
        return tensor

    def recompute_inputs(self) -> tuple[tuple, dict]:
        # Unpacking may recompute a parent region first (R2).
        saved = self.input_node.saved_tensors
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
        if self.debug:
            where = "\n" + _first_divergence(self.forward_log, self.recompute_log)
        else:
            where = " Run the step under gradckpt.debug_mode() to see where it diverged."
        return CheckpointError(
            f"gradckpt: recomputing region {self.name!r} {what_differed}. The region does not "
            "compute the same thing twice (data-dependent control flow, or state that changed "
            "between forward and backward)." + where
        )


class _FillCounter:
    __slots__ = ("count",)

    def __init__(self) -> None:
        self.count = 0


def _drop_recomputed(region_ref: weakref.ref[_Region], graph_id: int) -> None:
    region = region_ref()
    if region is not None:
        region.drop_recomputed(graph_id)
        region.graphs_with_cleanup.discard(graph_id)


def _unpack(slot: _Slot) -> torch.Tensor:
    return slot.region.unpack(slot)


def _identity(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _metadata(tensor: torch.Tensor) -> tuple[torch.Size, torch.dtype, torch.device]:
    return (tensor.shape, tensor.dtype, tensor.device)


def _producer(tensor: torch.Tensor) -> type | None:
    """The type of autograd node that made a saved tensor, where it identifies the operation.

    None for leaves (region inputs are fresh leaves in recomputation) and for views: autograd
    may record the same reshape as ViewBackward0 once and ReshapeAliasBackward0 the next time.
    """
    node = tensor.grad_fn
    if node is None or tensor._is_view():
        return None
    return type(node)


def _describe(metadata: tuple[torch.Size, torch.dtype, torch.device]) -> str:
    shape, dtype, device = metadata
    return f"{str(dtype).removeprefix('torch.')}{list(shape)} on {device}"


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
        if region.policy is not None or region.debug:
            stack.enter_context(_PolicyMode(region, recomputing=False))
        stack.enter_context(
            torch.autograd.graph.saved_tensors_hooks(region.pack_during_forward, _unpack)
        )
        return fn(*args, **kwargs)


def _name_of(fn: Callable[..., Any]) -> str:
    # _get_name: the class name as the user wrote it (and repr shows it), not our wrapper's.
    owner = getattr(fn, "__self__", None)
    if isinstance(owner, torch.nn.Module):
        return owner._get_name()
    if isinstance(fn, torch.nn.Module):
        return fn._get_name()
    return getattr(fn, "__qualname__", None) or type(fn).__name__


# --------------------------------------------------------------------------------------------
# Replaying RNG and autocast, guarding buffers
# --------------------------------------------------------------------------------------------


def _current_accelerator() -> torch.device | None:
    """The process's accelerator (CUDA, XPU, MPS, ...), or None on a CPU-only machine."""
    accelerator_api = getattr(torch, "accelerator", None)  # torch >= 2.6
    if accelerator_api is not None:
        return accelerator_api.current_accelerator() if accelerator_api.is_available() else None
    return torch.device("cuda") if torch.cuda.is_available() else None


def _accelerator_devices(tensors: list[torch.Tensor]) -> list[torch.device]:
    """Every non-CPU device whose RNG the region may draw from.

    The devices of the inputs, plus every device of the process's accelerator once it is
    initialized: a region can create tensors on a device none of its inputs live on, and
    ``torch.utils.checkpoint`` would then replay the wrong RNG stream.
    """
    devices = {t.device for t in tensors if t.device.type not in ("cpu", "meta")}
    accelerator = _current_accelerator()
    if accelerator is not None:
        module = torch.get_device_module(accelerator.type)
        initialized = getattr(module, "is_initialized", lambda: True)()
        if initialized:
            devices.update(
                torch.device(accelerator.type, index) for index in range(module.device_count())
            )
    return sorted(devices, key=str)


class _RngSnapshot:
    """The RNG state of the CPU and every accelerator device at the start of a region."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.cpu_state = torch.get_rng_state()
        self.device_states = {
            device: torch.get_device_module(device.type).get_rng_state(device)
            for device in _accelerator_devices(tensors)
        }

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        # Replay the region's RNG, then put the caller's back: recomputation must not shift the
        # random stream of whatever runs after it (invariant 2).
        caller_cpu = torch.get_rng_state()
        caller_devices = {
            device: torch.get_device_module(device.type).get_rng_state(device)
            for device in self.device_states
        }
        torch.set_rng_state(self.cpu_state)
        for device, state in self.device_states.items():
            torch.get_device_module(device.type).set_rng_state(state, device)
        try:
            yield
        finally:
            torch.set_rng_state(caller_cpu)
            for device, state in caller_devices.items():
                torch.get_device_module(device.type).set_rng_state(state, device)


class _AutocastSnapshot:
    """Autocast settings (per device type) at the start of a region, replayed exactly."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        device_types = {"cpu"} | {t.device.type for t in tensors if t.device.type != "meta"}
        accelerator = _current_accelerator()
        if accelerator is not None:
            device_types.add(accelerator.type)
        self.cache_enabled = torch.is_autocast_cache_enabled()
        self.settings = {
            kind: (torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
            for kind in sorted(device_types)
        }

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            for device_type, (enabled, dtype) in self.settings.items():
                stack.enter_context(
                    torch.autocast(
                        device_type, dtype=dtype, enabled=enabled, cache_enabled=self.cache_enabled
                    )
                )
            yield


class _BufferGuard:
    """Puts module buffers back as they were before recomputation (invariant 2).

    A global forward pre-hook (active on this thread only while recomputing) copies the buffers of
    every module the region calls before it runs; afterwards every one of them gets its old value
    back. All of them, not just those whose version counter moved: BatchNorm's kernel updates its
    running statistics without bumping the counter.
    """

    def __enter__(self) -> _BufferGuard:
        self.thread = threading.get_ident()
        self.snapshots: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.hook = torch.nn.modules.module.register_module_forward_pre_hook(self.remember)
        return self

    def remember(self, module: torch.nn.Module, args: Any) -> None:
        if threading.get_ident() != self.thread:
            return
        with _engine_internal():
            for buffer in module._buffers.values():
                if buffer is not None and id(buffer) not in self.snapshots:
                    self.snapshots[id(buffer)] = (buffer, buffer.detach().clone())

    def __exit__(self, *exc_info: Any) -> None:
        self.hook.remove()
        with torch.no_grad(), _engine_internal():
            for buffer, copy in self.snapshots.values():
                buffer.copy_(copy)


# --------------------------------------------------------------------------------------------
# Per-operation fates: keep, recompute, offload
# --------------------------------------------------------------------------------------------


class _OpRecord:
    """One policy-asked operation of the forward pass: what it was, its fate, what we stored."""

    __slots__ = ("op", "fate", "stored", "mutated_later")

    def __init__(self, op: torch._ops.OpOverload, fate: Fate, stored: Any) -> None:
        self.op = op
        self.fate = fate
        self.stored = stored
        self.mutated_later = False

    def protect_from_mutation(self) -> None:
        """The region is about to modify this output in place: stop sharing memory with it.

        Otherwise recomputation would hand back the modified value and apply the in-place
        operation a second time.
        """
        self.mutated_later = True
        if self.fate is Fate.KEEP:
            self.stored = tree_map_only(torch.Tensor, torch.Tensor.clone, self.stored)
        else:
            self.stored.finish_before_mutation()

    @property
    def handed_out(self) -> bool:
        """A kept output already given to a recomputation: a later one must run the op again."""
        return self.fate is Fate.KEEP and self.stored is None

    def replay(self) -> Any:
        if self.fate is Fate.OFFLOAD:
            return self.stored.restore(fresh_copy=self.mutated_later)
        # Kept outputs are handed over, not shared: the recomputation's graph holds them while
        # its backward needs them, and an output it never saves is freed as soon as the
        # recomputation has used it (as torch's selective checkpointing does). Holding on
        # until the region dies would add every kept output that backward does not save to
        # the step's peak. The rare second backward (retain_graph=True) recomputes the op.
        # A fresh alias, so autograd's bookkeeping on it never leaks into the region.
        stored, self.stored = self.stored, None
        return tree_map_only(torch.Tensor, torch.Tensor.detach, stored)


def _first_tensor(tree: Any) -> torch.Tensor | None:
    """The first tensor in a (possibly nested) output: an op's primary output, a block's hidden
    state."""
    return next((leaf for leaf in tree_flatten(tree)[0] if isinstance(leaf, torch.Tensor)), None)


def _detached_like(tensor: torch.Tensor) -> torch.Tensor:
    """A detached alias that requires grad exactly when the original does."""
    return tensor.detach().requires_grad_(tensor.requires_grad)


def _storage_key(tensor: torch.Tensor) -> int | None:
    try:
        return tensor.untyped_storage().data_ptr()
    except (RuntimeError, NotImplementedError):  # tensors without storage (sparse, fakes)
        return None


def _asks_policy(op: torch._ops.OpOverload) -> bool:
    # Views and in-place operations alias tensors that exist anyway: nothing to keep.
    return not op.is_view and not op._schema.is_mutable


class _PolicyMode(TorchDispatchMode):
    """Sees every ATen operation of a region.

    Forward: asks the policy about each operation that makes new tensors and keeps or offloads
    the outputs it chooses. Recomputation: hands those back instead of running the operation
    again, after checking that the same operation comes at the same position (invariant 7).
    In debug mode it also logs every operation with the line of user code that called it.
    """

    def __init__(self, region: _Region, recomputing: bool) -> None:
        super().__init__()
        self.region = region
        self.recomputing = recomputing
        self.position = 0
        self.watched: dict[int | None, list[_OpRecord]] = {}  # storage -> records sharing it
        self.log = region.recompute_log if recomputing else region.forward_log
        if recomputing:
            for record in region.op_records:
                if record.fate is Fate.OFFLOAD:
                    record.stored.prefetch()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        region = self.region
        if _internal_work.active:
            return func(*args, **kwargs)
        if region.debug:
            self.log.append(f"{func}  ({_user_frame()})")
        if region.policy is None:
            return func(*args, **kwargs)
        if not _asks_policy(func):
            if self.watched and func._schema.is_mutable and not self.recomputing:
                with _engine_internal():
                    self.protect_inputs(args, kwargs)
            return func(*args, **kwargs)
        if self.recomputing:
            return self.replay(func, args, kwargs)
        output = func(*args, **kwargs)
        # The policy's and our own tensor work must stay invisible to the policy mode of an
        # enclosing region, or that region's recomputation would see different operations.
        with _engine_internal():
            self.record(func, output)
        return output

    def record(self, func: torch._ops.OpOverload, output: Any) -> None:
        region = self.region
        first = _first_tensor(output)
        fate = Fate.RECOMPUTE if first is None else region.policy(func, first)
        if not isinstance(fate, Fate):
            raise UsageError(
                f"checkpoint policy {region.policy!r} returned {fate!r} for {func}; "
                "a policy must return gradckpt.Fate.KEEP, .RECOMPUTE or .OFFLOAD"
            )
        if fate is Fate.KEEP:
            stored = tree_map_only(torch.Tensor, torch.Tensor.detach, output)
        elif fate is Fate.OFFLOAD:
            stored = _Offloaded(output)
        else:
            stored = None
        record = _OpRecord(func, fate, stored)
        region.op_records.append(record)
        if fate is not Fate.RECOMPUTE:
            for tensor in tree_flatten(output)[0]:
                if isinstance(tensor, torch.Tensor) and _storage_key(tensor) is not None:
                    self.watched.setdefault(_storage_key(tensor), []).append(record)

    def protect_inputs(self, args: tuple, kwargs: dict) -> None:
        # Over-approximates "the mutated arguments" by all tensor arguments: a needless copy in a
        # rare case is cheaper than reading every schema's alias annotations on every call.
        for tensor in tree_flatten((args, kwargs))[0]:
            if isinstance(tensor, torch.Tensor):
                for record in self.watched.pop(_storage_key(tensor), ()):
                    record.protect_from_mutation()

    def replay(self, func, args, kwargs):  # noqa: ANN001
        region = self.region
        position = self.position
        self.position += 1
        record = region.op_records[position] if position < len(region.op_records) else None
        if record is None or record.op is not func:
            expected = record.op if record is not None else "nothing (the forward had ended)"
            raise region.mismatch(
                f"ran {func} as operation #{position}, where the forward pass ran {expected}"
            )
        if record.fate is Fate.RECOMPUTE or record.handed_out:
            return func(*args, **kwargs)
        with _engine_internal():
            return record.replay()


class _Offloaded:
    """An operation's outputs moved to CPU memory, and the way back (tree of ``_HostCopy``)."""

    def __init__(self, output: Any) -> None:
        leaves, self.spec = tree_flatten(output)
        self.entries = [_HostCopy(x) if isinstance(x, torch.Tensor) else x for x in leaves]

    def copies(self) -> list[_HostCopy]:
        return [entry for entry in self.entries if isinstance(entry, _HostCopy)]

    def prefetch(self) -> None:
        for copy in self.copies():
            copy.prefetch()

    def finish_before_mutation(self) -> None:
        for copy in self.copies():
            copy.finish_before_mutation()

    def restore(self, fresh_copy: bool) -> Any:
        leaves = [
            entry.restore(fresh_copy) if isinstance(entry, _HostCopy) else entry
            for entry in self.entries
        ]
        return tree_unflatten(leaves, self.spec)


class _HostCopy:
    """One tensor in CPU memory while the forward goes on, back on its device for backward.

    On an accelerator the copy runs on a side stream into pinned memory, so it overlaps with the
    rest of the forward; recomputation starts copying a region's tensors back all at once
    (prefetch) and waits for each one only when it is needed. On the CPU there is nowhere cheaper
    to put a tensor: it is simply kept (documented: OFFLOAD is KEEP for CPU-resident models).
    """

    def __init__(self, tensor: torch.Tensor) -> None:
        self.device = tensor.device
        self.on_accelerator = tensor.device.type not in ("cpu", "meta")
        self.back: tuple[torch.Tensor, Any] | None = None
        if not self.on_accelerator:
            self.host = tensor.detach()
            return
        module = torch.get_device_module(self.device.type)
        stream = _side_stream(self.device)
        stream.wait_stream(module.current_stream(self.device))  # the tensor must be written first
        with module.stream(stream):
            self.host = torch.empty_like(tensor, device="cpu", pin_memory=True)
            self.host.copy_(tensor.detach(), non_blocking=True)
            self.copied = stream.record_event()
        # The allocator must not hand the tensor's memory to anyone before the copy has read it.
        tensor.record_stream(stream)

    def finish_before_mutation(self) -> None:
        if not self.on_accelerator:
            self.host = self.host.clone()
            return
        module = torch.get_device_module(self.device.type)
        module.current_stream(self.device).wait_event(self.copied)

    def prefetch(self) -> None:
        if not self.on_accelerator or self.back is not None:
            return
        module = torch.get_device_module(self.device.type)
        stream = _side_stream(self.device)
        with module.stream(stream):
            tensor = torch.empty_like(self.host, device=self.device)
            tensor.copy_(self.host, non_blocking=True)
            self.back = (tensor, stream.record_event())

    def restore(self, fresh_copy: bool) -> torch.Tensor:
        if not self.on_accelerator:
            return self.host.clone() if fresh_copy else self.host.detach()
        self.prefetch()
        tensor, ready = self.back
        self.back = None  # drop our reference: backward owns the tensor from here (invariant 6)
        current = torch.get_device_module(self.device.type).current_stream(self.device)
        current.wait_event(ready)
        tensor.record_stream(current)  # made on the side stream, used and freed on this one
        return tensor


_side_streams: dict[torch.device, Any] = {}


def _side_stream(device: torch.device) -> Any:
    if device not in _side_streams:
        _side_streams[device] = torch.get_device_module(device.type).Stream(device)
    return _side_streams[device]


# --------------------------------------------------------------------------------------------
# Debug-mode reporting
# --------------------------------------------------------------------------------------------

_ENGINE_FILES = (os.sep + "torch" + os.sep, __file__)


def _user_frame() -> str:
    for frame in reversed(traceback.extract_stack()):
        if not any(part in frame.filename for part in _ENGINE_FILES):
            return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return "unknown location"


def _first_divergence(forward_log: list[str], recompute_log: list[str]) -> str:
    pairs = zip(forward_log, recompute_log, strict=False)
    for position, (forward_op, recomputed_op) in enumerate(pairs):
        if forward_op.split()[0] != recomputed_op.split()[0]:
            return (
                f"First operation that differed (#{position}):\n"
                f"  forward:       {forward_op}\n"
                f"  recomputation: {recomputed_op}"
            )
    return (
        f"The operations agreed for {min(len(forward_log), len(recompute_log))} steps; the forward "
        f"ran {len(forward_log)} operations, recomputation {len(recompute_log)}. Last forward "
        f"operation: {forward_log[-1] if forward_log else 'none'}"
    )


# --------------------------------------------------------------------------------------------
# The module form
# --------------------------------------------------------------------------------------------


class _CheckpointSettings:
    __slots__ = ("policy", "preserve_rng_state", "name")

    def __init__(self, policy: PolicyLike, preserve_rng_state: bool, name: str | None) -> None:
        self.policy = policy
        self.preserve_rng_state = preserve_rng_state
        self.name = name

    def __reduce__(self) -> Any:
        return (_CheckpointSettings, (self.policy, self.preserve_rng_state, self.name))


class _CheckpointedModule(torch.nn.Module):
    """Mixin placed in front of a module's own class by ``checkpoint_module``.

    It wraps the module's whole call, hooks included, so hooks run again in recomputation
    (FSDP2 re-gathers parameters in them). Only the class changes: parameters, buffers, names,
    ``state_dict`` keys and ``repr`` stay exactly as they were.
    """

    _gradckpt_original_class: type[torch.nn.Module]

    def _call_impl(self, *args: Any, **kwargs: Any) -> Any:
        settings: _CheckpointSettings = self.__dict__["_gradckpt_settings"]
        return _run_checkpointed(
            super()._call_impl,
            args,
            kwargs,
            name=settings.name,
            policy=settings.policy,
            preserve_rng_state=settings.preserve_rng_state,
        )

    def _get_name(self) -> str:
        return self._gradckpt_original_class.__name__

    def __reduce_ex__(self, protocol: Any) -> Any:
        # Pickle and deepcopy as the original class, then wrap again on load: the generated
        # class is not importable by name.
        wrapped_class = type(self)
        self.__class__ = self._gradckpt_original_class
        try:
            plain = self.__reduce_ex__(protocol)
        finally:
            self.__class__ = wrapped_class
        return (_rebuild_checkpointed, (plain,))


def _rebuild_checkpointed(plain: tuple) -> torch.nn.Module:
    constructor, constructor_args, *rest = plain
    module = constructor(*constructor_args)
    state = rest[0] if rest else None
    if state is not None:
        if hasattr(module, "__setstate__"):
            module.__setstate__(state)
        else:
            module.__dict__.update(state)
    module.__class__ = _checkpointed_class(type(module))
    return module


_checkpointed_classes: dict[type, type] = {}


def _checkpointed_class(original: type[torch.nn.Module]) -> type[torch.nn.Module]:
    if original not in _checkpointed_classes:
        _checkpointed_classes[original] = type(
            f"Checkpointed{original.__name__}",
            (_CheckpointedModule, original),
            {"_gradckpt_original_class": original, "__module__": original.__module__},
        )
    return _checkpointed_classes[original]


def checkpoint_module(
    module: torch.nn.Module,
    policy: PolicyLike = None,
    preserve_rng_state: bool = True,
    name: str | None = None,
) -> torch.nn.Module:
    """Make every call of ``module`` run through the checkpoint engine, in place.

    Parameter names, ``state_dict`` keys, ``repr`` and outputs stay exactly as they were; only
    what the module's forward saves for backward changes. Calling it again on a checkpointed
    module replaces its settings. ``uncheckpoint_module`` undoes it.

    Args:
        module: the block to checkpoint (one transformer layer, a stage of a CNN, ...).
        policy: as for ``checkpoint``: ``None``, a preset name or a callable.
        preserve_rng_state: as for ``checkpoint``.
        name: how errors refer to this region (default: the class name).

    Example:
        >>> import torch, gradckpt
        >>> block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU())
        >>> keys = list(block.state_dict())
        >>> _ = gradckpt.checkpoint_module(block, policy="save-matmuls")
        >>> list(block.state_dict()) == keys
        True
        >>> block(torch.randn(2, 8, requires_grad=True)).sum().backward()
        >>> _ = gradckpt.uncheckpoint_module(block)
        >>> gradckpt.is_checkpointed(block)
        False
    """
    if not isinstance(module, torch.nn.Module):
        raise UsageError(
            f"checkpoint_module() needs a torch.nn.Module, got {type(module).__name__}; "
            "for a plain function use gradckpt.checkpoint(fn, *args)"
        )
    resolve_policy(policy)  # fail now, not in the middle of the first training step
    module.__dict__["_gradckpt_settings"] = _CheckpointSettings(policy, preserve_rng_state, name)
    if not is_checkpointed(module):
        module.__class__ = _checkpointed_class(type(module))
    return module


def uncheckpoint_module(module: torch.nn.Module) -> torch.nn.Module:
    """Undo ``checkpoint_module``: the module runs exactly as before. A no-op if not checkpointed.

    Example:
        >>> import torch, gradckpt
        >>> block = gradckpt.checkpoint_module(torch.nn.Linear(4, 4))
        >>> type(gradckpt.uncheckpoint_module(block)) is torch.nn.Linear
        True
    """
    if is_checkpointed(module):
        module.__class__ = module._gradckpt_original_class
        module.__dict__.pop("_gradckpt_settings", None)
    return module


def is_checkpointed(module: torch.nn.Module) -> bool:
    """Whether ``checkpoint_module`` is in effect on ``module``.

    Example:
        >>> import torch, gradckpt
        >>> gradckpt.is_checkpointed(torch.nn.Linear(2, 2))
        False
    """
    return isinstance(module, _CheckpointedModule)
