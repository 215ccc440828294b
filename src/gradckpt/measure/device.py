"""Which device a model, optimizer or batch lives on."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

__all__ = ["infer_device"]


def infer_device(*objects: Any) -> torch.device:
    """The device of the first tensor, module parameter or optimizer parameter in ``objects``.

    CPU when none of them holds a tensor.

    Example:
        >>> infer_device(torch.nn.Linear(2, 2), torch.zeros(1))
        device(type='cpu')
    """
    for obj in objects:
        if isinstance(obj, torch.Tensor):
            return obj.device
        if isinstance(obj, nn.Module):
            for tensor in (*obj.parameters(), *obj.buffers()):
                return tensor.device
        if isinstance(obj, torch.optim.Optimizer):
            for group in obj.param_groups:
                for parameter in group["params"]:
                    return parameter.device
        if isinstance(obj, (list, tuple)):
            device = infer_device(*obj)
            if device.type != "cpu":
                return device
        if isinstance(obj, dict):
            device = infer_device(*obj.values())
            if device.type != "cpu":
                return device
    return torch.device("cpu")
