#!/usr/bin/env bash
# The CUDA checks that CI (no GPU) cannot run, as one script for a session that is lent a GPU
# machine: the engine's CUDA tests (RNG replay on the device, offload through side streams,
# max_memory_allocated lower with offload), planned offload (the host link, a plan offloading
# op outputs: its peak against the prediction, its step time), the budget watch (gradckpt.budget_watch: a step
# over its budget warns, one within does not; measured peaks against the plan's prediction
# with AdamW), then bench/engine.py and bench/frontier.py on the GPU. Everything it prints is
# also written to $OUT (or ./device-check/) so the figures can be copied into docs/.
#
#   bash bench/device_check.sh            # on the GPU machine, from the repository root
#   bash bench/device_check.sh budget     # only the budget watch (about a minute)
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-device-check}
mkdir -p "$out"
python=${PYTHON:-python3}

"$python" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.cuda.get_device_name())' 2>&1 | tee "$out/device.txt" || exit 1
"$python" -m pip install --quiet --no-deps -e . 2>&1 | tail -1
"$python" -m pip install --quiet pytest hypothesis 2>&1 | tail -1

only=${1:-all}
status=0

# The budget watch (issue 22): TinyGPT planned with gradckpt.enable(..., budget=...) and
# trained for a few steps. Within its budget no GradckptWarning; with 4x the sample's batch, or
# with AdamW's state not given to enable, one warning naming the measured peak; with AdamW
# given as enable(..., optimizer=opt), max_memory_allocated of steps 2+ against the prediction.
budget_watch_check() {
"$python" - <<'PY'
import warnings

import torch

import gradckpt
from gradckpt.budget import format_bytes
from gradckpt.budget_watch import watch_budget, watch_of
from gradckpt.errors import GradckptWarning, forget_warnings
from gradckpt.toy_models import GPTConfig, TinyGPT

device = torch.device("cuda")
config = GPTConfig(n_layer=6, n_embd=256, n_head=4, block_size=256, dropout=0.0)
SAMPLE_BATCH = 8
failures = 0


def batch_of(size):
    generator = torch.Generator().manual_seed(size)
    idx = torch.randint(0, config.vocab_size, (size, config.block_size), generator=generator)
    return {"idx": idx.to(device), "targets": idx.to(device)}


def planned(optimizer_kind, give_optimizer, budget="70%"):
    torch.manual_seed(0)
    model = TinyGPT(config).to(device).train()
    optimizer = (torch.optim.AdamW(model.parameters(), lr=1e-4) if optimizer_kind == "adamw"
                 else torch.optim.SGD(model.parameters(), lr=1e-3))  # no momentum: no state
    if give_optimizer:
        plan = gradckpt.enable(model, batch_of(SAMPLE_BATCH), budget=budget,
                               optimizer=optimizer)
    else:
        plan = gradckpt.enable(model, batch_of(SAMPLE_BATCH), budget=budget)
    by_apply = watch_of(model) is not None and watch_of(model).active
    watch = watch_budget(model, plan, steps=4)  # replaces the one apply() installed, if any
    return model, optimizer, plan, watch, by_apply


def train(model, optimizer, batch, steps=5):
    forget_warnings()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(steps):
            loss = model(**batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
    torch.cuda.synchronize()
    return [str(w.message) for w in caught
            if issubclass(w.category, GradckptWarning) and "peaked at" in str(w.message)]


def verdict(name, ok, detail):
    global failures
    failures += not ok
    print(f"{'PASS' if ok else 'FAIL'}: {name}: {detail}")


def describe(plan, watch):
    peaks = ", ".join(format_bytes(p) for p in watch.measured_peaks)
    return (f"budget {format_bytes(plan.budget_bytes)}, predicted "
            f"{format_bytes(plan.predicted_peak_bytes)}, measured per step [{peaks}]")


def planned_sgd():
    try:  # SGD without momentum has no state, but its step is part of the step planned for
        return planned("sgd", give_optimizer=True)
    except TypeError:  # enable() without optimizer= yet
        return planned("sgd", give_optimizer=False)


model, optimizer, plan, watch, by_apply = planned_sgd()
print(f"apply() installed a watch itself: {by_apply}")
print(plan)
warned = train(model, optimizer, batch_of(SAMPLE_BATCH))
verdict("within budget, no warning", not warned and bool(watch.measured_peaks),
        describe(plan, watch) + (f"; warned: {warned[0]}" if warned else ""))
gradckpt.disable(model)
del model, optimizer

model, optimizer, plan, watch, _ = planned_sgd()
warned = train(model, optimizer, batch_of(4 * SAMPLE_BATCH))
verdict("4x the sample's batch, one warning", len(warned) == 1,
        describe(plan, watch) + (f"; warned: {warned[0]}" if warned else "; no warning"))
gradckpt.disable(model)
del model, optimizer

model, optimizer, plan, watch, _ = planned("adamw", give_optimizer=False)
warned = train(model, optimizer, batch_of(SAMPLE_BATCH))
print(f"INFO: AdamW not given to enable: {len(warned)} warning(s); " + describe(plan, watch))
gradckpt.disable(model)
del model, optimizer

try:
    model, optimizer, plan, watch, _ = planned("adamw", give_optimizer=True)
except TypeError as error:  # enable() without optimizer= yet
    print(f"SKIP: AdamW given to enable: {error}")
else:
    warned = train(model, optimizer, batch_of(SAMPLE_BATCH))
    print("AdamW given as enable(..., optimizer=opt): max_memory_allocated per step vs the "
          "plan's prediction")
    for step, peak in enumerate(watch.measured_peaks, start=1):
        print(f"  step {step}: measured {format_bytes(peak)}, predicted "
              f"{format_bytes(plan.predicted_peak_bytes)} "
              f"({peak / plan.predicted_peak_bytes - 1:+.2%}), budget "
              f"{format_bytes(plan.budget_bytes)}")
    steady = watch.measured_peaks[1:]
    verdict("AdamW given to enable, steps 2+ within budget, no warning",
            bool(steady) and not warned
            and max(steady) <= plan.budget_bytes * (1 + watch.tolerance),
            describe(plan, watch) + (f"; warned: {warned[0]}" if warned else ""))
    gradckpt.disable(model)

with gradckpt.peak_memory() as peak:
    torch.empty(64 * 2**20, dtype=torch.uint8, device=device)
verdict("gradckpt.peak_memory() on CUDA sees a 64 MiB tensor made inside",
        peak.bytes - peak.start_bytes >= 64 * 2**20, repr(peak))
raise SystemExit(1 if failures else 0)
PY
}
budget_watch_check 2>&1 | tee "$out/budget_watch_cuda.txt" || status=1
[ "$only" = budget ] && exit $status

# Offload as a planned fate (issue 25): the host link profile measures, a plan whose blocks
# offload op outputs ("offload-ops:..."), max_memory_allocated of its steps against the plan's
# prediction, its step time against the same plan keeping them, gradients against plain.
offload_check() {
"$python" - <<'PY'
import time

import torch

import gradckpt
from gradckpt.budget import format_bytes
from gradckpt.cost import simulate
from gradckpt.op_choices import HOST_LINK
from gradckpt.plan import Segment
from gradckpt.toy_models import GPTConfig, TinyGPT

device = torch.device("cuda")
torch.manual_seed(0)
config = GPTConfig(n_layer=8, n_embd=1024, n_head=16, block_size=1024, dropout=0.1)
model = TinyGPT(config).to(device).train()
idx = torch.randint(0, config.vocab_size, (8, 1024), device=device)
sample = {"idx": idx, "targets": idx}
profile = gradckpt.profile(model, sample)
link = profile.notes.get(HOST_LINK)
print(f"host link measured: {link / 1e9:.1f} GB/s" if link else "host link: NOT measured")
choices = profile.blocks[0].op_choices
if not choices:
    raise SystemExit("FAIL: no op-level choices measured")
policy = choices[len(choices) // 2].policy
n = len(profile.blocks)


def step_times(segments, steps=6):
    plan = gradckpt.plan.Plan("hand", None, segments, 0, 0.0, 0.0,
                              [b.name for b in profile.blocks])
    gradckpt.apply(model, plan)
    torch.cuda.synchronize()
    peaks, times = [], []
    for _ in range(steps):
        torch.cuda.reset_peak_memory_stats()
        start = time.perf_counter()
        torch.manual_seed(1)
        model(**sample).backward()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        peaks.append(torch.cuda.max_memory_allocated())
        grads = [p.grad.clone() for p in model.parameters()]
        model.zero_grad(set_to_none=True)
    gradckpt.disable(model)
    return peaks, sorted(times)[len(times) // 2], grads


failures = 0
_, plain_time, plain_grads = step_times([])
for fate in ("save-ops:", "offload-ops:"):
    segments = [Segment(i, i, policy=fate + policy.split(":", 1)[1]) for i in range(n)]
    peaks, seconds, grads = step_times(segments)
    predicted = profile.fixed_bytes + simulate(profile, segments)[0]
    same = all(torch.equal(a, b) for a, b in zip(grads, plain_grads))
    print(f"{fate}{policy.split(':', 1)[1]} on every block: max_memory_allocated "
          f"{format_bytes(max(peaks[1:]))}, predicted {format_bytes(predicted)} "
          f"({max(peaks[1:]) / predicted - 1:+.2%}); step {seconds * 1e3:.1f} ms "
          f"({seconds / plain_time:.3f}x plain); gradients "
          f"{'identical' if same else 'DIFFERENT'}")
    failures += not same
try:
    plan = gradckpt.solve(profile, int(profile.peak_bytes * 0.5), "optimal")
except gradckpt.BudgetError as error:
    plan = gradckpt.solve(profile, error.minimum_bytes, "optimal")
print(plan)
raise SystemExit(1 if failures else 0)
PY
}
offload_check 2>&1 | tee "$out/offload_cuda.txt" || status=1

"$python" -m pytest -q -m cuda tests/ 2>&1 | tee "$out/cuda_tests.txt" || status=1
"$python" bench/engine.py --device cuda --layers 12 --embd 1024 --heads 16 --batch 8 --seq 1024 \
    --rounds 20 2>&1 | tee "$out/engine_cuda.txt" || status=1
# The planning issue's extra-time target on steadier times: predicted vs measured peaks
# (max_memory_allocated) and extra times of every plan, same script as on CPU.
"$python" bench/frontier.py --device cuda --model tinygpt --layers 12 --embd 1024 --heads 16 --batch 8 \
    --seq 512 --rounds 16 --verbose 2>&1 | tee "$out/frontier_cuda.txt" || status=1
exit $status
