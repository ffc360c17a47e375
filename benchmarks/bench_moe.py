"""Benchmark: the expert-parallel MoE layer on an emulated cluster, baseline vs overlapc.

    sudo python -m benchmarks.bench_moe [--world-sizes 2 4] [--rate auto|MBIT] [--inner eager|inductor]
                                        [--iters 7] [--modes train forward] [--tokens 1024 ...]
                                        [--form capacity|dropless] [--dtype float32|bfloat16]

The same driver as the TP+SP benchmark (benchmarks/harness.py): per world size and mode,
the link rate is calibrated so that the four all-to-alls of a training step (two forward,
two backward) take about as long as the compute, then baseline, overlapc and compute
alone are timed interleaved and the all-to-alls replayed alone. Capacity form (even
all-to-alls, static shapes), bmm experts, top-2 routing with the default random router.
Writes benchmarks/results/moe.json, a BENCHMARKS.md section and timeline PNGs.
"""

from __future__ import annotations

import dataclasses
import sys

from benchmarks import harness

BENCH = harness.Bench(
    builder="overlapc.models.moe:build_ep",
    stem="moe",
    section="Expert-parallel MoE layer (issue 6)",
    title="EP MoE layer",
    describe="MoE layer, {form} form ({n_experts} experts, top-{top_k}, capacity factor {capacity_factor}, "
    "dim {dim}, hidden {hidden}, {tokens} tokens per rank, expert GEMMs as {expert_form}, {dtype})",
)


def main(argv=None):
    p = harness.parser("python -m benchmarks.bench_moe")
    p.add_argument("--tokens", type=int, default=1024)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--capacity-factor", type=float, default=1.25)
    p.add_argument(
        "--experts-as",
        dest="expert_form",
        default=None,
        choices=["bmm", "loop", "grouped"],
        help="expert GEMMs: bmm or loop (capacity form; default bmm), grouped or loop (dropless form; default grouped)",
    )
    p.add_argument(
        "--form",
        default="capacity",
        choices=["capacity", "dropless"],
        help="capacity (padded slots, even all-to-alls) or dropless (run-time splits)",
    )
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16"],
        help="default: float32 (capacity), bfloat16 (dropless; grouped experts take only bf16)",
    )
    args = p.parse_args(argv)
    dropless = args.form == "dropless"
    dtype = args.dtype or ("bfloat16" if dropless else "float32")
    expert_form = args.expert_form or ("grouped" if dropless else "bmm")
    allowed = ("grouped", "loop") if dropless else ("bmm", "loop")
    if expert_form not in allowed:
        p.error(f"--experts-as {expert_form} does not fit --form {args.form} (allowed: {', '.join(allowed)})")
    if expert_form == "grouped" and dtype != "bfloat16":
        p.error("--experts-as grouped needs --dtype bfloat16 (torch's grouped matmul takes only bf16 on the CPU)")
    model = dict(
        tokens=args.tokens,
        dim=args.dim,
        hidden=args.hidden,
        n_experts=args.experts,
        top_k=args.top_k,
        capacity_factor=args.capacity_factor,
        expert_form=expert_form,
        form=args.form,
        dtype=dtype,
    )
    bench, cmd = BENCH, "sudo python -m benchmarks.bench_moe"
    if dropless and expert_form == "loop":  # its own json, timelines and BENCHMARKS.md section
        bench = dataclasses.replace(
            BENCH,
            stem="moe_dropless_loop",
            section="Expert-parallel MoE layer, dropless form, experts as a loop (issue 6)",
        )
        cmd += " --form dropless --experts-as loop"
    elif dropless:
        bench = dataclasses.replace(
            BENCH, stem="moe_dropless", section="Expert-parallel MoE layer, dropless form (issue 6)"
        )
        cmd += " --form dropless"
    return harness.main(bench, args, model, cmd, "benchmarks.bench_moe")


if __name__ == "__main__":
    sys.exit(main())
