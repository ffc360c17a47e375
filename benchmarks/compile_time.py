"""Benchmark: how long overlapc's graph passes take as a model grows (compile time, not speed).

    python -m benchmarks.compile_time [--layers 4 16 32] [--dim 1024 --ffn 2816 --heads 16 --seq 512]
                                      [--world 8] [--no-write]

Captures the reference TP+SP Llama (by default at the shapes of ``make bench``, so that
"auto" rewrites the sites it rewrites there; on the fake group no tensor is computed, so
the shapes cost nothing) at each depth with ``overlapc.explain`` (dynamo +
AOTAutograd + overlapc's passes, no inner compiler) on a fake process group of ``--world``
ranks in this one process, with the default options (strategy "auto": every site planned
by the cost model, micro-batch slices weighed against row chunks), and reports:

- total: the whole capture (dynamo and AOTAutograd included, which overlapc does not control);
- passes: the time inside ``overlapc.passes.optimize`` (forward and backward graphs);
- passes, no memo: the same with the cost model's memo of predictions switched off (each
  repeated site priced again in sympy), interleaved with the first per depth.

Writes benchmarks/results/compile_time.json and the section "Compile time" of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def _capture(layers: int, shape: dict, world_mesh, memo: bool) -> dict:
    import overlapc
    import overlapc.passes as passes
    from overlapc.models import llama
    from overlapc.passes import cost

    spent = [0.0]
    real_optimize, real_predict = passes.optimize, cost.predict_stages

    def timed_optimize(*a, **k):
        t = time.perf_counter()
        try:
            return real_optimize(*a, **k)
        finally:
            spent[0] += time.perf_counter() - t

    def unmemoised(stages, world, dtype, p, extent, copy_bytes=0, add_bytes=0):
        return cost._predict_stages(stages, world, dtype, p, extent, copy_bytes, add_bytes)

    cost._PREDICTIONS.clear()
    passes.optimize = timed_optimize
    if not memo:
        cost.predict_stages = unmemoised
    try:
        model, inputs = llama.build_tp_sp(world_mesh, n_layers=layers, vocab_size=256, **shape)
        t = time.perf_counter()
        report = overlapc.explain(model, *inputs)
        total = time.perf_counter() - t
    finally:
        passes.optimize, cost.predict_stages = real_optimize, real_predict
    return {
        "layers": layers,
        "memo": memo,
        "total_s": total,
        "passes_s": spent[0],
        "sites": sum(1 for s in report.sites if s.pattern != "collective"),
        "rewritten": sum(1 for s in report.sites if s.status == "rewritten"),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.compile_time")
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 16, 32])
    ap.add_argument("--dim", type=int, default=1024)
    ap.add_argument("--ffn", type=int, default=2816)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--world", type=int, default=8)
    ap.add_argument("--no-write", action="store_true", help="print only (no JSON, no BENCHMARKS.md)")
    args = ap.parse_args(argv)

    import torch.distributed as dist

    from benchmarks import common
    from overlapc.cli import fake_world

    if dist.is_initialized() and dist.get_backend() == "fake" and dist.get_world_size() == args.world:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (args.world,))  # one already here (a test session's): keep it
    else:
        mesh = fake_world(args.world)
    shape = dict(dim=args.dim, ffn_dim=args.ffn, n_heads=args.heads, batch=2, seq=args.seq)
    rows = []
    for layers in args.layers:
        for memo in (True, False):
            r = _capture(layers, shape, mesh, memo)
            rows.append(r)
            print(
                f"layers {layers:3d} memo {'on ' if memo else 'off'}: total {r['total_s']:6.1f} s, "
                f"passes {r['passes_s']:6.1f} s, {r['sites']} sites ({r['rewritten']} rewritten)",
                flush=True,
            )
    if args.no_write:
        return 0
    common.write_json("compile_time.json", {"args": vars(args), "rows": rows})
    cmd = "python -m benchmarks.compile_time" + " ".join(a for a in [""] + list(argv or sys.argv[1:]))
    lines = [
        f"Reference TP+SP Llama (dim {args.dim}, ffn {args.ffn}, {args.heads} heads, batch 2 x seq {args.seq}, "
        "fp32), "
        f"captured by `overlapc.explain` with the default options on a fake process group of "
        f"{args.world} ranks (one process, {os.cpu_count()} CPU cores). Total: the whole capture, dynamo and "
        "AOTAutograd included; passes: inside overlapc's graph passes (forward and backward); "
        "no memo: the cost model prices every repeated site again.",
        "",
        f"Reproduce: `{cmd}`",
        "",
        "| layers | sites (rewritten) | total s | passes s | passes s, no memo | passes per layer s |",
        "|---|---|---|---|---|---|",
    ]
    for layers in args.layers:
        on = next(r for r in rows if r["layers"] == layers and r["memo"])
        off = next(r for r in rows if r["layers"] == layers and not r["memo"])
        lines.append(
            f"| {layers} | {on['sites']} ({on['rewritten']}) | {on['total_s']:.1f} | {on['passes_s']:.1f} | "
            f"{off['passes_s']:.1f} | {on['passes_s'] / layers:.2f} |"
        )
    common.update_benchmarks_md("Compile time", "\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
