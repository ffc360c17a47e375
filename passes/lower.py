"""Lower: apply the planned rewrites, one site at a time, each all-or-nothing.

Each site kind registers how to check it (``can_rewrite``), how long the dim it chunks is
(``extent``) and how to rewrite it. A site whose nodes an earlier rewrite consumed (an
AG -> mm -> RS chain shares its matmul) is re-checked and skipped with its reason.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from torch.fx import Graph

from . import all_gather_matmul as agm
from . import all_to_all as a2a
from . import fuse
from . import matmul_all_reduce as mar
from . import matmul_reduce_scatter as mrs
from .deps import DepGraph
from .rows import LOCAL_ROWS, ROW_CHUNKS
from .sites import MatchedSite


@dataclass(frozen=True)
class Rule:
    can_rewrite: Callable[[MatchedSite, DepGraph], str | None]
    extent: Callable[[MatchedSite], int]
    rewrite: Callable[[MatchedSite, int], bool | None]
    """Rewrites the site; returns False when it decided not to (and set the site's reason)."""
    auto_chunks: Callable[[int], int] | None = None
    """chunks="auto" from the extent, where the planner's row rule does not fit."""


RULES = {
    agm.AllGatherMatmulSite: Rule(agm.can_rewrite, agm.chunk_extent, agm.rewrite_all_gather_matmul),
    mrs.MatmulReduceScatterSite: Rule(
        lambda s, deps: mrs.can_rewrite(s), mrs.chunk_extent, mrs.rewrite_matmul_reduce_scatter
    ),
    mar.MatmulAllReduceSite: Rule(lambda s, deps: mar.can_rewrite(s), mar.chunk_extent, mar.rewrite_matmul_all_reduce),
    **{kind: Rule(a2a.can_rewrite, a2a.chunk_extent, a2a.rewrite, a2a.auto_chunks) for kind in a2a.A2A_SITES},
}


def lower_sites(graph: Graph, sites: list[MatchedSite]) -> int:
    """Rewrite every planned site; returns how many were rewritten."""
    done = 0
    for site in sites:
        # lets a rewrite chain a later planned site into its own
        site.coll.meta.setdefault(a2a.SITE, []).append(site)
    for site in sites:
        if site.status != "planned":
            continue
        if any(n.graph is not graph or _erased(n) for n in [site.coll, site.wait, *site.matmuls]):
            site.skip("its matmul was already rewritten as part of another site")
            continue
        before = set(graph.nodes)
        if site.strategy == "fuse":
            fuse.rewrite(site, site.chunks, site.timeout)
        elif RULES[type(site)].rewrite(site, site.chunks) is False:
            continue
        _tag_waits(graph, before, site)
        site.status = "rewritten"
        done += 1
    for node in graph.nodes:  # sites and chunk lists hold nodes: keep them out of meta that others copy or pickle
        for key in (a2a.SITE, a2a.REACHED, ROW_CHUNKS, LOCAL_ROWS):
            node.meta.pop(key, None)
    return done


SITE_WAIT = "overlapc_site_wait"
"""node.meta key on each wait a rewrite emitted: (site name, chunk index, chunks), so a
collective that fails or times out is reported with the site and chunk it belongs to."""


def _tag_waits(graph: Graph, before: set, site: MatchedSite) -> None:
    from . import ops

    waits = [n for n in graph.nodes if n not in before and n.target is ops.WAIT]
    for i, w in enumerate(waits):
        w.meta[SITE_WAIT] = (site.name, i, len(waits))


def _erased(node) -> bool:
    # fx marks erased nodes by unlinking them from the graph's list.
    return node._erased if hasattr(node, "_erased") else node.prev is node
