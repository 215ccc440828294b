"""Ecosystem hooks: how integrations change a model while gradckpt works on it, without the core
knowing the model family (``gradckpt.ecosystem_hooks``; Hugging Face's is the built-in one)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from hf_models import causal_sample, tiny_llama

import gradckpt
from gradckpt.ecosystem_hooks import (
    Occasion,
    ecosystem_hooks_on,
    register_ecosystem_hook,
    run_ecosystem_hooks,
    unregister_ecosystem_hook,
)
from gradckpt.integrations.hf import adapt_transformers, turn_caches_off

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread


def test_adapters_run_in_order_and_undo_last_first() -> None:
    events = []

    def adapter(label):
        def run(model, occasion):
            events.append(f"{label} on")
            return lambda: events.append(f"{label} off")
        return run

    first, second, idle = adapter("first"), adapter("second"), lambda model, occasion: None
    for each in (first, second, idle, first):  # registering twice runs it once
        register_ecosystem_hook(each)
    try:
        restore = run_ecosystem_hooks(torch.nn.Linear(1, 1))
        assert events == ["first on", "second on"]
        restore()
        assert events == ["first on", "second on", "second off", "first off"]
    finally:
        for each in (first, second, idle):
            unregister_ecosystem_hook(each)
    unregister_ecosystem_hook(first)  # unknown: nothing happens
    with ecosystem_hooks_on(torch.nn.Linear(1, 1)):
        pass
    assert len(events) == 4


def test_importing_gradckpt_registers_the_hugging_face_adapter() -> None:
    # The core imports no integration; the package wires the built-in ones in.
    code = ("import gradckpt, gradckpt.ecosystem_hooks as a, gradckpt.integrations.hf as hf; "
            "assert hf.adapt_transformers in a._HOOKS")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_caches_are_off_in_training_steps_while_profiling_and_while_a_plan_is_applied() -> None:
    model = tiny_llama(3)
    model.config.use_cache = True
    seen = []  # the cache each training forward of a layer was handed

    def note(module, args, kwargs):
        if torch.is_grad_enabled():
            seen.append(kwargs.get("cache", kwargs.get("past_key_values")))

    hook = model.model.layers[0].register_forward_pre_hook(note, with_kwargs=True)
    sample = causal_sample()
    plan = gradckpt.enable(model, sample, budget="90%")
    assert seen and all(cache is None for cache in seen)  # profiling: never a cache
    seen.clear()
    model(**sample).loss.backward()  # a training step under the plan
    assert seen and all(cache is None for cache in seen)  # recomputation calls it again
    with torch.no_grad():  # inference: the cache as configured
        model(**sample)
    hook.remove()
    assert model.config.use_cache is True  # outside a training step: as the user set it
    gradckpt.disable(model)
    assert model.config.use_cache is True
    assert plan.block_names


def test_a_model_without_a_config_is_left_alone() -> None:
    assert turn_caches_off(torch.nn.Linear(2, 2)) is None
    assert adapt_transformers(torch.nn.Linear(2, 2), Occasion(True, True)) is None
