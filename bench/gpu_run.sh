#!/usr/bin/env bash
# One device call (run from a checkout on the H200): GPU correctness of the end-to-end path
# against transformers, then the serving workloads. Usage: bash bench/gpu_run.sh [all|profile]
set -uo pipefail
OUT=${OUT:-/tmp/headrace-out}; mkdir -p "$OUT"
export PYTHONPATH=$PWD:$PWD/protos:$PWD/bench:${PYTHONPATH:-} PYTHONUNBUFFERED=1 NCCL_NVLS_ENABLE=0
log() { echo "== $* ($(date +%T))"; }
log gpu; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ "${1:-all}" = all ]; then
  log e2e-gpu
  HEADRACE_TEST_DEVICE=cuda timeout 240 python3 -m pytest -q -x -p no:cacheprovider \
    tests/test_e2e_transformers.py tests/test_scheduling_e2e.py::test_parallel_samples_share_the_prompt \
    2>&1 | tail -4
  log ckpt; python3 bench/random_checkpoint.py qwen3-0.6b /tmp/qwen3 --device cuda
  log w2; timeout 150 python3 bench/serving_bench.py --model /tmp/qwen3 --workload w2 | tee -a "$OUT/results.jsonl"
  log w1; timeout 240 python3 bench/serving_bench.py --model /tmp/qwen3 --workload w1 | tee -a "$OUT/results.jsonl"
  log hf; timeout 120 python3 -P bench/hf_reference.py /tmp/qwen3 | tee -a "$OUT/results.jsonl"
else   # profile: the engine driving the runner in one process, transformers' reference, W3
  log ckpt; python3 bench/random_checkpoint.py qwen3-0.6b /tmp/qwen3 --device cuda
  log hf; timeout 120 python3 -P bench/hf_reference.py /tmp/qwen3 | tee -a "$OUT/results.jsonl"
  for w in w2 w1; do
    log "$w in one process"
    timeout 150 python3 -P bench/inprocess_bench.py --model /tmp/qwen3 --workload $w | tee -a "$OUT/results.jsonl"
  done
  log "w1 in one process, profiled"
  timeout 200 python3 -P bench/inprocess_bench.py --model /tmp/qwen3 --workload w1 --profile "$OUT/w1.prof"
  python3 -c "import pstats,sys; pstats.Stats(sys.argv[1]).sort_stats('tottime').print_stats(40)" \
    "$OUT/w1.prof" > "$OUT/w1-profile.txt"
  log ckpt8b; python3 bench/random_checkpoint.py llama-3.1-8b /tmp/llama8b --device cuda
  log w3; timeout 400 python3 bench/serving_bench.py --model /tmp/llama8b --workload w3 --num-seqs 256 \
    --serve-args "--device cuda --max-running 256 --max-batched-tokens 8192 --max-model-len 4096" \
    | tee -a "$OUT/results.jsonl"
fi
log done; cat "$OUT/results.jsonl" 2>/dev/null
