#!/usr/bin/env bash
# One prepared GPU check for issue 4, sized for a short lease (about 5 minutes on one H200):
# the engine's GPU tests (CUDA graphs, bf16, channels-last, streams, NCCL), then the speed
# table for ResNet-56 (8 clients x 64) and AWD-LSTM at PTB size. Needs torch, numpy,
# scikit-learn, rich, pytest; no flwr. Logs go to $OUT (or ./gpu-out).
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-gpu-out}"
mkdir -p "$out"
export PYTHONUNBUFFERED=1 PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
python3 - <<'PY' || exit 2
import sys, torch
if not torch.cuda.is_available():
    sys.exit("benchmarks/gpu_session.sh: no CUDA device here")
print(torch.__version__, torch.cuda.get_device_name(0))
PY
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv | tee "$out/gpu.txt"
timeout 150 python3 -m pytest -q -p no:cacheprovider tests/test_engine_gpu.py 2>&1 | tee "$out/gpu-tests.log"
timeout 120 python3 benchmarks/engine_speed.py --setting cifar10 --device cuda --local-steps 8 --repeats 3 2>&1 | tee "$out/cifar10.log"
timeout 90 python3 benchmarks/engine_speed.py --setting ptb --device cuda --local-steps 4 --repeats 2 2>&1 | tee "$out/ptb.log"
