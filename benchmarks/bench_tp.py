"""Benchmark: the reference TP+SP Llama model on an emulated cluster, baseline vs overlapc.

    sudo python -m benchmarks.bench_tp [--world-sizes 2 4] [--rate auto|MBIT] [--inner eager|inductor]
                                       [--iters 7] [--modes train forward] [--dim 1024 ...]

For each world size and mode (full training step, forward only) it builds an emulated
cluster (benchmarks/cluster.py), sets the link rate so that communication takes about as
long as compute (``--rate auto``: measured, in the same run), then times, interleaved,
the baseline, overlapc and compute alone, and replays the step's collectives alone. It
writes benchmarks/results/tp_sp.json, a table in BENCHMARKS.md and a timeline PNG of one
overlapc step. Namespaces are removed on exit, on error and on Ctrl-C.
"""
from __future__ import annotations

import argparse
import statistics
import sys

import torch
import torch.distributed as dist

from benchmarks import common


def _variants(cfg):
    """The three compiled copies of the model (same seed: same weights) and their backends."""
    from torch.distributed.device_mesh import init_device_mesh

    from overlapc import Backend, Options
    from overlapc.models import llama

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    kw = dict(cfg["model"])
    inner = cfg["inner"]
    opts = {
        "base": Options(inner=inner, strategy="none", schedule=False),
        "overlapc": Options(inner=inner, strategy="decompose", chunks=cfg["chunks"],
                            overrides=cfg.get("overrides", {})),
        "compute": Options(inner=inner, strategy="none", schedule=False),
    }
    out = {}
    for name, o in opts.items():
        model, (tokens,) = llama.build_tp_sp(mesh, **kw)
        be = Backend(o, extra_passes=(common.strip_collectives,) if name == "compute" else ())
        out[name] = (torch.compile(model, backend=be), model, be, tokens)
    return out


def _step_fn(compiled, model, tokens, mode):
    if mode == "forward":
        def step():
            with torch.no_grad():
                compiled(tokens)
    else:
        def step():
            for p in model.parameters():
                p.grad = None
            compiled(tokens).float().pow(2).mean().backward()
    return step


def bench_job(cfg: dict) -> dict:
    """On every rank: compile, warm up, time interleaved; comm replay; one profiled step."""
    torch.manual_seed(0)
    variants = _variants(cfg)
    steps = {n: _step_fn(c, m, t, cfg["mode"]) for n, (c, m, be, t) in variants.items()
             if n in cfg.get("variants", variants)}
    for s in steps.values():  # compile + warm up
        s()
        s()
    if cfg.get("smoke"):  # run the steps only (debugging)
        for s in steps.values():
            for _ in range(cfg["iters"]):
                s()
        return {}
    graphs = ("inference",) if cfg["mode"] == "forward" else ("forward", "backward")
    calls = common.collective_calls(variants["base"][2].report, graphs)
    if cfg.get("calibrate"):
        comp = [common.timed(steps["compute"]) for _ in range(3)]
        comm = [common.replay_comm(calls) for _ in range(3)]
        return {"t_compute": statistics.median(comp), "t_comm": statistics.median(comm)}
    times = common.interleaved(steps, cfg["iters"])
    comm = [common.replay_comm(calls) for _ in range(cfg["iters"])]
    result = common.summary(times, comm)
    result["times"] = times
    result["n_collectives"] = len(calls)
    rep = variants["overlapc"][2].report
    result["sites"] = {
        "rewritten": sum(1 for s in rep.sites if s.status == "rewritten"),
        "skipped": [f"{s.name}: {s.reason}" for s in rep.sites if s.status == "skipped"],
    }
    if cfg.get("profile"):  # every rank runs the step; rank 0's timeline is kept
        result["timeline"] = common.profile_events(steps["overlapc"])
        result["timeline_base"] = common.profile_events(steps["base"])
    return result


def run(args) -> list[dict]:
    from benchmarks.cluster import EmulatedCluster

    model = dict(n_layers=args.layers, dim=args.dim, n_heads=args.heads, ffn_dim=args.ffn,
                 vocab_size=256, batch=args.batch, seq=args.seq)
    rows = []
    EmulatedCluster.cleanup_stale()
    for world_size in args.world_sizes:
        for mode in args.modes:
            cfg = dict(model=model, inner=args.inner, chunks=args.chunks, mode=mode, iters=args.iters)
            rate = 400.0 if args.rate == "auto" else float(args.rate)
            with EmulatedCluster(world_size, rate_mbit=rate) as cluster:
                with cluster.world(timeout=3600) as world:
                    if args.rate == "auto":
                        # T_comm scales with 1/rate: aim at T_comm == T_compute.
                        for _ in range(2):
                            cal = world.run(bench_job, {**cfg, "calibrate": True})[0]
                            rate = rate * cal["t_comm"] / cal["t_compute"]
                            cluster.set_rate(round(rate, 1))
                            print(f"  calibrate w{world_size} {mode}: compute {cal['t_compute']*1e3:.0f} ms, "
                                  f"comm {cal['t_comm']*1e3:.0f} ms -> rate {rate:.0f} Mbit/s", flush=True)
                    res = world.run(bench_job, {**cfg, "profile": args.timeline})[0]
            res.update(world_size=world_size, mode=mode, rate_mbit=round(rate, 1), inner=args.inner,
                       chunks=args.chunks, model=model)
            print(f"w{world_size} {mode:8s} rate {rate:6.0f} Mbit/s  base {res['t_base']*1e3:7.1f} ms  "
                  f"overlapc {res['t_overlapc']*1e3:7.1f} ms  compute {res['t_compute']*1e3:7.1f} ms  "
                  f"comm {res['t_comm']*1e3:7.1f} ms  speedup {res['speedup']:.2f}x  E {res['efficiency']:.2f}",
                  flush=True)
            rows.append(res)
    return rows


def report(rows, args) -> None:
    import os

    # One section (and file set) per inner compiler, so an inductor run keeps the eager table.
    tag = "" if args.inner == "eager" else f"_{args.inner}"
    for r in rows:
        tl = r.pop("timeline", None)
        tlb = r.pop("timeline_base", None)
        if tl:
            name = f"timeline_tp_sp{tag}_w{r['world_size']}_{r['mode']}.png"
            common.timeline_png(tl, os.path.join(common.RESULTS, name),
                                f"overlapc, TP+SP Llama, world {r['world_size']}, {r['mode']} step, rank 0")
            r["timeline_png"] = f"benchmarks/results/{name}"
        if tlb:
            name = f"timeline_tp_sp{tag}_w{r['world_size']}_{r['mode']}_baseline.png"
            common.timeline_png(tlb, os.path.join(common.RESULTS, name),
                                f"baseline, TP+SP Llama, world {r['world_size']}, {r['mode']} step, rank 0")
    common.write_json(f"tp_sp{tag}.json", rows)
    cmd = "sudo make bench" if args.default_cmd else "python -m benchmarks.bench_tp " + " ".join(sys.argv[1:])
    m = rows[0]["model"]
    lines = [
        f"Reference TP+SP Llama ({m['n_layers']} layers, dim {m['dim']}, ffn {m['ffn_dim']}, heads {m['n_heads']}, "
        f"batch {m['batch']} x seq {m['seq']}, fp32), inner={rows[0]['inner']}, chunks={rows[0]['chunks']}, "
        f"emulated cluster (one network namespace per rank, veth + bridge, tbf), one torch thread per rank, "
        f"2 CPU cores. Medians of {args.iters} interleaved steps; T_comm = the step's collectives replayed "
        "alone; T_compute = the step with collectives replaced by local copies. "
        "E = (T_base - T_overlapc) / min(T_compute, T_comm).",
        "",
        f"Reproduce: `{cmd}`",
        "",
        "| world | step | link Mbit/s | T_base ms | T_overlapc ms | T_compute ms | T_comm ms | speedup | E | ideal speedup |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['world_size']} | {r['mode']} | {r['rate_mbit']:.0f} | {r['t_base']*1e3:.1f} | "
                     f"{r['t_overlapc']*1e3:.1f} | {r['t_compute']*1e3:.1f} | {r['t_comm']*1e3:.1f} | "
                     f"{r['speedup']:.2f}x | {r['efficiency']:.2f} | {r['ideal_speedup']:.2f}x |")
    pngs = [r["timeline_png"] for r in rows if r.get("timeline_png")]
    if pngs:
        lines += ["", "One overlapc step (rank 0): GEMM chunks (dark blue) run while collectives (red) are "
                      "on the wire. Baseline timelines are beside them (`*_baseline.png`).", ""]
        lines += [f"![timeline]({p})" for p in pngs[:2]]
    section = "Tensor + sequence parallel (issue 3)" if not tag else \
        f"Tensor + sequence parallel, inner={args.inner} (issue 3)"
    common.update_benchmarks_md(section, "\n".join(lines))


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_tp")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--modes", nargs="+", default=["train", "forward"], choices=["train", "forward"])
    p.add_argument("--rate", default="auto", help="link rate in Mbit/s, or 'auto' (T_comm ~ T_compute)")
    p.add_argument("--inner", default="eager", choices=["eager", "inductor"])
    p.add_argument("--chunks", default="auto", type=lambda s: s if s == "auto" else int(s))
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--dim", type=int, default=1024)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--ffn", type=int, default=2816)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--no-timeline", dest="timeline", action="store_false")
    p.add_argument("--default-cmd", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    rows = run(args)
    report(rows, args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
