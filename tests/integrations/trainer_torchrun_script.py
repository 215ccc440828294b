"""A Hugging Face Trainer run with ``GradckptCallback``, for
``test_integrations_hf_trainer_torchrun.py`` (not collected: no ``test_`` prefix).

``python -m torch.distributed.run --nproc-per-node 2 trainer_torchrun_script.py PARALLEL MODEL
OUT`` trains a tiny Llama on gloo (``PARALLEL``: ``ddp``, or ``fsdp`` for the Trainer's own FSDP
settings; ``MODEL``: ``full`` or ``lora``), and each rank writes ``OUT/rank{N}.json``
(``train``'s answer). The test imports ``train`` for the single-process run it compares with.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for hf_models
from test_integrations_hf_trainer import MeterTheSteps, lora, losses, token_dataset  # noqa: E402

from gradckpt.integrations import hf_families  # noqa: E402
from gradckpt.integrations.hf_trainer import GradckptCallback  # noqa: E402

BUDGET = "90%"
STEPS = 3


def tiny_llama() -> torch.nn.Module:
    """Seeded, the same on every rank; no dropout: ranks draw other masks than one process."""
    torch.manual_seed(0)
    return hf_families.hf_model(
        "llama", num_hidden_layers=4, vocab_size=256, max_position_embeddings=64,
        attention_dropout=0.0).train()


def parallel_arguments(parallel: str) -> dict[str, Any]:
    if parallel == "ddp":
        return {"ddp_backend": "gloo"}
    if parallel == "fsdp":
        return {"ddp_backend": "gloo", "fsdp": "full_shard",
                "fsdp_config": {"transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}}
    return {}  # one process


def train(out_dir: Path, parallel: str, batch_size: int, with_callback: bool,
          with_lora: bool = False) -> dict[str, Any]:
    """``STEPS`` Trainer steps on 16 rows of 32 tokens, ``batch_size`` rows per process: the
    losses logged, and with the callback its plan and the measured peak of the steps."""
    callback, metering = GradckptCallback(budget=BUDGET), MeterTheSteps()
    args = transformers.TrainingArguments(
        output_dir=str(out_dir), per_device_train_batch_size=batch_size, max_steps=STEPS,
        learning_rate=1e-3, logging_steps=1, report_to=[], use_cpu=True, save_strategy="no",
        seed=0, dataloader_num_workers=0, disable_tqdm=True, **parallel_arguments(parallel),
    )
    model = lora(tiny_llama()) if with_lora else tiny_llama()
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=token_dataset(),
        callbacks=[callback, metering] if with_callback else [],
    )
    trainer.train()
    result: dict[str, Any] = {"losses": losses(trainer)}
    if with_callback:
        plan = callback.plan
        result.update(
            segments=[[segment.start, segment.end] for segment in plan.segments],
            budget_bytes=plan.budget_bytes, predicted_peak_bytes=plan.predicted_peak_bytes,
            peak_bytes=metering.meter.peak(),
            trainable_bytes=sum(p.numel() * p.element_size()
                                for p in trainer.model.parameters() if p.requires_grad),
            ddp_bucket_bytes=callback.profile.notes.get("ddp_bucket_bytes", 0),
            distributed_type=trainer.accelerator.distributed_type.value,
            wrapped_in=type(trainer.model_wrapped).__name__,
        )
    return result


if __name__ == "__main__":
    parallel, with_lora, out_dir = sys.argv[1], sys.argv[2] == "lora", Path(sys.argv[3])
    torch.set_num_threads(1)
    answer = train(out_dir, parallel, batch_size=2, with_callback=True, with_lora=with_lora)
    rank = int(os.environ["RANK"])
    (out_dir / f"rank{rank}.json").write_text(json.dumps(answer))
    torch.distributed.barrier()  # gloo aborts a rank whose peer has left
    # Leave without tearing the gloo group down, which can hang (tests/gloo_ranks.py).
    os._exit(0)
