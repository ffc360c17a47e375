"""Plan: decide, per site, whether to rewrite it, how, and in how many chunks.

The decision is a pure function of the site's shapes, the options and the hardware
profile, so every rank reaches the same plan (a rank that planned differently would
issue different collectives and deadlock).

Until the cost model lands, ``strategy="auto"`` is a size rule: it decomposes a site when
its collective moves at least ``AUTO_MIN_BYTES`` per rank (below that, the latency each
extra collective adds costs more than overlap can hide: about 1 ms per gloo collective
measured on the emulated cluster, see BENCHMARKS.md), and ``chunks="auto"`` takes as many
chunks as keep each at least ``MIN_ROWS_PER_CHUNK`` rows, at most ``MAX_AUTO_CHUNKS``.
``strategy="decompose"`` rewrites every site that can be rewritten, whatever its size.
``strategy="fuse"`` replaces AllGather -> mm and mm -> ReduceScatter sites by the fused
Triton ops (passes/fuse.py) where the group has symmetric memory, and says why elsewhere.
"auto" never fuses yet: on the CPU the kernels run in Triton's interpreter (for
correctness, far slower than BLAS), and the multi-GPU workspace is not built.
"""
from __future__ import annotations

from overlapc.options import Options

from . import fuse, lower
from .deps import DepGraph
from .sites import MatchedSite

MAX_AUTO_CHUNKS = 4
MIN_ROWS_PER_CHUNK = 32
AUTO_MIN_BYTES = 1 << 20


def auto_chunks(extent: int) -> int:
    return max(2, min(MAX_AUTO_CHUNKS, extent // MIN_ROWS_PER_CHUNK))


def plan_sites(sites: list[MatchedSite], options: Options, deps: DepGraph) -> None:
    for site in sites:
        per_site = options.for_site(site.name)
        strategy, chunks = per_site["strategy"], per_site["chunks"]
        site.status, site.reason, site.strategy, site.chunks = "skipped", None, None, None
        if strategy == "none":
            site.status = "found"
            continue
        nbytes = site.comm_bytes()
        if options.min_bytes and nbytes is not None and nbytes < options.min_bytes:
            site.reason = f"collective moves {nbytes} B per rank, below min_bytes={options.min_bytes}"
            continue
        if strategy == "fuse":
            why = fuse.can_fuse(site, deps)
            if why:
                site.reason = f"strategy 'fuse': {why}"
                continue
            # AG: the copy engine's chunks (flags per chunk); RS: the kernel signals per tile.
            n = None
            if isinstance(site, fuse.AllGatherMatmulSite):
                n = min(lower.RULES[type(site)].extent(site), MAX_AUTO_CHUNKS if chunks == "auto" else chunks)
            site.strategy, site.chunks, site.status, site.timeout = "fuse", n, "planned", options.timeout
            continue
        if strategy == "auto" and nbytes is not None and nbytes < AUTO_MIN_BYTES:
            site.reason = (f"collective moves {nbytes / 1024:.0f} KiB per rank: below {AUTO_MIN_BYTES >> 10} KiB "
                           "the latency of extra collectives outweighs the overlap (strategy='decompose' forces it)")
            continue
        rule = lower.RULES.get(type(site))
        if rule is None:
            site.reason = f"no decomposition for {site.pattern} sites yet"
            continue
        why = rule.can_rewrite(site, deps)
        if why:
            site.reason = why
            continue
        extent = rule.extent(site)
        n = (rule.auto_chunks or auto_chunks)(extent) if chunks == "auto" else chunks
        if n > extent:
            if chunks != "auto":
                site.details["chunks_clamped"] = f"{chunks} -> {extent}: only {extent} rows to split"
            n = extent
        site.strategy, site.chunks, site.status = "decompose", n, "planned"
