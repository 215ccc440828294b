"""The one way the command line profiles a model: with a bar on stderr.

The core draws nothing; ``gradckpt.profile`` reports its steps to a callback, and this passes
it ``progress_bar``'s.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .progress import progress_bar

if TYPE_CHECKING:
    from torch import nn

    from gradckpt.profile_types import Profile

__all__ = ["profile_with_bar"]


def profile_with_bar(model: nn.Module, sample: Any, **options: Any) -> Profile:
    """``gradckpt.profile`` with a bar on stderr: every profile the command line takes shows
    one, as profiling is the slow part of both commands (quick ones show nothing).

    Example:
        >>> import torch
        >>> from gradckpt.toy_models import mlp_chain
        >>> len(profile_with_bar(mlp_chain(3, 8), torch.randn(4, 8), repeats=1).blocks)
        3
    """
    import gradckpt

    with progress_bar("gradckpt: profiling") as report:
        return gradckpt.profile(model, sample, progress=report, **options)
