"""The arguments of ``gradckpt``, ``gradckpt demo`` and ``gradckpt plan``.

Each command's parser names the function that runs it (``args.func``); a usage error is one
line saying what was wrong and where the help is, and for a misspelt flag, command or choice,
the close ones ("did you mean --budget?").
"""

from __future__ import annotations

import argparse
import re
import textwrap
from collections.abc import Iterable, Sequence
from typing import Any, NoReturn

from gradckpt import __version__
from gradckpt.integrations.fit import LEVERS

from .demo import run_demo
from .demo_size import DEFAULT_DEMO, QUICK_DEMO
from .errors import close_matches, did_you_mean, either
from .estimate import DTYPES
from .fit import run_fit
from .plan import run_plan
from .step_arguments import AUTOCAST

__all__ = ["EXAMPLES", "build_parser"]


EXAMPLES = """\
examples:
  gradckpt demo                                   # about a minute on a laptop CPU
  gradckpt demo --quick --out /tmp/demo           # seconds; plots in /tmp/demo
  gradckpt plan --list                            # the built-in models and known configs
  gradckpt plan tinygpt --batch 8 --seq 128 --budget 60%
  gradckpt plan path/to/config.json --batch 1 --seq 2048 --budget 6GiB --optimizer adam
  gradckpt plan mypackage.models:build --budget 2GiB --json plan.json --plot frontier.png
  gradckpt plan llama-3-8b --estimate --device h100 --batch 1 --seq 8192 --budget 70GiB \\
      --optimizer adamw                           # predicted: no GPU, no weights, < 1 min
  gradckpt plan llama-3-8b --estimate --device h100 --batch 1 --seq 8192 --budget 70GiB \\
      --optimizer adamw --world-size 8            # one rank of 8 sharding it (FSDP2, ZeRO-3)
  gradckpt plan llama-3-8b --estimate --device rtx4090 --batch 1 --seq 4096 --budget 22GiB \\
      --optimizer adamw --dtype bf16 --lora 16    # LoRA adapters on a frozen bf16 base
  gradckpt plan tinygpt --batch 2 --accumulation-steps 8 --autocast bf16 --trainer
                                                  # the Trainer's loop, bf16=True, 8 x 2
  gradckpt fit llama-3-8b --device rtx4090 --batch 1 --seq 4096 --optimizer adamw
                                                  # does not fit: the cheapest changes that do
"""

FIT_EXAMPLES = """\
examples:
  gradckpt fit llama-3-8b --device rtx4090 --batch 1 --seq 4096 --optimizer adamw
  gradckpt fit llama-3-8b --device rtx4090 --batch 1 --seq 4096 --trainer --lora 16
  gradckpt fit path/to/config.json --device a100-40gb --batch 8 --seq 2048 --budget 30GiB \\
      --levers recompute,chunked-head,micro-batch,autocast   # no LoRA, no more GPUs
"""

# What MODEL may be, for the descriptions of plan and fit.
_MODEL_HELP = (
    "MODEL is a Hugging Face config.json (or a folder holding one; the model is built with "
    "random weights, nothing is downloaded), a built-in name or a known config of a "
    "well-known model such as llama-3-8b (hyper-parameters only; plan --list shows them), or "
    "package.module:factory, a function returning a module or (module, sample); it gets "
    "batch= and seq= when it takes them."
)


# A token starting with "-" then a digit (or ".digit") is a value, never a flag: no gradckpt flag
# starts with a digit. argparse's own pattern only covers plain numbers ("-2", "-0.5"), so
# "--budget -1GiB" was "expected one argument" instead of the budget's own "is negative".
_NEGATIVE_VALUE = re.compile(r"^-\.?\d")


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one line: what was wrong, the close matches of a misspelt
    flag, command or choice, and where the help is.

    The hooks are argparse's private ``_negative_number_matcher`` and ``_check_value`` (Python
    3.14's own ``suggest_on_error`` works in ``_check_value`` too);
    tests/cli/test_cli_suggestions.py fails if a Python version changes them.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._negative_number_matcher = _NEGATIVE_VALUE
        self._commands: argparse._SubParsersAction | None = None

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: usage error: {message} (see '{self.prog} --help')\n")

    def add_subparsers(self, **kwargs: Any) -> Any:
        """The subcommands, remembered to tell a misspelt flag by the subcommand's flags."""
        self._commands = super().add_subparsers(**kwargs)
        return self._commands

    def parse_args(
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        """argparse's, but unrecognized arguments are told by the subcommand they were given
        to, with its flags close to each."""
        namespace, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self._command_parser(namespace)
            parser.error(_unrecognized_message(extras, parser._option_string_actions))
        return namespace

    def _command_parser(self, namespace: argparse.Namespace) -> argparse.ArgumentParser:
        """The parser of the subcommand given, whose flags a misspelt one was meant to be."""
        command = getattr(namespace, "command", None)
        if self._commands is None or command not in self._commands.choices:
            return self
        return self._commands.choices[command]

    def _check_value(self, action: argparse.Action, value: Any) -> None:
        if action.choices is not None and value not in action.choices:
            choices = [str(choice) for choice in action.choices]
            raise argparse.ArgumentError(
                action,
                f"invalid choice: {value!r}{did_you_mean(str(value), choices)} "
                f"(choose from {', '.join(map(repr, choices))})",
            )


def _unrecognized_message(extras: list[str], option_strings: Iterable[str]) -> str:
    """argparse's "unrecognized arguments", with the flags close to each misspelt one.

    Example:
        >>> _unrecognized_message(["--bugdet", "6GiB"], ["--budget", "--batch"])
        'unrecognized arguments: --bugdet 6GiB; did you mean --budget?'
        >>> _unrecognized_message(["--bugdet=6GiB", "--sqe", "8"], ["--budget", "--seq"])
        'unrecognized arguments: --bugdet=6GiB --sqe 8; did you mean --budget for --bugdet, --seq for --sqe?'
        >>> _unrecognized_message(["extra"], ["--budget"])
        'unrecognized arguments: extra'
    """  # noqa: E501
    message = f"unrecognized arguments: {' '.join(extras)}"
    flags = [extra.split("=", 1)[0] for extra in extras if _looks_like_a_flag(extra)]
    if len(flags) == 1:
        return message + did_you_mean(flags[0], option_strings, quote=False)
    hints = [
        f"{either(close, quote=False)} for {flag}"
        for flag in flags
        if (close := close_matches(flag, option_strings))
    ]
    return f"{message}; did you mean {', '.join(hints)}?" if hints else message


def _looks_like_a_flag(token: str) -> bool:
    return token.startswith("-") and len(token) > 1 and not _NEGATIVE_VALUE.match(token)


def _paragraph(text: str) -> str:
    """Wrapped for --help (the raw formatter, kept for the examples, does not wrap)."""
    return textwrap.fill(text, width=88)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of the ``gradckpt`` command.

    Example:
        >>> build_parser().parse_args(["demo", "--quick"]).quick
        True
        >>> build_parser().parse_args(["plan", "tinygpt", "--budget", "60%"]).budget
        '60%'
    """
    # --debug is accepted before and after the subcommand; SUPPRESS keeps the subcommand's
    # default from overwriting a --debug given before it.
    debug_parent = argparse.ArgumentParser(add_help=False)
    debug_parent.add_argument(
        "--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks"
    )
    parser = _Parser(
        prog="gradckpt",
        description="Gradient checkpointing for PyTorch: state a memory budget, get a plan.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"gradckpt {__version__}")
    parser.add_argument("--debug", action="store_true", default=False, help="show tracebacks")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_demo_parser(commands, debug_parent)
    step_parent = _step_parent()
    _add_plan_parser(commands, debug_parent, step_parent)
    _add_fit_parser(commands, debug_parent, step_parent)
    return parser


def _add_demo_parser(commands: Any, debug_parent: argparse.ArgumentParser) -> None:
    demo = commands.add_parser(
        "demo",
        parents=[debug_parent],
        help="what each strategy costs on a small GPT, the sqrt(n) table, and plots",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description=_paragraph(
            "1. Profiles TinyGPT, plans it with none / every-layer / sqrt / optimal at a few "
            "budgets, and measures each plan's peak memory (forward + backward), step time and "
            "whether training stays bit-identical. 2. The sqrt(n) table: activation memory and "
            "extra forward work of each strategy on chains of n identical blocks, computed by "
            "the solvers and measured where quick. 3. Plots (PNG) in --out."
        ),
    )
    size = DEFAULT_DEMO
    demo.add_argument("--layers", type=_positive_int, help=f"GPT blocks (default {size.layers})")
    demo.add_argument(
        "--batch", type=_positive_int, help=f"sequences per batch (default {size.batch})"
    )
    demo.add_argument("--seq", type=_positive_int, help=f"tokens per sequence (default {size.seq})")
    demo.add_argument(
        "--steps",
        type=_positive_int,
        help=f"AdamW steps of the bit-identity check (default {size.steps})",
    )
    demo.add_argument(
        "--quick",
        action="store_true",
        help=(
            f"a small run for tests: {QUICK_DEMO.layers} layers, batch {QUICK_DEMO.batch}, "
            f"{QUICK_DEMO.seq} tokens, chains of {', '.join(map(str, QUICK_DEMO.depths))} "
            "blocks (explicit flags still win)"
        ),
    )
    demo.add_argument(
        "--out",
        default="gradckpt-demo",
        help="folder for the PNG plots (default ./gradckpt-demo/)",
    )
    demo.add_argument(
        "--device",
        default="auto",
        help="device to run on: auto (cuda if available, else cpu), cpu, cuda, cuda:1, ...",
    )
    demo.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    demo.set_defaults(func=run_demo)


def _step_parent() -> argparse.ArgumentParser:
    """The arguments ``plan`` and ``fit`` share: the model, the training step and the device
    (``cli/step_arguments.py`` checks them)."""
    step = argparse.ArgumentParser(add_help=False)
    step.add_argument("model", nargs="?", metavar="MODEL", help="what to plan (see above)")
    step.add_argument("--batch", type=_positive_int, default=4,
                      help="batch size: one micro-batch, one rank's (default 4)")
    step.add_argument(
        "--seq", type=_positive_int, default=128, help="tokens per sequence (default 128)"
    )
    step.add_argument(
        "--budget",
        help="peak memory of a training step: 6GiB, 512MiB, 6GB, 60%% (of the peak without "
        "checkpointing) or auto (the default: what --device has; measured, what it has free "
        "now; predicted, what the target device has for the peak); the strategies none, "
        "every-layer and sqrt need none",
    )
    step.add_argument(
        "--optimizer",
        choices=["none", "adam", "adamw", "adamw-8bit", "sgd"],
        help="count the optimizer's state in the peak and budget: adam or adamw (2 values per "
        "trainable parameter, in its dtype), adamw-8bit (bitsandbytes: 2 bytes per parameter), "
        "sgd (none, without momentum); default none (adamw with --trainer)",
    )
    step.add_argument(
        "--dtype",
        choices=list(DTYPES),
        help="predicted steps only (plan --estimate, fit): train in this dtype (parameters, "
        "gradients, optimizer state and activations, as model.to(dtype) does); default: the "
        "config's torch_dtype, else the model's own (fp32); fp32 with --autocast",
    )
    step.add_argument(
        "--autocast",
        choices=list(AUTOCAST),
        help="mixed precision as torch.autocast applies it (Accelerate's mixed_precision, the "
        "Trainer's bf16=True / fp16=True): fp32 parameters, the forward under autocast to this "
        "dtype, each weight it uses cast to a copy that lives through the step",
    )
    step.add_argument(
        "--accumulation-steps",
        type=_positive_int,
        default=1,
        metavar="N",
        help="gradient accumulation: N micro-batches of --batch per optimizer step, the "
        "gradients of the earlier ones held through the later ones (default 1)",
    )
    step.add_argument(
        "--trainer",
        action="store_true",
        help="the Hugging Face Trainer's loop: sets --drop-output (its compute_loss keeps the "
        "loss, not the output) and, unless --optimizer is given, --optimizer adamw (its default "
        "optim, adamw_torch_fused); its gradient_accumulation_steps and bf16=True are "
        "--accumulation-steps and --autocast bf16",
    )
    step.add_argument(
        "--drop-output",
        action="store_true",
        help="the training loop drops the model's output before backward, as the Hugging Face "
        "Trainer does; by default it is held through backward (out = model(**batch); "
        "out.loss.backward()), which for a language model keeps the logits alive",
    )
    step.add_argument(
        "--output-head",
        choices=["auto", "plain", "chunked"],
        default="auto",
        help="what the plan may do with a language model's output head: auto (default: compute "
        "the loss in chunks of tokens, recomputing each chunk's logits in backward, when that "
        "fits where the plain head does not, or fits faster), plain (never: the output's "
        "logits stay whole), chunked (always)",
    )
    step.add_argument(
        "--lora",
        type=_positive_int,
        metavar="R",
        help="fine-tune with LoRA adapters of rank R (PEFT, lora_alpha 2R) on a frozen base: "
        "gradients and optimizer state of the adapters only; needs the hf extra",
    )
    step.add_argument(
        "--lora-targets",
        metavar="NAMES",
        help="with --lora: the modules that get adapters, comma-separated (q_proj,v_proj); "
        "default all-linear (every linear layer but the output head)",
    )
    step.add_argument(
        "--qlora",
        action="store_true",
        help="QLoRA: the base's linear layers in bitsandbytes 4-bit (NF4, double quantisation, "
        "computing in bf16, or in --dtype fp16) under LoRA adapters (rank 16, or --lora R); "
        "counts the packed weights, their scales and the weight each layer dequantises while "
        "it computes; needs the hf extra and bitsandbytes",
    )
    step.add_argument(
        "--8bit",
        dest="eight_bit",
        action="store_true",
        help="LoRA on an 8-bit base: the base's linear layers in bitsandbytes 8-bit (LLM.int8(), "
        "as load_in_8bit=True loads them: outlier threshold 6.0, computing in the trained "
        "dtype) under LoRA adapters (rank 16, or --lora R); counts the int8 weights, their "
        "scales and what each layer makes while it computes on the target (on a GPU, an fp16 "
        "copy of its input in int8 and an int32 product); not with --qlora; needs the hf extra "
        "and bitsandbytes",
    )
    step.add_argument(
        "--device",
        help="where to profile: auto (default: cuda when there is one), cpu, cuda, cuda:1, ...; "
        "predicted (plan --estimate, fit), the target device the plan is for: a preset "
        "(rtx4090, a100-80gb, h100, ...; docs/devices.md), this (default: this machine, "
        'measured once) or a JSON object of numbers: \'{"memory": "48GiB", "bf16_tflops": 180, '
        '"fp32_tflops": 90, "bandwidth_gbps": 960}\'',
    )
    step.add_argument(
        "--world-size",
        type=_positive_int,
        default=1,
        metavar="N",
        help="with --estimate: predict one of N ranks that shard the parameters, gradients and "
        "optimizer state as FSDP2 (fully_shard) and ZeRO-3 do, each holding 1/N of them plus "
        "what FSDP2 gathers in full (a block's parameters while it computes); the budget, the "
        "peak and the memory parts are then per rank, and --batch is one rank's batch (default "
        "1: one process holding the whole model; fit always predicts)",
    )
    step.add_argument(
        "--ddp",
        action="store_true",
        help="the model trains wrapped in DistributedDataParallel (torchrun): its buckets, a "
        "copy of every trainable gradient alive all run, are counted (plan only; --batch is "
        "one rank's batch; not with --world-size, which shards as FSDP2 does)",
    )
    step.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    return step


def _add_plan_parser(commands: Any, debug_parent: argparse.ArgumentParser,
                     step_parent: argparse.ArgumentParser) -> None:
    plan = commands.add_parser(
        "plan",
        parents=[debug_parent, step_parent],
        help="profile (or --estimate) a model and print the checkpointing plan for a budget",
        description=_paragraph(
            "Profile one training step of MODEL on this machine, solve for the budget and "
            "print the plan: what happens to each block, the predicted peak and extra time, "
            "and what takes the memory. " + _MODEL_HELP
        )
        + "\n\n"
        + _paragraph(
            "With --estimate nothing runs for real: the step is predicted on fake tensors for "
            "the target device named by --device (configs are built on the meta device, with "
            "no weights), so models this machine cannot hold plan in under a minute; it also "
            "prints whether the plan fits the device. With --world-size N it is predicted for "
            "one of N ranks sharding the model (FSDP2, ZeRO-3)."
        ),
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    plan.add_argument(
        "--list", action="store_true", help="list the built-in models and known configs, and exit"
    )
    plan.add_argument(
        "--estimate",
        action="store_true",
        help="predict instead of measuring: the step runs on fake tensors (no memory; configs "
        "built on the meta device, no weights), its times are rooflines of the target --device",
    )
    plan.add_argument(
        "--strategy",
        default="optimal",
        help="none, every-layer, sqrt, chen-greedy or optimal (default)",
    )
    plan.add_argument(
        "--json",
        metavar="FILE",
        help="write the plan as JSON (Plan.from_json); with --estimate, an object holding the "
        "plan, the profile's totals, the device and the memory parts (docs/cli.md)",
    )
    plan.add_argument("--plot", metavar="FILE", help="write the memory/time frontier as a PNG")
    plan.set_defaults(func=run_plan)


def _add_fit_parser(commands: Any, debug_parent: argparse.ArgumentParser,
                    step_parent: argparse.ArgumentParser) -> None:
    fit = commands.add_parser(
        "fit",
        parents=[debug_parent, step_parent],
        help="when a step does not fit: the cheapest changes that make it fit (predicted)",
        description=_paragraph(
            "Predict one training step of MODEL on the target --device (as plan --estimate "
            "does: fake tensors, no weights) and, when no plan makes it fit the budget, the "
            "same step with the levers gradckpt knows pulled, alone and together; print the "
            "--count cheapest configurations that fit, each with its predicted peak and time. "
            "Cheapest: the least change to what is trained first (recompute, a chunked head "
            "and dropping the output change nothing trained; bf16 autocast and a smaller "
            "micro-batch with accumulation change the numerics a little; bf16 throughout "
            "more; LoRA and a 4-bit base change what is trained; more GPUs cost money), then "
            "the predicted time of an optimizer step. " + _MODEL_HELP
        ),
        epilog=FIT_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    fit.add_argument(
        "--levers",
        metavar="NAMES",
        help="the levers that may be pulled, comma-separated (default: all): "
        + ", ".join(lever.name for lever in LEVERS),
    )
    fit.add_argument("--count", type=_positive_int, default=3,
                     help="how many configurations that fit to print (default 3)")
    fit.add_argument("--max-gpus", type=_positive_int, default=8, metavar="N",
                     help="the most GPUs the fsdp lever may shard over: 2, 4, 8, ... up to N "
                     "(default 8)")
    fit.add_argument("--adapter-rank", type=_positive_int, default=16, metavar="R",
                     help="the rank of the LoRA adapters the lora and 4bit levers add "
                     "(default 16; with --lora R, R)")
    fit.set_defaults(func=run_fit, estimate=True, strategy="optimal", list=False)
