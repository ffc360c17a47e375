"""Pieces every overlap benchmark shares: the three compiled variants of one model
(baseline, overlapc, compute alone), communication alone, step timing, the timeline
picture and the BENCHMARKS.md table.

Definitions (all measured in the same run, interleaved):
- T_base: torch.compile with overlapc's capture and the same inner compiler, strategy
  "none" and no scheduling: the model's own collectives, each waited on at once.
- T_overlapc: the same with overlapc's rewrites and schedule.
- T_compute: the baseline graphs with every collective replaced by a local stand-in of
  the same shape (a copy): what the step costs without the network.
- T_comm: every collective of the baseline step, replayed back to back with the same
  sizes, with no compute in between.
- overlap efficiency E = (T_base - T_overlapc) / min(T_compute, T_comm): 1.0 means the
  shorter of the two is completely hidden.
"""

from __future__ import annotations

import json
import operator
import os
import random
import statistics
import sys
import time

import torch
import torch.distributed as dist

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")


# ---------------------------------------------------------------------- compute alone


def strip_collectives(gm: torch.fx.GraphModule) -> None:
    """Replace each functional collective and its wait by a local op of the same shape.

    all_gather -> cat of W copies; reduce_scatter -> a copy of the first block; all_reduce
    and even all_to_all -> a copy; uneven all_to_all -> zeros of the size received. The
    copies keep the memory traffic a collective's buffers cost locally; the network and the
    peers' work are gone.
    """
    from overlapc.passes import ops
    from overlapc.passes.build import Builder
    from overlapc.passes.normalize import remove_dead_nodes

    graph = gm.graph
    for coll in [n for n in graph.nodes if ops.is_collective(n)]:
        wait = ops.wait_of(coll)
        if wait is None:
            continue
        b = Builder(graph, like=coll)
        x = coll.args[0]
        # Right after the collective: its size queries (sym_size) may come before its wait.
        with graph.inserting_before(coll.next):
            if coll.target is ops.ALL_GATHER:
                local = b.call(ops.aten.cat.default, [x] * coll.args[1])
            elif coll.target is ops.REDUCE_SCATTER:
                block = ops.shape(x)[0] // coll.args[2]
                local = b.contiguous(b.slice(x, 0, 0, block))
            elif _same_shape(ops.shape(coll), ops.shape(x)):
                # Even (an all-to-all traced with split lists too: equal ones). A copy, not
                # zeros: a dropless MoE's exchange of per-expert counts must keep counts that
                # add up, as if every rank routed like this one (zeros gave its experts no
                # rows: compute alone ran about a tenth of the step's GEMM time).
                local = b.contiguous(x)
            elif coll.target is ops.ALL_TO_ALL and isinstance(coll.args[1], (list, tuple)) and coll.args[1]:
                # Uneven (run-time splits): as many rows as this rank receives; zeros, since
                # the peers' rows are gone. Its size is the sum of the output splits.
                rows = coll.args[1][0]
                for s in coll.args[1][1:]:
                    rows = b.call(operator.add, rows, s)
                # aten.full, not new_zeros: under inductor this pass runs after its
                # decompositions, which turn new_zeros into full (a fallback for it is refused).
                # full alone would not read x, and dead-code elimination would then drop the
                # GEMM that made x (the experts' down projection): x is read once (summed in
                # fp32, no fp16 overflow), added as 0. A timing stand-in: its values are not used.
                val = x.meta["val"]
                zeros = b.call(ops.aten.full.default, [rows, *ops.shape(x)[1:]], 0, dtype=val.dtype, device=val.device)
                keep = b.call(ops.aten.mul.Tensor, b.call(ops.aten.sum.default, x, dtype=torch.float32), 0)
                local = b.call(ops.aten.add.Tensor, zeros, keep)
            else:
                continue
        wait.replace_all_uses_with(local)
        graph.erase_node(wait)
        coll.replace_all_uses_with(local)  # size queries (sym_size) of the collective itself
        graph.erase_node(coll)
    remove_dead_nodes(graph)
    graph.lint()


def _same_shape(a, b) -> bool:
    from torch.fx.experimental.symbolic_shapes import statically_known_true

    return (
        a is not None
        and b is not None
        and len(a) == len(b)
        and all(statically_known_true(x == y) for x, y in zip(a, b))
    )


# ---------------------------------------------------------------------- comm alone


def collective_calls(report, graphs=("forward", "backward", "inference")) -> list[dict]:
    """The collectives of a compiled step, from its report (every collective is in it)."""
    out = []
    for s in report.sites:
        # all_reduce_sum and all_reduce_rows rows describe rewrites of all-reduces; the
        # collectives they leave are other rows'
        if (
            s.graph in graphs
            and s.shapes.get("input") is not None
            and s.pattern not in ("all_reduce_sum", "all_reduce_rows")
        ):
            out.append(
                {
                    "op": s.collective_op,
                    "shape": s.shapes["input"],
                    "dtype": s.dtype,
                    "graph": s.graph,
                    "group": s.group,
                    "world": s.world_size,
                    "reduce": s.details.get("reduce_op", "sum"),
                }
            )
    # Sizes known only at run time (a dropless MoE's combine sends what its experts got):
    # replayed at the size of the largest all-to-all of known size (the dispatch), evenly split.
    known = [c["shape"][0] for c in out if c["op"] == "all_to_all_single" and isinstance(c["shape"][0], int)]
    for c in out:
        if not all(isinstance(d, int) for d in c["shape"]):
            if c["op"] != "all_to_all_single" or not known or not all(isinstance(d, int) for d in c["shape"][1:]):
                raise ValueError(f"cannot replay {c['op']} of run-time shape {c['shape']}")
            c["shape"] = [max(known), *c["shape"][1:]]
            c["approx"] = True
    return out


def wire_bytes(graphs) -> dict[str, int]:
    """{graph kind: bytes} each rank sends per step, counted from the collectives of the
    compiled graphs as they run (``Backend(keep_graphs=True).graphs``: after every pass, chunks
    and all-to-all forms included) by the textbook ring count: an all-reduce sends 2 (W-1)/W
    of its input, a reduce-scatter and an all-to-all (W-1)/W, an all-gather (W-1) times its
    input. gloo's own reduce-scatter is an all-reduce underneath: it sends twice its count."""
    from overlapc.passes import ops

    share = {
        ops.ALL_REDUCE: lambda w: 2 * (w - 1) / w,
        ops.ALL_GATHER: lambda w: w - 1,
        ops.REDUCE_SCATTER: lambda w: (w - 1) / w,
        ops.ALL_TO_ALL: lambda w: (w - 1) / w,
    }
    out: dict[str, int] = {}
    for kind, gm in graphs:
        for n in gm.graph.nodes:
            if n.op != "call_function" or n.target not in share:
                continue
            v, w = ops.val(n.args[0]), ops.world_size(n)
            if v is None or not w:
                continue
            out[kind] = out.get(kind, 0) + round(v.numel() * v.element_size() * share[n.target](w))
    return out


def replay_comm(calls: list[dict], barrier: bool = True) -> float:
    """Run the collectives one after another, each waited on; seconds."""
    c10d = torch.ops._c10d_functional
    tensors = [torch.ones(c["shape"], dtype=getattr(torch, c["dtype"])) for c in calls]
    if barrier:
        dist.barrier()
    t0 = time.perf_counter()
    for c, x in zip(calls, tensors):
        if c["op"] == "all_gather_into_tensor":
            y = c10d.all_gather_into_tensor(x, c["world"], c["group"])
        elif c["op"] == "reduce_scatter_tensor":
            y = c10d.reduce_scatter_tensor(x, "sum", c["world"], c["group"])
        elif c["op"] == "all_reduce":
            y = c10d.all_reduce(x, "sum", c["group"])
        elif c["op"] == "all_to_all_single":
            n = x.shape[0] // c["world"]
            y = c10d.all_to_all_single(x, [n] * c["world"], [n] * c["world"], c["group"])
        else:
            continue
        c10d.wait_tensor(y)
    return time.perf_counter() - t0


def loaded_times(step, calls: list[dict], group, rounds: int) -> tuple[float, float]:
    """Compute and communication run at once, each as if alone: (T_compute|comm, T_comm|compute).

    A side thread replays the step's collectives ``rounds`` times on ``group`` (a second
    process group, so its collectives never interleave with the main thread's); meanwhile
    the main thread runs the compute-only ``step`` (no collectives: ranks may run different
    counts). Kept: compute steps that ended while the replay still ran, and replay rounds
    (all of them run under compute: the main thread stops only when they are done). Medians,
    the slowest rank's; ``rounds`` must be the same on every rank. On this machine the two
    compete for the same cores (gloo's threads copy, reduce and push bytes through the
    kernel's TCP stack), so overlapping them buys less than min(T_compute, T_comm) here.
    The GIL switch interval is lowered while both run (the side thread would otherwise wait
    up to 5 ms for the main thread's Python after each collective), which also costs the
    main thread's Python a little: part of T_compute|comm.
    """
    import threading

    for c in calls:
        if c["world"] != group.size():
            raise ValueError(f"replaying a {c['op']} of a group of {c['world']} ranks on a group of {group.size()}")
    calls = [{**c, "group": group.group_name} for c in calls]
    replay_comm(calls)  # warm the second group's connections
    comm: list[float] = []
    failed: list[BaseException] = []
    done = threading.Event()
    ended = [0.0]

    def side():
        try:
            for _ in range(rounds):
                comm.append(replay_comm(calls, barrier=False))
        except BaseException as e:  # noqa: BLE001 - re-raised on the main thread, after the peers hear of it
            failed.append(e)
        finally:
            ended[0] = time.perf_counter()
            done.set()

    comp: list[tuple[float, float]] = []
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    try:
        dist.barrier()
        thread = threading.Thread(target=side, daemon=True)
        thread.start()
        while not done.is_set():
            t0 = time.perf_counter()
            step()
            comp.append((time.perf_counter() - t0, time.perf_counter()))
        thread.join()
    finally:
        sys.setswitchinterval(interval)
    kept = [dt for dt, end in comp if end <= ended[0]]
    mine = statistics.median(kept) if kept else -1.0  # -1: none (no NaN through gloo's MAX)
    hi = torch.tensor([mine, statistics.median(comm) if comm else -1.0, float(bool(failed))])
    lo = torch.tensor([mine])
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)  # every rank takes part before any raises
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    if failed:
        raise failed[0]
    if hi[2] > 0:
        raise RuntimeError("the collective replay under compute failed on another rank")
    if lo.item() < 0:
        raise RuntimeError(f"no compute step ended within the {rounds} replay rounds on some rank: give it more rounds")
    return hi[0].item(), hi[1].item()


# ---------------------------------------------------------------------- timing


def kernel_seconds(fn, reps: int) -> float:
    """Median seconds of one call of ``fn``. On a GPU: device time between CUDA events over
    back-to-back calls (``triton.testing.do_bench``, L2 flushed between calls), so the host's
    launch cost -- larger for a Triton launch than for torch.mm -- is not charged to the
    kernel. On the CPU: wall time of ``reps`` synchronous calls after an untimed one."""
    if torch.cuda.is_available():
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=max(20, 5 * reps), return_mode="median") / 1e3
    from overlapc.calibrate import median_seconds

    return median_seconds(fn, max(1, reps))


def timed(fn) -> float:
    """Seconds ``fn`` takes on the slowest rank, starting together."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dt = torch.tensor([time.perf_counter() - t0])
    dist.all_reduce(dt, op=dist.ReduceOp.MAX)
    return dt.item()


def interleaved(steps: dict, iters: int, seed: int = 0) -> dict[str, list[float]]:
    """Time each named step ``iters`` times, in a new order every round: a random
    permutation from ``seed``, the same on every rank (the steps issue collectives). Not a
    rotation: rotating keeps every step right behind the same neighbour every round, so
    whatever one step leaves behind (allocator state, a transfer still draining) always
    lands on the same other one. (Not shown to matter beyond this machine's noise: two
    copies of one ~40 ms program differed by -5% to +11% over 15 rounds either way.)"""
    names = list(steps)
    out = {n: [] for n in names}
    rng = random.Random(seed)
    for _ in range(iters):
        for n in rng.sample(names, len(names)):
            out[n].append(timed(steps[n]))
    return out


def summary(times: dict[str, list[float]], t_comm: list[float], loaded: tuple[float, float] | None) -> dict:
    med = {k: statistics.median(v) for k, v in times.items()}
    tc = statistics.median(t_comm)
    base, ovl, comp = med["base"], med["overlapc"], med["compute"]
    return {
        "t_base": base,
        "t_overlapc": ovl,
        "t_compute": comp,
        "t_comm": tc,
        "speedup": base / ovl,
        "efficiency": (base - ovl) / min(comp, tc),
        "ideal_speedup": base / max(comp, tc),
        "t_compute_loaded": loaded[0] if loaded else None,
        "t_comm_loaded": loaded[1] if loaded else None,
        "spread": {k: [min(v), max(v)] for k, v in times.items()},
    }


# ---------------------------------------------------------------------- exposure

WAIT_LABEL = "overlapc_wait|"


def _labeled_wait(x, label: str):
    from torch.profiler import record_function

    with record_function(label):
        return torch.ops._c10d_functional.wait_tensor.default(x)


def label_waits(gm: torch.fx.GraphModule) -> None:
    """Run each wait of ``gm`` (inner eager) under a profiler label naming what it waits for:
    ``overlapc_wait|<site>|<chunk>|<chunks>|<pattern>``, from the tag the lowering puts on a
    rewritten site's waits; ``...|<collective op> <module>|0|1|whole`` for the others. A
    Python call around the op: microseconds per wait."""
    from overlapc.passes import ops
    from overlapc.passes.lower import SITE_WAIT

    for w in [n for n in gm.graph.nodes if n.target is ops.WAIT]:
        coll = w.args[0]
        tag = w.meta.get(SITE_WAIT)
        if tag is not None:
            site, i, n = tag
            label = f"{WAIT_LABEL}{site}|{i}|{n}|{site.rsplit(':', 1)[-1]}"
        else:
            what = ops.collective_name(coll) if ops.is_collective(coll) else coll.name
            label = f"{WAIT_LABEL}{what} {ops.module_path(coll) or ''}|0|1|whole"
        w.target = _labeled_wait
        w.args = (coll, label)
    gm.recompile()


def wait_exposure(fn) -> dict:
    """One call of ``fn`` under the profiler, split by what ran (rank-local):

    - ``waits``: seconds the main thread spent in each labelled wait (label_waits), by label;
    - ``split``: the call's wall time as compute alone (the main thread busy, no collective
      on gloo's threads: in a wire-bound step, time the link idles), overlapped (both),
      comm alone (the main thread in a wait while a collective runs) and idle (waiting with
      nothing running here: a peer is late), and the step itself.
    """
    from torch.profiler import ProfilerActivity, profile

    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    wall = time.perf_counter() - t0
    waits: dict[str, float] = {}
    wait_iv, comm_iv, starts = [], [], []
    for e in prof.events():
        a, b = e.time_range.start / 1e6, e.time_range.end / 1e6
        starts.append(a)
        if e.name.startswith(WAIT_LABEL):
            key = e.name[len(WAIT_LABEL) :]
            waits[key] = waits.get(key, 0.0) + (b - a)
            wait_iv.append((a, b))
        elif e.name.startswith("gloo:"):
            comm_iv.append((a, b))
    if not starts:
        return {"waits": waits, "split": {}}
    lo = min(starts)
    span = max(e.time_range.end / 1e6 for e in prof.events()) - lo
    w, c = _union(wait_iv), _union(comm_iv)
    both_wait_comm = _overlap(w, c)
    split = {
        "step": min(wall, span) if span > 0 else wall,
        "comm_alone": both_wait_comm,
        "idle": _length(w) - both_wait_comm,
        "overlapped": _length(c) - both_wait_comm,
    }
    split["compute_alone"] = max(0.0, span - _length(w) - split["overlapped"])
    return {"waits": waits, "split": split}


def _union(iv: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(iv):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def _length(iv) -> float:
    return sum(b - a for a, b in iv)


def _overlap(x, y) -> float:
    """Total length where two sorted, disjoint interval lists meet."""
    i = j = 0
    tot = 0.0
    while i < len(x) and j < len(y):
        a, b = max(x[i][0], y[j][0]), min(x[i][1], y[j][1])
        tot += max(0.0, b - a)
        if x[i][1] < y[j][1]:
            i += 1
        else:
            j += 1
    return tot


def exposure_by_cause(waits: dict[str, float]) -> dict[str, float]:
    """Exposed seconds of labelled waits by what a pipeline loses them to:

    - fill: the first chunk of a gather (nothing gathered yet to compute on);
    - drain: the last chunk of a reduce-scatter or all-reduce (nothing left to compute under it);
    - steady: the other chunks (the link slower than the compute between them);
    - whole: collectives that were not chunked (the attention boundary's unrewritten ones, the
      embedding's, sites the plan left alone).

    Chunk positions are a rewrite's wait order: right for the gather and reduce-scatter sites;
    an all-to-all region numbers its dispatch and combine waits together, and micro-batch
    slices carry no tags (their waits count as whole)."""
    out = {"fill": 0.0, "drain": 0.0, "steady": 0.0, "whole": 0.0}
    for label, t in waits.items():
        site, i, n, pattern = label.rsplit("|", 3)
        i, n = int(i), int(n)
        if n <= 1 or pattern == "whole":
            out["whole"] += t
        elif i == 0 and "gather" in pattern:
            out["fill"] += t
        elif i == n - 1 and "gather" not in pattern:
            out["drain"] += t
        else:
            out["steady"] += t
    return out


# ---------------------------------------------------------------------- outputs


def write_json(name: str, data) -> str:
    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, name)
    with open(path, "w") as f:
        json.dump(data, f, indent=2)
    return path


def write_run_report(stem: str, heading: str, section: str, body: str, rows) -> str:
    """A run's own report, benchmarks/reports/DATE_HOST_STEM.md; its rows as results/STEM.json;
    and BENCHMARKS.md's ``section`` replaced by ``body`` with links to every report of ``stem``."""
    import socket

    reports_dir = os.path.join(ROOT, "benchmarks", "reports")
    os.makedirs(reports_dir, exist_ok=True)
    path = os.path.join(reports_dir, f"{time.strftime('%Y-%m-%d_%H%M')}_{socket.gethostname()}_{stem}.md")
    with open(path, "w") as f:
        f.write(f"# {heading}\n\n{time.strftime('%Y-%m-%d %H:%M')} UTC, host {socket.gethostname()}\n\n{body}\n")
    write_json(f"{stem}.json", rows)
    links = ", ".join(
        f"[{f}](benchmarks/reports/{f})" for f in sorted(os.listdir(reports_dir)) if f.endswith(f"_{stem}.md")
    )
    update_benchmarks_md(section, body + f"\n\nThis run and the others: {links}.")
    print(body)
    print(f"wrote {path}")
    return path


def update_benchmarks_md(section: str, body: str) -> str:
    """Replace (or append) the section ``## {section}`` of BENCHMARKS.md."""
    path = os.path.join(ROOT, "BENCHMARKS.md")
    text = open(path).read() if os.path.exists(path) else "# Benchmarks\n"
    head = f"## {section}"
    start = text.find(head)
    block = f"{head}\n\n{body.strip()}\n"
    if start < 0:
        text = text.rstrip() + "\n\n" + block
    else:
        end = text.find("\n## ", start + len(head))
        text = text[:start] + block + (text[end:] if end >= 0 else "")
    with open(path, "w") as f:
        f.write(text)
    return path


def timeline_png(events: list[dict], path: str, title: str) -> str:
    """Two lanes of one step: compute (GEMM chunks highlighted) and communication."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    os.makedirs(os.path.dirname(path), exist_ok=True)
    t0 = min(e["start"] for e in events)
    fig, ax = plt.subplots(figsize=(12, 2.6))
    colors = {"gemm": "#1f77b4", "compute": "#aec7e8", "comm": "#d62728"}
    lanes = {"comm": 1, "gemm": 0, "compute": 0}
    for e in events:
        lane = lanes[e["kind"]]
        ax.broken_barh(
            [((e["start"] - t0) * 1e3, max((e["end"] - e["start"]) * 1e3, 0.05))],
            (lane - 0.4, 0.8),
            facecolors=colors[e["kind"]],
            edgecolor="none",
        )
    ax.set_yticks([0, 1])
    ax.set_yticklabels(["compute (dark: GEMM)", "communication"])
    ax.set_xlabel("ms")
    ax.set_title(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def profile_events(fn) -> list[dict]:
    """Run ``fn`` under the profiler; GEMMs and other ops on the main thread, gloo's work
    on its own threads."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
    evs = []
    main = None
    for e in prof.events():
        name = e.name
        if name.startswith("gloo:"):
            kind = "comm"
        elif name in ("aten::mm", "aten::addmm", "aten::bmm"):
            kind = "gemm"
        elif name.startswith("aten::") or name.startswith("cpp_fused") or name.startswith("graph_"):
            kind = "compute"
        else:
            continue
        if kind != "comm":
            main = main if main is not None else e.thread
            if e.thread != main:
                continue
        evs.append({"name": name, "kind": kind, "start": e.time_range.start / 1e6, "end": e.time_range.end / 1e6})
    # Keep top-level compute events only (nested aten calls overlap their parents).
    evs.sort(key=lambda e: (e["start"], -e["end"]))
    flat, end = [], -1.0
    for e in evs:
        if e["kind"] == "comm" or e["start"] >= end:
            flat.append(e)
            if e["kind"] != "comm":
                end = e["end"]
    return flat
