"""Installing a plan on a model, and taking it off again.

``apply(model, plan)`` finds the plan's blocks in the model by name and checkpoints the plan's
segments (nested ones included) with ``gradckpt.engine.segments.checkpoint_segments``: hooks
on the blocks, and the registered ecosystem hooks run (``gradckpt.ecosystem_hooks``: Hugging
Face key/value caches off), nothing else. The hooks run for the plan "none" too: ``profile``
measured the step with them (a T5 training step holds 1.7% more with its cache on), so the
model runs as predicted. Parameters, their names, ``state_dict`` keys and outputs do not change.
``disable(model)`` removes the hooks and undoes the ecosystem hooks: the model runs exactly as
before.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Callable, Iterator
from typing import NamedTuple, NoReturn

from torch import nn

from .budget_watch import watch_budget
from .ecosystem_hooks import Occasion, run_ecosystem_hooks
from .engine import (
    HeadChunking,
    SegmentsHandle,
    checkpoint_segments,
    chunk_head,
    refuse_checkpointed_modules,
)
from .errors import UsageError, either
from .measure import resolve_blocks
from .measure.fingerprint import fingerprint_mismatch
from .plan import Plan, Segment

__all__ = ["apply", "disable", "get_plan", "replacing_plan"]


class _Installed(NamedTuple):
    """What ``apply`` installed on a model: the plan, the segments' hooks (None for a plan
    without segments), the output head's chunking (None: the plain head) and how to undo the
    ecosystem hooks."""

    plan: Plan
    handle: SegmentsHandle | None
    undo_ecosystem_hooks: Callable[[], None]
    unwatch: Callable[[], None]
    head: HeadChunking | None = None


# What apply() installed on each model, so that disable(), get_plan() and a second apply()
# find it.
_installed: weakref.WeakKeyDictionary[nn.Module, _Installed] = weakref.WeakKeyDictionary()


def apply(model: nn.Module, plan: Plan) -> None:
    """Checkpoint ``model`` as ``plan`` says, replacing any plan applied before.

    Example:
        >>> import torch, gradckpt
        >>> from gradckpt.plan import Plan, Segment
        >>> model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(4)])
        >>> plan = Plan("sqrt", None, [Segment(0, 1), Segment(2, 3)], 0, 0.0, 0.0,
        ...             block_names=["0", "1", "2", "3"])
        >>> gradckpt.apply(model, plan)
        >>> model(torch.randn(2, 4, requires_grad=True)).sum().backward()
        >>> gradckpt.disable(model)
    """
    if not isinstance(plan, Plan):
        raise UsageError(f"apply() needs a gradckpt.Plan, got {type(plan).__name__}")
    if not plan.block_names:
        raise UsageError("the plan names no blocks; make it with gradckpt.solve(profile, ...)")
    modules = dict(model.named_modules())
    missing = [name for name in plan.block_names if name not in modules]
    if missing:
        more = " and more" if len(missing) > 3 else ""
        # A plan made before the model was wrapped (PEFT, DDP) names its blocks without the
        # wrapper's prefix.
        wrapped = [found for name in missing[:3] for found in modules
                   if found.endswith("." + name)]
        hint = (f"; the model holds {either(wrapped, joined_by='and')}{more}, as if wrapped "
                f"after the plan was made" if len(wrapped) == len(missing[:3]) else "")
        _refuse_another_models_plan(
            f"it checkpoints {either(missing[:3], joined_by='and')}{more}, which "
            f"{type(model).__name__} has no module named ({len(plan.block_names)} blocks "
            f"planned, {len(missing)} missing){hint}")
    try:
        named_blocks = resolve_blocks(model, plan.block_names)
    except UsageError as error:
        _refuse_another_models_plan(f"its blocks do not make a chain here ({error})")
    mismatch = fingerprint_mismatch(model, plan.block_names, plan.block_fingerprints,
                                    plan.chain_lengths)
    if mismatch is not None:
        _refuse_another_models_plan(mismatch)
    head = _planned_head(model, plan)
    flat = _flatten(plan.segments)
    for segment in flat:
        if segment.policy is not None and segment.children:
            # The engine's policy mode of a segment also sees its children's operations, while
            # the cost model lets the policy govern only blocks outside the children.
            raise UsageError(
                f"segment {segment.start}-{segment.end} has both a policy and nested segments; "
                "the engine supports a policy only on segments without children"
            )
    for parent in flat:
        for child in parent.children:
            if child.policy is not None:
                # Its kept outputs would live from the parent's first forward on: memory no
                # prediction counts.
                raise UsageError(
                    f"segment {child.start}-{child.end} has a policy but is nested in segment "
                    f"{parent.start}-{parent.end}; put policies on top-level segments only "
                    "(inside another segment the kept outputs live through the whole step)"
                )
    # checkpoint_segments refuses them too, but only after the old plan has come off.
    refuse_checkpointed_modules([named_blocks[index] for segment in flat
                                 for index in range(segment.start, segment.end + 1)])
    disable(model)
    handle = None  # plan "none": no hooks, nothing to pay
    if flat:
        names = [f"{plan.block_names[s.start]}..{plan.block_names[s.end]}" for s in flat]
        handle = checkpoint_segments(
            [module for _, module in named_blocks],
            [(s.start, s.end) for s in flat],
            policies=[s.policy for s in flat],
            names=names,
        )
    try:
        # As the profile measured the step (recomputed layers would append to a key/value
        # cache twice, for one), and so that the model's ecosystem knows (integrations.hf).
        undo_ecosystem_hooks = run_ecosystem_hooks(
            model, Occasion(plan_applied=True, recomputes=bool(flat)))
    except BaseException:
        if handle is not None:  # all or nothing: no hooks without their record
            handle.remove()
        raise
    # The loss in chunks (gradckpt.linear_cross_entropy reads it; integrations.hf routes a
    # causal language model's loss through it in training steps with labels).
    chunking = chunk_head(head, plan.head_chunks) if head is not None else None
    # On CUDA, the first training steps are checked against the budget (budget_watch).
    _installed[model] = _Installed(plan, handle, undo_ecosystem_hooks, watch_budget(model, plan),
                                   chunking)


def disable(model: nn.Module) -> None:
    """Remove whatever ``apply`` installed on ``model``; a no-op if nothing is.

    ``model`` may also be a wrapper of the planned model (``peft.get_peft_model`` after
    ``enable``) or what a planned wrapper unwraps to (``merge_and_unload()``).

    Example:
        >>> import torch, gradckpt
        >>> gradckpt.disable(torch.nn.Linear(2, 2))
    """
    for planned in _planned_models_sharing(model):
        installed = _installed.pop(planned)
        if installed.handle is not None:
            installed.handle.remove()
        installed.undo_ecosystem_hooks()
        installed.unwatch()
        if installed.head is not None:
            installed.head.remove()


def get_plan(model: nn.Module) -> Plan | None:
    """The plan ``apply`` (or ``enable``) installed on ``model``, or None when it has none.

    As for ``disable``, ``model`` may also be a wrapper of the planned model (PEFT's) or what
    a planned wrapper unwraps to.

    Example:
        >>> import torch, gradckpt
        >>> from gradckpt.plan import Plan, Segment
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        >>> plan = Plan("sqrt", None, [Segment(0, 1)], 0, 0.0, 0.0, block_names=["0", "1"])
        >>> gradckpt.apply(model, plan)
        >>> gradckpt.get_plan(model) is plan
        True
        >>> gradckpt.disable(model)
        >>> print(gradckpt.get_plan(model))
        None
    """
    planned = _planned_models_sharing(model)
    return _installed[planned[0]].plan if planned else None


@contextlib.contextmanager
def replacing_plan(model: nn.Module) -> Iterator[Plan | None]:
    """Take ``model``'s plan off for the block (it runs as without gradckpt there); if the
    block raises (``KeyboardInterrupt`` included), put that plan back before the error goes
    on. Yields the plan that was on (None if none). What ``enable`` measures and applies in.

    Example:
        >>> import torch, gradckpt
        >>> from gradckpt.plan import Plan, Segment
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
        >>> plan = Plan("sqrt", None, [Segment(0, 1)], 0, 0.0, 0.0, block_names=["0", "1"])
        >>> gradckpt.apply(model, plan)
        >>> try:
        ...     with replacing_plan(model) as previous:
        ...         raise RuntimeError("the new plan could not be made")
        ... except RuntimeError:
        ...     pass
        >>> gradckpt.get_plan(model) is plan
        True
        >>> gradckpt.disable(model)
    """
    previous = get_plan(model)
    disable(model)
    try:
        yield previous
    except BaseException:
        disable(model)  # whatever the block got to apply
        if previous is not None:
            apply(model, previous)
        raise


def _planned_models_sharing(model: nn.Module) -> list[nn.Module]:
    """The models a plan was applied to that are ``model``, inside it or around it: a plan
    applied before PEFT wrapped the model, or to the PEFT model whose ``merge_and_unload()``
    returned ``model``, is still on ``model``'s blocks."""
    if model in _installed:
        return [model]
    inside = set(model.modules())
    return [
        planned for planned in list(_installed)
        if planned in inside or any(module is model for module in planned.modules())
    ]


def _refuse_another_models_plan(why: str) -> NoReturn:
    raise UsageError(
        f"this plan was made for another model: {why}. Its predictions (the peak, the budget it "
        f"fits) are that model's; make a plan for this one: gradckpt.enable(model, sample, "
        f"budget=...)"
    ) from None


def _planned_head(model: nn.Module, plan: Plan) -> nn.Module | None:
    """The module whose loss the plan computes in chunks (None: the plain head)."""
    if plan.head_chunks <= 1:
        return None
    modules = dict(model.named_modules())
    if plan.head_name not in modules:
        raise UsageError(
            f"this plan was made for another model: it chunks the loss at output head "
            f"{plan.head_name!r}, which {type(model).__name__} does not have"
        )
    return modules[plan.head_name]


def _flatten(segments: list[Segment]) -> list[Segment]:
    return [item for segment in segments for item in (segment, *_flatten(segment.children))]
