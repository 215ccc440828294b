"""``--lora R``, ``--qlora`` and ``--8bit``: plan fine-tuning with adapters on a frozen base, as
users fine-tune.

The model ``gradckpt plan`` built (measured, or on the meta device for ``--estimate``) is
wrapped with PEFT's LoRA before it is profiled: the base's parameters frozen, adapters of rank R
(``lora_alpha`` 2R, PEFT's defaults otherwise) on the target modules. The plan then counts what
LoRA training holds: gradients and optimizer state of the adapters only, the frozen weights, and
the activations the adapters' backward still needs.

As fine-tuning scripts load it, the base is in the trained dtype before the adapters are added,
and the adapters are in PEFT's own (fp32: ``get_peft_model`` upcasts 16-bit adapters), so the
step is not cast again afterwards (``trained_dtype`` is then ``None``). ``--qlora`` is the QLoRA
recipe: the base's linear layers in bitsandbytes 4-bit (NF4, double quantisation, computing in
the 16-bit trained dtype, bf16 by default), under LoRA adapters (rank 16 unless ``--lora R``).
``--8bit`` is LoRA on an 8-bit base: the base's linear layers in bitsandbytes 8-bit as
``load_in_8bit=True`` loads them (LLM.int8(), outlier threshold 6.0, computing in the trained
dtype), under the same adapters.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
from typing import TYPE_CHECKING

from gradckpt.tables import format_count

from .builtin_models import DTYPES, PlanTarget
from .errors import CommandLineError

if TYPE_CHECKING:
    import torch
    from torch import nn

__all__ = [
    "DEFAULT_QLORA_RANK", "DEFAULT_TARGETS", "check_lora_arguments", "fine_tuned", "trained_dtype",
    "with_lora",
]

# PEFT's name for every linear layer but the output head: the QLoRA paper's recipe, and what
# fine-tuning scripts now default to.
DEFAULT_TARGETS = "all-linear"
# --qlora or --8bit without --lora R: the QLoRA paper's and most fine-tuning scripts' adapter rank.
DEFAULT_QLORA_RANK = 16


def check_lora_arguments(args: argparse.Namespace) -> None:
    """What can be wrong with ``--lora``, ``--lora-targets``, ``--qlora`` and ``--8bit``
    before any slow work.

    Example:
        >>> arguments = argparse.Namespace(lora=None, lora_targets="q_proj")
        >>> check_lora_arguments(arguments)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        gradckpt.cli.errors.CommandLineError: --lora-targets names the modules that get ...
    """
    base = _quantized_base(args)
    if args.lora is None and base is None:
        if args.lora_targets is not None:
            raise CommandLineError(
                "--lora-targets names the modules that get adapters: add --lora R (the "
                "adapters' rank, e.g. --lora 16)"
            )
        return
    if getattr(args, "qlora", False) and getattr(args, "eight_bit", False):
        raise CommandLineError(
            "--qlora and --8bit both quantise the base: --qlora for 4-bit (NF4), --8bit for "
            "8-bit (LLM.int8()), not both"
        )
    flag = base or "--lora"
    try:
        import peft  # noqa: F401
    except ImportError:
        raise CommandLineError(
            f"{flag} needs PEFT: pip install 'gradckpt[hf]' (or pip install peft)"
        ) from None
    if base is not None:
        try:
            import bitsandbytes  # noqa: F401
        except ImportError:
            bits = "4-bit" if base == "--qlora" else "8-bit"
            raise CommandLineError(
                f"{base} needs bitsandbytes for its {bits} layers: pip install bitsandbytes "
                "(after torch, which it depends on)"
            ) from None


def _quantized_base(args: argparse.Namespace) -> str | None:
    """The flag that quantises the base, if one is given: ``--qlora`` or ``--8bit``."""
    if getattr(args, "qlora", False):
        return "--qlora"
    return "--8bit" if getattr(args, "eight_bit", False) else None


def fine_tuned(target: PlanTarget, args: argparse.Namespace) -> PlanTarget:
    """``target`` as the command line trains it: with LoRA adapters when ``--lora`` is given,
    on a 4-bit base with ``--qlora`` or an 8-bit one with ``--8bit`` (its description saying
    so), else as it is.

    Example:
        >>> from gradckpt.cli.builtin_models import BUILTIN_MODELS
        >>> target = BUILTIN_MODELS["mlp-chain"][1](2, 4)
        >>> fine_tuned(target, argparse.Namespace(lora=None, lora_targets=None)) is target
        True
    """
    quantized = _quantized_base(args)
    if args.lora is None and quantized is None:
        return target
    import torch

    dtype = trained_dtype(args, target)
    model = target.model.to(dtype) if dtype is not None else target.model
    rank = args.lora if args.lora is not None else DEFAULT_QLORA_RANK
    base = ""
    if quantized == "--qlora":
        from gradckpt.integrations.quantized import quantize_linear_layers

        compute = dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        quantize_linear_layers(model, compute_dtype=compute)
        base = f" on a 4-bit NF4 base (double quantisation, computing in {_short(compute)})"
    elif quantized == "--8bit":
        from gradckpt.integrations.quantized_8bit import (
            DEFAULT_THRESHOLD,
            quantize_linear_layers_8bit,
        )

        quantize_linear_layers_8bit(model)
        base = f" on an 8-bit base (LLM.int8(), outlier threshold {DEFAULT_THRESHOLD})"
    model, phrase = with_lora(model, rank, args.lora_targets)
    return dataclasses.replace(
        target, model=model, description=f"{target.description} + {phrase}{base}",
        dtype_applied=True,
    )


def trained_dtype(args: argparse.Namespace, target: PlanTarget) -> torch.dtype | None:
    """The dtype ``estimate`` casts the step to: ``--dtype``, else fp32 under ``--autocast``
    (mixed precision keeps fp32 weights), else the config's; ``None`` when ``fine_tuned``
    has put the model in its dtype already (adapters in PEFT's own).

    Example:
        >>> from gradckpt.cli.builtin_models import PlanTarget
        >>> args = argparse.Namespace(dtype="bf16", autocast=None)
        >>> trained_dtype(args, PlanTarget(None, None, "a model", config_dtype="float32"))
        torch.bfloat16
    """
    import torch

    if target.dtype_applied:
        return None
    if getattr(args, "dtype", None):
        return getattr(torch, DTYPES[args.dtype])
    if getattr(args, "autocast", None):
        return torch.float32
    return getattr(torch, target.config_dtype) if target.config_dtype else None


def _short(dtype: torch.dtype) -> str:
    return {"bfloat16": "bf16", "float16": "fp16"}.get(str(dtype).removeprefix("torch."), "fp32")


def with_lora(model: nn.Module, rank: int, targets: str | None) -> tuple[nn.Module, str]:
    """``model`` with LoRA adapters of ``rank`` on ``targets`` (comma-separated module
    names, or ``"all-linear"``, the default), its base frozen; and a phrase for the
    description line.

    Example:
        >>> import torch
        >>> from transformers import LlamaConfig, LlamaForCausalLM
        >>> base = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=16,
        ...     intermediate_size=32, num_hidden_layers=2, num_attention_heads=2))
        >>> model, phrase = with_lora(base, 4, "q_proj,v_proj")
        >>> phrase
        'LoRA r=4 on q_proj, v_proj (512 trainable of 7.76K parameters)'
    """
    import peft

    chosen = targets or DEFAULT_TARGETS
    modules: str | list[str] = (
        chosen if chosen == DEFAULT_TARGETS
        else [name.strip() for name in chosen.split(",") if name.strip()]
    )
    config = peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=modules)
    import torch

    # On a base built on meta, the adapters are made there too: PEFT would initialise each on
    # the CPU and move it (448 real random inits for Llama-3-8B, half a second).
    on_meta = all(p.is_meta for p in model.parameters())
    try:
        with torch.device("meta") if on_meta else contextlib.nullcontext():
            wrapped = peft.get_peft_model(model, config)
    except ValueError as error:
        raise CommandLineError(
            f"--lora-targets {chosen}: {error}; this model's linear layers are named "
            f"{', '.join(_linear_names(model))} (or pass --lora-targets {DEFAULT_TARGETS})"
        ) from None
    trainable = sum(p.numel() for p in wrapped.parameters() if p.requires_grad)
    total = sum({id(p): p.numel() for p in wrapped.parameters()}.values())
    where = chosen if chosen == DEFAULT_TARGETS else ", ".join(modules)
    return wrapped, (f"LoRA r={rank} on {where} ({format_count(trainable)} trainable of "
                     f"{format_count(total)} parameters)")


def _linear_names(model: nn.Module) -> list[str]:
    """The distinct last names of the model's linear layers (what ``target_modules`` takes)."""
    from torch import nn

    names = {name.rsplit(".", 1)[-1] for name, module in model.named_modules()
             if isinstance(module, nn.Linear)}
    return sorted(names)
