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

import functools
import itertools
import math
import operator
from collections.abc import Callable

from torch.fx import Node

from . import ops
from .build import Builder
from .normalize import Producer

ROW_MATMULS = (ops.aten.mm.default, ops.aten.addmm.default, ops.SCALED_MM)


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
        elif ops.is_identity(p) or p.target is ops.ADD or ops.is_full_slice(p):
            continue
        else:
            return f"{p.name} ({p.target}) does not act on rows independently"
    for m in prod.matmuls:
        if m.target not in ROW_MATMULS:
            return f"{m.name} is {m.target}, not a 2-D mm/addmm/_scaled_mm"
        if m.target is ops.SCALED_MM and ops.scale_kind(m) is None:
            return f"{m.name}'s scale_a {ops.shape(m.args[2])} is neither one number nor one per row"
        out = static_shape(m)
        if out is None or out != [rows, n]:
            return f"{m.name} output {out} is not the collective input's rows {[rows, n]}"
    return None


def pinned_scale(b: Builder, rows: Node) -> Node:
    """A chunk's (n, 1) rowwise scales for _scaled_mm, which checks scale_a.stride(1) == 1:
    inductor may lay out a copied (n, 1) slice with any stride on its size-1 dim, and
    as_strided fixes that stride."""
    n = static_shape(rows)[0]
    return b.call(ops.aten.as_strided.default, b.reshape(rows, [n]), [n, 1], [1, 1])


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
            if ops.is_scaled_rowwise(node):
                args[2] = pinned_scale(b, select(node.args[2]))  # rowwise scales go with their rows
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

    def __init__(self, layout: tuple, pieces: list[Node], site: str = ""):
        self.layout, self.pieces, self.site = layout, list(pieces), site


def row_layout(world: int, dim: int, shape: list[int], chunks_sizes: list[int]) -> tuple:
    return (world, dim, tuple(shape[:-1]), tuple(chunks_sizes))


@functools.lru_cache(maxsize=256)
def chunk_rows_of(layout: tuple) -> tuple[tuple[int, ...], ...]:
    """Per chunk, the rows of the (rows, N) tensor that a ``layout`` (see RowChunks) puts in
    that chunk's piece, in the piece's order. Two layouts can describe the same pieces: an
    all-gather along the sequence of (1, S, N) is recorded as its (W, S / W) rank-major form,
    a reduce-scatter of it along dim 1 of (1, S); with batch 1 both are rank-major rows."""
    world, dim, prefix, sizes = layout
    outer, inner, s = math.prod(prefix[:dim]), math.prod(prefix[dim + 1 :]), prefix[dim] // world
    shards = [
        [(o * prefix[dim] + k * s + t) * inner + i for o in range(outer) for t in range(s) for i in range(inner)]
        for k in range(world)
    ]
    bounds = [0, *itertools.accumulate(sizes)]
    return tuple(tuple(r for sh in shards for r in sh[lo:hi]) for lo, hi in zip(bounds, bounds[1:]))


def same_rows(a: tuple, b: tuple) -> bool:
    """Whether two row layouts put the same rows, in the same order, in every chunk."""
    return a == b or (
        math.prod(a[2]) == math.prod(b[2]) and len(a[3]) == len(b[3]) and chunk_rows_of(a) == chunk_rows_of(b)
    )


def chained_rows(
    b: Builder, root: Node, layout: tuple, c: int, plain: Callable[[Node], Node], sources: set | None = None
) -> Node | None:
    """Chunk ``c`` of ``root``'s rows (as (world * n_c, N)) built from row-chunked GEMM
    results (RowChunks with the same rows per chunk: :func:`same_rows`) through row-wise ops:
    views that keep the last dim and pointwise ops whose tensor operands all have the result's
    shape. Operands that reach no chunked result are sliced with ``plain``. None when ``root``
    reaches none. The sites whose chunks it read are added to ``sources``."""
    rows = math.prod(layout[2])
    reach: dict[Node, bool] = {}

    def reaches(n) -> bool:
        if not isinstance(n, Node):
            return False
        if n not in reach:
            reach[n] = False  # cycles cannot happen in a DAG; this only guards re-entry
            info = n.meta.get(ROW_CHUNKS)
            if info is not None:
                reach[n] = same_rows(info.layout, layout)
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
            if sources is not None and info.site:
                sources.add(info.site)
        elif n.target in ops.RESHAPES:
            out = ev(n.args[0])
        else:
            args = [(ev(a) if reaches(a) else plain(a)) if isinstance(a, Node) else a for a in n.args]
            kwargs = {k: (ev(v) if reaches(v) else plain(v)) if isinstance(v, Node) else v for k, v in n.kwargs.items()}
            out = b.call(n.target, *args, **kwargs)
        memo[n] = out
        return out

    return ev(root) if reaches(root) else None


LOCAL_ROWS = "overlapc_local_rows"
"""node.meta key set by the reduce-scatter rewrite on its result: a LocalRows saying which
new nodes hold that result's rows, chunk by chunk."""


class LocalRows:
    """A rank-local tensor, read as (R, N) rows, whose row ranges [o_c, o_c + sizes[c]) already
    exist as separate (sizes[c], N) nodes ``pieces[c]`` (a reduce-scatter's chunks, each its
    own wait). An all-gather whose shard is computed from it by row-wise ops, chunked with
    the same sizes, gathers chunk c as soon as chunk c arrived: RS -> residual add -> norm ->
    AG without waiting for the whole tensor."""

    def __init__(self, sizes, pieces: list[Node], site: str):
        self.sizes, self.pieces, self.site = tuple(sizes), list(pieces), site


_PASS_THROUGH = {ops.aten.detach.default, ops.aten.alias.default}
_ROW_REDUCTIONS = {ops.aten.mean.dim, ops.aten.sum.dim_IntList, ops.aten.amax.default}
_LN_BACKWARD = ops.aten.native_layer_norm_backward.default
_ROW_TUPLES = {ops.aten.native_layer_norm.default, _LN_BACKWARD, ops.aten.var_mean.correction}
"""Ops returning a tuple with row-wise results: LayerNorm over the last dim (output, mean, rstd),
its backward's input gradient (the weight and bias gradients sum over rows: not row-wise), and
var_mean over the last dim keeping it (inductor's decomposition of LayerNorm)."""


def _last_dim_only(dims, rank: int) -> bool:
    """Whether a reduction's ``dims`` are exactly the last of ``rank`` dims."""
    return isinstance(dims, (list, tuple)) and [d % rank for d in dims] == [rank - 1]


def _row_tuple_ok(n: Node, index) -> bool:
    shape = static_shape(n.args[0])
    if not shape:
        return False
    if n.target is ops.aten.native_layer_norm.default:
        return list(n.args[1]) == shape[-1:]
    if n.target is _LN_BACKWARD:
        return index == 0 and list(n.args[2]) == shape[-1:]
    dims = n.args[1] if len(n.args) > 1 else n.kwargs.get("dim")
    return n.kwargs.get("keepdim") is True and _last_dim_only(dims, len(shape))


def local_row_chunks(b: Builder, root: Node, sizes: list[int]) -> tuple[list[Node], list[str]] | None:
    """``root``'s row ranges (by ``sizes``) as (n_c, N) nodes computed from LocalRows chunks of
    the same sizes, and the names of the sites those come from; None where ``root`` is not
    reached from any through row-wise ops.

    Row-wise: views that keep the last dim; pointwise ops (casts included) whose tensor operands
    have ``root``'s rows or none (a norm's weight, a scalar); reductions over the last dim
    that keep it (a norm's mean or sum of squares); expands of such a (rows, 1) result along
    the last dim. Operands that reach no chunk are sliced by rows. The nodes between stay as
    they were for their other users (the residual stream, saved activations): chunk c
    recomputes its rows of the row-wise ops, which are cheap beside the GEMMs it unblocks."""
    shape = static_shape(root)
    if not shape:
        return None
    rows = _rows_of(shape)
    reach: dict[Node, bool] = {}
    sources: dict[Node, str] = {}
    skip: set[Node] = set()

    def rowed(n) -> list[int] | None:
        s = static_shape(n) if isinstance(n, Node) else None
        return s if s and len(s) >= 2 and _rows_of(s) == rows else None

    def rowless(n) -> bool:
        """No row dims: broadcasts against any row range unchanged."""
        s = static_shape(n)
        return s is not None and all(d == 1 for d in s[:-1])

    def operands_fit(tensors: list[Node], rank: int) -> bool:
        """Every operand has the rows, at the result's rank, or none."""
        return all((rowed(a) is not None and len(rowed(a)) == rank) or rowless(a) for a in tensors)

    def reaches(n) -> bool:
        if not isinstance(n, Node) or n.op != "call_function":
            return False
        if n not in reach:
            reach[n] = False
            info = n.meta.get(LOCAL_ROWS)
            s = rowed(n)
            if s is None:
                return False
            if info is not None:
                reach[n] = info.sizes == tuple(sizes) and n not in skip
                if reach[n]:
                    sources[n] = info.site
            elif n.target in ops.RESHAPES or n.target in _PASS_THROUGH:
                src = rowed(n.args[0])
                reach[n] = src is not None and src[-1] == s[-1] and reaches(n.args[0])
            elif n.target in _ROW_REDUCTIONS:
                dims = n.args[1] if len(n.args) > 1 else None
                keep = len(n.args) > 2 and n.args[2] is True
                reach[n] = keep and _last_dim_only(dims, len(s)) and not n.kwargs and reaches(n.args[0])
            elif n.target is ops.aten.expand.default:
                src = rowed(n.args[0])
                reach[n] = src is not None and len(src) == len(s) and src[-1] == 1 and reaches(n.args[0])
            elif n.target is operator.getitem and isinstance(n.args[0], Node) and n.args[0].target in _ROW_TUPLES:
                t = n.args[0]
                tensors = [a for a in (*t.args, *t.kwargs.values()) if isinstance(a, Node)]
                ok = _row_tuple_ok(t, n.args[1]) and operands_fit(tensors, len(s))
                reach[n] = ok and any([reaches(a) for a in tensors])  # visit all: every source counts
            elif ops.is_pointwise(n):
                tensors = [a for a in (*n.args, *n.kwargs.values()) if isinstance(a, Node)]
                reach[n] = operands_fit(tensors, len(s)) and any([reaches(a) for a in tensors])
        return reach[n]

    if not reaches(root):
        return None
    # A source all of whose chunks the nearest source's first chunk already waits for (the
    # residual stream of earlier layers, behind attention) is read whole and sliced:
    # recomputing it chunk by chunk would only repeat adds. One walk per gather.
    if len(sources) > 1:
        pos = {n: i for i, n in enumerate(root.graph.nodes)}
        nearest = max(sources, key=lambda src: pos[src])
        first = ancestors(nearest.meta[LOCAL_ROWS].pieces[:1])
        skip = {a for a in sources if a is not nearest and set(a.meta[LOCAL_ROWS].pieces) <= first}
    if skip:
        reach.clear()
        sources.clear()
        if not reaches(root):
            return None
    flat: dict[Node, Node] = {}

    def sliced(a: Node, off: int, n: int) -> Node:
        if a not in flat:
            flat[a] = b.reshape(a, [rows, static_shape(a)[-1]])
        return b.slice(flat[a], 0, off, off + n)

    def operand(a, c, off, n, memo):
        if not isinstance(a, Node):
            return a
        if reaches(a):
            return ev(a, c, off, n, memo)
        if rowed(a) is not None:
            return sliced(a, off, n)
        s = static_shape(a)
        return b.reshape(a, [s[-1]]) if s and len(s) > 1 else a  # rowless: broadcast as a row vector

    def ev(x: Node, c: int, off: int, n: int, memo: dict) -> Node:
        if x in memo:
            return memo[x]
        info = x.meta.get(LOCAL_ROWS)
        if info is not None:
            out = info.pieces[c]
        elif x.target in ops.RESHAPES or x.target in _PASS_THROUGH:
            out = ev(x.args[0], c, off, n, memo)
        elif x.target in _ROW_REDUCTIONS:
            out = b.call(x.target, ev(x.args[0], c, off, n, memo), [-1], True, *x.args[3:])
        elif x.target is ops.aten.expand.default:
            out = b.call(x.target, ev(x.args[0], c, off, n, memo), [n, static_shape(x)[-1]])
        elif x.target is operator.getitem:
            t = x.args[0]
            if t not in memo:
                args = [operand(a, c, off, n, memo) for a in t.args]
                kwargs = dict(t.kwargs)
                if t.target is ops.aten.var_mean.correction:
                    if len(args) > 1:
                        args[1] = [-1]
                    else:
                        kwargs["dim"] = [-1]
                elif t.target is _LN_BACKWARD:  # the input gradient only
                    if len(args) > 7:
                        args[7] = [True, False, False]
                    else:
                        kwargs["output_mask"] = [True, False, False]
                memo[t] = b.call(t.target, *args, **kwargs)
            out = b.call(operator.getitem, memo[t], x.args[1])
        else:
            args = [operand(a, c, off, n, memo) for a in x.args]
            kwargs = {k: operand(v, c, off, n, memo) for k, v in x.kwargs.items()}
            out = b.call(x.target, *args, **kwargs)
        memo[x] = out
        return out

    out, off = [], 0
    for c, n in enumerate(sizes):
        out.append(ev(root, c, off, n, {}))
        off += n
    return out, sorted(set(sources.values()))


def ancestors(nodes: list[Node]) -> set[Node]:
    """Every node the given ones depend on (not themselves)."""
    seen, stack = set(), list(nodes)
    while stack:
        for p in stack.pop().all_input_nodes:
            if p not in seen:
                seen.add(p)
                stack.append(p)
    return seen


def _rows_of(shape: list[int]) -> int:
    """Rows of a tensor read as (rows, last dim)."""
    return math.prod(shape[:-1])
