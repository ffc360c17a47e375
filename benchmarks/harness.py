"""One benchmark driver for every model: compile three variants, calibrate the link,
time them interleaved, replay the collectives, draw a timeline, write the table.

A benchmark module gives a :class:`Bench`: how to build its model on a 1-D mesh (returns
``(module, example_inputs)``), the loss of a training step, and its names. See
benchmarks/common.py for the definitions of T_base, T_overlapc, T_compute, T_comm and E.
"""

from __future__ import annotations

import argparse
import datetime
import importlib
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from benchmarks import common
from overlapc.runtime import adapt, live


@dataclass(frozen=True)
class Bench:
    builder: str
    """"module:function" building (model, inputs) on a 1-D mesh from keyword arguments."""
    stem: str
    """File stem under benchmarks/results/ (json, timeline PNGs)."""
    section: str
    """BENCHMARKS.md section title."""
    title: str
    """What the model is, for timeline titles."""
    describe: str
    """Format string of the table's first line, filled from the model's keyword arguments."""


def _build(cfg):
    mod, fn = cfg["builder"].split(":")
    return getattr(importlib.import_module(mod), fn)


def compute_alone(inner: str):
    """The backend of T_compute: no overlap, and every collective replaced by a local op of
    its shape (common.strip_collectives)."""
    from overlapc import Backend, Options

    return Backend(Options(inner=inner, strategy="none", schedule=False), extra_passes=(common.strip_collectives,))


def _variants(cfg):
    """The three compiled copies of the model (same seed: same weights) and their backends."""
    from torch.distributed.device_mesh import init_device_mesh

    from overlapc import Backend, Options

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    inner = cfg["inner"]
    # Waits under profiler labels, for the exposure breakdown. Inner eager only: the graphs run
    # as they are there, while inductor cannot lower the Python call around each wait.
    label = (common.label_waits,) if cfg.get("exposure") and inner == "eager" else ()
    backends = {
        "base": lambda: Backend(
            Options(inner=inner, strategy="none", schedule=False), extra_passes=label, keep_graphs=True
        ),
        "overlapc": lambda: Backend(
            Options(
                inner=inner,
                strategy="decompose",
                chunks=cfg["chunks"],
                overrides=cfg.get("overrides", {}),
                hardware=cfg.get("hardware"),
            ),
            extra_passes=label,
            keep_graphs=True,
        ),
        "compute": lambda: compute_alone(inner),
    }
    for name, opts in cfg.get("extra", {}).items():  # --variant: more overlapc options, same run
        backends[name] = lambda opts=opts: Backend(
            Options(**{"inner": inner, "hardware": cfg.get("hardware"), **opts}), extra_passes=label, keep_graphs=True
        )
    out = {}
    for name, make in backends.items():
        # Inputs as built: a float input that requires grad stands for an earlier layer's
        # output (the MoE's dispatch all-to-all has a backward only then).
        model, inputs = _build(cfg)(mesh, **cfg["model"])
        be = make()
        out[name] = (torch.compile(model, backend=be), model, be, inputs)
    return out


def _step_fn(compiled, model, inputs, mode, phases: list | None = None):
    """One step; a training step appends its (forward, backward) seconds to ``phases``."""
    if mode == "forward":

        def step():
            with torch.no_grad():
                compiled(*inputs)
    else:

        def step():
            for p in [*model.parameters(), *inputs]:
                if isinstance(p, torch.Tensor):
                    p.grad = None
            t0 = time.perf_counter()
            loss = compiled(*inputs).float().pow(2).mean()
            t1 = time.perf_counter()
            loss.backward()
            if phases is not None:
                phases.append((t1 - t0, time.perf_counter() - t1))

    return step


def _phase_medians(phases: dict[str, list], skip: int) -> dict[str, list[float]]:
    """Per variant, [forward, backward] medians of the timed steps (the first ``skip`` were
    warm-up), at the slowest rank."""
    names = sorted(phases)
    local = torch.tensor([[statistics.median(p[k] for p in phases[n][skip:]) for k in (0, 1)] for n in names])
    dist.all_reduce(local, op=dist.ReduceOp.MAX)
    return {n: local[i].tolist() for i, n in enumerate(names)}


def bench_job(cfg: dict) -> dict:
    """On every rank: compile, warm up, time interleaved; comm replay; one profiled step."""
    torch.manual_seed(0)
    # Run-time split sizes (.tolist(), the dropless MoE) stay in the graph, as symbols;
    # otherwise dynamo breaks the graph there and specialises each rank on its own sizes.
    torch._dynamo.config.capture_scalar_outputs = cfg["model"].get("form") == "dropless"
    variants = _variants(cfg)
    phases = {n: [] for n in variants}
    steps = {
        n: _step_fn(c, m, x, cfg["mode"], phases[n])
        for n, (c, m, be, x) in variants.items()
        if n in cfg.get("variants", variants)
    }
    # Compile, warm up, and let option adapt settle: a graph it races runs the planned and the
    # captured program alternately for 2 * (1 + adapt) calls before it keeps one; timing those
    # calls would time a mix of the two, not what a training job runs from then on.
    settle = adapt.settle_calls(max((be.options.adapt for _, _, be, _ in variants.values()), default=0))
    # The first call compiles (forward and backward); what the live-group measurement spent
    # in it is live.SPENT's new entries (rank 0's; every rank measures together).
    first = {}
    for n, s in steps.items():
        seen = len(live.SPENT)
        first[n] = {"t": common.timed(s), "measure": live.SPENT[seen:]}
    for s in steps.values():
        for _ in range(settle - 1):
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
    per_phase = None
    if cfg["mode"] == "train" and cfg.get("phases"):
        # Forward and backward apart: their own medians, and each graph's collectives replayed alone.
        per_phase = {"steps": _phase_medians({n: phases[n] for n in steps}, settle)}
        per_phase["comm"] = [
            statistics.median(
                common.replay_comm(common.collective_calls(variants["base"][2].report, (g,))) for _ in range(3)
            )
            for g in ("forward", "backward")
        ]
    # Both at once, each timed as if alone: how much each slows the other on these cores.
    # Rounds enough for ~3 compute steps under them, the same on every rank (replay_comm's
    # times are each rank's own: a count taken from them differed between ranks and hung).
    rounds = torch.tensor([max(3, math.ceil(3 * statistics.median(times["compute"]) / statistics.median(comm)))])
    dist.all_reduce(rounds, op=dist.ReduceOp.MAX)
    # Its own group, with a short timeout: a replay stuck on one rank fails every rank
    # within a minute; the row keeps its other numbers.
    side = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=60))
    try:
        loaded = common.loaded_times(steps["compute"], calls, side, rounds=int(rounds.item()))
    except Exception as e:  # noqa: BLE001 - reported in the row, not fatal to the benchmark
        loaded = None
        print(f"compute-under-comm measurement failed: {type(e).__name__}: {str(e)[:200]}", flush=True)
    result = common.summary(times, comm, loaded)
    result["times"] = times
    result["compile"] = {
        n: {
            "first_s": f["t"],
            "compile_s": f["t"] - statistics.median(times[n]),
            "measure_s": sum(m["seconds"] for m in f["measure"]),
            "graphs": len(f["measure"]),
            "measured": sum(m["measured"] for m in f["measure"]),
            "cached": sum(m["cached"] for m in f["measure"]),
        }
        for n, f in first.items()
        if n in times
    }
    if per_phase is not None:
        result["phases"] = per_phase
    if cfg.get("exposure"):  # one profiled step each, rank 0's waits
        result["exposure"] = {n: common.wait_exposure(s) for n, s in steps.items() if n != "compute"}
    denom = min(result["t_compute"], result["t_comm"])
    result["variants"] = {}
    for name, opts in cfg.get("extra", {}).items():
        t = statistics.median(times[name])
        result["variants"][name] = {
            "options": opts,
            "t": t,
            "speedup": result["t_base"] / t,
            "efficiency": (result["t_base"] - t) / denom,
            # what option adapt measured and kept, per graph (its rows share one verdict)
            "adapted": sorted(
                {
                    (
                        s.graph,
                        s.details["measured"]["kept"],
                        s.details["measured"]["planned_ms"],
                        s.details["measured"]["baseline_ms"],
                        s.details["measured"].get("alternative_ms"),
                    )
                    for s in variants[name][2].report.sites
                    if s.details.get("measured")
                }
            ),
            # the form each lowered kind ran in (passes/forms.py); gloo's own where absent
            "forms": sorted(
                {
                    f"{k[:-3]}: {v}"
                    for s in variants[name][2].report.sites
                    for k, v in s.details.items()
                    if k.endswith("_as")
                }
            ),
            # what the variant's planner decided per site: a gap to the best variant starts here
            "plan": {s.name: _plan_cell(s) for s in variants[name][2].report.sites if s.pattern != "collective"},
        }
    # Bytes each compiled step sends, by graph, counted from the graphs as they run.
    result["wire"] = {
        name: common.wire_bytes(be.graphs or []) for name, (_, _, be, _) in variants.items() if name != "compute"
    }
    result["n_collectives"] = len(calls)
    result["comm_approx"] = any(c.get("approx") for c in calls)
    rep = variants["overlapc"][2].report
    # The cost model's view of the same step: what the rewritten sites are predicted to save
    # (base - planned, under the calibrated profile); the rest of the step is taken as measured.
    saving = predicted_saving(rep)
    result["predicted_saving"] = saving
    result["predicted_speedup"] = result["t_base"] / (result["t_base"] - saving) if saving < result["t_base"] else None
    result["sites"] = {
        "rewritten": sum(1 for s in rep.sites if s.status == "rewritten"),
        "chunks": {s.name: s.chunks for s in rep.sites if s.status == "rewritten"},
        "skipped": [f"{s.name}: {s.reason}" for s in rep.sites if s.status == "skipped"],
    }
    if cfg.get("profile"):  # every rank runs the step; rank 0's timeline is kept
        result["timeline"] = common.profile_events(steps["overlapc"])
        result["timeline_base"] = common.profile_events(steps["base"])
    return result


def _plan_cell(site) -> str:
    if site.status == "rewritten":
        return f"{site.strategy} x{site.chunks}"
    return f"{site.status}: {site.reason or ''}"[:160]


def predicted_saving(report) -> float:
    """Seconds the rewritten sites of a report are predicted to save (base - planned, at
    their chunk counts): the cost model's view of a step, the rest taken as measured."""
    saving = 0.0
    for s in report.sites:
        p = s.details.get("predicted")
        if s.status != "rewritten" or not p:
            continue
        if s.pattern == "microbatch":  # slices microbatches="auto" chose: their region's pipeline
            saving += (p["base_ms"] - p["sliced_ms"]) / 1e3
            continue
        planned = p.get("fused_ms") if s.strategy == "fuse" else p["by_chunks_ms"].get(str(s.chunks))
        if planned is not None:
            saving += (p["base_ms"] - planned) / 1e3
    return saving


def calibrate_job():
    from overlapc.calibrate import measure

    return measure(name="emulated-cluster")


def _calibrated_profile(world, world_size: int, rate: float) -> tuple[str, dict]:
    """`overlapc calibrate` inside the cluster: the profile's path (a temporary file) and the profile."""
    import json
    import tempfile

    prof = world.run(calibrate_job)[0]
    prof["name"] = f"emulated-w{world_size}-{rate:g}mbit"
    fd, path = tempfile.mkstemp(suffix=".json", prefix="overlapc-profile-")
    with os.fdopen(fd, "w") as f:
        json.dump(prof, f)
    os.chmod(path, 0o644)
    return path, prof


def run_calibrated(world_size: int, rate: float, job, *args) -> tuple[object, dict]:
    """``job(profile_path, *args)`` on every rank of an emulated cluster of ``world_size``
    ranks at ``rate`` Mbit/s, under a profile calibrated inside it first: rank 0's result,
    and the profile."""
    from overlapc.testing.cluster import EmulatedCluster

    EmulatedCluster.cleanup_stale()
    with EmulatedCluster(world_size, rate_mbit=rate) as cluster:
        with cluster.world(timeout=1800) as world:
            path, prof = _calibrated_profile(world, world_size, rate)
            try:
                return world.run(job, path, *args)[0], prof
            finally:
                os.unlink(path)


def _opts(rows, name: str) -> str:
    opts = next(r["variants"][name]["options"] for r in rows if name in r.get("variants", {}))
    return ", ".join(f"{k}={v}" for k, v in opts.items())


def parse_variants(specs) -> dict[str, dict]:
    """``--variant NAME OPTION=VALUE ...`` (repeated) -> {NAME: {OPTION: value}}; values read as
    JSON where they parse (2, true, "auto"), else as strings; checked by Options."""
    import json

    from overlapc import Options

    out = {}
    for name, *pairs in specs or []:
        opts = {}
        for kv in pairs:
            k, sep, v = kv.partition("=")
            if not sep:
                raise SystemExit(f"--variant {name}: expected OPTION=VALUE, got {kv!r}")
            try:
                opts[k] = json.loads(v)
            except ValueError:
                opts[k] = v
        Options.from_user(opts)  # a wrong name or value is an OverlapError naming it
        out[name] = opts
    return out


def run(bench: Bench, model: dict, args, **cfg_extra) -> list[dict]:
    """Every (world, mode) of ``args`` in its own cluster; ``cfg_extra`` goes to bench_job
    (phases=True: forward and backward apart; exposure=True: labelled waits)."""
    from overlapc.testing.cluster import EmulatedCluster

    rows = []
    extra = parse_variants(args.variant)  # a wrong option fails here, before any cluster is built
    EmulatedCluster.cleanup_stale()
    for world_size in args.world_sizes:
        for mode in args.modes:
            cfg = dict(
                builder=bench.builder,
                model=model,
                inner=args.inner,
                chunks=args.chunks,
                extra=extra,
                mode=mode,
                iters=args.iters,
                **cfg_extra,
            )
            rate = 400.0 if args.rate == "auto" else float(args.rate)
            # A cache of its own per cluster: "no prior calibration" means no measurements of
            # another run (same hosts, another link rate) either.
            with EmulatedCluster(world_size, rate_mbit=rate) as cluster, tempfile.TemporaryDirectory() as cache:
                with cluster.world(timeout=3600, env={"OVERLAPC_CACHE": cache}) as world:
                    if args.rate == "auto":
                        # T_comm scales with 1/rate: aim at T_comm == T_compute.
                        for _ in range(2):
                            cal = world.run(bench_job, {**cfg, "calibrate": True})[0]
                            rate = rate * cal["t_comm"] / cal["t_compute"]
                            cluster.set_rate(round(rate, 1))
                            print(
                                f"  calibrate w{world_size} {mode}: compute {cal['t_compute'] * 1e3:.0f} ms, "
                                f"comm {cal['t_comm'] * 1e3:.0f} ms -> rate {rate:.0f} Mbit/s",
                                flush=True,
                            )
                    # chunks="auto" is the planner's count: plan with this cluster's profile.
                    profile_path, prof = _calibrated_profile(world, world_size, rate)
                    try:
                        res = world.run(bench_job, {**cfg, "profile": args.timeline, "hardware": profile_path})[0]
                    finally:
                        os.unlink(profile_path)
            # The profile the planner used: its choices can be re-derived offline (fake world).
            res.update(
                world_size=world_size,
                mode=mode,
                rate_mbit=round(rate, 1),
                inner=args.inner,
                chunks=args.chunks,
                model=model,
                profile=prof,
            )
            print(
                f"w{world_size} {mode:8s} rate {rate:6.0f} Mbit/s  base {res['t_base'] * 1e3:7.1f} ms  "
                f"overlapc {res['t_overlapc'] * 1e3:7.1f} ms  compute {res['t_compute'] * 1e3:7.1f} ms  "
                f"comm {res['t_comm'] * 1e3:7.1f} ms  speedup {res['speedup']:.2f}x  E {res['efficiency']:.2f}  "
                f"predicted {res['predicted_speedup'] or float('nan'):.2f}x  loaded compute "
                f"{(res['t_compute_loaded'] or float('nan')) * 1e3:.1f} ms "
                f"comm {(res['t_comm_loaded'] or float('nan')) * 1e3:.1f} ms",
                flush=True,
            )
            for name, v in res.get("variants", {}).items():
                print(
                    f"    variant {name} {v['options']}: {v['t'] * 1e3:7.1f} ms  speedup {v['speedup']:.2f}x  "
                    f"E {v['efficiency']:.2f}",
                    flush=True,
                )
                for site, cell in v.get("plan", {}).items():
                    print(f"        {site}: {cell}", flush=True)
            rows.append(res)
    return rows


def report(bench: Bench, rows, args, cmd: str, extra: str = "") -> None:
    # One section (and file set) per inner compiler, so an inductor run keeps the eager table.
    tag = "" if args.inner == "eager" else f"_{args.inner}"
    for r in rows:
        for key, who in (("timeline", "overlapc"), ("timeline_base", "baseline")):
            tl = r.pop(key, None)
            if not tl:
                continue
            suffix = "" if who == "overlapc" else "_baseline"
            name = f"timeline_{bench.stem}{tag}_w{r['world_size']}_{r['mode']}{suffix}.png"
            common.timeline_png(
                tl,
                os.path.join(common.RESULTS, name),
                f"{who}, {bench.title}, world {r['world_size']}, {r['mode']} step, rank 0",
            )
            if who == "overlapc":
                r["timeline_png"] = f"benchmarks/results/{name}"
    common.write_json(f"{bench.stem}{tag}.json", rows)
    lines = [
        bench.describe.format(**rows[0]["model"]) + f", inner={rows[0]['inner']}, chunks={rows[0]['chunks']}, "
        f"emulated cluster (one network namespace per rank, veth + bridge, tbf), one torch thread per rank, "
        f"2 CPU cores. Medians of {args.iters} interleaved steps; T_comm = the step's collectives replayed "
        "alone; T_compute = the step with collectives replaced by local copies. "
        "E = (T_base - T_overlapc) / min(T_compute, T_comm).",
        "",
        f"Reproduce: `{cmd}`",
        "",
        "| world | step | link Mbit/s | T_base ms | T_overlapc ms | T_compute ms | T_comm ms | speedup | E "
        "| ideal speedup "
        "| predicted speedup | compute under comm | comm under compute |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        pred = f"{r['predicted_speedup']:.2f}x" if r.get("predicted_speedup") else "n/a"
        lines.append(
            f"| {r['world_size']} | {r['mode']} | {r['rate_mbit']:.0f} | {r['t_base'] * 1e3:.1f} | "
            f"{r['t_overlapc'] * 1e3:.1f} | {r['t_compute'] * 1e3:.1f} | {r['t_comm'] * 1e3:.1f} | "
            f"{r['speedup']:.2f}x | {r['efficiency']:.2f} | {r['ideal_speedup']:.2f}x | {pred} | "
            + (
                f"{r['t_compute_loaded'] / r['t_compute']:.2f}x slower | "
                f"{r['t_comm_loaded'] / r['t_comm']:.2f}x slower |"
                if r.get("t_compute_loaded")
                else "n/a | n/a |"
            )
        )
    lines += [
        "",
        "Predicted speedup: the measured T_base less what the cost model, under the profile "
        "calibrated inside this cluster in the same run, predicts the rewritten sites save at the "
        "chunk counts they got (the step's other compute taken as measured).",
        "",
        "Compute under comm: the compute-only step timed while a side thread replays the step's "
        "collectives on a second process group, against the step alone; comm under compute: those "
        "replays against the replay alone. Here both compete for the same 2 cores (gloo's threads "
        "copy, reduce and push the bytes through the kernel's TCP stack, and every message waits "
        "for a core to wake its thread), so overlap buys less than min(T_compute, T_comm). The "
        "replay issues its collectives one at a time, each waited on; under load each one's "
        "wake-ups queue behind busy cores, so for steps of many short collectives (forward) the "
        "second ratio over-states what overlapc's concurrent chunks pay.",
    ]
    names = list(dict.fromkeys(n for r in rows for n in r.get("variants", {})))
    if names:
        lines += [
            "",
            "Other overlapc options timed in the same interleaved run (same T_base, T_compute, T_comm; "
            "speedup against T_base):",
            "",
            "| world | step | " + " | ".join(f"{n}: {_opts(rows, n)}" for n in names) + " |",
            "|---|---|" + "---|" * len(names),
        ]
        for r in rows:
            v = r.get("variants", {})
            lines.append(
                f"| {r['world_size']} | {r['mode']} | "
                + " | ".join(
                    f"{v[n]['t'] * 1e3:.1f} ms, {v[n]['speedup']:.2f}x, E {v[n]['efficiency']:.2f}" if n in v else "n/a"
                    for n in names
                )
                + " |"
            )
    pngs = [r["timeline_png"] for r in rows if r.get("timeline_png")]
    if pngs:
        lines += [
            "",
            "One overlapc step (rank 0): GEMM chunks (dark blue) run while collectives (red) are "
            "on the wire. Baseline timelines are beside them (`*_baseline.png`).",
            "",
        ]
        lines += [f"![timeline]({p})" for p in pngs[:2]]
    if any(r.get("comm_approx") for r in rows):
        extra = (
            "T_comm is approximate: all-to-alls whose sizes are known only at run time (the "
            "dropless combine) are replayed at the dispatch's size, split evenly. " + extra
        ).strip()
    if extra:
        lines += ["", extra]
    section = bench.section if not tag else f"{bench.section}, inner={args.inner}"
    common.update_benchmarks_md(section, "\n".join(lines))


def parser(prog: str) -> argparse.ArgumentParser:
    """The options every benchmark takes; a benchmark adds its model's own."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--modes", nargs="+", default=["train", "forward"], choices=["train", "forward"])
    p.add_argument("--rate", default="auto", help="link rate in Mbit/s, or 'auto' (T_comm ~ T_compute)")
    p.add_argument("--inner", default="eager", choices=["eager", "inductor"])
    p.add_argument("--chunks", default="auto", type=lambda s: s if s == "auto" else int(s))
    p.add_argument("--iters", type=int, default=7)
    p.add_argument(
        "--variant",
        nargs="+",
        action="append",
        type=str,
        metavar=("NAME", "OPTION=VALUE"),
        help="also time overlapc with these options in the same interleaved run, e.g. "
        "--variant mb2 microbatches=2 strategy=none (repeatable; reported in the JSON and printed)",
    )
    p.add_argument("--no-timeline", dest="timeline", action="store_false")
    p.add_argument("--default-cmd", action="store_true", help=argparse.SUPPRESS)
    return p


def main(bench: Bench, args, model: dict, default_cmd: str, module: str) -> int:
    rows = run(bench, model, args)
    cmd = default_cmd if args.default_cmd else f"python -m {module} " + " ".join(sys.argv[1:])
    report(bench, rows, args, cmd)
    return 0
