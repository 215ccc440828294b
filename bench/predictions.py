"""Are plans right on the models people fine-tune? Predicted against measured peaks, per family.

The question (issue 13, item 3): on GPT-2, Llama, Qwen2, BERT (masked LM), T5 and ViT built
from configs and called with their labels, a CNN with BatchNorm, and frozen bases with adapters
(hand-written LoRA and PEFT), does the plan ``gradckpt`` makes for 70% and 45% of the plain peak
(or the smallest feasible budget, when 45% is below it) fit, as the step users write measures
it? The step is a loop's second step (``out = model(**batch); out.loss.backward()``): the
model's output alive through backward, and the first step's until the second's forward
returns, as ``profile`` assumes by default (no optimizer here: ``tests/test_training_loop.py``
measures loops with one).

For each model and budget it prints the budget, the predicted and the measured peak (the memory
meter: MemTracker's "Total" on CPU), measured against budget and against prediction, and
whether the gradients equal the plain model's bit for bit. The closing verdict line asks for
every measured peak within budget + 3%, every plan's prediction within 3% of the measured peak,
the plain step never under-predicted (the budgets are shares of it), and identical gradients.

    .venv/bin/python bench/predictions.py            # about 2 minutes on a 2-core CPU
    .venv/bin/python bench/predictions.py --only llama,t5

Memory is exact to the byte on CPU, so nothing else running matters here (no time is measured).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

import gradckpt
from gradckpt.measure import MemoryMeter, infer_device
from gradckpt.measure.step import loss_of, run_model
from gradckpt.measure.tensors import tensors_in

SHARES = (0.7, 0.45)
ALLOWANCE = 0.03


@dataclass
class Case:
    name: str
    build: Callable[[], nn.Module]
    sample: Callable[[], Any]
    loss_fn: Callable[[Any], torch.Tensor] | None = None


def _ids(vocab: int, shape: tuple[int, int], seed: int = 1) -> torch.Tensor:
    return torch.randint(3, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _transformers() -> Any:
    import transformers

    return transformers


def gpt2() -> nn.Module:
    t = _transformers()
    config = t.GPT2Config(vocab_size=1000, n_embd=64, n_layer=4, n_head=4, n_positions=128,
                          bos_token_id=0, eos_token_id=0)
    return t.GPT2LMHeadModel(config)


# Llama and Qwen2 share their architecture's sizes here.
DECODER_SIZES = dict(
    vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
)


def llama() -> nn.Module:
    t = _transformers()
    return t.LlamaForCausalLM(t.LlamaConfig(**DECODER_SIZES, attention_dropout=0.1))


def qwen2() -> nn.Module:
    t = _transformers()
    return t.Qwen2ForCausalLM(t.Qwen2Config(**DECODER_SIZES))


def causal_sample() -> dict:
    ids = _ids(1000, (2, 128))
    return {"input_ids": ids, "labels": ids}


def bert() -> nn.Module:
    t = _transformers()
    return t.BertForMaskedLM(t.BertConfig(
        vocab_size=1000, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        intermediate_size=128, max_position_embeddings=128))


def masked_sample() -> dict:
    ids = _ids(1000, (2, 128))
    labels = torch.full_like(ids, -100)
    labels[:, ::7] = ids[:, ::7]  # one token in seven is predicted, as masked LM recipes do
    return {"input_ids": ids, "labels": labels}


def t5() -> nn.Module:
    t = _transformers()
    return t.T5ForConditionalGeneration(t.T5Config(
        vocab_size=1000, d_model=64, num_layers=3, num_decoder_layers=3, num_heads=4, d_kv=16,
        d_ff=128, decoder_start_token_id=0))


def seq2seq_sample() -> dict:
    return {"input_ids": _ids(1000, (2, 96)), "labels": _ids(1000, (2, 48), seed=2)}


def vit() -> nn.Module:
    t = _transformers()
    return t.ViTForImageClassification(t.ViTConfig(
        hidden_size=64, num_hidden_layers=4, num_attention_heads=4, intermediate_size=128,
        image_size=64, patch_size=8, num_labels=10))


def image_sample() -> dict:
    generator = torch.Generator().manual_seed(1)
    return {"pixel_values": torch.randn(4, 3, 64, 64, generator=generator),
            "labels": torch.randint(0, 10, (4,), generator=generator)}


def cnn() -> nn.Module:
    def stage(channels_in: int, channels_out: int) -> nn.Module:
        return nn.Sequential(nn.Conv2d(channels_in, channels_out, 3, padding=1),
                             nn.BatchNorm2d(channels_out), nn.ReLU())

    return nn.Sequential(stage(3, 16), stage(16, 16), stage(16, 16), stage(16, 16),
                         nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 10))


def cnn_sample() -> torch.Tensor:
    return torch.randn(8, 3, 48, 48, generator=torch.Generator().manual_seed(1))


def mean_square(output: torch.Tensor) -> torch.Tensor:
    return output.square().mean()


class LoRABlock(nn.Module):
    """A frozen base MLP with trainable low-rank adapters on both projections."""

    def __init__(self, width: int = 128, rank: int = 8) -> None:
        super().__init__()
        self.up = nn.Linear(width, 4 * width).requires_grad_(False)
        self.down = nn.Linear(4 * width, width).requires_grad_(False)
        self.up_a = nn.Parameter(torch.randn(rank, width) / width)
        self.up_b = nn.Parameter(torch.zeros(4 * width, rank))
        self.down_a = nn.Parameter(torch.randn(rank, 4 * width) / width)
        self.down_b = nn.Parameter(torch.randn(width, rank) / rank)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.up(self.norm(x)) + x @ self.up_a.t() @ self.up_b.t()
        h = F.gelu(h)
        return x + self.down(h) + h @ self.down_a.t() @ self.down_b.t()


def lora_stack() -> nn.Module:
    return nn.Sequential(*(LoRABlock() for _ in range(6)))


def lora_sample() -> torch.Tensor:
    return torch.randn(8, 64, 128, generator=torch.Generator().manual_seed(1))


def peft_llama() -> nn.Module:
    import peft

    config = peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                             lora_dropout=0.1)
    return peft.get_peft_model(llama(), config)


CASES = [
    Case("gpt2", gpt2, causal_sample),
    Case("llama", llama, causal_sample),
    Case("qwen2", qwen2, causal_sample),
    Case("bert", bert, masked_sample),
    Case("t5", t5, seq2seq_sample),
    Case("vit", vit, image_sample),
    Case("cnn", cnn, cnn_sample, mean_square),
    Case("lora", lora_stack, lora_sample, mean_square),
    Case("peft-llama", peft_llama, causal_sample),
]


def _caches_off(model: nn.Module) -> None:
    # As fine-tuning scripts set it, and as gradckpt does while a plan is applied.
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and hasattr(config, "use_cache"):
            config.use_cache = False


def users_step(model: nn.Module, sample: Any, loss_fn: Any) -> tuple[int, list]:
    """The measured peak of a loop's second step, ``out = model(**batch);
    loss_of(out).backward()``: ``out`` held through backward, and the first step's ``out``
    until the second's forward returns (the loop rebinds it only then)."""
    held: dict[str, Any] = {}

    def step() -> None:
        torch.manual_seed(3)  # dropout masks alike
        held["out"] = run_model(model, sample)  # the previous output is let go only now
        loss_of(held["out"], loss_fn).backward()

    step()  # the first step: its output is alive when the measured one starts
    model.zero_grad(set_to_none=True)
    tensors = list(sample.values()) if isinstance(sample, dict) else [sample]
    tracked = [model, *tensors, *tensors_in(held["out"])]
    with MemoryMeter(infer_device(model), *tracked) as meter:
        tracked.clear()  # nothing here may keep the first output alive once the loop drops it
        step()
    return meter.peak(), [p.grad for p in model.parameters()]


def fresh(case: Case) -> nn.Module:
    torch.manual_seed(0)
    model = case.build().train()
    _caches_off(model)
    return model


def run_case(case: Case) -> list[dict]:
    sample = case.sample()
    plain_peak, plain_grads = users_step(fresh(case), sample, case.loss_fn)
    model = fresh(case)
    measured = gradckpt.profile(model, sample, loss_fn=case.loss_fn, repeats=1, progress=False)
    # The plain step's prediction is the cost model's, like every plan's (not the profile's
    # own measured peak, which would hide an error common to all plans).
    plain = gradckpt.solve(measured, None, "none")
    rows = [{"model": case.name, "budget": "plain", "budget_bytes": None,
             "predicted": plain.predicted_peak_bytes, "measured": plain_peak,
             "identical": True}]
    for share in SHARES:
        label = f"{share:.0%}"
        try:
            plan = gradckpt.solve(measured, int(share * measured.peak_bytes))
        except gradckpt.BudgetError as error:
            plan = gradckpt.solve(measured, error.minimum_bytes)
            label += " (least)"
        gradckpt.apply(model, plan)
        peak, grads = users_step(model, sample, case.loss_fn)
        gradckpt.disable(model)
        identical = all((a is None and b is None) or (a is not None and b is not None
                                                      and torch.equal(a, b))
                        for a, b in zip(grads, plain_grads, strict=True))
        rows.append({"model": case.name, "budget": label, "budget_bytes": plan.budget_bytes,
                     "predicted": plan.predicted_peak_bytes, "measured": peak,
                     "identical": identical})
    return rows


def _mib(value: int | None) -> str:
    return "-" if value is None else f"{value / 2**20:.2f}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated case names: " +
                        ", ".join(case.name for case in CASES))
    args = parser.parse_args(argv)
    chosen = CASES if not args.only else [c for c in CASES if c.name in args.only.split(",")]
    print(f"bench/predictions.py: torch {torch.__version__}, cpu, step with the output kept")
    header = (f"{'model':<11} {'budget':<11} {'budget MiB':>10} {'predicted':>10} "
              f"{'measured':>10} {'vs budget':>10} {'vs pred.':>9}  gradients")
    print(header)
    print("-" * len(header))
    worst_budget = worst_prediction = 0.0
    plain_under = False
    all_identical = True
    for case in chosen:
        for row in run_case(case):
            over = (row["measured"] / row["budget_bytes"] - 1) if row["budget_bytes"] else None
            error = (row["predicted"] - row["measured"]) / row["measured"]
            if over is None:
                plain_under |= error < -0.001
            else:
                worst_budget = max(worst_budget, over)
                worst_prediction = max(worst_prediction, abs(error))
            all_identical &= row["identical"]
            print(f"{row['model']:<11} {row['budget']:<11} {_mib(row['budget_bytes']):>10} "
                  f"{_mib(row['predicted']):>10} {_mib(row['measured']):>10} "
                  f"{'-' if over is None else f'{over:+.2%}':>10} {error:>+9.2%}  "
                  f"{'identical' if row['identical'] else 'DIFFERENT'}")
        sys.stdout.flush()
    fits = worst_budget <= ALLOWANCE
    close = worst_prediction <= ALLOWANCE
    print(f"\nverdict: measured over budget at most {worst_budget:+.2%} (limit +3%): "
          f"{'PASS' if fits else 'FAIL'}; plan predictions within {worst_prediction:.2%} of "
          f"the measured peak (limit 3%): {'PASS' if close else 'FAIL'}; plain step never "
          f"under-predicted: {'FAIL' if plain_under else 'PASS'}; gradients identical: "
          f"{'PASS' if all_identical else 'FAIL'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
