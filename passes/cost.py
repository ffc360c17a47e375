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

A pipeline of ``n`` chunks with per-chunk transfer ``c_i`` and GEMM ``g_i`` (AG -> GEMM:
transfer first; GEMM -> RS/AR: GEMM first), plus ``chunk_overhead`` per extra chunk::

    T(n) = first_1 + sum_{i=2..n} Max(c_i, g_{i-1} or g_i ...) + last_n + (n-1) * overhead
           + copied bytes / copy_bw

i.e. the first stage of chunk 1 and the second stage of chunk n are exposed, everything
else runs at the pace of the slower stage, plus ``overlap_loss * Min(c_i, g_j)``: transfers
and GEMMs that overlap still compete for something (SMs and memory bandwidth on a GPU: NCCL
runs on SMs; CPU cores on the emulated cluster, where TCP over veth is CPU work), measured
by ``overlapc calibrate`` as the part of the shorter activity that does not hide. ``overhead`` is what one more chunk costs beyond
its collective's alpha (issue, wait, launch: calibrated as such), and the copies are the
chunk outputs concatenated back into the original layout (and, for a reduce-scatter, the
GEMM input regrouped by destination rank). Chunks are sized like the rewrite sizes them
(passes/build.chunk_sizes: weights 1, 2, .., 2, 1). Where chunked reduce-scatters and
all-reduces run concurrently (gloo: overlapc issues them all at once; NCCL on one stream
does not), their chunks share one latency. Fused (a GPU with symmetric memory):
``Max(t_gemm / fused_efficiency, t_comm) + t_comm / n_tiles_in_flight`` approximated as
``Max(g / eff_fused, c) + c / 8``.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import sympy

from overlapc.errors import OverlapError
from overlapc.runtime.dropless import chunk_weights

PROFILE_DIR = Path(__file__).resolve().parent.parent / "overlapc" / "profiles"
if not PROFILE_DIR.is_dir():  # installed (non-editable): overlapc/profiles next to overlapc/
    import overlapc as _o
    PROFILE_DIR = Path(_o.__file__).resolve().parent / "profiles"
CACHE_DIR = Path(os.environ.get("OVERLAPC_CACHE", Path.home() / ".cache" / "overlapc"))
BUILTIN = ("cpu-local", "cpu-default", "h100-nvlink", "h200-nvlink", "ib-400g")


@dataclass(frozen=True)
class Gemm:
    peak_flops: float   # flop/s, vendor peak (or measured best)
    eff_max: float      # fraction of peak the largest GEMMs reach
    half_flops: float   # flops at which a GEMM reaches half of eff_max * peak


@dataclass(frozen=True)
class Link:
    alpha: float        # s per ring step
    beta: float         # bytes/s per rank and direction


@dataclass(frozen=True)
class Profile:
    name: str
    source: str
    gemm: dict[str, Gemm]           # by dtype name: "float32", "bfloat16", ...
    link: Link
    chunk_overhead: float           # s per extra chunk (launch, sync, bookkeeping)
    min_gain: float                 # predicted gains below this are within the model's error: skip
    rs_factor: float = 1.0          # reduce-scatter cost relative to the ring formula (gloo: 2)
    copy_bw: float = 1e12           # bytes/s of a device-local copy (read + write counted once)
    overlap_loss: float = 0.0       # share of the shorter of (transfer, GEMM) that still shows when they overlap
    concurrent_reductions: bool = False  # chunked RS/AR run concurrently (gloo): their latencies overlap
    fused_efficiency: float | None = None  # fused kernels' GEMM rate relative to plain GEMMs; None: no fused kernels

    def gemm_for(self, dtype: str) -> Gemm:
        return self.gemm.get(dtype) or self.gemm.get("float32") or next(iter(self.gemm.values()))


def profile_from_dict(d: dict, path: str | None = None) -> Profile:
    try:
        gemm = {k: Gemm(float(v["peak_tflops"]) * 1e12, float(v["eff_max"]), float(v["half_gflop"]) * 1e9)
                for k, v in d["gemm"].items()}
        link = Link(float(d["link"]["alpha_us"]) * 1e-6, float(d["link"]["beta_gbps"]) * 1e9)
        return Profile(name=d["name"], source=d["source"], gemm=gemm, link=link,
                       chunk_overhead=float(d["chunk_overhead_us"]) * 1e-6, min_gain=float(d["min_gain"]),
                       rs_factor=float(d.get("rs_factor", 1.0)), copy_bw=float(d.get("copy_gbps", 1000)) * 1e9,
                       overlap_loss=float(d.get("overlap_loss", 0.0)),
                       concurrent_reductions=bool(d.get("concurrent_reductions", False)),
                       fused_efficiency=d.get("fused_efficiency"))
    except (KeyError, TypeError, ValueError) as e:
        raise OverlapError(f"hardware profile {path or d.get('name')!r} is malformed: {type(e).__name__}: {e}; "
                           f"see {PROFILE_DIR / 'h100-nvlink.json'} for the format") from e


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
            raise OverlapError("option 'hardware': profile 'cpu-local' has not been measured on this machine; "
                               "run `overlapc calibrate --world-size N` (or use 'cpu-default')")
    else:
        p = PROFILE_DIR / f"{name_or_path}.json"
        if not p.is_file():
            raise OverlapError(f"option 'hardware' must be one of {', '.join(repr(b) for b in BUILTIN)} or a "
                               f"profile file path; got {name_or_path!r}")
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
def t_gemm(flops, g: Gemm):
    flops = sympy.sympify(flops)
    if flops.is_number and flops == 0:
        return sympy.Integer(0)
    return (flops + g.half_flops) / (g.peak_flops * g.eff_max)


def t_comm(kind: str, nbytes, world: int, p: Profile):
    """Time of one collective moving ``nbytes`` (this rank's input) over ``world`` ranks."""
    B, W, a, b = sympy.sympify(nbytes), world, p.link.alpha, p.link.beta
    if W <= 1:
        return sympy.Integer(0)
    step = (W - 1) * a
    if kind == "all_gather":
        return step + (W - 1) * B / b
    frac = sympy.Rational(W - 1, W) * B / b
    if kind == "reduce_scatter":
        return (step + frac) * p.rs_factor
    if kind == "all_reduce":
        return 2 * (step + frac)
    if kind == "all_to_all":
        return step + frac
    raise ValueError(f"unknown collective kind {kind!r}")


def chunk_comm_times(kind: str, comm_first: bool, nbytes, world: int, p: Profile, weights: list[int]) -> list:
    tot = sum(weights)
    cs = [t_comm(kind, sympy.sympify(nbytes) * wi / tot, world, p) for wi in weights]
    if not comm_first and p.concurrent_reductions:
        # Issued at once and run concurrently: the chunks share one latency, not one each.
        lat = t_comm(kind, 0, world, p)
        cs = [cs[0]] + [c - lat for c in cs[1:]]
    return cs


def t_pipeline(comm_first: bool, g_flops, kind: str, nbytes, world: int, gemm: Gemm, p: Profile, n: int,
               copy_bytes=0):
    """Predicted time of an n-chunk pipeline (see the module docstring)."""
    w = chunk_weights(n)
    tot = sum(w)
    cs = chunk_comm_times(kind, comm_first, nbytes, world, p, w)
    gs = [t_gemm(sympy.sympify(g_flops) * wi / tot, gemm) for wi in w]
    first, second = (cs, gs) if comm_first else (gs, cs)
    t = first[0]
    for i in range(1, n):
        t += sympy.Max(first[i], second[i - 1]) + p.overlap_loss * sympy.Min(first[i], second[i - 1])
    return t + second[-1] + (n - 1) * p.chunk_overhead + sympy.sympify(copy_bytes) / p.copy_bw


def t_fused(c, g, p: Profile):
    g = g / p.fused_efficiency
    return sympy.Max(g, c) + p.overlap_loss * sympy.Min(g, c) + c / 8


# ------------------------------------------------------------------ per-site prediction
KIND = {"all_gather_matmul": "all_gather", "matmul_reduce_scatter": "reduce_scatter",
        "matmul_all_reduce": "all_reduce", "all_to_all_matmul": "all_to_all", "matmul_all_to_all": "all_to_all"}
COMM_FIRST = {"all_gather_matmul": True, "all_to_all_matmul": True}


@dataclass
class Prediction:
    base: float
    best: float
    strategy: str               # "decompose" or "skip"
    chunks: int | None
    comm: float
    gemm: float
    per_chunks: dict[int, float]
    flops: int = 0
    dtype: str = "float32"
    copy_bytes: int = 0

    @property
    def gain(self) -> float:
        return (self.base - self.best) / self.base if self.base > 0 else 0.0

    def to_dict(self) -> dict:
        ms = lambda t: round(t * 1e3, 4)  # noqa: E731
        return {"base_ms": ms(self.base), "best_ms": ms(self.best), "gain": round(self.gain, 4),
                "comm_ms": ms(self.comm), "gemm_ms": ms(self.gemm), "strategy": self.strategy, "chunks": self.chunks,
                "by_chunks_ms": {str(k): ms(v) for k, v in self.per_chunks.items()}}


def predict(pattern: str, nbytes: int, flops: int, world: int, dtype: str, p: Profile, extent: int,
            copy_bytes: int = 0) -> Prediction:
    """Baseline and best overlapped time of one site (numbers in, numbers out).

    ``copy_bytes``: what the decomposition copies besides the GEMMs and collectives
    (chunk outputs concatenated into the original layout, inputs regrouped by rank)."""
    kind, comm_first = KIND[pattern], COMM_FIRST.get(pattern, False)
    gemm = p.gemm_for(dtype)
    c, g = float(t_comm(kind, nbytes, world, p)), float(t_gemm(flops, gemm))
    base = c + g
    per = {n: float(t_pipeline(comm_first, flops, kind, nbytes, world, gemm, p, n, copy_bytes))
           for n in range(2, min(8, extent) + 1)}
    best_n = min(per, key=lambda n: (per[n], n)) if per else None
    best, strategy, chunks = (per[best_n], "decompose", best_n) if per else (base, "skip", None)
    return Prediction(base, best, strategy, chunks, c, g, per, flops, dtype, copy_bytes)


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
    return (f"predicted gain {pred.gain:.1%} below the threshold {p.min_gain:.0%} of profile {p.name!r} "
            f"at {where} (base {ms(pred.base)}: comm {ms(pred.comm)}, GEMM {ms(pred.gemm)}; "
            f"best {pred.strategy}/{pred.chunks} {ms(pred.best)})")


def site_events(pattern: str, nbytes: int, flops: int, world: int, dtype: str, p: Profile, strategy: str,
                chunks: int | None, copy_bytes: int = 0) -> tuple[list[tuple], list[tuple]]:
    """Timelines of one site, baseline and planned: lists of (lane, label, start_s, dur_s),
    lanes "compute" and "comm", starting at 0 (for traces and pictures of a plan)."""
    kind, comm_first = KIND[pattern], COMM_FIRST.get(pattern, False)
    gemm = p.gemm_for(dtype)
    c, g = float(t_comm(kind, nbytes, world, p)), float(t_gemm(flops, gemm))
    if comm_first:
        base = [("comm", kind, 0.0, c), ("compute", "gemm", c, g)]
    else:
        base = [("compute", "gemm", 0.0, g), ("comm", kind, g, c)]
    if strategy == "fuse":
        f = float(t_fused(c, g, p))
        return base, [("compute", "fused gemm", 0.0, f), ("comm", f"{kind} (fused)", 0.0, min(c, f))]
    if strategy != "decompose" or not chunks:
        return base, base
    w = chunk_weights(chunks)
    tot = sum(w)
    cs = [float(c) for c in chunk_comm_times(kind, comm_first, nbytes, world, p, w)]
    gs = [float(t_gemm(flops * wi / tot, gemm)) + p.chunk_overhead for wi in w]
    ev, c_end, g_end = [], 0.0, 0.0
    for i in range(chunks):
        # A GEMM that runs under a transfer is slowed by the overlap loss (as in t_pipeline).
        if comm_first:
            ev.append(("comm", f"{kind} {i}", c_end, cs[i]))
            c_end += cs[i]
            start = max(c_end, g_end)
            g = gs[i] + (p.overlap_loss * min(cs[i + 1], gs[i]) if i + 1 < chunks else 0.0)
            ev.append(("compute", f"gemm {i}", start, g))
            g_end = start + g
        else:
            g = gs[i] + (p.overlap_loss * min(cs[i - 1], gs[i]) if i > 0 else 0.0)
            ev.append(("compute", f"gemm {i}", g_end, g))
            g_end += g
            start = max(g_end, c_end)
            ev.append(("comm", f"{kind} {i}", start, cs[i]))
            c_end = start + cs[i]
    if copy_bytes:
        end = max(c_end, g_end)
        ev.append(("compute", "copies", end, copy_bytes / p.copy_bw))
    return base, ev
