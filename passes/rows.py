"""Row-chunked evaluation of a matmul producer (shared by the reduce-scatter and
all-reduce rewrites).

A producer is the tree of nodes between a collective's input and the matmuls that make
it: reshapes that keep the last dim, dtype casts, adds. Every such node acts on rows
independently, so the tree can be evaluated on any subset of the rows of the matmuls'
left operands, giving exactly those rows of the result, with the same operations in the
same order per row::

    y = view(mm(a1, w1), s) + view(mm(a2, w2), s)
    rows(y, r) = mm(a1[r], w1) + mm(a2[r], w2)           # (len(r), N)
"""

from __future__ import annotations

import math
from collections.abc import Callable

from torch.fx import Node

from . import ops
from .build import Builder
from .normalize import Producer

ROW_MATMULS = (ops.aten.mm.default, ops.aten.addmm.default)


def static_shape(node: Node) -> list[int] | None:
    """The node's shape; with symbolic sizes, only while a shape bucket is compiled
    (ops.shape_bucket), where size arithmetic and comparisons on them are guarded."""
    s = ops.shape(node)
    if s is None:
        return None
    if not all(isinstance(d, int) for d in s):
        if not ops.symbolic_ok() or any(ops.hint(d) is None for d in s):
            return None
    return s


def can_chunk_rows(root: Node, prod: Producer) -> str | None:
    """Why ``root`` cannot be evaluated row-chunk by row-chunk (None: it can)."""
    shape = static_shape(root)
    if shape is None:
        return "dynamic shapes: chunk sizes would not be known at compile time"
    n, rows = shape[-1], _rows_of(shape)
    if "concat" in prod.form:
        return "the producer concatenates matmul results (per-expert loop): not row-chunkable"
    for p in prod.path:
        if p.target in ops.RESHAPES:
            if (static_shape(p) or [None])[-1] != n:
                return f"{p.name} reshapes the matmul output's last dim"
        elif p.target in ops.IDENTITIES or p.target is ops.ADD or ops.is_full_slice(p):
            continue
        else:
            return f"{p.name} ({p.target}) does not act on rows independently"
    for m in prod.matmuls:
        if m.target not in ROW_MATMULS:
            return f"{m.name} is {m.target}, not a 2-D mm/addmm"
        out = static_shape(m)
        if out is None or out != [rows, n]:
            return f"{m.name} output {out} is not the collective input's rows {[rows, n]}"
    return None


def chunk_rows(b: Builder, root: Node, prod: Producer, select: Callable[[Node], Node]) -> Node:
    """Build ``root``'s rows picked by ``select`` (applied to each matmul's (M, K) left
    operand); returns a node of shape (rows, N)."""
    leaves = set(prod.matmuls)
    memo: dict[Node, Node] = {}

    def ev(node: Node) -> Node:
        if node in memo:
            return memo[node]
        if node in leaves:
            lhs = ops.MATMULS[node.target][0]
            args = list(node.args)
            args[lhs] = select(node.args[lhs])
            out = b.call(node.target, *args, **node.kwargs)
        elif node.target is ops.ADD:
            a, c = (ev(x) if isinstance(x, Node) else x for x in node.args[:2])
            out = b.call(ops.ADD, a, c)
        elif node.target in ops.RESHAPES or node.target is ops.aten.clone.default or ops.is_full_slice(node):
            out = ev(node.args[0])
        else:  # dtype cast
            out = b.call(node.target, ev(node.args[0]), *node.args[1:], **node.kwargs)
        memo[node] = out
        return out

    return ev(root)


# ----------------------------------------------------------------------------- chaining

ROW_CHUNKS = "overlapc_row_chunks"
"""node.meta key set by the all-gather rewrite on each consumer GEMM's result: a RowChunks
saying which new nodes hold that result's rows, chunk by chunk."""


class RowChunks:
    """A tensor whose rows, taken rank-major per chunk, already exist as separate nodes.

    ``layout`` = (world, dim, prefix, sizes): the tensor is (prod(prefix), N) rows of a
    (prefix..., N) tensor gathered/scattered along ``dim`` over ``world`` ranks; chunk c is
    rows [o_c, o_c + sizes[c]) of every rank's shard, in rank order, as ``pieces[c]``
    of shape (world * sizes[c], N). The reduce-scatter rewrite selects exactly these rows
    for its chunk c when its layout is the same, so it can read ``pieces[c]`` instead of
    slicing the whole tensor, and its chunk c no longer waits for the other chunks.
    """

    def __init__(self, layout: tuple, pieces: list[Node]):
        self.layout, self.pieces = layout, list(pieces)


def row_layout(world: int, dim: int, shape: list[int], chunks_sizes: list[int]) -> tuple:
    return (world, dim, tuple(shape[:-1]), tuple(chunks_sizes))


def chained_rows(b: Builder, root: Node, layout: tuple, c: int, plain: Callable[[Node], Node]) -> Node | None:
    """Chunk ``c`` of ``root``'s rows (as (world * n_c, N)) built from row-chunked GEMM
    results (RowChunks of the same layout) through row-wise ops: views that keep the last
    dim and pointwise ops whose tensor operands all have the result's shape. Operands that
    reach no chunked result are sliced with ``plain``. None when ``root`` reaches none."""
    rows = math.prod(layout[2])
    reach: dict[Node, bool] = {}

    def reaches(n) -> bool:
        if not isinstance(n, Node):
            return False
        if n not in reach:
            reach[n] = False  # cycles cannot happen in a DAG; this only guards re-entry
            info = n.meta.get(ROW_CHUNKS)
            if info is not None:
                reach[n] = info.layout == layout
            else:
                shape = static_shape(n)
                if not shape or _rows_of(shape) != rows:
                    return False
                if n.target in ops.RESHAPES:
                    src = static_shape(n.args[0])
                    reach[n] = bool(src) and src[-1] == shape[-1] and reaches(n.args[0])
                elif ops.is_pointwise(n):
                    tensors = [a for a in (*n.args, *n.kwargs.values()) if isinstance(a, Node)]
                    reach[n] = all(static_shape(a) == shape for a in tensors) and any(reaches(a) for a in tensors)
        return reach[n]

    memo: dict[Node, Node] = {}

    def ev(n: Node) -> Node:
        if n in memo:
            return memo[n]
        info = n.meta.get(ROW_CHUNKS)
        if info is not None:
            out = info.pieces[c]
        elif n.target in ops.RESHAPES:
            out = ev(n.args[0])
        else:
            args = [(ev(a) if reaches(a) else plain(a)) if isinstance(a, Node) else a for a in n.args]
            kwargs = {k: (ev(v) if reaches(v) else plain(v)) if isinstance(v, Node) else v for k, v in n.kwargs.items()}
            out = b.call(n.target, *args, **kwargs)
        memo[n] = out
        return out

    return ev(root) if reaches(root) else None


def _rows_of(shape: list[int]) -> int:
    """Rows of a tensor read as (rows, last dim)."""
    return math.prod(shape[:-1])
