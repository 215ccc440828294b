"""``gradckpt.estimate(..., world_size=2)`` against FSDP2 run for real: two CPU processes (gloo),
``fully_shard`` on each decoder layer of a small Llama and then on the root, AdamW.

Which instant counts: the peak of the loop's second step (``out = model(**batch);
out.loss.backward(); opt.step(); opt.zero_grad()``), so that the optimizer state exists, with
gradients None when it starts and the first step's ``out`` alive until the forward returns. That
is the step ``gradckpt.profile`` and ``estimate(optimizer="adamw")`` plan. The optimizer step's
own peak is lower in every case here (checked).
Memory is ``MemoryMeter("cpu", ...)``: MemTracker's total, which follows FSDP2's DTensor shards
and the storages it resizes to gather and free parameters. A rank's peak is the larger of the two
ranks' (they agree to the byte here).

gloo's ``reduce_scatter_tensor`` reduces a copy of its whole input, a transient as large as the
gradients it scatters that NCCL does not make on a GPU. The ranks reduce-scatter with
``_InPlaceReduceScatter`` instead (FSDP2's ``set_custom_reduce_scatter``): the same sums, no copy,
so that what is measured is what FSDP2 itself holds. Where the peak is a block's backward
("llama", "lora", "llama-every-layer") it is the same either way (measured); in "wide-vocab"
gloo's copy of the root's gradients makes the peak (24,258,980 bytes instead of 20,724,900).

A gloo collective returns once its work is done, but gloo's worker thread lets go of the work,
and of the tensors it holds, only after that, when it next gets a core and the GIL: until then a
buffer FSDP2 has dropped stays alive. On a busy machine that came late now and then: a log of
the meter's frees showed gloo's thread freeing a layer's reduce-scatter input (656,384 bytes)
after the next layer's all-gather had allocated its output, and "llama" measured 263,168 bytes
above the prediction; a layer's all-gather output (672,768 bytes) alive past the next one's
allocation adds exactly what "lora" once measured above it (279,584 bytes). The ranks'
collectives (``_InPlaceReduceScatter``, ``_AllGather``) therefore return only once gloo holds
none of their tensors, so that each buffer dies where FSDP2 drops it, as the prediction has it.

``python -m pytest -q tests/predict/test_predict_per_rank.py -s`` prints the figures
docs/estimate.md quotes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os
import queue
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from gloo_ranks import free_port
from torch import nn

import gradckpt
from gradckpt.measure.meter import MemoryMeter
from gradckpt.measure.tensors import tensors_in

# one_thread: the ranks run one thread each, and so does this process for its tiny models
pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

WORLD_SIZE = 2
TIMEOUT_SECONDS = 150  # both ranks, all cases: about 20 s on 2 CPU cores
# The estimate is exact to the byte for these models but for AdamW's step counters (a 4-byte
# tensor per trainable parameter, which estimate does not count: 156 bytes here), and the cost
# model bounds a block's backward from the block measured on its own, which can come out up to
# about one hidden state above what the step reaches (+0.4% measured on 4 ranks at batch 2 x 32).
# Under by more than 0.1%, or over by more than 1%, is a fault of the model of FSDP2 (the model
# before this test was +3.2% on "llama", -24% on "wide-vocab" and -1.5% on "lora").
UNDER, OVER = 0.001, 0.01


@dataclasses.dataclass(frozen=True)
class Case:
    """A model and one rank's batch; where its per-rank peak falls is in the comment."""

    name: str
    vocab_size: int = 512
    batch: int = 2
    sequence: int = 64
    lora: bool = False
    strategy: str = "none"  # the plan gradckpt.solve makes from the estimate, applied


CASES = [
    Case("llama"),  # the last layer's backward: gathered parameters and prefetched buffers
    Case("wide-vocab", vocab_size=4096, batch=1, sequence=8),  # the embedding's backward
    Case("lora", lora=True),  # a frozen base: the gathers are the same, gradients few
    # Each layer checkpointed alone: FSDP2's hooks run again when a layer is recomputed.
    Case("llama-every-layer", strategy="every-layer"),
]


class _LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (LoRA)."""

    def __init__(self, base: nn.Linear, rank: int = 8) -> None:
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.randn(rank, base.in_features) * 0.01)
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, rank))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + (x @ self.lora_a.t()) @ self.lora_b.t()


def build(case: Case) -> nn.Module:
    """The case's model, the same on every rank (one seed); on the meta device under
    ``torch.device("meta")``."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        num_hidden_layers=4, hidden_size=128, intermediate_size=256, num_attention_heads=4,
        num_key_value_heads=4, vocab_size=case.vocab_size, max_position_embeddings=128,
        # Without this the step keeps every layer's keys and values until backward ends (a
        # cache nobody reads in training); estimate measures with caches off, as gradckpt's
        # adapters run models.
        use_cache=False,
    )
    model = LlamaForCausalLM(config)
    if case.lora:
        model.requires_grad_(False)
        for layer in model.model.layers:
            attention = layer.self_attn
            attention.q_proj = _LoRALinear(attention.q_proj)
            attention.v_proj = _LoRALinear(attention.v_proj)
    return model


def batch(case: Case, device: str = "cpu") -> dict[str, torch.Tensor]:
    """One rank's batch: token ids, and the same as labels."""
    ids = torch.randint(0, case.vocab_size, (case.batch, case.sequence),
                        generator=torch.Generator().manual_seed(1))
    return {"input_ids": ids.to(device), "labels": ids.clone().to(device)}


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def measured_step(model: nn.Module, optimizer: torch.optim.Optimizer,
                  sample: dict[str, torch.Tensor]) -> dict[str, int]:
    """The peaks of the loop's second step, ``out = model(**batch); out.loss.backward();
    optimizer.step(); optimizer.zero_grad()``, with the optimizer's state alive and the first
    step's ``out`` until the second's forward returns (the loop rebinds it only then): the
    whole step's, its forward and backward's, and ``optimizer.step()``'s alone."""
    held: dict[str, Any] = {}

    def forward_backward() -> None:
        held["out"] = model(**sample)
        held["out"].loss.backward()

    forward_backward()  # the first step: the optimizer state exists from its end on
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    tracked = [model, optimizer, *sample.values(), *tensors_in(held["out"])]
    # No garbage collection during the measured step: a tensor kept only by a reference cycle
    # then counts in every run, not only in runs where the collector happens not to run before
    # the peak. (The meter's own cycle, fixed in 10a7531, kept the first step's output, logits
    # and loss, alive past the forward in about half the runs: +262,148 B, 2.1%, on "llama".)
    gc.collect()
    collecting = gc.isenabled()
    gc.disable()
    try:
        with MemoryMeter("cpu", *tracked) as meter:
            tracked.clear()  # only the loop may keep the first step's output alive
            forward_backward()
            forward_backward_peak = meter.peak()
            meter.reset_peak()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            optimizer_step_peak = meter.peak()
    finally:
        if collecting:
            gc.enable()
    return {"peak": max(forward_backward_peak, optimizer_step_peak),
            "forward_backward_peak": forward_backward_peak,
            "optimizer_step_peak": optimizer_step_peak}


class _InPlaceReduceScatter:
    """FSDP2's reduce-scatter as an in-place all-reduce of its input (a buffer FSDP2 allocates
    for it and drops after) and a copy of this rank's chunk: no transient copy of the input, as
    on NCCL (see the module docstring). Duck-types FSDP2's ``ReduceScatter`` (private)."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 op: Any, async_op: bool = False) -> None:
        import torch.distributed as dist

        average = op == dist.ReduceOp.AVG  # gloo sums only
        with _let_go_by_gloo(input_tensor):
            dist.all_reduce(input_tensor.view(input_tensor.shape),
                            op=dist.ReduceOp.SUM if average else op, group=group)
        if average:
            input_tensor.div_(group.size())
        output_tensor.copy_(input_tensor.chunk(group.size())[group.rank()])


class _AllGather:
    """FSDP2's all-gather (``all_gather_single``, as its default does), returning once gloo
    holds none of its output: the buffer dies where FSDP2 drops it, after copying the
    parameters out. Duck-types FSDP2's ``AllGather`` (private)."""

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: Any,
                 async_op: bool = False) -> None:
        import torch.distributed as dist

        assert not async_op, "the ranks all-gather synchronously (FSDP2's default)"
        # FSDP2 gathers in place: its input is a part of the output's storage.
        with _let_go_by_gloo(output_tensor, input_tensor):
            dist.all_gather_single(output_tensor.view(output_tensor.shape),
                                   input_tensor.view(input_tensor.shape), group=group)


@contextlib.contextmanager
def _let_go_by_gloo(*tensors: torch.Tensor) -> Iterator[None]:
    """Returns once the storages of ``tensors`` have no more references than on entry.

    gloo's worker thread holds a collective's tensors (in its work, and views it makes) until
    after the rank's wait has returned, and drops them when it next gets a core and the GIL.
    Passed new views, the collective holds storage references of its own, and the rank waits
    here until they are gone (see the module docstring)."""
    storages = {tensor.untyped_storage()._cdata: tensor.untyped_storage() for tensor in tensors}
    references = {cdata: torch._C._storage_Use_Count(cdata) for cdata in storages}
    yield
    deadline = time.monotonic() + TIMEOUT_SECONDS
    while any(torch._C._storage_Use_Count(cdata) > count for cdata, count in references.items()):
        if time.monotonic() > deadline:
            raise RuntimeError("gloo still holds a finished collective's tensors")
        time.sleep(0.0001)  # lets the worker thread have the GIL


def _rank(rank: int, port: int, plans: dict[str, Any], results: Any) -> None:
    """One rank: every case sharded with FSDP2 (and checkpointed as its plan says), measured;
    its peaks go to ``results``."""
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)  # two ranks on two cores
    dist.init_process_group("gloo", rank=rank, world_size=WORLD_SIZE)
    try:
        peaks = {}
        for case in CASES:
            model = build(case)
            for layer in model.model.layers:
                fully_shard(layer)
            fully_shard(model)
            for module in (*model.model.layers, model):
                module.set_custom_all_gather(_AllGather())
                module.set_custom_reduce_scatter(_InPlaceReduceScatter())
            if plans[case.name].segments:
                gradckpt.apply(model, plans[case.name])
            optimizer = torch.optim.AdamW(trainable(model), lr=1e-3)
            peaks[case.name] = measured_step(model, optimizer, batch(case))
        results.put((rank, peaks))
    except BaseException as error:  # the parent reports it rather than waiting
        results.put((rank, repr(error)))
        raise
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def sharded() -> dict[str, tuple[int, dict[str, int]]]:
    """Per case, the predicted per-rank peak of its plan and a rank's measured peaks (the
    larger of the two ranks')."""
    pytest.importorskip("transformers")
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not (dist.is_available() and dist.is_gloo_available()):
        pytest.skip("needs torch.distributed with gloo")
    plans = {case.name: predicted_plan(case, WORLD_SIZE) for case in CASES}
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    ranks = [context.Process(target=_rank, args=(rank, port, plans, results), daemon=True)
             for rank in range(WORLD_SIZE)]
    for process in ranks:
        process.start()
    try:
        by_rank = _collect(results, ranks)
    finally:
        for process in ranks:
            process.join(timeout=10)
            if process.is_alive():  # a hung collective: never stall the suite
                process.kill()
                process.join()
    return {case.name: (plans[case.name].predicted_peak_bytes, {
        key: max(peaks[case.name][key] for peaks in by_rank.values())
        for key in ("peak", "forward_backward_peak", "optimizer_step_peak")}) for case in CASES}


def _collect(results: Any, ranks: list[Any]) -> dict[int, dict[str, dict[str, int]]]:
    """Every rank's answer, failing as soon as one fails or dies, or at the deadline."""
    deadline = time.monotonic() + TIMEOUT_SECONDS
    by_rank: dict[int, Any] = {}
    while len(by_rank) < len(ranks):
        try:
            rank, answer = results.get(timeout=1)
        except queue.Empty:
            dead = [p.exitcode for p in ranks if p.exitcode not in (None, 0)]
            if dead:
                pytest.fail(f"a rank died (exit codes {dead}) before reporting")
            if time.monotonic() > deadline:
                pytest.fail(f"the ranks did not finish within {TIMEOUT_SECONDS} s")
            continue
        if isinstance(answer, str):
            pytest.fail(f"rank {rank} failed: {answer}")
        by_rank[rank] = answer
    return by_rank


def predicted_plan(case: Case, world_size: int) -> Any:
    """The case's plan, solved from ``gradckpt.estimate`` for one rank's batch with the model on
    the meta device; its ``predicted_peak_bytes`` is the estimate's peak for ``"none"``."""
    model_and_batch = dataclasses.replace(case, name="", strategy="none")
    return gradckpt.solve(_estimate(model_and_batch, world_size), None, case.strategy)


@functools.cache
def _estimate(case: Case, world_size: int) -> gradckpt.Profile:
    """Cached: cases that differ only in the strategy solved ("llama", "llama-every-layer")
    estimate the same model and batch (solving is pure; the profile is not changed)."""
    with torch.device("meta"):
        model = build(case)
    return gradckpt.estimate(model, batch(case, "meta"), device="this", optimizer="adamw",
                             world_size=world_size)


def _check(predicted: int, measured: int, what: str) -> None:
    error = (predicted - measured) / measured
    print(f"{what}: measured {measured} ({measured / 2**20:.2f} MiB), predicted {predicted} "
          f"({predicted / 2**20:.2f} MiB), {error:+.3%}")
    assert -UNDER <= error <= OVER, f"{what}: predicted {predicted}, measured {measured}"


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_a_ranks_predicted_peak_is_fsdp2s(case: Case, sharded: dict) -> None:
    predicted, measured = sharded[case.name]
    _check(predicted, measured["peak"], f"{case.name}, 1 of 2 ranks")
    # forward and backward make the peak here; optimizer.step() comes below it
    assert measured["optimizer_step_peak"] < measured["forward_backward_peak"]


@pytest.mark.parametrize("case", CASES, ids=lambda case: case.name)
def test_the_unsharded_peak_is_one_process(case: Case) -> None:
    pytest.importorskip("transformers")
    plan = predicted_plan(case, 1)
    model = build(case)
    if plan.segments:
        gradckpt.apply(model, plan)
    measured = measured_step(model, torch.optim.AdamW(trainable(model), lr=1e-3), batch(case))
    _check(plan.predicted_peak_bytes, measured["peak"], f"{case.name}, 1 process")
