"""AllToAll <-> matmul sites (expert-parallel MoE dispatch/combine, Ulysses attention).

Found::

    a2a = all_to_all_single(x, out_splits, in_splits, group); r = wait_tensor(a2a)
    e = view/transpose/select...(r); h = bmm(e, W1) ...            # all_to_all_matmul

    o = bmm(h, W2)  (or stack of per-expert mms, or a sum)
    a2a = all_to_all_single(view/transpose(o), ...)               # matmul_all_to_all

One all-to-all can be both: its input made by matmuls and its output consumed by them.
"""
from __future__ import annotations

from dataclasses import dataclass

from torch.fx import Graph, Node

from . import ops
from .deps import DepGraph
from .normalize import Dims, NoProducer, matmul_producer, matmul_uses
from .sites import ConsumerSite, Loose, ProducerSite


def _splits(coll: Node):
    out_s, in_s = coll.args[1], coll.args[2]
    return out_s, in_s


def _static_splits(s) -> bool:
    return s is None or all(isinstance(v, int) for v in s)


@dataclass(eq=False)
class AllToAllMatmulSite(ConsumerSite):
    pattern = "all_to_all_matmul"

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
        uses, others = matmul_uses(wait, Dims({0}), through_indexing=True)
        uses = [u for u in uses if u.other is None or not deps.depends(u.other, wait)]
        if uses:
            s = AllToAllMatmulSite(**common, uses=uses, other_users=others)
            s.details = {"splits": splits, "other_users": [n.name for n in others]}
            found.append(s)
        why_consumer = "no matmul consumer" if not uses else None
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

