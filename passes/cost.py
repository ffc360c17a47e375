"""Cost model: predicted time of a site as it is (baseline) and under each strategy.

All sizes and times are sympy expressions, so the same formulas answer for symbolic
shapes (``M = s0 * 512``); the planner substitutes numbers when it decides.

GEMM: roofline with a saturating efficiency curve::

    t_gemm(F) = F / (peak * eff_max * F / (F + F_half))  =  (F + F_half) / (peak * eff_max)

(``F`` flops; a GEMM of ``F_half`` flops reaches half its best rate: small GEMMs, and the
small chunks a pipeline cuts, run below peak).

Collectives, ring algorithms on a link of latency ``alpha`` (s per step) and bandwidth
``beta`` (bytes/s per rank and direction), ``W`` ranks, ``B`` the bytes of the
collective's input on one rank::

    all_gather      (W-1) * alpha + (W-1) * B / beta
    reduce_scatter  ((W-1) * alpha + (W-1)/W * B / beta) * rs_factor   (gloo: 2, an all-reduce)
    all_reduce      2 * ((W-1) * alpha + (W-1)/W * B / beta)
    all_to_all      (W-1) * alpha + (W-1)/W * B / beta

or, where the profile has a measured curve for the collective (``curves``: bytes of one
rank's input -> seconds, written by ``overlapc calibrate`` for all-gather and all-to-all,
measured on groups of ``curves_world`` ranks, used for groups of that size only) and ``B``
is a number, the time interpolated on that curve: a link's rate per byte need not
be constant (over TCP on a shaped veth a 16 MiB all-to-all runs at 52-66% of the rate of
2 MiB ones, so chunks are cheaper per byte than the whole).

A site is a sequence of stages (:class:`Stage`): AG -> GEMM is [all_gather, gemm], GEMM ->
RS/AR [gemm, reduce_scatter], an all-to-all region e.g. [all_to_all, gemm, all_to_all].
Cut into ``n`` chunks, chunk i of stage s waits for chunk i of stage s - 1, and each lane
(compute, comm) runs its tasks one at a time in the order overlapc's schedule issues them,
stage by stage (:func:`flow`)::

    finish(s, i) = Max(free(lane_s), finish(s - 1, i)) + d(s, i)

plus ``chunk_overhead`` per extra chunk of each collective and the copied bytes at
``copy_bw``. A GEMM that runs while a transfer is in flight is lengthened by
``overlap_loss * Min(its time, the transfer's)``: transfers and GEMMs that overlap still
compete for something (SMs and memory bandwidth on a GPU: NCCL runs on SMs; CPU cores on
the emulated cluster, where TCP over veth is CPU work), measured by ``overlapc calibrate``
as the part of the shorter activity that does not hide. A transfer that runs while GEMMs do
is lengthened by ``comm_loss[kind] * Min(its time, the GEMMs')``: about 0 where the wire is
the bottleneck, up to 1 where moving bytes is CPU work the GEMMs take cores from (calibrated
per kind; an all-to-all reads the all-gather's, an all-reduce the reduce-scatter's). A
reduce-scatter larger than the largest one ``rs_factor`` is fitted on pays the measured
excess ``rs_large`` (a 32 MiB one ran 1.1-1.6x the formula). ``overhead`` is what one more
chunk costs beyond its collective's alpha (issue, wait, launch: calibrated as such), and
the copies are the chunk outputs concatenated back into the original layout (and, for a
reduce-scatter, the GEMM input regrouped by destination rank; for a region, the tensors
read whole and the partial sums). Chunks are sized like the rewrite sizes them
(passes/build.chunk_sizes: weights 1, 2, .., 2, 1). Where chunked reduce-scatters and
all-reduces run concurrently (gloo: overlapc issues them all at once and the group's two
worker threads run two at a time; NCCL on one stream does not), a later chunk's latency
hides under the transfer of the one running beside it: it adds ``Max(its transfer, its
whole time / comm_threads)`` (the link or the threads are the bottleneck). Where one chunk
has several all-gathers or all-to-alls (issued at once), each pays its bytes at the link's
best rate and ``concurrent_excess`` of the rest of its time (:func:`t_link`). A chunked
collective's latency is ``loaded_latency`` times the idle one: its chunks run while the
rank computes the pipeline's GEMMs, and on a busy host every ring step waits longer for a
core (calibrated; 1 where it does not show). Fused (a GPU
with symmetric memory):
``Max(t_gemm / fused_efficiency, t_comm) + t_comm / n_tiles_in_flight`` approximated as
``Max(g / eff_fused, c) + c / 8``.
"""

from __future__ import annotations

import importlib.resources
import json
import os
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path

import sympy

from overlapc.errors import OverlapError
from overlapc.runtime.dropless import chunk_weights

from . import ops

# The built-in profiles: package data of overlapc (pyproject's package-data), wherever it is installed.
PROFILE_DIR = Path(str(importlib.resources.files("overlapc") / "profiles"))
CACHE_DIR = Path(os.environ.get("OVERLAPC_CACHE", Path.home() / ".cache" / "overlapc"))
BUILTIN = ("cpu-local", "cpu-default", "h100-nvlink", "h200-nvlink", "ib-400g")


@dataclass(frozen=True)
class Gemm:
    peak_flops: float  # flop/s, vendor peak (or measured best)
    eff_max: float  # fraction of peak the largest GEMMs reach
    half_flops: float  # flops at which a GEMM reaches half of eff_max * peak
    half_rows: float = 0.0  # rows (M) at which a GEMM's rate halves: a skinny GEMM streams its
    # whole weight for few rows (0: not modelled)
    half_rows_batched: float = 0.0  # the same for batched GEMMs (bmm: M rows per batch entry, e.g. per
    # expert); 0: as half_rows


@dataclass(frozen=True)
class Link:
    alpha: float  # s per ring step
    beta: float  # bytes/s per rank and direction


@dataclass(frozen=True)
class Profile:
    name: str
    source: str
    gemm: dict[str, Gemm]  # by dtype name: "float32", "bfloat16", ...
    link: Link
    chunk_overhead: float  # s per extra chunk (launch, sync, bookkeeping)
    min_gain: float  # predicted gains below this are within the model's error: skip
    rs_factor: float = 1.0  # reduce-scatter cost relative to the ring formula (gloo: 2)
    rs_large: tuple = ()  # ((input bytes, s), ...): a large reduce-scatter's excess over that,
    # 0 at the first point (for groups of curves_world ranks)
    copy_bw: float = 1e12  # bytes/s of a device-local copy (read + write counted once)
    overlap_loss: float = 0.0  # share of the shorter of (transfer, GEMM) that still shows when they overlap
    comm_loss: dict = field(default_factory=dict)  # collective kind -> share of the GEMM time run under a
    # transfer by which that transfer is lengthened
    concurrent_reductions: bool = False  # chunked RS/AR issued at once run concurrently (gloo)
    comm_threads: int | None = None  # collectives a group runs at once (gloo: its 2 worker threads);
    # None: 2 where concurrent_reductions, else 1
    fresh_bytes: float = 0.0  # outputs of at least this many bytes are fresh pages every call (glibc
    # returns them to the OS on free: a GEMM's first write page-faults); 0: none
    fresh_bw: float = 0.0  # bytes/s of that first touch
    loaded_latency: dict = field(default_factory=dict)  # collective kind -> its latency with GEMMs running on
    # the rank, relative to idle (a pipeline's chunks run
    # under its GEMMs; the baseline's do not); absent: 1
    concurrent_excess: float = 1.0  # share of a transfer's time beyond the link's best rate (per-connection
    # inefficiency, latency) that still shows when a chunk's several
    # all-gathers / all-to-alls are issued at once (1: none hides)
    fused_efficiency: float | None = None  # fused kernels' GEMM rate relative to plain GEMMs; None: no fused kernels
    device: str = "cpu"  # what the profile describes ("cuda": a GPU cluster, planned from anywhere)
    curves: dict = field(default_factory=dict)  # collective kind -> ((input bytes per rank, s), ...):
    # measured times, used instead of alpha-beta ...
    curves_world: int | None = None  # ... for groups of this many ranks only
    world_curves: dict = field(default_factory=dict)  # group size -> {kind -> points}: measured on the live
    # group when a graph is compiled (overlapc/runtime/live.py);
    # read before ``curves``
    provenance: dict = field(default_factory=dict)  # (kind, group size) -> "measured" or "cached"

    def curve(self, kind: str, world: int):
        """The measured (bytes, s) points for ``kind`` over ``world`` ranks, or None."""
        live = self.world_curves.get(world, {}).get(kind)
        if live:
            return live
        return self.curves.get(kind) if world == self.curves_world else None

    def numbers_from(self, kind: str, world: int) -> str:
        """Where a collective's time comes from: "measured" or "cached" (the live group),
        "profile" (the profile's measured curve), or "modelled" (its link formula)."""
        if (kind, world) in self.provenance:
            return self.provenance[(kind, world)]
        return "profile" if self.curve(kind, world) else "modelled"

    def gemm_for(self, dtype: str) -> Gemm:
        return self.gemm.get(dtype) or self.gemm.get("float32") or next(iter(self.gemm.values()))


def profile_from_dict(d: dict, path: str | None = None) -> Profile:
    try:
        gemm = {
            k: Gemm(
                float(v["peak_tflops"]) * 1e12,
                float(v["eff_max"]),
                float(v["half_gflop"]) * 1e9,
                float(v.get("half_rows", 0.0)),
                float(v.get("half_rows_batched", 0.0)),
            )
            for k, v in d["gemm"].items()
        }
        link = Link(float(d["link"]["alpha_us"]) * 1e-6, float(d["link"]["beta_gbps"]) * 1e9)
        return Profile(
            name=d["name"],
            source=d["source"],
            gemm=gemm,
            link=link,
            chunk_overhead=float(d["chunk_overhead_us"]) * 1e-6,
            min_gain=float(d["min_gain"]),
            rs_factor=float(d.get("rs_factor", 1.0)),
            copy_bw=float(d.get("copy_gbps", 1000)) * 1e9,
            overlap_loss=float(d.get("overlap_loss", 0.0)),
            comm_loss={k: float(v) for k, v in (d.get("comm_loss") or {}).items()},
            rs_large=tuple((float(b), float(t)) for b, t in d.get("rs_large") or ()),
            concurrent_reductions=bool(d.get("concurrent_reductions", False)),
            comm_threads=d.get("comm_threads"),
            concurrent_excess=float(d.get("concurrent_excess", 1.0)),
            loaded_latency={k: max(1.0, float(v)) for k, v in (d.get("loaded_latency") or {}).items()},
            fresh_bytes=float((d.get("fresh_alloc") or {}).get("bytes", 0.0)),
            fresh_bw=float((d.get("fresh_alloc") or {}).get("gbps", 0.0)) * 1e9,
            fused_efficiency=d.get("fused_efficiency"),
            device=str(d.get("device", "cpu")),
            curves={k: _monotone(v) for k, v in (d.get("curves") or {}).items() if v},
            curves_world=int(d["curves_world"]) if d.get("curves") or d.get("rs_large") else None,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise OverlapError(
            f"hardware profile {path or d.get('name')!r} is malformed: {type(e).__name__}: {e}; "
            f"see {PROFILE_DIR / 'h100-nvlink.json'} for the format"
        ) from e


def _monotone(points) -> tuple:
    """Measured (bytes, s) points sorted by bytes, times made non-decreasing (timing noise
    must not make a chunk cheaper than a smaller one)."""
    out, t_max = [], 0.0
    for b, t in sorted((float(b), float(t)) for b, t in points):
        t_max = max(t_max, t)
        out.append((b, t_max))
    return tuple(out)


def load_profile(name_or_path: str | None = None) -> Profile:
    """A profile by name (built-in, or ``cpu-local`` as written by ``overlapc calibrate``) or
    by the path of a JSON file; None: the profile of the machine this runs on."""
    if name_or_path is None:
        name_or_path = default_profile_name()
    p = Path(name_or_path)
    if name_or_path.endswith(".json") or p.is_file():
        if not p.is_file():
            raise OverlapError(f"option 'hardware': no profile file {name_or_path!r}")
    elif name_or_path == "cpu-local":
        p = CACHE_DIR / "cpu-local.json"
        if not p.is_file():
            raise OverlapError(
                "option 'hardware': profile 'cpu-local' has not been measured on this machine; "
                "run `overlapc calibrate --world-size N` (or use 'cpu-default')"
            )
    else:
        p = PROFILE_DIR / f"{name_or_path}.json"
        if not p.is_file():
            raise OverlapError(
                f"option 'hardware' must be one of {', '.join(repr(b) for b in BUILTIN)} or a "
                f"profile file path; got {name_or_path!r}"
            )
    return _read_profile(str(p), p.stat().st_mtime_ns)


@lru_cache(maxsize=32)
def _read_profile(path: str, mtime_ns: int) -> Profile:
    """Parsed once per file version: Options validation and every planned graph load it."""
    return profile_from_dict(json.loads(Path(path).read_text()), path)


def default_profile_name() -> str:
    """H100/H200 by device name; else cpu-local when calibrated, else cpu-default."""
    try:
        import torch

        if torch.cuda.is_available():
            dev = torch.cuda.get_device_name()
            if "H200" in dev:
                return "h200-nvlink"
            if "H100" in dev:
                return "h100-nvlink"
    except Exception:  # noqa: BLE001
        pass
    return "cpu-local" if (CACHE_DIR / "cpu-local.json").is_file() else "cpu-default"


# ------------------------------------------------------------------ formulas (sympy)
def t_gemm(flops, g: Gemm, rows=None, batched: bool = False):
    """Time of one GEMM call of ``flops`` with ``rows`` rows (M, per batch entry where
    ``batched``; None: not known)."""
    flops = sympy.sympify(flops)
    if flops.is_number and flops == 0:
        return sympy.Integer(0)
    t = (flops + g.half_flops) / (g.peak_flops * g.eff_max)
    rows = sympy.sympify(rows) if rows is not None else None
    h = (g.half_rows_batched or g.half_rows) if batched else g.half_rows
    if rows is not None and h and not (rows.is_number and rows <= 0):
        t = t * (1 + h / rows)
    return t


def t_comm(kind: str, nbytes, world: int, p: Profile):
    """Time of one collective moving ``nbytes`` (this rank's input) over ``world`` ranks."""
    B, W, a, b = sympy.sympify(nbytes), world, p.link.alpha, p.link.beta
    if W <= 1:
        return sympy.Integer(0)
    step = (W - 1) * a
    points = p.curve(kind, W) if B.is_number else None
    if points:
        return sympy.Float(_on_curve(points, float(B), float(step)))
    if kind == "all_gather":
        return step + (W - 1) * B / b
    frac = sympy.Rational(W - 1, W) * B / b
    if kind == "reduce_scatter":
        t = (step + frac) * p.rs_factor
        if p.rs_large and W == p.curves_world and B.is_number and float(B) > p.rs_large[0][0]:
            t = t + sympy.Float(max(0.0, _interp(p.rs_large, float(B))))  # 0 at the first point
        return t
    if kind == "all_reduce":
        return 2 * (step + frac)
    if kind == "all_to_all":
        return step + frac
    raise ValueError(f"unknown collective kind {kind!r}")


def t_link(kind: str, nbytes, world: int, p: Profile):
    """The part of :func:`t_comm` that is bytes on the wire: ``nbytes`` at the best per-byte
    rate the kind's measured curve reaches (what a transfer takes beyond it is latency and a
    connection's inefficiency on big messages), or the formula's bandwidth term."""
    B = sympy.sympify(nbytes)
    points = p.curve(kind, world) if B.is_number else None
    if points:
        return sympy.Float(float(B) * min(t / b for b, t in points))
    return t_comm(kind, B, world, p) - t_comm(kind, 0, world, p)


def _on_curve(points, nbytes: float, latency: float) -> float:
    """Piecewise-linear time of a collective of ``nbytes`` through measured (bytes, s)
    points, from (0, latency); past the largest point, on the slope of the last segment."""
    return _interp([(0.0, min(latency, points[0][1])), *points], nbytes)


def _interp(pts, x: float) -> float:
    """Piecewise-linear through (x, y) points; past the last, on the last segment's slope."""
    for (b0, t0), (b1, t1) in zip(pts, pts[1:]):  # noqa: B007 -- the segment found is used below
        if x <= b1:
            break  # else the last segment, extended
    return t0 + (t1 - t0) * (x - b0) / (b1 - b0) if b1 > b0 else t1


@dataclass(frozen=True)
class Stage:
    """One stage of a site's pipeline, whole (unchunked): GEMMs on the compute lane, or
    collectives on the comm lane. A site is a sequence of stages whose chunk i of stage
    s needs chunk i of stage s - 1 (AG -> mm: [all_gather, gemm]; mm -> RS: [gemm,
    reduce_scatter]; an all-to-all region: e.g. [gemm, all_to_all, gemm, all_to_all, gemm])."""

    lane: str  # "compute" or "comm"
    kind: str  # "gemm", or the collective: "all_gather", "reduce_scatter", ...
    amount: int  # compute: flops; comm: bytes of this rank's inputs (all collectives of the stage)
    count: int = 1  # collectives (or GEMM calls) the stage is made of; each pays its latency per chunk
    rows: int | None = None  # compute: rows (M) of its GEMM calls, whole
    rows_chunked: bool = True  # the chunks cut those rows (else each chunk's GEMMs keep them all)
    after: int = 0  # compute: flops run whole, once, after the stage's last chunk (deferred sums)
    after_count: int = 0  # the GEMM calls of ``after``
    after_rows: int | None = None  # their rows (M)
    batched: bool = False  # compute: its chunked GEMMs are batched (bmm: ``rows`` per batch entry)
    out_bytes: int = 0  # compute: bytes of its GEMM calls' outputs, whole (0: not counted)
    out_whole: bool = False  # compute: the rewrite reassembles those outputs into whole tensors (which
    # are then the fresh allocations, not the chunks' outputs)

    def to_dict(self) -> dict:
        return {
            "lane": self.lane,
            "kind": self.kind,
            "amount": self.amount,
            "count": self.count,
            "rows": self.rows,
            "rows_chunked": self.rows_chunked,
            "after": self.after,
            "after_count": self.after_count,
            "after_rows": self.after_rows,
            "batched": self.batched,
            "out_bytes": self.out_bytes,
            "out_whole": self.out_whole,
        }

    def t_after(self, gemm: Gemm):
        """Time of the deferred GEMMs (whole rows, as in the baseline)."""
        if not self.after:
            return sympy.Integer(0)
        k = max(1, self.after_count)
        return k * t_gemm(sympy.sympify(self.after) / k, gemm, self.after_rows)


def t_fresh(nbytes, p: Profile):
    """First touch of a fresh output of ``nbytes`` (0 below the profile's ``fresh_bytes``)."""
    b = sympy.sympify(nbytes)
    if not (p.fresh_bytes and p.fresh_bw and b.is_number and float(b) >= p.fresh_bytes):
        return sympy.Integer(0)
    return b / p.fresh_bw


def stage_times(st: Stage, fracs: list, world: int, gemm: Gemm, p: Profile) -> list:
    """Per-chunk durations of one stage; ``fracs`` the chunks' shares of the rows."""
    if st.lane == "compute":
        rows = (lambda f: st.rows * f) if st.rows_chunked else (lambda f: st.rows)
        out = sympy.sympify(st.out_bytes) / max(1, st.count)  # one call's output, whole
        return [
            st.count
            * (
                t_gemm(sympy.sympify(st.amount) * f / st.count, gemm, None if st.rows is None else rows(f), st.batched)
                + (t_fresh(out, p) * f if st.out_whole else t_fresh(out * f, p))
            )
            for f in fracs
        ]
    one = [sympy.sympify(st.amount) * f / st.count for f in fracs]  # bytes of one collective per chunk
    each = [t_comm(st.kind, b, world, p) for b in one]
    if st.kind in ("all_gather", "all_to_all") and st.count > 1 and len(fracs) > 1 and p.concurrent_excess < 1:
        # A chunk's collectives (Ulysses: q, k and v) are issued at once by the schedule (the
        # unrewritten graph waits on each before the next): run side by side on the group's
        # threads, each pays its bytes at the link's rate and only ``concurrent_excess`` of
        # the rest. Measured (world 2, 658 Mbit/s, three 8 MiB all-to-alls): 281 ms one after
        # another, 218 ms issued at once; in 2 chunks 233 / 178, in 8 chunks 163 / 158.
        links = [t_link(st.kind, b, world, p) for b in one]
        each = [lk + p.concurrent_excess * (t - lk) for t, lk in zip(each, links)]
    ts = [st.count * t for t in each]
    if len(ts) == 1:
        return ts
    lat = st.count * t_comm(st.kind, 0, world, p)  # the stage's latency, idle
    loaded = _per_kind(p.loaded_latency, st.kind, 1.0)
    if loaded > 1:
        # Chunks run beside the pipeline's GEMMs, and a collective's latency is longer on a
        # rank whose cores are busy (calibrate's loaded_latency; measurements: docs/cost_model.md).
        # The baseline's run alone.
        lat = lat * loaded
        ts = [t + lat * (1 - 1 / loaded) for t in ts]
    if st.kind in ("reduce_scatter", "all_reduce") and p.concurrent_reductions:
        # Issued at once, they run ``comm_threads`` at a time (gloo: ProcessGroupGloo's two
        # worker threads): a chunk after the first adds its transfer where the link is the
        # bottleneck (its latency hides under its neighbour's transfer), or its whole time /
        # comm_threads where latency is. Measured (world 4, 1000 Mbit/s, reduce_scatter_tensor
        # issued async, all waited): 8 chunks of an 8 MiB input 104 ms against 107 ms whole;
        # of a 1 MiB input 30 ms against 13 ms whole; of 16 KiB, 32 ms against 8 ms.
        k = p.comm_threads or ops.GLOO_DEFAULT_THREADS
        ts = [ts[0]] + [sympy.Max(t - lat, t / max(1, int(k))) for t in ts[1:]]
    return ts


def flow(
    durations: list[list], lanes: list[str], loss: float = 0.0, after: list | None = None, comm_loss: list | None = None
):
    """Start times and durations of a chunked pipeline, and its end (sympy or numbers).

    ``durations[s][i]``: chunk i of stage s; ``lanes[s]``: its lane. Each lane runs its
    tasks one at a time in (stage, chunk) order -- the order overlapc's schedule issues
    them: every chunk of a stage is issued before the next stage's first (collectives as
    early as their inputs allow; compute that feeds the earliest collective first) -- and
    chunk i of stage s starts once chunk i of stage s - 1 has finished. A compute task is
    lengthened by ``loss`` times the transfer that runs under it (the next chunk's
    incoming one, the previous chunk's outgoing one; at most its own length): overlapped
    transfers and GEMMs still compete for cores or SMs. A transfer is lengthened by
    ``comm_loss[s]`` times the GEMMs that run under it (the next stage's previous chunk, the
    previous stage's next chunk; at most its own length): where moving bytes is CPU work (TCP
    on an oversubscribed host) the GEMMs slow the transfer too. ``after[s]``: a task on stage s's
    lane once its last chunk is done (chunk index -1 in the events), which nothing waits for
    but which holds the lane.
    Returns (events, end): events are (stage, chunk, start, duration)."""
    free = {lane: sympy.Integer(0) for lane in lanes}
    done: list[list] = []
    events = []
    n = len(durations[0]) if durations else 0

    def beside(s: int, i: int, other: str) -> list:
        """Tasks of the ``other`` lane that run while task (s, i) does: the previous stage's
        next chunk and the next stage's previous chunk."""
        out = []
        if s > 0 and i + 1 < n and lanes[s - 1] == other:
            out.append(durations[s - 1][i + 1])
        if s + 1 < len(lanes) and i > 0 and lanes[s + 1] == other:
            out.append(durations[s + 1][i - 1])
        return out

    for s, (ds, lane) in enumerate(zip(durations, lanes)):
        row = []
        k = loss if lane == "compute" else (comm_loss[s] if comm_loss else 0)
        for i, d in enumerate(ds):
            under = beside(s, i, "comm" if lane == "compute" else "compute") if k else []
            if under:
                d = d + k * sympy.Min(d, sum(under))
            start = free[lane] if s == 0 else sympy.Max(free[lane], done[s - 1][i])
            row.append(start + d)
            free[lane] = start + d
            events.append((s, i, start, d))
        done.append(row)
        if after and after[s]:
            events.append((s, -1, free[lane], after[s]))
            free[lane] = free[lane] + after[s]
    end = sympy.Max(*(r[-1] for r in done), *free.values()) if done else sympy.Integer(0)
    return events, end


def comm_loss_of(kind: str, p: Profile) -> float:
    """The profile's comm-side overlap loss for a collective kind (0 for GEMMs)."""
    return _per_kind(p.comm_loss, kind, 0.0)


def _per_kind(values: dict, kind: str, default: float) -> float:
    """A per-kind profile value. Calibration measures all-gathers and reduce-scatters; an
    all-to-all moves bytes like an all-gather (no reduction), an all-reduce reduces like a
    reduce-scatter."""
    like = {"all_to_all": "all_gather", "all_reduce": "reduce_scatter"}
    return values.get(kind, values.get(like.get(kind, ""), default))


def chunk_fracs(n: int, extent=None) -> list:
    """The chunks' shares of the rows, as the rewrite sizes them (passes/build.chunk_sizes):
    weights 1, 2, .., 2, 1, or the exact sizes where the extent is a number."""
    if isinstance(extent, int) and extent >= n:
        from .build import chunk_sizes

        return [sympy.Rational(c, extent) for c in chunk_sizes(extent, n)]
    w = chunk_weights(n)
    return [sympy.Rational(wi, sum(w)) for wi in w]


def t_stages(
    stages: list[Stage],
    world: int,
    gemm: Gemm,
    p: Profile,
    n: int,
    copy_bytes=0,
    extent=None,
    add_bytes=0,
    events: bool = False,
):
    """Predicted time of the stages as an n-chunk pipeline: the flow, plus ``chunk_overhead``
    per extra chunk of each collective, plus the copies the rewrite adds (``copy_bytes``, and
    ``add_bytes`` per extra chunk: partial sums) at ``copy_bw``. With ``events``: (events, end)
    where events are (lane, label, start, duration), the overhead and copies last."""
    fracs = chunk_fracs(n, extent)
    durations = [stage_times(st, fracs, world, gemm, p) for st in stages]
    evs, end = flow(
        durations,
        [st.lane for st in stages],
        p.overlap_loss,
        [st.t_after(gemm) for st in stages],
        [comm_loss_of(st.kind, p) for st in stages],
    )
    n_colls = sum(st.count for st in stages if st.lane == "comm")
    tail = (n - 1) * n_colls * p.chunk_overhead + (sympy.sympify(copy_bytes) + (n - 1) * add_bytes) / p.copy_bw
    if not events:
        return end + tail
    out = [(stages[s].lane, f"{stages[s].kind} {'whole' if i < 0 else i}", t0, d) for s, i, t0, d in evs]
    if tail:
        out.append(("compute", "chunk overhead + copies", end, tail))
    return out, end + tail


def whole_times(stages: list[Stage], world: int, gemm: Gemm, p: Profile) -> list[float]:
    """Each stage's time unchunked (the baseline runs them one after another)."""
    return [float(stage_times(st, [1], world, gemm, p)[0] + st.t_after(gemm)) for st in stages]


def site_stages(pattern: str, nbytes, flops, count: int = 1, rows=None, out_bytes: int = 0) -> list[Stage]:
    """AllGather -> mm, mm -> ReduceScatter, mm -> AllReduce: the two stages (the chunks cut
    the GEMMs' rows)."""
    comm_first = bool(COMM_FIRST.get(pattern))  # an all-gather site reassembles its consumers' outputs
    comm = Stage("comm", KIND[pattern], nbytes)
    gemm = Stage("compute", "gemm", flops, count, rows, out_bytes=out_bytes, out_whole=comm_first)
    return [comm, gemm] if comm_first else [gemm, comm]


def t_pipeline(comm_first: bool, g_flops, kind: str, nbytes, world: int, gemm: Gemm, p: Profile, n: int, copy_bytes=0):
    """Predicted time of an n-chunk two-stage pipeline (see :func:`t_stages`)."""
    comm, g = Stage("comm", kind, nbytes), Stage("compute", "gemm", g_flops)
    return t_stages([comm, g] if comm_first else [g, comm], world, gemm, p, n, copy_bytes)


def t_fused(c, g, p: Profile):
    g = g / p.fused_efficiency
    return sympy.Max(g, c) + p.overlap_loss * sympy.Min(g, c) + c / 8


# ------------------------------------------------------------------ per-site prediction
KIND = {
    "all_gather_matmul": "all_gather",
    "matmul_reduce_scatter": "reduce_scatter",
    "matmul_all_reduce": "all_reduce",
    "all_to_all_matmul": "all_to_all",
    "matmul_all_to_all": "all_to_all",
}
COMM_FIRST = {"all_gather_matmul": True, "all_to_all_matmul": True}


@dataclass
class Prediction:
    base: float
    best: float
    strategy: str  # "decompose" or "skip"
    chunks: int | None
    comm: float
    gemm: float
    per_chunks: dict[int, float]
    flops: int = 0
    dtype: str = "float32"
    copy_bytes: int = 0
    stages: list[Stage] = field(default_factory=list)
    extent: int | None = None
    add_bytes: int = 0

    @property
    def gain(self) -> float:
        return (self.base - self.best) / self.base if self.base > 0 else 0.0

    def to_dict(self) -> dict:
        ms = lambda t: round(t * 1e3, 4)  # noqa: E731
        return {
            "base_ms": ms(self.base),
            "best_ms": ms(self.best),
            "gain": round(self.gain, 4),
            "comm_ms": ms(self.comm),
            "gemm_ms": ms(self.gemm),
            "strategy": self.strategy,
            "chunks": self.chunks,
            "by_chunks_ms": {str(k): ms(v) for k, v in self.per_chunks.items()},
            "stages": [st.to_dict() for st in self.stages],
            "extent": self.extent,
            "add_bytes": self.add_bytes,
        }


def predict(
    pattern: str,
    nbytes: int,
    flops: int,
    world: int,
    dtype: str,
    p: Profile,
    extent: int,
    copy_bytes: int = 0,
    gemm_calls: int = 1,
    rows: int | None = None,
    out_bytes: int = 0,
) -> Prediction:
    """Baseline and best overlapped time of an AllGather -> mm, mm -> ReduceScatter or
    mm -> AllReduce site (numbers in, numbers out).

    ``copy_bytes``: what the decomposition copies besides the GEMMs and collectives
    (chunk outputs concatenated into the original layout, inputs regrouped by rank)."""
    return predict_stages(
        site_stages(pattern, nbytes, flops, gemm_calls, rows, out_bytes), world, dtype, p, extent, copy_bytes
    )


_PREDICTIONS: dict[tuple, Prediction] = {}
_PREDICTIONS_MAX = 4096


def predict_stages(
    stages: list[Stage], world: int, dtype: str, p: Profile, extent: int | None, copy_bytes: int = 0, add_bytes: int = 0
) -> Prediction:
    """Baseline (the stages one after another) and the best n-chunk pipeline, n = 2 .. 8
    (at most one chunk per row of ``extent``; None: rows counted at run time, chunks weighted
    1, 2, .., 2, 1 as the dropless op cuts them).

    A pure function of its arguments, evaluated in sympy (~60 ms a call): a model's layers
    repeat the same sites, so results are memoised by value, profile included (a 16-layer
    TP+SP graph pair: 260 predictions, a few dozen distinct)."""
    key = (tuple(stages), world, dtype, repr(p), extent, copy_bytes, add_bytes)
    hit = _PREDICTIONS.get(key)
    if hit is None:
        hit = _predict_stages(stages, world, dtype, p, extent, copy_bytes, add_bytes)
        if len(_PREDICTIONS) >= _PREDICTIONS_MAX:
            _PREDICTIONS.clear()
        _PREDICTIONS[key] = hit
    return replace(hit, per_chunks=dict(hit.per_chunks), stages=list(hit.stages))


def _predict_stages(
    stages: list[Stage], world: int, dtype: str, p: Profile, extent: int | None, copy_bytes: int, add_bytes: int
) -> Prediction:
    gemm = p.gemm_for(dtype)
    whole = whole_times(stages, world, gemm, p)
    c = sum(t for st, t in zip(stages, whole) if st.lane == "comm")
    g = sum(t for st, t in zip(stages, whole) if st.lane == "compute")
    base = c + g
    per = {
        n: float(t_stages(stages, world, gemm, p, n, copy_bytes, extent, add_bytes))
        for n in range(2, (8 if extent is None else min(8, extent)) + 1)
    }
    best_n = min(per, key=lambda n: (per[n], n)) if per else None
    best, strategy, chunks = (per[best_n], "decompose", best_n) if per else (base, "skip", None)
    flops = sum(st.amount + st.after for st in stages if st.lane == "compute")
    return Prediction(
        base, best, strategy, chunks, c, g, per, flops, dtype, copy_bytes, list(stages), extent, add_bytes
    )


def site_flops(matmul_vals: list[tuple]) -> int:
    """2 * numel(out) * K summed over ``(lhs_val, out_val)`` pairs."""
    total = 0
    for lhs, out in matmul_vals:
        total += 2 * _int(out.numel()) * _int(lhs.shape[-1])
    return total


def _int(x) -> int:
    from .ops import hint

    v = hint(x)
    if v is None:
        raise OverlapError("symbolic sizes: the planner decides on numbers (a bucket's sizes)")
    return v


def ms(t: float) -> str:
    return f"{t * 1e3:.3g} ms"


def describe_skip(pred: Prediction, p: Profile, where: str) -> str:
    return (
        f"predicted gain {pred.gain:.1%} below the threshold {p.min_gain:.0%} of profile {p.name!r} "
        f"at {where} (base {ms(pred.base)}: comm {ms(pred.comm)}, GEMM {ms(pred.gemm)}; "
        f"best {pred.strategy}/{pred.chunks} {ms(pred.best)})"
    )


def site_events(
    pred: dict, world: int, p: Profile, strategy: str | None, chunks: int | None
) -> tuple[list[tuple], list[tuple]]:
    """Timelines of one site, baseline and planned, from its ``details["predicted"]``: lists of
    (lane, label, start_s, dur_s), lanes "compute" and "comm", starting at 0 (for traces and
    pictures of a plan). The planned one is :func:`t_stages`' own flow, so it ends at the
    predicted time."""
    stages = [Stage(**d) for d in pred["stages"]]
    gemm = p.gemm_for(pred["dtype"])
    whole = whole_times(stages, world, gemm, p)
    base, t = [], 0.0
    for st, d in zip(stages, whole):
        base.append((st.lane, st.kind, t, d))
        t += d
    if strategy == "fuse" and len(stages) == 2:
        (kind, c), (_, g) = sorted(((st.kind, d) for st, d in zip(stages, whole)), key=lambda x: x[0] == "gemm")
        f = float(t_fused(c, g, p))
        return base, [("compute", "fused gemm", 0.0, f), ("comm", f"{kind} (fused)", 0.0, min(c, f))]
    if strategy != "decompose" or not chunks:
        return base, base
    evs, _ = t_stages(
        stages,
        world,
        gemm,
        p,
        chunks,
        pred.get("copy_bytes", 0),
        pred.get("extent"),
        pred.get("add_bytes", 0),
        events=True,
    )
    return base, [(lane, label, float(t0), float(d)) for lane, label, t0, d in evs]
