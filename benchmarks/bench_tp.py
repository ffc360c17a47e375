"""Benchmark: the reference TP+SP Llama model on an emulated cluster, baseline vs overlapc.

    sudo python -m benchmarks.bench_tp [--world-sizes 2 4] [--rate auto|MBIT] [--inner eager|inductor]
                                       [--iters 7] [--modes train forward] [--dim 1024 ...]

For each world size and mode (full training step, forward only) it builds an emulated
cluster (overlapc/testing/cluster.py), sets the link rate so that communication takes about as
long as compute (``--rate auto``: measured, in the same run), then times, interleaved,
the baseline, overlapc and compute alone, and replays the step's collectives alone. It
writes benchmarks/results/tp_sp.json, a table in BENCHMARKS.md and a timeline PNG of one
overlapc step. Namespaces are removed on exit, on error and on Ctrl-C.
"""

from __future__ import annotations

import sys

from benchmarks import harness

BENCH = harness.Bench(
    builder="overlapc.models.llama:build_tp_sp",
    stem="tp_sp",
    section="Tensor + sequence parallel (issue 3)",
    title="TP+SP Llama",
    describe="Reference TP+SP Llama ({n_layers} layers, dim {dim}, ffn {ffn_dim}, heads {n_heads}, "
    "batch {batch} x seq {seq}, fp32)",
)


def main(argv=None):
    p = harness.parser("python -m benchmarks.bench_tp")
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    args = p.parse_args(argv)
    model = dict(
        n_layers=args.layers,
        dim=args.dim,
        n_heads=args.heads,
        ffn_dim=args.ffn,
        vocab_size=256,
        batch=args.batch,
        seq=args.seq,
    )
    return harness.main(BENCH, args, model, "sudo make bench", "benchmarks.bench_tp")


if __name__ == "__main__":
    sys.exit(main())
