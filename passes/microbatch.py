"""Micro-batch interleaving: the graph's batch cut in ``n`` slices that run side by side, so
that one slice's communication hides under another slice's compute (option ``microbatches``).

Row-chunked sites (AllGather -> mm, mm -> ReduceScatter) can hide a collective only under
the GEMMs next to it. Where a collective has no GEMM next to it -- a tensor + sequence
parallel block's reduce-scatter after the attention output projection follows attention,
which mixes all rows of the sequence -- nothing hides it. Cut along the batch instead,
every op of a transformer block acts on each slice on its own (attention included), so
slice 1's attention runs while slice 0's reduce-scatter is on the wire.

The cut is a region of passes/axis.py along dim 0 (the batch) of the graph's first
all-gather or reduce-scatter, grown forward through everything that keeps batch slices
apart, taking in every all-gather and reduce-scatter it reaches: each is issued per slice.
Sums over the batch (weight gradients) become per-slice partials (fp32) or run whole after
the slices; whatever reads a region tensor whole gets it rebuilt from its slices. The
slices' nodes are laid out level by level -- level L: what follows L collectives of the
region -- slice 0 then slice 1 within a level, so the schedule (passes/schedule.py), which
keeps the order of compute it does not need to move, alternates the slices between
collectives. Where the region ends (an op without a per-slice rule), a later collective
starts another region.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Graph, Node

from . import axis as ax
from . import ops
from .build import Builder, chunk_sizes
from .lower import _erased
from .schedule import legalize

KINDS = (ops.ALL_GATHER, ops.REDUCE_SCATTER)
SLICED = "overlapc_microbatch"
"""meta key of a collective one slice of a micro-batch region issues."""
MAX_AUTO_SLICES = 4


def start_axis(coll: Node) -> ax.Axis | None:
    """The batch axis of a collective's result: dim 0 of one rank's block (an all-gather's
    input, a reduce-scatter's output), whole."""
    src = coll.args[0] if coll.target is ops.ALL_GATHER else ops.wait_of(coll)
    shape = ax.static_shape(src) if src is not None else None
    if not shape or shape[0] < 2:
        return None
    return ax.Axis(0, shape[0], 1)


def _next_region(graph: Graph, passed: set[Node]):
    """The region of the first collective not in ``passed`` that starts one: (collective, its
    batch axis, region), or None. Collectives that start none are added to ``passed``."""
    while True:
        coll = next(
            (c for c in graph.nodes if c.target in KINDS and c not in passed and ops.wait_of(c) is not None), None
        )
        if coll is None:
            return None
        a = start_axis(coll)
        region = ax.grow(ops.wait_of(coll), a, kinds=KINDS) if a is not None else None
        if region is not None and region.matmuls:
            return coll, a, region
        passed.add(coll)


def split_microbatches(graph: Graph, n: int) -> list[dict]:
    """Cut the graph's batch into ``n`` slices (fewer where the batch is smaller), region by
    region; returns one description per region cut, or whose cut failed (for the report).
    The slices' collectives are marked (``meta[SLICED]``)."""
    done: list[dict] = []
    passed: set[Node] = set()
    while True:
        found = _next_region(graph, passed)
        if found is None:
            return done
        coll, a, region = found
        info = {
            "collective": coll.name,
            "collective_op": ops.collective_name(coll),
            "module": ops.module_path(coll),
            "group": ops.group_name(coll),
            "world_size": ops.world_size(coll),
            "batch": a.extent,
            "slices": min(n, a.extent),
            "collectives": [c.name for c in region.collectives],
            "matmuls": [m.name for m in region.matmuls],
            "rebuilt_whole": len(region.whole),
            "sums_after_slices": len(region.deferred),
        }
        try:
            created = _rewrite(graph, coll, region, info["slices"])
            passed |= created
            for x in created:
                if x.target in KINDS:
                    x.meta[SLICED] = True
        except Exception as e:  # an op refused its slice shapes: that region stays as it was
            passed.add(coll)
            info["failed"] = f"the sliced replay failed ({type(e).__name__}: {str(e)[:200]}); left unchanged"
        done.append(info)


@dataclass
class Slicing:
    """What the micro-batch step did to one graph: its report rows, and ``view``, the cost
    model's view of the choice ``microbatches="auto"`` made (None for a number, or no region)."""

    rows: list
    view: dict | None = None

    @property
    def sliced(self) -> bool:
        return any(r.status == "rewritten" for r in self.rows)

    def priced(self, sites: list) -> list:
        """The sites the planner prices: not those inside slices "auto" chose, which were
        priced as slices alone (a number of slices chunks the sites inside them too)."""
        return [s for s in sites if not self._held(s)]

    def settle(self, sites: list) -> None:
        """After planning: skip the held sites, and note on the sites declined slices would
        have taken in why they were declined."""
        for s in sites:
            if self._held(s):
                s.skip(
                    "inside the micro-batch slices microbatches='auto' chose (priced as slices alone; "
                    "set microbatches to a number to chunk the sites inside them too)"
                )
            elif self.view and "reason" in self.view and s.coll.name in self.view["collectives"]:
                s.details["microbatches"] = self.view["reason"]

    def _held(self, site) -> bool:
        return bool(self.view and self.sliced and site.coll.meta.get(SLICED))


def slice_microbatches(graph: Graph, graph_kind: str, options, profile=None) -> Slicing:
    """The micro-batch step of the pipeline: the number of slices (``options.microbatches``,
    or :func:`choose_slices`' choice), the cut, and its report rows."""
    n, view = options.microbatches, None
    if n == "auto":
        n, view = choose_slices(graph, graph_kind, options, profile)
    if n <= 1:
        return Slicing([], view)
    slicing = Slicing(report_rows(split_microbatches(graph, n), graph_kind, n, view), view)
    if slicing.sliced:
        legalize(graph)
    return slicing


def choose_slices(graph: Graph, graph_kind: str, options, profile=None) -> tuple[int, dict | None]:
    """``microbatches="auto"``: the number of slices to cut (1: none), and the cost model's
    view of the choice (None where the graph has no region to cut).

    Each region the cut would make (found without changing the graph) is priced as a
    pipeline of its stages (passes/all_to_all.region_stages: GEMMs and attention by level,
    each level's all-gathers or reduce-scatters), n = 2 .. ``MAX_AUTO_SLICES`` slices (at most
    the batch), and compared with what the row-chunked sites whose collectives lie in those
    regions are predicted to save (as planned: each at its best count, left out where
    strategy "auto" would leave them). Slices win when they save more, and at least the
    profile's ``min_gain`` of the regions' time. Only under strategies "auto" and
    "decompose" ("none" changes nothing; "fuse" runs the fused ops). A pure function of
    shapes, options and profile, like every plan."""
    from . import cost
    from .all_to_all import region_stages
    from .plan import pick_count

    if options.strategy not in ("auto", "decompose"):  # "none": report only; "fuse": the fused ops
        return 1, None
    regions, passed = [], set()
    while (found := _next_region(graph, passed)) is not None:
        regions.append(found)
        passed |= {found[0], *found[2].collectives}
    if not regions:
        return 1, None
    in_regions = {c for _, _, r in regions for c in r.collectives}
    names = sorted(c.name for c in in_regions)
    profile = profile or cost.load_profile(options.hardware)
    preds = []
    for coll, a, region in regions:
        got = region_stages(region)
        world = ops.world_size(coll)
        if got is None or not world:
            return 1, {
                "collectives": names,
                "reason": f"microbatches='auto': not cut: the cost model cannot price "
                f"the region of {coll.name} (symbolic sizes, or collectives of two kinds at one level); "
                "set microbatches to a number to cut it",
            }
        stages, copy_bytes, add_bytes, dtype = got
        preds.append(cost.predict_stages(stages, world, dtype, profile, a.extent, copy_bytes, add_bytes))
    counts = set.intersection(*(set(p.per_chunks) for p in preds)) & set(range(2, MAX_AUTO_SLICES + 1))
    base = sum(p.base for p in preds)
    n = pick_count({c: sum(p.per_chunks[c] for p in preds) for c in counts})
    sliced = sum(p.per_chunks[n] for p in preds)
    rows_saving = _row_chunk_saving(graph, graph_kind, options, in_regions, profile)
    view = {
        "profile": profile.name,
        "slices": n,
        "regions": len(regions),
        "base_ms": round(base * 1e3, 4),
        "sliced_ms": round(sliced * 1e3, 4),
        "row_chunks_saving_ms": round(rows_saving * 1e3, 4),
        "collectives": names,
    }
    saving = base - sliced
    if saving > rows_saving and base and saving / base >= profile.min_gain:
        return n, view
    view["reason"] = (
        f"microbatches='auto': {n} slices predicted to save {cost.ms(saving)} of "
        f"{cost.ms(base)} ({len(regions)} region(s)), row-chunked sites {cost.ms(rows_saving)}; "
        f"not cut (slices must save more, and at least {profile.min_gain:.0%}, profile "
        f"{profile.name!r})"
    )
    return 1, view


def _row_chunk_saving(graph: Graph, graph_kind: str, options, colls: set[Node], profile) -> float:
    """Seconds the row-chunked sites of ``colls`` are predicted to save as the planner plans
    them: the graph's modelled sites go through passes/plan.plan_sites (strategy, min_bytes,
    the rule's checks, ``min_gain`` under "auto", one count for sites that can chain), and
    each planned one counts its baseline less its time at the count it got."""
    from .deps import DepGraph
    from .match import find_sites
    from .plan import MODELLED, plan_sites

    deps = DepGraph(graph)
    # Modelled sites only: the all-to-all rules' checks record regions and pipelines in
    # node.meta, which the real plan, later, would find left by these throwaway sites.
    sites = [s for s in find_sites(graph, graph_kind, deps)[0] if s.pattern in MODELLED]
    plan_sites(sites, options, deps, profile)
    saving = 0.0
    for s in sites:
        pred = s.details.get("predicted")
        if s.coll not in colls or s.status != "planned" or not pred:
            continue  # (a site fused by a per-site override has no prediction: not counted)
        if s.strategy == "fuse":  # auto fused it: best_ms is the fused time
            saving += pred["base_ms"] - pred["best_ms"]
        else:  # a count above those priced (2 .. 8) is taken at the most chunks priced
            by = pred["by_chunks_ms"]
            saving += pred["base_ms"] - by.get(str(s.chunks), by[max(by, key=int)] if by else pred["best_ms"])
    return saving / 1e3


def report_rows(cuts: list[dict], graph_kind: str, n: int, view: dict | None = None) -> list:
    """Report rows (pattern "microbatch"): one per region cut (or whose cut failed, with
    why), or one skipped row saying why nothing could be cut. ``view``: :func:`choose_slices`'
    prediction (of all regions together), kept in the first row's details."""
    from overlapc.report import Site

    if not cuts:
        return [
            Site(
                name=f"{graph_kind}::microbatch",
                pattern="microbatch",
                graph=graph_kind,
                status="skipped",
                reason=f"microbatches={n}: no all-gather or reduce-scatter whose batch (dim 0 of one rank's "
                "block, size >= 2) reaches a matmul through ops that keep batch slices apart",
            )
        ]
    rows = []
    for i, c in enumerate(cuts):
        ok = "failed" not in c
        rows.append(
            Site(
                name=f"{graph_kind}:{c['module'] or ''}:microbatch" + (f"#{i}" if i else ""),
                pattern="microbatch",
                graph=graph_kind,
                status="rewritten" if ok else "skipped",
                reason=c.get("failed"),
                strategy="microbatch" if ok else None,
                chunks=c["slices"] if ok else None,
                group=c["group"],
                world_size=c["world_size"],
                collective=c["collective"],
                collective_op=c["collective_op"],
                module=c["module"],
                matmuls=c["matmuls"],
                dim=0,
                details={
                    "batch": c["batch"],
                    "collectives": c["collectives"],
                    "rebuilt_whole": c["rebuilt_whole"],
                    "sums_after_slices": c["sums_after_slices"],
                    **({"predicted": view} if view and i == 0 else {}),
                },
            )
        )
    return rows


def _rewrite(graph: Graph, coll: Node, region: ax.Region, n: int) -> set[Node]:
    """Replay ``region`` in ``n`` slices in place of its nodes; the new nodes (raises, the
    graph unchanged, where the replay fails)."""
    from .all_to_all import _anchors, retire_region

    anchors = _anchors(region)
    level = region.levels()
    sizes = chunk_sizes(region.axis.extent, n)
    b = Builder(graph, like=coll)
    marks: list = []
    with graph.inserting_before(coll):
        pieces = ax.substitute(b, region, sizes, marks)
    _level_major(b.created[: marks[-1][2]] if marks else [], marks, level, coll)
    new = set(b.created)
    retire_region(graph, region, anchors, pieces[-1])
    return {x for x in new if not _erased(x)}


def _level_major(created: list[Node], marks: list, level: dict, before: Node) -> None:
    """Lay the replayed nodes out level by level, slice by slice within a level (see the
    module docstring); the pass's legalize restores def-before-use where this order broke it."""
    key: dict[Node, tuple] = {}
    start = 0
    for c, step, end in marks:
        for i in range(start, end):
            key[created[i]] = (level.get(step, 0), c, i)
        start = end
    for x in sorted(created, key=key.get):
        before.prepend(x)
