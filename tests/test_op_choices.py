"""Operation-level choices (``gradckpt.op_choices``, issue 25), the pure parts: no model runs.

- ``pareto_menu`` is a 0/1 knapsack solved for every capacity at once, so it is checked
  against brute force over every subset of a few operations: each subset is matched or beaten
  (no more bytes, no less time saved) by a menu entry, each entry is a real subset with its
  exact sums, and no entry beats another.
- ``spread`` picks the few entries ``profile`` measures: from the menu, never empty nor as
  large as keeping the block whole, the most saving one among them included.
- ``menu_of`` is that spread, less the set ``"save-matmuls"`` keeps (measured already).
- ``policy_cost`` is what the cost model and the solvers read for any policy: measured peaks
  where ``profile`` measured the policy, times from the measured ones, bounds otherwise.
- The engine's ``"save-ops:..."`` names: what they keep, and clear errors for malformed ones.
- ``Profile`` JSON keeps the measured choices as ``OpChoice`` objects.
"""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import gradckpt
from gradckpt import UsageError
from gradckpt.engine import (
    MATMUL_AND_ATTENTION_NAMES,
    Fate,
    operations_kept_by,
    save_ops_policy_name,
)
from gradckpt.engine.fates import resolve_policy
from gradckpt.op_choices import (
    MENU_SIZE,
    is_op_choice,
    menu_of,
    pareto_menu,
    policy_cost,
    spread,
)
from gradckpt.profile_types import OpChoice, Profile, example_block

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

TOLERANCE = 1e-9  # shares are float sums; the menu treats shares within 1e-12 as equal

# Operation names as profiles record them: matmuls and attention, and cheap elementwise ones.
OPERATION_NAMES = ["aten.mm", "aten.bmm", "aten.addmm", "aten.mean", "aten.silu", "aten.mul",
                   "aten.add", "aten._safe_softmax"]

items_strategy = st.dictionaries(
    st.sampled_from(OPERATION_NAMES),
    st.tuples(st.integers(0, 64), st.floats(0.0, 1.0, allow_nan=False, allow_subnormal=False)),
    max_size=8,
)


def all_subsets(items: dict[str, tuple[int, float]]) -> list[tuple[frozenset, int, float]]:
    names = sorted(items)
    subsets = []
    for size in range(len(names) + 1):
        for chosen in itertools.combinations(names, size):
            subsets.append((frozenset(chosen), sum(items[n][0] for n in chosen),
                            sum(items[n][1] for n in chosen)))
    return subsets


# ------------------------------------------------------------------------------------------
# pareto_menu: the knapsack against brute force
# ------------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(items=items_strategy)
def test_pareto_menu_equals_brute_force_over_every_subset(items) -> None:
    menu = pareto_menu(items)
    # Every subset is matched or beaten by an entry: no more bytes, at least its share.
    for ops, nbytes, share in all_subsets(items):
        assert any(m_bytes <= nbytes and m_share >= share - TOLERANCE
                   for _, m_bytes, m_share in menu), (sorted(ops), nbytes, share, menu)
    # Every entry is a real subset with its exact sums.
    for ops, nbytes, share in menu:
        assert ops <= set(items)
        assert nbytes == sum(items[n][0] for n in ops)
        assert share == pytest.approx(sum(items[n][1] for n in ops), abs=TOLERANCE)
    # Fewest bytes first, and none beats another: more bytes always buy more time.
    assert [nbytes for _, nbytes, _ in menu] == sorted(nbytes for _, nbytes, _ in menu)
    for (_, bytes_a, share_a), (_, bytes_b, share_b) in itertools.combinations(menu, 2):
        assert bytes_a < bytes_b and share_a < share_b
    # The cheapest entry keeps no bytes: nothing, or operations whose outputs take none.
    assert menu[0][1] == 0


def test_pareto_menu_leaves_out_operations_that_save_no_time() -> None:
    menu = pareto_menu({"aten.mm": (8, 0.5), "aten.ones": (0, 0.0), "aten.mul": (4, 0.0)})
    assert [(sorted(ops), nbytes) for ops, nbytes, _ in menu] == [([], 0), (["aten.mm"], 8)]


def test_pareto_menu_of_nothing_is_keeping_nothing() -> None:
    assert pareto_menu({}) == [(frozenset(), 0, 0.0)]


# ------------------------------------------------------------------------------------------
# spread: the few entries profile measures
# ------------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None)
@given(items=items_strategy, count=st.integers(1, 7),
       below_bytes=st.one_of(st.none(), st.integers(0, 300)))
def test_spread_takes_the_cheapest_entry_for_each_share_of_the_most(
    items, count, below_bytes
) -> None:
    menu = pareto_menu(items)
    chosen = spread(menu, count, below_bytes)
    allowed = [entry for entry in menu
               if entry[0] and (below_bytes is None or entry[1] < below_bytes)]
    assert len(chosen) <= count
    assert len(set(chosen)) == len(chosen)
    assert all(entry in allowed for entry in chosen)  # from the menu, never empty nor too big
    if not allowed:
        assert chosen == []
        return
    assert allowed[-1] in chosen  # the one saving the most
    most = allowed[-1][2]
    for step in range(1, count + 1):  # each target's cheapest entry
        target = most * step / count
        cheapest = min((e for e in allowed if e[2] >= target - 1e-12), key=lambda e: e[1])
        assert cheapest in chosen, (step, cheapest, chosen)


def test_spread_by_default_measures_at_most_menu_size() -> None:
    items = {name: (index + 1, 0.01 * (index + 1)) for index, name in enumerate(OPERATION_NAMES)}
    chosen = spread(pareto_menu(items))
    assert len(chosen) == MENU_SIZE


# ------------------------------------------------------------------------------------------
# menu_of: a block's choices to measure
# ------------------------------------------------------------------------------------------


def block_with_operations(items: dict[str, tuple[int, float]], saved_bytes: int = 10_000,
                          **fields):
    """A block whose operations keep ``items``' bytes and take their seconds (of a 1 s
    forward)."""
    return example_block(
        saved_bytes=saved_bytes, forward_seconds=1.0,
        kept_bytes_by_op={name: nbytes for name, (nbytes, _) in items.items()},
        forward_seconds_by_op={name: seconds for name, (_, seconds) in items.items()},
        **fields,
    )


@settings(max_examples=150, deadline=None)
@given(items=items_strategy, saved_bytes=st.integers(1, 300))
def test_menu_of_is_the_spread_less_what_save_matmuls_keeps(items, saved_bytes) -> None:
    block = block_with_operations(items, saved_bytes)
    chosen = menu_of(block)
    total = sum(seconds for _, seconds in items.values())
    if not total:
        assert chosen == []
        return
    shares = {name: (nbytes, seconds / total) for name, (nbytes, seconds) in items.items()}
    matmuls = frozenset(name for name in items if name in MATMUL_AND_ATTENTION_NAMES)
    expected = spread(pareto_menu(shares), below_bytes=saved_bytes)
    assert [entry[0] for entry in chosen] == [e[0] for e in expected if e[0] != matmuls]
    assert all(ops != matmuls for ops, _, _ in chosen)
    assert all(ops and nbytes < saved_bytes for ops, nbytes, _ in chosen)
    for ops, nbytes, share in chosen:
        assert nbytes == sum(items[name][0] for name in ops)
        assert share == pytest.approx(sum(shares[name][1] for name in ops), abs=TOLERANCE)


def test_menu_of_leaves_out_exactly_the_matmul_set() -> None:
    # The matmuls' set alone is "save-matmuls" (measured already); a set with only some of
    # them, or with more operations, is a choice of its own.
    items = {"aten.mm": (30, 0.4), "aten.bmm": (10, 0.2), "aten.mean": (1, 0.1)}
    shares = {name: (nbytes, seconds / 0.7) for name, (nbytes, seconds) in items.items()}
    spread_entries = [sorted(ops) for ops, _, _ in spread(pareto_menu(shares))]
    assert spread_entries == [["aten.bmm"], ["aten.bmm", "aten.mean"], ["aten.mean", "aten.mm"],
                              ["aten.bmm", "aten.mm"], ["aten.bmm", "aten.mean", "aten.mm"]]
    chosen = [sorted(ops) for ops, _, _ in menu_of(block_with_operations(items))]
    assert chosen == [entry for entry in spread_entries if entry != ["aten.bmm", "aten.mm"]]


def test_menu_of_leaves_out_choices_keeping_as_much_as_the_block_saves() -> None:
    # Both together keep 31 bytes: keeping the block whole (31 saved) does as well.
    items = {"aten.silu": (30, 0.5), "aten.mean": (1, 0.2)}
    chosen = menu_of(block_with_operations(items, saved_bytes=31))
    assert [sorted(ops) for ops, _, _ in chosen] == [["aten.mean"], ["aten.silu"]]
    chosen = menu_of(block_with_operations(items, saved_bytes=32))
    assert [sorted(ops) for ops, _, _ in chosen][-1] == ["aten.mean", "aten.silu"]


def test_menu_of_a_block_without_per_operation_times_is_empty() -> None:
    assert menu_of(example_block(kept_bytes_by_op={"aten.mm": 4, "aten.mean": 1})) == []
    assert menu_of(example_block(kept_bytes_by_op={"aten.mm": 4},
                                 forward_seconds_by_op={"aten.mm": 0.0})) == []


# ------------------------------------------------------------------------------------------
# policy_cost: what the cost model and the solvers read
# ------------------------------------------------------------------------------------------

KEPT = {"aten.mm": 40, "aten.mean": 2, "aten.silu": 16}
SECONDS = {"aten.mm": 0.3, "aten.mean": 0.1, "aten.silu": 0.1, "aten.add": 0.5}  # of 2 s


def measured_block(**fields):
    """A block with a 2 s forward, per-operation numbers, and one measured op choice."""
    numbers = dict(
        saved_bytes=200, forward_seconds=2.0, forward_peak_bytes=150, matmul_bytes=40,
        matmul_seconds=0.6, kept_bytes_by_op=KEPT,
        forward_seconds_by_op={name: 2.0 * share for name, share in SECONDS.items()},
        op_choices=[OpChoice("save-ops:aten.mean,aten.mm", kept_bytes=42, forward_share=0.4,
                             forward_peak_bytes=90, backward_peak_bytes=70)],
        checkpointed_extra_seconds=2.2,
    )
    numbers.update(fields)
    return example_block(**numbers)


@pytest.mark.parametrize("measured", [True, False], ids=["measured", "unmeasured"])
def test_save_matmuls_costs_what_the_block_says(measured: bool) -> None:
    fields = dict(policy_forward_peak_bytes=60, policy_backward_peak_bytes=80,
                  policy_extra_seconds=1.7) if measured else {}
    block = measured_block(**fields)
    cost = policy_cost(block, "save-matmuls")
    assert cost.policy == "save-matmuls"
    assert cost.kept_bytes == block.matmul_bytes
    assert cost.extra_seconds == block.policy_recompute_seconds()
    assert cost.transient_bytes == block.policy_transient_bytes()
    assert cost.backward_peak_bytes == block.policy_backward_peak_bytes
    if measured:
        assert (cost.extra_seconds, cost.transient_bytes, cost.backward_peak_bytes) == (
            1.7, 20, 80)
    else:
        assert cost.extra_seconds == pytest.approx(1.4)
        assert (cost.transient_bytes, cost.backward_peak_bytes) == (150, None)


@pytest.mark.parametrize("name", ["save-ops:aten.mean,aten.mm", "save-ops:aten.mm,aten.mean",
                                  "save-ops:aten.mm,,aten.mean"])
@pytest.mark.parametrize("dispatch_seconds", [0.0, 0.3])
def test_a_measured_op_choice_costs_its_measured_peaks(name, dispatch_seconds) -> None:
    # However the name orders its operations, it is the measured choice: its peaks are the
    # measured ones; its time is the recomputation less what the kept operations take, plus
    # the per-operation dispatch counted for the block (0 for an estimate).
    block = measured_block(policy_dispatch_seconds=dispatch_seconds)
    cost = policy_cost(block, name)
    assert cost.policy == "save-ops:aten.mean,aten.mm"
    assert cost.kept_bytes == 42
    assert cost.transient_bytes == 90 - 42  # forward peak less the kept outputs
    assert cost.backward_peak_bytes == 70
    assert cost.extra_seconds == pytest.approx(2.2 - 0.4 * 2.0 + dispatch_seconds)


def test_the_noisy_save_matmuls_timing_does_not_price_the_choices() -> None:
    # A save-matmuls run measured slow or fast says nothing about the other choices' dispatch.
    for policy_extra_seconds in (1.0, 5.0):
        block = measured_block(policy_extra_seconds=policy_extra_seconds)
        cost = policy_cost(block, "save-ops:aten.mean,aten.mm")
        assert cost.extra_seconds == pytest.approx(1.4)


def test_a_measured_choice_whose_peak_is_below_what_it_keeps_has_no_negative_transient():
    choice = OpChoice("save-ops:aten.mm", 40, 0.15, forward_peak_bytes=30, backward_peak_bytes=5)
    cost = policy_cost(measured_block(op_choices=[choice]), "save-ops:aten.mm")
    assert cost.transient_bytes == 0


def test_an_unmeasured_op_choice_is_bounded_from_the_plain_numbers() -> None:
    block = measured_block()
    cost = policy_cost(block, "save-ops:aten.silu,aten.mm,aten.cat")  # aten.cat: not in block
    assert cost.policy == "save-ops:aten.cat,aten.mm,aten.silu"
    assert cost.kept_bytes == KEPT["aten.mm"] + KEPT["aten.silu"]
    assert cost.backward_peak_bytes is None  # the cost model walks the block instead
    assert cost.transient_bytes == block.forward_peak_bytes  # an upper bound
    share = (SECONDS["aten.mm"] + SECONDS["aten.silu"]) / sum(SECONDS.values())
    assert cost.extra_seconds == pytest.approx(2.2 - share * 2.0)


def test_an_op_choice_never_costs_negative_time() -> None:
    block = measured_block(checkpointed_extra_seconds=0.1)
    assert policy_cost(block, "save-ops:aten.add,aten.mm").extra_seconds == 0.0


def test_is_op_choice() -> None:
    assert is_op_choice("save-ops:aten.mm")
    assert not is_op_choice("save-matmuls") and not is_op_choice(None)


# ------------------------------------------------------------------------------------------
# The engine's names
# ------------------------------------------------------------------------------------------


def test_a_save_ops_name_keeps_exactly_the_operations_it_lists() -> None:
    policy = resolve_policy("save-ops:aten.mm,aten.silu")
    x = torch.ones(2, 2)
    aten = torch.ops.aten
    assert policy(aten.mm.default, x) is Fate.KEEP
    assert policy(aten.silu.default, x) is Fate.KEEP
    assert policy(aten.addmm.default, x) is Fate.RECOMPUTE  # another matmul: not listed
    assert policy(aten.mul.Tensor, x) is Fate.RECOMPUTE
    assert policy.__name__ == "save-ops:aten.mm,aten.silu"
    assert operations_kept_by("save-ops:aten.silu,aten.mm") == {"aten.mm", "aten.silu"}
    assert save_ops_policy_name(["aten.silu", "aten.mm"]) == "save-ops:aten.mm,aten.silu"


@pytest.mark.parametrize("name", ["save-ops:", "save-ops:,", "save-ops:mm", "save-ops:aten.mm,mm"])
def test_a_save_ops_name_without_operations_is_a_usage_error_showing_the_form(name) -> None:
    with pytest.raises(UsageError, match=r"e\.g\. 'save-ops:aten\.mm,aten\.silu'") as error:
        resolve_policy(name)
    assert repr(name) in str(error.value)
    with pytest.raises(UsageError, match="save-ops:"):  # at the public door too
        gradckpt.checkpoint(torch.sin, torch.ones(2, requires_grad=True), policy=name)


def test_an_unknown_policy_name_lists_the_save_ops_form() -> None:
    with pytest.raises(UsageError) as error:
        resolve_policy("save-op:aten.mm")
    message = str(error.value)
    assert "'save-ops:'" in message and "save-matmuls" in message


def test_checkpoint_under_a_save_ops_policy_gives_the_plain_gradients() -> None:
    torch.manual_seed(0)
    weight = torch.randn(8, 8, requires_grad=True)
    x = torch.randn(4, 8, requires_grad=True)

    def fn(x: torch.Tensor) -> torch.Tensor:
        h = torch.nn.functional.silu(x @ weight)
        return (h * h.mean(dim=-1, keepdim=True)) @ weight

    fn(x).sum().backward()
    expected = (x.grad.clone(), weight.grad.clone())
    x.grad = weight.grad = None
    gradckpt.checkpoint(fn, x, policy="save-ops:aten.mm,aten.mean").sum().backward()
    assert torch.equal(x.grad, expected[0]) and torch.equal(weight.grad, expected[1])


# ------------------------------------------------------------------------------------------
# Profile JSON
# ------------------------------------------------------------------------------------------


def test_a_profile_with_op_choices_round_trips_through_json() -> None:
    blocks = [measured_block(), measured_block(op_choices=[]),
              measured_block(op_choices=[
                  OpChoice("save-ops:aten.mean", 2, 0.05, 70, 120),
                  OpChoice("save-ops:aten.mean,aten.mm,aten.silu", 58, 0.5, 100, 60)])]
    profile = Profile(blocks, peak_bytes=5000, fixed_bytes=1000, step_seconds=9.0)
    again = Profile.from_json(profile.to_json())
    assert again == profile
    for block in again.blocks:
        assert all(isinstance(choice, OpChoice) for choice in block.op_choices)
    assert again.blocks[2].op_choices[1].policy == "save-ops:aten.mean,aten.mm,aten.silu"
    assert again.blocks[0].kept_bytes_by_op == KEPT


def test_a_profile_written_before_op_choices_reads_with_no_choices() -> None:
    profile = Profile([example_block()], peak_bytes=1100, fixed_bytes=1000, step_seconds=3.0)
    data = json.loads(profile.to_json())
    for block in data["blocks"]:
        del block["op_choices"], block["kept_bytes_by_op"]
    again = Profile.from_json(json.dumps(data))
    assert again.blocks[0].op_choices == [] and again.blocks[0].kept_bytes_by_op == {}
