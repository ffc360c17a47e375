"""Matmul -> AllReduce sites (tensor-parallel row-parallel linears).

Found::

    y = mm(a, W)                        # or a sum of matmuls
    y3 = view(y, (B, S, N))
    ar = all_reduce(y3, "sum", group); out = wait_tensor(ar)

Any row block of the matmul output can be all-reduced on its own, so the rows of ``a``
are what a rewrite chunks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch.fx import Graph

from . import ops
from .build import Builder, chunk_sizes
from .deps import DepGraph
from .normalize import Dims, NoProducer, erase_collective, matmul_producer
from .rows import can_chunk_rows, chunk_rows, static_shape
from .sites import Loose, ProducerSite


@dataclass(eq=False)
class MatmulAllReduceSite(ProducerSite):
    pattern = "matmul_all_reduce"
    reduce_op: str = "sum"


def find_matmul_all_reduce_sites(graph: Graph, deps: DepGraph):
    sites, loose = [], []
    for node in graph.nodes:
        if node.target is not ops.ALL_REDUCE:
            continue
        wait = ops.wait_of(node)
        if wait is None:
            loose.append(Loose(node, "all-reduce is not completed by a single wait_tensor"))
            continue
        if ops.reduce_op(node) not in ("sum", "avg"):
            loose.append(Loose(node, f"a {ops.reduce_op(node)} all-reduce, not a matmul's partial sums"))
            continue
        x = node.args[0]
        rank = len(ops.shape(x) or [])
        try:
            # Track the flattened leading dims (the rows of a matmul output) down to the matmul.
            prod = matmul_producer(x, Dims(range(max(rank - 1, 0))) if rank else None, {node})
        except NoProducer as e:
            loose.append(Loose(node, str(e)))
            continue
        site = MatmulAllReduceSite(
            coll=node,
            wait=wait,
            group=ops.group_name(node),
            world=ops.world_size(node),
            reduce_op=ops.reduce_op(node),
            producer=prod,
        )
        site.details = {"producer": prod.form, "reduce_op": site.reduce_op}
        sites.append(site)
    return sites, loose


# ----------------------------------------------------------------------------- rewrite


def can_rewrite(site: MatmulAllReduceSite) -> str | None:
    why = can_chunk_rows(site.coll.args[0], site.producer)
    if why:
        return why
    if chunk_extent(site) < 2:
        return "a single output row: too small to chunk"
    return None


def chunk_extent(site: MatmulAllReduceSite) -> int:
    return math.prod(static_shape(site.coll.args[0])[:-1])


def rewrite_matmul_all_reduce(site: MatmulAllReduceSite, chunks: int) -> None:
    """All-reduce row chunks of the matmul output while the next chunk is computed.

    Before::  y = mm(a, w); out = all_reduce(view(y, shape))
    After::   y_c = mm(a[o_c:o_c+l_c], w); r_c = all_reduce(y_c)   # each issued at once
              out = view(cat([wait(r_c)]), shape)                 # waited on last
    """
    graph = site.coll.graph
    x = site.coll.args[0]
    shape = static_shape(x)
    b = Builder(graph, like=site.coll)
    waits = []
    with graph.inserting_before(site.coll):
        off = 0
        for n in chunk_sizes(chunk_extent(site), chunks):
            yc = chunk_rows(b, x, site.producer, lambda a, off=off, n=n: b.slice(a, 0, off, off + n))
            ar = b.call(ops.ALL_REDUCE, yc, site.reduce_op, site.group)
            waits.append(b.call(ops.WAIT, ar))
            off += n
        out = b.view(b.cat(waits, 0), shape)
    site.wait.replace_all_uses_with(out)
    erase_collective(site.coll, site.wait)
