"""The state a region's operations depend on besides their inputs, recorded in the forward pass
and replayed in recomputation; and the guard that undoes recomputation's effect on buffers.

Recomputation runs inside backward, where the caller may have changed anything global since the
forward pass (left a ``with torch.device("meta"):`` block, switched the default dtype, turned on
deterministic algorithms), and on CUDA it runs on autograd's own thread. Whatever decides what a
region's operations compute, beyond their inputs, is therefore recorded when the region starts
and put in place around its recomputation, then put back as the caller had it:

- the random number generators of the CPU and every accelerator device (dropout);
- autocast, per device type;
- the default device (``torch.device(...)`` as a context, ``torch.set_default_device``), which
  factory functions such as ``torch.ones`` use, and the ``FakeTensorMode`` that makes them
  fake tensors (``estimate`` runs regions under one);
- the global settings in ``_SETTINGS``: default dtype, deterministic algorithms, float32
  matmul precision, cuDNN and scaled-dot-product-attention backend choices.

Grad mode needs no record: a region only records in the forward pass with grad enabled, and
recomputation always runs with grad enabled.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import _get_current_function_mode_stack
from torch.utils._device import DeviceContext

from .tensors import _engine_internal, _version_of


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

    def moved(self) -> bool:
        """Whether anything drew random numbers since the snapshot (dropout, say)."""
        if not torch.equal(torch.get_rng_state(), self.cpu_state):
            return True
        return any(
            not torch.equal(torch.get_device_module(device.type).get_rng_state(device), state)
            for device, state in self.device_states.items()
        )

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


class _Setting:
    """One global setting that changes what operations compute: how to read it and set it."""

    __slots__ = ("name", "get", "set")

    def __init__(self, name: str, get: Callable[[], Any], set: Callable[[Any], None]) -> None:
        self.name = name
        self.get = get
        self.set = set


def _set_deterministic(mode: tuple[bool, bool]) -> None:
    enabled, warn_only = mode
    torch.use_deterministic_algorithms(enabled, warn_only=warn_only)


def _attribute(owner_name: str, owner: Any, name: str) -> _Setting:
    return _Setting(
        f"{owner_name}.{name}",
        lambda: getattr(owner, name),
        lambda value: setattr(owner, name, value),
    )


def _sdp_backend(name: str) -> _Setting:
    cuda = torch.backends.cuda
    return _Setting(
        f"torch.backends.cuda.{name}_sdp_enabled",
        getattr(cuda, f"{name}_sdp_enabled"),
        getattr(cuda, f"enable_{name}_sdp"),
    )


_SETTINGS = (
    _Setting("default dtype", torch.get_default_dtype, torch.set_default_dtype),
    _Setting(
        "deterministic algorithms",
        lambda: (
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        ),
        _set_deterministic,
    ),
    _Setting(
        "float32 matmul precision",
        torch.get_float32_matmul_precision,
        torch.set_float32_matmul_precision,
    ),
    *(
        _attribute("torch.backends.cuda.matmul", torch.backends.cuda.matmul, name)
        for name in (
            "allow_fp16_reduced_precision_reduction",
            "allow_bf16_reduced_precision_reduction",
        )
    ),
    *(
        _attribute("torch.backends.cudnn", torch.backends.cudnn, name)
        for name in ("allow_tf32", "deterministic", "benchmark")
    ),
    # Which fused attention kernel scaled_dot_product_attention picks (torch.nn.attention's
    # sdpa_kernel sets these): another kernel saves other tensors for backward.
    *(_sdp_backend(name) for name in ("flash", "mem_efficient", "math", "cudnn")),
)


def _default_device() -> torch.device | None:
    """Where factory functions put tensors: the device of the ``torch.device`` context (also what
    ``torch.set_default_device`` installs), or None without one (the CPU).

    Read from the mode stack as torch itself does, not with ``torch.get_default_device()``,
    which makes a tensor to resolve a device without an index.
    """
    if torch._C._len_torch_function_stack() == 0:  # the usual case, and cheap to ask
        return None
    for mode in reversed(_get_current_function_mode_stack()):
        if isinstance(mode, DeviceContext):
            return mode.device
    return None


def _active_fake_mode() -> Any:
    """The active ``FakeTensorMode`` (torch keeps at most one, in a slot of its own), or None."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE)


class _AmbientState:
    """Everything besides its inputs that a region's operations depend on, as it was when the
    forward pass entered the region; ``replayed()`` puts it in place for recomputation."""

    def __init__(self, tensors: list[torch.Tensor], preserve_rng_state: bool) -> None:
        self.rng = _RngSnapshot(tensors) if preserve_rng_state else None
        # Without replay, a region that draws random numbers recomputes with other ones: a
        # wrong gradient nobody would notice. Snapshot anyway, to tell (random_without_replay).
        self.rng_probe = None if preserve_rng_state else _RngSnapshot(tensors)
        self.autocast = _AutocastSnapshot(tensors)
        self.default_device = _default_device()
        self.fake_mode = _active_fake_mode()
        self.settings = [(setting, setting.get()) for setting in _SETTINGS]

    def random_without_replay(self) -> bool:
        """The region drew random numbers (its forward has run) and its RNG is not replayed."""
        return self.rng_probe is not None and self.rng_probe.moved()

    @contextlib.contextmanager
    def replayed(self) -> Iterator[None]:
        with contextlib.ExitStack() as stack:
            if self.rng is not None:
                stack.enter_context(self.rng.replayed())
            stack.enter_context(self.autocast.replayed())
            # Only where it differs: a device context is a mode every torch call passes through.
            if _default_device() != self.default_device:
                stack.enter_context(torch.device(self.default_device or "cpu"))
            if self.fake_mode is not None and _active_fake_mode() is not self.fake_mode:
                stack.enter_context(self.fake_mode)
            for setting, value in self.settings:
                current = setting.get()
                if current != value:
                    setting.set(value)
                    stack.callback(setting.set, current)
            yield


class _BufferGuard:
    """Puts module buffers, and the tensors modules keep as plain attributes, back as they were
    before recomputation (invariant 2).

    A global forward pre-hook (active on this thread only while recomputing) copies the buffers of
    every module the region calls before it runs; afterwards every one of them gets its old value
    back. All of them, not just those whose version counter moved: BatchNorm's kernel updates its
    running statistics without bumping the counter. The version counter is put back too: a
    buffer saved for backward (BatchNorm saves its running statistics) must look unchanged to
    the next recomputation that saves it, which checks versions.

    A tensor a module's forward assigns to an attribute (a recurrent layer's last state,
    ``self.state = h``) gets back the one the forward pass left there: the recomputed one would
    hold the graph that recomputation built, and through it the region's inputs, until the next
    forward pass replaced it (``region.py``'s R6 frees the rest of that graph). The hook notes
    the attributes of a called module's whole subtree, before the module's code can change its
    children's.
    """

    def __enter__(self) -> _BufferGuard:
        self.thread = threading.get_ident()
        self.snapshots: dict[int, tuple[torch.Tensor, torch.Tensor, int | None]] = {}
        self.attributes: dict[int, tuple[torch.nn.Module, dict[str, Any]]] = {}
        self.hook = torch.nn.modules.module.register_module_forward_pre_hook(self.remember)
        return self

    def remember(self, module: torch.nn.Module, args: Any) -> None:
        if threading.get_ident() != self.thread:
            return
        with _engine_internal():
            for buffer in module._buffers.values():
                if buffer is not None and id(buffer) not in self.snapshots:
                    copy = buffer.detach().clone()
                    self.snapshots[id(buffer)] = (buffer, copy, _version_of(buffer))
        if id(module) not in self.attributes:
            for inner in module.modules():
                self.attributes.setdefault(id(inner), (inner, dict(vars(inner))))

    def __exit__(self, *exc_info: Any) -> None:
        self.hook.remove()
        with torch.no_grad(), _engine_internal():
            for buffer, copy, version in self.snapshots.values():
                buffer.copy_(copy)
                if version is not None:
                    torch._C._autograd._unsafe_set_version_counter((buffer,), (version,))
        for module, before in self.attributes.values():
            _put_back_tensor_attributes(module, before)


def _put_back_tensor_attributes(module: torch.nn.Module, before: dict[str, Any]) -> None:
    """Give ``module`` back the plain attributes in ``before`` (its ``vars()`` then) that hold
    a tensor now or held one then, where they changed; one that did not exist is removed.
    Parameters, buffers and submodules live in ``nn.Module``'s own dictionaries, whose
    identity does not change."""
    now = vars(module)
    for name in now.keys() | before.keys():
        old, new = before.get(name, _MISSING), now.get(name, _MISSING)
        if old is new or not (isinstance(old, torch.Tensor) or isinstance(new, torch.Tensor)):
            continue
        if old is _MISSING:
            del now[name]
        else:
            now[name] = old


_MISSING = object()


# The internal interface's name (gradckpt.engine): measuring re-runs a block under the autocast
# settings of its call in the step, as recomputation does.
AutocastSnapshot = _AutocastSnapshot
# And to tell whether code drew random numbers (measure.torch_checkpoints' diagnostic).
RngSnapshot = _RngSnapshot
