"""The CUDA budget watch (``gradckpt.budget_watch``, issue 22 item 3), run on CPU: the CUDA
allocator's statistics are replaced by a fake whose peak each test sets, and the watch is told
the model is on ``cuda``. A step over budget warns once, with the numbers; a step within does
not; the hook is gone after ``steps`` judged steps; evaluation forwards are not judged."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

from gradckpt.budget_watch import watch_budget, watch_of
from gradckpt.errors import GradckptWarning, UsageError
from gradckpt.plan import Plan

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

MIB = 2**20
BUDGET = 100 * MIB
PLAN = Plan("optimal", BUDGET, [], 90 * MIB, 0.0, 0.0)


class FakeAllocator:
    """``torch.cuda``'s peak statistics, as the tests set them."""

    def __init__(self) -> None:
        self.allocated_bytes = 10 * MIB
        self.peak_bytes = 500 * MIB  # before training: loading, profiling
        self.resets = 0
        self.queries = 0

    def max_memory_allocated(self, device: object = None) -> int:
        self.queries += 1
        return self.peak_bytes

    def memory_allocated(self, device: object = None) -> int:
        return self.allocated_bytes

    def reset_peak_memory_stats(self, device: object = None) -> None:
        self.resets += 1
        self.peak_bytes = self.allocated_bytes


@pytest.fixture
def allocator(monkeypatch: pytest.MonkeyPatch) -> FakeAllocator:
    fake = FakeAllocator()
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", fake.max_memory_allocated)
    monkeypatch.setattr(torch.cuda, "memory_allocated", fake.memory_allocated)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", fake.reset_peak_memory_stats)
    return fake


def train(model: nn.Module, allocator: FakeAllocator, peaks_bytes: list[int]) -> None:
    """One training step per peak: the forward (where the watch reads), then the step's
    backward and optimizer reaching that peak."""
    for peak_bytes in peaks_bytes:
        model(torch.randn(2, 4)).sum().backward()
        allocator.peak_bytes = max(allocator.peak_bytes, peak_bytes)


def test_a_step_over_budget_warns_once_with_the_numbers(allocator: FakeAllocator) -> None:
    model = nn.Linear(4, 4)
    watch = watch_budget(model, PLAN, steps=3, device="cuda")
    assert watch.active
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        train(model, allocator, [90 * MIB, 150 * MIB, 160 * MIB, 0])
    messages = [str(w.message) for w in caught if issubclass(w.category, GradckptWarning)]
    assert len(messages) == 1, messages
    message = messages[0]
    assert "training step 2 of Linear peaked at 150.00 MiB" in message
    assert "budget of 100.00 MiB" in message and "predicted 90.00 MiB" in message
    assert "50.0% above" in message and "10.00 MiB was allocated" in message
    for cause in ("optimizer=", "larger batch", "longer sequence", "another model"):
        assert cause in message
    assert caught[0].filename == __file__  # points at the user's model(...) call
    assert watch.measured_peaks == [90 * MIB, 150 * MIB, 160 * MIB]  # the pre-training 500 not
    assert watch.exceeded_step == 2 and watch.peak_bytes == 160 * MIB
    assert not watch.active
    assert "above it from step 2" in watch.summary()


def test_steps_within_budget_do_not_warn(allocator: FakeAllocator) -> None:
    model = nn.Linear(4, 4)
    watch = watch_budget(model, PLAN, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradckptWarning)
        # 100.5 MiB: within the 1% tolerance (allocator rounding, not a step that does not fit)
        train(model, allocator, [95 * MIB, 100 * MIB, int(100.5 * MIB), 0])
    assert watch.measured_peaks == [95 * MIB, 100 * MIB, int(100.5 * MIB)]
    assert watch.exceeded_step is None
    assert "within it" in watch.summary()


def test_the_hook_is_removed_after_steps(allocator: FakeAllocator) -> None:
    model = nn.Linear(4, 4)
    watch = watch_budget(model, PLAN, steps=2, device="cuda")
    train(model, allocator, [20 * MIB, 30 * MIB])
    assert watch.active  # two steps ran, only the first judged (at the second forward)
    train(model, allocator, [40 * MIB])
    assert not watch.active and len(model._forward_pre_hooks) == 0
    queries, resets = allocator.queries, allocator.resets
    train(model, allocator, [500 * MIB] * 3)  # no cost, no judgment any more
    assert (allocator.queries, allocator.resets) == (queries, resets)
    assert watch.measured_peaks == [20 * MIB, 30 * MIB]


def test_evaluation_forwards_are_not_judged(allocator: FakeAllocator) -> None:
    model = nn.Linear(4, 4)
    watch = watch_budget(model, PLAN, device="cuda")
    with warnings.catch_warnings():
        warnings.simplefilter("error", GradckptWarning)
        train(model, allocator, [50 * MIB])
        with torch.no_grad():
            model(torch.randn(2, 4))
            allocator.peak_bytes = 400 * MIB  # an evaluation with a large batch
        model.eval()
        model(torch.randn(2, 4))
        model.train()
        with torch.inference_mode():
            model(torch.randn(2, 4))
        train(model, allocator, [60 * MIB, 70 * MIB, 0])
    # The first forward after the evaluation reads nothing: its interval held the evaluation.
    assert watch.measured_peaks == [60 * MIB, 70 * MIB]
    assert watch.active


def test_cpu_models_and_plans_without_a_budget_are_not_watched(allocator: FakeAllocator) -> None:
    model = nn.Linear(4, 4)
    on_cpu = watch_budget(model, PLAN)
    assert not on_cpu.active and "cpu" in on_cpu.reason
    no_budget = watch_budget(model, Plan("none", None, [], 0, 0.0, 0.0), device="cuda")
    assert not no_budget.active and "no budget" in no_budget.reason
    train(model, allocator, [500 * MIB] * 3)
    assert allocator.queries == 0 and allocator.resets == 0
    assert len(model._forward_pre_hooks) == 0
    on_cpu()  # the remover is a no-op


def test_watching_again_replaces_the_watch(allocator: FakeAllocator) -> None:
    model = nn.Linear(4, 4)
    first = watch_budget(model, PLAN, device="cuda")
    second = watch_budget(model, PLAN, device="cuda")
    assert not first.active and second.active and watch_of(model) is second
    assert len(model._forward_pre_hooks) == 1
    second()
    assert len(model._forward_pre_hooks) == 0 and watch_of(model) is second


def test_bad_arguments() -> None:
    with pytest.raises(UsageError, match="steps"):
        watch_budget(nn.Linear(2, 2), PLAN, steps=0)
    with pytest.raises(UsageError, match="tolerance"):
        watch_budget(nn.Linear(2, 2), PLAN, tolerance=-0.1)


def test_apply_installs_the_watch_and_disable_removes_it(
    allocator: FakeAllocator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every applied plan is watched (``apply`` calls ``watch_budget``); ``disable`` takes the
    hook off. The watch is told the model is on CUDA, as the tests above do."""
    import importlib

    import gradckpt

    apply_module = importlib.import_module("gradckpt.apply")  # the module, not the function
    monkeypatch.setattr(apply_module, "watch_budget",
                        lambda model, plan: watch_budget(model, plan, device="cuda"))
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    plan = Plan("sqrt", BUDGET, [], 90 * MIB, 0.0, 0.0, block_names=["0", "1"])
    gradckpt.apply(model, plan)
    watch = watch_of(model)
    assert watch is not None and watch.active and watch.budget_bytes == BUDGET
    with pytest.warns(GradckptWarning, match="above the budget|over the budget|budget"):
        train(model, allocator, [50 * MIB, 150 * MIB, 50 * MIB])
    gradckpt.disable(model)
    assert not watch.active


def test_a_plan_on_cpu_is_not_watched() -> None:
    import gradckpt

    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    gradckpt.apply(model, Plan("sqrt", BUDGET, [], 90 * MIB, 0.0, 0.0, block_names=["0", "1"]))
    watch = watch_of(model)
    assert watch is not None and not watch.active and "cpu" in watch.reason
    gradckpt.disable(model)
