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

from typing import Callable

from torch.fx import Node

from . import ops
from .build import Builder
from .normalize import Producer

ROW_MATMULS = (ops.aten.mm.default, ops.aten.addmm.default)


def static_shape(node: Node) -> list[int] | None:
    s = ops.shape(node)
    if s is None or not all(isinstance(d, int) for d in s):
        return None
    return s


def can_chunk_rows(root: Node, prod: Producer) -> str | None:
    """Why ``root`` cannot be evaluated row-chunk by row-chunk (None: it can)."""
    shape = static_shape(root)
    if shape is None:
        return "dynamic shapes: chunk sizes would not be known at compile time"
    n = shape[-1]
    rows = 1
    for s in shape[:-1]:
        rows *= s
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
