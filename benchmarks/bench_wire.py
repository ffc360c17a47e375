"""Benchmark: the wire-bound configuration (issue 31). A Llama-7B-wide TP+SP block at
100 Mbit/s, where the link, not the cores, is the limit, so what overlap leaves exposed is
the program's structure.

    sudo python -m benchmarks.bench_wire [--rate 100] [--world-sizes 2 4] [--modes train forward]

Per (world, mode), one emulated cluster and one interleaved run (benchmarks/harness.py) times
the baseline, ``strategy="decompose"`` under a profile calibrated in the cluster (the
harness's overlapc row) and, in the same rounds: the defaults (no options), micro-batch slices
and "forms": nothing overlapped, the collectives sent as the all-to-alls overlapc sends on gloo
(the baseline with the same bytes on the wire). Besides the whole-step E it reports:

- compute under comm: the compute-only step while the step's collectives are replayed on
  another group; near 1.0x means the cores are not what limits overlap (wire-bound);
- per-phase E = (T_base - T_overlapc) / sum over forward and backward of
  min(T_compute,p, T_comm,p): a backward cannot start before its forward ends, so the
  whole-step min(T_compute, T_comm) over-states what can be hidden;
- exposure: the seconds rank 0's one compute thread spent waiting for communication in one
  step, by cause (benchmarks/common.exposure_by_cause: fill, drain, steady, whole) and by site.
"""

from __future__ import annotations

import sys

from benchmarks import common, harness

BUILDER = "overlapc.models.llama:build_tp_sp"
TITLE = "TP+SP Llama, 7B-wide"
# Llama-7B's width: compute per byte on the wire grows with dim, and at dim 4096 a training
# step's compute and its collectives take about as long at 100 Mbit/s on this machine.
MODEL = dict(n_layers=1, dim=4096, n_heads=32, ffn_dim=11008, vocab_size=256, batch=1, seq=256)
VARIANTS = [
    ["default", "hardware=null"],
    ["slices", "microbatches=2", "strategy=none"],
    # The captured program with its collectives sent as all-to-alls, as overlapc's rows send them
    # on gloo, and nothing overlapped: the baseline with the same bytes on the wire. gloo's
    # reduce-scatter is an all-reduce moving twice the bytes, so against T_base alone a
    # rewrite's speedup mixes fewer bytes with overlap.
    ["forms", "strategy=none", "reduce_scatter=all_to_all", "all_gather=all_to_all", "schedule=false", "adapt=0"],
]
NAMES = ("decompose", "default", "slices", "forms")
_LABEL = {"overlapc": "decompose"}
"""The harness's name of the decompose row -> this report's."""
_HARNESS = {v: k for k, v in _LABEL.items()}


def main(argv=None) -> int:
    p = harness.parser("python -m benchmarks.bench_wire")
    p.set_defaults(rate="100", iters=5, timeline=False)
    args = p.parse_args(argv)
    args.variant = (args.variant or []) + VARIANTS
    bench = harness.Bench(builder=BUILDER, stem="wire", section="", title=TITLE, describe="")
    rows = harness.run(bench, MODEL, args, phases=True, exposure=True)
    common.write_json("wire.json", rows)  # first: a run takes about an hour
    cmd = "sudo python -m benchmarks.bench_wire " + " ".join(sys.argv[1:] if argv is None else argv)
    write_report(rows, cmd)
    return 0


def _times(r) -> dict[str, float]:
    v = {n: x["t"] for n, x in r.get("variants", {}).items()}
    v["decompose"] = r["t_overlapc"]
    return v


def _e_forms(r, t: float) -> str:
    """E' against the forms variant: the same bytes on the wire, nothing overlapped."""
    forms = r.get("variants", {}).get("forms", {}).get("t")
    if not forms:
        return ""
    hideable = min(r["t_compute"], forms - r["t_compute"])
    return f" (E' {(forms - t) / hideable:.2f})" if hideable > 0 else ""


def _phase_e(r, name: str) -> str:
    ph = r.get("phases")
    if not ph:
        return "n/a"
    key = _HARNESS.get(name, name)
    steps, comm = ph["steps"], ph["comm"]
    if key not in steps:
        return "n/a"
    hideable = [min(c, m) for c, m in zip(steps["compute"], comm)]
    per = [(b - o) / h if h else float("nan") for b, o, h in zip(steps["base"], steps[key], hideable)]
    whole = (r["t_base"] - _times(r)[name]) / sum(hideable)
    return f"{whole:.2f} (fw {per[0]:.2f}, bw {per[1]:.2f})"


def write_report(rows: list[dict], cmd: str) -> str:
    lines = [
        f"{TITLE} ({', '.join(f'{k} {v}' for k, v in MODEL.items())}, fp32, inner eager), emulated cluster "
        "(one network namespace per rank, veth + tbf), one torch thread per rank, 2 CPU cores. Medians of "
        "interleaved steps; speedups and E against T_base in the same run. decompose: strategy decompose "
        "under a profile calibrated in the cluster; default: no options; slices: microbatches=2, "
        "strategy none; forms: nothing overlapped, every all-gather and reduce-scatter sent as all-to-alls "
        "(as overlapc sends them on gloo). E' in brackets: against forms, the baseline with the same bytes "
        "on the wire, E' = (T_forms - T) / min(T_compute, T_forms - T_compute) (forms overlaps nothing, so "
        "its comm is T_forms - T_compute).",
        "",
        f"Reproduce: `{cmd}`",
        "",
        "| link Mbit/s | world | step | T_base | T_comm | T_compute | compute under comm | " + " | ".join(NAMES) + " |",
        "|---|---|---|---|---|---|---|" + "---|" * len(NAMES),
    ]
    for r in rows:
        v = _times(r)
        denom = min(r["t_compute"], r["t_comm"])
        load = f"{r['t_compute_loaded'] / r['t_compute']:.2f}x" if r.get("t_compute_loaded") else "n/a"
        cells = [
            f"{v[n] * 1e3:.0f} ms, {r['t_base'] / v[n]:.2f}x, E {(r['t_base'] - v[n]) / denom:.2f}{_e_forms(r, v[n])}"
            if n in v
            else "n/a"
            for n in NAMES
        ]
        lines.append(
            f"| {r['rate_mbit']:.0f} | {r['world_size']} | {r['mode']} | {r['t_base'] * 1e3:.0f} ms | "
            f"{r['t_comm'] * 1e3:.0f} ms | {r['t_compute'] * 1e3:.0f} ms | {load} | " + " | ".join(cells) + " |"
        )
    train = [r for r in rows if r.get("phases")]
    if train:
        lines += [
            "",
            "Per-phase E (training): (T_base - T) / sum over forward and backward of min(T_compute,p, T_comm,p); "
            "in brackets each phase's own E. Phase times (ms, forward / backward, slowest rank):",
            "",
            "| world | T_compute,p | T_comm,p | " + " | ".join(NAMES) + " |",
            "|---|---|---|" + "---|" * len(NAMES),
        ]
        for r in train:
            ph = r["phases"]
            comp = "/".join(f"{t * 1e3:.0f}" for t in ph["steps"]["compute"])
            comm = "/".join(f"{t * 1e3:.0f}" for t in ph["comm"])
            lines.append(f"| {r['world_size']} | {comp} | {comm} | " + " | ".join(_phase_e(r, n) for n in NAMES) + " |")
    split_rows, cause_rows = [], []
    for r in rows:
        for name, got in r.get("exposure", {}).items():
            label = _LABEL.get(name, name)
            where = f"| {r['world_size']} | {r['mode']} | {label}"
            sp, waits = got.get("split"), got.get("waits")
            if sp:
                split_rows.append(
                    f"{where} | "
                    + " | ".join(
                        f"{sp[k] * 1e3:.0f}" for k in ("step", "compute_alone", "overlapped", "comm_alone", "idle")
                    )
                    + " |"
                )
            kept = [g for g, k, *_ in r.get("variants", {}).get(name, {}).get("adapted", []) if k != "planned"]
            if kept:  # option adapt kept the graph as captured there: its waits carry no labels
                where += f" (adapt kept the captured {', '.join(kept)})"
            if not waits:
                cause_rows.append(f"{where} | n/a | n/a | n/a | n/a | n/a | |")
                continue
            by = common.exposure_by_cause(waits)
            sites: dict[str, float] = {}
            for k, t in waits.items():
                site = k.rsplit("|", 3)[0]
                sites[site] = sites.get(site, 0.0) + t
            top = ", ".join(f"{s} {t * 1e3:.0f}" for s, t in sorted(sites.items(), key=lambda x: -x[1])[:3])
            cause_rows.append(
                f"{where} | "
                + " | ".join(f"{by[c] * 1e3:.0f}" for c in ("fill", "drain", "steady", "whole"))
                + f" | {sum(by.values()) * 1e3:.0f} | {top} |"
            )
    lines += [
        "",
        "Where one profiled step's time went on rank 0 (ms): compute alone (the link idle, which a "
        "wire-bound step cannot afford), overlapped, comm alone (the compute thread waiting on a "
        "collective) and idle (waiting, nothing on the wire here: a late peer):",
        "",
        "| world | step | variant | step | compute alone | overlapped | comm alone | idle |",
        "|---|---|---|---|---|---|---|---|",
        *split_rows,
        "",
        "Exposure: ms rank 0's compute thread waited for communication in one profiled step, by cause "
        "(fill: a gather's first chunk; drain: a reduce-scatter's last; steady: other chunks; whole: "
        "collectives not chunked):",
        "",
        "| world | step | variant | fill | drain | steady | whole | total | top sites |",
        "|---|---|---|---|---|---|---|---|---|",
        *cause_rows,
    ]
    body = "\n".join(lines)
    return common.write_run_report("wire", f"Wire-bound: {TITLE}", f"Wire-bound, {TITLE} (issue 31)", body, rows)


if __name__ == "__main__":
    sys.exit(main())
