"""Model adapters: how integrations change a model while gradckpt works on it, without the core
knowing the model family (``gradckpt.adapters``; Hugging Face's is the built-in one)."""

from __future__ import annotations

import subprocess
import sys

import torch
from hf_models import causal_sample, tiny_llama

import gradckpt
from gradckpt.adapters import adapt, adapted, register_adapter, unregister_adapter
from gradckpt.integrations.hf import turn_caches_off


def test_adapters_run_in_order_and_undo_last_first() -> None:
    events = []

    def adapter(label):
        def run(model):
            events.append(f"{label} on")
            return lambda: events.append(f"{label} off")
        return run

    first, second, idle = adapter("first"), adapter("second"), lambda model: None
    for each in (first, second, idle, first):  # registering twice runs it once
        register_adapter(each)
    try:
        restore = adapt(torch.nn.Linear(1, 1))
        assert events == ["first on", "second on"]
        restore()
        assert events == ["first on", "second on", "second off", "first off"]
    finally:
        for each in (first, second, idle):
            unregister_adapter(each)
    unregister_adapter(first)  # unknown: nothing happens
    with adapted(torch.nn.Linear(1, 1)):
        pass
    assert len(events) == 4


def test_importing_gradckpt_registers_the_hugging_face_adapter() -> None:
    # The core imports no integration; the package wires the built-in ones in.
    code = ("import gradckpt, gradckpt.adapters as a, gradckpt.integrations.hf as hf; "
            "assert hf.turn_caches_off in a._ADAPTERS")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_caches_are_off_while_profiling_and_while_a_plan_is_applied() -> None:
    model = tiny_llama(3)
    model.config.use_cache = True
    seen = []
    hook = model.model.layers[0].register_forward_pre_hook(
        lambda module, args: seen.append(model.config.use_cache))
    sample = causal_sample()
    plan = gradckpt.enable(model, sample, budget="90%")
    hook.remove()
    assert seen and not any(seen)  # every forward profile ran had the cache off
    assert model.config.use_cache is False  # the plan is applied
    gradckpt.disable(model)
    assert model.config.use_cache is True
    assert plan.block_names


def test_a_model_without_a_config_is_left_alone() -> None:
    assert turn_caches_off(torch.nn.Linear(2, 2)) is None
