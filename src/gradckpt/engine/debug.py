"""Debug mode: every operation of a region logged with its source line, to show where a
recomputation first diverged from the forward pass."""

from __future__ import annotations

import contextlib
import os
import threading
import traceback
from collections.abc import Iterator


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


# Frames in torch or in the engine are not "the user's code".
_ENGINE_FILES = (os.sep + "torch" + os.sep, os.path.dirname(__file__) + os.sep)


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

