"""The chain as the optimal solver's dynamic programs read it: per-block numbers (what a kept
block retains and peaks at, what is alive around a run) and per-segment costs (a segment's
first forward, its recomputation with and without the policy), in bytes and seconds.

Both programs, the time tables (``optimal``) and the least-peak search (``least_peak``), index
runs by (first block, column): columns 0..n-1 are runs inside a segment ending at that block
(its incoming gradient alive throughout), column n the top-level run to the last block (only
the previous step's output alive, in its forward). How a run's first input stands is one of
``FRESH`` (not retained yet), ``HELD`` (retained by the kept block before it, its saved
output, or a tensor of the sample) and ``OPENING`` (retained as the input of the segment whose
recomputation the run opens). Both record what each run's first item is: ``KEEP`` (the block
kept), ``POLICY - i`` (the block alone, a top-level segment under the i-th policy of its
``menu``: ``"save-matmuls"``, then its measured op-level choices) or, any other number
j >= 0, the segment from the run's first block to block j.

Example:
    >>> from gradckpt.profile_types import Profile, example_block
    >>> chain = ChainCosts(Profile([example_block(f"h.{i}") for i in range(3)], 0, 0, 1.0))
    >>> chain.kept(0, input_retained=False)  # retains its 50 saved bytes; backward peaks at 60
    (50, 60)
    >>> chain.segments(0).forward_seconds  # segments 0..0, 0..1, 0..2 recompute 1, 2, 3 s
    [1.0, 2.0, 3.0]
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..cost import gradients_after, output_kept_bytes, returned_alive, side_inputs_held
from ..op_choices import offload_offer, offloading, policy_cost
from ..profile_types import PLANNED_POLICY, BlockProfile, Profile
from .timing_noise import TIME_NOISE_NOTE, merged_within_band

__all__ = [
    "FRESH", "HELD", "OPENING", "KEEP", "POLICY", "ChainCosts", "MenuOption", "SegmentCosts",
    "menu_choice", "menu_index",
]

FRESH, HELD, OPENING = "fresh", "held", "opening"
# Negative, so that a segment's last block, 0..n-1, is a choice of its own; POLICY - i is
# the i-th option of a block's menu.
KEEP, POLICY = -1, -2


def menu_choice(index: int) -> int:
    """The choice recorded for option ``index`` of a block's menu.

    >>> menu_choice(0) == POLICY, menu_index(menu_choice(3))
    (True, 3)
    """
    return POLICY - index


def menu_index(choice: int) -> int:
    """The menu option a recorded choice stands for (see ``menu_choice``)."""
    return POLICY - choice


@dataclass
class MenuOption:
    """Block s alone, a top-level segment under ``policy``: the bytes it keeps from its
    forward, its extra seconds, and the peaks of its recomputation (the incoming gradient and
    the gradients made before it alive: ``alive[s]`` included) and of its first forward, each
    above what it retains (its input, side inputs and the kept outputs)."""

    policy: str
    kept_bytes: int
    extra_seconds: float
    peak: int
    transient: int


@dataclass
class SegmentCosts:
    """For segments s..j, j = s, s+1, ...: the numbers the DP needs, one list entry per j."""

    transient: list[int]  # most bytes above its kept input while its forward runs
    forward_seconds: list[float]  # its recomputation, no policy
    matmul_bytes: list[int]  # what the policy keeps from the first forward
    policy_seconds: list[float]  # its recomputation under the policy
    policy_peak: list[int]  # its recomputation's peak under the policy, above what it keeps
    policy_transient: list[int]  # its first forward's peak under the policy, above the same


class ChainCosts:
    """The chain's per-block numbers and per-segment costs, shared by both DPs (see the module
    for how runs are indexed).

    Example:
        >>> from gradckpt.profile_types import Profile, example_block
        >>> blocks = [example_block(f"h.{i}", gradient_bytes=5) for i in range(3)]
        >>> chain = ChainCosts(Profile(blocks, 0, 0, 1.0, chain_breaks=[2]))
        >>> chain.alive  # per column: the output and its gradients, then the previous output
        [20, 15, 10, 0]
        >>> chain.limit  # the last block a segment starting at each block may reach
        [1, 1, 2]
    """

    def __init__(self, profile: Profile) -> None:
        self.blocks: list[BlockProfile] = profile.blocks
        self.n = len(self.blocks)
        # Without matmuls and unmeasured, a block under the policy is its plain segment.
        self.has_matmuls = any(b.matmul_bytes or b.matmul_seconds
                               or b.policy_backward_peak_bytes is not None for b in self.blocks)
        # Whether any block has a menu (save-matmuls, or op-level choices).
        self.policies = self.has_matmuls or any(b.op_choices for b in self.blocks)
        # While a run inside a segment ending at c is (re)computed in backward, c's output
        # gradient and every parameter gradient made before are alive.
        self.gradients_after = gradients_after(profile)
        self.alive = [
            b.output_bytes + g for b, g in zip(self.blocks, self.gradients_after, strict=True)
        ]
        # Column n is the top level, whose forward runs with the previous step's output alive
        # (a loop's ``out = model(**batch)`` holds it until the model returns), and what the
        # modules before the chain hold.
        self.alive.append(profile.previous_output_bytes + profile.before_chain_bytes)
        self.head_bytes = profile.head_bytes
        # Side inputs are held by the top-level item holding their block (simulate's walk),
        # those no block saves too, as in any plan with a segment: the plan without one is
        # predicted apart (solve_optimal, lowest_peak_plan). side_before[j] is the sum over
        # blocks 0..j-1, so segment s..j holds side_before[j + 1] - side_before[s].
        self.side = side_inputs_held(profile, checkpointing=True)
        self.side_before = [0]
        for side in self.side:
            self.side_before.append(self.side_before[-1] + side)
        # The last block a segment starting at s may reach (chain breaks: encoder to decoder).
        self.limit = [profile.segment_end_limit(s) for s in range(self.n)]
        # held[s]: block s's input is retained already when block s - 1 is kept before it
        # (that block saves its output), or, for s = 0, always (a tensor of the sample);
        # index n, the head, never.
        self.held = [profile.input_held(s) for s in range(self.n)] + [False]
        # returned[s]: what block s - 1 returned besides its hidden state, alive while block s
        # runs forward where s - 1 was checkpointed (simulate's walk). The programs count it
        # whatever s - 1's fate (a kept block's graph saves it: counted twice), so that a plan
        # they find fitting fits simulate's count too.
        self.returned = returned_alive(profile)
        self._segments: dict[int, SegmentCosts] = {}
        self._menus: dict[int, list[MenuOption]] = {}
        self.host_link, _ = offload_offer(profile)
        self.time_noise_band = self.noise_band(profile)

    @staticmethod
    def noise_band(profile: Profile) -> float:
        """The band within which ``solve`` settled the profile's times (``timing_noise``):
        options less than that apart are a tie; 0 where it compares them exactly.

        Example:
            >>> from gradckpt.profile_types import Profile, example_block
            >>> ChainCosts.noise_band(Profile([example_block()], 0, 0, 1.0))
            0.0
        """
        return profile.notes.get(TIME_NOISE_NOTE, 0.0)

    def menu(self, s: int) -> list[MenuOption]:
        """The policies block s may run under alone at the top level: ``"save-matmuls"``
        (where the chain has matmuls or measured it), then the op-level choices ``profile``
        measured for it (``BlockProfile.op_choices``), each followed, where the profile's
        device has a host link (``op_choices.offload_offer``), by the same outputs offloaded.

        Example:
            >>> from gradckpt.profile_types import Profile, example_block
            >>> block = example_block(matmul_bytes=20, matmul_seconds=0.5)
            >>> [(o.policy, o.kept_bytes, o.extra_seconds) for o in
            ...  ChainCosts(Profile([block], 0, 0, 1.0)).menu(0)]
            [('save-matmuls', 20, 0.5)]
        """
        if s in self._menus:
            return self._menus[s]
        block, menu = self.blocks[s], []
        if self.has_matmuls:
            costs = self.segments(s)
            menu.append(MenuOption(PLANNED_POLICY, costs.matmul_bytes[0],
                                   costs.policy_seconds[0], costs.policy_peak[0],
                                   costs.policy_transient[0]))
        for choice in block.op_choices:
            # Each kept, then (GPU targets only) the same outputs offloaded instead.
            policies = [choice.policy, offloading(choice.policy)] if self.host_link else [
                choice.policy]
            for policy in policies:
                cost = policy_cost(block, policy, self.host_link)
                # Its own output the policy keeps, unless the next block saves it as its
                # input (a segment there retains it too: counted twice, the safe side).
                output = (0 if s + 1 < self.n and self.blocks[s + 1].input_saved
                          else output_kept_bytes(block, policy, self.host_link))
                menu.append(MenuOption(
                    cost.policy, cost.kept_bytes + output, cost.extra_seconds,
                    self.alive[s] + max((cost.backward_peak_bytes or 0) - output, 0),
                    max(cost.transient_bytes - output, 0) + self.returned[s]))
        if self.time_noise_band:  # settled times (solve): options within the noise cost the
            # same, and the first in this order wins their tie (timing_noise.py), not the noise
            seconds = merged_within_band([option.extra_seconds for option in menu],
                                         self.time_noise_band)
            menu = [replace(option, extra_seconds=extra)
                    for option, extra in zip(menu, seconds, strict=True)]
        self._menus[s] = menu
        return menu

    def end(self, column: int) -> int:
        """The last block of a run in ``column``.

        Example:
            >>> from gradckpt.profile_types import Profile, example_block
            >>> chain = ChainCosts(Profile([example_block(), example_block("h.1")], 0, 0, 1.0))
            >>> chain.end(0), chain.end(2)  # inside a segment ending at 0; the top level
            (0, 1)
        """
        return min(column, self.n - 1)

    def start_after_keeping(self, s: int) -> str:
        """How the run from block s stands once block s - 1 is kept before it (for s = 0:
        at the start of the chain).

        Example:
            >>> from gradckpt.profile_types import Profile, example_block
            >>> blocks = [example_block(output_saved=True, saved_bytes=60), example_block("h.1")]
            >>> ChainCosts(Profile(blocks, 0, 0, 1.0)).start_after_keeping(1)
            'held'
        """
        return HELD if self.held[s] else FRESH

    def kept(self, s: int, input_retained: bool, top: bool = False) -> tuple[int, int]:
        """Block s kept: the bytes it retains (its side inputs too at the top level), and its
        backward's peak above what was before.

        Example:
            >>> from gradckpt.profile_types import Profile, example_block
            >>> chain = ChainCosts(Profile([example_block(side_bytes=4)], 0, 0, 1.0))
            >>> chain.kept(0, input_retained=True, top=True)  # its input, saved, is retained
            (44, 54)
        """
        block = self.blocks[s]
        added = block.saved_bytes - (block.input_bytes if input_retained and block.input_saved
                                     else 0)
        added += self.side[s] if top else 0
        return added, (added + block.output_bytes + block.backward_peak_bytes
                       + self.gradients_after[s])

    def kept_transient(self, s: int, input_retained: bool, top: bool) -> int:
        """What block s's forward holds, kept, above what is retained before it.

        Example:
            >>> from gradckpt.profile_types import Profile, example_block
            >>> chain = ChainCosts(Profile([example_block(forward_peak_bytes=70)], 0, 0, 1.0))
            >>> chain.kept_transient(0, input_retained=False, top=True)  # its input, its peak
            80
        """
        block = self.blocks[s]
        hidden = 0 if input_retained else block.input_bytes
        return (hidden + block.forward_peak_bytes + (self.side[s] if top else 0)
                + self.returned[s])

    def kept_forward_peak(self, s: int, input_retained: bool, column: int) -> int:
        """Block s's forward, kept, as the first item of a run in ``column``: what is alive
        there and its transient.

        Example:
            >>> from gradckpt.profile_types import Profile, example_block
            >>> chain = ChainCosts(Profile([example_block(forward_peak_bytes=70)], 0, 0, 1.0))
            >>> chain.kept_forward_peak(0, input_retained=True, column=0)  # its output alive
            80
        """
        return self.alive[column] + self.kept_transient(s, input_retained, column == self.n)

    def segment_side_bytes(self, s: int, j: int) -> int:
        """The side inputs a top-level segment s..j holds.

        Example:
            >>> from gradckpt.profile_types import Profile, example_block
            >>> blocks = [example_block(f"h.{i}", side_bytes=i) for i in range(4)]
            >>> ChainCosts(Profile(blocks, 0, 0, 1.0)).segment_side_bytes(1, 3)
            6
        """
        return self.side_before[j + 1] - self.side_before[s]

    def segments(self, s: int) -> SegmentCosts:
        """Costs of the segments starting at s (computed once, in O(n)).

        Example:
            >>> from gradckpt.profile_types import Profile, example_block
            >>> blocks = [example_block(f"h.{i}", forward_peak_bytes=30) for i in range(3)]
            >>> ChainCosts(Profile(blocks, 0, 0, 1.0)).segments(0).transient  # next inputs
            [30, 40, 40]
        """
        if s in self._segments:
            return self._segments[s]
        costs = SegmentCosts([], [], [], [], [], [])
        transient, seconds, matmul_bytes, policy_seconds = 0, 0.0, 0, 0.0
        policy_transient = 0  # a longer segment under the policy: bounded by the plain peaks
        retained = 0  # above the segment's kept input and matmul outputs, while recomputed
        forward_high = backward_high = -math.inf
        for j in range(s, self.limit[s] + 1):
            block = self.blocks[j]
            hidden = (0 if j == s else block.input_bytes) + self.returned[j]
            transient = max(transient, hidden + block.segment_forward_peak_bytes())
            policy_transient = max(policy_transient, hidden + block.forward_peak_bytes)
            seconds += block.recompute_seconds()
            matmul_bytes += block.matmul_bytes
            policy_seconds += block.policy_recompute_seconds()
            # Recomputed under the policy, every block is kept, minus its already kept matmuls
            # (and its input, when the block before kept it as its saved output); its forward
            # there reuses the kept matmul outputs rather than making them again.
            kept_input = j == s or self.held[j]
            forward_high = max(forward_high, retained + (0 if kept_input else block.input_bytes)
                               + max(block.forward_peak_bytes - block.matmul_bytes, 0))
            before = retained + (0 if kept_input else block.input_bytes)
            added, _ = self.kept(j, input_retained=kept_input)
            retained += added - block.matmul_bytes
            backward_high = max(backward_high, retained + block.output_bytes
                                + block.backward_peak_bytes + self.gradients_after[j])
            costs.transient.append(transient)
            costs.forward_seconds.append(seconds)
            costs.matmul_bytes.append(matmul_bytes)
            costs.policy_seconds.append(policy_seconds)
            policy_peak = max(self.alive[j] + forward_high, backward_high)
            if j > s and block.policy_backward_peak_bytes is not None:
                # Its recomputation and backward as measured alone (simulate's walk).
                policy_peak = max(policy_peak, self.alive[j] + before
                                  + block.policy_backward_peak_bytes)
            if j == s and block.policy_backward_peak_bytes is not None:  # measured (simulate)
                policy_peak = self.alive[j] + block.policy_backward_peak_bytes
                costs.policy_transient.append(block.policy_transient_bytes() + self.returned[s])
            else:
                costs.policy_transient.append(policy_transient)
            costs.policy_peak.append(int(policy_peak))
        self._segments[s] = costs
        return costs

    def measured_recompute_peak(self, s: int) -> int | None:
        """The one-block segment s..s's recomputation and backward, as ``profile`` measured
        it (``simulate`` uses that instead of walking the block kept): its peak above the
        segment's retained input, its gradient alive; None when not measured.

        Example:
            >>> from gradckpt.profile_types import Profile, example_block
            >>> block = example_block(checkpointed_backward_peak_bytes=25)
            >>> ChainCosts(Profile([block], 0, 0, 1.0)).measured_recompute_peak(0)  # + output
            35
        """
        measured = self.blocks[s].checkpointed_backward_peak_bytes
        return None if measured is None else self.alive[s] + measured

    def lowest_forward_peak(self, s: int) -> int:
        """The least block s's forward holds above its input as any run's first item: kept,
        in a segment, or alone under the policy.

        Example:
            >>> from gradckpt.profile_types import Profile, example_block
            >>> block = example_block(forward_peak_bytes=70, checkpointed_forward_peak_bytes=20)
            >>> ChainCosts(Profile([block], 0, 0, 1.0)).lowest_forward_peak(0)
            20
        """
        block = self.blocks[s]
        lowest = min(block.forward_peak_bytes, block.segment_forward_peak_bytes()
                     ) + self.returned[s]
        if not self.policies:
            return lowest
        return min(lowest, *(option.transient for option in self.menu(s)))
