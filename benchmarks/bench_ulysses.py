"""Benchmark: the Ulysses sequence-parallel attention block on an emulated cluster.

    sudo python -m benchmarks.bench_ulysses [--world-sizes 2 4] [--rate auto|MBIT] [--inner eager|inductor]
                                            [--iters 7] [--modes train forward] [--seq 2048 ...]

The same driver as the other benchmarks (benchmarks/harness.py). The block's four
all-to-alls per forward (q, k, v: sequence -> heads; attention output: heads ->
sequence) and four per backward are overlapped by one region chunked along the local
heads. Writes benchmarks/results/ulysses.json, a BENCHMARKS.md section and timelines.
"""

from __future__ import annotations

import dataclasses
import sys

from benchmarks import harness

BENCH = harness.Bench(
    builder="overlapc.models.ulysses:build_ulysses",
    stem="ulysses",
    section="Ulysses sequence-parallel attention (issue 6)",
    title="Ulysses attention",
    describe="Ulysses attention block (dim {dim}, {n_heads} heads, batch {batch} x seq {seq} in total, causal, fp32)",
)


def main(argv=None):
    p = harness.parser("python -m benchmarks.bench_ulysses")
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument(
        "--kv-heads",
        type=int,
        default=None,
        help="grouped-query attention: this many k/v heads (own json, timelines and section)",
    )
    p.add_argument(
        "--gqa",
        default="repeat",
        choices=["repeat", "sdpa"],
        help="how query heads share k/v heads: repeat_kv (expand + reshape) or enable_gqa",
    )
    args = p.parse_args(argv)
    model = dict(dim=args.dim, n_heads=args.heads, batch=args.batch, seq=args.seq)
    bench, cmd = BENCH, "sudo python -m benchmarks.bench_ulysses"
    if args.kv_heads:
        model.update(n_kv_heads=args.kv_heads, gqa=args.gqa)
        bench = dataclasses.replace(
            BENCH,
            stem="ulysses_gqa",
            section="Ulysses attention, grouped-query (issue 6)",
            describe="Ulysses attention block (dim {dim}, {n_heads} query heads, {n_kv_heads} k/v heads ({gqa}), "
            "batch {batch} x seq {seq} in total, causal, fp32)",
        )
        cmd += f" --kv-heads {args.kv_heads} --gqa {args.gqa} --batch {args.batch} --seq {args.seq}"
    return harness.main(bench, args, model, cmd, "benchmarks.bench_ulysses")


if __name__ == "__main__":
    sys.exit(main())
