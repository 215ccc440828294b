"""DDP with a plan applied: two gloo processes on CPU.

The plan is applied to the bare model (``gradckpt.enable``, one plan for both ranks), then the
model is wrapped in ``DistributedDataParallel``. Each rank trains on its own half of the batch;
the reference is one process without checkpointing computing the same average gradient. Cases:
with and without ``find_unused_parameters``, ``static_graph=True``, and gradient accumulation
with ``no_sync()`` over two micro-batches. A recomputation that marked a parameter ready twice
would fail DDP with "Expected to mark a variable ready only once"; a wrong recomputation would
change the gradients.

The budget: ``enable(..., ddp=True)`` counts DDP's buckets (a copy of the trainable gradients,
alive all run), so a rank's measured peak (``MemoryMeter``, the loop's second step, as
``tests/predict/test_predict_per_rank.py`` measures it) is the predicted one, within the budget.
"""

from __future__ import annotations

import gc

import pytest
import torch
import torch.distributed as dist
from gloo_ranks import WORLD, answer, join_group, run_ranks
from torch.nn.parallel import DistributedDataParallel

import gradckpt
from gradckpt.measure.meter import MemoryMeter
from gradckpt.measure.tensors import tensors_in

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.slow

CASES = {
    "plain": {},
    "find_unused_parameters": {"find_unused_parameters": True},
    "static_graph": {"static_graph": True},
}


def tiny_llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        num_hidden_layers=4, hidden_size=64, intermediate_size=128, num_attention_heads=4,
        num_key_value_heads=2, vocab_size=256, max_position_embeddings=128,
        attention_dropout=0.1)  # dropout: the recomputation must replay each rank's RNG
    return transformers.LlamaForCausalLM(config)


def micro_batches(rank: int, count: int) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(100 + rank)
    batches = []
    for _ in range(count):
        ids = torch.randint(0, 256, (2, 32), generator=generator)
        batches.append({"input_ids": ids, "labels": ids})
    return batches


def local_gradients(model: torch.nn.Module, batches: list[dict], seed: int) -> dict:
    """One rank's gradients for its micro-batches, without DDP and without a plan."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    for batch in batches:
        out = model(**batch)
        out.loss.backward()
    return {name: p.grad.clone() for name, p in model.named_parameters()}


def worker(rank: int, port: int, out: str, case: str, accumulate: bool) -> None:
    join_group(rank, port)
    count = 2 if accumulate else 1
    mine = micro_batches(rank, count)
    # The reference: each rank's plain gradients (same seed, so the same dropout masks as
    # the planned run below), averaged over ranks as DDP averages them.
    reference = local_gradients(tiny_llama(), mine, seed=rank)
    for gradient in reference.values():
        dist.all_reduce(gradient)
        gradient /= WORLD
    model = tiny_llama()
    plan = gradckpt.enable(model, mine[0], budget="70%")
    ddp = DistributedDataParallel(model, **CASES[case])
    torch.manual_seed(rank)
    for index, batch in enumerate(mine):
        last = index == len(mine) - 1
        with ddp.no_sync() if not last else _nothing():
            output = ddp(**batch)
            output.loss.backward()
    worst = max((p.grad - reference[name]).abs().max().item()
                for name, p in model.named_parameters())
    result = {"worst": worst, "recomputed": len(plan.segments)}
    answer(out, rank, result)


def measured_peak(ddp: DistributedDataParallel, optimizer: torch.optim.Optimizer,
                  batch: dict[str, torch.Tensor]) -> int:
    """The peak of the loop's second step, ``out = ddp(**batch); out.loss.backward();
    optimizer.step(); optimizer.zero_grad()``: the optimizer's state alive, the first step's
    ``out`` until the second's forward returns. DDP's buckets, made before the meter starts,
    count from backward's first copy into them (a GPU's allocator counts them all along)."""
    held = {}

    def step() -> None:
        held["out"] = ddp(**batch)
        held["out"].loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    tracked = [ddp.module, optimizer, *batch.values(), *tensors_in(held["out"])]
    gc.collect()
    gc.disable()  # a tensor kept by a reference cycle would count in some runs only
    try:
        with MemoryMeter("cpu", *tracked) as meter:
            tracked.clear()  # only the loop keeps the first step's output
            step()
    finally:
        gc.enable()
    return meter.peak()


def peak_worker(rank: int, port: int, out: str, bucket_view: bool) -> None:
    join_group(rank, port)
    model = tiny_llama()
    batch = micro_batches(rank, 1)[0]
    plan = gradckpt.enable(model, batch, budget="85%", optimizer="adamw", ddp=True)
    ddp = DistributedDataParallel(model, gradient_as_bucket_view=bucket_view)
    answer_peak(out, rank, plan, ddp, batch, trainable_bytes=sum(
        p.numel() * p.element_size() for p in model.parameters()))


def wrapped_peak_worker(rank: int, port: int, out: str, ddp_flag: bool | None) -> None:
    """``enable`` on a model already wrapped in DDP, with ``ddp=True`` or left unset."""
    join_group(rank, port)
    model = tiny_llama()
    batch = micro_batches(rank, 1)[0]
    ddp = DistributedDataParallel(model)
    flag = {} if ddp_flag is None else {"ddp": ddp_flag}
    plan = gradckpt.enable(ddp, batch, budget="85%", optimizer="adamw", **flag)
    answer_peak(out, rank, plan, ddp, batch)


def answer_peak(out: str, rank: int, plan: gradckpt.Plan, ddp: DistributedDataParallel,
                batch: dict[str, torch.Tensor], **extra: int) -> None:
    """The rank's measured peak of the AdamW loop (``measured_peak``) beside its plan's."""
    optimizer = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    torch.manual_seed(rank)
    answer(out, rank, {
        "peak_bytes": measured_peak(ddp, optimizer, batch),
        "predicted_peak_bytes": plan.predicted_peak_bytes, "budget_bytes": plan.budget_bytes,
        "recomputed": len(plan.segments), **extra,
    })


class _nothing:
    def __enter__(self) -> None:
        pass

    def __exit__(self, *exc: object) -> None:
        pass





@pytest.mark.parametrize("case", CASES)
def test_ddp_with_a_plan_gives_the_gradients_of_one_plain_process(tmp_path, case) -> None:
    for result in run_ranks(worker, tmp_path, case, False):
        assert result["recomputed"] > 0
        assert result["worst"] < 1e-5, result


def test_gradient_accumulation_under_no_sync(tmp_path) -> None:
    for result in run_ranks(worker, tmp_path, "plain", True):
        assert result["recomputed"] > 0
        assert result["worst"] < 1e-5, result


@pytest.mark.parametrize("bucket_view", [False, True], ids=["buckets", "gradient_as_bucket_view"])
def test_a_ranks_peak_under_ddp_is_the_predicted_one_within_the_budget(
    tmp_path, bucket_view: bool
) -> None:
    """With gradient_as_bucket_view=True the buckets are alive all run as well, and backward
    still makes each gradient (from None) before DDP copies it in: the same peak."""
    for result in run_ranks(peak_worker, tmp_path, bucket_view):
        print(result)
        assert result["recomputed"] > 0
        assert result["predicted_peak_bytes"] <= result["budget_bytes"]
        assert result["peak_bytes"] <= result["budget_bytes"] * 1.03, result
        # The buckets are a fifth of this step: uncounted, the peak would be that much above.
        assert abs(result["peak_bytes"] - result["predicted_peak_bytes"]) <= (
            0.02 * result["predicted_peak_bytes"]), result


@pytest.mark.parametrize("ddp_flag", [None, True], ids=["ddp-unset", "ddp-true"])
def test_enable_on_a_model_already_wrapped_in_ddp_counts_its_buckets_once(
    tmp_path, ddp_flag: bool | None
) -> None:
    """Wrapped first, then enabled: the buckets exist and the step measured through the
    wrapper counts them; ``ddp=True`` must not count them a second time."""
    for result in run_ranks(wrapped_peak_worker, tmp_path, ddp_flag):
        print(result)
        assert result["recomputed"] > 0
        assert result["peak_bytes"] <= result["budget_bytes"] * 1.03, result
        assert abs(result["peak_bytes"] - result["predicted_peak_bytes"]) <= (
            0.02 * result["predicted_peak_bytes"]), result
