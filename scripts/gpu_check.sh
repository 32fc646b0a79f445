#!/usr/bin/env bash
# The GPU check (one GPU, a few minutes): the `pytest -m cuda` tests, then the GPU benchmarks
# whose figures go into the README (with the date and the GPU):
#   1. the MoE layer at Mixtral-like shapes (16384 tokens, dim 4096, ffn 14336, 8 experts,
#      top-2, bf16): TFLOP/s and the fraction of bf16 peak, the dense FFN of the same FLOPs beside
#   2. end to end: tokens/s and MFU of examples/moe_1b.toml (1.01B parameters) on one GPU
# Run from anywhere; uses the `python3` on PATH (it must hold a CUDA build of torch >= 2.9).
# Output: one line per result; JSON copies under $OUT when that is set (the device tool).
set -uo pipefail
cd "$(dirname "$0")/.."
export PYTHONUNBUFFERED=1
out=${OUT:-/tmp/moepar-gpu-check}
mkdir -p "$out"
python3 -m pip install -q --no-deps --no-build-isolation -e . >/dev/null 2>&1 \
  || python3 -m pip install -q --no-deps -e . || exit 1
python3 -c "import torch; assert torch.cuda.is_available(), 'no CUDA device'; \
print('gpu-check:', torch.cuda.get_device_name(0), 'torch', torch.__version__)" || exit 1
status=0
echo "== cuda tests"
timeout 240 python3 -m pytest tests -m cuda -q -p no:cacheprovider -rfE 2>&1 | tee "$out/cuda-tests.log" | tail -25 || status=1
echo "== MoE layer, Mixtral-like shapes, bf16"
timeout 120 python3 -m moepar bench moe-layer --device cuda --tokens 16384 --dim 4096 \
  --ffn-dim 14336 --experts 8 --top-k 2 --dtype bfloat16 --repeats 10 --warmup 3 --json \
  | tee "$out/moe-layer.json" || status=1
echo "== end to end, examples/moe_1b.toml"
timeout 120 python3 -m moepar bench train --config examples/moe_1b.toml --device cuda \
  --steps 10 --warmup 3 --json | tee "$out/train.json" || status=1
exit $status
