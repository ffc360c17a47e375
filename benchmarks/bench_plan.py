"""Benchmark: the cost model's predictions against measurements on the emulated cluster.

    sudo python -m benchmarks.bench_plan [--world-sizes 2 4] [--rates 1000 3000] [--iters 7]
    python -m benchmarks.bench_plan --rescore benchmarks/results/plan.json [older plan.json ...]

For each world size and link rate it builds an emulated cluster (overlapc/testing/cluster.py),
runs ``overlapc calibrate`` inside it (the profile of *that* cluster: GEMM rates, link
alpha/beta, reduce-scatter factor), then for each single-site program (AllGather -> mm and
mm -> ReduceScatter, fp32, several shapes) and for an MoE layer's forward (an all-to-all
region: dispatch, experts, combine; the layer's routing is not modelled, so its predicted
speedup is the measured baseline less the region's predicted saving) times, interleaved in
one run:

- the baseline (strategy "none"),
- the site decomposed into n = 2, 3, 4, 6, 8 chunks (a sweep of fixed counts),
- the planner's choice (strategy "decompose", chunks "auto", hardware = the calibrated profile).

Per configuration it reports the predicted and the measured speedup of the planner's
choice (and of every fixed count), the error of the prediction, and how far the planner's
chunk count lands from the best fixed count of the sweep. Writes
benchmarks/results/plan.json and a section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from benchmarks import common, harness

CHUNKS = [2, 3, 4, 6, 8]
# (M rows gathered / scattered in total, K, N): comm-bound, balanced, compute-bound at the rates below
SHAPES = [(2048, 1024, 1024), (2048, 1024, 4096), (1024, 512, 4096)]
# MoE layer forward (capacity form, bmm experts, top-2, 8 experts, fp32): (tokens per rank, dim, hidden)
MOE_SHAPES = [(1024, 1024, 2048), (512, 512, 2048)]
KINDS = ("ag_mm", "mm_rs", "moe")


def ag_mm(x, w, group):
    return torch.mm(funcol.all_gather_tensor(x, 0, group), w)


def mm_rs(x, w, group):
    return funcol.reduce_scatter_tensor(torch.mm(x, w), "sum", 0, group)


def plan_job(kind: str, shape, profile_path: str, iters: int) -> dict:
    from overlapc import Backend, Options

    torch.manual_seed(dist.get_rank())
    world, group = dist.get_world_size(), dist.group.WORLD
    M, K, N = shape
    if kind == "ag_mm":
        x, w, fn = torch.randn(M // world, K), torch.randn(K, N) / K**0.5, ag_mm
    elif kind == "mm_rs":
        x, w, fn = torch.randn(M, K // world), torch.randn(K // world, N) / K**0.5, mm_rs
    else:  # a whole MoE layer: its region (dispatch, experts, combine) and the routing around it
        from torch.distributed.device_mesh import init_device_mesh

        from overlapc.models import moe

        layer, (tokens,) = moe.build_ep(
            init_device_mesh("cpu", (world,)), tokens=M, dim=K, hidden=N, capacity_factor=1.25
        )
        x, w, fn = tokens.detach(), None, lambda x, w, group: layer(x)
    variants = {
        "base": Options(inner="eager", strategy="none", schedule=False, hardware=profile_path),
        "auto": Options(inner="eager", strategy="decompose", chunks="auto", hardware=profile_path),
    }
    for n in CHUNKS:
        variants[f"n{n}"] = Options(inner="eager", strategy="decompose", chunks=n, hardware=profile_path)
    # Each variant is one more dynamo compile of fn (a new backend fails BACKEND_MATCH); past
    # the recompile limit dynamo would silently time the rest eagerly. The world resets dynamo per job.
    assert len(variants) <= torch._dynamo.config.recompile_limit, "more variants than dynamo compiles"
    steps, reports = {}, {}
    for name, o in variants.items():
        be = Backend(o)
        c = torch.compile(fn, backend=be)
        reports[name] = be

        def step(c=c):
            with torch.no_grad():
                out = c(x, w, group)
                if isinstance(out, funcol.AsyncCollectiveTensor):
                    out.wait()

        steps[name] = step
    for s in steps.values():
        s()
        s()
    rounds = _rounds(steps["base"], iters)
    times = common.interleaved(steps, rounds)
    med = {k: statistics.median(v) for k, v in times.items()}
    site = next(s for s in reports["auto"].report.sites if s.pattern != "collective" and s.details.get("predicted"))
    pred = site.details["predicted"]
    return {
        "kind": kind,
        "shape": list(shape),
        "world": world,
        "t": med,
        "predicted": pred,
        "auto_chunks": site.chunks,
        "rounds": rounds,
        "spread": {k: [min(v), max(v)] for k, v in times.items()},
    }


def _rounds(step, iters: int, budget_s: float = 1.5, most: int = 31) -> int:
    """Rounds of the interleaved timing: ``iters``, or more for short steps, up to ``most``,
    so that each variant is timed for about ``budget_s`` in all. Two copies of one ~40 ms
    program differ by up to ~10% in a median of 15 rounds here, as much as the chunk counts
    being compared; longer steps are steadier. The same number on every rank (the slowest's)."""
    return int(min(most, max(iters, -(-budget_s // common.timed(step)))))


def run(args) -> list[dict]:
    from overlapc.testing.cluster import EmulatedCluster

    rows = []
    EmulatedCluster.cleanup_stale()
    for world_size in args.world_sizes:
        for rate in args.rates:
            with EmulatedCluster(world_size, rate_mbit=rate) as cluster:
                with cluster.world(timeout=3600) as world:
                    path, prof = harness._calibrated_profile(world, world_size, rate)
                    print(
                        f"w{world_size} {rate:g} Mbit/s: alpha {prof['link']['alpha_us']:.0f} us, beta "
                        f"{prof['link']['beta_gbps'] * 1e3:.1f} MB/s, rs_factor {prof['rs_factor']}, fp32 GEMM "
                        f"{prof['gemm']['float32']['peak_tflops'] * 1e3:.0f} GFLOP/s",
                        flush=True,
                    )
                    try:
                        for kind in args.kinds:
                            for shape in MOE_SHAPES if kind == "moe" else SHAPES:
                                r = world.run(plan_job, kind, shape, path, args.iters)[0]
                                r.update(rate_mbit=rate, profile=prof)
                                rows.append(_score(r))
                                print(_line(rows[-1]), flush=True)
                    finally:
                        os.unlink(path)
    return rows


def _predicted_speedup(kind: str, base: float, at_n: float, measured_base: float) -> float:
    """Predicted speedup of a row from the model's baseline and n-chunk times (seconds).
    For the MoE layer: the measured baseline less the region's predicted saving (the
    layer's routing is not modelled)."""
    if kind != "moe":
        return base / at_n
    return measured_base / (measured_base - (base - at_n))


def _fixed(t: dict) -> dict[int, float]:
    """The sweep's times by chunk count."""
    return {int(k[1:]): v for k, v in t.items() if k.startswith("n")}


def _score(r: dict) -> dict:
    t, p = r["t"], r["predicted"]
    n = r["auto_chunks"]

    def predicted(k):
        return _predicted_speedup(r["kind"], p["base_ms"] / 1e3, p["by_chunks_ms"][str(k)] / 1e3, t["base"])

    r["measured_speedup"] = t["base"] / t["auto"]
    r["predicted_speedup"] = predicted(n)
    r["error"] = (r["predicted_speedup"] - r["measured_speedup"]) / r["measured_speedup"]
    fixed = _fixed(t)
    best_n = min(fixed, key=fixed.get)
    r["best_fixed"] = best_n
    r["auto_vs_best"] = t["auto"] / fixed[best_n] - 1
    # The planner's count judged by the sweep's own time for it (the same program as the
    # auto variant, timed in the same run): separates the choice from timing noise.
    r["count_vs_best"] = fixed[n] / fixed[best_n] - 1 if n in fixed else r["auto_vs_best"]
    r["noise"] = abs(t["auto"] / fixed[n] - 1) if n in fixed else None
    r["fixed_errors"] = {
        str(k): predicted(k) / (t["base"] / v) - 1 for k, v in fixed.items() if str(k) in p["by_chunks_ms"]
    }
    return r


def _line(r):
    return (
        f"w{r['world']} {r['rate_mbit']:5.0f} Mbit/s {r['kind']:5s} {r['shape']}  base {r['t']['base'] * 1e3:6.1f} ms"
        f"  auto n={r['auto_chunks']} {r['t']['auto'] * 1e3:6.1f} ms  speedup measured {r['measured_speedup']:.2f}x"
        f" predicted {r['predicted_speedup']:.2f}x (err {r['error']:+.0%})  best fixed n={r['best_fixed']}"
        f" (auto {r['auto_vs_best']:+.1%})"
    )


def _site_gain(r) -> float:
    p = r["predicted"]
    return (p["base_ms"] - p["by_chunks_ms"][str(r["auto_chunks"])]) / p["base_ms"]


def report(rows, cmd: str) -> None:
    common.write_json("plan.json", rows)
    errs = [abs(r["error"]) for r in rows]
    all_errs = [abs(e) for r in rows for e in r["fixed_errors"].values()]
    within = sum(1 for r in rows if r["auto_vs_best"] <= 0.05)
    within_count = sum(1 for r in rows if r.get("count_vs_best", r["auto_vs_best"]) <= 0.05)
    noise = sorted(r["noise"] for r in rows if r.get("noise") is not None)
    # strategy="auto" keeps a site only if its predicted gain clears the profile's min_gain.
    keep = [_site_gain(r) >= r["profile"]["min_gain"] for r in rows]
    pays = [r["measured_speedup"] >= 1.0 for r in rows]
    right = sum(1 for k, m in zip(keep, pays) if k == m)
    slower_kept = sum(1 for k, r in zip(keep, rows) if k and r["measured_speedup"] < 0.97)
    lines = [
        "Single-site programs (fp32, inner eager): AllGather -> mm and mm -> ReduceScatter of "
        f"(M, K, N) in {SHAPES}, and the MoE layer's forward (fp32, capacity form, bmm experts, 8 experts, "
        f"top-2, capacity factor 1.25; (tokens per rank, dim, hidden) in {MOE_SHAPES}), "
        f"world sizes {sorted({r['world'] for r in rows})}, link rates "
        f"{sorted({r['rate_mbit'] for r in rows})} Mbit/s on the emulated cluster. The profile of each "
        "(world, rate) is calibrated in the same run (`overlapc calibrate` inside the cluster). Measured: "
        "medians of interleaved steps (each round in a new random order; "
        f"{min(r.get('rounds', 7) for r in rows)}-{max(r.get('rounds', 7) for r in rows)} rounds: "
        "at least --iters, more for short steps, about 1.5 s per variant), baseline vs the planner's chunk count "
        "(strategy decompose, chunks auto) "
        f"vs fixed counts {CHUNKS}.",
        "",
        f"Reproduce: `{cmd}`",
        "",
        f"- {len(rows)} configurations. Prediction error of the planner's choice (predicted vs measured "
        f"speedup): median {statistics.median(errs):.1%}, max {max(errs):.1%} "
        f"(over every fixed count too: median {statistics.median(all_errs):.1%}, max {max(all_errs):.1%}).",
        f"- Planner's chunk count within 5% of the best fixed count: {within} of {len(rows)} (planner variant's "
        f"own time); {within_count} of {len(rows)} judged by the sweep's time for the same count. Timing "
        f"noise (planner variant vs the fixed variant with the same count, the same program): "
        + (f"median {statistics.median(noise):.1%}, max {max(noise):.1%}." if noise else "n/a."),
        f'- Decisions of strategy="auto" (rewrite only when the predicted gain clears min_gain = '
        f"{rows[0]['profile']['min_gain']:.0%}): {right} of {len(rows)} agree with the measurement (rewrite "
        f"where it measured at least as fast as the baseline, skip where it measured slower); "
        f"{slower_kept} kept sites measured more than 3% slower.",
        "",
        "| world | Mbit/s | site | M, K, N | base ms | planner n | planner ms | measured | predicted | error "
        "| best fixed n | planner vs best |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['world']} | {r['rate_mbit']:g} | {r['kind']} | {', '.join(map(str, r['shape']))} | "
            f"{r['t']['base'] * 1e3:.1f} | {r['auto_chunks']} | {r['t']['auto'] * 1e3:.1f} | "
            f"{r['measured_speedup']:.2f}x | {r['predicted_speedup']:.2f}x | {r['error']:+.1%} | "
            f"{r['best_fixed']} | {r['auto_vs_best']:+.1%} |"
        )
    common.update_benchmarks_md("Planner: predicted vs measured (issue 5)", "\n".join(lines))


def rescore(path: str, overrides: dict | None = None) -> dict:
    """The current cost model against the timings of an earlier run (its plan.json): each
    row's stages and calibrated profile re-predicted, the count the model picks now judged
    by the sweep's time for it, or the planner variant's where that ran the same count
    (other rows are not judged). ``overrides``: profile fields set on every row, keyed
    ``"world,rate"`` (e.g. ``"4,3000"``) or ``"*"`` for all: a new field's value before a run
    has calibrated it. For trying a model change on several runs before spending a run on
    it. Prints one line."""
    from overlapc.passes import cost, plan

    with open(path) as f:
        rows = json.load(f)
    errs, fixed_errs, within, judged = [], [], 0, 0
    for r in rows:
        p, t = r["predicted"], r["t"]
        prof = dict(r["profile"])
        for key in ("*", f"{r['world']},{r['rate_mbit']:g}"):
            prof.update((overrides or {}).get(key, {}))
        pred = cost.predict_stages(
            [cost.Stage(**d) for d in p["stages"]],
            r["world"],
            "float32",
            cost.profile_from_dict(prof),
            p["extent"],
            p.get("copy_bytes") or 0,
            p.get("add_bytes") or 0,
        )
        per = pred.per_chunks
        n = plan.pick_count(per)

        def speedup(k):
            return _predicted_speedup(r["kind"], pred.base, per[k], t["base"])

        fixed = _fixed(t)
        fixed_errs += [abs(speedup(k) * fixed[k] / t["base"] - 1) for k in fixed if k in per]
        # the count's measured time: the sweep's, else the planner variant's where it picked the same
        t_n = fixed.get(n, t["auto"] if n == r["auto_chunks"] else None)
        if t_n is not None:
            judged += 1
            within += t_n / min(fixed.values()) - 1 <= 0.05
            errs.append(abs(speedup(n) * t_n / t["base"] - 1))
    out = {
        "path": path,
        "judged": judged,
        "within_5pct": within,
        "median_error": statistics.median(errs),
        "max_error": max(errs),
        "median_error_all_counts": statistics.median(fixed_errs),
        "max_error_all_counts": max(fixed_errs),
    }
    print(
        f"{path}: counts within 5% {within} of {judged} judged; error of the picked count median "
        f"{out['median_error']:.1%} max {out['max_error']:.1%}; over every fixed count median "
        f"{out['median_error_all_counts']:.1%} max {out['max_error_all_counts']:.1%}"
    )
    return out


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_plan")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--rates", type=float, nargs="+", default=[1000.0, 3000.0])
    p.add_argument("--iters", type=int, default=7, help="rounds at least (short steps get more, up to 31)")
    p.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    p.add_argument(
        "--from-json",
        action="store_true",
        help="rewrite the BENCHMARKS.md section from benchmarks/results/plan.json (no measuring)",
    )
    p.add_argument(
        "--rescore",
        nargs="+",
        metavar="PLAN_JSON",
        help="re-predict earlier runs' timings with the current model and print how it does (no measuring)",
    )
    p.add_argument(
        "--set",
        nargs="+",
        default=[],
        metavar="[WORLD,RATE:]FIELD=VALUE",
        help="with --rescore: set a profile field (JSON value) on every row, or on one cluster's",
    )
    args = p.parse_args(argv)
    if args.rescore:
        overrides: dict = {}
        for item in args.set:
            m = re.fullmatch(r"(?:(\d+,[\d.]+):)?(\w+)=(.+)", item)
            if not m:
                p.error(f"--set {item!r}: expected [WORLD,RATE:]FIELD=JSON")
            where, key, val = m.groups()
            overrides.setdefault(where or "*", {})[key] = json.loads(val)
        for path in args.rescore:
            rescore(path, overrides)
        return 0
    if args.from_json:
        with open(os.path.join(common.RESULTS, "plan.json")) as f:
            rows = json.load(f)
        report(rows, "sudo python -m benchmarks.bench_plan")
        return 0
    rows = run(args)
    report(rows, ("sudo python -m benchmarks.bench_plan " + " ".join(sys.argv[1:] if argv is None else argv)).strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())
