"""Chunking a region of the graph along one axis, from a collective to the collectives it feeds.

An :class:`Axis` names one factor of one dim of a tensor: dim ``dim`` of size
``outer * extent * inner``, read row-major as (outer, extent, inner). Chunk [s, s + n)
of the axis keeps, for every outer and inner index, the extent indices in [s, s + n); as
a tensor it has that dim resized to ``outer * n * inner``, everything else in the same
order. Capacity slots of a packed MoE buffer (E * cap, d) are ``Axis(0, cap)``: each
chunk holds slots [s, s + n) of every expert.

A region starts at the wait of a collective and grows forward through ops that act on
the chunks independently (:func:`step_of`): reshapes that keep the factor whole,
transposes, pointwise ops, matmuls whose output follows the axis (rows, columns, or the
batch of a bmm). A matmul or sum that reduces over the axis ends the region as a sum of
per-chunk partials (in fp32; in bf16/fp16 it runs whole on operands rebuilt from the
chunks, so that no partial is rounded before the sum). An all-to-all fed by the region is a *terminal*: it can run chunk by
chunk, so chunk c of the next collective waits only for chunk c of the first. Everything
else reads the region's tensors whole, rebuilt from their chunks.

Each op is replayed per chunk with the same arguments, except its shape arguments (the
axis dim shrinks) and its operands from outside the region, which are narrowed to the
chunk when they have the axis, and passed whole when they broadcast over it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.fx import Node

from . import ops
from .build import Builder

LOW_PRECISION = (torch.bfloat16, torch.float16)

PIECE = "piece"
"""Operand treatment: the operand is in the region; use its chunk."""


@dataclass(frozen=True)
class Axis:
    dim: int
    extent: int
    inner: int = 1

    def outer(self, shape) -> int:
        return shape[self.dim] // (self.extent * self.inner)

    def resized(self, shape, n: int) -> list[int]:
        s = list(shape)
        s[self.dim] = self.outer(shape) * n * self.inner
        return s

    def fits(self, shape) -> bool:
        return (0 <= self.dim < len(shape) and isinstance(shape[self.dim], int)
                and shape[self.dim] % (self.extent * self.inner) == 0)


def static_shape(node) -> list[int] | None:
    s = ops.shape(node)
    if s is None or not all(isinstance(d, int) for d in s):
        return None
    return s


# ----------------------------------------------------------------------------- mapping

def through_reshape(src: list[int], axis: Axis, dst: list[int]) -> Axis | None:
    """Where the factor lands after a reshape from ``src`` to ``dst`` (None: it is split)."""
    stride = axis.inner * math.prod(src[axis.dim + 1:])  # element stride of the factor
    span = stride * axis.extent
    for j in range(len(dst)):
        p = math.prod(dst[j + 1:])
        if p <= stride and stride % p == 0 and (p * dst[j]) % span == 0:
            return Axis(j, axis.extent, stride // p)
    return None


def _norm(d: int, rank: int) -> int:
    return d + rank if d < 0 else d


@dataclass
class Step:
    """How one node of the region is computed per chunk."""
    node: Node
    axis: Axis | None
    """The output's axis; None: the node sums over the axis (a partial per chunk)."""
    operands: dict = field(default_factory=dict)
    """arg position (int) or kwarg name -> PIECE, an Axis to narrow that operand with, or None (whole)."""
    shape_arg: tuple | None = None
    """(arg position, new shape function of the chunk size) for reshapes."""


def _tensor_args(node: Node):
    for i, a in enumerate(node.args):
        if isinstance(a, Node):
            yield i, a
    for k, a in node.kwargs.items():
        if isinstance(a, Node):
            yield k, a


def _pointwise(node: Node) -> bool:
    tags = getattr(node.target, "tags", ())
    return torch.Tag.pointwise in tags or node.target in ops.IDENTITIES


def _broadcast_treatment(operand: Node, out_shape: list[int], axis: Axis):
    """None (pass whole) when the operand broadcasts over the axis dim, the axis to narrow
    it with when it has the output's shape, False when neither."""
    s = static_shape(operand)
    if s is None:
        return False
    if s == out_shape:
        return axis
    k = axis.dim - (len(out_shape) - len(s))  # its dim aligned with the axis dim
    if len(s) <= len(out_shape) and (k < 0 or s[k] == 1):
        return None
    return False


def step_of(node: Node, axes: dict[Node, Axis]) -> Step | None:
    """The per-chunk rule for ``node``, one of whose operands is in the region (None: no rule)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return None
    t = node.target
    out = static_shape(node)
    if out is None:
        return None
    if t in (ops.aten.stack.default, ops.aten.cat.default):
        return _concat_step(node, axes)
    if any(isinstance(a, (list, tuple)) and any(isinstance(x, Node) for x in a) for a in node.args):
        return None
    reached = {k: a for k, a in _tensor_args(node) if a in axes}
    if t in ops.RESHAPES and 0 in reached and len(reached) == 1:
        a = axes[node.args[0]]
        new = through_reshape(static_shape(node.args[0]), a, out)
        if new is None:
            return None
        # view/reshape/_unsafe_view take the new shape; squeeze/unsqueeze/flatten keep their
        # dim arguments valid because sizes, not ranks, change.
        shape_arg = (1, out) if t in (ops.aten.view.default, ops.aten._unsafe_view.default,
                                      ops.aten.reshape.default) else None
        return Step(node, new, {0: PIECE}, shape_arg)
    if t in ops.PERMUTES and list(reached) == [0]:
        a = axes[node.args[0]]
        rank = len(out)
        if t is ops.aten.t.default:
            perm = [1, 0] if rank == 2 else [0]
        elif t is ops.aten.transpose.int:
            d0, d1 = _norm(node.args[1], rank), _norm(node.args[2], rank)
            perm = list(range(rank))
            perm[d0], perm[d1] = d1, d0
        else:
            perm = [_norm(d, rank) for d in node.args[1]]
        return Step(node, Axis(perm.index(a.dim), a.extent, a.inner), {0: PIECE})
    if t is ops.aten.select.int and list(reached) == [0]:
        a = axes[node.args[0]]
        d = _norm(node.args[1], len(out) + 1)
        if d == a.dim:
            return None
        return Step(node, Axis(a.dim - (d < a.dim), a.extent, a.inner), {0: PIECE})
    if t is ops.aten.slice.Tensor and list(reached) == [0]:
        a = axes[node.args[0]]
        d = _norm(node.args[1] if len(node.args) > 1 else 0, len(out))
        if d == a.dim and not ops.is_full_slice(node):
            return None
        return Step(node, a, {0: PIECE})
    if t is ops.aten.select_backward.default and list(reached) == [0]:
        a = axes[node.args[0]]
        d = _norm(node.args[2], len(out))
        return Step(node, Axis(a.dim + (d <= a.dim), a.extent, a.inner), {0: PIECE}, (1, out))
    if t in ops.MATMULS and t in (ops.aten.mm.default, ops.aten.bmm.default):
        return _matmul_step(node, axes)
    if t is ops.aten.sum.dim_IntList and list(reached) == [0]:
        a = axes[node.args[0]]
        rank = len(static_shape(node.args[0]))
        dims = [_norm(d, rank) for d in (node.args[1] or range(rank))]
        keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        if a.dim in dims:
            return Step(node, None, {0: PIECE})
        shift = 0 if keep else sum(d < a.dim for d in dims)
        return Step(node, Axis(a.dim - shift, a.extent, a.inner), {0: PIECE})
    if _pointwise(node):
        if t is ops.aten._to_copy.default and not set(node.kwargs) <= {"dtype", "memory_format"}:
            return None
        axis = next(iter(axes[n] for n in reached.values()))
        if not axis.fits(out):
            return None
        operands = {}
        for k, a in _tensor_args(node):
            if a in axes:
                if axes[a] != axis or static_shape(a) != out:
                    return None
                operands[k] = PIECE
            else:
                how = _broadcast_treatment(a, out, axis)
                if how is False:
                    return None
                operands[k] = how
        return Step(node, axis, operands)
    return None


def _concat_step(node: Node, axes: dict[Node, Axis]) -> Step | None:
    """stack / cat of same-shaped region tensors with one axis, not along the axis (the
    per-expert loop stacks its experts' outputs)."""
    xs = node.args[0]
    if not all(isinstance(x, Node) and x in axes for x in xs):
        return None
    a, shape = axes[xs[0]], static_shape(xs[0])
    if shape is None or any(axes[x] != a or static_shape(x) != shape for x in xs):
        return None
    d = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
    if node.target is ops.aten.stack.default:
        d = _norm(d, len(shape) + 1)
        return Step(node, Axis(a.dim + (d <= a.dim), a.extent, a.inner), {0: PIECE})
    if _norm(d, len(shape)) == a.dim:
        return None
    return Step(node, a, {0: PIECE})


def _matmul_step(node: Node, axes: dict[Node, Axis]) -> Step | None:
    """mm (M,K)@(K,N) and bmm (B,M,K)@(B,K,N): the output follows an axis on M, N or B
    (the other side narrowed along B too); an axis on K, on both sides, makes the output a
    sum of partial products."""
    lhs, rhs = node.args[0], node.args[1]
    if static_shape(lhs) is None or static_shape(rhs) is None:
        return None
    bmm = node.target is ops.aten.bmm.default
    m, k, k2, n = (1, 2, 1, 2) if bmm else (0, 1, 0, 1)
    la, ra = axes.get(lhs), axes.get(rhs)

    def shared(a: Axis, other_dim: int, other_axis: Axis | None):
        want = Axis(other_dim, a.extent, a.inner)
        if other_axis is None:
            return want
        return PIECE if other_axis == want else False

    if la is not None:
        if la.dim == m and ra is None:
            return Step(node, la, {0: PIECE, 1: None})
        if la.dim in (k, 0 if bmm else -1):
            how = shared(la, k2 if la.dim == k else 0, ra)
            if how is False:
                return None
            return Step(node, None if la.dim == k else la, {0: PIECE, 1: how})
        return None
    if ra.dim == n:
        return Step(node, ra, {0: None, 1: PIECE})
    if ra.dim in (k2, 0 if bmm else -1):
        if bmm and ra.dim == 0:
            return Step(node, ra, {0: Axis(0, ra.extent, ra.inner), 1: PIECE})
        return Step(node, None, {0: Axis(k, ra.extent, ra.inner), 1: PIECE})
    return None


# ----------------------------------------------------------------------------- regions

def even_splits(coll: Node) -> bool:
    out_s, in_s = coll.args[1], coll.args[2]
    for s in (out_s, in_s):
        if s is None:
            continue
        if not all(isinstance(v, int) for v in s) or len(set(s)) != 1:
            return False
    return True


def all_to_all_fits(coll: Node, axis: Axis) -> bool:
    """Whether an even all-to-all can run chunk by chunk along ``axis`` of its input: the
    peers' blocks (dim 0 in ``world`` parts) must stay whole around the factor."""
    shape = static_shape(coll.args[0])
    world = ops.world_size(coll)
    if shape is None or not world or not axis.fits(shape):
        return False
    return axis.dim != 0 or axis.outer(shape) % world == 0


@dataclass
class Region:
    start: Node
    """The wait of the collective the region starts from (or a tensor to narrow)."""
    axis: Axis
    steps: list[Step]
    axes: dict[Node, Axis]
    terminals: list[Node]
    """All-to-alls (even splits) whose input is in the region: rewritten chunk by chunk."""
    whole: list[Node]
    """Region nodes that something outside the region reads whole."""

    @property
    def matmuls(self) -> list[Node]:
        return [s.node for s in self.steps if s.node.target in ops.MATMULS]

    def score(self) -> tuple:
        return (len(self.matmuls) + 2 * len(self.terminals), self.axis.extent)


def grow(start: Node, axis: Axis, may_chain=lambda coll: True) -> Region:
    """The region reached from ``start`` chunked along ``axis``."""
    graph = start.graph
    axes: dict[Node, Axis] = {start: axis}
    steps: list[Step] = []
    terminals: list[Node] = []
    seen = False
    for node in graph.nodes:
        if not seen:
            seen = node is start
            continue
        if node.op == "output":
            continue
        ins = [a for a in node.all_input_nodes if a in axes]
        if not ins:
            continue
        if (node.target is ops.ALL_TO_ALL and node.args[0] in axes and even_splits(node)
                and ops.wait_of(node) is not None and all_to_all_fits(node, axes[node.args[0]])
                and may_chain(node)):
            terminals.append(node)
            continue
        st = step_of(node, axes)
        if st is None or (st.axis is None and ops.val(node).dtype in LOW_PRECISION):
            # A low-precision reduction over the axis stays whole, on operands rebuilt from
            # the chunks: per-chunk partials would each be rounded before the sum.
            continue
        steps.append(st)
        if st.axis is not None:
            axes[node] = st.axis
    inside = {s.node for s in steps} | set(terminals)
    whole = [n for n in axes if any(u not in inside for u in n.users)]
    return Region(start, axis, steps, axes, terminals, whole)


def candidate_axes(node: Node, world: int) -> list[Axis]:
    """Axes of an all-to-all's output to try: every factor of dim 0 that a reshape user
    exposes (keeping the peers' blocks whole), and every other dim."""
    shape = static_shape(node)
    if shape is None or not shape:
        return []
    out = []
    row = math.prod(shape[1:])
    for u in node.users:
        if u.target not in ops.RESHAPES:
            continue
        dst = static_shape(u)
        for j in range(len(dst or [])):
            p = math.prod(dst[j + 1:])
            if p % row == 0 and dst[j] > 1 and shape[0] % (dst[j] * (p // row)) == 0:
                out.append(Axis(0, dst[j], p // row))
    out.append(Axis(0, shape[0] // world, 1))
    out += [Axis(d, shape[d], 1) for d in range(1, len(shape)) if shape[d] > 1]
    seen, keep = set(), []
    for a in out:
        if a not in seen and a.fits(shape) and (a.dim != 0 or a.outer(shape) % world == 0) and a.extent > 1:
            seen.add(a)
            keep.append(a)
    return keep


# ----------------------------------------------------------------------------- building

def narrow(b: Builder, x: Node, axis: Axis, start: int, n: int) -> Node:
    """Chunk [start, start + n) of ``x`` along ``axis``."""
    shape = static_shape(x)
    o = axis.outer(shape)
    if o == 1 and axis.inner == 1:
        return b.slice(x, axis.dim, start, start + n)
    split = shape[:axis.dim] + [o, axis.extent, axis.inner] + shape[axis.dim + 1:]
    piece = b.slice(b.view(x, split), axis.dim + 1, start, start + n)
    return b.reshape(piece, axis.resized(shape, n))


def assemble(b: Builder, pieces: list[Node], sizes: list[int], axis: Axis, shape: list[int]) -> Node:
    """The whole tensor (of ``shape``) from its chunks along ``axis``."""
    if len(pieces) == 1:
        return pieces[0]
    o = axis.outer(shape)
    if o == 1 and axis.inner == 1:
        return b.cat(pieces, axis.dim)
    parts = [b.view(p, shape[:axis.dim] + [o, n, axis.inner] + shape[axis.dim + 1:])
             for p, n in zip(pieces, sizes)]
    return b.view(b.cat(parts, axis.dim + 1), shape)


def contiguous(b: Builder, x: Node) -> Node:
    v = ops.val(x)
    return x if v is not None and v.is_contiguous() else b.contiguous(x)


def replay(b: Builder, region: Region, sizes: list[int], start_pieces: list[Node]) -> list[dict[Node, Node]]:
    """Build every step once per chunk; returns, per chunk, region node -> its chunk
    (for sums: its partial)."""
    out = []
    off = 0
    for c, n in enumerate(sizes):
        piece: dict[Node, Node] = {region.start: start_pieces[c]}
        narrowed: dict[tuple, Node] = {}
        for st in region.steps:
            node = st.node

            def operand(k, a):
                how = st.operands.get(k)
                if isinstance(a, (list, tuple)):
                    return [operand(k, x) if isinstance(x, Node) else x for x in a]
                if how is PIECE:
                    return piece[a]
                if isinstance(how, Axis):
                    key = (a, how)
                    if key not in narrowed:
                        narrowed[key] = narrow(b, a, how, off, n)
                    return narrowed[key]
                return a

            args = [operand(i, a) if isinstance(a, (Node, list, tuple)) else a for i, a in enumerate(node.args)]
            kwargs = {k: operand(k, a) if isinstance(a, Node) else a for k, a in node.kwargs.items()}
            if st.shape_arg is not None:
                pos, shape = st.shape_arg
                args[pos] = st.axis.resized(shape, n)
            piece[node] = b.call(node.target, *args, **kwargs)
        out.append(piece)
        off += n
    return out


def add_partials(b: Builder, parts: list[Node]) -> Node:
    """Sum of per-chunk partials (fp32 and wider only: see :func:`grow`)."""
    acc = parts[0]
    for p in parts[1:]:
        acc = b.call(ops.ADD, acc, p)
    return acc
