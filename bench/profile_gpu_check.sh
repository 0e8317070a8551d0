#!/usr/bin/env bash
# On-demand profiling on the GPU (issue 30), in one device call from a checkout's root, about
# 1.5 minutes on an H200 (most of it the server's start: random Qwen3-0.6B weights, CUDA graphs):
#   bash bench/profile_gpu_check.sh
# Needs the serving wheels carried to the GPU machine on PYTHONPATH (shared/REFERENCE.md 8).
# 1. `headrace serve` of Qwen3-0.6B with random weights (bench/random_checkpoint.py);
# 2. W2 (bench.serving_bench --workload w2) once without profiling: the baseline;
# 3. W2 again while `headrace admin profile --steps 20` records its first 20 steps;
# 4. bench.profile_summary: the trace parses, holds 20 step ranges and names CUDA kernels (the
#    top 10 by device time), the engine core's profile loads; the table last compares W2's
#    latency with and without the profile running.
# Files: $OUT/profile/ (the trace opens in https://ui.perfetto.dev or TensorBoard's profiler
# plugin), $OUT/profile-*.json|txt.
set -uo pipefail
OUT=${OUT:-/tmp/headrace-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
. bench/source_path.sh   # the checkout as the package headrace
PORT=${PORT:-50171}; ADDR=127.0.0.1:$PORT; PROFILE=$OUT/profile
log() { echo "== $* ($(date +%T))"; }
log gpu; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
[ -d /tmp/qwen3 ] || { log ckpt; timeout 120 python3 -m bench.random_checkpoint qwen3-0.6b /tmp/qwen3 --device cuda; }
log serve
rm -rf "$PROFILE"
# Admin (profiling) needs an admin token since issue 29; the server and `admin` read the same one
export HEADRACE_ADMIN_TOKEN=${HEADRACE_ADMIN_TOKEN:-profile-check-$RANDOM$RANDOM}
HEADRACE_LOG_LEVEL=WARNING setsid python3 -m headrace.cli serve --model /tmp/qwen3 --device cuda --port "$PORT" \
  --http-port 0 --metrics-port 0 --dataplane-metrics-port 0 --max-running 256 > "$OUT/profile-serve.log" 2>&1 &
SERVER=$!
trap 'kill -TERM -- -"$SERVER" 2>/dev/null; sleep 3; kill -KILL -- -"$SERVER" 2>/dev/null' EXIT
for _ in $(seq 120); do python3 -m headrace.cli health --address "$ADDR" --timeout 1 > /dev/null 2>&1 && break; sleep 1; done
python3 -m headrace.cli health --address "$ADDR" || { tail -20 "$OUT/profile-serve.log"; exit 1; }
log "w2 baseline"
timeout 60 python3 -m bench.serving_bench --address "$ADDR" --workload w2 | tee "$OUT/profile-w2-baseline.json"
log "w2 while profiling 20 steps"
# armed first (W2 lasts ~2 s on an H200): the profile records the next 20 steps the server
# runs, the bench's first ones (its warm-up request's, then the first timed stream's)
timeout 90 python3 -m headrace.cli admin profile --address "$ADDR" --steps 20 --dir "$PROFILE" --wait 60 \
  > "$OUT/profile-status.json" &
PROF=$!
sleep 4   # the admin command started and armed the recording
timeout 60 python3 -m bench.serving_bench --address "$ADDR" --workload w2 | tee "$OUT/profile-w2-profiled.json"
wait $PROF; echo "headrace admin profile: exit status $?"
cat "$OUT/profile-status.json"; ls -la "$PROFILE"
log summary
python3 -m bench.profile_summary "$PROFILE" --top 10 --require-kernels | tee "$OUT/profile-summary.txt"
echo "trace check exit status ${PIPESTATUS[0]} (0: parses, names CUDA kernels)"
python3 -m bench.profile_summary "$PROFILE" --json > "$OUT/profile-summary.json" 2>/dev/null
python3 - "$OUT" <<'EOF'
import json, os, sys
out = sys.argv[1]
def load(name):
    try:
        return json.load(open(os.path.join(out, name)))
    except (OSError, ValueError):
        return {}
base, prof, status = load("profile-w2-baseline.json"), load("profile-w2-profiled.json"), load("profile-status.json")
summary = load("profile-summary.json")
trace = (summary.get("traces") or [{}])[0]
print("| figure | profiled run | baseline (same run, no profile) |")
print("| --- | --- | --- |")
for key in ("ttft_ms_p50", "itl_ms_p50", "itl_ms_p99"):
    print(f"| W2 {key} | {prof.get(key)} | {base.get(key)} |")
print(f"| steps recorded / in trace | {status.get('stepsRecorded')} / {trace.get('steps')} | 20 asked |")
print(f"| distinct CUDA kernels named / their device time | {trace.get('kernels')} / "
      f"{(trace.get('kernel_us') or 0) / 1e3:.2f} ms | > 0 |")
print(f"| files | {len(status.get('files', []))} | 3 (trace, core .pstats, core .txt) |")
print(f"| errors | {status.get('errors', [])} | [] |")
EOF
