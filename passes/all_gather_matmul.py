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

from dataclasses import dataclass, field

from torch.fx import Graph, Node

from . import ops
from .deps import DepGraph
from .normalize import Dims, NoProducer, Use, matmul_producer, matmul_uses, split_cat_gather
from .sites import Loose, MatchedSite


@dataclass(eq=False)
class AllGatherMatmulSite(MatchedSite):
    pattern = "all_gather_matmul"
    shard: Node = None
    """The local input of the all-gather."""
    gathered: Node = None
    """The gathered tensor as the model sees it: the wait, or the cat of the split + cat idiom."""
    gather_dim: int = 0
    """Dim of ``gathered`` that holds the rank-ordered shards."""
    idiom: list[Node] = field(default_factory=list)
    """split/getitem/cat nodes of an inner-dim gather (empty for dim 0)."""
    uses: list[Use] = field(default_factory=list)
    other_users: list[Node] = field(default_factory=list)
    """Users of the gathered tensor (or its views) that are not matmuls: they still need it whole."""

    @property
    def matmuls(self):
        return ops.in_graph_order(u.matmul for u in self.uses)

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
            sp = ops.data_users(wait)[0]
            idiom = [sp, *sp.users, gathered]
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
            loose.append(Loose(node, f"the other operand of every matmul consumer ({names}) "
                                     "depends on the all-gather itself"))
            continue
        site = AllGatherMatmulSite(
            coll=node, wait=wait, group=ops.group_name(node), world=world, shard=node.args[0],
            gathered=gathered, gather_dim=dim, idiom=idiom, uses=kept,
            other_users=others + [u.matmul for u in dropped])
        site.details = {
            "roles": {u.matmul.name: f"{u.side}:{u.role}" for u in kept},
            "other_users": [n.name for n in site.other_users],
        }
        sites.append(site)
    return sites, loose


def _no_consumer_reason(coll: Node, others: list[Node]) -> str:
    users = ", ".join(sorted({_op_name(n) for n in others})) or "nothing"
    reason = f"no matmul consumer (the gathered tensor is used by {users})"
    src = coll.args[0]
    try:
        prod = matmul_producer(src, None, {coll})
        reason += (f"; its input comes from matmul {prod.matmuls[0].name}: matmul -> all-gather is "
                   "not a site kind (keep the output sharded, e.g. loss_parallel, or gather the input instead)")
    except NoProducer:
        pass
    return reason


def _op_name(n: Node) -> str:
    if n.op == "output":
        return "the graph output"
    if n.op == "call_function":
        return getattr(n.target, "__name__", str(n.target)).split(".")[0]
    return n.op
