"""The memory meter: bytes allocated on one device, now and at their highest.

Memory is measured, never guessed, with the two reference measures a budget is defined by
(docs/planning.md, "What `profile` measures"):

- on CUDA, the caching allocator's own statistics (``torch.cuda.memory_allocated``,
  ``max_memory_allocated``);
- on CPU, ``torch.distributed._tools.mem_tracker.MemTracker``, the "Total" of its snapshots.
  MemTracker only sees tensors created inside it and tensors registered with it, so pass
  everything that lives across the measured code (model, optimizer, inputs) as ``tracked``.

torch 2.13's MemTracker puts a gradient hook on every parameter of every module it sees, and
``register_hook`` raises for a parameter that does not require grad: any frozen parameter
(LoRA's base, a frozen embedding) crashed it. ``_MemTracker`` installs those hooks only on
parameters that can have a gradient; a frozen one never has one to count, so what is counted
does not change (``tests/measure/test_measure_meter.py`` checks that both agree to the byte
where MemTracker works).
"""

from __future__ import annotations

import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

from . import clock
from .device import infer_device

__all__ = ["MemoryMeter", "measure_peak_bytes", "running_meter"]


class MemoryMeter:
    """Allocated bytes on ``device`` now (``current()``) and the most since the meter started or
    since ``reset_peak()`` (``peak()``).

    On CUDA the allocator knows both. On CPU, MemTracker counts what exists (``tracked``: what
    was made before the meter started; everything made inside it), and the meter reads its
    current total after every operation: unlike a MemTracker started just for a part of a step,
    that sees the part's frees of older tensors too (a backward pass frees what the forward
    saved).

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(256, 256)
        >>> x = torch.randn(64, 256)
        >>> with MemoryMeter("cpu", model, x) as meter:
        ...     before = meter.current()
        ...     model(x).sum().backward()
        >>> meter.peak() >= before + 4 * 256 * 256  # the weight's gradient, at least
        True
    """

    def __init__(self, device: torch.device | str, *tracked: Any) -> None:
        self.device = torch.device(device)
        if self.device.type not in ("cpu", "cuda"):
            raise ValueError(f"the memory meter supports cpu and cuda, not {self.device.type!r}")
        self._tracked = trackable(tracked)
        self._tracker: Any = None
        self._highest = 0
        self._exited = False
        # On CPU: the operations seen so far, and, once ``trace`` is a list, the total after
        # each (``stand_ins`` compares identical blocks' memory operation by operation).
        self.operations = 0
        self.trace: list[int] | None = None

    def __enter__(self) -> MemoryMeter:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            _entered.meters.append(self)
            return self
        # On fake tensors (``estimate``, under a modeled clock) the tracker runs without the
        # Dynamo guard TorchDispatchMode puts around each dispatch: nothing is compiled there.
        self._tracker = _mem_tracker(guarded=not clock.modeled())
        if self._tracked:
            self._tracker.track_external(*self._tracked)
        # MemTracker keeps what it needs; holding them here would keep alive for the whole
        # measurement what the measured code lets go (a loop's previous output).
        self._tracked = []
        # The tracker reads the total after every operation it sees, for this meter: the same
        # operations a mode entered just above it would see, one dispatch layer fewer.
        self._tracker.after_each_operation = self._operation_done
        self._tracker.__enter__()
        self._highest = self.current()
        _entered.meters.append(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        if self in _entered.meters:
            _entered.meters.remove(self)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return
        self._highest = self.peak()
        self._exited = True
        self._tracker.__exit__(*exc)

    def current(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated(self.device)
        return self._tracker.total_bytes(self.device)

    def peak(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return torch.cuda.max_memory_allocated(self.device)
        if self._exited:  # the last reading is final
            return self._highest
        return max(self._highest, self.current())

    def reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            self._highest = self.current()

    def _operation_done(self) -> None:
        now = self.current()
        self.operations += 1
        if now > self._highest:
            self._highest = now
        if self.trace is not None:
            self.trace.append(now)


class _Entered(threading.local):
    """The meters entered on this thread, innermost last."""

    def __init__(self) -> None:
        self.meters: list[MemoryMeter] = []


_entered = _Entered()


def running_meter() -> MemoryMeter | None:
    """The innermost ``MemoryMeter`` entered on this thread and not yet left, or None: what
    code inside a metered step reads the meter through (``chunk_stand_ins``)."""
    return _entered.meters[-1] if _entered.meters else None


def trackable(objects: Any) -> list[Any]:
    """What MemTracker can track among ``objects`` and what they hold: tensors, modules and
    optimizers, found through lists, tuples, dicts and sets, and through the attributes of
    anything else (a Hugging Face cache in a model's output: ``peak_memory(..., out)``).

    Example:
        >>> from types import SimpleNamespace
        >>> cache = SimpleNamespace(keys=[torch.ones(2)], length=1)
        >>> [type(found).__name__ for found in trackable(({"cache": cache}, None, "text"))]
        ['Tensor']
    """
    # A loop over a stack, not a recursive closure: a closure that calls itself is a reference
    # cycle holding what it found (a loop's previous output) until the garbage collector runs.
    found: list[Any] = []
    seen: set[int] = set()
    stack: list[tuple[Any, int]] = [(objects, 0)]
    while stack:
        obj, depth = stack.pop()
        if obj is None or id(obj) in seen or depth > _TRACKABLE_DEPTH:
            continue
        seen.add(id(obj))
        if isinstance(obj, (torch.Tensor, nn.Module, torch.optim.Optimizer)):
            found.append(obj)
            continue
        if isinstance(obj, (set, frozenset)):
            obj = list(obj)
        leaves, _ = tree_flatten(obj)
        if len(leaves) != 1 or leaves[0] is not obj:  # a container: what it holds
            stack += [(leaf, depth + 1) for leaf in reversed(leaves)]
        elif not isinstance(obj, (str, bytes, int, float, bool, type)):
            stack += [(value, depth + 1)
                      for value in reversed(list(getattr(obj, "__dict__", {}).values()))]
    return found


# How deep ``trackable`` looks into objects that are not containers (a cache's layers' tensors
# are three levels down).
_TRACKABLE_DEPTH = 6


def measure_peak_bytes(
    step_fn: Callable[[], Any], *track: Any, device: torch.device | str | None = None
) -> int:
    """Run ``step_fn()`` once and return the peak memory in bytes on ``device`` while it ran.

    ``track``: the modules, optimizers and tensors that exist before the step and stay alive
    through it (model, optimizer, inputs, targets). On CPU they are registered with the meter so
    that the peak counts them, as ``torch.cuda.max_memory_allocated()`` does on CUDA. The device
    defaults to the one the tracked objects live on. Models with frozen parameters (LoRA, PEFT,
    a frozen embedding) are measured like any other.

    The peak is of everything allocated on the device, not just the activations: parameters,
    gradients, optimizer state and inputs are included, which is what a memory budget is about.
    The call holds ``track`` until it returns: to see the free of a tracked tensor the step lets
    go (a loop's previous output), enter ``MemoryMeter(device, *tracked)`` and clear your list
    of them inside it, as ``profile`` does; the meter itself keeps none of them.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(1024, 1024)
        >>> x = torch.randn(32, 1024)
        >>> step = lambda: model(x).sum().backward()
        >>> parameter_bytes = 4 * (1024 * 1024 + 1024)
        >>> measure_peak_bytes(step, model, x) >= 2 * parameter_bytes  # weights + gradients
        True
    """
    device = torch.device(device) if device is not None else infer_device(*track)
    with MemoryMeter(device, *track) as meter:
        step_fn()
    return meter.peak()


def _tensors_of(result: Any) -> list[torch.Tensor]:
    """The tensors an operation returned: itself, or those in a list or tuple (an ATen
    operation's outputs nest no deeper); anything else as a pytree."""
    if isinstance(result, torch.Tensor):
        return [result]
    if isinstance(result, (list, tuple)) and all(
            item is None or isinstance(item, torch.Tensor) for item in result):
        return [item for item in result if item is not None]
    return [leaf for leaf in tree_flatten(result)[0] if isinstance(leaf, torch.Tensor)]


class _NoHook:
    """Stands in for a gradient hook MemTracker would have put on a frozen parameter."""

    def remove(self) -> None:
        pass


def _mem_tracker(guarded: bool) -> Any:
    return _mem_tracker_class(guarded)()


@functools.cache
def _mem_tracker_class(guarded: bool) -> type:
    # Imported here: torch.distributed is not built into every torch wheel (e.g. some macOS ones).
    from torch._guards import active_fake_mode
    from torch.distributed._tools.mem_tracker import DTensor, MemTracker, _MemRefType, _UpdateType
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )

    wait_tensor = torch.ops._c10d_functional.wait_tensor.default
    device_of = torch.ops.prim.device.default

    class _MemTracker(MemTracker):
        """MemTracker counting totals only.

        - Frozen parameters get no gradient hooks (see the module docstring): they are marked
          as hooked already, which is all MemTracker's loop checks.
        - No per-module statistics: MemTracker snapshots (deep copies) the memory at every
          module's entry and exit and walks every module it has seen after every operation,
          to keep peaks per module; the meter reads one total. On an 8B-parameter model
          estimated on fake tensors that bookkeeping was most of the time. Its module
          tracker (hooks on every module and on every output for backward) is replaced by
          one forward pre-hook that counts the parameters and buffers of modules seen for the
          first time, the one thing the per-module hooks did that changes the total.
        """

        def __init__(self) -> None:
            super().__init__()
            self._mod_tracker = _FirstForwardTracker(self)
            self.after_each_operation: Callable[[], None] = lambda: None
            self._device_matches: dict[Any, dict[torch.device, bool]] = {}

        @classmethod
        def _should_skip_dynamo(cls) -> bool:
            return guarded

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            # MemTracker's own, less its per-operation costs: a pytree map (a wrapper function
            # made per call) over the outputs, and peak statistics per module.
            if DTensor in types:  # DTensor's local operations come back here
                return NotImplemented
            if func is device_of:  # a fake tensor's ``.device``: no memory, not an operation
                return func(*args, **(kwargs or {}))
            if func is wait_tensor and active_fake_mode():
                result = args[0]  # as in eager, a wait returns its input (MemTracker's note)
            else:
                result = func(*args, **(kwargs or {}))
            with clock.BOOKKEEPING:  # what the tracker asks of fake tensors is not the step's
                if active_fake_mode() is self._fake_mode_on_entry:
                    if self._in_opt:
                        reftype = _MemRefType.OPT
                    elif self._mod_tracker.is_bw and not self._in_ac:
                        reftype = _MemRefType.TEMP
                    else:
                        reftype = _MemRefType.ACT
                    for tensor in _tensors_of(result):
                        self._track(reftype, tensor)
                self.after_each_operation()
            return result

        def _track_module_params_and_buffers(
            self, module: nn.Module, install_grad_hooks: bool = True
        ) -> tuple[int, int]:
            for parameter in module.parameters():
                if not parameter.requires_grad:
                    self._param_to_grad_hook_handles.setdefault(parameter, (_NoHook(), _NoHook()))
            return super()._track_module_params_and_buffers(module, install_grad_hooks)

        def _update_peak_stats(self, peak_state: Any) -> None:
            pass  # the meter keeps its own peak of the total

        # Threads measure at once (two models planned in two threads): what MemTracker hooks
        # process-wide counts for the tracker of the thread that runs it, and is put back
        # whatever the order the threads' trackers exit in.

        def _register_global_optimizer_hook(self) -> None:
            # Another thread's optimizer.step() is not this thread's memory.
            thread = threading.get_ident()

            def before_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
                if threading.get_ident() == thread:
                    self._in_opt = True

            def after_step(optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
                if threading.get_ident() == thread:
                    self._track_optimizer_states(_MemRefType.OPT, optimizer)
                    self._in_opt = False

            self._optimizer_hook_handles = (
                register_optimizer_step_pre_hook(before_step),
                register_optimizer_step_post_hook(after_step),
            )

        def _track_resize(self) -> None:
            _resizes.counted_by(self)

        def _restore_resize(self) -> None:
            _resizes.not_counted_by(self)

        def resized(self, storage: torch.UntypedStorage) -> None:
            """MemTracker's ``resize_`` patch, after the resize (see ``_Resizes``)."""
            winfo, _ = self._WINFO.get(storage, (None, None))
            if winfo is not None and winfo.size != storage.size():
                old_mem_consumed = winfo.mem_consumed
                winfo.update_mem_consumed(storage)
                self._update_snap(_UpdateType.SIZE, winfo, old_mem_consumed=old_mem_consumed)

        def total_bytes(self, device: torch.device) -> int:
            """Bytes counted on ``device`` now (the snapshot's "Total", without copying it)."""
            matches = self._device_matches.setdefault(device, {})
            total = 0
            for where, breakdown in self._curr_mem_snap.items():
                match = matches.get(where)
                if match is None:
                    match = matches[where] = torch.device(where) == device
                if match:
                    total += breakdown.get("Total", 0)
            return int(total)

    return _MemTracker


class _Resizes(threading.local):
    """``UntypedStorage.resize_``, which no dispatch mode sees, counted by the trackers entered
    on the thread that resizes.

    MemTracker patches ``resize_`` while it is entered and puts back what was there when it
    was made. Two threads' trackers whose lifetimes overlap without nesting put back each
    other's patch: one stayed installed for good, every later resize in the process counted
    by a tracker long gone. Here one patch serves the process, on while any tracker is.
    """

    lock = threading.Lock()  # class attributes: shared by the threads
    users = 0
    real: Any = None

    def __init__(self) -> None:
        self.trackers: list[Any] = []  # this thread's, innermost last

    def counted_by(self, tracker: Any) -> None:
        with self.lock:
            if _Resizes.users == 0:
                _Resizes.real = torch.UntypedStorage.resize_
                torch.UntypedStorage.resize_ = _counted_resize  # type: ignore[method-assign]
            _Resizes.users += 1
        self.trackers.append(tracker)

    def not_counted_by(self, tracker: Any) -> None:
        self.trackers.remove(tracker)
        with self.lock:
            _Resizes.users -= 1
            if _Resizes.users == 0:
                torch.UntypedStorage.resize_ = _Resizes.real  # type: ignore[method-assign]


_resizes = _Resizes()


def _counted_resize(storage: torch.UntypedStorage, size: int) -> None:
    _Resizes.real(storage, size)
    for tracker in _resizes.trackers:
        tracker.resized(storage)


class _FirstForwardTracker:
    """Stands in for MemTracker's ``ModTracker``: when a module runs for the first time, its
    parameters and buffers are counted (with gradient hooks), as MemTracker's pre-forward hook
    does. Backward is never reported (``is_bw``), which only changes how MemTracker labels
    the bytes it counts, not their total."""

    is_bw = False
    parents = frozenset({"Global"})

    def __init__(self, tracker: Any) -> None:
        self._tracker = tracker
        self._seen: weakref.WeakSet[nn.Module] = weakref.WeakSet()
        self._handle: Any = None

    def register_user_hooks(self, *hooks: Any) -> None:
        pass

    def clear_user_hooks(self) -> None:
        pass

    def _first_forward(self, module: nn.Module, args: Any) -> None:
        # A global hook: the modules another thread runs meanwhile are not this step's.
        if threading.get_ident() != self._thread:
            return
        if module not in self._seen:
            self._seen.add(module)
            self._tracker._track_module_params_and_buffers(module, install_grad_hooks=True)

    def __enter__(self) -> _FirstForwardTracker:
        self._thread = threading.get_ident()
        self._handle = nn.modules.module.register_module_forward_pre_hook(self._first_forward)
        return self

    def __exit__(self, *exc: Any) -> None:
        self._handle.remove()
