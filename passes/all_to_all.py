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
all-to-alls. The region reaches upstream as well (Ulysses: from the all-to-all after the
q projection back to the projection's weight rows, and over to k and v), so a
matmul -> all-to-all site is rewritten the same way; each all-to-all a region takes in is
reported rewritten, "chained_from" the site that took it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.fx import Graph, Node

from . import axis as ax
from . import dropless, ops
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
    axis: ax.Axis | None = None
    """The axis the planner chose (None: the structural best, :func:`best_region`)."""
    pipeline: object | None = None
    """A dropless.Pipeline: run-time splits, chunked by the run-time op."""

    @property
    def dim(self):
        return 0


@dataclass(eq=False)
class MatmulAllToAllSite(ProducerSite):
    pattern = "matmul_all_to_all"
    region: ax.Region | None = None
    axis: ax.Axis | None = None
    """The axis the planner chose (None: the structural best, :func:`best_region`)."""
    pipeline: object | None = None

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
        splits = (
            "even"
            if out_s is None and in_s is None
            else "static"
            if _static_splits(out_s) and _static_splits(in_s)
            else "dynamic"
        )
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
            why_consumer = (
                f"the other operand of every matmul consumer ({names}) depends on the "
                "all-to-all itself: no chunk can start before all have arrived"
            )
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
"""node.meta key on an all-to-all: the first planned site whose region takes it in."""

A2A_SITES = (AllToAllMatmulSite, MatmulAllToAllSite)


def candidate_regions(site, may_chain=lambda coll: True) -> list[ax.Region]:
    """The site's regions that reach a matmul, one per candidate axis, taking in the most
    all-to-alls any of them takes in (overlapping a collective beats any chunking choice);
    restricted to the planner's axis once it chose one (``site.axis``)."""
    regions = []
    for a in ax.candidate_axes(site.wait, site.world):
        if getattr(site, "axis", None) is not None and a != site.axis:
            continue
        r = ax.grow(site.wait, a, may_chain)
        if r is not None and r.matmuls:
            regions.append(r)
    most = max((len(r.collectives) for r in regions), default=0)
    regions = [r for r in regions if len(r.collectives) == most]
    # A dim's indices in groups (ax.candidate_axes) only where the single indices reach less:
    # a region along the finer axis that takes the same collectives and matmuls can cut
    # everything the coarser one can, and more.
    return [
        r
        for r in regions
        if not (
            _grouped(r.axis)
            and any(
                _finer(o.axis, r.axis) and set(o.collectives) == set(r.collectives) and set(o.matmuls) >= set(r.matmuls)
                for o in regions
            )
        )
    ]


def _grouped(a: ax.Axis) -> bool:
    """An axis of ax.candidate_axes' grouped kind: indices of a dim other than the first, in groups."""
    return a.dim >= 1 and a.inner > 1


def _finer(a: ax.Axis, b: ax.Axis) -> bool:
    """``a`` cuts the same span of the same dim as ``b``, into more pieces."""
    return a.dim == b.dim and a.extent > b.extent and a.extent * a.inner == b.extent * b.inner


def best_region(site, may_chain=lambda coll: True) -> ax.Region | None:
    """The region to rewrite: the planner's axis (``site.axis``), else the structural best:
    most all-to-alls, then room for a pipeline, most matmuls (:meth:`Region.score`)."""
    return max(candidate_regions(site, may_chain), key=lambda r: r.score(), default=None)


def can_rewrite(site, deps: DepGraph) -> str | None:
    if not ax.even_splits(site.coll):
        return dropless.can_pipeline(site, deps)
    if not site.world or ax.static_shape(site.wait) is None:
        return "dynamic shapes: chunk sizes would not be known at compile time"
    region = best_region(site)
    reacher = site.coll.meta.get(REACHED)
    if region is None and reacher is not None:
        region = reacher.region  # chunked as part of an earlier site's region
    if region is None:
        return "no axis of the exchanged buffer reaches a matmul through ops that keep chunks apart"
    site.region = region
    describe(site, region)
    for c in region.collectives:
        c.meta.setdefault(REACHED, site)
    return None


def describe(site, region: ax.Region) -> None:
    site.details["axis"] = {"dim": region.axis.dim, "extent": region.axis.extent, "inner": region.axis.inner}
    site.details["chained"] = [c.name for c in region.collectives if c is not site.coll]
    site.details.pop("whole_after_chunks", None)
    if region.deferred:
        site.details["whole_after_chunks"] = [n.name for n in region.deferred]


def chunk_extent(site) -> int:
    if site.pipeline is not None:
        return RUNTIME_EXTENT
    return site.region.axis.extent


def _sites_of(coll: Node) -> list:
    """The matched sites of a collective: one all-to-all can be both a consumer site
    (all_to_all_matmul) and a producer site (matmul_all_to_all)."""
    return coll.meta.get(SITE, [])


RUNTIME_EXTENT = 1 << 30
"""The extent of a dropless pipeline: rows are counted at run time (chunks may be empty)."""


def auto_chunks(extent: int) -> int:
    """chunks="auto" for a region: one axis index is a whole slab (a capacity slot of every
    expert, one head over the whole sequence), not a row, so the planner's 32-rows rule
    does not apply; as many chunks as the row rule's maximum (4), at most one per index."""
    return max(2, min(4, extent))


def _attention_flops(node: Node) -> int | None:
    """Flops of a fused attention op (q, k: (B, H, S, D)): 4*B*H*Sq*Sk*D forward (two
    GEMMs), 2.5 times that backward (five, with the recomputed scores); causal halves it."""
    if node.target not in ax.BATCHED:
        return None
    bwd = "backward" in node.target.__name__
    q, k = (ops.val(a) if isinstance(a, Node) else None for a in node.args[int(bwd) : int(bwd) + 2])
    if q is None or k is None or q.dim() != 4:
        return None
    b, h, sq, d = (ops.hint(x) for x in q.shape)
    sk = ops.hint(k.shape[-2])
    if None in (b, h, sq, d, sk):
        return None
    flops = 4 * b * h * sq * sk * d * (5 if bwd else 2) // 2
    if ops.arg(node, "is_causal") is True:
        flops //= 2
    return flops


def _matmul_flops(node: Node) -> int | None:
    from overlapc.errors import OverlapError

    from . import cost

    lhs = ops.MATMULS[node.target][0]
    a, out = ops.val(node.args[lhs]), ops.val(node)
    if a is None or out is None:
        return None
    try:
        return cost.site_flops([(a, out)])
    except OverlapError:  # a size without a number
        return None


class _Gemms:
    """The GEMMs of one compute stage (or of its deferred sums), for the cost model: flops,
    calls, and the rows (M) of one equivalent call. Under the rows term t = f (1 + h / M)
    (passes/cost.t_gemm), calls of f_i flops and M_i rows cost as much as their total F at
    M = F / sum(f_i / M_i); over the GEMMs whose rows the chunks cut where there are any
    (they pay more per chunk), else over all."""

    def __init__(self):
        self.flops = self.count = 0
        self.fm = {True: [0, 0.0], False: [0, 0.0]}  # cut -> [flops, sum f / M]
        self.batched = False  # a GEMM whose rows the chunks cut is batched (bmm: rows per batch entry)

    def add(self, flops: int, rows, cut: bool, batched: bool = False) -> None:
        self.flops += flops
        self.count += 1
        self.batched |= bool(rows) and cut and batched
        if rows:
            acc = self.fm[cut]
            acc[0] += flops
            acc[1] += flops / rows

    def merge(self, other: _Gemms) -> None:
        self.flops += other.flops
        self.count += other.count
        self.batched |= other.batched
        for cut in (True, False):
            self.fm[cut][0] += other.fm[cut][0]
            self.fm[cut][1] += other.fm[cut][1]

    def rows(self):
        """(rows, whether the chunks cut them)."""
        for cut in (True, False):
            f, fm = self.fm[cut]
            if fm:
                return round(f / fm), cut
        return None, True


def region_stages(region: ax.Region):
    """The cost model's view of a region: its stages (passes/cost.Stage) in pipeline order,
    the bytes the rewrite copies (whole tensors reassembled from chunks, all-to-all inputs
    made contiguous) and the bytes of the partial sums it adds per extra chunk; or None
    where a size is not a number.

    A node's level is the number of collectives between the region's start and it: GEMMs
    (and fused attention) at level L form compute stage 2L, the collectives they feed comm
    stage 2L + 1 (all-to-alls here; all-gathers and reduce-scatters too in a micro-batch
    region, passes/microbatch.py; one kind per level, else None); sums deferred to run whole
    (:func:`overlapc.passes.axis._deferrable`) are the ``after`` of their level's compute
    stage. A compute stage's rows are the equivalent rows of its GEMMs (:class:`_Gemms`),
    cut by the chunks when the region's axis runs along them (MoE capacity slots) and whole
    per chunk when it does not (Ulysses heads). Elementwise ops are not modelled (memory-bound, small beside
    the GEMMs)."""
    from . import cost

    level = region.levels()
    gemms: dict[int, _Gemms] = {}  # compute stage -> its GEMMs
    after: dict[int, _Gemms] = {}  # compute stage -> its deferred sums
    comm: dict[int, list] = {}  # comm stage -> [bytes, collectives, kind]
    dtype = None
    copy_bytes = add_bytes = 0
    for node in region.deferred:
        f = _matmul_flops(node) if node.target in ops.MATMULS else None
        if f is not None:  # elementwise sums are not modelled (as in the steps)
            out = ops.val(node)
            m = ops.hint(out.shape[-2]) if out is not None else None
            after.setdefault(2 * level[node], _Gemms()).add(f, m, False)
    for st in region.steps:
        node = st.node
        if node.target in ops.COST_KIND:
            x = ops.val(node.args[0])
            nb = ops.hint(x.numel()) if x is not None else None
            if nb is None:
                return None
            a = region.axes.get(node.args[0])
            shape = ax.static_shape(node.args[0])
            if a is not None and shape is not None and math.prod(shape[: a.dim]) * a.outer(shape) > 1:
                copy_bytes += nb * x.element_size()
            acc = comm.setdefault(2 * (level[node] - 1) + 1, [0, 0, ops.COST_KIND[node.target]])
            if acc[2] != ops.COST_KIND[node.target]:
                return None  # two kinds at one level: not a pipeline of stages
            acc[0] += nb * x.element_size()
            acc[1] += 1
            continue
        out = ops.val(node)
        f = _matmul_flops(node) if node.target in ops.MATMULS else _attention_flops(node)
        if f is not None:
            m = ops.hint(out.shape[-2]) if node.target in ops.MATMULS and out is not None else None
            cut = m is not None and st.axis is not None and st.axis.dim == out.dim() - 2
            gemms.setdefault(2 * level[node], _Gemms()).add(f, m, cut, out is not None and out.dim() == 3)
            if dtype is None and out is not None:
                dtype = ops.dtype_name(out)
        if st.axis is None:  # a sum over the axis: one more partial per extra chunk
            if out is None or ops.hint(out.numel()) is None:
                return None
            add_bytes += 3 * ops.hint(out.numel()) * out.element_size()  # read two, write one
    for node in region.whole:
        v = ops.val(node)
        if v is None or ops.hint(v.numel()) is None:
            return None
        copy_bytes += ops.hint(v.numel()) * v.element_size()
    merged: list[tuple] = []  # (lane, amounts)
    for s in sorted(set(gemms) | set(after) | set(comm)):
        lane = "comm" if s % 2 else "compute"
        cur = list(comm[s]) if lane == "comm" else [gemms.get(s) or _Gemms(), after.get(s) or _Gemms()]
        # An empty stage between two of one lane merges them (comm stages: of one kind only;
        # of two kinds they stay apart, one after the other on the comm lane).
        if merged and merged[-1][0] == lane and (lane == "compute" or merged[-1][1][2] == cur[2]):
            prev = merged.pop()[1]
            if lane == "comm":
                cur = [cur[0] + prev[0], cur[1] + prev[1], cur[2]]
            else:
                cur[0].merge(prev[0])
                cur[1].merge(prev[1])
        merged.append((lane, cur))
    stages: list = []
    for lane, cur in merged:
        if lane == "comm":
            stages.append(cost.Stage("comm", cur[2], cur[0], cur[1]))
            continue
        g, late = cur
        rows, chunked = g.rows()
        stages.append(
            cost.Stage(
                "compute", "gemm", g.flops, g.count, rows, chunked, late.flops, late.count, late.rows()[0], g.batched
            )
        )
    return stages, copy_bytes, add_bytes, dtype or "float32"


def _anchors(region: ax.Region) -> dict[Node, Node]:
    """Per deferred sum, the all-to-all it is ordered behind (:func:`_run_after`): the first
    one fed from its level or later (the one that justified deferring it, and whose stage
    the cost model puts it after)."""
    if not region.deferred:
        return {}
    level = region.levels()
    colls = sorted(region.collectives, key=lambda c: level[c])  # stable: graph order within a level
    return {n: next((c for c in colls if level[c] - 1 >= level[n]), colls[-1]) for n in region.deferred}


def retire_region(graph: Graph, region: ax.Region, anchors: dict[Node, Node], last_chunk: dict, on_erase=None) -> None:
    """After a region's chunked replay (``last_chunk``: the last chunk's node per original):
    erase the region's collectives, the last first, dead nodes swept before each (so that
    nothing but the collective's wait still reads it), calling ``on_erase(coll)`` after each;
    then order each deferred sum behind its anchor's last chunk (:func:`_run_after`)."""
    for coll in reversed(region.collectives):
        remove_dead_nodes(graph)
        erase_collective(coll, ops.wait_of(coll))
        if on_erase is not None:
            on_erase(coll)
    remove_dead_nodes(graph)
    _run_after(anchors, last_chunk)


def _run_after(anchors: dict[Node, Node], last_chunk: dict) -> None:
    """Order each deferred sum behind the last chunk of its anchor all-to-all: a scheduling
    edge (passes/schedule.ISSUE_AFTER). The schedule would otherwise run compute that feeds
    no collective as early as its position allows, and the rewrite's node order is no
    guide: the whole weight gradients then ran before the last chunk's input gradients and
    held back its transfer (the world-2 MoE training step's last all-to-all chunk started
    after them). So ordered, they run under that transfer."""
    from .schedule import add_issue_after

    for n, coll in anchors.items():
        add_issue_after(n, last_chunk[coll])


def _comm_first(region: ax.Region) -> list[Node]:
    """The region's all-to-alls whose chunk inputs all exist at once: nothing but layout and
    pointwise steps between them and the region's seeds (no GEMM, no other all-to-all),
    e.g. a MoE dispatch. Those fed by a GEMM per chunk get their inputs one at a time."""
    steps = {st.node for st in region.steps}
    out = []
    for coll in region.collectives:
        stack, seen = list(coll.all_input_nodes), set()
        while stack:
            x = stack.pop()
            if x in seen or x not in steps:
                continue
            if x.target in ops.MATMULS or x.target in (ops.ALL_TO_ALL, ops.WAIT):
                break
            seen.add(x)
            stack.extend(x.all_input_nodes)
        else:
            out.append(coll)
    return out


def _one_at_a_time(colls: list[Node], pieces: list[dict]) -> None:
    """Issue chunk c + 1 of each of ``colls`` only once chunk c has arrived (a scheduling
    edge to chunk c's wait, passes/schedule.ISSUE_AFTER). Issued at once, the chunks share
    the link and each arrives late: measured over a shaped 1000 Mbit/s link (gloo, 8 MiB per
    rank), 2 chunks issued together both arrived at 61-69 ms (world 4) and 33-44 ms (world
    2); one at a time, the first at 20-24 / 11-20 ms and the last at 46-54 / 31-40 ms. The
    first chunk's compute waits for it, so it should come first. (Chunks fed by compute are
    issued one at a time by the compute anyway; all-gathers on gloo are serialized by the
    schedule for another reason.)"""
    from .schedule import add_issue_after

    for coll in colls:
        for prev, cur in zip(pieces, pieces[1:]):
            w = ops.wait_of(prev[coll])
            if w is not None:
                add_issue_after(cur[coll], w)


def rewrite(site, chunks: int) -> None:
    """Chunk the all-to-all and its region; chain the all-to-alls the region reaches.

    Before (MoE, capacity form)::

        r = wait(all_to_all(send)); h = experts(view(r)); o = wait(all_to_all(view(h)))

    After (chunks c of the chosen axis, e.g. capacity slots [s_c, s_c + n_c) of every expert)::

        r_c = wait(all_to_all(narrow(send, c)))       # all issued first
        h_c = experts(view_c(r_c))                     # same ops, chunk shapes
        o_c = wait(all_to_all(view_c(h_c)))            # issued as soon as h_c exists
        o   = cat(o_c along the axis)

    The region also reaches upstream: in Ulysses attention the head axis goes back through
    the all-to-all to the q/k/v projections (chunk c = heads c: the projection's weight
    rows), and forward through attention to the output projection, whose contraction over
    the heads becomes a sum of per-chunk partials. Tensors the rest of the graph reads
    whole (saved activations) are rebuilt from their chunks.
    """
    if site.pipeline is not None:
        return dropless.rewrite(site, chunks, _sites_of)

    def may_chain(coll):
        return coll is site.coll or any(o.status == "planned" for o in _sites_of(coll))

    region = best_region(site, may_chain)
    if region is None:  # planned only as part of a region whose own site was not rewritten
        reacher = site.coll.meta.get(REACHED)
        site.skip(
            "chunkable only as part of the region of "
            f"{reacher.name if reacher else 'another site'}, which was not rewritten"
            + (f": {reacher.reason}" if reacher is not None and reacher.reason else "")
        )
        return False
    describe(site, region)
    graph = site.coll.graph
    anchors = _anchors(region)  # before the replay erases the region's nodes
    comm_first = _comm_first(region)
    sizes = chunk_sizes(region.axis.extent, chunks)
    b = Builder(graph, like=site.coll)
    with graph.inserting_before(site.coll):
        try:
            pieces = ax.substitute(b, region, sizes)
        except Exception as e:  # an op refused its chunk shapes: the graph is as it was
            site.skip(f"chunked replay of the region failed ({type(e).__name__}: {str(e)[:200]}); left unchanged")
            return False

    in_region = set(region.matmuls) | set(region.deferred)

    def chained(coll):
        # Every site of a collective the region takes in is rewritten with it: the
        # collective's chunks travel under the region's compute. Its matmuls that the
        # region does not take in (e.g. a bf16 output projection, whose sum over the heads
        # runs whole) read the tensor rebuilt from the chunks: the report names them.
        for other in _sites_of(coll):
            if other is not site:
                other.status, other.strategy, other.chunks = "rewritten", "decompose", chunks
                other.details.update(axis=site.details["axis"], chained_from=site.name)
                other.details.pop("chained", None)
                whole = [m.name for m in other.matmuls if m not in in_region]
                if whole:
                    other.details["matmuls_after_whole"] = whole

    retire_region(graph, region, anchors, pieces[-1], chained)
    _one_at_a_time(comm_first, pieces)
    site.details["chunk_sizes"] = sizes
