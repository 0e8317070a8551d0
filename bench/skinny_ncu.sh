#!/usr/bin/env bash
# What the skinny quantized GEMMs wait for on the H200 (issue 32, session 22), from a checkout's
# root, one device call of ~4 min:  bash bench/skinny_ncu.sh
# 1. Nsight Compute (--clock-control none: the card's clocks as found) on one launch each of
#    our W4A16 tl.dot program at M = 16 and the FP8 one of the same structure (ONE_ROW=1: also
#    the one-row W4A16 FMA program), at Llama-3.1-8B's qkv shape and the pinned tiles:
#    occupancy, warp states, scheduler, memory; the W4A16 launch's per-instruction stall samples.
#    (PROFILE_TILE: the W4A16 tile profiled, default 16/32/2/3/8.)
# 2. W4A16 M = 16 tiles (TILES), CUDA-graph timed, with and without the PTX unpacking
#    (HEADRACE_W4A16_ASM=1); the other shapes' pinned tiles.
# FP8=1: instead, the FP8 one-row and W8A8 programs (session 25; ~1 min); INT4T=1: the tiled
# INT4 kernel at 16 rows beside the GPTQ-layout one, gate_up (~1 min).
# Reports under $OUT: NAME.txt (ncu's details), w4a16_m16_sass.csv; the last lines: a table.
set -uo pipefail
OUT=${OUT:-/tmp/headrace-out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
. bench/source_path.sh   # the checkout as the package headrace
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
TABLE=$OUT/table.txt; : > "$TABLE"
prof() {   # NAME ARGS...: ncu's sections for the 4th launch of one skinny GEMM
  echo "== ncu $1 ($(date +%T))"
  timeout 150 "$NCU" --clock-control none -k "regex:skinny|tiled" --launch-skip 3 --launch-count 1 \
    --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \
    --section SchedulerStats --section MemoryWorkloadAnalysis --section SourceCounters \
    -o "/tmp/$1" -f python3 -m bench.skinny_ncu "${@:2}" > "$OUT/$1.log" 2>&1
  "$NCU" -i "/tmp/$1.ncu-rep" > "$OUT/$1.txt" 2>&1
  grep -E "us a call" "$OUT/$1.log" | tee -a "$TABLE"
  grep -E "^ +(Duration|Memory Throughput|DRAM Throughput|Registers Per Thread|Theoretical Occupancy|Achieved Occupancy|Warp Cycles Per Issued Instruction|Eligible Warps Per Scheduler|Issued Warp Per Scheduler|No Eligible|Block Limit [A-Za-z ]+) " \
    "$OUT/$1.txt" | sed "s/^ */$1: /" | tee -a "$TABLE"
  grep -oE "[^.]*(stalled|stall)[^.]*\." "$OUT/$1.txt" | head -4 | sed "s/^ */$1: /" | tee -a "$TABLE"
}
echo "== gpu ($(date +%T))"; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
if [ "${FP8:-0}" = 1 ]; then   # FP8 at qkv (session 25): the one-row FMA program at M = 1 against
  # the W8A8 programs at M = 16 (on quantised rows: split 4 and unsplit; quantising inline)
  prof fp8_m1 --scheme fp8 --shape qkv --m 1 --tile 1/8/4/1/1/1024
  prof w8a8_m16 --scheme w8a8 --shape qkv --m 16 --tile 16/64/4/4/4
  prof w8a8_m16_unsplit --scheme w8a8 --shape qkv --m 16 --tile 16/64/4/3/1/256
  prof w8a8i_o_m16 --scheme w8a8i --shape o --m 16 --tile 16/64/4/3/8
  echo "== table ($(date +%T))"; cat "$TABLE"; exit 0
fi
if [ "${INT4T:-0}" = 1 ]; then   # the tiled INT4 kernel at 16 rows beside the GPTQ one (~1 min)
  prof w4a16t_m16 --scheme w4a16t --shape gate_up --m 16 --tile 16/64/4/3/1
  prof w4a16_m16_gate_up --scheme w4a16 --shape gate_up --m 16 --tile 16/64/2/3/4
  echo "== table ($(date +%T))"; cat "$TABLE"; exit 0
fi
prof w4a16_m16 --scheme w4a16 --shape qkv --m 16 --tile ${PROFILE_TILE:-16/32/2/3/8}
"$NCU" -i /tmp/w4a16_m16.ncu-rep --page source --print-source sass --csv > "$OUT/w4a16_m16_sass.csv" 2>&1
prof fp8_m16 --scheme fp8 --shape qkv --m 16 --tile 16/64/4/4/4
[ "${ONE_ROW:-0}" = 1 ] && prof w4a16_m1 --scheme w4a16 --shape qkv --m 1 --tile 1/64/2/1/8
echo "== W4A16 M = 16 tiles, graph-timed ($(date +%T))"
for t in ${TILES:-16/32/2/3/8 16/32/2/3/4 16/64/4/3/4}; do
  timeout 60 python3 -m bench.skinny_ncu --scheme w4a16 --shape qkv --m 16 --tile $t 2>&1 \
    | grep "us a call" | tee -a "$TABLE"
  HEADRACE_W4A16_ASM=1 timeout 60 python3 -m bench.skinny_ncu --scheme w4a16 --shape qkv --m 16 \
    --tile $t 2>&1 | grep "us a call" | sed 's/^/asm: /' | tee -a "$TABLE"
done
for shape in o gate_up down; do     # the pinned tiles
  timeout 60 python3 -m bench.skinny_ncu --scheme w4a16 --shape $shape --m 16 2>&1 \
    | grep "us a call" | tee -a "$TABLE"
done
echo "== table ($(date +%T))"; cat "$TABLE"
