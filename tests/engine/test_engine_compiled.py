"""A model with a plan applied under ``torch.compile`` (issue 16).

While Dynamo traces a planned block, the engine lowers it to a ``torch.utils.checkpoint``
region (``gradckpt.engine.compiled``). Checked: compiled training gives the gradients of the
model without checkpointing (float tolerance: compiled kernels reorder sums), for
``torch.compile(model)`` and ``model.compile()``, for every kind of plan (single blocks,
multi-block and nested segments, an op-level policy), for a frozen base with adapters, and the
memory of a compiled step falls as the plan says (measured in a fresh process: MemTracker
cannot see inside compiled graphs).

Most tests compile with ``backend="aot_eager"``: Dynamo and AOTAutograd (where checkpointed
regions are traced and partitioned) without Inductor's code generation, which only changes the
kernels; one test runs Inductor end to end.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import gradckpt
from gradckpt.plan import Plan, Segment

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: see conftest.one_thread

LAYERS = 4


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def tiny_llama(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(
        num_hidden_layers=LAYERS, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=128)
    return transformers.LlamaForCausalLM(config)


def batch() -> dict[str, torch.Tensor]:
    ids = torch.randint(0, 256, (2, 32), generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids, "labels": ids}


def plan_of(segments: list[Segment]) -> Plan:
    return Plan("test", None, segments, 0, 0.0, 0.0,
                block_names=[f"model.layers.{i}" for i in range(LAYERS)])


def gradients(model: torch.nn.Module, run: torch.nn.Module) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    out = run(**batch())
    out.loss.backward()  # the output alive through backward, as users write it
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


def assert_close(ours: dict, expected: dict) -> None:
    assert ours.keys() == expected.keys()
    for name, value in expected.items():
        torch.testing.assert_close(ours[name], value, rtol=1e-4, atol=1e-5, msg=name)


PLANS = {
    "every layer": [Segment(i, i) for i in range(LAYERS)],
    "multi-block": [Segment(0, 1), Segment(2, 3)],
    "nested": [Segment(0, 3, children=[Segment(1, 2)])],
    "save-matmuls": [Segment(0, 0, policy="save-matmuls"), Segment(2, 3, policy="save-matmuls")],
    "offload-matmuls": [Segment(1, 1, policy="offload-matmuls")],
}


@pytest.mark.parametrize("name", PLANS)
def test_a_compiled_plan_trains_like_the_plain_model(name: str) -> None:
    expected = gradients(reference := tiny_llama(), reference)
    model = tiny_llama()
    gradckpt.apply(model, plan_of(PLANS[name]))
    assert_close(gradients(model, torch.compile(model, backend="aot_eager")), expected)


def test_model_compile_and_inductor_train_like_the_plain_model() -> None:
    expected = gradients(reference := tiny_llama(), reference)
    model = tiny_llama()
    gradckpt.apply(model, plan_of(PLANS["multi-block"]))
    model.compile()  # Inductor, in place
    assert_close(gradients(model, model), expected)
    assert_close(gradients(model, model), expected)  # a second step: no recompilation trouble


def test_a_frozen_base_with_adapters_compiles_with_its_plan() -> None:
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)
    reference = peft.get_peft_model(tiny_llama(), config)
    expected = gradients(reference, reference)
    model = peft.get_peft_model(tiny_llama(), config)
    gradckpt.enable(model, batch(), budget="90%")
    assert_close(gradients(model, torch.compile(model, backend="aot_eager")), expected)


def test_evaluation_under_compile_is_untouched_by_the_plan() -> None:
    model, reference = tiny_llama(), tiny_llama()
    gradckpt.apply(model, plan_of(PLANS["every layer"]))
    compiled = torch.compile(model, backend="aot_eager")
    with torch.no_grad():
        torch.testing.assert_close(compiled(**batch()).logits, reference(**batch()).logits)


def test_disable_gives_the_blocks_their_own_forward_back() -> None:
    model = tiny_llama()
    before = {name: module.__dict__.get("forward") for name, module in model.named_modules()}
    gradckpt.apply(model, plan_of(PLANS["nested"]))
    assert "forward" in model.model.layers[1].__dict__  # lowered for compile while planned
    gradckpt.disable(model)
    after = {name: module.__dict__.get("forward") for name, module in model.named_modules()}
    assert after == before
    expected = gradients(reference := tiny_llama(), reference)
    assert_close(gradients(model, torch.compile(model, backend="aot_eager")), expected)


# Memory: a compiled step's peak as the kernel sees it (VmHWM of a fresh process, freed memory
# returned at once), since MemTracker cannot see inside compiled graphs.
MEASURE = textwrap.dedent("""
    import sys, torch, transformers, gradckpt
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=4, hidden_size=256,
        intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=512, max_position_embeddings=512)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.randint(0, 512, (4, 256))
    batch = {"input_ids": ids, "labels": ids}
    if sys.argv[1] != "plain":
        gradckpt.apply(model, gradckpt.solve(gradckpt.profile(model, batch, repeats=1), None,
                                             sys.argv[1]))
    compiled = torch.compile(model, backend="aot_eager")
    def step():
        out = compiled(**batch)
        out.loss.backward()
        del out
    def status(key):
        return next(int(line.split()[1]) * 1024 for line in open("/proc/self/status")
                    if line.startswith(key))
    step(); step()
    open("/proc/self/clear_refs", "w").write("5")
    start = status("VmRSS")
    step()
    print(status("VmHWM") - start)
""")


def compiled_peak_bytes(*strategies: str) -> list[int]:
    """Each strategy's peak, measured in processes of their own that run at once, on one
    thread each: a process's VmHWM is its own whatever runs beside it (only times would
    suffer), and OpenMP threads of two processes competing for two cores slow both manyfold."""
    environment = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536", "OMP_NUM_THREADS": "1"}
    processes = [subprocess.Popen([sys.executable, "-c", MEASURE, strategy], env=environment,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for strategy in strategies]
    peaks = []
    try:
        for strategy, process in zip(strategies, processes, strict=True):
            stdout, stderr = process.communicate(timeout=300)
            assert process.returncode == 0, f"{strategy}: {stderr[-3000:]}"
            peaks.append(int(stdout.split()[-1]))
    finally:
        for process in processes:
            process.kill()  # no-op for those done; a failure or timeout leaves none behind
    return peaks


@pytest.mark.slow
def test_a_compiled_plan_keeps_its_memory_saving() -> None:
    plain, every_layer = compiled_peak_bytes("plain", "every-layer")
    # 4 layers' activations at 4 x 256 x 256: every layer keeps only block inputs, so well
    # under half of the plain step's peak above its start.
    assert every_layer < 0.6 * plain, (every_layer, plain)
