"""Plans' predicted peaks against the measured ones, for the tests of the cost model: the
model profiled, then run plain and under each plan in the loop's second step with AdamW
(``compare_plans``), the gradients checked bit for bit against the plain model's."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator
from typing import Any
from unittest import mock

import torch

import gradckpt
from gradckpt.cost import plan_for
from gradckpt.engine.fates import operations_kept_by, save_ops_policy_name
from gradckpt.integrations.hf import turn_caches_off
from gradckpt.plan import Segment
from gradckpt.side_by_side import compare_plans


def choice_of(block: Any, operations: Iterable[str]) -> tuple[frozenset[str], int, float]:
    """The menu entry for keeping ``operations`` of ``block`` (a ``BlockProfile``), as
    ``op_choices.menu_of`` makes them: the operations, their kept bytes, their time share."""
    operations = frozenset(operations)
    total = sum(block.forward_seconds_by_op.values()) or 1.0
    return (operations, sum(block.kept_bytes_by_op.get(op, 0) for op in operations),
            sum(block.forward_seconds_by_op.get(op, 0.0) for op in operations) / total)


@contextlib.contextmanager
def also_measured(policies: Iterable[str]) -> Iterator[None]:
    """``profile`` measures the op-level choices ``policies`` name, for each block running
    their operations, besides those its menu offers. Which it offers follows the measured
    time shares (an operation under a twentieth of the forward is not offered): a Llama
    layer's ``aten.add`` was in the menu on a quiet machine and out of it on a loaded one."""
    from gradckpt.measure import one_block

    wanted = {operations_kept_by(policy) for policy in policies}
    offered_by = one_block.menu_of

    def menu(block: Any) -> list[tuple[frozenset[str], int, float]]:
        offered = offered_by(block)
        missing = wanted - {operations for operations, _, _ in offered}
        return offered + [choice_of(block, operations) for operations in sorted(missing, key=sorted)
                          if operations <= block.kept_bytes_by_op.keys()]

    with mock.patch.object(one_block, "menu_of", menu):
        yield


def predicted_and_measured(
    model: torch.nn.Module, batch: Any, plans: dict[str, list[Segment]],
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> dict[str, tuple[int, int]]:
    """Per plan, its predicted and measured peak, the gradients checked bit for bit; the
    op-level choices the plans name are measured (``also_measured``; an offload policy, as the
    choice keeping the same outputs: on the CPU the engine keeps what it offloads)."""
    turn_caches_off(model)
    policies = [segment.policy for segments in plans.values() for segment in segments
                if segment.policy is not None]
    with also_measured(policies):
        profile = gradckpt.profile(model, batch, loss_fn, optimizer="adamw", repeats=1)
    for segments in plans.values():
        for segment in segments:
            if segment.policy is not None:
                # An offload policy is measured as keeping the same operations' outputs.
                kept = save_ops_policy_name(operations_kept_by(segment.policy))
                measured = [c.policy for c in profile.blocks[segment.start].op_choices]
                assert kept in measured, (segment, measured)
    chosen = {label: plan_for(profile, label, None, segments)
              for label, segments in plans.items()}
    result = compare_plans(model, batch, {"plain": None, **chosen}, loss_fn=loss_fn,
                           optimizer=torch.optim.AdamW(model.parameters()), rounds=0)
    for label in chosen:
        assert result.identical(label), f"{label}: gradients differ from the plain model's"
    return {label: (plan.predicted_peak_bytes, result.peak_bytes[label])
            for label, plan in chosen.items()}
