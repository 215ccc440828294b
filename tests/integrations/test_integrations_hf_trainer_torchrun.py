"""The Hugging Face Trainer with ``GradckptCallback`` under ``torchrun``: two gloo processes on
CPU (``trainer_torchrun_script.py``), 2 rows per process, against one process of 4 rows.

Checked on every rank: one plan (rank 0 solves, every rank applies it), the losses of the
single-process run without the callback, and the measured peak of a rank's steps against the
prediction and the budget. The ranks see the single process's batches split in two
(Accelerate hands the sampler's batches of 2 to the ranks in turn, the same shuffle on each),
and DDP averages the gradients, each rank's loss weighted by the tokens of the whole step;
only the order of the sums differs, so the losses agree to float rounding: up to 1.7e-7
relative when written.

DDP holds one more copy of the trainable gradients (its buckets), alive all run; the callback
sees that the Trainer wraps the model in DDP and counts them (``enable(..., ddp=True)``), so a
rank's measured peak is the predicted one (uncounted, full fine-tuning measured 19% above the
budget). The Trainer's FSDP settings on CPU run DDP: Accelerate (1.16, ``AcceleratorState``)
turns to FSDP only from a multi-GPU (or other accelerator) state, and drops the plugin on
``MULTI_CPU``. The run is then the DDP run above, and the callback counts DDP's buckets there
too.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("peft")

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]

SCRIPT = Path(__file__).with_name("trainer_torchrun_script.py")
WORLD = 2


def run_on_two_ranks(tmp_path: Path, parallel: str, model: str) -> list[dict]:
    """Each rank's answer; a hang fails after 300 s instead of stalling CI."""
    environment = dict(os.environ, OMP_NUM_THREADS="1")
    result = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
         str(WORLD), str(SCRIPT), parallel, model, str(tmp_path)],
        capture_output=True, text=True, timeout=300, env=environment,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    return [json.loads((tmp_path / f"rank{rank}.json").read_text()) for rank in range(WORLD)]


@functools.cache
def one_process(out_dir: Path, with_lora: bool) -> list[float]:
    """The losses of one process without the callback, the two ranks' rows in each batch."""
    sys.path.insert(0, str(SCRIPT.parent))
    try:
        from trainer_torchrun_script import train
    finally:
        sys.path.remove(str(SCRIPT.parent))
    return train(out_dir / f"one-process-{with_lora}", "single", batch_size=2 * WORLD,
                 with_callback=False, with_lora=with_lora)["losses"]


@pytest.fixture(scope="module")
def tmp_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("trainer_torchrun")


def assert_one_plan_and_the_losses_of_one_process(ranks: list[dict], expected: list[float]) -> None:
    assert ranks[0]["segments"], "the plan recomputes something"
    for rank in ranks:
        assert rank["segments"] == ranks[0]["segments"]
        for field in ("budget_bytes", "predicted_peak_bytes"):  # rank 0's plan, as it is
            assert rank[field] == ranks[0][field], field
        assert rank["losses"] == pytest.approx(expected, rel=1e-6, abs=0)


def assert_ddp_peaks(ranks: list[dict]) -> None:
    for rank in ranks:
        print({key: value for key, value in rank.items() if key.endswith("bytes")})
        assert rank["wrapped_in"] == "DistributedDataParallel"
        # The plan counts DDP's buckets: the trainable parameters' bytes.
        assert rank["ddp_bucket_bytes"] == rank["trainable_bytes"], rank
        assert rank["predicted_peak_bytes"] <= rank["budget_bytes"]
        assert rank["peak_bytes"] <= rank["budget_bytes"] * 1.03, rank
        predicted = rank["predicted_peak_bytes"]
        assert abs(rank["peak_bytes"] - predicted) <= 0.01 * predicted, rank


@pytest.mark.parametrize("model", ["lora", "full"])
def test_ddp_one_plan_the_losses_of_one_process(tmp_path: Path, tmp_root: Path, model: str) -> None:
    ranks = run_on_two_ranks(tmp_path, "ddp", model)
    with_lora = model == "lora"
    assert_one_plan_and_the_losses_of_one_process(ranks, one_process(tmp_root, with_lora))
    assert_ddp_peaks(ranks)


def test_the_trainers_fsdp_settings_on_cpu_run_ddp_with_one_plan(
    tmp_path: Path, tmp_root: Path
) -> None:
    ranks = run_on_two_ranks(tmp_path, "fsdp", "full")
    assert [rank["distributed_type"] for rank in ranks] == ["MULTI_CPU"] * WORLD
    assert_one_plan_and_the_losses_of_one_process(ranks, one_process(tmp_root, False))
    assert_ddp_peaks(ranks)
