#!/usr/bin/env bash
# CUDA graphs of prefill and mixed steps (piecewise, and full with the unified attention kernel)
# and the data plane's host time per step (issue 31), in one device call from a checkout's root
# (under 4 minutes on an H200; every step's timeout is cut to what is left of BUDGET_S, 230 s
# by default, so the table prints):
#   bash bench/mixed_gpu_check.sh [SECTION...]     sections: tests kernel steps w1 (default: all)
# Wheels: the serving set gpu_run.sh's runs carry (shared/REFERENCE.md section 8), installed
# into /tmp/site first when WHEELS=DIR is set (pip --target --no-deps).
# tests: the unified attention kernel compiled against headrace.kernels.reference (decode, prefill,
#   mixed, cached prefixes, bucket padding, tile sizes, random ragged batches, FP8 KV); greedy
#   outputs with --cudagraph-mode full_and_piecewise and full equal eager and transformers on a
#   tiny Llama and Qwen3 (fp32) and eager on a Qwen3-0.6B-shaped checkpoint (fp32, 24 chunked
#   prompts).
# kernel: bench.unified_attention, device µs per layer of the unified kernel per BLOCK_M
#   against the split decode + prefill launches, for decode / mixed / prefill / 2k-over-8k.
# steps: bench.step_host on Qwen3-0.6B (random bf16) at 256 sequences: decode (256 decodes),
#   mixed (256 decodes + a 512-token prompt), prefill (2048 tokens); per --cudagraph-mode
#   full_decode_only (graphs for decodes only), full_and_piecewise (the default) and full;
#   host ms per launch phase, execute vs device ms (serial), wall / device / idle ms per step
#   (pipelined); the graphs' count, memory and capture time.
# w1: bench.inprocess_bench W1 in one process, in the mode whose mixed step was fastest
#   (pipelined wall) in steps (full when steps did not run).
set -uo pipefail
SECTIONS=${*:-tests kernel steps w1}
OUT=${OUT:-/tmp/headrace-out}; mkdir -p "$OUT"
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONUNBUFFERED=1
. bench/source_path.sh   # the checkout as the package headrace
RESULTS=$OUT/mixed.jsonl; : > "$RESULTS"
DEADLINE=$(( $(date +%s) + ${BUDGET_S:-230} ))
log() { echo "== $* ($(date +%T))"; }
cap() { local left=$(( DEADLINE - $(date +%s) - 10 )); echo $(( $1 < left ? $1 : (left > 1 ? left : 1) )); }
has() { [[ " $SECTIONS " == *" $1 "* ]]; }
log gpu; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
if [ -n "${WHEELS:-}" ]; then
  log install "$WHEELS"
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$WHEELS"/*.whl 2>&1 | tail -2
fi
[ -d /tmp/qwen3 ] || { log ckpt; python3 -m bench.random_checkpoint qwen3-0.6b /tmp/qwen3 --device cuda; }
if has tests; then
  log tests-gpu
  gpu_pytest() {   # one line per test to $OUT/mixed-tests.txt; the exit status printed
    HEADRACE_TEST_DEVICE=cuda HEADRACE_TEST_QWEN3_DIR=/tmp/qwen3 timeout $(cap $1) python3 -m pytest -v -x \
      -p no:cacheprovider "${@:2}" >> "$OUT/mixed-tests.txt" 2>&1
    rc=$?; echo "pytest $2 ...: exit status $rc (124: timed out; over 128: killed by signal $((rc - 128)))"
  }
  gpu_pytest 40 tests/test_unified_attention.py
  gpu_pytest 60 tests/test_mixed_graphs.py -k gpu
  grep -cE " PASSED" "$OUT/mixed-tests.txt" | sed 's/^/tests passed: /'
  grep -E "FAILED|ERROR|Error|Segmentation|Aborted" "$OUT/mixed-tests.txt" | head -8
fi
if has kernel; then
  log "unified attention: device µs per layer by BLOCK_M vs the split kernels"
  timeout $(cap 30) python3 -m bench.unified_attention 2>"$OUT/unified.err" | tee "$OUT/unified.txt" | grep -v '^{'
  grep '^{' "$OUT/unified.txt" >> "$RESULTS"; tail -3 "$OUT/unified.err"
fi
if has steps; then
  log "step_host: decode / mixed / prefill by --cudagraph-mode"
  timeout $(cap 75) python3 -m bench.step_host --model /tmp/qwen3 --device cuda --seqs 256 --prefill 512 \
    --prefill-only 2048 --modes full_decode_only,full_and_piecewise,full --steps 20 \
    2>"$OUT/step_host.err" | tee "$OUT/step_host.txt" | grep -v '^{' ; grep '^{' "$OUT/step_host.txt" >> "$RESULTS"
  tail -3 "$OUT/step_host.err"
fi
if has w1; then
  mode=$(python3 - "$RESULTS" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith('{"kind"')]
mixed = [r for r in rows if r["kind"] == "mixed" and r["mode"] in ("full_and_piecewise", "full")]
print(min(mixed, key=lambda r: r["pipelined_wall_ms"])["mode"] if mixed else "full")
EOF
)
  log "w1 in one process, --cudagraph-mode $mode"
  timeout $(cap 45) python3 -m bench.inprocess_bench --model /tmp/qwen3 --workload w1 --cudagraph-mode "$mode" \
    2>>"$OUT/w1.err" | tail -1 | tee -a "$RESULTS"
fi
log summary
python3 - "$RESULTS" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1]) if l.startswith("{")]
for r in rows:
    if "graphs" in r:
        print(f"graphs: {r['graph_count']} captured in {r['graph_capture_s']} s, {r['graph_mib']} MiB "
              f"({r['graph_estimated_mib']} MiB estimated, kept out of the KV budget)")
    if "full_graphs" in r:
        print(f"full step graphs (beside them): {r['full_graphs']} captured in {r['full_capture_s']} s, "
              f"{r['full_mib']} MiB")
units = [r for r in rows if r.get("kernel") == "unified"]
for shape in dict.fromkeys(r["shape"] for r in units):
    split = next(r["us"] for r in rows if r.get("kernel") == "split" and r["shape"] == shape)
    best = min((r for r in units if r["shape"] == shape), key=lambda r: r["us"])
    print(f"attention {shape}: unified {best['us']} µs/layer at BLOCK_M {best['block_m']} "
          f"(max diff {best['max_abs_diff_vs_split']}), split kernels {split} µs/layer")
print(f"{'mode':<19}{'kind':<8}{'graph':<10}{'host_ms':>8}{'exec_ms':>8}{'dev_ms':>7}{'exe/dev':>8}"
      f"{'outside':>8}{'pipe_wall':>10}{'pipe_dev':>9}{'idle':>6}")
for r in rows:
    if "kind" in r:
        print(f"{r['mode']:<19}{r['kind']:<8}{r['graph']:<10}{r['host_launch_ms'] + r['host_ms']['finish']:8.2f}"
              f"{r['execute_ms']:8.2f}{r['device_ms']:7.2f}{r['execute_over_device'] or 0:8.2f}"
              f"{r['outside_device_ms'] or 0:8.2f}{r['pipelined_wall_ms']:10.2f}{r['pipelined_device_ms']:9.2f}"
              f"{r['pipelined_idle_ms']:6.2f}")
for r in rows:
    if str(r.get("workload", "")).startswith("w1"):
        print(f"W1 in one process, {r['cudagraph_mode']}: {r['output_tok_per_s']} tok/s "
              f"(graphs {r['graph_mib']} MiB, captured in {r['graph_capture_s']} s)")
EOF
