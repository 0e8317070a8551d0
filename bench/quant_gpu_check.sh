#!/usr/bin/env bash
# Quantization on the GPU (one device call, under 3 minutes on an H200), from a checkout:
#   bash bench/quant_gpu_check.sh [kernels] [fp8] [sweep] [serve]   (default: kernels)
# 1. the quant kernels (FP8 per-token quant + _scaled_mm, the FP8-weight skinny GEMM, W4A16/W8A16
#    GEMM, FP8 KV attention and prologue) against their plain-torch references, compiled on the GPU;
# 2. bench/quant_kernels.py: each GEMM beside bf16 torch at Llama-3.1-8B's shapes, M = 1..256,
#    then the FP8 crossover table (_scaled_mm vs the skinny kernel, TB/s of weight bytes, the
#    kernel fp8_linear picks): what sets triton_quant.FP8_SKINNY_MAX_ROWS.
# fp8: only the FP8 skinny tests and the FP8 crossover (bench/quant_kernels.py --fp8), ~1 min.
# The serving benchmarks are bench/serving_bench.py with the new flags, beside bf16 in the same run:
#   python3 -P bench/serving_bench.py --model /tmp/llama8b --workload w3 --num-seqs 256 \
#     --serve-args "--device cuda --max-running 256 --max-batched-tokens 8192 --max-model-len 4096 \
#                   --quantization fp8 --kv-cache-dtype fp8"
#   (W1 with --kv-cache-dtype fp8; W2 with an INT4 checkpoint, made from the random bf16 one by
#    python3 bench/quantize_checkpoint.py /tmp/llama8b /tmp/llama8b-w4a16 --device cuda
#    (compressed-tensors W4A16 g128, round-to-nearest; detected from its config.json))
# sweep: the W4A16 and FP8 skinny tile/split-K sweeps and W8A8's parts (bench/quant_kernels.py --sweep), ~2 min.
# serve: Llama-3.1-8B (random bf16) W2 in bf16 and with INT4 weights (compressed-tensors W4A16
#   g128), then W3 (256 sequences) in bf16 and with FP8 weights + FP8 KV cache; ~5 min.
set -uo pipefail
export PYTHONPATH=$PWD:$PWD/protos:${PYTHONPATH:-} PYTHONUNBUFFERED=1
SECTIONS=${*:-kernels}
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
if has kernels; then
  echo "== quant kernel tests on cuda ($(date +%T))"
  HEADRACE_TEST_DEVICE=cuda timeout 150 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_quant_kernels.py tests/test_fp8_skinny.py 2>&1 | tail -5
  echo "== quant kernel micro-benchmark ($(date +%T))"
  timeout 180 python3 -m bench.quant_kernels --m 1,8,32,64,128,256 2>&1 | tail -60
fi
if has fp8; then
  echo "== FP8 skinny tests on cuda, FP8 crossover ($(date +%T))"
  HEADRACE_TEST_DEVICE=cuda timeout 120 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_fp8_skinny.py 2>&1 | tail -5
  timeout 120 python3 -m bench.quant_kernels --fp8 --m 1,8,32,64,128,256 2>&1 | tail -60
fi
if has sweep; then
  echo "== W4A16 and FP8 skinny sweeps, W8A8 parts ($(date +%T))"
  timeout 300 python3 -m bench.quant_kernels --m 1,16,64,256 --sweep 2>&1 | grep -E "sweep|parts"
fi
if has serve; then
  echo "== llama-3.1-8b checkpoints ($(date +%T))"
  python3 -m bench.random_checkpoint llama-3.1-8b /tmp/llama8b --device cuda
  python3 -m bench.quantize_checkpoint /tmp/llama8b /tmp/llama8b-w4a16 --device cuda
  base="--device cuda --max-running 256 --max-batched-tokens 8192 --max-model-len 4096"
  for m in /tmp/llama8b /tmp/llama8b-w4a16; do
    echo "== W2 $m ($(date +%T))"
    timeout -k 5 120 python3 -m bench.serving_bench --model $m --workload w2 --serve-args "$base" > /tmp/q.txt 2>&1
    tail -1 /tmp/q.txt
  done
  for q in "" "--quantization fp8 --kv-cache-dtype fp8"; do
    echo "== W3 llama8b $q ($(date +%T))"
    timeout -k 5 150 python3 -m bench.serving_bench --model /tmp/llama8b --workload w3 --num-seqs 256 \
      --serve-args "$base $q" > /tmp/q.txt 2>&1
    tail -1 /tmp/q.txt
  done
fi
echo "== done ($(date +%T))"
