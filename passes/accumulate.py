"""Accumulate: the per-chunk partial sums a rewrite builds, summed by the GEMMs themselves.

A chunked region whose steps sum over the chunked axis (the input gradient of a projection
chunked over heads, a weight gradient chunked over the batch) emits one partial product per
chunk and adds them (:func:`passes.axis.add_partials`): ``p0 + p1 + ...``, each ``p_c`` a
GEMM's output or a view of it. Run eagerly, each add is one more pass over the output that
reads two tensors and writes a third. ``addmm(acc, a, b)`` instead lets the GEMM add its
product to the running sum (BLAS ``beta = 1``, on a copy of ``acc``): one pass fewer per
partial. Measured on a two-process micro-benchmark (BENCHMARKS.md, issue 6): the partial
sums' overhead over one whole GEMM halved (4 chunks: +2 ms against +3.4-6.3 ms).

The addmm goes where the partial's mm was, so the pipeline order the rewrite laid out
(chunk c's GEMM under chunk c+1's collective) stays. Only sums overlapc built (adds marked
``meta["overlapc"]``), in fp32 or fp64 (narrower partials are never built: see
passes/axis.py), of a 2-D mm that nothing else reads, with no broadcasting, and a running
sum defined before the mm. Option ``addmm_partials=False`` leaves the adds as they are.
"""

from __future__ import annotations

import torch
from torch.fx import Graph, Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

from . import ops
from .build import Builder
from .normalize import remove_dead_nodes

_VIEWS = (ops.aten.view.default, ops.aten._unsafe_view.default, ops.aten.reshape.default)


def fold_partial_sums(graph: Graph) -> int:
    """Turn ``add(acc, [view of] mm(a, b))`` chains into ``addmm``; returns how many."""
    pos = {n: i for i, n in enumerate(graph.nodes)}
    folded = 0
    for add in list(graph.nodes):
        if add.target is not ops.ADD or not add.meta.get("overlapc") or add.kwargs or len(add.args) != 2:
            continue
        for acc, part in (add.args, add.args[::-1]):
            mm = _only_gemm(part)
            if (
                mm is None
                or not isinstance(acc, Node)
                or pos.get(acc, len(pos)) >= pos[mm]
                or not _same_shape(acc, add)
            ):
                continue
            b = Builder(graph, like=mm)
            with graph.inserting_before(mm):
                shape = list(ops.val(mm).shape)
                acc2 = acc if _same_shape(acc, mm) else b.call(ops.aten.reshape.default, acc, shape)
                out = b.call(ops.aten.addmm.default, acc2, *mm.args)
                if part is not mm:
                    out = b.call(ops.aten.view.default, out, list(ops.val(add).shape))
            for n in b.created:
                pos[n] = pos[mm]
            add.replace_all_uses_with(out)
            graph.erase_node(add)
            folded += 1
            break
    if folded:
        remove_dead_nodes(graph)
    return folded


def _only_gemm(part) -> Node | None:
    """The 2-D fp32/fp64 mm whose output ``part`` is (directly or through a view), read only there."""
    if not isinstance(part, Node) or len(part.users) != 1:
        return None
    mm = part.args[0] if part.target in _VIEWS and isinstance(part.args[0], Node) else part
    if mm.target is not ops.aten.mm.default or len(mm.users) != 1:
        return None
    v = ops.val(mm)
    return mm if v is not None and v.dtype in (torch.float32, torch.float64) else None


def _same_shape(x: Node, y: Node) -> bool:
    vx, vy = ops.val(x), ops.val(y)
    if vx is None or vy is None or vx.dtype != vy.dtype or vx.dim() != vy.dim():
        return False
    return all(statically_known_true(a == b) for a, b in zip(vx.shape, vy.shape))
