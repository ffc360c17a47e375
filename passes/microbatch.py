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

from torch.fx import Graph, Node

from . import axis as ax
from . import ops
from .build import Builder, chunk_sizes
from .lower import _erased

KINDS = (ops.ALL_GATHER, ops.REDUCE_SCATTER)


def start_axis(coll: Node) -> ax.Axis | None:
    """The batch axis of a collective's result: dim 0 of one rank's block (an all-gather's
    input, a reduce-scatter's output), whole."""
    src = coll.args[0] if coll.target is ops.ALL_GATHER else ops.wait_of(coll)
    shape = ax.static_shape(src) if src is not None else None
    if not shape or shape[0] < 2:
        return None
    return ax.Axis(0, shape[0], 1)


def split_microbatches(graph: Graph, n: int) -> list[dict]:
    """Cut the graph's batch into ``n`` slices (fewer where the batch is smaller), region by
    region; returns one description per region cut, or whose cut failed (for the report)."""
    done: list[dict] = []
    created: set[Node] = set()
    skipped: set[Node] = set()
    while True:
        coll = next((c for c in graph.nodes if c.target in KINDS and c not in created and c not in skipped
                     and ops.wait_of(c) is not None), None)
        if coll is None:
            return done
        a = start_axis(coll)
        region = ax.grow(ops.wait_of(coll), a, kinds=KINDS) if a is not None else None
        if region is None or not region.matmuls:
            skipped.add(coll)
            continue
        info = {"collective": coll.name, "collective_op": ops.collective_name(coll), "module": ops.module_path(coll),
                "group": ops.group_name(coll), "world_size": ops.world_size(coll), "batch": a.extent,
                "slices": min(n, a.extent), "collectives": [c.name for c in region.collectives],
                "matmuls": [m.name for m in region.matmuls], "rebuilt_whole": len(region.whole),
                "sums_after_slices": len(region.deferred)}
        try:
            created |= _rewrite(graph, coll, region, info["slices"])
        except Exception as e:  # an op refused its slice shapes: that region stays as it was
            skipped.add(coll)
            info["failed"] = f"the sliced replay failed ({type(e).__name__}: {str(e)[:200]}); left unchanged"
        done.append(info)


def report_rows(cuts: list[dict], graph_kind: str, n: int) -> list:
    """Report rows (pattern "microbatch"): one per region cut (or whose cut failed, with
    why), or one skipped row saying why nothing could be cut."""
    from overlapc.report import Site

    if not cuts:
        return [Site(name=f"{graph_kind}::microbatch", pattern="microbatch", graph=graph_kind, status="skipped",
                     reason=f"microbatches={n}: no all-gather or reduce-scatter whose batch (dim 0 of one rank's "
                            "block, size >= 2) reaches a matmul through ops that keep batch slices apart")]
    rows = []
    for i, c in enumerate(cuts):
        ok = "failed" not in c
        rows.append(Site(
            name=f"{graph_kind}:{c['module'] or ''}:microbatch" + (f"#{i}" if i else ""), pattern="microbatch",
            graph=graph_kind, status="rewritten" if ok else "skipped", reason=c.get("failed"),
            strategy="microbatch" if ok else None, chunks=c["slices"] if ok else None, group=c["group"],
            world_size=c["world_size"], collective=c["collective"], collective_op=c["collective_op"],
            module=c["module"], matmuls=c["matmuls"], dim=0,
            details={"batch": c["batch"], "collectives": c["collectives"], "rebuilt_whole": c["rebuilt_whole"],
                     "sums_after_slices": c["sums_after_slices"]}))
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
    _level_major(b.created[:marks[-1][2]] if marks else [], marks, level, coll)
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
