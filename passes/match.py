"""Match: find every matmul-collective site in a graph, and every collective in none.

One driver over the per-kind finders; each finder returns its sites and, for each of its
collectives that forms no site, the reason. Collectives no finder handles (coalesced,
broadcast, ...) are reported too. Site names are stable across ranks (graph order) and
readable: ``"<graph>:<module>:<pattern>"``, with ``#2``, ``#3``... on repeats.
"""

from __future__ import annotations

from torch.fx import Graph

from . import ops
from .all_gather_matmul import find_all_gather_matmul_sites
from .all_to_all import find_all_to_all_sites
from .deps import DepGraph
from .matmul_all_reduce import find_matmul_all_reduce_sites
from .matmul_reduce_scatter import find_matmul_reduce_scatter_sites
from .sites import Loose, MatchedSite

FINDERS = (
    find_all_gather_matmul_sites,
    find_matmul_reduce_scatter_sites,
    find_matmul_all_reduce_sites,
    find_all_to_all_sites,
)


def find_sites(graph: Graph, graph_kind: str, deps: DepGraph | None = None) -> tuple[list[MatchedSite], list[Loose]]:
    deps = deps or DepGraph(graph)
    sites: list[MatchedSite] = []
    loose: list[Loose] = []
    for finder in FINDERS:
        found, unmatched = finder(graph, deps)
        sites += found
        loose += unmatched
    handled = {s.coll for s in sites} | {c.coll for c in loose}
    for node in graph.nodes:
        if ops.is_collective(node) and node not in handled:
            loose.append(Loose(node, f"{ops.collective_name(node)} is not a collective overlapc matches"))
    order = {n: i for i, n in enumerate(graph.nodes)}
    sites.sort(key=lambda s: (order[s.coll], s.pattern))
    loose.sort(key=lambda c: order[c.coll])
    name_sites(sites, loose, graph_kind)
    return sites, loose


def name_sites(sites, loose, graph_kind: str):
    seen: dict[str, int] = {}
    for item in [*sites, *loose]:
        item.graph_kind = graph_kind
        if isinstance(item, MatchedSite):
            base = f"{graph_kind}:{item.module() or item.coll.name}:{item.pattern}"
        else:
            base = f"{graph_kind}:{ops.module_path(item.coll) or item.coll.name}:collective"
        n = seen.get(base, 0) + 1
        seen[base] = n
        item.name = base if n == 1 else f"{base}#{n}"
