"""Plans' predicted peaks against the measured ones, for the tests of the cost model: the
model profiled, then run plain and under each plan in the loop's second step with AdamW
(``compare_plans``), the gradients checked bit for bit against the plain model's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

import gradckpt
from gradckpt.cost import plan_for
from gradckpt.engine.fates import operations_kept_by, save_ops_policy_name
from gradckpt.integrations.hf import turn_caches_off
from gradckpt.plan import Segment
from gradckpt.side_by_side import compare_plans


def predicted_and_measured(
    model: torch.nn.Module, batch: Any, plans: dict[str, list[Segment]],
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
) -> dict[str, tuple[int, int]]:
    """Per plan, its predicted and measured peak, the gradients checked bit for bit; the
    op-level choices the plans name are among those ``profile`` measured (an offload policy,
    as the choice keeping the same outputs: on the CPU the engine keeps what it offloads)."""
    turn_caches_off(model)
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
