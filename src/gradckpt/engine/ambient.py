"""The state a region's operations depend on besides their inputs, recorded in the forward pass
and replayed in recomputation; and the guard that undoes recomputation's effect on buffers."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Any

import torch

from .tensors import _engine_internal


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

