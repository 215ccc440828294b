"""What ``gradckpt plan`` and ``gradckpt fit`` both take about the training step: checked before
any slow work, and turned into the keywords ``gradckpt.profile`` and ``gradckpt.estimate`` take.

The step is the loop users write, the one every budget is for: its micro-batch
(``--batch``, ``--seq``), the optimizer whose state it holds, gradient accumulation, mixed
precision, and whether the loop holds the model's output through backward. ``--trainer`` is the
Hugging Face Trainer's loop: the output dropped before backward (``compute_loss`` keeps only
the loss) and, unless ``--optimizer`` says otherwise, AdamW (the Trainer's default ``optim``,
``adamw_torch_fused``); its ``gradient_accumulation_steps`` and ``bf16=True`` are
``--accumulation-steps`` and ``--autocast bf16``, given as such.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from .errors import CommandLineError
from .fine_tuning import check_lora_arguments
from .model_lookup import check_model_name

if TYPE_CHECKING:
    import torch

__all__ = ["AUTOCAST", "TRAINER_OPTIMIZER", "autocast_dtype", "check_step_arguments",
           "step_words"]

# --autocast: the short names people write, and torch's.
AUTOCAST = {"bf16": "bfloat16", "fp16": "float16"}
# What the Trainer steps when TrainingArguments.optim is left alone (AdamW, fused on torch 2.8+):
# counted as AdamW's two moments per trainable parameter.
TRAINER_OPTIMIZER = "adamw"


def check_step_arguments(args: argparse.Namespace, command: str) -> None:
    """What can be wrong with the model and step arguments, told before any slow work; and
    ``--trainer``'s settings filled in (``args.drop_output``, ``args.optimizer``).

    Example:
        >>> from gradckpt.cli.parser import build_parser
        >>> args = build_parser().parse_args(["plan", "tinygpt", "--trainer"])
        >>> check_step_arguments(args, "plan"); args.drop_output, args.optimizer
        (True, 'adamw')
        >>> args = build_parser().parse_args(["plan", "tinygpt", "--autocast", "bf16",
        ...                                   "--dtype", "bf16", "--estimate"])
        >>> check_step_arguments(args, "plan")
        Traceback (most recent call last):
        ...
        gradckpt.cli.errors.CommandLineError: --autocast bf16 is mixed precision: fp32 ...
    """
    from gradckpt.budget import check_budget
    from gradckpt.errors import UsageError

    if args.model is None:
        raise CommandLineError(
            f"MODEL is missing (see 'gradckpt plan --list' for built-ins and known configs; "
            f"'gradckpt {command} --help' for the rest)"
        )
    check_model_name(args.model)  # a misspelt name is told before the other arguments
    if args.trainer:
        args.drop_output = True  # the Trainer's compute_loss keeps the loss, not the output
    if args.optimizer is None:
        args.optimizer = TRAINER_OPTIMIZER if args.trainer else "none"
    if args.autocast is not None and args.dtype in AUTOCAST:
        raise CommandLineError(
            f"--autocast {args.autocast} is mixed precision: fp32 parameters, the forward "
            f"under autocast; with --dtype {args.dtype} the whole model is {args.dtype} "
            f"already: drop --autocast (pure {args.dtype}) or --dtype (mixed precision)"
        )
    if args.budget is not None:
        try:  # the form only: a percentage's base is known once the model is profiled
            check_budget(args.budget)
        except UsageError as error:
            raise CommandLineError(f"--budget: {error}") from None
    check_lora_arguments(args)


def autocast_dtype(args: argparse.Namespace) -> torch.dtype | None:
    """``--autocast`` as a torch dtype (None without it).

    Example:
        >>> autocast_dtype(argparse.Namespace(autocast="bf16"))
        torch.bfloat16
    """
    import torch

    return getattr(torch, AUTOCAST[args.autocast]) if args.autocast else None


def step_words(args: argparse.Namespace) -> str:
    """What the header line adds for the step's loop: mixed precision, accumulation, the
    output dropped.

    Example:
        >>> step_words(argparse.Namespace(autocast="bf16", accumulation_steps=4,
        ...                               drop_output=True, trainer=True))
        ', bf16 autocast, 4 micro-batches accumulated, output dropped before backward (Trainer)'
        >>> step_words(argparse.Namespace(autocast=None, accumulation_steps=1,
        ...                               drop_output=False, trainer=False))
        ''
    """
    words = []
    if args.autocast:
        words.append(f"{args.autocast} autocast")
    if args.accumulation_steps > 1:
        words.append(f"{args.accumulation_steps} micro-batches accumulated")
    if args.drop_output:
        words.append("output dropped before backward" + (" (Trainer)" if args.trainer else ""))
    if getattr(args, "ddp", False):
        words.append("DDP's buckets counted")
    return "".join(f", {word}" for word in words)
