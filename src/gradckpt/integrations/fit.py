"""The cheapest change that fits: when a training step does not fit a budget, the few
configurations of it that do, the least change to what is trained first, then the fastest.

``fit(model, sample, budget, device=..., optimizer=...)`` predicts the step as it is with
``gradckpt.estimate`` (fake tensors: no weights, no real compute) and, where no plan makes it
fit, the same step with the levers gradckpt knows pulled, alone and together, each
configuration estimated once and solved for the budget. The levers (``LEVERS``), each with the
*change rank* that orders them:

====  ==============  ==========================================================================
rank  lever           what changes
====  ==============  ==========================================================================
-     recompute       a checkpointing plan: activations recomputed (or offloaded) in backward
-     chunked-head    the output head's loss in chunks of tokens, each chunk's logits recomputed
0     drop-output     the loop drops the model's output before backward, as the HF Trainer does
1     autocast        bf16 mixed precision: fp32 weights, the forward under ``torch.autocast``
1     micro-batch     a smaller micro-batch with gradient accumulation: the same effective batch
2     bf16            the whole model in bf16: weights, gradients and optimizer state rounded
3     lora            LoRA adapters (PEFT) on a frozen base instead of training every weight
4     4bit            the frozen base in 4 bits (QLoRA: NF4 with double quantisation) + LoRA
5     fsdp            FSDP2 sharding over N GPUs (the fewest that fit; per-GPU peak and time)
====  ==============  ==========================================================================

"Cheapest" is defined so. The plan's levers (recompute, chunked-head) are what gradckpt does
anyway and count as no change; the others change the step, each by its rank: 0 the loop, not
what is trained (the same numbers come out); 1 the numerics a little; 2 more; 3 and 4 what is
trained; 5 costs money. An option's *change* is the ranks of its levers but the plan's,
largest first, and options are ordered by it as tuples: a rank-3 lever is more change than any
number of rank-1 ones; of two options whose largest ranks are equal, the one with fewer levers
of that rank (then of the next) is less change; dropping the output is more change than a plan
alone and less than anything else. Equal change is ordered by fewer GPUs, then by the predicted
time of an optimizer step over the same effective batch. Of a lever's values, the least change
is taken that fits: the largest micro-batch (GPUs keep busier with it than a roofline shows),
the fewest GPUs.

The search (``gradckpt.integrations.fit_search``) stays small: each configuration is one
estimate, solved once for every plan it allows; configurations go in order of change and stop
once ``count`` options are found; sets of levers that cannot fit are ruled out without
estimating them.

The model is never changed: the levers that wrap it (LoRA, 4-bit) work on a copy on the meta
device, whose parameters take no memory.

Example:
    >>> import torch
    >>> from gradckpt.toy_models import mlp_chain
    >>> model, sample = mlp_chain(16, 256), torch.randn(8, 64, 256)  # 1M fp32 parameters
    >>> search = fit(model, sample, "9MiB", device="h100",
    ...              levers=["recompute", "micro-batch", "bf16"])
    >>> search.as_is_least_peak_bytes > 9 * 2**20  # no plan of the step as it is fits
    True
    >>> [(option.levers, option.description) for option in search.options]  # doctest: +ELLIPSIS
    [(('recompute', 'bf16'), 'bf16 throughout; ... blocks recomputed')]
    >>> search.options[0].predicted_peak_bytes <= 9 * 2**20
    True
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from ..errors import UsageError
from ..predict.devices import DeviceSpec, device_spec
from ..solvers import check_output_head
from .fit_options import (
    LEVERS,
    Adapters,
    Configuration,
    FineTune,
    FitOption,
    FitSearch,
    Lever,
    LeverSkipped,
    _allowed_levers,
    check_levers,
)
from .fit_options import _change as _change
from .fit_options import _subsets_by_change as _subsets_by_change
from .fit_search import _Search
from .fit_step import _batch_size
from .fit_step import _meta_copy as _meta_copy

__all__ = [
    "LEVERS", "Adapters", "Configuration", "FitOption", "FitSearch", "Lever", "LeverSkipped",
    "check_levers", "fit", "lora_adapters",
]
# The option types live in fit_options, the search in fit_search, its reading of the step in
# fit_step; each name is importable from here as before the split. ``_change``,
# ``_subsets_by_change`` and ``_meta_copy`` are imported ``as`` themselves: re-exported for the
# tests that pin them.


def fit(
    model: nn.Module,
    sample: Any,
    budget: int | str = "auto",
    *,
    device: str | DeviceSpec | dict = "this",
    optimizer: str | None = None,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    dtype: torch.dtype | None = None,
    autocast: torch.dtype | None = None,
    accumulation_steps: int = 1,
    keep_output: bool = True,
    world_size: int = 1,
    ddp: bool = False,
    adapters: Adapters | None = None,
    levers: Iterable[str] | None = None,
    count: int = 3,
    max_world_size: int = 8,
    lora_rank: int = 16,
    lora_targets: str | None = None,
    output_head: str = "auto",
    fine_tune: FineTune | None = None,
    on_estimate: Callable[[str], None] | None = None,
) -> FitSearch:
    """The ``count`` cheapest configurations of the training step that fit ``budget`` on
    ``device``, best first (the order: this module's docstring; the search: ``fit_search``'s).

    Args:
        model, sample, loss_fn: the step, as for ``gradckpt.estimate``; the model may be on
            the meta device (no weights) and is not changed.
        budget: the peak per GPU, in any form ``gradckpt.solve`` reads; ``"auto"`` (default)
            is what ``device`` has; a percentage is of the step as it is, without checkpointing.
        device, optimizer, dtype, autocast, accumulation_steps, keep_output, world_size, ddp:
            the step as it is, as ``gradckpt.estimate`` takes them. Under ``ddp`` the ``fsdp``
            lever is FSDP2 instead of DDP over N GPUs, each keeping its batch.
        adapters: the step as it is trains these adapters on ``model`` (made by ``fine_tune``).
        levers: the names of ``LEVERS`` that may be pulled (default: all).
        count: how many options to find.
        max_world_size: the most GPUs the ``fsdp`` lever may use (it tries 2, 4, 8, ...).
        lora_rank, lora_targets: the adapters the ``lora`` and ``4bit`` levers add.
        output_head: as for ``gradckpt.solve`` (``"plain"``: the logits stay whole).
        fine_tune: ``(copy of model, Adapters, dtype) -> model with them``, the base cast to
            ``dtype`` first; default ``lora_adapters``.
        on_estimate: called with a configuration's description before it is estimated.

    Returns a ``FitSearch``. If the step fits as it is, without a plan, its one option pulls
    no lever.

    Raises ``UsageError`` for an unknown lever name or a malformed argument, and
    ``BudgetError`` when no configuration fits: its ``minimum_bytes`` is the least peak the
    configuration with every lever pulled reaches, and the message says so.

    Example:
        >>> import torch
        >>> from gradckpt.toy_models import mlp_chain
        >>> search = fit(mlp_chain(16, 256), torch.randn(8, 64, 256), "12MiB", device="h100",
        ...              levers=["recompute"])
        >>> best = search.options[0]
        >>> best.levers, best.predicted_peak_bytes <= search.budget_bytes, search.estimated
        (('recompute',), True, 1)
        >>> fit(mlp_chain(16, 256), torch.randn(8, 64, 256), "9MiB", levers=["recompte"])
        Traceback (most recent call last):
        ...
        gradckpt.errors.UsageError: unknown lever 'recompte'; did you mean 'recompute'? ...
    """
    check_output_head(output_head)
    allowed = _allowed_levers(levers, output_head)
    for name, value, what in (("count", count, "options to find"),
                              ("max_world_size", max_world_size, "the most GPUs"),
                              ("lora_rank", lora_rank, "the adapters' rank")):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise UsageError(f"{name} must be a positive int ({what}), got {value!r}")
    spec = device_spec(device)
    as_is = Configuration(
        batch=_batch_size(sample), accumulation_steps=accumulation_steps,
        world_size=world_size, dtype=dtype, autocast=autocast, keep_output=keep_output,
        adapters=adapters, ddp=ddp,
    )
    search = _Search(
        model=model, sample=sample, loss_fn=loss_fn, spec=spec, optimizer=optimizer,
        allowed=allowed, output_head=output_head, fine_tune=fine_tune or lora_adapters,
        max_world_size=max_world_size,
        new_adapters=Adapters(lora_rank, lora_targets, "as-is"), on_estimate=on_estimate,
    )
    return search.run(as_is, budget, count)


def lora_adapters(model: nn.Module, adapters: Adapters, dtype: torch.dtype | None = None
                  ) -> nn.Module:
    """``model`` as fine-tuning scripts load it: cast to ``dtype`` (None: as it is), its linear
    layers in 4 bits for ``adapters.base == "4-bit"`` (``gradckpt.integrations.quantized``:
    NF4, computing in ``dtype`` where it is 16-bit, else bf16) or 8 bits for ``"8-bit"``
    (``quantized_8bit``: LLM.int8()), then LoRA adapters (PEFT, ``lora_alpha`` twice the rank,
    in PEFT's dtype: fp32), as ``gradckpt plan --lora R [--qlora | --8bit]`` makes them.
    Changes ``model`` in place. The default ``fine_tune`` of ``fit``.

    Example:
        >>> import torch
        >>> base = torch.nn.Sequential(torch.nn.Linear(8, 8))
        >>> wrapped = lora_adapters(base, Adapters(2), torch.bfloat16)
        >>> {n.split(".")[-2]: p.dtype for n, p in wrapped.named_parameters()}
        {'base_layer': torch.bfloat16, 'default': torch.float32}
    """
    try:
        import peft
    except ImportError:
        raise LeverSkipped("LoRA needs PEFT: pip install 'gradckpt[hf]'") from None
    if dtype is not None:
        model = model.to(dtype)
    if adapters.base in ("4-bit", "8-bit"):
        sixteen_bit = dtype if dtype in (torch.bfloat16, torch.float16) else torch.bfloat16
        model = _quantized_base(model, adapters.base, sixteen_bit)
    elif adapters.base != "as-is":
        raise LeverSkipped(f"a {adapters.base} base is not built by lora_adapters")
    targets: str | list[str] = (
        "all-linear" if adapters.targets in (None, "all-linear")
        else [name.strip() for name in adapters.targets.split(",") if name.strip()]
    )
    config = peft.LoraConfig(r=adapters.rank, lora_alpha=2 * adapters.rank,
                             target_modules=targets)
    return peft.get_peft_model(model, config)


def _quantized_base(model: nn.Module, base: str, compute_dtype: torch.dtype) -> nn.Module:
    """``model``'s linear layers as bitsandbytes 4-bit (QLoRA's base, computing in
    ``compute_dtype``) or 8-bit (LLM.int8()) ones, as Transformers loads them."""
    try:
        if base == "8-bit":
            from .quantized_8bit import quantize_linear_layers_8bit

            return quantize_linear_layers_8bit(model)
        from .quantized import quantize_linear_layers

        return quantize_linear_layers(model, compute_dtype=compute_dtype)
    except ImportError as error:
        raise LeverSkipped(f"a {base} base needs bitsandbytes ({error})") from None

