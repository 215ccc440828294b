"""Where the commands run: ``--device`` read as a torch device, and tensors moved there."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

__all__ = ["resolve_device", "synchronize", "to_device"]


def resolve_device(name: str) -> torch.device:
    """``--device``: auto (cuda when torch sees a GPU, else cpu), cpu, cuda or cuda:N.

    Example:
        >>> resolve_device("cpu")
        device(type='cpu')
        >>> resolve_device("tpu")
        Traceback (most recent call last):
        ...
        ValueError: unknown device 'tpu'; expected auto, cpu or cuda[:N]
    """
    import torch

    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError:
        raise ValueError(f"unknown device {name!r}; expected auto, cpu or cuda[:N]") from None
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"gradckpt runs on cpu or cuda, not {device.type!r}")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {name} was asked for, but torch sees no CUDA GPU")
    return device


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a clock read after it times the work.

    Example:
        >>> import torch
        >>> synchronize(torch.device("cpu"))  # nothing queued off CUDA
    """
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def to_device(sample: Any, device: torch.device) -> Any:
    """``sample`` with each tensor in it (in tuples, lists, dicts) moved to ``device``.

    Example:
        >>> import torch
        >>> moved = to_device({"input_ids": torch.zeros(2), "note": "kept"}, torch.device("cpu"))
        >>> moved["input_ids"].device, moved["note"]
        (device(type='cpu'), 'kept')
    """
    import torch
    from torch.utils._pytree import tree_map

    return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, sample)
