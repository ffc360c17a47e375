"""Benchmark: what `backend="overlapc"` does with no options and no calibration, beside the
best variant, at several link rates (issue 32's targets).

    sudo python -m benchmarks.bench_defaults [--model tp_sp|moe] [--rates 60 250 1000]
                                             [--world-sizes 2 4] [--modes train forward]

Per (rate, world, mode), one emulated cluster and one interleaved run (benchmarks/harness.py)
times the baseline and, in the same run:

- default: no options at all (``hardware=None``: the machine's profile);
- again: the default options compiled a second time in the same process: its live-group
  measurements hit the cache (what a recompile costs), and its gap to "default" is the run's
  noise between two copies of one program;
- decompose: ``strategy="decompose"``, counts by the planner under a profile calibrated inside
  this cluster (the harness's overlapc row);
- auto-calibrated: ``strategy="auto"`` under that calibrated profile;
- slices: ``microbatches=2, strategy="none"`` (reduce-scatters as all-to-alls, as the others
  run them on gloo: strategy "none" alone keeps the backend's own);
- native AG: the defaults with ``all_gather="native"``: what running all-gathers as all-to-alls
  on gloo (passes/forms.py) adds to the default, in the same run (reduce-scatters as
  all-to-alls: report 2026-12-07_0922 has the same column for ``reduce_scatter="native"``).

"default / best" is the default's speedup over the best of the last three. Writes
benchmarks/reports/DATE_HOST_defaults_MODEL.md and a section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import sys

from benchmarks import common, harness

MODELS = {
    # Small enough that a step takes well under a second at 60 Mbit/s (wire-bound there).
    "tp_sp": (
        "overlapc.models.llama:build_tp_sp",
        "TP+SP Llama",
        dict(n_layers=1, dim=512, n_heads=8, ffn_dim=1408, vocab_size=256, batch=2, seq=256),
    ),
    "moe": (
        "overlapc.models.moe:build_ep",
        "EP MoE (capacity form)",
        dict(dim=256, hidden=512, n_experts=8, top_k=2, tokens=256),
    ),
}
VARIANTS = [
    ["default", "hardware=null"],
    ["again", "hardware=null"],
    ["auto-calibrated", "strategy=auto"],
    ["slices", "microbatches=2", "strategy=none", "reduce_scatter=all_to_all"],
    ["native AG", "hardware=null", "all_gather=native"],
]
NATIVE = "native AG"
BEST_OF = ("decompose", "auto-calibrated", "slices")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_defaults")
    p.add_argument("--model", choices=sorted(MODELS), default="tp_sp")
    p.add_argument("--rates", type=float, nargs="+", default=[60, 250, 1000])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--modes", nargs="+", default=["train", "forward"], choices=["train", "forward"])
    p.add_argument("--iters", type=int, default=5)
    args = p.parse_args(argv)
    builder, title, model = MODELS[args.model]
    bench = harness.Bench(builder=builder, stem=f"defaults_{args.model}", section="", title=title, describe="")
    rows = []
    for rate in args.rates:
        run_args = argparse.Namespace(
            world_sizes=args.world_sizes,
            modes=args.modes,
            rate=str(rate),
            inner="eager",
            chunks="auto",
            iters=args.iters,
            variant=VARIANTS,
            timeline=False,
        )
        rows += harness.run(bench, model, run_args)
    cmd = "sudo python -m benchmarks.bench_defaults " + " ".join(sys.argv[1:] if argv is None else argv)
    write_report(args.model, title, model, rows, cmd)
    return 0


def _cell(t_base: float, t: float) -> str:
    return f"{t * 1e3:.0f} ms ({t_base / t:.2f}x)"


def write_report(name: str, title: str, model: dict, rows: list[dict], cmd: str) -> str:
    lines = [
        f"{title} ({', '.join(f'{k} {v}' for k, v in model.items())}, fp32, inner eager), emulated "
        "cluster (one network namespace per rank, veth + tbf), one torch thread per rank, 2 CPU cores. "
        "Medians of interleaved steps; speedups against T_base in the same run.",
        "",
        f"Reproduce: `{cmd}`",
        "",
        "| link Mbit/s | world | step | T_base | T_comm | T_compute | default | again | decompose | "
        f"auto-calibrated | slices | default / best | {NATIVE} |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        v = {n: x["t"] for n, x in r.get("variants", {}).items()}
        v["decompose"] = r["t_overlapc"]
        best = min(v[n] for n in BEST_OF if n in v)
        lines.append(
            f"| {r['rate_mbit']:.0f} | {r['world_size']} | {r['mode']} | {r['t_base'] * 1e3:.0f} ms | "
            f"{r['t_comm'] * 1e3:.0f} ms | {r['t_compute'] * 1e3:.0f} ms | "
            + " | ".join(_cell(r["t_base"], v[n]) if n in v else "n/a" for n in ("default", "again", *BEST_OF))
            + f" | {best / v['default']:.2f} | "
            + (_cell(r["t_base"], v[NATIVE]) if NATIVE in v else "n/a")
            + " |"
        )
    lines += [
        "",
        "What option adapt kept in the first calls (graph: program kept, planned / baseline ms at the slowest "
        "rank, and / alternative ms where the other family raced too), and the form each lowered "
        "collective kind ran in (passes/forms.py):",
        "",
    ]
    for r in rows:
        for n in ("default", "again"):
            got = r.get("variants", {}).get(n, {}).get("adapted") or []
            cells = [
                f"{g}: {kept} ({p:.0f} / {b:.0f}" + ("" if a is None else f" / {a:.0f}") + ")"
                for g, kept, p, b, a in got
            ]
            text = "; ".join(cells) or "no graph raced"
            forms = ", ".join(r.get("variants", {}).get(n, {}).get("forms") or []) or "gloo's own"
            lines.append(
                f"- {r['rate_mbit']:.0f} Mbit/s, world {r['world_size']}, {r['mode']}, {n}: {text}; forms: {forms}"
            )
    lines += [
        "",
        "Compile time the live-group measurement adds (rank 0; first step: the compiling call, forward "
        "and backward; compile: first step minus the median step; measured / cached: collective sizes):",
        "",
        "| link Mbit/s | world | step | default: first step | compile | measurement (graphs, sizes) "
        "| share of compile | again: measurement (cached sizes) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        c = r.get("compile", {})
        d, a = c.get("default"), c.get("again")
        if not d:
            continue
        lines.append(
            f"| {r['rate_mbit']:.0f} | {r['world_size']} | {r['mode']} | {d['first_s']:.1f} s | "
            f"{d['compile_s']:.1f} s | {d['measure_s']:.2f} s ({d['graphs']}, {d['measured']} measured, "
            f"{d['cached']} cached) | {d['measure_s'] / max(d['compile_s'], 1e-9):.0%} | "
            + (f"{a['measure_s'] * 1e3:.1f} ms ({a['cached']})" if a else "n/a")
            + " |"
        )
    body = "\n".join(lines)
    return common.write_run_report(
        f"defaults_{name}",
        f"Defaults against the best variant: {title}",
        f"Defaults against the best variant, {title} (issue 32)",
        body,
        rows,
    )


if __name__ == "__main__":
    sys.exit(main())
