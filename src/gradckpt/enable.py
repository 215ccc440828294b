"""The one-liner: measure the model, solve for the budget, apply the plan.

``enable(model, sample, budget="6GiB", optimizer=optimizer)`` is ``profile`` → ``solve`` →
``apply``, for the steady state of the user's loop (the optimizer's state alive, its step's
peak counted); it returns the plan, whose ``str`` and ``predicted_peak_bytes`` say what the
step will cost before it runs. On a model that carries a plan, it measures the model without
it and replaces it; when anything fails, the model keeps the plan it had.

``plan_and_apply`` is that path, profile → solve → apply, written once: ``enable`` wraps it, and
the Hugging Face Trainer's callback (``integrations.hf_trainer``) calls it with what the Trainer
fixes (its optimizer, its accumulation, DDP, a loop that drops the output first). ``check_request``
refuses a strategy or budget it cannot use before anything runs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .apply import apply, replacing_plan
from .budget import check_budget, format_bytes
from .distributed import agreed_on_every_rank
from .errors import UsageError, warn_once
from .measure import profile
from .measure.optimizer_step import check_optimizer
from .measure.training_state import check_ddp, optimizer_state_bytes
from .plan import Plan
from .profile_types import Profile
from .solvers import BUDGET_DRIVEN, check_output_head, check_strategy, solve

__all__ = ["check_request", "enable", "plan_and_apply"]


def enable(
    model: nn.Module,
    sample: Any,
    budget: int | str = "auto",
    strategy: str = "optimal",
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    blocks: Any = None,
    *,
    optimizer: torch.optim.Optimizer | str | None = None,
    accumulation_steps: int = 1,
    ddp: bool = False,
    keep_output: bool = True,
    output_head: str = "auto",
) -> Plan:
    """Checkpoint ``model`` so that the training step on batches like ``sample`` fits ``budget``.

    Args:
        model: the model, as it will be trained.
        sample: one batch as the loop passes it (for a Hugging Face model, ``labels``
            included), the largest the run will see.
        budget: the peak memory of a whole training step on the model's device, everything
            included (parameters, gradients, the optimizer's state, ``optimizer.step()``):
            bytes (int), ``"6GiB"``, ``"6GB"``, ``"60%"`` (of that step's peak without
            checkpointing) or ``"auto"`` (what the device has free).
        strategy: ``"optimal"`` (default), ``"chen-greedy"``, ``"sqrt"``, ``"every-layer"``
            or ``"none"``.
        loss_fn, blocks: as for ``gradckpt.profile``.
        optimizer: the optimizer the loop steps (an optimizer object: its real state; or a
            name such as ``"adamw"``, ``"sgd"``, ``"adamw-8bit"``). Its state and its step's
            peak are part of the step planned for. ``None`` with trainable parameters warns
            once (the plan would leave out the state AdamW adds from step 2 on); pass
            ``"none"`` for a loop without an optimizer step.
        accumulation_steps: micro-batches per optimizer step; above 1 the gradients held
            between micro-batches are counted.
        ddp: ``True`` when the model will train wrapped in
            ``torch.nn.parallel.DistributedDataParallel`` (enable on the bare model, then wrap
            it): DDP's buckets, a copy of every trainable gradient alive all run, are counted
            in the step, so that a rank's peak, buckets included, fits ``budget``. A model
            already wrapped (``enable(ddp_model, ...)``) needs nothing: its step is measured
            through the wrapper, buckets included, and ``ddp=True`` does not count them twice.
        keep_output: the loop holds the model's output until backward ends (``out =
            model(**batch); out.loss.backward()``); ``False`` for loops that drop it first
            (the Hugging Face Trainer).
        output_head: what the plan may do with a language model's output head (its loss
            through ``gradckpt.linear_cross_entropy``, as a Hugging Face causal language model
            given ``labels`` has it): ``"auto"`` (default) computes the loss in chunks of
            tokens, each chunk's logits recomputed in backward, when that fits where the plain
            head does not or fits faster; the output's ``logits`` are then an empty
            ``(batch, seq, 0)`` tensor in training steps. ``"plain"`` keeps the logits whole
            (a loop that reads them), ``"chunked"`` always chunks.

    Returns the plan applied. When the model fits without checkpointing the plan is empty and
    the model runs exactly as before.

    Raises:
        gradckpt.BudgetError: no plan meets the budget; ``minimum_bytes`` is the smallest that
            does and ``profile`` the measurement, to retry without measuring again.
        gradckpt.UsageError: a malformed budget, an unknown strategy or optimizer (refused
            before anything runs), a model without a chain of blocks, a sample it cannot run.

    Calling it again (another budget, a re-run notebook cell) replaces the plan; after any
    error the model is as it was, its earlier plan included.

    Example:
        >>> import torch, gradckpt
        >>> from gradckpt.toy_models import GPTConfig, TinyGPT
        >>> model = TinyGPT(GPTConfig(n_layer=4, n_embd=32, n_head=2, block_size=64))
        >>> optimizer = torch.optim.AdamW(model.parameters())
        >>> idx = torch.randint(0, 512, (8, 64))
        >>> plan = gradckpt.enable(model, {"idx": idx, "targets": idx}, budget="70%",
        ...                        optimizer=optimizer)
        >>> plan.predicted_peak_bytes <= plan.budget_bytes
        True
        >>> gradckpt.disable(model)

        Under DDP (on every rank, before ``DistributedDataParallel(model)``), ``ddp=True``
        counts its buckets, as large as the trainable parameters:

        >>> under_ddp = gradckpt.enable(model, {"idx": idx, "targets": idx}, budget=None,
        ...                             strategy="sqrt", optimizer=optimizer, ddp=True)
        >>> buckets = sum(p.numel() * 4 for p in model.parameters())
        >>> plain = gradckpt.enable(model, {"idx": idx, "targets": idx}, budget=None,
        ...                         strategy="sqrt", optimizer=optimizer)
        >>> abs(under_ddp.predicted_peak_bytes - plain.predicted_peak_bytes - buckets) < 4096
        True
        >>> gradckpt.disable(model)
    """
    check_request(budget, strategy, output_head)  # a bad request is refused before any warning
    check_ddp(ddp)
    if optimizer is None:  # "none": no optimizer step, and no warning
        _warn_without_optimizer(model)
    plan, _ = plan_and_apply(model, sample, budget, strategy, loss_fn, blocks,
                             optimizer=optimizer, accumulation_steps=accumulation_steps,
                             ddp=ddp, keep_output=keep_output, output_head=output_head)
    return plan


def plan_and_apply(
    model: nn.Module,
    sample: Any,
    budget: int | str | None,
    strategy: str,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    blocks: Any = None,
    *,
    optimizer: torch.optim.Optimizer | str | None,
    accumulation_steps: int = 1,
    ddp: bool = False,
    keep_output: bool = True,
    output_head: str = "auto",
    progress: Callable[[int, int], None] | None = None,
) -> tuple[Plan, Profile]:
    """Profile ``model`` on ``sample``, solve for ``budget``, apply the plan: ``enable``'s path.

    The one path every entry that plans and applies takes (``enable`` and the Trainer
    callback; ``gradckpt plan`` only profiles and solves), so that they plan the same step
    alike: the model is measured without any plan it
    carries, under ``torch.distributed`` rank 0 solves and every rank gets its plan
    (``distributed.agreed_on_every_rank``), and the plan replaces the old one; after any error
    the model is as it was, its earlier plan included. ``enable`` adds what a user calling it
    needs (a warning when no optimizer is given); callers of this function pass what their loop
    fixes and translate errors into their own terms.

    Args:
        model, sample, budget, strategy, loss_fn, blocks, accumulation_steps, ddp,
            keep_output, output_head: as for ``enable`` (``keep_output=False``: the Trainer's
            loop, which drops the output before backward).
        optimizer: as for ``enable``, without its default: ``None`` counts no optimizer step
            and warns of nothing.
        progress: called as ``progress(done, total)`` while profiling, as for ``profile``.

    Returns the plan applied and the profile it was solved from.

    Raises what ``enable`` raises.

    Example:
        >>> import torch, gradckpt
        >>> from gradckpt.toy_models import GPTConfig, TinyGPT
        >>> model = TinyGPT(GPTConfig(n_layer=4, n_embd=32, n_head=2, block_size=64))
        >>> idx = torch.randint(0, 512, (8, 64))
        >>> plan, measured = plan_and_apply(model, {"idx": idx, "targets": idx}, "70%",
        ...                                 "optimal", optimizer="adamw", keep_output=False)
        >>> plan.budget_bytes == measured.peak_bytes * 70 // 100  # of the step planned for
        True
        >>> gradckpt.get_plan(model) is plan
        True
        >>> gradckpt.disable(model)
    """
    check_request(budget, strategy, output_head)
    check_ddp(ddp)
    optimizer = check_optimizer(optimizer)  # a misspelt name is told before anything runs
    # Measured as the model is without a plan; any plan it had comes back if anything fails.
    with replacing_plan(model):
        measured = profile(model, sample, loss_fn=loss_fn, blocks=blocks, optimizer=optimizer,
                           accumulation_steps=accumulation_steps, ddp=ddp,
                           keep_output=keep_output, progress=progress)
        # solve reads a percentage of the measured step and "auto" on the model's device.
        plan = agreed_on_every_rank(
            lambda: solve(measured, budget, strategy, output_head=output_head))
        apply(model, plan)
    return plan, measured


def check_request(budget: int | str | None, strategy: str, output_head: str = "auto") -> None:
    """Raise ``UsageError`` for a strategy gradckpt lacks, for ``budget=None`` with a strategy
    that needs a budget, for a budget ``parse_budget`` cannot read, or for an ``output_head``
    other than ``OUTPUT_HEADS``; nothing is measured, so a percentage and ``"auto"`` are read
    later, by ``solve``.

    Example:
        >>> check_request("60%", "optimal"), check_request(None, "sqrt")
        (None, None)
        >>> check_request(None, "optimal")
        Traceback (most recent call last):
        ...
        gradckpt.errors.UsageError: strategy 'optimal' chooses its plan for a budget and ...
    """
    check_strategy(strategy)
    check_output_head(output_head)
    if budget is None:  # the fixed strategies' plan, whatever it costs
        if strategy in BUDGET_DRIVEN:
            raise UsageError(
                f"strategy {strategy!r} chooses its plan for a budget and budget=None gives "
                f"none; pass one ('6GiB', '60%', 'auto') or use one of the fixed strategies "
                f"'none', 'every-layer', 'sqrt'"
            )
        return
    check_budget(budget)


def _warn_without_optimizer(model: nn.Module) -> None:
    """Warn once that the plan leaves out an optimizer's state, naming AdamW's size."""
    adamw_bytes = optimizer_state_bytes("adamw", model)
    if not adamw_bytes:
        return
    warn_once(
        "enable-without-optimizer",
        f"gradckpt.enable() got no optimizer=, so the plan is for forward and backward only; "
        f"from the second step on an optimizer's state is alive too (AdamW's: "
        f"{format_bytes(adamw_bytes)} for this model's trainable parameters) and the step "
        f"would go over the budget. Pass the optimizer the loop steps: enable(model, sample, "
        f"budget, optimizer=optimizer) (or a name such as 'adamw'), or optimizer='none' for a "
        f"loop without an optimizer step.",
        stacklevel=4,  # the user's call of enable
    )
