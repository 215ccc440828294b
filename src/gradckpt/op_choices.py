"""Operation-level choices for a block checkpointed on its own: which operations' outputs to
keep from the forward pass, and what each choice costs in bytes and seconds.

A checkpointed block recomputes, in backward, every operation whose outputs it did not keep
(the engine re-runs them in order), so keeping an operation's outputs (all its calls in the
block: a policy ``"save-ops:aten.mm,aten.mean"``) costs their bytes from the forward to the
backward and saves exactly that operation's forward time. Which operations to keep is then a
0/1 knapsack over the block's operations (``pareto_menu``: every choice that no other beats
in both bytes and time), measured, not ruled: on a 2-core CPU a Llama layer's RMSNorm ``mean``
took 6% of its forward for 12 kB of output, its matmuls 22% for 16 MB. ``profile`` measures a
few of these choices per block (``spread``: the cheapest one saving each fifth of what can be
saved, or all where there are no more than five), their peaks as ``apply`` runs them, into
``BlockProfile.op_choices``; the optimal solver weighs them against keeping the block and
recomputing it whole.

``policy_cost`` is what the cost model and the solvers read for any policy a plan names: the
bytes it keeps, its recomputation's seconds and its measured peaks.

Example:
    >>> items = {"aten.mm": (16, 0.2), "aten.mean": (1, 0.1), "aten.mul": (16, 0.05)}
    >>> for ops, nbytes, share in pareto_menu(items):
    ...     print(sorted(ops), nbytes, round(share, 2))
    [] 0 0.0
    ['aten.mean'] 1 0.1
    ['aten.mm'] 16 0.2
    ['aten.mean', 'aten.mm'] 17 0.3
    ['aten.mean', 'aten.mm', 'aten.mul'] 33 0.35
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from .engine import (
    MATMUL_AND_ATTENTION_NAMES,
    OFFLOAD_OPS,
    SAVE_OPS,
    keeps_operation,
    operations_kept_by,
    save_ops_policy_name,
)
from .profile_types import PLANNED_POLICY, BlockProfile, Profile

__all__ = [
    "MENU_SIZE", "Choice", "PolicyCost", "is_op_choice", "kept_by_policy", "menu_of",
    "HOST_CAP", "HOST_LINK", "offload_offer", "offloaded", "offloading", "pareto_menu",
    "policy_cost",
    "spread", "without_offload",
]

MENU_SIZE = 5
"""How many op-level choices ``profile`` measures per block (besides ``"save-matmuls"``)."""


Choice = tuple[frozenset[str], int, float]  # operations kept, their bytes, their time share


@dataclass(frozen=True)
class PolicyCost:
    """A one-block segment under ``policy``, as the solvers weigh it.

    - ``kept_bytes``: outputs kept from its forward until its recomputation.
    - ``extra_seconds``: how much longer its forward and backward take than the plain block's.
    - ``transient_bytes``: its first forward's peak above its input and the kept outputs.
    - ``backward_peak_bytes``: its backward's peak, recomputation included, above its input,
      the kept outputs and the incoming gradient; ``None`` where not measured (the cost model
      then bounds it, walking the block as kept).
    - ``offloaded_bytes``: outputs moved to host memory from its forward until its
      recomputation (``"offload-ops:..."``), which the device does not hold meanwhile.
    """

    policy: str
    kept_bytes: int
    extra_seconds: float
    transient_bytes: int
    backward_peak_bytes: int | None
    offloaded_bytes: int = 0


def pareto_menu(items: dict[str, tuple[int, float]]) -> list[Choice]:
    """The sets of operations worth keeping: for ``items`` (operation -> bytes its outputs
    take, share of the forward time it takes), every set whose kept bytes no other set with
    at least its time share undercuts, as ``(operations, bytes, share)``, fewest bytes first.

    A 0/1 knapsack solved for every capacity at once: sets are built one operation at a time
    and only the undominated ones carried on (at most one per distinct byte count).

    Example:
        >>> [sorted(ops) for ops, _, _ in pareto_menu({"a": (2, 0.5), "b": (3, 0.1)})]
        [[], ['a'], ['a', 'b']]
    """
    frontier: list[Choice] = [(frozenset(), 0, 0.0)]
    for name, (nbytes, share) in sorted(items.items()):
        if share <= 0:
            continue  # keeping it saves no time: it could only add bytes
        grown = [(ops | {name}, kept + nbytes, saved + share) for ops, kept, saved in frontier]
        frontier = _undominated(frontier + grown)
    return frontier


def _undominated(
    sets: list[Choice]
) -> list[Choice]:
    kept: list[Choice] = []
    for entry in sorted(sets, key=lambda e: (e[1], -e[2], sorted(e[0]))):
        if not kept or entry[2] > kept[-1][2] + 1e-12:
            kept.append(entry)
    return kept


def spread(menu: list[Choice], count: int = MENU_SIZE, below_bytes: int | None = None
           ) -> list[Choice]:
    """Up to ``count`` choices of ``menu`` spread over what keeping can save: for each target
    share of the most the menu saves (1/count, 2/count, ..., all of it), the cheapest choice
    saving at least that; all of them where there are no more than ``count``. Choices keeping
    nothing, or ``below_bytes`` or more (keeping the block whole does as well for less), are
    left out.

    Example:
        >>> menu = pareto_menu({"a": (1, 0.1), "b": (5, 0.3), "c": (9, 0.4)})
        >>> [(sorted(ops), nbytes) for ops, nbytes, _ in spread(menu, count=2)]
        [(['a', 'b'], 6), (['a', 'b', 'c'], 15)]
    """
    useful = [entry for entry in menu if entry[0]
              and (below_bytes is None or entry[1] < below_bytes)]
    if len(useful) <= count:
        # All of them: picking among so few by targets would turn on shares a timing's noise
        # moves (a 10% op against a fifth of 46% was in one profile and out of the next).
        return useful
    most = useful[-1][2]
    chosen: list[Choice] = []
    for step in range(1, count + 1):
        target = most * step / count
        entry = next(e for e in useful if e[2] >= target - 1e-12)
        if entry not in chosen:
            chosen.append(entry)
    return chosen


def menu_of(block: BlockProfile) -> list[Choice]:
    """The choices ``profile`` measures for ``block``: ``spread`` over the Pareto set of its
    operations (their kept bytes and time shares, from ``kept_bytes_by_op`` and
    ``forward_seconds_by_op``), less the set ``"save-matmuls"`` keeps (measured already).

    Example:
        >>> from gradckpt.profile_types import example_block
        >>> block = example_block(saved_bytes=50, forward_seconds=1.0,
        ...     kept_bytes_by_op={"aten.mm": 30, "aten.mean": 1},
        ...     forward_seconds_by_op={"aten.mm": 0.5, "aten.mean": 0.2})
        >>> [sorted(ops) for ops, _, _ in menu_of(block)]
        [['aten.mean'], ['aten.mean', 'aten.mm']]
    """
    total = sum(block.forward_seconds_by_op.values())
    if not total:
        return []
    items = {
        name: (nbytes, block.forward_seconds_by_op.get(name, 0.0) / total)
        for name, nbytes in block.kept_bytes_by_op.items()
    }
    matmuls = frozenset(name for name in items if name in MATMUL_AND_ATTENTION_NAMES)
    return [entry for entry in spread(pareto_menu(items), below_bytes=block.saved_bytes)
            if entry[0] != matmuls]


def policy_cost(
    block: BlockProfile, policy: str, host_link_bytes_per_second: float | None = None
) -> PolicyCost:
    """What ``block`` checkpointed alone under ``policy`` costs: measured where ``profile``
    measured that policy (``"save-matmuls"``, the block's ``op_choices``), else bounded from
    the plain numbers. ``"offload-ops:..."``: the same operations kept, priced as offloaded
    over a host link of ``host_link_bytes_per_second`` (``offloaded``).

    Example:
        >>> from gradckpt.profile_types import example_block
        >>> cost = policy_cost(example_block(forward_seconds=3.0, matmul_seconds=2.0,
        ...                                  matmul_bytes=8), "save-matmuls")
        >>> cost.kept_bytes, cost.extra_seconds, cost.backward_peak_bytes  # not measured
        (8, 1.0, None)
    """
    if policy.startswith(OFFLOAD_OPS):
        kept = policy_cost(block, save_ops_policy_name(operations_kept_by(policy)))
        return offloaded(block, kept, host_link_bytes_per_second, policy)
    if policy in (PLANNED_POLICY, "offload-matmuls"):  # offloaded: priced as kept (bounded)
        return PolicyCost(policy, block.matmul_bytes, block.policy_recompute_seconds(),
                          block.policy_transient_bytes(), block.policy_backward_peak_bytes)
    operations = operations_kept_by(policy)
    name = save_ops_policy_name(operations)
    for choice in block.op_choices:
        if choice.policy == name:
            return PolicyCost(
                name, choice.kept_bytes, _extra_seconds(block, choice.forward_share),
                max(choice.forward_peak_bytes - choice.kept_bytes, 0), choice.backward_peak_bytes,
            )
    kept = sum(nbytes for op, nbytes in block.kept_bytes_by_op.items()
               if keeps_operation(operations, op))
    total = sum(block.forward_seconds_by_op.values())
    share = (sum(seconds for op, seconds in block.forward_seconds_by_op.items()
                 if keeps_operation(operations, op)) / total if total else 0.0)
    # Unmeasured: its forward holds at most what the plain forward does (which saves more).
    return PolicyCost(name, kept, _extra_seconds(block, share), block.forward_peak_bytes, None)


HOST_LINK = "host_link_bytes_per_second"
"""``Profile.notes`` key: what one copy to or from pinned host memory moves per second on the
profile's device (a GPU); offload is offered only where it is set."""
HOST_CAP = "offload_host_bytes"
"""``Profile.notes`` key: the most host memory a plan may offload to (None: not checked)."""


def offload_offer(profile: Profile) -> tuple[float | None, str]:
    """The host link a plan may offload over (None: offload not offered) and a sentence
    saying so, or why not, for the plan's table.

    Example:
        >>> from gradckpt.profile_types import example_block
        >>> link, why = offload_offer(Profile([example_block()], 0, 0, 1.0))
        >>> link, why[:47]
        (None, 'offload: not offered: the model runs on the CPU')
    """
    link = profile.notes.get(HOST_LINK)
    if profile.device != "cuda":
        return None, ("offload: not offered: the model runs on the CPU, whose memory is the "
                      "host memory (moving tensors there would save nothing)")
    if not link:
        return None, ("offload: not offered: no host link figure for this device (give "
                      f"profile.notes[{HOST_LINK!r}] in bytes per second)")
    cap = profile.notes.get(HOST_CAP)
    limit = "host memory not checked" if cap is None else f"at most {cap / 2**30:.1f} GiB of it"
    return link, f"offload: offered over a host link of {link / 1e9:.1f} GB/s, {limit}"


def offloading(policy: str) -> str:
    """The ``"offload-ops:..."`` policy offloading what ``policy`` (``"save-ops:..."``) keeps.

    >>> offloading("save-ops:aten.mm,attention")
    'offload-ops:aten.mm,attention'
    """
    return save_ops_policy_name(operations_kept_by(policy), offload=True)


def without_offload(profile: Profile) -> Profile:
    """``profile`` with offload not offered (its host link forgotten).

    Example:
        >>> from gradckpt.profile_types import example_block
        >>> profile = Profile([example_block()], 0, 0, 1.0, notes={HOST_LINK: 1e9})
        >>> without_offload(profile).notes[HOST_LINK] is None
        True
    """
    return dataclasses.replace(profile, notes={**profile.notes, HOST_LINK: None})


def offloaded(
    block: BlockProfile, kept: PolicyCost, host_link_bytes_per_second: float | None,
    policy: str,
) -> PolicyCost:
    """``kept`` (a choice keeping some outputs on the device) with those outputs offloaded
    instead: the device holds none of them between the forward and the recomputation; the
    forward holds them until their copies are done (its peak as kept, an upper bound: copies
    run while it goes on) and the recomputation holds them again from its start (the engine
    prefetches them all then, on a side stream). The copies cost time only where they outlast
    what they overlap: to the host, the block's forward; back, its recomputation. Without a
    host link (the CPU, where the engine keeps what it would offload): priced as ``kept``.

    Example:
        >>> from gradckpt.profile_types import example_block
        >>> kept = PolicyCost("save-ops:aten.mm", 40, 0.5, 10, 20)
        >>> cost = offloaded(example_block(forward_seconds=1.0), kept, 20.0,
        ...                  "offload-ops:aten.mm")
        >>> cost.kept_bytes, cost.offloaded_bytes, cost.transient_bytes, cost.backward_peak_bytes
        (0, 40, 50, 60)
        >>> cost.extra_seconds  # 2 s each way: 1 s exposed after the forward, 1.5 s after 0.5 s
        3.0
    """
    if not host_link_bytes_per_second:
        # On the CPU the engine keeps what it would offload (the memory is the same); on a
        # GPU whose link is unknown, kept is the bound on memory.
        return PolicyCost(policy, kept.kept_bytes, kept.extra_seconds, kept.transient_bytes,
                          kept.backward_peak_bytes)
    transfer = kept.kept_bytes / host_link_bytes_per_second
    exposed = (max(0.0, transfer - block.forward_seconds)
               + max(0.0, transfer - kept.extra_seconds))
    backward = (None if kept.backward_peak_bytes is None
                else kept.backward_peak_bytes + kept.kept_bytes)
    return PolicyCost(policy, 0, kept.extra_seconds + exposed,
                      kept.transient_bytes + kept.kept_bytes, backward, kept.kept_bytes)


def _extra_seconds(block: BlockProfile, kept_share: float) -> float:
    """A one-block segment's extra time when its kept operations take ``kept_share`` of the
    forward: the recomputation without them, plus what the per-operation dispatch costs
    (``BlockProfile.policy_dispatch_seconds``, counted rather than read from the difference of
    two noisy timings)."""
    return (max(0.0, block.recompute_seconds() - kept_share * block.forward_seconds)
            + block.policy_dispatch_seconds)


def kept_by_policy(policy: str, name: str) -> bool:
    """Whether ``policy`` keeps (or offloads) the outputs of the operation called ``name``.

    >>> kept_by_policy("save-ops:aten.mean,aten.mm", "aten.mm")
    True
    >>> kept_by_policy("save-matmuls", "aten.mean")
    False
    """
    if policy in (PLANNED_POLICY, "offload-matmuls"):
        return name in MATMUL_AND_ATTENTION_NAMES
    return keeps_operation(operations_kept_by(policy), name)


def is_op_choice(policy: str | None) -> bool:
    """Whether ``policy`` names operations to keep (``"save-ops:..."``).

    >>> is_op_choice("save-ops:aten.mm"), is_op_choice("save-matmuls")
    (True, False)
    """
    return policy is not None and policy.startswith(SAVE_OPS)
