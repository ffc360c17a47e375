"""AllToAll <-> matmul sites (expert-parallel MoE dispatch/combine, Ulysses attention).

Found::

    a2a = all_to_all_single(x, out_splits, in_splits, group); r = wait_tensor(a2a)
    e = view/transpose/select...(r); h = bmm(e, W1) ...            # all_to_all_matmul

    o = bmm(h, W2)  (or stack of per-expert mms, or a sum)
    a2a = all_to_all_single(view/transpose(o), ...)               # matmul_all_to_all

One all-to-all can be both: its input made by matmuls and its output consumed by them.

Rewrite (see passes/axis.py): the dispatch all-to-all is issued in chunks along an axis
of its buffer that the expert GEMMs keep apart (capacity slots, or whole experts), each
chunk's GEMMs run as soon as it lands, and a combine all-to-all fed by those GEMMs is
issued chunk by chunk too. Chosen is the axis whose region reaches the most matmuls and
all-to-alls. A matmul -> all-to-all site is rewritten as the end of such a region;
alone (no chunked all-to-all reaches it) it is left untouched with its reason.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Graph, Node

from . import axis as ax
from . import ops
from .build import Builder, chunk_sizes
from .deps import DepGraph
from .normalize import Dims, NoProducer, erase_collective, matmul_producer, matmul_uses, remove_dead_nodes
from .sites import ConsumerSite, Loose, ProducerSite


def _splits(coll: Node):
    out_s, in_s = coll.args[1], coll.args[2]
    return out_s, in_s


def _static_splits(s) -> bool:
    return s is None or all(isinstance(v, int) for v in s)


@dataclass(eq=False)
class AllToAllMatmulSite(ConsumerSite):
    pattern = "all_to_all_matmul"
    region: ax.Region | None = None

    @property
    def dim(self):
        return 0


@dataclass(eq=False)
class MatmulAllToAllSite(ProducerSite):
    pattern = "matmul_all_to_all"

    @property
    def dim(self):
        return 0


def find_all_to_all_sites(graph: Graph, deps: DepGraph):
    sites, loose = [], []
    for node in graph.nodes:
        if node.target is not ops.ALL_TO_ALL:
            continue
        wait = ops.wait_of(node)
        if wait is None:
            loose.append(Loose(node, "all-to-all is not completed by a single wait_tensor"))
            continue
        common = dict(coll=node, wait=wait, group=ops.group_name(node), world=ops.world_size(node))
        out_s, in_s = _splits(node)
        splits = "even" if out_s is None and in_s is None else \
            "static" if _static_splits(out_s) and _static_splits(in_s) else "dynamic"
        found = []
        all_uses, others = matmul_uses(wait, Dims({0}), through_indexing=True)
        uses = [u for u in all_uses if u.other is None or not deps.depends(u.other, wait)]
        if uses:
            s = AllToAllMatmulSite(**common, uses=uses, other_users=others)
            s.details = {"splits": splits, "other_users": [n.name for n in others]}
            found.append(s)
        why_consumer = None
        if not all_uses:
            why_consumer = "no matmul consumer"
        elif not uses:
            names = ", ".join(u.matmul.name for u in all_uses)
            why_consumer = (f"the other operand of every matmul consumer ({names}) depends on the "
                            "all-to-all itself: no chunk can start before all have arrived")
        try:
            prod = matmul_producer(node.args[0], Dims({0}), {node})
            s = MatmulAllToAllSite(**common, producer=prod)
            s.details = {"splits": splits, "producer": prod.form}
            found.append(s)
            why_producer = None
        except NoProducer as e:
            why_producer = str(e)
        if found:
            sites.extend(found)
        else:
            loose.append(Loose(node, f"{why_consumer}; {why_producer}"))
    return sites, loose



# ----------------------------------------------------------------------------- rewrite

SITE = "overlapc_site"
"""node.meta key on a site's collective: the site (set by the lowering before any rewrite)."""
REACHED = "overlapc_reached_by"
"""node.meta key on a matmul -> all-to-all collective: the site whose region reaches it."""


def best_region(site: AllToAllMatmulSite, may_chain=lambda coll: True) -> ax.Region | None:
    """The region, over every candidate axis, reaching the most matmuls and all-to-alls."""
    best = None
    for a in ax.candidate_axes(site.wait, site.world):
        r = ax.grow(site.wait, a, may_chain)
        if r.matmuls and (best is None or r.score() > best.score()):
            best = r
    return best


def can_rewrite_consumer(site: AllToAllMatmulSite, deps: DepGraph) -> str | None:
    if not site.world or ax.static_shape(site.wait) is None:
        return "dynamic shapes: chunk sizes would not be known at compile time"
    if not ax.even_splits(site.coll):
        return ("uneven or run-time split sizes: chunk boundaries are not known at compile time "
                "(the dropless form needs a run-time pipelined op, not built yet)")
    region = best_region(site)
    if region is None:
        return "no axis of the received buffer reaches a matmul through ops that keep chunks apart"
    site.region = region
    site.details["axis"] = {"dim": region.axis.dim, "extent": region.axis.extent, "inner": region.axis.inner}
    site.details["chained"] = [t.name for t in region.terminals]
    for t in region.terminals:
        t.meta[REACHED] = site
    return None


def consumer_extent(site: AllToAllMatmulSite) -> int:
    return site.region.axis.extent


def can_rewrite_producer(site: MatmulAllToAllSite, deps: DepGraph) -> str | None:
    if site.coll.meta.get(REACHED) is None:
        return ("no chunked all-to-all region reaches its input: a matmul -> all-to-all is "
                "only decomposed as the end of one (standalone form not built yet)")
    return None


def producer_extent(site: MatmulAllToAllSite) -> int:
    return consumer_extent(site.coll.meta[REACHED])


def rewrite_producer(site: MatmulAllToAllSite, chunks: int) -> bool:
    """Reached here only when the region that would chain it was not rewritten."""
    first = site.coll.meta.get(REACHED)
    site.status, site.strategy, site.chunks = "skipped", None, None
    site.reason = (f"the all-to-all region that reaches it ({first.name if first else '?'}) "
                   f"was not rewritten{': ' + first.reason if first and first.reason else ''}")
    return False


def rewrite_consumer(site: AllToAllMatmulSite, chunks: int) -> None:
    """Chunk the all-to-all and its region; chain the all-to-alls the region feeds.

    Before (MoE, capacity form)::

        r = wait(all_to_all(send)); h = experts(view(r)); o = wait(all_to_all(view(h)))

    After (chunks c of the chosen axis, e.g. capacity slots [s_c, s_c + n_c) of every expert)::

        r_c = wait(all_to_all(narrow(send, c)))       # all issued first
        h_c = experts(view_c(r_c))                     # same ops, chunk shapes
        o_c = wait(all_to_all(view_c(h_c)))            # issued as soon as h_c exists
        o   = cat(o_c along the axis)

    Tensors the rest of the graph reads whole (saved activations) are rebuilt from their
    chunks; reductions over the axis (weight gradients) become sums of per-chunk partials.
    """
    def may_chain(coll):
        other = coll.meta.get(SITE)
        return other is not None and other.status == "planned"

    region = best_region(site, may_chain)
    graph = site.coll.graph
    a = region.axis
    sizes = chunk_sizes(a.extent, chunks)
    b = Builder(graph, like=site.coll)

    def all_to_all(coll, send, n):
        splits = coll.args[1]
        per_peer = ax.static_shape(send)[0] // site.world
        sp = None if splits is None else [per_peer] * len(splits)
        isp = None if coll.args[2] is None else [per_peer] * len(coll.args[2])
        out = b.call(ops.ALL_TO_ALL, ax.contiguous(b, send), sp, isp, *coll.args[3:], **coll.kwargs)
        return b.call(ops.WAIT, out)

    with graph.inserting_before(site.coll):
        send = site.coll.args[0]
        starts, off = [], 0
        for n in sizes:
            starts.append(all_to_all(site.coll, ax.narrow(b, send, a, off, n), n))
            off += n
        pieces = ax.replay(b, region, sizes, starts)
        for t in region.terminals:
            src = t.args[0]
            outs = [all_to_all(t, p[src], n) for p, n in zip(pieces, sizes)]
            tw = ops.wait_of(t)
            tw.replace_all_uses_with(ax.assemble(b, outs, sizes, region.axes[src], ax.static_shape(tw)))
        for node in region.whole:
            node.replace_all_uses_with(
                ax.assemble(b, [p[node] for p in pieces], sizes, region.axes[node], ax.static_shape(node)))
        for st in region.steps:
            if st.axis is None:
                st.node.replace_all_uses_with(ax.add_partials(b, [p[st.node] for p in pieces]))
    for t in region.terminals:
        erase_collective(t, ops.wait_of(t))
        other = t.meta.get(SITE)
        other.status, other.strategy, other.chunks = "rewritten", "decompose", chunks
        other.details["chained_from"] = site.name
    remove_dead_nodes(graph)
    erase_collective(site.coll, site.wait)
    site.details["chunk_sizes"] = sizes
