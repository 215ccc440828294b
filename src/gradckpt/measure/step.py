"""The user's training step: how the model is called on a sample, what its loss is, and what
stays alive until backward ends.

A budget is for the step users write (docs/planning.md, "What `profile` measures")::

    out = model(**batch)          # or model(batch), model(*batch)
    loss = out.loss               # or loss_fn(out)
    loss.backward()               # ``out`` (for a language model, the logits) still alive

so the model's output is held through backward by default: for a language model the logits
are often the largest tensor of the step (2 x 256 tokens x a 3,000-word vocabulary in float32 is
5.9 MiB; Llama-3-8B at 8k tokens, 4 GiB). Loops that drop the output before backward (the
Hugging Face Trainer's ``compute_loss`` returns the loss alone) pass ``keep_output=False`` and
get the tighter plan their step really needs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..errors import UsageError

__all__ = ["OutputHolder", "run_model", "loss_of", "training_step"]


class OutputHolder:
    """The loop's ``out`` variable across steps.

    ``out = model(**batch)`` lets go of the previous step's output only once the model has
    returned the new one: in a loop that never deletes ``out``, the previous logits are alive
    through the whole next forward pass. ``training_step`` given a holder does the same.
    """

    def __init__(self) -> None:
        self.output: Any = None


def run_model(model: nn.Module, sample: Any) -> Any:
    """Call the model on a sample the way the README says: tensor, tuple (positional) or dict.

    Example:
        >>> run_model(torch.nn.Linear(2, 1), torch.ones(3, 2)).shape
        torch.Size([3, 1])
    """
    if isinstance(sample, dict):
        return model(**sample)
    if isinstance(sample, (tuple, list)):
        return model(*sample)
    if isinstance(sample, torch.Tensor):
        return model(sample)
    raise UsageError(
        f"sample must be a tensor (model(sample)), a tuple (model(*sample)) or a dict "
        f"(model(**sample)); got {type(sample).__name__}"
    )


def loss_of(output: Any, loss_fn: Callable[[Any], torch.Tensor] | None = None) -> torch.Tensor:
    """The scalar to call backward on: ``loss_fn(output)``, else ``output.loss``, else the
    output itself if it is a scalar, else its sum.

    Example:
        >>> loss_of(torch.ones(2, 3, requires_grad=True))
        tensor(6., grad_fn=<SumBackward0>)
    """
    if loss_fn is not None:
        loss = loss_fn(output)
    elif isinstance(getattr(output, "loss", None), torch.Tensor):
        loss = output.loss  # Hugging Face models given labels
    elif isinstance(output, torch.Tensor):
        # A model that returns its loss is used as is (summing it would make another tensor).
        loss = output if output.dim() == 0 else output.sum()
    else:
        raise UsageError(
            f"cannot tell the loss of a {type(output).__name__} output: pass loss_fn= "
            "(a function from the model's output to a scalar tensor), or give the model what "
            "it needs to return .loss (e.g. labels for Hugging Face models)"
        )
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        raise UsageError(f"the loss must be a scalar tensor, got {_describe(loss)}")
    if not loss.requires_grad:
        raise UsageError(
            "the loss does not require grad: no parameter of the model is trainable, or the "
            "model ran without grad"
        )
    return loss


def training_step(
    model: nn.Module,
    sample: Any,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    keep_output: bool = True,
    holder: OutputHolder | None = None,
) -> torch.Tensor:
    """One forward and backward pass as a training loop runs it; returns the loss, detached.

    ``keep_output=True`` holds the model's output until backward ends, as
    ``out = model(**batch); out.loss.backward()`` does; ``False`` drops it before backward, as
    the Hugging Face Trainer does. Gradients accumulate into ``.grad`` as usual. With
    ``holder`` (and ``keep_output``) the output also outlives the step in ``holder.output``,
    until the next step's forward has returned, as a loop's ``out`` variable does.

    Example:
        >>> import torch
        >>> model = torch.nn.Linear(4, 2)
        >>> training_step(model, torch.ones(3, 4)).shape
        torch.Size([])
        >>> model.weight.grad.shape
        torch.Size([2, 4])
    """
    output = run_model(model, sample)
    if holder is not None and keep_output:
        holder.output = output  # the previous step's output is let go only now
    loss = loss_of(output, loss_fn)
    if not keep_output:
        del output  # the loss alone lives on, and what its graph saved
    loss.backward()
    return loss.detach()


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a tensor of shape {list(value.shape)}"
    return f"a {type(value).__name__}"
