"""Reduce-scatters as all-to-alls where the backend runs reduce-scatter as an all-reduce.

gloo has no reduce-scatter algorithm of its own: ProcessGroupGloo runs
``reduce_scatter_tensor`` as an all-reduce of the whole input, then keeps the rank's block.
Every rank then sends the whole tensor's worth twice ((W-1)/W of it in each of two phases),
where a ring reduce-scatter sends (W-1)/W of it once. An all-to-all moves exactly what a
reduce-scatter must: block j of every rank's input to rank j. Summing the W blocks a rank
received is its share::

    Before::  out = wait(reduce_scatter_tensor(x, "sum", W, group))        # x: (W * m, ...)
    After::   r = wait(all_to_all_single(x, [m] * W, [m] * W, group))      # block i from rank i
              out = sum(view(r, (W, m, ...)), 0)

Half the bytes on the wire at world 2 (measured: docs/design.md, "Reduce-scatter on gloo").
A large all-to-all is sent in pieces (:func:`pieces`), each an all-to-all of a column range of
every block, all issued before the first is waited on: on gloo's TCP transport one message of
hundreds of KiB per peer ran at half the link rate after another collective, where the same
bytes in pieces kept it. Block i of the result comes from rank i on every rank, so the sum's
order is fixed and the same for every block; values differ from gloo's all-reduce order by
rounding only (fp32: ~1e-7 relative; bf16: the sum is accumulated in fp32 and rounded once).

This is a lowering, not a site: it runs after the sites are rewritten, on every
reduce-scatter of the graph (the chunks a rewrite issued included), so the planner prices
reduce-scatters on such groups as all-to-alls (:func:`lowered_groups`, passes/plan.py).
Option ``reduce_scatter``: "auto" lowers on gloo groups (under strategy "none" only where
micro-batch slices rewrite the graph anyway), "all_to_all" on every group, "native" nowhere.
"""

from __future__ import annotations

import math

from torch.fx import Graph, Node

from overlapc.options import Options

from . import ops
from .build import Builder
from .lower import SITE_WAIT

AS_ALL_TO_ALL = "all_to_all"
PIECE_BYTES = 32 << 10
"""Largest message per peer of one piece (bytes). Measured pieces: docs/design.md."""
MAX_PIECES = 16
LOWERED_BACKENDS = ("gloo",)
"""Backends whose reduce-scatter is an all-reduce underneath."""


def _group_lowered(name: str | None, options: Options) -> bool:
    if options.reduce_scatter == "native" or name is None:
        return False
    if options.reduce_scatter == AS_ALL_TO_ALL:
        return True
    slices = isinstance(options.microbatches, int) and options.microbatches > 1
    if options.strategy == "none" and not slices:  # "auto" under "none": report only, nothing changes
        return False
    from overlapc.runtime import lanes

    return ops.group_backend(lanes.base_group(name)) in LOWERED_BACKENDS


def pieces(nbytes: int, world: int) -> int:
    """All-to-alls one reduce-scatter of ``nbytes`` (one rank's input) is sent as."""
    return max(1, min(MAX_PIECES, math.ceil(nbytes / world / PIECE_BYTES)))


def piece_bounds(cols: int, k: int) -> list[int]:
    """Column bounds of ``k`` pieces of a block of ``cols`` columns: piece p is [b[p], b[p + 1])."""
    return [cols * p // k for p in range(k + 1)]


def lowerable(rs: Node, options: Options) -> bool:
    """Whether ``rs``, a reduce-scatter, runs as an all-to-all under ``options``: a sum or
    average over a group the option lowers, of a static dim 0 that the world divides."""
    if rs.target is not ops.REDUCE_SCATTER or rs.args[1] not in ("sum", "avg"):
        return False
    world, v = rs.args[2], ops.val(rs.args[0])
    if not isinstance(world, int) or world < 2 or v is None or v.dim() == 0:
        return False
    rows = v.shape[0]
    return (
        isinstance(rows, int)
        and rows % world == 0
        and ops.wait_of(rs) is not None
        and _group_lowered(ops.group_name(rs), options)
    )


def lowered_groups(graph: Graph, options: Options) -> set[str]:
    """Names of the groups whose reduce-scatters in ``graph`` :func:`lower_reduce_scatters`
    would lower."""
    return {ops.group_name(n) for n in graph.nodes if lowerable(n, options)}


def lower_reduce_scatters(graph: Graph, options: Options) -> set[str]:
    """Rewrite each :func:`lowerable` reduce-scatter of ``graph`` in place as an all-to-all and
    a sum of the blocks received; returns the names of the groups whose ones were rewritten."""
    done: set[str] = set()
    for rs in [n for n in graph.nodes if lowerable(n, options)]:
        wait = ops.wait_of(rs)
        x, op, world, group = rs.args[:4]
        v = ops.val(x)
        shape, block = list(v.shape), v.numel() // world
        k = pieces(v.numel() * v.element_size(), world)
        bounds = piece_bounds(block, k)
        b = Builder(graph, like=rs)
        with graph.inserting_before(rs):
            if k == 1:
                sends = [x]
            else:  # piece p: columns [bounds[p], bounds[p + 1]) of every rank's block
                blocks = b.reshape(x, [world, block])
                sends = [b.contiguous(b.slice(blocks, 1, lo, hi)) for lo, hi in zip(bounds, bounds[1:])]
            rows = 1 if k > 1 else shape[0] // world  # dim-0 rows of one block
            a2as = [b.call(ops.ALL_TO_ALL, t, [rows] * world, [rows] * world, group) for t in sends]
        tag = wait.meta.get(SITE_WAIT)  # a rewritten site's chunk: its failure still names it
        with graph.inserting_before(wait):
            parts = []
            for a2a, lo, hi in zip(a2as, bounds, bounds[1:]):
                waited = b.call(ops.WAIT, a2a)
                if tag is not None:
                    waited.meta[SITE_WAIT] = tag
                got = b.view(waited, [world, hi - lo])
                parts.append(b.call(ops.aten.sum.dim_IntList, got, [0]))
            out = b.view(parts[0] if k == 1 else b.cat(parts, 0), [shape[0] // world, *shape[1:]])
            if op == "avg":
                out = b.call(ops.aten.div.Tensor, out, world)
        wait.replace_all_uses_with(out)
        graph.erase_node(wait)
        graph.erase_node(rs)
        done.add(group)
    return done
