"""Plan: decide, per site, whether to rewrite it, how, and in how many chunks.

The decision is a pure function of the site's shapes, the options and the hardware
profile, so every rank reaches the same plan (a rank that planned differently would
issue different collectives and deadlock; overlapc/agree.py checks that they did not).

AllGather -> mm, mm -> ReduceScatter and mm -> AllReduce sites are planned by the cost
model (passes/cost.py) under the profile of ``options.hardware`` (default: this machine's):
it predicts the site's time as it is and as an n-chunk pipeline for every n the site
allows, and ``strategy="auto"`` rewrites the site with the best n unless the predicted
gain is below the profile's ``min_gain`` (the reason names the gain, the threshold, the
shape and the predicted times). ``chunks="auto"`` takes the model's n under
``strategy="decompose"`` too: one n for the sites of a graph that chunk the same rows (so
that their chunks can chain), the count of the best summed prediction (the fewest chunks
on a tie; see ``_agree_on_chunks``). Every planned site carries its prediction in
``details["predicted"]``.

All-to-all regions (MoE dispatch -> experts -> combine, Ulysses projections -> all-to-all ->
attention -> all-to-all -> output projection) are planned by the same model: the region's
GEMMs and attention are grouped into compute stages and its all-to-alls into comm stages by
how many all-to-alls lie before them (passes/all_to_all.region_stages), and the n-chunk
pipeline of those stages (passes/cost.flow) is compared with the stages run one after
another, with the copies the rewrite adds (tensors read whole reassembled, partial sums).
A site whose all-to-all is part of an earlier site's region is predicted (and counted)
there. A dropless pipeline (split sizes known only at run time: passes/dropless.py) is
predicted as [dispatch, the body's GEMMs, combine] at balanced routing (each rank receives
as many rows as it sends) when the rows it sends are a number (the forward) or the sum of a
forward pipeline's send splits (the backward: passes/dropless.note_rows); its other
all-to-all follows that decision. Where even those are unknown a rule remains: rewritten
when the all-to-all moves at least ``AUTO_MIN_BYTES`` per rank, chunks min(4, extent).

``strategy="fuse"`` replaces AllGather -> mm and mm -> ReduceScatter sites by the fused
Triton ops (passes/fuse.py) where the group has symmetric memory, and says why elsewhere.
"auto" fuses where the profile prices fused kernels (``fused_efficiency``: the GPU
profiles), the fused time (passes/cost.t_fused) beats the best decomposition and the
baseline by ``min_gain``, and the site can be fused on the profile's device. The CPU
profiles price none (the kernels run in Triton's interpreter, for correctness, far slower
than BLAS), so auto fuses only under a profile that prices them, run where the group has
symmetric memory (a GPU profile planned on a machine without CUDA says why not).
"""

from __future__ import annotations

import dataclasses

from overlapc.errors import OverlapError
from overlapc.options import Options
from overlapc.runtime import symm

from . import all_to_all, cost, dropless, fuse, lower, ops
from .deps import DepGraph
from .forms import lowered_groups
from .sites import MatchedSite

MAX_AUTO_CHUNKS = 4
MIN_ROWS_PER_CHUNK = 32
AUTO_MIN_BYTES = 1 << 20
MODELLED = ("all_gather_matmul", "matmul_reduce_scatter", "matmul_all_reduce")
FUSED_VERIFIED_ON = ("cpu",)
"""Devices whose fused kernels have passed the multi-process checks against eager, where
strategy "auto" may choose them: the CPU (Triton's interpreter, tests/test_fused_kernels.py).
On CUDA they ran on one GPU only, with peers emulated, and hung there twice (issue 37)."""


def auto_chunks(extent: int) -> int:
    """The rows rule (kept for sites the model does not cover)."""
    return max(2, min(MAX_AUTO_CHUNKS, extent // MIN_ROWS_PER_CHUNK))


def predict_site(site: MatchedSite, profile: cost.Profile, extent: int) -> cost.Prediction | None:
    """The cost model's view of one site, or None where it has no numbers (symbolic shapes)."""
    nbytes = site.comm_bytes()
    if nbytes is None or site.world is None:
        return None
    sums = []  # GEMMs that sum over the gathered rows: the chunks cut their contraction dim
    if site.pattern == "all_gather_matmul":
        from .all_gather_matmul import contraction_uses, row_uses

        mms = [u.matmul for u in row_uses(site)]
        sums = [u.matmul for u in contraction_uses(site)]
    else:
        mms = site.matmuls
    pairs = []
    for m in mms + sums:
        lhs = ops.MATMULS[m.target][0]
        a, out = ops.val(m.args[lhs]), ops.val(m)
        if a is None or out is None:
            return None
        pairs.append((a, out))
    try:
        flops = cost.site_flops(pairs)
    except OverlapError:
        return None
    dtype = ops.dtype_name(ops.val(site.coll.args[0]))
    # What the rewrite copies: chunk outputs concatenated back (AG: every consumer's output;
    # RS/AR: the collective's output) and, for RS, the GEMM inputs regrouped by rank.
    if site.pattern == "all_gather_matmul":
        copied = sum(_nbytes(out) for _, out in pairs[: len(mms)])
    else:
        copied = _nbytes(ops.val(site.coll))
        if site.pattern == "matmul_reduce_scatter":
            copied += sum(_nbytes(a) for a, _ in pairs)
    # the dim of the GEMM calls the chunks cut: M of row consumers, K of sums over the rows
    ms = [ops.hint(out.shape[-2]) for _, out in pairs[: len(mms)]]
    ms += [ops.hint(a.shape[-1]) for a, _ in pairs[len(mms) :]]
    rows = None if None in ms else min(ms)
    return cost.predict(
        site.pattern,
        nbytes,
        flops,
        site.world,
        dtype,
        profile,
        extent,
        copy_bytes=copied,
        gemm_calls=len(pairs),
        rows=rows,
        out_bytes=sum(_nbytes(out) for _, out in pairs),
    )


def predict_region(site, profile: cost.Profile, left_out=frozenset(), chunks="auto") -> cost.Prediction | None:
    """The cost model's view of an all-to-all site's region (passes/all_to_all.region_stages),
    grown as the rewrite will grow it: without the all-to-alls of sites left alone
    (``left_out``: strategy "none", below min_bytes). Of the candidate axes (MoE: capacity
    slots or whole experts) the one predicted to save the most at ``chunks`` (its best count
    under "auto"; of the axes with room for a fixed count) becomes the site's (``site.axis``,
    ``site.region``): slot chunks multiply every local expert's weights per chunk, expert
    chunks each weight once but allow only as many chunks as there are local experts; the
    model's rows term tells them apart."""
    best = None
    regions = all_to_all.candidate_regions(site, lambda coll: coll is site.coll or coll not in left_out)
    if chunks != "auto":  # a count the user asked for: the axes that can honour it, if any can
        regions = [r for r in regions if r.axis.extent >= int(chunks)] or regions
    for region in regions:
        got = all_to_all.region_stages(region)
        if got is None or not site.world:
            continue
        stages, copy_bytes, add_bytes, dtype = got
        if not any(st.lane == "compute" for st in stages):
            continue
        pred = cost.predict_stages(stages, site.world, dtype, profile, region.axis.extent, copy_bytes, add_bytes)
        t = pred.best if chunks == "auto" else pred.per_chunks.get(min(int(chunks), region.axis.extent), pred.best)
        # Regions of different axes may take in different GEMMs: compare what each saves.
        if best is None or pred.base - t > best[0]:
            best = (pred.base - t, region, pred)
    if best is None:
        return None
    _, region, pred = best
    site.axis, site.region = region.axis, region  # the rewrite grows this axis's region
    all_to_all.describe(site, region)
    for c in region.collectives:
        c.meta[all_to_all.REACHED] = site
    return pred


def predict_pipeline(site, profile: cost.Profile) -> cost.Prediction | None:
    """The cost model's view of a dropless site's pipeline (passes/dropless.pipeline_stages),
    at balanced routing: the split sizes exist only at run time."""
    got = dropless.pipeline_stages(site.pipeline)
    if got is None or not site.world:
        return None
    stages, copy_bytes, add_bytes, dtype = got
    return cost.predict_stages(stages, site.world, dtype, profile, None, copy_bytes, add_bytes)


def _nbytes(v) -> int:
    return ops.hinted_nbytes(v) or 0


def graph_profile(graph, graph_kind: str, options: Options) -> cost.Profile | None:
    """The profile a graph is planned with: ``options.hardware``'s (None: this machine's),
    with the times of the graph's collectives measured on their live groups where
    ``options.measure`` allows (overlapc/runtime/live.py). None where nothing is planned:
    strategy "none" without overrides or micro-batch slices (slices are planned, and their
    program is scheduled by the measured times: passes/schedule.estimate)."""
    if options.strategy == "none" and not options.overrides and not options.fixed_slices:
        return None
    from overlapc.runtime import live

    base = cost.load_profile(options.hardware)
    live.choose_forms(graph, options, graph_kind)  # which form each kind runs in, measured
    if lowered_groups(graph, options):
        # Its reduce-scatters run as all-to-alls (passes/forms.py): priced as what runs, not
        # as the backend's reduce-scatter the profile measured (gloo's: an all-reduce).
        base = dataclasses.replace(base, rs_factor=1.0, rs_large=())
    return live.measured_profile(graph, base, options, graph_kind)


def plan_sites(sites: list[MatchedSite], options: Options, deps: DepGraph, profile: cost.Profile | None = None) -> None:
    if profile is None and sites:
        profile = cost.load_profile(options.hardware)
    _plan_each(sites, options, deps, profile)
    _agree_on_chunks(sites, options, profile)
    for s in sites:
        s.details.pop("chunks_fixed", None)


def pick_count(times: dict[int, float]) -> int:
    """The chunk count for predicted times by count: the fastest; of equal ones, the fewest.
    (A tolerance band, counts within x% of the best taken as ties, picked no count closer to
    the best fixed one on bench_plan's sweeps: docs/cost_model.md#measurements-behind-calibration.)"""
    best = min(times.values())
    return min(c for c, t in times.items() if t <= best)


def _agree_on_chunks(sites: list[MatchedSite], options: Options, profile) -> None:
    """One chunk count for the modelled sites of a graph that chunk the same number of rows.

    Such sites can chain (an MLP's all-gather chunks feed its reduce-scatter's chunks directly,
    passes/rows.py) only when their row layouts, hence their counts, are equal; and the
    model's curves are flat near their minimum. So the count is the one that minimises the
    sites' summed predicted time; of equal ones, the fewest."""
    groups: dict[tuple, list[MatchedSite]] = {}
    for s in sites:
        pred = s.details.get("predicted")
        if s.status != "planned" or s.strategy != "decompose" or not pred or s.details.get("chunks_fixed"):
            continue
        if s.pattern not in MODELLED:  # an all-to-all region chunks its own axis, chained with no row site
            continue
        extent = lower.RULES[type(s)].extent(s)
        groups.setdefault((s.world, str(extent)), []).append(s)
    for group in groups.values():
        counts = set.intersection(*(set(map(int, s.details["predicted"]["by_chunks_ms"])) for s in group))
        if not counts:
            continue
        n = pick_count({n: sum(s.details["predicted"]["by_chunks_ms"][str(n)] for s in group) for n in counts})
        for s in group:
            pred = s.details["predicted"]
            s.chunks = pred["chunks"] = n
            pred["best_ms"] = pred["by_chunks_ms"][str(n)]
            pred["gain"] = round((pred["base_ms"] - pred["best_ms"]) / pred["base_ms"], 4) if pred["base_ms"] else 0.0


def _plan_each(sites: list[MatchedSite], options: Options, deps: DepGraph, profile) -> None:
    left_out = frozenset(
        s.coll
        for s in sites
        if options.for_site(s.name)["strategy"] == "none"
        or (options.min_bytes and s.comm_bytes() is not None and s.comm_bytes() < options.min_bytes)
    )
    planned_pipelines: dict = {}  # dropless dispatch -> the site of its pair planned first
    for site in sites:
        per_site = options.for_site(site.name)
        strategy, chunks = per_site["strategy"], per_site["chunks"]
        site.skip(None)  # until a decision below
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
            _plan_fused(site, chunks, options)
            continue
        rule = lower.RULES.get(type(site))
        if rule is None:
            site.reason = f"no decomposition for {site.pattern} sites yet"
            continue
        why = rule.can_rewrite(site, deps)
        if why:
            site.reason = why
            continue
        extent = rule.extent(site)  # symbolic in a shape bucket: plan at its smallest sizes
        rows = ops.hint(extent)
        if not isinstance(extent, int) and ops.symbolic_ok():
            site.details["bucket"] = {"rows": str(extent), "rows_at": rows, "planned_at": ops.bucket_sizes()}
        if site.pattern in MODELLED and rows:
            pred = predict_site(site, profile, rows)
        elif isinstance(site, all_to_all.A2A_SITES) and site.pipeline is None and site.region is not None:
            reacher = site.coll.meta.get(all_to_all.REACHED)
            if (
                reacher is not None
                and reacher is not site
                and (reacher.status == "planned" or (reacher.details.get("predicted") and strategy == "auto"))
            ):
                # Part of an earlier site's region: predicted (and counted) there, chunked with it.
                site.details["modelled_with"] = reacher.name
                if reacher.status == "planned":
                    site.strategy, site.chunks, site.status = "decompose", reacher.chunks, "planned"
                else:
                    site.reason = f"in the region of {reacher.name}: {reacher.reason}"
                continue
            pred = predict_region(site, profile, left_out, chunks)
            extent = rule.extent(site)  # the axis the model chose
            rows = ops.hint(extent)
        elif isinstance(site, all_to_all.A2A_SITES) and site.pipeline is not None:
            first = planned_pipelines.setdefault(site.pipeline.dispatch, site)
            if first is not site:
                # The other all-to-all of a pipeline planned already: one op runs both.
                site.details["modelled_with"] = first.name
                if first.status == "planned":
                    site.strategy, site.chunks, site.status = first.strategy, first.chunks, "planned"
                else:
                    site.reason = f"in the pipeline of {first.name}: {first.reason}"
                continue
            other = site.pipeline.combine if site.coll is site.pipeline.dispatch else site.pipeline.dispatch
            if other in left_out:  # one op runs both all-to-alls or neither
                site.reason = (
                    f"its pipeline's other all-to-all, {other.name}, is left alone (strategy 'none' or min_bytes)"
                )
                continue
            pred = predict_pipeline(site, profile)
        else:
            pred = None
        if pred is not None:
            kind = ops.COST_KIND.get(site.coll.target)
            site.details["predicted"] = {
                "profile": profile.name,
                "numbers": profile.numbers_from(kind, site.world),
                **pred.to_dict(),
                "bytes": nbytes,
                "flops": pred.flops,
                "dtype": pred.dtype,
                "copy_bytes": pred.copy_bytes,
            }
            if strategy == "auto" and _fuse_pays(site, pred, profile, deps):
                _plan_fused(site, chunks, options)
                p = site.details["predicted"]
                p.update(
                    strategy="fuse",
                    chunks=site.chunks,
                    best_ms=p["fused_ms"],
                    gain=round((p["base_ms"] - p["fused_ms"]) / p["base_ms"], 4),
                )
                continue
            if strategy == "auto" and pred.gain < profile.min_gain:
                site.reason = cost.describe_skip(pred, profile, _where(site))
                continue
        elif strategy == "auto" and nbytes is not None and nbytes < AUTO_MIN_BYTES:
            site.reason = (
                f"collective moves {nbytes / 1024:.0f} KiB per rank: below {AUTO_MIN_BYTES >> 10} KiB "
                "the latency of extra collectives outweighs the overlap (strategy='decompose' forces it)"
            )
            continue
        if chunks != "auto":
            n = chunks
            site.details["chunks_fixed"] = True
        elif pred is not None and pred.chunks:
            n = pred.chunks
        else:
            n = (rule.auto_chunks or auto_chunks)(rows if rows is not None else extent)
        # Symbolic rows: against the bucket's smallest size, so the count fits all of it.
        limit = extent if isinstance(extent, int) or rows is None else rows
        if n > limit:
            if chunks != "auto":
                site.details["chunks_clamped"] = f"{chunks} -> {limit}: only {limit} rows to split"
            n = limit
        site.strategy, site.chunks, site.status = "decompose", n, "planned"


def _plan_fused(site: MatchedSite, chunks, options: Options) -> None:
    # AG: the copy engine's chunks (flags per chunk); RS: the kernel signals per tile.
    n = None
    if isinstance(site, fuse.AllGatherMatmulSite):
        n = min(lower.RULES[type(site)].extent(site), MAX_AUTO_CHUNKS if chunks == "auto" else chunks)
    site.strategy, site.chunks, site.status, site.timeout = "fuse", n, "planned", options.timeout


def _fuse_pays(site: MatchedSite, pred: cost.Prediction, profile: cost.Profile, deps: DepGraph) -> bool:
    """strategy "auto": whether the fused op is predicted faster than the best decomposition
    and than the baseline by ``min_gain``, and the site can be fused here. Only profiles with
    fused kernels worth running have a ``fused_efficiency`` (the GPU ones; not the CPU, whose
    kernels run in Triton's interpreter). The fused prediction, and why a fusion that would
    pay is not taken, go into the site's details."""
    if not profile.fused_efficiency or not isinstance(site, fuse.FUSED_KINDS):
        return False
    t = float(cost.t_fused(pred.comm, pred.gemm, profile))
    site.details["predicted"]["fused_ms"] = round(t * 1e3, 4)
    if t >= pred.best or (pred.base - t) / pred.base < profile.min_gain:
        return False
    why = fuse.can_fuse(site, deps)
    if why is None and profile.device not in FUSED_VERIFIED_ON:
        why = (
            f"strategy 'auto' does not fuse on {profile.device}: the fused kernels have not passed the "
            "checks between devices of that kind yet (strategy='fuse' asks for them)"
        )
        here = symm.cuda_supported(None) if profile.device == "cuda" else None  # a GPU plan traced here
        if here:
            why += f"; and here: {here}"
    if why:
        site.details["fuse_not_taken"] = why
        site.details.pop("fuse_left_whole", None)  # can_fuse's note on consumers, for a fused site only
    return why is None


def _where(site: MatchedSite) -> str:
    region = getattr(site, "region", None)
    if region is not None:
        return (
            f"a region of {len(region.collectives)} all-to-alls and {len(region.matmuls)} GEMMs chunked along "
            f"{region.axis.extent} slabs, {site.comm_bytes()} B per rank"
        )
    pipeline = getattr(site, "pipeline", None)
    if pipeline is not None:
        rows = dropless.rows_at_balance(ops.val(pipeline.dispatch.args[0]).shape[0])
        nbytes = site.comm_bytes()
        if nbytes is None:  # the backward's: rows from the forward's number
            nbytes = dropless.sent_bytes(pipeline)
        return (
            f"a dropless pipeline of {len(dropless.pipeline_matmuls(pipeline))} GEMMs, {rows} rows sent per "
            f"rank (priced at balanced routing), {nbytes} B per rank"
        )
    mm = site.matmuls[0] if site.matmuls else None
    v = ops.val(mm) if mm is not None else None
    if v is not None and v.dim() >= 2:
        m, n = (_size(d) for d in v.shape[-2:])
        return f"M={m}, N={n}, {site.comm_bytes()} B per rank"
    return f"{site.comm_bytes()} B per rank"


def _size(d) -> str:
    """A size for a reason: the number, or in a shape bucket the number it was planned at."""
    if isinstance(d, int) or ops.hint(d) is None:
        return str(d)
    names = sorted(str(sym) for sym in d.node.expr.free_symbols)
    reps = ops.bucket_sizes() or {}
    at = ", ".join(f"{k}={reps[k]}" for k in names if k in reps)
    return f"{ops.hint(d)} ({d} at {at})"
