#!/usr/bin/env bash
# The GPU check of the fused kernels without pytest: each stage of tests/gpu/checks.py, then the
# rate benchmark (benchmarks/bench_fused_rates.py), one process each with its own deadline (a
# kernel that never returns wedges its process's GPU context; the next process starts afresh),
# in the order that loses least when one hangs. Everything, each stage's ``RESULT {json}`` line
# included, goes to one log, OUTDIR/gpu_check.log. The whole run stops starting parts after
# $GPU_CHECK_TOTAL seconds (default 450), so it ends within 8 minutes.
#   bash scripts/gpu_check.sh [OUTDIR]      # default OUTDIR: gpu_check_out
# Uses $PYTHON (default: the python3 on PATH, a GPU machine's own torch); nothing is installed.
# Here, without a GPU: PYTHON=.venv/bin/python GPU_CHECK_ARGS=--smoke bash scripts/gpu_check.sh /tmp/gc
# Exit status: 0 when every part passed.
set -u
out=${1:-gpu_check_out}
mkdir -p "$out" && out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."  # the modules run as tests.gpu.checks and benchmarks.*
log="$out/gpu_check.log"
: >"$log"
export PYTHONUNBUFFERED=1
py=${PYTHON:-python3}
total=${GPU_CHECK_TOTAL:-450}
failed=0
run() {  # name, seconds, command...
    local name=$1 secs=$2 left=$(( total - SECONDS ))
    shift 2
    if (( left < 10 )); then
        echo "stage $name: skipped, past the ${total} s total" | tee -a "$log"
        failed=1
        return
    fi
    (( secs > left )) && secs=$left
    echo "=== stage $name (deadline ${secs} s)" >>"$log"
    timeout -k 5 "$secs" "$@" >>"$log" 2>&1
    local rc=$?
    (( rc == 124 || rc == 137 )) && echo "stage $name: killed after ${secs} s (a hung kernel?)" >>"$log"
    (( rc != 0 )) && failed=1
    echo "stage $name: exit $rc" | tee -a "$log"
}
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv >>"$log" 2>&1
# stage names and deadlines: workspace, pipe, ag, rs, ops, grouped, ulysses (tests/gpu/checks.py)
stages=$("$py" -m tests.gpu.checks --list 2>>"$log") || { echo "cannot list the stages: see $log"; exit 1; }
while read -r name secs; do
    run "$name" "$secs" "$py" -m tests.gpu.checks --stage "$name" ${GPU_CHECK_ARGS:-}
done <<<"$stages"
# TFLOP/s of the kernels against torch.mm, 4 shapes, best config; starts nothing new after --budget
run rates 120 "$py" -m benchmarks.bench_fused_rates --budget 90 ${GPU_CHECK_ARGS:-}
grep -E "^(FAIL|problem|error|kernel|gemm_rs |ag_gemm)" "$log" | cut -c1-400
echo "log: $log (${SECONDS} s)"
exit $failed
