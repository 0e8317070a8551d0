#!/usr/bin/env bash
# Quantization on the GPU (issue 32), from a checkout's root on the H200:
#   bash bench/quant_gpu_check.sh [SECTION...]     (default: wheels tests gemm attention)
# Two device calls (carry .whl with the serving kit of wheels):
#   1. check and choose, ONE call of <= 5 min (expected ~3): bash bench/quant_gpu_check.sh
#      then commit $OUT/quant_dispatch.json as kernels/quant_dispatch.json (rankings + tiles);
#      HEADRACE_COMMIT=<the tree's commit> names it in the table where the copy's git is stale
#   2. the figures, ~8-9 min:      bash bench/quant_gpu_check.sh wheels serve
#      (serve = w1kv, ~2 min, + l8, ~6-7 min: run them in separate calls if one is too long)
# Sections (times: estimates for an H200 host with 16 cores, from the number of distinct Triton
# compiles each part makes, counted under the interpreter, at ~1-2 s a compile, plus timings):
# wheels: installs the carried wheels (WHEELS, default .whl: gemlite, fbgemm-gpu-genai 1.6.0,
#   compressed-tensors and its loguru/psutil; plus the serving kit for `serve`) into /tmp/site; ~5 s.
#   FBGEMM's 35.8 MB wheel and the serving kit fit one call's 64 MiB without the grammar
#   engines' wheels (docs/quantization.md).
# tests: the quantized kernels and layers compiled on the GPU against their references, the eight
#   files in parallel (each its own process; compiles are CPU-bound): skinny FP8 / W8A8 / W4A16 GEMMs
#   (every program shape, split-K; ~15 compiles each), the fixed / pinned tiles and the autotuner
#   (~6), the general W4A16 kernel and FP8 KV attention (~40), every kernel each layer can
#   dispatch to (ours, torch's, gemlite's at its default config) and its CUDA-graph capture with
#   host syncs forbidden (~30); ~60-90 s wall (the slowest file), capped at 120 s.
# gemm: bench/quant_kernels.py: every candidate GEMM beside bf16 cuBLAS at Llama-3.1-8B's four
#   shapes, M = 1, 16, 64, 256 (CUDA-graph replay past L2; up to 16 tiles a bucket of our skinny
#   kernels swept), the winner per shape and M, issue 32's targets; writes
#   $OUT/quant_dispatch.json (copied to kernels/ so a `serve` in the same call uses it); the
#   W8A8 kernels of qkv, gate_up and down are ranked by their time on quantised rows, as the
#   norm and SiLU kernels hand them those rows (--rows --rank-on-rows); ~40 s
#   on the H200 at d375ecc with FBGEMM (tiles are shared across shapes: N and K are runtime
#   arguments), weights (256 MB a shape and scheme) built on the GPU; capped at 240 s
#   (--budget 200 s: library kernels after that are skipped, ours still measured).
# gemmasm: the W4A16 kernel with its PTX unpacking (HEADRACE_W4A16_ASM=1): its GPU tests, then
#   its GEMMs (ours only, M = 1, 16, 64, 16 tiles swept) beside bf16; no table; ~1.5 min.
# attention: bench/fp8_kv_attention.py at batch 256, context 1000 / 2048: decode over an FP8
#   cache beside bf16 (its variants) and prefill over a cached prefix; ~30 s (6 decode compiles,
#   4 decode rows of 6 graph timings, 2 prefill rows), capped at 60 s.
# w1kv: W1 (Qwen3-0.6B, offline client) bf16 KV vs FP8 KV; ~2 min.
# l8: Llama-3.1-8B (random bf16; an INT4 compressed-tensors W4A16 g128 copy): W3 bf16 vs FP8
#   weights + FP8 KV, W2 bf16 vs INT4 (and FP8); ~6-7 min (checkpoints ~2 min, three servers).
# w3kv: W3 on Llama-3.1-8B only, bf16 vs FP8 weights + FP8 KV (the W3 target); ~5 min.
# w3lib: W3 on Llama-3.1-8B with FP8 weights + FP8 KV, our kernels (--quant-backend triton:
#   scaled_mm at decode's 256 rows) against auto with the carried libraries (FBGEMM's row-wise
#   GEMM where kernels/quant_dispatch.json ranks it first, taking the norm / SiLU kernels'
#   quantised rows); needs FBGEMM's wheel in WHEELS; ~5 min.
# w2int4: W2 on Llama-3.1-8B only, bf16 vs the INT4 copy (the W2 ITL target); ~4 min.
#   W2_ALSO="VAR=VALUE ...": the INT4 server again under each setting, one server each (~+1.5
#   min each), e.g. W2_ALSO=HEADRACE_QUANT_LAYOUTS=all: the layout budget's price.
# splits: FP8 against bf16 decode attention at batch 1-32 (several splits a sequence), the
#   engine's tile beside others; ~60 s.
# serve: w1kv and l8; then the table of issue 32's serving targets (server logs: $OUT/serve-N.log).
# The last lines: a short table of each section's wall time and result.
set -uo pipefail
OUT=${OUT:-/tmp/headrace-out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
. bench/source_path.sh   # the checkout as the package headrace
SECTIONS=${*:-wheels tests gemm attention}
[[ " $SECTIONS " == *" serve "* ]] && SECTIONS="$SECTIONS w1kv l8"
log() { echo "== $* ($(date +%T))"; }
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
SUMMARY=$OUT/summary.txt; : > "$SUMMARY"
note() { printf '%-19s %5s s  %s\n' "$1" "$2" "$3" >> "$SUMMARY"; }
log gpu; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if has wheels && ls "${WHEELS:-.whl}"/*.whl >/dev/null 2>&1; then
  log wheels; python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site "${WHEELS:-.whl}"/*.whl 2>&1 | tail -2
fi
QUANT_TESTS="quant_gpu skinny_gemm fp8_skinny fp8_w8a8 fp8_w8a8_inline w4a16_skinny w4a16_tiled quant_kernels"
if has tests; then
  log "quant tests on cuda (eight files in parallel)"; t0=$SECONDS; pids=()
  for f in $QUANT_TESTS; do
    HEADRACE_TEST_DEVICE=cuda timeout 120 python3 -m pytest -p no:cacheprovider \
      "tests/test_$f.py" > "$OUT/test_$f.txt" 2>&1 & pids+=($!)
  done
  wait "${pids[@]}"
  for f in $QUANT_TESTS; do
    r=$(grep -E "passed|failed|error|skipped" "$OUT/test_$f.txt" | tail -1)
    echo "test_$f: ${r:-no result (timed out at 120 s?)}"
    grep -E "^(FAILED|ERROR)" "$OUT/test_$f.txt" | head -5
    note "test_$f" "" "${r:-no result}"
  done
  note tests $((SECONDS - t0)) "wall, eight files in parallel"
fi
if has gemm; then
  log "quantized GEMMs side by side"; t0=$SECONDS
  timeout 240 python3 -m bench.quant_kernels --m 1,16,64,256 --sweep 16 --budget 200 --lib-first-call 60 --rows --rank-on-rows \
    --table "$OUT/quant_dispatch.json" 2>&1 | tee "$OUT/quant_gemm.txt" | grep -v "^  "
  if [ -s "$OUT/quant_dispatch.json" ]; then
    cp "$OUT/quant_dispatch.json" kernels/quant_dispatch.json; r="table written"
  else r="NO table (timed out or failed)"; fi
  note gemm $((SECONDS - t0)) "$r"
fi
if has gemmasm; then
  log "W4A16 with the PTX unpacking (HEADRACE_W4A16_ASM=1): its tests, then its GEMMs"; t0=$SECONDS
  HEADRACE_W4A16_ASM=1 HEADRACE_TEST_DEVICE=cuda timeout 90 python3 -m pytest -p no:cacheprovider \
    tests/test_w4a16_skinny.py > "$OUT/test_w4a16_asm.txt" 2>&1
  r=$(grep -E "passed|failed|error" "$OUT/test_w4a16_asm.txt" | tail -1); echo "test_w4a16_skinny (asm): $r"
  HEADRACE_W4A16_ASM=1 timeout 150 python3 -m bench.quant_kernels --m 1,16,64 --schemes w4a16 \
    --libs "" --sweep 16 2>&1 | tee "$OUT/quant_gemm_asm.txt" | grep -v "^  "
  note gemmasm $((SECONDS - t0)) "tests: ${r:-no result}"
fi
if has attention; then
  log "FP8 KV attention"; t0=$SECONDS
  timeout 60 python3 -m bench.fp8_kv_attention --batches 256 --contexts 1000,2048 2>&1 \
    | tee "$OUT/fp8_kv.txt"
  note attention $((SECONDS - t0)) "$(grep -c '| best' "$OUT/fp8_kv.txt") decode rows, $(grep -c prefill "$OUT/fp8_kv.txt") prefill rows"
fi
if has splits; then
  log "FP8 KV decode at small batches"; t0=$SECONDS
  timeout 120 python3 -m bench.fp8_kv_attention --batches 1,8,32 --contexts 2000 --no-prefill \
    --layouts llama3.1-8b --tiles engine,64/2/5,64/4/4,64/4/5,32/2/5 2>&1 | tee "$OUT/fp8_kv_splits.txt"
  note splits $((SECONDS - t0)) "$(grep -c '| best' "$OUT/fp8_kv_splits.txt") decode rows"
fi
if has w1kv || has l8 || has w3kv || has w3lib || has w2int4; then
  RES=$OUT/quant_serve.jsonl; : > "$RES"; ADDR=127.0.0.1:50151; n=0
  up() {      # MODEL SERVE_ARGS...: `headrace serve` in a process group of its own
    n=$((n + 1)); log "serve $*"
    HEADRACE_LOG_LEVEL=INFO setsid python3 -m headrace.cli serve --model "$1" --host 127.0.0.1 \
      --port 50151 --http-port 50152 --device cuda "${@:2}" > "$OUT/serve-$n.log" 2>&1 &
    SERVER=$!
  }
  down() {    # stops the server's group; prints its KV sizing and quantized layers' kernels
    kill -- -"$SERVER" 2>/dev/null; wait "$SERVER" 2>/dev/null; sleep 2
    grep -ohE "KV cache: [0-9]+ blocks[^;]*|quantized [A-Za-z0-9]+Linear [0-9x]+: .{0,160}" \
      "$OUT/serve-$n.log" | sort -u | head -6
  }
  bench() {   # LABEL WORKLOAD: one serving_bench run against the server, its JSON line labelled
    local every=0
    [ "$2" != w2 ] && every=100000   # W1/W3: an offline client; W2 streams every token
    log "$1"
    timeout -k 5 300 python3 -m bench.serving_bench --address $ADDR --workload "$2" \
      --num-seqs 256 --stream-interval $every > /tmp/q.txt 2>&1 &
    local b=$!
    while kill -0 $b 2>/dev/null; do   # a server that died: stop waiting for it to be ready
      kill -0 "$SERVER" 2>/dev/null || { echo "server exited"; kill $b 2>/dev/null; }
      sleep 2
    done
    wait $b
    tail -1 /tmp/q.txt | python3 -c "import json,sys
try: d = json.loads(sys.stdin.read()); d['label'] = '$1'; print(json.dumps(d))
except ValueError: print(json.dumps({'label': '$1', 'error': 'no result'}))" | tee -a "$RES"
    grep -q '"label"' "$RES" && tail -1 "$RES" | grep -q error && tail -5 "$OUT/serve-$n.log"
  }
  W1="--max-running 256 --max-batched-tokens 16384"
  L8="--max-running 256 --max-batched-tokens 8192 --max-model-len 4096"
  if has w1kv; then
    log "checkpoint qwen3"; python3 -m bench.random_checkpoint qwen3-0.6b /tmp/qwen3 --device cuda > /dev/null
    up /tmp/qwen3 $W1; bench "W1 qwen3 bf16 KV" w1; down
    up /tmp/qwen3 $W1 --kv-cache-dtype fp8; bench "W1 qwen3 fp8 KV" w1; down
  fi
  if has w3kv; then
    log "checkpoint llama8b"
    python3 -m bench.random_checkpoint llama-3.1-8b /tmp/llama8b --device cuda > /dev/null
    up /tmp/llama8b $L8; bench "W3 llama8b bf16" w3; down
    up /tmp/llama8b $L8 --quantization fp8 --kv-cache-dtype fp8
    bench "W3 llama8b fp8 weights + fp8 KV" w3; down
  fi
  if has w3lib; then
    log "checkpoint llama8b"
    python3 -m bench.random_checkpoint llama-3.1-8b /tmp/llama8b --device cuda > /dev/null
    up /tmp/llama8b $L8 --quantization fp8 --kv-cache-dtype fp8 --quant-backend triton
    bench "W3 llama8b fp8 ours" w3; down
    up /tmp/llama8b $L8 --quantization fp8 --kv-cache-dtype fp8
    bench "W3 llama8b fp8 weights + fp8 KV" w3; down
  fi
  if has w2int4; then
    log "checkpoints llama8b"
    python3 -m bench.random_checkpoint llama-3.1-8b /tmp/llama8b --device cuda > /dev/null
    python3 -m bench.quantize_checkpoint /tmp/llama8b /tmp/llama8b-w4a16 --device cuda > /dev/null
    up /tmp/llama8b $L8; bench "W2 llama8b bf16" w2; down
    up /tmp/llama8b-w4a16 $L8; bench "W2 llama8b int4" w2; down
    for extra in ${W2_ALSO:-}; do   # the INT4 server again under one more setting (VAR=VALUE)
      export "$extra"
      up /tmp/llama8b-w4a16 $L8; bench "W2 llama8b int4 $extra" w2; down
      unset "${extra%%=*}"
    done
  fi
  if has l8; then
    log "checkpoints llama8b"
    python3 -m bench.random_checkpoint llama-3.1-8b /tmp/llama8b --device cuda > /dev/null
    python3 -m bench.quantize_checkpoint /tmp/llama8b /tmp/llama8b-w4a16 --device cuda > /dev/null
    up /tmp/llama8b $L8; bench "W2 llama8b bf16" w2; bench "W3 llama8b bf16" w3; down
    up /tmp/llama8b-w4a16 $L8; bench "W2 llama8b int4" w2; down
    up /tmp/llama8b $L8 --quantization fp8 --kv-cache-dtype fp8
    bench "W3 llama8b fp8 weights + fp8 KV" w3; bench "W2 llama8b fp8 weights + fp8 KV" w2; down
  fi
  log "serving targets (issue 32)"
  python3 - "$RES" <<'EOF'
import json, sys
runs = {d["label"]: d for d in map(json.loads, open(sys.argv[1]))}
def get(label, key):
    return runs.get(label, {}).get(key)
def row(what, base, new, unit, target):
    ratio = f"{new / base:.3f}x" if base and new else "-"
    print(f"{what:<42} {base or '-':>10} {new or '-':>10} {unit:<7} {ratio:>8}   {target}")
print(f"{'':<42} {'baseline':>10} {'quantized':>10} {'':<7} {'ratio':>8}   target")
row("W1 Qwen3-0.6B tok/s, bf16 KV | FP8 KV", get("W1 qwen3 bf16 KV", "output_tok_per_s"),
    get("W1 qwen3 fp8 KV", "output_tok_per_s"), "tok/s", ">= 1.15x")
row("W3 Llama-8B tok/s, bf16 | FP8 w + FP8 KV", get("W3 llama8b bf16", "output_tok_per_s"),
    get("W3 llama8b fp8 weights + fp8 KV", "output_tok_per_s"), "tok/s",
    ">= 14,000 tok/s (vLLM 0.24: 12,640; moonshot 16,000)")
row("W3 Llama-8B tok/s, FP8 ours | FP8 auto", get("W3 llama8b fp8 ours", "output_tok_per_s"),
    get("W3 llama8b fp8 weights + fp8 KV", "output_tok_per_s"), "tok/s", "(libraries' share)")
row("W2 Llama-8B ITL p50, bf16 | INT4", get("W2 llama8b bf16", "itl_ms_p50"),
    get("W2 llama8b int4", "itl_ms_p50"), "ms", "<= 0.45x")
for label in runs:
    if label.startswith("W2 llama8b int4 "):
        row(f"W2 ITL p50, bf16 | INT4 {label[16:]}", get("W2 llama8b bf16", "itl_ms_p50"),
            get(label, "itl_ms_p50"), "ms", "<= 0.45x")
row("W2 Llama-8B TTFT p50, bf16 | INT4", get("W2 llama8b bf16", "ttft_ms_p50"),
    get("W2 llama8b int4", "ttft_ms_p50"), "ms", "-")
row("W2 Llama-8B ITL p50, bf16 | FP8 + FP8 KV", get("W2 llama8b bf16", "itl_ms_p50"),
    get("W2 llama8b fp8 weights + fp8 KV", "itl_ms_p50"), "ms", "-")
EOF
fi
log "summary (issue 32)"
cat "$SUMMARY"
if has gemm; then grep -E "^target" "$OUT/quant_gemm.txt"; fi
if has attention; then   # engine's FP8 decode variant (first after bf16) against bf16, per row
  grep '| best' "$OUT/fp8_kv.txt" | awk -F'|' '{split($3, a, ";"); sub(/\).*/, "", a[2]);
    printf "fp8 KV decode %s: the engine variant takes%s of bf16 time\n", $1, a[2]}'
fi
log done
