"""Matmul -> AllReduce sites (tensor-parallel row-parallel linears).

Found::

    y = mm(a, W)                        # or a sum of matmuls
    y3 = view(y, (B, S, N))
    ar = all_reduce(y3, "sum", group); out = wait_tensor(ar)

Any row block of the matmul output can be all-reduced on its own, so the rows of ``a``
are what a rewrite chunks.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Graph

from . import ops
from .deps import DepGraph
from .normalize import Dims, NoProducer, Producer, matmul_producer
from .sites import Loose, MatchedSite


@dataclass(eq=False)
class MatmulAllReduceSite(MatchedSite):
    pattern = "matmul_all_reduce"
    reduce_op: str = "sum"
    producer: Producer = None

    @property
    def matmuls(self):
        return ops.in_graph_order(self.producer.matmuls)


def find_matmul_all_reduce_sites(graph: Graph, deps: DepGraph):
    sites, loose = [], []
    for node in graph.nodes:
        if node.target is not ops.ALL_REDUCE:
            continue
        wait = ops.wait_of(node)
        if wait is None:
            loose.append(Loose(node, "all-reduce is not completed by a single wait_tensor"))
            continue
        x = node.args[0]
        rank = len(ops.shape(x) or [])
        try:
            # Track the flattened leading dims (the rows of a matmul output) down to the matmul.
            prod = matmul_producer(x, Dims(range(max(rank - 1, 0))) if rank else None, {node})
        except NoProducer as e:
            loose.append(Loose(node, str(e)))
            continue
        site = MatmulAllReduceSite(coll=node, wait=wait, group=ops.group_name(node),
                                   world=ops.world_size(node), reduce_op=ops.reduce_op(node), producer=prod)
        site.details = {"producer": prod.form, "reduce_op": site.reduce_op}
        sites.append(site)
    return sites, loose
