#!/usr/bin/env bash
# flash-attn-4 beside our Triton attention on the GPU, in one device call from a checkout's root
# (about 8 minutes on an H200, much of it compiling flash-attn-4 kernels and starting workers;
# every step's timeout is cut to what is left of BUDGET_S, 560 s by default, so the summary
# always prints inside a 10-minute call):
#   bash bench/fa4_gpu_check.sh WHEEL_DIR [SECTION...]
#   sections: install tests bench w1 long w3 (default: install tests bench w1 long)
# install: the carried wheels of WHEEL_DIR (flash-attn-4, nvidia-cutlass-dsl and its three
#   -libs-* wheels, apache-tvm-ffi, torch-c-dlpack-ext, quack-kernels, einops) into /tmp/site
#   with pip --target; the -libs-* wheels share one nvidia_cutlass_dsl/ tree, so they are unzipped
#   into it, and nvidia_cutlass_dsl/dsl_packages goes on PYTHONPATH (a .pth file does that in a
#   normal install; shared/REFERENCE.md section 7).
# tests: tests/test_flash_attn_gpu.py (kernel against the reference and Triton, e2e bf16 parity).
# bench: bench/attention_backends.py (prefill TFLOP/s, decode TB/s, host cost, the crossover).
# w1 / long: bench.inprocess_bench on Qwen3-0.6B (random weights) with --attention-backend
#   triton, then auto: W1 throughput and the first token of a 30,000-token prompt.
# w3: (not by default, ~4 more minutes) W3 through the gRPC planes on Llama-3.1-8B, triton vs auto.
# Compiled flash-attn-4 kernels are cached on disk across the processes (FA4_CACHE=0: not).
# The wheels are ~100 MB (the -libs-cu13 one 92 MB) and a device call carries 64 MiB: WHEEL_DIR
# may be several folders joined by ':' (carried by successive calls to a warm machine), holding
# wheels or pieces of one (split -b 40M X.whl X.whl.part-), joined here in name order.
set -uo pipefail
WHEELS=${1:?usage: bash bench/fa4_gpu_check.sh WHEEL_DIR [SECTION...]}
shift
SECTIONS=${*:-install tests bench w1 long}
OUT=${OUT:-/tmp/headrace-out}; mkdir -p "$OUT"
SITE=/tmp/site
export PYTHONPATH=$SITE:$SITE/nvidia_cutlass_dsl/dsl_packages${PYTHONPATH:+:$PYTHONPATH}
. bench/source_path.sh   # the checkout as the package headrace
export PYTHONUNBUFFERED=1 FLASH_ATTENTION_CUTE_DSL_CACHE_ENABLED=${FA4_CACHE:-1}
RESULTS=$OUT/fa4.jsonl; : > "$RESULTS"
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-560} ))
log() { echo "== $* ($(date +%T))"; }
cap() { local left=$(( DEADLINE - $(date +%s) - 15 )); echo $(( $1 < left ? $1 : (left > 1 ? left : 1) )); }
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
log gpu; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if has install; then
  log install "$WHEELS"
  JOINED=/tmp/fa4-wheels; rm -rf "$JOINED"; mkdir -p "$JOINED" "$SITE"
  IFS=: read -ra dirs <<< "$WHEELS"
  for d in "${dirs[@]}"; do cp "$d"/*.whl "$JOINED"/ 2>/dev/null; done
  for piece in $(for d in "${dirs[@]}"; do ls "$d"/*.whl.part-* 2>/dev/null; done \
                 | awk -F/ '{print $NF "\t" $0}' | sort | cut -f2); do
    name=$(basename "$piece"); cat "$piece" >> "$JOINED/${name%.part-*}"
  done
  python3 -m pip install -q --no-index --no-deps --target "$SITE" --upgrade \
    $(ls "$JOINED"/*.whl | grep -v nvidia_cutlass_dsl_libs) 2>&1 | tail -3
  for w in "$JOINED"/nvidia_cutlass_dsl_libs_*.whl; do python3 -m zipfile -e "$w" "$SITE"; done
  python3 -c "import flash_attn.cute.interface as i, cutlass, torch; print('flash-attn-4 imports;', \
torch.__version__, cutlass.__file__)" 2>&1 | tail -2
  python3 -m pip list --path "$SITE" 2>/dev/null | grep -iE "flash|cutlass|tvm|quack|einops|dlpack"
fi
if has tests; then
  log tests-gpu
  # one line per test and the exit status: the last session's run printed no summary (89 s),
  # so a crash (a signal) or a timeout must be told apart from a failure
  HEADRACE_TEST_DEVICE=cuda timeout $(cap 170) python3 -m pytest -v -x -p no:cacheprovider \
    tests/test_flash_attn_gpu.py tests/test_attention_backends.py > "$OUT/fa4-tests.txt" 2>&1
  rc=$?; grep -cE " PASSED" "$OUT/fa4-tests.txt" | sed 's/^/tests passed: /'
  grep -E "FAILED|ERROR|Error|Segmentation|Aborted" "$OUT/fa4-tests.txt" | head -8; tail -3 "$OUT/fa4-tests.txt"
  echo "pytest exit status $rc (124: timed out; over 128: killed by signal $((rc - 128)))"
fi
if has bench; then
  log bench; timeout $(cap 130) python3 -m bench.attention_backends --quick 2>&1 | tee "$OUT/fa4-bench.txt" | tail -60
fi
if has w1 || has long || has w3; then
  [ -d /tmp/qwen3 ] || { log ckpt; python3 -m bench.random_checkpoint qwen3-0.6b /tmp/qwen3 --device cuda; }
fi
for w in w1 long; do
  has $w || continue
  for b in triton auto; do
    log "$w --attention-backend $b"
    timeout $(cap 100) python3 -m bench.inprocess_bench --model /tmp/qwen3 --workload $w \
      --attention-backend $b | tail -1 | tee -a "$RESULTS"
  done
done
if has w3; then
  [ -d /tmp/llama8b ] || { log ckpt8b; python3 -m bench.random_checkpoint llama-3.1-8b /tmp/llama8b --device cuda; }
  for b in triton auto; do
    log "w3 --attention-backend $b"
    timeout $(cap 200) python3 -m bench.serving_bench --model /tmp/llama8b --workload w3 --num-seqs 256 \
      --serve-args "--device cuda --max-running 256 --max-batched-tokens 8192 --max-model-len 4096 \
      --attention-backend $b" | tail -1 | sed "s/^{/{\"backend\": \"$b\", /" | tee -a "$RESULTS"
  done
fi
log summary
grep -A12 "^summary" "$OUT/fa4-bench.txt" 2>/dev/null
python3 - "$RESULTS" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
print(f"{'workload':<16} {'backend':<10} {'tok/s':>9} {'ttft_s (min)':>13}")
for r in rows:
    backend = r.get("attention_backend", r.get("backend", "?"))
    print(f"{r.get('workload', 'w3')[:16]:<16} {backend:<10} {r.get('output_tok_per_s', ''):>9} "
          f"{r.get('ttft_s_min', ''):>13}")
EOF
log done
