"""Benchmark: the Ulysses sequence-parallel attention block on an emulated cluster.

    sudo python -m benchmarks.bench_ulysses [--world-sizes 2 4] [--rate auto|MBIT] [--inner eager|inductor]
                                            [--iters 7] [--modes train forward] [--seq 2048 ...]

The same driver as the other benchmarks (benchmarks/harness.py). The block's four
all-to-alls per forward (q, k, v: sequence -> heads; attention output: heads ->
sequence) and four per backward are overlapped by one region chunked along the local
heads. Writes benchmarks/results/ulysses.json, a BENCHMARKS.md section and timelines.
"""
from __future__ import annotations

import sys

from benchmarks import harness

BENCH = harness.Bench(
    builder="overlapc.models.ulysses:build_ulysses", stem="ulysses",
    section="Ulysses sequence-parallel attention (issue 6)", title="Ulysses attention",
    describe="Ulysses attention block (dim {dim}, {n_heads} heads, batch {batch} x seq {seq} in total, "
             "causal, fp32)")


def main(argv=None):
    p = harness.parser("python -m benchmarks.bench_ulysses")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    args = p.parse_args(argv)
    model = dict(dim=args.dim, n_heads=args.heads, batch=args.batch, seq=args.seq)
    return harness.main(BENCH, args, model, "sudo python -m benchmarks.bench_ulysses",
                        "benchmarks.bench_ulysses")


if __name__ == "__main__":
    sys.exit(main())
