"""What ``overlapc plan`` prints and draws: per-site predictions of the cost model, and a
timeline of one step (Chrome trace JSON that Perfetto opens, and a PNG) for a cluster that
is not here.

The timeline lays the modelled sites end to end in graph order (forward, then backward):
baseline (collective, then its GEMMs, or the reverse) above the planned pipeline. Compute
that is part of no site (attention, norms, the optimizer) is not modelled and not drawn.
"""

from __future__ import annotations

import json

from .options import Options
from .report import Report


def _rows(report: Report):
    """Sites with a per-site prediction. A micro-batch row's prediction prices its slices as a
    whole (no stages of one site): it is not drawn, and the sites inside it show as skipped."""
    return [s for s in report.sites if s.details.get("predicted") and s.pattern != "microbatch"]


def _ms(x: float) -> str:
    return f"{x:.3f}"


def plan_table(report: Report, opts: Options) -> str:
    rows = _rows(report)
    prof = rows[0].details["predicted"]["profile"] if rows else (opts.hardware or "default")
    head = ["graph", "site", "pattern", "status", "plan", "comm ms", "gemm ms", "base ms", "planned ms", "gain"]
    lines = []
    tb = tp = 0.0
    for s in rows:
        p = s.details["predicted"]
        planned = p["best_ms"] if s.status == "rewritten" else p["base_ms"]
        tb, tp = tb + p["base_ms"], tp + planned
        plan = f"{s.strategy}/{s.chunks}" if s.status == "rewritten" else "skip"
        lines.append(
            [
                s.graph,
                s.module or "",
                s.pattern,
                s.status,
                plan,
                _ms(p["comm_ms"]),
                _ms(p["gemm_ms"]),
                _ms(p["base_ms"]),
                _ms(planned),
                f"{(p['base_ms'] - planned) / p['base_ms']:.1%}",
            ]
        )
    widths = [max(len(str(r[i])) for r in [head] + lines) for i in range(len(head))]
    fmt = lambda r: "  ".join(str(c).ljust(w) for c, w in zip(r, widths))  # noqa: E731
    out = [f"profile: {prof}", fmt(head), fmt(["-" * w for w in widths])] + [fmt(r) for r in lines]
    if rows:
        out.append(
            f"modelled sites: {tb:.3f} ms -> {tp:.3f} ms ({tb / tp if tp else 1:.2f}x on the sites alone; "
            "the step's other compute is not modelled)"
        )
    skipped = [s for s in report.sites if s.status == "skipped" and s.pattern != "collective"]
    for s in skipped:
        out.append(f"skipped {s.name}: {s.reason}")
    for s in rows:
        if s.details.get("fuse_not_taken"):
            out.append(
                f"not fused {s.name}: predicted {_ms(s.details['predicted']['fused_ms'])} ms fused, but "
                f"{s.details['fuse_not_taken']}"
            )
    return "\n".join(out)


def plan_json(report: Report, opts: Options) -> str:
    return json.dumps(
        [
            {
                "name": s.name,
                "status": s.status,
                "strategy": s.strategy,
                "chunks": s.chunks,
                "reason": s.reason,
                **s.details["predicted"],
                **({"fuse_not_taken": s.details["fuse_not_taken"]} if s.details.get("fuse_not_taken") else {}),
            }
            for s in _rows(report)
        ],
        indent=1,
    )


def timeline(report: Report, opts: Options):
    """(baseline events, planned events) of one step: (lane, label, start_s, dur_s, site)."""
    from overlapc.passes import cost

    prof = cost.load_profile(opts.hardware)
    base_ev, plan_ev = [], []
    tb = tp = 0.0
    for s in _rows(report):
        p = s.details["predicted"]
        strategy = s.strategy if s.status == "rewritten" else None
        b, e = cost.site_events(p, s.world_size, prof, strategy, s.chunks)
        base_ev += [(lane, lab, tb + t, d, s.name) for lane, lab, t, d in b]
        plan_ev += [(lane, lab, tp + t, d, s.name) for lane, lab, t, d in e]
        tb += max(t + d for _, _, t, d in b)  # the next site starts when this one has ended
        tp += max(t + d for _, _, t, d in e)
    return base_ev, plan_ev


def write_trace(report: Report, opts: Options, path: str) -> list[str]:
    base_ev, plan_ev = timeline(report, opts)
    events = []
    for pid, evs in ((0, base_ev), (1, plan_ev)):
        events.append(
            {
                "ph": "M",
                "name": "process_name",
                "pid": pid,
                "tid": 0,
                "args": {"name": "baseline" if pid == 0 else "overlapc plan"},
            }
        )
        for tid, lane in ((0, "compute"), (1, "comm")):
            events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": lane}})
        for lane, label, t, d, site in evs:
            events.append(
                {
                    "ph": "X",
                    "name": label,
                    "cat": lane,
                    "pid": pid,
                    "tid": 0 if lane == "compute" else 1,
                    "ts": t * 1e6,
                    "dur": d * 1e6,
                    "args": {"site": site},
                }
            )
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
    written = [path]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return written
    fig, ax = plt.subplots(figsize=(12, 2.6))
    rows = {("baseline", "compute"): 3, ("baseline", "comm"): 2, ("plan", "compute"): 1, ("plan", "comm"): 0}
    for which, evs in (("baseline", base_ev), ("plan", plan_ev)):
        for lane, _label, t, d, _ in evs:
            y = rows[(which, lane)]
            ax.broken_barh(
                [(t * 1e3, d * 1e3)],
                (y - 0.4, 0.8),
                color="#1f4e9c" if lane == "compute" else "#c0392b",
                edgecolor="white",
                linewidth=0.3,
            )
    ax.set_yticks(list(rows.values()))
    ax.set_yticklabels([f"{w} {lane}" for (w, lane) in rows])
    ax.set_xlabel("ms (modelled sites only, end to end)")
    prof = next((s.details["predicted"]["profile"] for s in _rows(report)), opts.hardware)
    tb = max((t + d for _, _, t, d, _ in base_ev), default=0) * 1e3
    tp = max((t + d for _, _, t, d, _ in plan_ev), default=0) * 1e3
    ax.set_title(f"overlapc plan, profile {prof}: {tb:.2f} ms -> {tp:.2f} ms", fontsize=10)
    fig.tight_layout()
    png = path.rsplit(".", 1)[0] + ".png"
    fig.savefig(png, dpi=110)
    plt.close(fig)
    return written + [png]
