"""The link between a GPU and its host's memory, measured: what offloading a tensor costs.

``profile`` on a GPU times copies of 64 MiB between the device and pinned host memory, each
way, and takes the slower direction's median; it also notes how much host memory a plan may
offload to (half of what ``budget="auto"`` would give on the CPU). On any other device it
measures nothing: offloading is offered only on GPUs (``gradckpt.op_choices.offload_offer``).
"""

from __future__ import annotations

import statistics

import torch

from ..budget import available_bytes
from ..errors import UsageError
from ..op_choices import HOST_CAP, HOST_LINK

__all__ = ["host_link_notes"]

_COPY_BYTES = 64 * 2**20
_ROUNDS = 5


def host_link_notes(device: torch.device) -> dict[str, float | int]:
    """``Profile.notes`` entries for offloading on ``device``: the host link's bytes per
    second (``op_choices.HOST_LINK``) and the host memory a plan may take
    (``op_choices.HOST_CAP``); empty where the device is not a GPU.

    Example:
        >>> host_link_notes(torch.device("cpu"))
        {}
    """
    if device.type != "cuda" or not torch.cuda.is_available():
        return {}
    on_device = torch.empty(_COPY_BYTES, dtype=torch.uint8, device=device)
    on_host = torch.empty(_COPY_BYTES, dtype=torch.uint8, pin_memory=True)
    seconds: dict[str, list[float]] = {"to host": [], "to device": []}
    for _ in range(_ROUNDS + 1):  # the first round warms up
        for direction, (target, source) in {"to host": (on_host, on_device),
                                            "to device": (on_device, on_host)}.items():
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            start.record()
            target.copy_(source, non_blocking=True)
            end.record()
            end.synchronize()
            seconds[direction].append(start.elapsed_time(end) / 1000)
    slower = max(statistics.median(times[1:]) for times in seconds.values())
    notes: dict[str, float | int] = {HOST_LINK: _COPY_BYTES / slower}
    try:  # what "auto" would give on the CPU: MemAvailable, under a cgroup's limit
        notes[HOST_CAP] = available_bytes("cpu") // 2
    except UsageError:  # no way to tell: not checked
        pass
    return notes
