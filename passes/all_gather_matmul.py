"""AllGather -> matmul sites (sequence-parallel column-parallel linears).

Found::

    ag = all_gather_into_tensor(x, W, group); w = wait_tensor(ag)
    [parts = split(w, ...); g = cat(parts, dim=d)]          # gathers on an inner dim
    a = view/t/permute/...(g)
    y1 = mm(a, W1); y2 = mm(a, W2); ...                     # one all-gather, several matmuls

One all-gather feeding several matmuls (q/k/v, gate/up, or dgrad and wgrad in backward)
is one site. Each matmul use records where the gathered dim lands: "rows" (the matmul
output rows follow the gathered chunks: pipelinable), "contraction" (the gathered dim is
summed over, as in a weight gradient gathered^T @ dy) or "cols".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch.fx import Graph, Node

from . import ops
from .build import Builder, chunk_sizes, movedim_perm
from .deps import DepGraph
from .normalize import (
    Dims,
    NoProducer,
    Use,
    erase_collective,
    matmul_producer,
    matmul_uses,
    remove_dead_nodes,
    split_cat_gather,
)
from .rows import ROW_CHUNKS, ROW_MATMULS, RowChunks, local_row_chunks, pinned_scale, row_layout, static_shape
from .sites import ConsumerSite, Loose


@dataclass(eq=False)
class AllGatherMatmulSite(ConsumerSite):
    pattern = "all_gather_matmul"
    shard: Node = None
    """The local input of the all-gather."""
    gathered: Node = None
    """The gathered tensor as the model sees it: the wait, or the cat of the split + cat idiom."""
    gather_dim: int = 0
    """Dim of ``gathered`` that holds the rank-ordered shards."""
    idiom: list[Node] = field(default_factory=list)
    """split/getitem/cat nodes of an inner-dim gather (empty for dim 0)."""

    @property
    def dim(self):
        return self.gather_dim

    def check(self, deps: DepGraph) -> str | None:
        """What must stay true for a rewrite: no matmul's other operand needs the gather."""
        for u in self.uses:
            if u.other is not None and deps.depends(u.other, self.wait):
                return f"the other operand of {u.matmul.name} depends on the all-gather"
        return None


def find_all_gather_matmul_sites(graph: Graph, deps: DepGraph) -> tuple[list[AllGatherMatmulSite], list[Loose]]:
    sites, loose = [], []
    for node in graph.nodes:
        if node.target is not ops.ALL_GATHER:
            continue
        wait = ops.wait_of(node)
        if wait is None:
            loose.append(Loose(node, "all-gather is not completed by a single wait_tensor"))
            continue
        world = ops.world_size(node)
        gathered, dim, idiom = wait, 0, []
        inner = split_cat_gather(wait, world) if world else None
        if inner is not None:
            gathered, dim = inner
            idiom = [*ops.data_users(wait), *gathered.args[0], gathered]
        uses, others = matmul_uses(gathered, Dims({dim}))
        if not uses:
            loose.append(Loose(node, _no_consumer_reason(node, others)))
            continue
        # The other operand of a matmul must not itself depend on the gathered tensor:
        # then the matmul cannot start on a chunk before the whole gather is done.
        kept = [u for u in uses if u.other is None or not deps.depends(u.other, wait)]
        dropped = [u for u in uses if u not in kept]
        if not kept:
            names = ", ".join(u.matmul.name for u in dropped)
            loose.append(
                Loose(node, f"the other operand of every matmul consumer ({names}) depends on the all-gather itself")
            )
            continue
        site = AllGatherMatmulSite(
            coll=node,
            wait=wait,
            group=ops.group_name(node),
            world=world,
            shard=node.args[0],
            gathered=gathered,
            gather_dim=dim,
            idiom=idiom,
            uses=kept,
            other_users=others + [u.matmul for u in dropped],
        )
        site.details = {
            "roles": {u.matmul.name: f"{u.side}:{u.role}" for u in kept},
            "other_users": [n.name for n in site.other_users],
        }
        sites.append(site)
    return sites, loose


def _no_consumer_reason(coll: Node, others: list[Node]) -> str:
    users = ", ".join(sorted({ops.op_name(n) for n in others})) or "nothing"
    reason = f"no matmul consumer (the gathered tensor is used by {users})"
    src = coll.args[0]
    try:
        prod = matmul_producer(src, None, {coll})
        reason += (
            f"; its input comes from matmul {prod.matmuls[0].name}: matmul -> all-gather is "
            "not a site kind (keep the output sharded, e.g. loss_parallel, or gather the input instead)"
        )
    except NoProducer:
        pass
    return reason


# ----------------------------------------------------------------------------- rewrite


def row_uses(site: AllGatherMatmulSite) -> list[Use]:
    """Consumers whose output rows follow the gathered rows: mm/addmm, or _scaled_mm with a
    tensorwise scale, on a reshape of the gathered tensor that keeps its last dim as the
    contraction dim."""
    gshape = static_shape(site.gathered)
    out = []
    for u in site.uses:
        if u.side != "lhs" or u.role != "rows" or u.matmul.target not in ROW_MATMULS:
            continue
        if not _through_layout(u):
            continue
        operand = static_shape(u.matmul.args[u.arg])
        if gshape is None or operand is None or len(operand) != 2 or operand[-1] != gshape[-1]:
            continue
        if row_args(site, u) is None:
            continue
        out.append(u)
    return out


def _through_layout(u: Use) -> bool:
    """The gathered tensor reaches ``u``'s operand through reshapes, identities and full slices."""
    return all(p.target in ops.RESHAPES or ops.is_identity(p) or ops.is_full_slice(p) for p in u.path)


def contraction_uses(site: AllGatherMatmulSite) -> list[Use]:
    """Consumers that sum over the gathered rows: ``mm(a, g)`` with ``g`` the gathered rows
    (reached through reshapes that keep the last dim) and ``a`` of shape (N, M), a weight
    gradient. Chunk c's partial product takes chunk c's columns of ``a``."""
    gshape = static_shape(site.gathered)
    if gshape is None:
        return []
    out = []
    for u in site.uses:
        if u.side != "rhs" or u.role != "contraction" or u.matmul.target is not ops.aten.mm.default:
            continue
        if not _through_layout(u):
            continue
        operand, lhs = static_shape(u.matmul.args[u.arg]), static_shape(u.matmul.args[0])
        if operand is None or len(operand) != 2 or operand[-1] != gshape[-1] or lhs is None or lhs[-1] != operand[0]:
            continue
        out.append(u)
    return out


def row_args(site: AllGatherMatmulSite, u: Use) -> list[int] | None:
    """Arguments of a consumer, beside the gathered operand, with one entry per output row: an
    addmm's full bias, a _scaled_mm's rowwise scale_a. Each chunk takes its rows of them, which
    are the gathered rows' rank-major order only for a gather along dim 0. [] where there are
    none (a broadcast bias, a tensorwise scale pass whole); None where they cannot be chunked."""
    m, out = u.matmul, static_shape(u.matmul)
    if out is None:
        return None
    found = []
    if m.target is ops.aten.addmm.default:
        bias = static_shape(m.args[0])
        if bias is None:
            return None
        if math.prod(bias) != out[-1]:  # not one row broadcast: the output's rows, or refused
            if bias != out:
                return None
            found.append(0)
    elif m.target is ops.SCALED_MM and ops.scale_kind(m) != "tensor":
        if ops.scale_kind(m) != "row":
            return None
        found.append(2)
    if found and site.gather_dim != 0:
        return None
    return found


def can_rewrite(site: AllGatherMatmulSite, deps: DepGraph) -> str | None:
    """Why the site cannot be decomposed (None: it can)."""
    why = site.check(deps)
    if why:
        return why
    xshape = static_shape(site.shard)
    if xshape is None or static_shape(site.gathered) is None:
        return "dynamic shapes: chunk sizes would not be known at compile time"
    if site.gather_dim == len(xshape) - 1:
        return "gathered along the last (contraction) dim: no output rows to pipeline"
    if chunk_extent(site) < 2:
        return "the shard has a single row: too small to chunk"
    if not row_uses(site) and not contraction_uses(site):
        scaled = [u.matmul.name for u in site.uses if ops.is_scaled_rowwise(u.matmul)]
        if scaled:
            return (
                f"{', '.join(scaled)} scales the gathered rows rowwise, in a layout chunks of rows cannot "
                "take their scales from (a gather along dim 0 can)"
            )
        roles = ", ".join(f"{k}={v}" for k, v in site.details.get("roles", {}).items())
        return f"no matmul consumes gathered rows, or sums over them, through reshapes only ({roles})"
    return None


def chunk_extent(site: AllGatherMatmulSite) -> int:
    """Rows of the local shard (all dims but the last, flattened): what the rewrite chunks."""
    return math.prod(static_shape(site.shard)[:-1])


def rewrite_all_gather_matmul(site: AllGatherMatmulSite, chunks: int) -> None:
    """Gather the shard in ``chunks`` row ranges; each row consumer runs on a range as it lands.

    Before::

        g = all_gather(x, dim=d); y = mm(reshape(g, (M, K)), w)

    After (x as R rows of K; ranges c = [o_c, o_c + n_c); every gather issued first)::

        g_c = wait(all_gather(reshape(x, (R, K))[o_c:o_c+n_c]))   # (W * n_c, K), rank-major
        y_c = mm(g_c, w)                                         # reads the gathered buffer as is
        y   = reshape(movedim(cat([y_c as (W, n_c, N)], 1) as (W, *x[:-1], N), 0, d), (M, N))

    Ranges of the flattened rows are contiguous views of the shard, so nothing is copied
    before a gather, and each GEMM reads its gathered range in place: no compiler fusion
    can tie a GEMM, or a gather, to another range's data. The rank-major row order is
    fixed once, in the final cat. Other users of g (weight-gradient matmuls, the
    saved-for-backward tensor) read g rebuilt from the ranges after the GEMMs. Output
    layout and values are exactly the original's.
    """
    graph = site.coll.graph
    uses, sums = row_uses(site), contraction_uses(site)
    x, d, world, group = site.shard, site.gather_dim, site.world, site.group
    xshape = static_shape(x)
    rank = len(xshape)
    k, rows = xshape[-1], chunk_extent(site)
    first = ops.in_graph_order(u.matmul for u in uses + sums)[0]
    b = Builder(graph, like=site.coll)

    def assemble(parts, last):
        """(W, n_c, last) pieces -> the gathered layout (..., W * x_d, ..., last)."""
        full = b.view(b.cat(parts, 1), [world, *xshape[:-1], last])
        if d == 0:
            return full
        # Materialise: a reshape of the permuted view can itself be a (non-contiguous) view
        # when size-1 dims are merged, and users of the original expect a contiguous tensor.
        return b.contiguous(b.permute(full, movedim_perm(rank + 1, 0, d)))

    pieces = []  # gathered ranges as (W * n_c, K)
    sizes = chunk_sizes(rows, chunks)
    layout = row_layout(world, d, static_shape(site.gathered), sizes)
    with graph.inserting_before(first):
        # Ranges of a shard made by row-wise ops from an earlier reduce-scatter's chunks
        # (RS -> residual add -> norm -> AG) are computed from those chunks: range c is
        # gathered once chunk c has arrived, not after the whole reduce-scatter.
        chained, sources = local_row_chunks(b, x, sizes) or (None, [])
        flat = b.reshape(x, [rows, k]) if chained is None else None
        off = 0
        for c, n in enumerate(sizes):
            src = chained[c] if chained is not None else b.slice(flat, 0, off, off + n)
            ag = b.call(ops.ALL_GATHER, src, world, group)
            pieces.append((b.call(ops.WAIT, ag), n))
            off += n
        operands: dict[tuple, list[Node]] = {}

        def chunks_for(u: Use) -> list[Node]:
            """The ranges as ``u``'s operand: one per range, shared by consumers with the same casts."""
            casts = [p for p in u.path if p.target in ops.IDENTITIES and p.target is not ops.aten.clone.default]
            key = tuple((p.target, p.args[1:], tuple(p.kwargs.items())) for p in casts)
            if key not in operands:
                operands[key] = []
                for a, _ in pieces:
                    for p in casts:
                        a = b.call(p.target, a, *p.args[1:], **p.kwargs)
                    operands[key].append(a)
            return operands[key]

        for u in uses:
            mm = u.matmul
            outs, ys = [], []
            per_row = {i: b.view(mm.args[i], [world, rows, ops.shape(mm.args[i])[-1]]) for i in row_args(site, u)}
            off = 0
            for a, (_, n) in zip(chunks_for(u), pieces):
                args = list(mm.args)
                args[u.arg] = a
                for i, whole_rows in per_row.items():  # chunk c's rows of every rank, as its operand holds them
                    part = b.reshape(b.slice(whole_rows, 1, off, off + n), [world * n, ops.shape(mm.args[i])[-1]])
                    args[i] = pinned_scale(b, part) if mm.target is ops.SCALED_MM else part
                off += n
                y = b.call(mm.target, *args, **mm.kwargs)
                ys.append(y)
                outs.append(b.view(y, [world, n, ops.shape(y)[-1]]))
            whole = b.reshape(assemble(outs, ops.shape(mm)[-1]), ops.shape(mm))
            # A later reduce-scatter with the same row layout reads these chunks directly.
            whole.meta[ROW_CHUNKS] = RowChunks(layout, ys, site.name)
            mm.replace_all_uses_with(whole)
        for u in sums:
            chunks_for(u)  # the ranges' casts, beside the gathers
        last = b.created[-1]
    for u in sums:  # a sum over the gathered rows: one partial product per range, added up
        mm, n_out, lead = u.matmul, ops.shape(u.matmul.args[0])[0], xshape[:-1]
        # where the sum was: its other operand (a gradient) may be computed after the first GEMM
        with graph.inserting_before(mm):
            # a's columns are the gathered rows, (..., W * x_d, ...) flattened: as (N, W, rows)
            cols = b.reshape(mm.args[0], [n_out, *lead[:d], world, *lead[d:]])
            if d:
                cols = b.permute(cols, movedim_perm(len(lead) + 2, 1 + d, 1))
            cols = b.reshape(cols, [n_out, world, rows])
            total, off = None, 0
            for a, (_, n) in zip(chunks_for(u), pieces):
                part = b.call(mm.target, b.reshape(b.slice(cols, 2, off, off + n), [n_out, world * n]), a)
                total = part if total is None else b.call(ops.ADD, total, part)
                off += n
        mm.replace_all_uses_with(total)
    if sources:
        site.details["rows_from"] = sources
    for u in uses + sums:  # not inside inserting_before(first): first is one of them
        graph.erase_node(u.matmul)
    remove_dead_nodes(graph)
    if ops.data_users(site.gathered):
        # Rebuilt after the GEMMs, not where the gather was: placed early, it would make
        # the scheduler wait for every range before the first GEMM.
        with graph.inserting_after(last):
            parts = [b.view(w, [world, n, k]) for w, n in pieces]
            full = b.reshape(assemble(parts, k), ops.shape(site.gathered))
        site.gathered.replace_all_uses_with(full)
        remove_dead_nodes(graph)
    erase_collective(site.coll, site.wait)
