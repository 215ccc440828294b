"""No state outlives a failure (issue 27, item 1): a planned step that fails in its forward, in
its recomputation or in its backward, and a ``KeyboardInterrupt`` or an error inside ``profile``
and ``estimate``, leave the model as it was (after ``enable``), torch's global and thread-local
state as it was, and gradckpt's own state idle; the same model then trains with the plain
model's gradients, bit for bit, and a fresh model plans and trains likewise. Two models planned
and trained in two threads at once each get their plain copy's gradients."""

from __future__ import annotations

import gc
import importlib
import subprocess
import sys
import textwrap
import threading
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from hf_models import tiny_llama, with_lora
from torch.nn.modules import module as torch_module

import gradckpt
from gradckpt import budget_watch, ecosystem_hooks
from gradckpt.engine import chunked_head, debug, suspension, tensors
from gradckpt.integrations import hf as hf_integration
from gradckpt.integrations import hf_families
from gradckpt.measure import clock, operations

pytestmark = pytest.mark.usefixtures("one_thread")

# What apply installed, per model (the module's: ``gradckpt.apply`` is the function).
_installed = importlib.import_module("gradckpt.apply")._installed

VOCAB, BATCH, SEQ = 64, 2, 48
BUDGET = "90%"  # the tiny Llama recomputes its middle layer within it


class Injected(Exception):
    """The failure the tests make."""


def _model(lora: bool) -> torch.nn.Module:
    model = tiny_llama(3, vocab_size=VOCAB)
    return with_lora(model) if lora else model


def _batch() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)
    return {"input_ids": ids, "labels": ids}


def _planned(model: torch.nn.Module) -> torch.nn.Module:
    """The recomputed block of ``model``, once ``enable`` planned it."""
    plan = gradckpt.enable(model, _batch(), budget=BUDGET, optimizer="adamw")
    assert plan.segments, "the budget must make the plan recompute a block"
    return model.get_submodule(plan.block_names[plan.segments[0].start])


def _train(model: torch.nn.Module, steps: int = 2) -> list[dict[str, torch.Tensor]]:
    """Every step's gradients, from no gradients, the same dropout for every model."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(2)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    gradients = []
    for _ in range(steps):
        model(**_batch()).loss.backward()
        gradients.append({n: p.grad.clone() for n, p in model.named_parameters()
                          if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad()
    return gradients


def _same_gradients(ours: list[dict], plain: list[dict]) -> bool:
    return len(ours) == len(plain) and all(
        a.keys() == b.keys() and all(torch.equal(a[n], b[n]) for n in a)
        for a, b in zip(ours, plain, strict=True))


# ---- what must come back as it was --------------------------------------------------------


def _model_state(model: torch.nn.Module) -> dict:
    return {
        "values": {k: v.clone() for k, v in model.state_dict().items()},
        "trains": {n: p.requires_grad for n, p in model.named_parameters()},
        "modes": {n: m.training for n, m in model.named_modules()},
        "hooks": {n: (list(m._forward_hooks), list(m._forward_pre_hooks),
                      list(m._backward_hooks), list(m._backward_pre_hooks))
                  for n, m in model.named_modules()},
        "forwards": {n: m.__dict__.get("forward") for n, m in model.named_modules()},
        "config": getattr(model, "config", None) and model.config.to_dict(),
    }


def _same_model(before: dict, after: dict, but: set[str] = frozenset()) -> None:
    assert before.keys() == after.keys()
    for key in set(before) - but:
        if key == "values":
            assert before[key].keys() == after[key].keys()
            assert all(torch.equal(v, after[key][k]) for k, v in before[key].items())
        else:
            assert before[key] == after[key], key


def _torch_state() -> dict:
    return {
        "grad": torch.is_grad_enabled(),
        "inference": torch.is_inference_mode_enabled(),
        "autocast": (torch.is_autocast_enabled("cpu"), torch.is_autocast_enabled("cuda")),
        "saved tensors hooks": torch._C._autograd._top_saved_tensors_default_hooks(True),
        "dispatch modes": torch._C._len_torch_dispatch_stack(),
        "fake mode": torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE),
        "function modes": torch._C._len_torch_function_stack(),
        "global module hooks": [
            list(hooks) for hooks in (
                torch_module._global_forward_pre_hooks, torch_module._global_forward_hooks,
                torch_module._global_backward_pre_hooks, torch_module._global_backward_hooks)],
        "default dtype": torch.get_default_dtype(),
        "deterministic": torch.are_deterministic_algorithms_enabled(),
    }


def _gradckpt_state() -> dict:
    """gradckpt's module-level and thread-local state (the threads' own: this one's)."""
    gc.collect()  # what earlier tests left to the collector goes now, not between two looks
    handles = list(suspension._segment_handles)
    return {
        "engine internal work": tensors._internal_work.active,
        "debug": debug._debug_state.enabled,
        "suspended": dict(suspension._suspended.counts),
        "segment handles": {id(h) for h in handles},
        "open segments": [[(f.replaying, dict(f.runs)) for f in h.local.frames]
                          for h in handles],
        "entered hooks": [list(h.local.entered) for h in handles],
        "head forced": dict(chunked_head._local.forced),
        "head listeners": list(chunked_head._local.listeners),
        "clocks": list(clock._active.stack),
        "bookkeeping": clock._active.bookkeeping,
        "installed": {id(m) for m in _installed.keys()},
        "budget watches": {id(m) for m in budget_watch._watches.keys()},
        "ecosystem hooks": list(ecosystem_hooks._HOOKS),
        "hf flags": {id(m): n for m, n in hf_integration._flagged_by_plans.items()},
    }


def _globals() -> dict:
    return {**_torch_state(), **_gradckpt_state()}


# A KeyboardInterrupt that no hook of gradckpt sees (between two blocks, in a pre-hook after
# gradckpt's) leaves the segment it cut short open on the thread, its hooks off: the next call of
# a block of the model finishes it (segments.py, "Failure safety"). The caches that the
# Transformers integration turned off for the forward are back at once (a try/finally in the
# model's forward: test_an_interrupt_leaves_the_cache_setting_as_it_was).
FINISHED_BY_THE_NEXT_STEP = {"open segments", "entered hooks"}


def _same_globals(before: dict, but: set[str] = frozenset()) -> None:
    after = _globals()
    for key, value in before.items():
        assert key in but or after[key] == value, (key, value, after[key])


def _snapshot(model: torch.nn.Module) -> tuple[dict, dict]:
    return _model_state(model), _globals()


def _check_everything_came_back(
    model: torch.nn.Module, lora: bool, model_before: dict, globals_before: dict,
    interrupted: bool = False,
) -> None:
    _same_globals(globals_before, FINISHED_BY_THE_NEXT_STEP if interrupted else set())
    _same_model(model_before, _model_state(model))
    torch.randn(3)  # the default generator works
    # The same planned model trains as the plain one, and a fresh one plans and trains so.
    plain = _train(_model(lora))
    assert _same_gradients(_train(model), plain)
    _same_globals(globals_before)
    assert _model_state(model)["config"] == model_before["config"]
    fresh = _model(lora)
    _planned(fresh)
    assert _same_gradients(_train(fresh), plain)


def _raising_on_call(calls_to_fail: set[int], error: BaseException,
                     seen: list[int] | None = None) -> Callable:
    """A forward pre-hook raising ``error`` on those calls (counted from 1; the count kept in
    ``seen[0]`` where given)."""
    seen = [0] if seen is None else seen

    def hook(module: torch.nn.Module, args: tuple) -> None:
        seen[0] += 1
        if seen[0] in calls_to_fail:
            raise error

    return hook


# ---- 1, 2: the planned step's forward, its recomputation -----------------------------------


WHERE = {
    # block's own pre-hook (after gradckpt's, which has turned the region's hooks on), a layer
    # inside the block, the call of it that raises: 1 is the forward, 2 the recomputation
    "forward, the block's pre-hook": ("", 1),
    "forward, inside the block": ("mlp", 1),
    "recomputation, inside the block": ("mlp", 2),
    "recomputation, late in the block": ("post_attention_layernorm", 2),
}


@pytest.mark.parametrize("error", [Injected("injected"), KeyboardInterrupt()],
                         ids=["exception", "interrupt"])
@pytest.mark.parametrize("where", list(WHERE))
@pytest.mark.parametrize("lora", [False, True], ids=["llama", "lora"])
def test_a_planned_step_failing_in_forward_or_recomputation_leaves_nothing(
        lora: bool, where: str, error: BaseException) -> None:
    model = _model(lora)
    block = _planned(model)
    model_before, globals_before = _snapshot(model)
    inner, failing_call = WHERE[where]
    handle = block.get_submodule(inner).register_forward_pre_hook(
        _raising_on_call({failing_call}, error))
    rng_before_backward = None
    with pytest.raises(type(error)):
        out = model(**_batch())
        rng_before_backward = torch.get_rng_state()
        out.loss.backward()
    handle.remove()
    out = None
    if failing_call == 2:  # recomputation replays the forward's RNG and puts the caller's back
        assert rng_before_backward is not None
        assert torch.equal(torch.get_rng_state(), rng_before_backward)
    _check_everything_came_back(model, lora, model_before, globals_before,
                                interrupted=isinstance(error, KeyboardInterrupt))


def test_an_interrupt_leaves_the_cache_setting_as_it_was() -> None:
    model = _model(lora=False)
    block = _planned(model)
    handle = block.mlp.register_forward_pre_hook(_raising_on_call({1}, KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        model(**_batch())
    handle.remove()
    assert model.config.use_cache is True


# ---- 3: the planned step's backward ---------------------------------------------------------


# Where the tensor hook goes: an output the backward reaches before the block is recomputed
# (its MLP's), and one it reaches after (its attention's input).
HOOKED = {"before recomputation": "mlp", "after recomputation": "self_attn.q_proj"}


@pytest.mark.parametrize("hooked", list(HOOKED))
@pytest.mark.parametrize("lora", [False, True], ids=["llama", "lora"])
def test_a_planned_step_failing_in_backward_leaves_nothing(lora: bool, hooked: str) -> None:
    model = _model(lora)
    block = _planned(model)
    model_before, globals_before = _snapshot(model)
    block_calls, reached = [], []  # the block's calls so far when backward fails

    def fail(gradient: torch.Tensor) -> None:
        reached.append(len(block_calls))
        raise Injected("backward")

    def hook_output(module: torch.nn.Module, args: tuple, output: torch.Tensor) -> None:
        if not reached and output.requires_grad:
            output.register_hook(fail)

    handles = [block.get_submodule(HOOKED[hooked]).register_forward_hook(hook_output),
               block.register_forward_pre_hook(lambda module, args: block_calls.append(1))]
    out = model(**_batch())
    rng_before_backward = torch.get_rng_state()
    with pytest.raises(Injected):
        out.loss.backward()
    for handle in handles:
        handle.remove()
    del out
    assert reached == [1 if hooked == "before recomputation" else 2]
    assert torch.equal(torch.get_rng_state(), rng_before_backward)
    _check_everything_came_back(model, lora, model_before, globals_before)


# ---- 4, 5: profile and estimate -------------------------------------------------------------


def _block_calls(model: torch.nn.Module, run: Callable[[], object]) -> int:
    """How often ``run`` calls the model's second layer."""
    calls = [0]
    layer = _layers(model)[1]

    def count(module: torch.nn.Module, args: tuple) -> None:
        calls[0] += 1

    handle = layer.register_forward_pre_hook(count)
    try:
        run()
    finally:
        handle.remove()
    return calls[0]


def _layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The planned model's chain of blocks."""
    return [model.get_submodule(name) for name in gradckpt.get_plan(model).block_names]


MEASURING: dict[str, Callable[[torch.nn.Module], object]] = {
    "profile": lambda model: gradckpt.profile(model, _batch(), repeats=1),
    "estimate": lambda model: gradckpt.estimate(model, _batch(), device="h100"),
}


@pytest.mark.parametrize(("call", "lora"), [
    pytest.param(call, lora, id=f"{call}-{'lora' if lora else 'llama'}",
                 marks=[] if (call, lora) == ("profile", False) else [pytest.mark.slow])
    for call in MEASURING for lora in (False, True)])
def test_an_interrupt_while_measuring_propagates_and_leaves_nothing(
    call: str, lora: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    # With the op-level menu's timing capped in seconds, a loaded machine makes fewer timed runs.
    monkeypatch.setattr(operations, "MENU_TIMING_SECONDS", float("inf"))
    model = _model(lora)
    _planned(model)
    model_before, globals_before = _snapshot(model)
    measure = MEASURING[call]
    calls = _block_calls(model, lambda: measure(model))
    assert calls >= 3
    _same_model(model_before, _model_state(model))
    # Calls of the second layer from the recording step, through the timed and metered steps,
    # to the layer measured on its own (forward, recomputation, backward), the last one.
    for failing in sorted({1, 2, 3, calls // 2, calls - 1, calls}):
        _interrupt_on_call(model, lambda: measure(model), failing)
        _same_model(model_before, _model_state(model), {"config"})
        _same_globals(globals_before)
    _check_everything_came_back(model, lora, model_before, globals_before, interrupted=True)


def _interrupt_on_call(model: torch.nn.Module, run: Callable[[], object], failing: int) -> None:
    """Run ``run`` with a KeyboardInterrupt raised on the second layer's ``failing``-th call,
    which must propagate. The count is not the same in every run: which op-level choices a
    layer's menu offers, each measured with its own calls, follows the operations' measured
    time shares (in full-suite runs the last call counted before never came, 2 runs of 3).
    Where a run ends before that call, the interrupt goes on the last call it made instead."""
    for _ in range(5):
        seen = [0]
        handle = _layers(model)[1].register_forward_pre_hook(
            _raising_on_call({failing}, KeyboardInterrupt(), seen))
        try:
            run()
        except KeyboardInterrupt:
            return
        finally:
            handle.remove()
        assert 0 < seen[0] < failing, "the run made the call and no interrupt came out"
        failing = seen[0]
    pytest.fail(f"no run reached the second layer's call {failing}")


def test_an_error_in_the_loss_on_fake_tensors_does_not_kill_the_process() -> None:
    # Run apart: an exception escaping estimate's timing dispatch mode was said to abort it.
    script = textwrap.dedent("""
        import torch, gradckpt
        from hf_models import tiny_llama

        def loss_fn(output):
            raise RuntimeError("the loss failed")

        model = tiny_llama(2, vocab_size=64)
        ids = torch.randint(0, 64, (2, 16))
        for kind in (RuntimeError, KeyboardInterrupt):
            try:
                gradckpt.estimate(model, {"input_ids": ids, "labels": ids}, device="h100",
                                  loss_fn=loss_fn if kind is RuntimeError else
                                  lambda output: (_ for _ in ()).throw(KeyboardInterrupt()))
            except gradckpt.GradckptError as error:
                assert kind is RuntimeError and "the loss failed" in str(error.__cause__), error
            except KeyboardInterrupt:
                assert kind is KeyboardInterrupt
            assert torch._C._len_torch_dispatch_stack() == 0
        print("survived")
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120, cwd=Path(__file__).parent,
                          env={"OMP_NUM_THREADS": "1", "PATH": ""})
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("survived")


@pytest.mark.parametrize("lora", [False, True], ids=["llama", "lora"])
def test_an_error_in_the_loss_on_fake_tensors_leaves_nothing(lora: bool) -> None:
    model = _model(lora)
    _planned(model)
    model_before, globals_before = _snapshot(model)

    def loss_fn(output: object) -> torch.Tensor:
        raise Injected("the loss failed")

    with pytest.raises(gradckpt.GradckptError) as raised:
        gradckpt.estimate(model, _batch(), device="h100", loss_fn=loss_fn)
    assert isinstance(raised.value.__cause__, Injected)
    _check_everything_came_back(model, lora, model_before, globals_before)


# ---- 6: two threads -------------------------------------------------------------------------


def _llama_without_dropout() -> torch.nn.Module:
    # Dropout draws from the process's one CPU generator, which two threads share: their masks
    # would depend on how the threads interleave. Everything else must not.
    torch.manual_seed(0)
    return hf_families.hf_model("llama", num_hidden_layers=3, vocab_size=VOCAB,
                                max_position_embeddings=64, attention_dropout=0.0).train()


def _measured_bytes(model: torch.nn.Module) -> list:
    """What ``profile`` measures of memory (exact, so equal twice; times are not)."""
    measured = gradckpt.profile(model, _batch(), repeats=1)
    return [measured.peak_bytes, measured.fixed_bytes, *(
        (block.input_bytes, block.saved_bytes, block.forward_peak_bytes,
         block.backward_peak_bytes, block.checkpointed_forward_peak_bytes,
         block.checkpointed_backward_peak_bytes) for block in measured.blocks)]


def test_two_models_planned_and_trained_in_two_threads_do_not_see_each_other() -> None:
    resize = torch.UntypedStorage.resize_  # the memory meter counts resizes while it runs
    models = [_llama_without_dropout(), with_lora(_llama_without_dropout())]
    alone = [_measured_bytes(model) for model in models]
    plain = [_train(_llama_without_dropout(), steps=3),
             _train(with_lora(_llama_without_dropout()), steps=3)]
    barrier = threading.Barrier(2)
    results: dict[int, object] = {}

    def work(index: int) -> None:
        model = models[index]
        try:
            barrier.wait()
            measured = _measured_bytes(model)
            barrier.wait()
            _planned(model)
            barrier.wait()
            gradients = _train(model, steps=3)
            local = _installed[model].handle.local  # this thread's
            results[index] = (measured, gradients, [(f.replaying, f.runs) for f in local.frames],
                              local.entered)
        except BaseException as error:  # told by the main thread
            results[index] = error
            barrier.abort()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    failed = {i: r for i, r in results.items() if isinstance(r, BaseException)}
    assert not failed, {i: "".join(traceback.format_exception(e)) for i, e in failed.items()}
    for index in range(2):
        measured, gradients, frames, entered = results[index]
        assert measured == alone[index]  # the other thread's step counted nowhere
        assert _same_gradients(gradients, plain[index])
        assert frames == [(None, {})] and entered == []  # each thread's segments closed
    assert torch.UntypedStorage.resize_ is resize
