#!/usr/bin/env bash
# The CUDA checks that CI (no GPU) cannot run, as one script for a session that is lent a GPU
# machine: the engine's CUDA tests (RNG replay on the device, offload through side streams,
# max_memory_allocated lower with offload), then bench/engine.py and bench/frontier.py on the
# GPU. Everything it prints is also written to $OUT (or ./device-check/) so the figures can be
# copied into docs/.
#
#   bash bench/device_check.sh            # on the GPU machine, from the repository root
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${OUT:-device-check}
mkdir -p "$out"
python=${PYTHON:-python3}

"$python" -c 'import torch; assert torch.cuda.is_available(), "no CUDA device"; print(torch.__version__, torch.cuda.get_device_name())' 2>&1 | tee "$out/device.txt" || exit 1
"$python" -m pip install --quiet --no-deps -e . 2>&1 | tail -1
"$python" -m pip install --quiet pytest hypothesis 2>&1 | tail -1

status=0
"$python" -m pytest -q -m cuda tests/ 2>&1 | tee "$out/cuda_tests.txt" || status=1
"$python" bench/engine.py --device cuda --layers 12 --embd 1024 --heads 16 --batch 8 --seq 1024 \
    --rounds 20 2>&1 | tee "$out/engine_cuda.txt" || status=1
# The planning issue's extra-time target on steadier times: predicted vs measured peaks
# (max_memory_allocated) and extra times of every plan, same script as on CPU.
"$python" bench/frontier.py --device cuda --layers 12 --embd 1024 --heads 16 --batch 8 \
    --seq 512 --rounds 16 --verbose 2>&1 | tee "$out/frontier_cuda.txt" || status=1
exit $status
