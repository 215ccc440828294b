"""Planning a model again, and failures that leave nothing behind (issue 22, item 4).

A planned model can be planned again (``enable`` twice, as a re-run notebook cell does) and
measured (``profile`` sees it as without its plan and leaves the plan on), with the plain model's
gradients bit for bit (engine invariant 1) and no warning about flags gradckpt set itself.
``get_plan`` and ``is_checkpointed`` say what is on. And an exception or ``KeyboardInterrupt``
anywhere (a planned block's forward, recomputation, backward, between blocks, ``profile``)
leaves no hooks, modes or engine state behind: the same model and a fresh one train correctly
afterwards. Real Transformers models from tiny configs (random weights) and a PEFT LoRA model.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import hf_models
import pytest
import torch
from torch import nn

import gradckpt
from gradckpt.engine import plans_suspended
from gradckpt.engine.suspension import _segment_handles, _suspended
from gradckpt.errors import forget_warnings
from gradckpt.plan import Plan, Segment

transformers = pytest.importorskip("transformers")
peft = pytest.importorskip("peft")

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread


# --- helpers --------------------------------------------------------------------------------


def llama(layers: int = 3) -> nn.Module:
    """A seeded tiny LlamaForCausalLM (hidden 64, attention dropout on: RNG replay matters)."""
    return hf_models.tiny_llama(layers)


@functools.cache
def plain_step(layers: int = 3) -> dict[str, torch.Tensor]:
    """``train_step`` of the plain ``llama(layers)`` on ``sample()``: what every plan gives."""
    return train_step(llama(layers), sample())


def sample() -> dict:
    return hf_models.causal_sample(seq=32)


def plan_for(model: nn.Module, segments: list[tuple[int, int] | Segment]) -> Plan:
    names = [name for name, _ in gradckpt.find_blocks(model)]
    made = [s if isinstance(s, Segment) else Segment(*s) for s in segments]
    return Plan("sqrt", None, made, 0, 0.0, 0.0, block_names=names)


def train_step(model: nn.Module, batch: dict) -> dict[str, torch.Tensor]:
    """One step of the user's loop; the loss and every gradient, then the gradients cleared."""
    torch.manual_seed(3)  # dropout masks
    output = model(**batch)
    output.loss.backward()
    result = {"loss": output.loss.detach()}
    result.update({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    model.zero_grad(set_to_none=True)
    return result


def assert_identical(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(actual[name], tensor), name


def hook_counts(model: nn.Module) -> list[int]:
    return [len(m._forward_pre_hooks) + len(m._forward_hooks) for m in model.modules()]


def global_state() -> dict[str, Any]:
    """What a failure could leave behind on this thread or in the process."""
    module = torch.nn.modules.module
    return {
        "saved-tensor hooks": torch._C._autograd._top_saved_tensors_default_hooks(False),
        "dispatch modes": torch._C._len_torch_dispatch_stack(),
        "function modes": torch._C._len_torch_function_stack(),
        "global module hooks": (len(module._global_forward_pre_hooks),
                                len(module._global_forward_hooks)),
        "grad mode": torch.is_grad_enabled(),
        "torch.utils.checkpoint": torch.utils.checkpoint.CheckpointFunction,
        "suspended": dict(_suspended.counts),
        # Each live plan's per-thread state: no segment open, no hooks entered.
        "open segments": [
            (len(handle.local.frames), bool(handle.local.frames[0].runs), handle.local.entered)
            for handle in list(_segment_handles)
        ],
    }


def assert_nothing_left(before: dict[str, Any]) -> None:
    after = global_state()
    assert after.pop("open segments") == [(1, False, [])] * len(_segment_handles)
    assert after == {key: value for key, value in before.items() if key != "open segments"}


@contextlib.contextmanager
def no_gradckpt_warnings() -> Iterator[None]:
    forget_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    messages = [str(w.message) for w in caught if issubclass(w.category, gradckpt.GradckptWarning)]
    assert messages == []


def byte_fields(profile: gradckpt.Profile) -> dict:
    """The profile as JSON without its times (measured, so never equal twice), without
    ``saved_bytes_by_op``, a breakdown that differs between two profiles of one plain model
    (which operation a storage is credited to; their totals, ``saved_bytes``, are kept), and
    without ``op_choices``, which sets of operations were measured: chosen by their measured
    time shares."""

    def without_times(value: Any) -> Any:
        if isinstance(value, dict):
            return {key: without_times(item) for key, item in value.items()
                    if "seconds" not in key and key not in ("saved_bytes_by_op", "op_choices")}
        if isinstance(value, list):
            return [without_times(item) for item in value]
        return value

    return without_times(json.loads(profile.to_json()))


def fresh_model_plans_and_trains() -> None:
    """A model nobody touched yet gets a plan and trains to the plain model's gradients."""
    model = llama(2)
    gradckpt.apply(model, plan_for(model, [(0, 1)]))
    assert_identical(train_step(model, sample()), plain_step(2))
    gradckpt.disable(model)


# --- planning again -------------------------------------------------------------------------


def test_enable_twice_replaces_the_plan_and_trains_as_the_plain_model() -> None:
    """The reported case: enable, AdamW steps, enable again. No error, no warning about
    Transformers' checkpointing (gradckpt's own flags are on), the plain model's gradients and
    parameters after every step."""
    plain, model = llama(), llama()
    batch = sample()
    plain_optimizer = torch.optim.AdamW(plain.parameters(), lr=1e-3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)

    def steps() -> None:
        for _ in range(2):
            assert_identical(train_step(model, batch) | {}, train_step(plain, batch))
        # train_step cleared the gradients: step with fresh ones, identically on both
        for each, its_optimizer in ((plain, plain_optimizer), (model, optimizer)):
            torch.manual_seed(3)
            each(**batch).loss.backward()
            its_optimizer.step()
            its_optimizer.zero_grad(set_to_none=True)

    with no_gradckpt_warnings():
        first = gradckpt.enable(model, batch, budget="100%", strategy="sqrt",
                                optimizer=optimizer)
        assert any(s.end > s.start for s in first.segments)  # a multi-block segment
        steps()
        second = gradckpt.enable(model, batch, budget="90%", optimizer=optimizer)
    assert gradckpt.get_plan(model) is second
    steps()
    for (name, parameter), twin in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(parameter, twin), name
    gradckpt.disable(model)


def _lora(model: nn.Module) -> nn.Module:
    config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                             lora_dropout=0.0, init_lora_weights=False)
    torch.manual_seed(1)
    return peft.get_peft_model(model, config)


def test_a_lora_model_enabled_twice_gives_the_plain_lora_gradients() -> None:
    plain, model = _lora(llama(2)), _lora(llama(2))
    batch = sample()
    expected = train_step(plain, batch)
    with no_gradckpt_warnings():
        gradckpt.enable(model, batch, budget="100%", strategy="every-layer", optimizer="none")
        assert_identical(train_step(model, batch), expected)
        plan = gradckpt.enable(model, batch, budget="100%", strategy="sqrt", optimizer="none")
    assert gradckpt.get_plan(model) is plan
    assert gradckpt.get_plan(model.base_model.model) is plan  # what the wrapper holds
    assert_identical(train_step(model, batch), expected)
    gradckpt.disable(model)
    assert gradckpt.get_plan(model) is None


def test_profile_of_a_planned_lora_model_does_not_take_the_plans_flags_for_transformers() -> None:
    """PEFT's wrappers forward attribute reads to the model they wrap, so the flag a plan sets
    on the Transformers model reads as set on them too: those are the plan's, not Transformers'
    checkpointing, and profiling the planned model says nothing of it."""
    plain, model = _lora(llama(2)), _lora(llama(2))
    batch = sample()
    with no_gradckpt_warnings():
        gradckpt.enable(model, batch, budget="100%", strategy="every-layer", optimizer="none")
        measured = gradckpt.profile(model, batch, repeats=1)
    assert byte_fields(measured) == byte_fields(gradckpt.profile(plain, batch, repeats=1))
    gradckpt.disable(model)


def test_enable_then_disable_gives_back_the_plain_model() -> None:
    plain, model = llama(2), llama(2)
    batch = sample()
    hooks, flag = hook_counts(model), model.is_activation_checkpointing
    plan = gradckpt.enable(model, batch, budget="100%", strategy="every-layer", optimizer="none")
    assert gradckpt.get_plan(model) is plan and gradckpt.is_checkpointed(model)
    assert model.is_activation_checkpointing
    gradckpt.disable(model)
    assert gradckpt.get_plan(model) is None and not gradckpt.is_checkpointed(model)
    assert hook_counts(model) == hooks and model.is_activation_checkpointing == flag
    assert not any("forward" in vars(layer) for layer in model.model.layers)
    assert_identical(train_step(model, batch), train_step(plain, batch))


def test_profile_of_a_planned_model_is_the_plain_models_and_keeps_the_plan() -> None:
    plain, model = llama(2), llama(2)
    batch = sample()
    plan = plan_for(model, [(0, 1)])
    gradckpt.apply(model, plan)
    train_step(model, batch)  # the plan has run: its segments opened, closed and recomputed
    hooks = hook_counts(model)
    with no_gradckpt_warnings():
        measured = gradckpt.profile(model, batch, repeats=1)
    assert byte_fields(measured) == byte_fields(gradckpt.profile(plain, batch, repeats=1))
    assert gradckpt.get_plan(model) is plan and hook_counts(model) == hooks
    assert model.is_activation_checkpointing
    calls = []
    model.model.layers[1].mlp.register_forward_pre_hook(lambda *_: calls.append(1))
    assert_identical(train_step(model, batch), train_step(plain, batch))
    assert len(calls) == 2  # forward and recomputation: the plan is still on


def test_the_trainer_callback_replans_a_model_enable_planned(tmp_path) -> None:
    """The Trainer callback takes enable's path (``enable.plan_and_apply``): on a model enable
    planned, it measures the plain model and replaces enable's plan, with no warning about the
    flags gradckpt set; the model then trains as the plain one."""
    from gradckpt.integrations.hf_trainer import GradckptCallback

    plain, model = llama(2), llama(2)
    batch = sample()
    callback = GradckptCallback(budget=None, strategy="every-layer", sample=batch)
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, report_to=[])
    with no_gradckpt_warnings():
        first = gradckpt.enable(model, batch, budget=None, strategy="sqrt", optimizer="none")
        callback.on_train_begin(args, transformers.TrainerState(),
                                transformers.TrainerControl(), model=model)
    plan = callback.plan
    assert gradckpt.get_plan(model) is plan and plan is not first
    assert [(s.start, s.end) for s in plan.segments] == [(0, 0), (1, 1)]  # every layer
    # The Trainer's step (AdamW, the output dropped first) of the plain model.
    expected = gradckpt.profile(plain, batch, optimizer="adamw", keep_output=False, repeats=1)
    assert byte_fields(callback.profile) == byte_fields(expected)
    assert_identical(train_step(model, batch), train_step(plain, batch))
    gradckpt.disable(model)


def test_get_plan_and_is_checkpointed_say_what_is_on() -> None:
    model = llama(2)
    assert gradckpt.get_plan(model) is None and not gradckpt.is_checkpointed(model)
    plan = plan_for(model, [(0, 1)])
    gradckpt.apply(model, plan)
    assert gradckpt.get_plan(model) is plan
    assert gradckpt.is_checkpointed(model) and gradckpt.is_checkpointed(model.model.layers[0])
    assert not gradckpt.is_checkpointed(model.lm_head)
    wrapped = _lora(model)  # a wrapper of the planned model
    assert gradckpt.get_plan(wrapped) is plan and gradckpt.is_checkpointed(wrapped)
    gradckpt.disable(wrapped)
    assert gradckpt.get_plan(model) is None and not gradckpt.is_checkpointed(model)
    gradckpt.checkpoint_module(model.model.layers[1])
    assert gradckpt.is_checkpointed(model) and gradckpt.get_plan(model) is None
    gradckpt.uncheckpoint_module(model.model.layers[1])
    assert not gradckpt.is_checkpointed(model)


def test_suspension_is_for_this_thread_only() -> None:
    """Inside plans_suspended the model runs plain here, and planned on another thread."""
    plain, model = llama(2), llama(2)
    batch = sample()
    gradckpt.apply(model, plan_for(model, [(0, 1)]))
    gradckpt.checkpoint_module(model.lm_head)
    calls: dict[str, int] = {}

    def count(*_: Any) -> None:
        name = threading.current_thread().name
        calls[name] = calls.get(name, 0) + 1

    model.model.layers[1].mlp.register_forward_pre_hook(count)
    model.lm_head.register_forward_pre_hook(count)
    expected = train_step(plain, batch)
    results = {}
    with plans_suspended(model):
        results["suspended"] = train_step(model, batch)
        other = threading.Thread(target=lambda: results.update(other=train_step(model, batch)),
                                 name="other")
        other.start()
        other.join()
    assert calls == {threading.current_thread().name: 2, "other": 4}
    assert_identical(results["suspended"], expected)
    assert_identical(results["other"], expected)
    assert _suspended.counts == {}
    gradckpt.uncheckpoint_module(model.lm_head)
    gradckpt.disable(model)


# --- failures leave nothing behind ----------------------------------------------------------


def _raise_in(module: nn.Module, error: BaseException, on_call: int = 1) -> Callable[[], None]:
    """Make ``module``'s ``on_call``-th forward (counting from 1) raise ``error``; return what
    undoes it."""
    calls = []
    own = module.forward

    def forward(*args: Any, **kwargs: Any) -> Any:
        calls.append(1)
        if len(calls) == on_call:
            raise error
        return own(*args, **kwargs)

    module.forward = forward
    return lambda: vars(module).pop("forward")


def _in_a_block_forward(model: nn.Module, batch: dict) -> None:
    undo = _raise_in(model.model.layers[1].mlp, RuntimeError("boom in forward"))
    try:
        model(**batch)
    finally:
        undo()


def _interrupt_in_a_block_forward(model: nn.Module, batch: dict) -> None:
    undo = _raise_in(model.model.layers[1].mlp, KeyboardInterrupt())
    try:
        model(**batch)
    finally:
        undo()


def _interrupt_between_blocks(model: nn.Module, batch: dict) -> None:
    # Before any hook of block 2 runs: inside the nested plan's segment 0-2, between blocks.
    handle = model.model.layers[2].register_forward_pre_hook(
        lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()), prepend=True)
    try:
        model(**batch)
    finally:
        handle.remove()


def _in_recomputation(model: nn.Module, batch: dict) -> None:
    undo = _raise_in(model.model.layers[2].mlp, RuntimeError("boom in recomputation"), 2)
    try:
        model(**batch).loss.backward()
    finally:
        undo()


def _in_backward(model: nn.Module, batch: dict) -> None:
    output = model(**batch)
    output.logits.register_hook(lambda grad: (_ for _ in ()).throw(RuntimeError("boom")))
    output.loss.backward()


FAILURES = {
    "exception in a block's forward": (_in_a_block_forward, RuntimeError),
    "KeyboardInterrupt in a block's forward": (_interrupt_in_a_block_forward, KeyboardInterrupt),
    "KeyboardInterrupt between blocks": (_interrupt_between_blocks, KeyboardInterrupt),
    "exception in recomputation": (_in_recomputation, RuntimeError),
    "exception in backward": (_in_backward, RuntimeError),
}

PLANS = {  # nested segments, and a policy (top-level segments without children only)
    "nested": [Segment(0, 2, children=[Segment(0, 1), Segment(2, 2)])],
    "policy": [Segment(0, 1, policy="save-matmuls"), Segment(2, 2)],
}


@pytest.mark.parametrize("segments", PLANS.values(), ids=PLANS.keys())
@pytest.mark.parametrize("failure", FAILURES.values(), ids=FAILURES.keys())
def test_a_failed_step_leaves_nothing_behind(failure: tuple, segments: list[Segment]) -> None:
    fail, error = failure
    model = llama()
    batch = sample()
    plan = plan_for(model, segments)
    gradckpt.apply(model, plan)
    before, hooks, caches = global_state(), hook_counts(model), model.config.use_cache
    with pytest.raises(error):
        fail(model, batch)
    if fail is _interrupt_between_blocks:
        # No hook of ours runs there: a segment cut short (nested: 0-3) is closed by the
        # model's next call (below); it touched nothing outside the model meanwhile.
        after = global_state()
        del after["open segments"]
        assert after == {key: value for key, value in before.items() if key != "open segments"}
    else:
        assert_nothing_left(before)
    assert hook_counts(model) == hooks
    if error is not KeyboardInterrupt:  # torch runs no post-hook for it: the next call does
        assert model.config.use_cache == caches
    model.zero_grad(set_to_none=True)
    assert_identical(train_step(model, batch), plain_step())
    assert_nothing_left(before)
    assert model.config.use_cache == caches
    fresh_model_plans_and_trains()
    gradckpt.apply(model, plan)  # applying again after a failure works
    assert_identical(train_step(model, batch), plain_step())
    gradckpt.disable(model)
    assert_nothing_left(before)


def test_a_segments_first_block_run_on_its_own_then_the_whole_model() -> None:
    """What profile did to a planned model before it suspended plans: a segment's first block
    called alone, and backward through it (the zip() crash: the region replays the blocks
    that ran). Nothing stays on the thread's stacks; the model then trains as planned."""
    plain, model = llama(), llama()
    batch = sample()
    gradckpt.apply(model, plan_for(model, [(0, 2)]))
    before = global_state()
    hidden = torch.randn(2, 32, 64, requires_grad=True)
    positions = model.model.rotary_emb(hidden, torch.arange(32)[None])

    def input_gradient(layer: nn.Module) -> torch.Tensor:
        torch.manual_seed(3)  # dropout masks
        return torch.autograd.grad(layer(hidden, position_embeddings=positions).sum(), hidden)[0]

    assert torch.equal(input_gradient(model.model.layers[0]),
                       input_gradient(plain.model.layers[0]))
    state = global_state()  # the segment is open (block 1 may come next), nothing else
    assert state.pop("open segments") != before["open segments"]
    assert state == {key: value for key, value in before.items() if key != "open segments"}
    assert_identical(train_step(model, batch), plain_step())
    assert_nothing_left(before)
    fresh_model_plans_and_trains()


@pytest.mark.parametrize("planned", [False, True], ids=["plain", "planned"])
@pytest.mark.parametrize("at", ["first", "middle", "last"])
def test_a_keyboard_interrupt_during_profile_leaves_nothing_behind(at: str, planned: bool) -> None:
    """Raised by the progress callback after profile's first step (the warm-up), one in the
    middle, its last (the last block measured)."""
    model = llama(2)
    batch = sample()
    plan = plan_for(model, [(0, 1)])
    if planned:
        gradckpt.apply(model, plan)
    model(**batch).loss.backward()  # gradients the loop holds: profile puts them back
    before, hooks = global_state(), hook_counts(model)
    grads = {name: p.grad for name, p in model.named_parameters()}
    assert all(grad is not None for grad in grads.values())
    caches, rng = model.config.use_cache, torch.get_rng_state()

    def progress(done: int, total: int) -> None:
        if done == {"first": 1, "middle": total // 2, "last": total}[at]:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        gradckpt.profile(model, batch, repeats=1, progress=progress)
    assert_nothing_left(before)
    assert hook_counts(model) == hooks and model.config.use_cache == caches
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(p.grad is grads[name] for name, p in model.named_parameters())
    assert gradckpt.get_plan(model) is (plan if planned else None)
    model.zero_grad(set_to_none=True)
    assert_identical(train_step(model, batch), plain_step(2))
    fresh_model_plans_and_trains()


def test_enable_after_the_reported_crash_and_on_a_fresh_model() -> None:
    """The issue's sequence, on a deep copy taken before it: enable, train, enable again; then
    a fresh model is planned and trained."""
    model = llama()
    plain = copy.deepcopy(model)
    batch = sample()
    gradckpt.enable(model, batch, budget="100%", strategy="sqrt", optimizer="none")
    assert_identical(train_step(model, batch), train_step(plain, batch))
    before = global_state()
    plan = gradckpt.enable(model, batch, budget="100%", strategy="sqrt", optimizer="none")
    assert_nothing_left(before)
    assert gradckpt.get_plan(model) is plan
    assert_identical(train_step(model, batch), train_step(plain, batch))
    gradckpt.disable(model)
    fresh_model_plans_and_trains()


def test_a_modeled_clock_is_for_its_own_thread_only() -> None:
    """estimate times fake tensors on a modeled clock; a profile on another thread at the same
    time reads the wall clock."""
    from gradckpt.measure import clock
    from gradckpt.predict.clock import ModeledClock

    class Device:
        def seconds(self, flops: float, bytes_moved: float, dtype: torch.dtype) -> float:
            return 1.0

    seen = {}
    entered, leave = threading.Event(), threading.Event()

    def estimate_like() -> None:
        with ModeledClock(Device()):
            seen["inside"] = clock.modeled()
            entered.set()
            leave.wait()

    other = threading.Thread(target=estimate_like)
    other.start()
    entered.wait()
    seen["here"] = clock.modeled()
    leave.set()
    other.join()
    assert seen == {"inside": True, "here": False}


def test_backward_on_another_thread_recomputes_there() -> None:
    """On CUDA, backward (so recomputation) runs on autograd's own thread: the segments'
    state is per thread, and a nested plan replays there as on the forward's thread."""
    model = llama()
    gradckpt.apply(model, plan_for(model, PLANS["nested"]))
    batch = sample()
    torch.manual_seed(3)  # dropout masks, as train_step draws them
    output = model(**batch)
    backward = threading.Thread(target=output.loss.backward)
    backward.start()
    backward.join()
    actual = {"loss": output.loss.detach()}
    actual.update({name: p.grad for name, p in model.named_parameters() if p.grad is not None})
    assert_identical(actual, plain_step())
    gradckpt.disable(model)
