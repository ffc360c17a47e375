#!/usr/bin/env bash
# The GPU check of the fused kernels (benchmarks/gpu_check.py), one part per process, in the
# order that loses least when one hangs (a kernel that never returns wedges its process's
# GPU context; each part has its own time limit). About 2 minutes on an H100.
#   bash scripts/gpu_check.sh [OUTDIR]      # logs and JSON under OUTDIR (default: gpu_check_out)
# Uses $PYTHON (default: the python3 on PATH, a GPU machine's own torch); nothing is installed.
# Here, without a GPU: PYTHON=.venv/bin/python GPU_CHECK_ARGS=--smoke bash scripts/gpu_check.sh /tmp/gc
set -u
out=${1:-gpu_check_out}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
log="$out/log.txt"
run() {  # stage, seconds
    timeout -k 5 "$2" "${PYTHON:-python3}" -m benchmarks.gpu_check --stage "$1" --budget $(( $2 - 25 )) ${GPU_CHECK_ARGS:-} \
        --out "$out/$1.json" >>"$log" 2>&1
    echo "stage $1: exit $?" | tee -a "$log"
}
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv >>"$log" 2>&1
run workspace 70   # flags, data copies and back-to-back calls while a grid spins; the abort last
run pipe 75        # the AG consumer with a producer on a side stream
run ag 75          # AG consumer GEMM rate against torch.mm, 4 shapes
run rs 75          # RS producer GEMM rate against torch.mm, 4 shapes
run ops 70         # the fused ops between processes (skipped with fewer GPUs than ranks)
run grouped 40     # overlapc::grouped_mm (dropless expert loops) against the loop, and its rate
run ulysses 90     # the Ulysses block compiled: SDPA's CUDA kernel inside the head-chunked region
grep -E "^(FAIL|error|stage|kernel|ag_gemm|gemm_rs|workspace \(|fused ops|grouped_mm|ulysses)" "$log" | cut -c1-400
