"""The ``gradckpt`` command line.

    gradckpt demo                   what checkpointing buys on a small GPT, and the sqrt(n) law
    gradckpt plan MODEL --budget B  the plan for a model: per block, predicted peak and time
    gradckpt plan MODEL --estimate --device h100-80gb --budget B
                                    the same, predicted for a target device without running
                                    the model (no weights: 8B models plan on a laptop)
    gradckpt plan --list            the built-in models and known configs (llama-3-8b, ...)
    gradckpt fit MODEL --device rtx4090
                                    when the step does not fit: the cheapest changes that do
                                    (LoRA, bf16, a smaller micro-batch, more GPUs, ...)
    gradckpt --version

Exit status: 0 done; 1 an error while working (a missing file, a factory that raised, a budget
no plan meets); 2 a usage error (the command line itself is wrong). Every error is one line on
stderr; ``--debug`` shows the traceback instead. ``python -m gradckpt`` is the same command.

The modules: ``parser`` (the arguments; ``step_arguments`` checks those ``plan`` and ``fit``
share), one per command (``demo``, ``plan``, ``estimate`` for ``plan --estimate``, ``fit``) and
the pieces they are made of (``known_configs``: the hyper-parameters of well-known models),
``progress`` (the only place gradckpt draws progress; the core gets it as a callback). Models
from Hugging Face configs come from ``gradckpt.integrations.hf``; ``fit``'s search from
``gradckpt.integrations.fit``.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from .errors import CommandLineError, one_line
from .parser import build_parser

__all__ = ["main", "build_parser"]


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``gradckpt`` console script; returns the exit status.

    Example:
        >>> main(["plan", "--list"])  # doctest: +ELLIPSIS
        tinygpt ...
        0
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("gradckpt: interrupted", file=sys.stderr)
        return 130
    except CommandLineError as error:
        if args.debug:
            raise
        print(f"gradckpt {args.command}: usage error: {one_line(error)}", file=sys.stderr)
        return 2
    except Exception as error:  # one clear line for users; the traceback with --debug
        if args.debug:
            raise
        print(
            f"gradckpt: error: {one_line(error)} (rerun with --debug for the traceback)",
            file=sys.stderr,
        )
        return 1
