"""Matmul -> ReduceScatter sites (sequence-parallel row-parallel linears).

Found::

    y = mm(a, W)                        # or a sum of matmuls: dq@Wq + dk@Wk + dv@Wv
    y3 = view(y, (B, S, N))
    [parts = split(y3, S // W, dim=d); c = cat(parts)]   # scatters an inner dim
    rs = reduce_scatter_tensor(c, "sum", W, group); out = wait_tensor(rs)

The matmul result must feed only the reduce-scatter: if it is used elsewhere, chunking it
would leave the full GEMM in place beside the chunked one.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch.fx import Graph, Node

from . import ops
from .build import Builder, chunk_sizes, movedim_perm
from .deps import DepGraph
from .normalize import Dims, NoProducer, Producer, erase_collective, matmul_producer, split_cat_scatter
from .rows import LOCAL_ROWS, LocalRows, can_chunk_rows, chained_rows, chunk_rows, row_layout, static_shape
from .sites import Loose, ProducerSite


@dataclass(eq=False)
class MatmulReduceScatterSite(ProducerSite):
    pattern = "matmul_reduce_scatter"
    scattered: Node = None
    """The tensor whose ``scatter_dim`` is reduce-scattered (before the split + cat idiom)."""
    scatter_dim: int = 0
    idiom: list[Node] = field(default_factory=list)
    """split/getitem/cat nodes of an inner-dim scatter (empty for dim 0)."""
    reduce_op: str = "sum"

    @property
    def dim(self):
        return self.scatter_dim


def collective_input(coll: Node, world: int | None) -> tuple[Node, int, list[Node], set[Node]]:
    """(tensor, dim, idiom nodes, users allowed on the tensor) for a scatter-like collective."""
    inp = coll.args[0]
    inner = split_cat_scatter(inp, world) if world else None
    if inner is None:
        return inp, 0, [], {coll}
    y, d, feeders = inner
    idiom = list(dict.fromkeys([*feeders, *inp.args[0], inp]))
    return y, d, idiom, feeders


def find_matmul_reduce_scatter_sites(graph: Graph, deps: DepGraph):
    sites, loose = [], []
    for node in graph.nodes:
        if node.target is not ops.REDUCE_SCATTER:
            continue
        wait = ops.wait_of(node)
        if wait is None:
            loose.append(Loose(node, "reduce-scatter is not completed by a single wait_tensor"))
            continue
        world = ops.world_size(node)
        y, dim, idiom, allowed = collective_input(node, world)
        if idiom and len(ops.data_users(node.args[0])) != 1:
            loose.append(Loose(node, f"the concatenated scatter input {node.args[0].name} has other users"))
            continue
        try:
            prod = matmul_producer(y, Dims({dim}), allowed)
        except NoProducer as e:
            loose.append(Loose(node, str(e)))
            continue
        site = MatmulReduceScatterSite(
            coll=node,
            wait=wait,
            group=ops.group_name(node),
            world=world,
            scattered=y,
            scatter_dim=dim,
            idiom=idiom,
            reduce_op=ops.reduce_op(node),
            producer=prod,
        )
        site.details = {"producer": prod.form, "roles": _roles(prod), "reduce_op": site.reduce_op}
        sites.append(site)
    return sites, loose


def _roles(prod: Producer) -> dict[str, str]:
    """Where the scattered dim lands in each matmul's output: "rows", "cols", or "unknown"."""
    out = {}
    for m, d in zip(prod.matmuls, prod.dims):
        rank = len(ops.shape(m) or [2])
        if d is None or len(d) != 1:
            out[m.name] = "unknown"
        else:
            (k,) = d
            k -= rank - 2
            out[m.name] = "batch" if k < 0 else "rows" if k == 0 else "cols"
    return out


# ----------------------------------------------------------------------------- rewrite


def can_rewrite(site: MatmulReduceScatterSite) -> str | None:
    if site.reduce_op not in ("sum", "avg"):
        return f"reduce op {site.reduce_op!r} is not rewritten (sum and avg are)"
    why = can_chunk_rows(site.scattered, site.producer)
    if why:
        return why
    shape = static_shape(site.scattered)
    d = site.scatter_dim
    if d == len(shape) - 1:
        return "scattered along the last (output column) dim: rows cannot be pipelined"
    if shape[d] % site.world:
        return f"size {shape[d]} along the scatter dim is not divisible by the world size {site.world}"
    if chunk_extent(site) < 2:
        return "a single local output row: too small to chunk"
    return None


def chunk_extent(site: MatmulReduceScatterSite) -> int:
    """Rows of the local output (all dims but the last, flattened): what the rewrite chunks."""
    return math.prod(static_shape(site.scattered)[:-1]) // site.world


def rewrite_matmul_reduce_scatter(site: MatmulReduceScatterSite, chunks: int) -> None:
    """Compute the matmul per chunk of destination rows; reduce-scatter each chunk while
    the next is computed.

    Before::

        y = mm(a, w) (or a sum of matmuls), as (.., S, .., N); out = reduce_scatter(y, dim=d)

    After (S = W * s; the local output has R rows; chunk c is its rows [o_c, o_c + n_c))::

        a_c = reshape(movedim(a as (.., W, s, .., K), d, 0) as (W, R, K)[:, o_c:o_c+n_c], (-1, K))
        y_c = mm(a_c, w)                    # rank-major rows: already the scatter layout
        r_c = reduce_scatter(y_c)           # issued at once
        out = view(cat([wait(r_c)]), out_shape)

    The row reordering is a copy of the GEMM's input, made before it; the GEMM's output
    goes to the reduce-scatter as it is, with nothing in between.
    """
    graph = site.coll.graph
    y, d, world = site.scattered, site.scatter_dim, site.world
    shape = static_shape(y)
    rank = len(shape)
    s, rows = shape[d] // world, chunk_extent(site)
    out_shape = shape[:d] + [s] + shape[d + 1 :]
    b = Builder(graph, like=site.coll)
    waits = []
    rank_major: dict[Node, Node] = {}  # per matmul operand: (W, R, K), made once

    def by_rank(a: Node) -> Node:
        if a not in rank_major:
            k = static_shape(a)[-1]
            v = b.view(a, [*shape[:d], world, s, *shape[d + 1 : -1], k])
            if d > 0:
                v = b.permute(v, movedim_perm(rank + 1, d, 0))
            rank_major[a] = b.reshape(v, [world, rows, k])
        return rank_major[a]

    sizes = chunk_sizes(rows, chunks)
    layout = row_layout(world, d, shape, sizes)
    sources: set[str] = set()
    with graph.inserting_before(site.coll):
        off = 0
        for c, n in enumerate(sizes):

            def plain(a, off=off, n=n):
                return b.reshape(b.slice(by_rank(a), 1, off, off + n), [world * n, static_shape(a)[-1]])

            def select(a, c=c, plain=plain):
                # Rows that an earlier all-gather rewrite already produced chunk by chunk
                # (AG -> mm -> row-wise ops -> mm -> RS, as in an MLP) are read from those
                # chunks: this chunk's GEMM and reduce-scatter then wait only for its own
                # gathered range, and the scatter overlaps the remaining ranges' GEMMs.
                chained = chained_rows(b, a, layout, c, plain, sources)
                return chained if chained is not None else plain(a)

            yc = chunk_rows(b, y, site.producer, select)
            rs = b.call(ops.REDUCE_SCATTER, yc, site.reduce_op, world, site.group)
            waits.append(b.call(ops.WAIT, rs))
            off += n
        out = b.view(b.cat(waits, 0), out_shape)
    # A later all-gather whose shard is computed from these rows by row-wise ops (residual
    # add, norm) reads them chunk by chunk (rows.local_row_chunks).
    out.meta[LOCAL_ROWS] = LocalRows(sizes, waits, site.name)
    if sources:  # the all-gather sites whose chunks feed this one's, chunk by chunk
        site.details["rows_from"] = sorted(sources)
    site.wait.replace_all_uses_with(out)
    erase_collective(site.coll, site.wait)
