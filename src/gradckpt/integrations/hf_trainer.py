"""Hugging Face ``Trainer``: ``GradckptCallback`` plans and applies gradckpt when training begins.

In ``on_train_begin`` (the Trainer's optimizer and data loader built, no step run yet) the
callback takes ``gradckpt.enable``'s own path, ``enable.plan_and_apply`` (profile, solve,
apply), on one batch of the run for the step the Trainer runs, and says what it applied. Here:
what is the Trainer's (its batch, its optimizer, messages and logs in the callback's terms).

This module imports Transformers at the top: it is only imported when a user asks for the
callback (``gradckpt`` itself imports ``integrations.hf``, which does not need Transformers).
"""

from __future__ import annotations

import contextlib
import logging
import numbers
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
import transformers
from torch import nn

from ..budget import format_bytes, rounded_up_budget
from ..budget_watch import watch_of
from ..enable import check_request, plan_and_apply
from ..errors import BudgetError, UsageError
from ..measure import infer_device
from ..plan import Plan
from ..profile_types import Profile
from .hf_trainer_sample import collator_of, first_batch, on_device, pad_token_id_for, padded

__all__ = ["GradckptCallback"]

logger = logging.getLogger("gradckpt")


class GradckptCallback(transformers.TrainerCallback):
    """Checkpoint the model of a ``transformers.Trainer`` run so that its steps fit ``budget``.

    Args:
        budget: the peak memory of a training step on the model's device, everything included
            (parameters, gradients, the optimizer's state): int bytes, ``"6GiB"``, ``"6GB"``,
            ``"60%"`` (of the peak without checkpointing) or ``"auto"`` (what the device has
            free). ``None`` only with the fixed strategies ``"none"``, ``"every-layer"`` and
            ``"sqrt"``.
        strategy: one of ``gradckpt.solvers.STRATEGIES``; ``"optimal"`` by default.
        sample: the batch to profile on (a dict of tensors, as the model takes it); default:
            the first batch of the Trainer's training data loader.
        max_length: pad the profiled batch to this many tokens (see below).
        loss_fn: turns the model's output into the loss, as for ``gradckpt.profile``; default
            ``output.loss``, as the Trainer uses it.
        blocks: the chain of blocks to checkpoint, as for ``gradckpt.profile``; default: found
            in the model (``gradckpt.find_blocks``).
        output_head: as for ``gradckpt.enable``: ``"auto"`` (default) lets the plan compute a
            causal language model's loss in chunks of tokens (``out.logits`` is then empty in
            training steps; evaluation is unchanged), ``"plain"`` rules that out (a
            ``compute_loss`` or callback that reads the logits), ``"chunked"`` always does it.

    When training begins (``on_train_begin``) the callback:

    1. takes the first batch of the training data loader, restoring every random number
       generator it advances (torch's, CUDA's, Python's, NumPy's and the data loader's own), so
       that the run sees the same batches and dropout masks as without the callback. The batch is
       moved to the model's device and padded to the maximum length, since a later batch may be
       longer than the first: ``max_length`` given here, else the collator's ``max_length``
       attribute when it is an int (``DataCollatorWithPadding`` and ``DataCollatorForSeq2Seq``
       have one). Every 2-D integer tensor of the batch shorter than that is padded at the end of
       dim 1: ``labels`` with -100, ``input_ids`` with the pad token id (the collator's
       tokenizer's, else the Trainer's ``processing_class``'s, else ``model.config``'s, else 0),
       ``attention_mask``, ``token_type_ids`` and the rest with 0. Longer tensors are left as
       they are. A ``sample`` passed here is used as given, padded only to a ``max_length``
       passed here. With a data loader whose iteration cannot be repeated (a stream read once),
       pass ``sample=``. Under trl's ``SFTTrainer``, whose ``compute_loss`` calls the model with
       ``fused_lm_head=True`` (the fused head trl adds to it), the batch gets that key too;
    2. plans through ``gradckpt.enable``'s code, in training mode, for the step the Trainer
       runs once under way: its optimizer's state and step (its ``args.optim`` when it has
       none yet), its ``gradient_accumulation_steps``, the output dropped before backward as
       its ``compute_loss`` does (a percentage budget is of that whole step's peak), and,
       where the Trainer wraps the model in ``DistributedDataParallel`` (under ``torchrun``:
       Accelerate's multi-process state other than FSDP and DeepSpeed, a trainable
       parameter), DDP's buckets, a copy of the trainable gradients alive all run
       (``enable(..., ddp=True)``; the Trainer builds DDP without
       ``gradient_as_bucket_view``); the plan replaces any the model carries;
    3. says what it applied in one line on the ``"gradckpt"`` logger at WARNING, which Python
       shows by default (blocks recomputed, predicted peak, budget; the plan's table at INFO),
       and keeps the plan as ``self.plan`` (the profile as ``self.profile``, the optimizer's
       state, accumulated gradients and DDP's buckets it counted as ``self.reserved_bytes``);
    4. on a GPU, after the first steps, logs their measured peak against the prediction and
       the budget (``self.measured_peak_bytes``; a step over the budget also warns, as every
       applied plan does on CUDA).

    It plans once: a second ``trainer.train()`` with the same callback keeps the plan, without
    profiling again (make a new callback to plan again). The plan stays applied when training
    ends; ``gradckpt.disable(model)`` removes it. When planning fails, the model is left as it
    was (an earlier plan included) and the error says why: ``gradckpt.BudgetError`` (with
    ``minimum_bytes``) for a budget no plan meets, ``gradckpt.UsageError`` for a model without
    a chain of blocks it can find (pass ``blocks=``) or a run without a training data loader
    (pass ``sample=``).

    With ``TrainingArguments(activation_checkpointing=True)`` (``gradient_checkpointing``),
    Transformers' own per-layer checkpointing is turned off while the plan is applied: the plan
    decides what is recomputed.

    Example:
        >>> from gradckpt.integrations.hf_trainer import GradckptCallback
        >>> callback = GradckptCallback(budget="60%")
        >>> callback.budget, callback.strategy, callback.plan
        ('60%', 'optimal', None)
        >>> GradckptCallback(budget="6 gigs")
        Traceback (most recent call last):
        ...
        gradckpt.errors.UsageError: GradckptCallback(budget='6 gigs'): budget '6 gigs' not ...
        >>> from transformers import Trainer  # doctest: +SKIP
        >>> trainer = Trainer(model, args, train_dataset=dataset,  # doctest: +SKIP
        ...                   callbacks=[GradckptCallback(budget="20GiB")])
        >>> trainer.train()  # doctest: +SKIP
        >>> print(callback.plan)  # doctest: +SKIP
    """

    def __init__(
        self,
        budget: int | str | None = "auto",
        strategy: str = "optimal",
        *,
        sample: Any = None,
        max_length: int | None = None,
        loss_fn: Callable[[Any], torch.Tensor] | None = None,
        blocks: Any = None,
        output_head: str = "auto",
    ) -> None:
        try:
            # "auto" and percentages are read when planning
            check_request(budget, strategy, output_head)
        except UsageError as error:
            given = f"budget={budget!r}"
            if strategy != "optimal":
                given += f", strategy={strategy!r}"
            if output_head != "auto":
                given += f", output_head={output_head!r}"
            raise UsageError(f"GradckptCallback({given}): {error}") from None
        if max_length is not None and (
            isinstance(max_length, bool)
            or not isinstance(max_length, numbers.Integral)
            or max_length < 1
        ):
            raise UsageError(
                f"GradckptCallback(max_length={max_length!r}): max_length must be a positive int "
                f"(the number of tokens to pad the profiled batch to) or None"
            )
        self.budget = budget
        self.strategy = strategy
        self.sample = sample
        self.max_length = max_length
        self.loss_fn = loss_fn
        self.blocks = blocks
        self.output_head = output_head
        self.plan: Plan | None = None
        self.profile: Profile | None = None
        self.reserved_bytes: int | None = None
        self.measured_peak_bytes: int | None = None

    def on_train_begin(
        self,
        args: transformers.TrainingArguments,
        state: transformers.TrainerState,
        control: transformers.TrainerControl,
        model: nn.Module | None = None,
        train_dataloader: Any = None,
        optimizer: torch.optim.Optimizer | None = None,
        processing_class: Any = None,
        **kwargs: Any,
    ) -> None:
        if self.plan is not None:  # planned in an earlier train() call: keep it
            return
        if model is None:
            raise UsageError(
                "GradckptCallback got no model in on_train_begin; it must be passed to a "
                "transformers.Trainer (callbacks=[GradckptCallback(...)])"
            )
        sample = self._sample(model, train_dataloader, processing_class, infer_device(model))
        # enable's path for the Trainer's step; after an error (no blocks found, a budget no
        # plan meets) the model is as it was.
        try:
            with _training_mode(model):
                plan, measured = plan_and_apply(
                    model, sample, self.budget, self.strategy, self.loss_fn, self.blocks,
                    optimizer=_optimizer_for(optimizer, args),
                    accumulation_steps=args.gradient_accumulation_steps,
                    ddp=_wrapped_in_ddp(args, model), keep_output=False,
                    output_head=self.output_head,
                )
        except BudgetError as error:
            raise self._with_a_budget_that_fits(error) from None
        except UsageError as error:
            raise UsageError(
                f"GradckptCallback could not profile {type(model).__name__}: {error} "
                f"(give the callback blocks=, loss_fn= or sample= as needed)"
            ) from error
        reserved_bytes = (measured.optimizer_state_bytes + measured.accumulated_gradient_bytes
                          + measured.notes.get("ddp_bucket_bytes", 0))
        self.plan, self.profile, self.reserved_bytes = plan, measured, reserved_bytes
        logger.warning("gradckpt: %s", plan_summary(plan, measured, self.budget))
        logger.info("GradckptCallback's plan for %s:\n%s", type(model).__name__, plan)

    # Transformers calls these with (args, state, control, model=..., ...).
    def on_step_end(self, *args: Any, model: nn.Module | None = None, **kwargs: Any) -> None:
        self._report_measured_peak(model, training_ended=False)

    def on_train_end(self, *args: Any, model: nn.Module | None = None, **kwargs: Any) -> None:
        self._report_measured_peak(model, training_ended=True)

    def _report_measured_peak(self, model: nn.Module | None, training_ended: bool) -> None:
        """On a GPU, once the plan's watch has judged the first steps (``budget_watch``: the
        allocator's peak of each step, read at the next forward), log what it measured against
        the prediction and the budget, once; a run too short to finish the watch is reported
        when training ends."""
        if self.plan is None or self.measured_peak_bytes is not None or model is None:
            return
        watch = watch_of(model)
        if watch is None or watch.reason or not watch.measured_peaks:
            return  # not on CUDA, no budget, or no step judged yet
        if watch.active and not training_ended:
            return
        self.measured_peak_bytes = watch.peak_bytes
        logger.warning("gradckpt: %s", watch.summary())

    def _with_a_budget_that_fits(self, error: BudgetError) -> BudgetError:
        """An infeasible budget's error, saying what to pass the callback instead."""
        smallest = rounded_up_budget(error.minimum_bytes)
        headline = str(error).split("\n", 1)[0]
        return BudgetError(
            f"GradckptCallback(budget={self.budget!r}): {headline}\n"
            f"{error.explanation or ''} Pass a budget that fits: "
            f"GradckptCallback(budget={smallest!r}).".strip(),
            minimum_bytes=error.minimum_bytes, profile=error.profile,
            explanation=error.explanation,
        )

    def _sample(
        self, model: nn.Module, train_dataloader: Any, processing_class: Any, device: torch.device
    ) -> Any:
        """The batch to profile on, on ``device``, padded as the class docstring says."""
        sample, collator, max_length = self.sample, None, self.max_length
        if sample is None:
            if train_dataloader is None:
                raise UsageError(
                    "GradckptCallback needs a batch to profile the model on and the Trainer "
                    "has no training data loader; pass one: GradckptCallback(sample={...})"
                )
            sample = first_batch(train_dataloader)
            collator = collator_of(train_dataloader)
            collator_length = getattr(collator, "max_length", None)
            if max_length is None and type(collator_length) is int:  # not a bool either
                max_length = collator_length
        sample = on_device(sample, device)
        if max_length is not None:
            pad_token_id = pad_token_id_for(collator, processing_class, model)
            sample = padded(sample, max_length, pad_token_id)
        if isinstance(sample, Mapping) and _has_trl_fused_head(model):
            # trl's SFTTrainer computes the loss through the fused head it patched onto the
            # model: its compute_loss calls model(**batch, fused_lm_head=True), whose memory is
            # not the plain forward's (on CPU a chunk of 32768 positions' logits, 8 MiB at a
            # vocabulary of 64). The step planned for must be that call.
            sample = {"fused_lm_head": True, **sample}
        return sample


def plan_summary(plan: Plan, measured: Profile, budget: int | str | None) -> str:
    """One line saying what a plan does: blocks recomputed, predicted peak, budget, extra time.

    Example:
        >>> from gradckpt.plan import Plan, Segment
        >>> from gradckpt.profile_types import Profile, example_block
        >>> blocks = [example_block(f"h.{i}") for i in range(4)]
        >>> profile = Profile(blocks, 1210, 1000, 12.0)
        >>> plan = Plan("optimal", 1150, [Segment(0, 1)], 1120, 2.0, 0.166,
        ...             block_names=["h.0", "h.1", "h.2", "h.3"])
        >>> print(plan_summary(plan, profile, "95%"))  # doctest: +NORMALIZE_WHITESPACE
        plan optimal recomputes 2 of 4 blocks: predicted peak 1.09 KiB, budget 1.12 KiB
        ('95%'), 1.18 KiB without checkpointing; +16.6% time per step
    """
    recomputed = len({index for segment in plan.segments for index in segment.blocks()})
    head = f" and the loss in {plan.head_chunks} chunks" if plan.head_chunks > 1 else ""
    return (
        f"plan {plan.strategy} recomputes {recomputed} of {len(measured.blocks)} blocks{head}: "
        f"predicted peak {format_bytes(plan.predicted_peak_bytes)}, budget "
        f"{_budget_text(budget, plan.budget_bytes)}, {format_bytes(measured.peak_bytes)} "
        f"without checkpointing; +{100 * plan.predicted_overhead:.1f}% time per step"
    )


def _budget_text(budget: int | str | None, budget_bytes: int | None) -> str:
    if budget_bytes is None:
        return "none"
    if isinstance(budget, str):  # "85%" or "auto": say what it came to
        return f"{format_bytes(budget_bytes)} ({budget!r})"
    return format_bytes(budget_bytes)


def _optimizer_for(
    optimizer: torch.optim.Optimizer | None, args: transformers.TrainingArguments
) -> torch.optim.Optimizer | str:
    """The optimizer whose state to count: the Trainer's, unwrapped from Accelerate's
    ``AcceleratedOptimizer`` (whose class name says nothing of the state it keeps), or the
    name ``args.optim`` stands for when the Trainer has not built one yet or has one that is no
    ``torch.optim.Optimizer`` (DeepSpeed's)."""
    while isinstance(getattr(optimizer, "optimizer", None), torch.optim.Optimizer):
        optimizer = optimizer.optimizer
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    name = str(getattr(args.optim, "value", args.optim)).lower()
    for prefix, counted_as in (("sgd", "sgd"), ("adagrad", "adagrad"), ("rmsprop", "adam")):
        if name.startswith(prefix):
            return counted_as
    # The Trainer's default is AdamW; Adafactor, Lion and 8-bit optimizers keep less, so
    # counting two full-size states for them errs on the safe side.
    return "adamw"


def _wrapped_in_ddp(args: transformers.TrainingArguments, model: nn.Module) -> bool:
    """Whether the Trainer trains ``model`` wrapped in ``DistributedDataParallel``, as
    Accelerate's ``prepare_model`` (1.16) decides: more than one process in a ``MULTI_*`` state
    (``MULTI_GPU``, ``MULTI_CPU``, ...; not ``FSDP`` or ``DEEPSPEED``; on CPU the Trainer's FSDP
    settings give ``MULTI_CPU`` and DDP), no tensor parallelism, and a trainable parameter. The
    Trainer builds DDP's options from ``ddp_find_unused_parameters``, ``ddp_bucket_cap_mb``,
    ``ddp_broadcast_buffers`` and ``ddp_static_graph``, never ``gradient_as_bucket_view``: the
    buckets are a copy. Without an Accelerate state (a callback called by hand), the arguments
    say it: ``parallel_mode`` distributed over more than one process, without FSDP or
    DeepSpeed.

    Example:
        >>> import tempfile, torch, transformers
        >>> args = transformers.TrainingArguments(tempfile.mkdtemp(), use_cpu=True)
        >>> _wrapped_in_ddp(args, torch.nn.Linear(2, 2))  # one process
        False
    """
    if not any(p.requires_grad for p in model.parameters()):
        return False  # Accelerate wraps only a model with something to train
    from accelerate.state import AcceleratorState, is_initialized

    parallelism = getattr(args, "parallelism_config", None)
    if parallelism is not None and getattr(parallelism, "tp_enabled", False):
        return False
    if is_initialized():  # the Trainer's Accelerator made it
        state = AcceleratorState()
        return state.num_processes > 1 and state.distributed_type.name.startswith("MULTI_")
    return (args.parallel_mode == transformers.training_args.ParallelMode.DISTRIBUTED
            and args.world_size > 1 and not args.fsdp and not args.deepspeed)


@contextlib.contextmanager
def _training_mode(model: nn.Module) -> Iterator[None]:
    """The model in training mode, as the Trainer runs it, and each module's mode put back."""
    modes = [(module, module.training) for module in model.modules()]
    model.train()
    try:
        yield
    finally:
        for module, training in modes:
            module.training = training


def _has_trl_fused_head(model: nn.Module) -> bool:
    """Whether trl's ``add_fused_lm_head`` patched a forward in ``model`` (SFTTrainer does, on
    the model under PEFT's wrapper): an instance ``forward`` taking ``fused_lm_head``. Read from
    the code object, as the patch wraps the class's forward (``inspect.signature`` shows that)."""
    for module in model.modules():
        code = getattr(getattr(vars(module).get("forward"), "__func__", None), "__code__", None)
        if code is not None and "fused_lm_head" in code.co_varnames[
                : code.co_argcount + code.co_kwonlyargcount]:
            return True
    return False
