"""Chunking a region of the graph along one axis, from a collective to the collectives it feeds.

An :class:`Axis` names one factor of one dim of a tensor: dim ``dim`` of size
``outer * extent * inner``, read row-major as (outer, extent, inner). Chunk [s, s + n)
of the axis keeps, for every outer and inner index, the extent indices in [s, s + n); as
a tensor it has that dim resized to ``outer * n * inner``, everything else in the same
order. Capacity slots of a packed MoE buffer (E * cap, d) are ``Axis(0, cap)``: each
chunk holds slots [s, s + n) of every expert.

A region starts at the wait of a collective and grows forward through ops that act on
the chunks independently (one :class:`Rule` per op, asked downstream by :func:`step_of` and
upstream by :func:`inputs_for`): reshapes that keep the factor whole,
transposes, pointwise ops, matmuls whose output follows the axis (rows, columns, or the
batch of a bmm). A matmul or sum that reduces over the axis ends the region as a sum of
per-chunk partials (in fp32; in bf16/fp16 it runs whole on operands rebuilt from the
chunks, so that no partial is rounded before the sum). A sum that nothing in the region
reads and that an all-to-all of the region follows (see :func:`levels`; the expert weight
gradients of a MoE backward) also runs whole, once, after the last chunk: there it fills
the time the last chunks of that all-to-all are on the wire, at the GEMM efficiency of
the whole rows and without the partials' extra passes over its output (measured on the
world-2 MoE training step with the collectives stripped: the partials' adds alone cost
255 ms of an 887 ms step; with the sums deferred the step took 720 ms); in bf16/fp16 too,
where it is whole anyway. An all-to-all fed by the region is a *terminal*: it can run chunk by
chunk, so chunk c of the next collective waits only for chunk c of the first. Everything
else reads the region's tensors whole, rebuilt from their chunks. A micro-batch region
(passes/microbatch.py) also takes in all-gathers and reduce-scatters (dim 0 holds the ranks'
blocks: the axis' outer factor grows or shrinks by the world size) and sequence
parallelism's split/cat idioms around them (a split or cat along the axis dim keeps whole
blocks of it).

Each op is replayed per chunk with the same arguments, except its shape arguments (the
axis dim shrinks) and its operands from outside the region, which are narrowed to the
chunk when they have the axis, and passed whole when they broadcast over it.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.fx import Node

from . import ops
from .build import Builder

LOW_PRECISION = (torch.bfloat16, torch.float16)

PIECE = "piece"
"""Operand treatment: the operand is in the region; use its chunk."""

CHUNKABLE = (ops.ALL_TO_ALL, ops.ALL_GATHER, ops.REDUCE_SCATTER)
"""Collectives a region can carry chunk by chunk. All-to-all regions take in all-to-alls only
(their growers' ``kinds``); a micro-batch region (passes/microbatch.py) takes all three."""


def in_region_kind(node: Node) -> bool:
    return node.op == "call_function" and node.target in CHUNKABLE


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
        return (
            0 <= self.dim < len(shape)
            and isinstance(shape[self.dim], int)
            and shape[self.dim] % (self.extent * self.inner) == 0
        )


def static_shape(node) -> list[int] | None:
    s = ops.shape(node)
    if s is None or not all(isinstance(d, int) for d in s):
        return None
    return s


# ----------------------------------------------------------------------------- mapping


def through_reshape(src: list[int], axis: Axis, dst: list[int]) -> Axis | None:
    """Where the factor lands after a reshape from ``src`` to ``dst`` (None: it is split)."""
    stride = axis.inner * math.prod(src[axis.dim + 1 :])  # element stride of the factor
    span = stride * axis.extent
    for j in range(len(dst)):
        p = math.prod(dst[j + 1 :])
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
    if len(s) <= len(out_shape) and s[k] == out_shape[axis.dim]:
        return Axis(k, axis.extent, axis.inner)  # broadcasts along other dims only: narrow it too
    return False


@dataclass(frozen=True)
class Attention:
    """A fused attention op, forward or backward: every tensor of ``batched`` (arg positions)
    and ``outputs`` (result indices) is (batch, heads, ...), so dims 0 and 1 are independent
    and chunks along either go through. Its other results (CUDA kernels' RNG state, sequence
    lengths, an empty debug mask) are the same for every chunk while ``dropout_p`` is 0:
    readers outside take the first chunk's. ``none``: args (by name) that must be None
    (attention bias or mask, nested-tensor sequence offsets); ``off``: flags that must be False."""

    batched: frozenset
    outputs: frozenset
    none: tuple = ()
    off: tuple = ()


def _attention_ops() -> dict:
    specs = {
        # CPU flash attention: (out, logsumexp); backward -> (dq, dk, dv)
        "_scaled_dot_product_flash_attention_for_cpu": ((0, 1, 2), (0, 1), ("attn_mask",), ()),
        "_scaled_dot_product_flash_attention_for_cpu_backward": ((0, 1, 2, 3, 4, 5), (0, 1, 2), ("attn_mask",), ()),
        # CUDA flash: (out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, rng state, unused, debug mask)
        "_scaled_dot_product_flash_attention": ((0, 1, 2), (0, 1), (), ("return_debug_mask",)),
        "_scaled_dot_product_flash_attention_backward": ((0, 1, 2, 3, 4, 5), (0, 1, 2), ("cum_seq_q", "cum_seq_k"), ()),
        # memory-efficient: (out, logsumexp padded to 32 rows, seed, offset); backward also a bias grad
        "_scaled_dot_product_efficient_attention": ((0, 1, 2), (0, 1), ("attn_bias",), ()),
        "_scaled_dot_product_efficient_attention_backward": ((0, 1, 2, 3, 5, 6), (0, 1, 2), ("attn_bias",), ()),
        # cuDNN: as flash, logsumexp (B, H, S, 1)
        "_scaled_dot_product_cudnn_attention": ((0, 1, 2), (0, 1), ("attn_bias",), ("return_debug_mask",)),
        "_scaled_dot_product_cudnn_attention_backward": (
            (0, 1, 2, 3, 4, 5),
            (0, 1, 2),
            ("attn_bias", "cum_seq_q", "cum_seq_k"),
            (),
        ),
    }
    return {
        getattr(ops.aten, name).default: Attention(frozenset(b), frozenset(o), none, off)
        for name, (b, o, none, off) in specs.items()
        if hasattr(ops.aten, name)
    }


# Fused attention ops (forward and backward), on CPU and the CUDA kernels SDPA picks from.
BATCHED = _attention_ops()
TUPLES = {*BATCHED, ops.aten.split.Tensor}
"""Ops that return tuples: only their getitems have shapes (and can be narrowed)."""


def _batched_args(node: Node):
    spec = BATCHED[node.target]
    return [(k, a) for k, a in _tensor_args(node) if k in spec.batched]


def heads_axis(a: Axis, src: list[int] | None, dst: list[int] | None) -> Axis | None:
    """An attention op's axis ``a`` on a tensor of shape ``src`` carried to one of shape
    ``dst`` (another operand or result of the op): the batch (dim 0) as it is; the heads
    (dim 1) in as many groups, where the two have other head counts (grouped-query
    attention: query head h reads k/v head h // (H / H_kv), so chunk c of the query heads'
    groups reads chunk c of the k/v heads)."""
    if src is None or dst is None or len(src) < 2 or len(dst) < 2 or a.dim not in (0, 1) or src[0] != dst[0]:
        return None
    if a.dim == 0:
        return a
    outer = a.outer(src)
    if dst[1] % (a.extent * outer):
        return None
    return Axis(1, a.extent, dst[1] // (a.extent * outer))


def invariant_output(node: Node) -> bool:
    """A getitem of an attention op's result that is the same for every chunk (see :class:`Attention`)."""
    return (
        node.op == "call_function"
        and node.target is operator.getitem
        and isinstance(node.args[0], Node)
        and node.args[0].target in BATCHED
        and node.args[1] not in BATCHED[node.args[0].target].outputs
    )


# ----------------------------------------------------------------------------- rules
#
# One rule per op answers both directions, as DTensor's op strategies do for placements:
# ``step`` (downstream) says how the op runs per chunk once some of its operands are in the
# region, and which axis its output gets; ``inputs`` (upstream) says which inputs, chunked
# along which axes, give its output chunked along a given axis. None in either direction: the
# op is not carried (downstream), or its output is narrowed from the whole tensor (upstream).


@dataclass(frozen=True)
class Chain:
    """The collectives an upstream pull may take in: of ``kinds``, where ``may_chain`` agrees."""

    may_chain: Callable[[Node], bool]
    kinds: tuple

    def admits(self, coll: Node) -> bool:
        return coll.target in self.kinds and self.may_chain(coll)


class Rule:
    def step(self, node: Node, axes: dict[Node, Axis]) -> Step | None:
        return None

    def inputs(self, x: Node, a: Axis, chain: Chain) -> list[tuple[Node, Axis]] | None:
        return None


_RULES: dict = {}
_FAMILIES: list[tuple[Callable[[Node], bool], Rule]] = []


def rule(*targets, when: Callable[[Node], bool] | None = None):
    """Register a :class:`Rule` subclass for the ops ``targets``, and for every node ``when``
    accepts (families: pointwise ops, batched matmuls), tried in registration order."""

    def register(cls):
        inst = cls()
        _RULES.update(dict.fromkeys(targets, inst))
        if when is not None:
            _FAMILIES.append((when, inst))
        return cls

    return register


def rule_for(node: Node) -> Rule | None:
    if node.op != "call_function":
        return None
    found = _RULES.get(node.target)
    if found is not None:
        return found
    return next((r for when, r in _FAMILIES if when(node)), None)


def step_of(node: Node, axes: dict[Node, Axis]) -> Step | None:
    """The per-chunk rule for ``node``, one of whose operands is in the region (None: no rule)."""
    r = rule_for(node)
    return r.step(node, axes) if r is not None else None


def inputs_for(x: Node, a: Axis, may_chain=lambda coll: True, kinds=(ops.ALL_TO_ALL,)) -> list | None:
    """The inputs of ``x`` and their axes from which ``x`` chunked along ``a`` can be
    computed (None: none; ``x`` is then narrowed)."""
    r = rule_for(x)
    return r.inputs(x, a, Chain(may_chain, tuple(kinds))) if r is not None else None


def _dim_arg(node: Node, pos: int) -> int:
    return node.args[pos] if len(node.args) > pos else node.kwargs.get("dim", 0)


def _plain(node: Node, axes: dict[Node, Axis]) -> tuple[list[int], dict] | None:
    """The output's static shape and the operands in the region (position -> node), for an op
    with no list of tensors among its arguments (None otherwise)."""
    out = static_shape(node)
    if out is None or any(isinstance(a, (list, tuple)) and any(isinstance(x, Node) for x in a) for a in node.args):
        return None
    return out, {k: a for k, a in _tensor_args(node) if a in axes}


def _unary(node: Node, axes: dict[Node, Axis]) -> tuple[list[int], Axis] | None:
    """The output's static shape and the axis of the first operand, when it is the only one in the region."""
    got = _plain(node, axes)
    if got is None or list(got[1]) != [0]:
        return None
    return got[0], axes[node.args[0]]


def _perm(node: Node, rank: int) -> list[int]:
    """out dim j = in dim perm[j]."""
    t = node.target
    if t is ops.aten.t.default:
        return [1, 0] if rank == 2 else [0]
    if t is ops.aten.transpose.int:
        d0, d1 = _norm(node.args[1], rank), _norm(node.args[2], rank)
        perm = list(range(rank))
        perm[d0], perm[d1] = d1, d0
        return perm
    return [_norm(d, rank) for d in node.args[1]]


class _Unary(Rule):
    """An op whose first operand is the only one in the region: ``chunked`` gets the output's
    static shape and that operand's axis."""

    def step(self, node, axes):
        got = _unary(node, axes)
        return None if got is None else self.chunked(node, *got)

    def chunked(self, node: Node, out: list[int], a: Axis) -> Step | None:
        return None


@rule(operator.getitem)
class _Item(Rule):
    """An item of a tuple (split, attention): it carries its op's axis."""

    def step(self, node, axes):
        src = node.args[0]
        shape = static_shape(node)
        a = axes.get(src)
        if a is not None and src.target in BATCHED:  # a result with its own head count (GQA: dk, dv)
            if node.args[1] not in BATCHED[src.target].outputs:
                return None
            a = heads_axis(a, static_shape(src.args[0]), shape)
        if a is not None and shape is not None and a.fits(shape):
            return Step(node, a, {0: PIECE})
        return None

    def inputs(self, x, a, chain):
        src = x.args[0]
        if isinstance(src, Node) and src.target in BATCHED:
            sa = heads_axis(a, static_shape(x), static_shape(src.args[0]))
            return [(src, sa)] if sa is not None else None
        return [(src, a)] if isinstance(src, Node) and src.target in TUPLES else None


@rule(ops.aten.split.Tensor)
class _Split(Rule):
    """A tuple: its getitems carry the axis. A piece along the axis dim keeps whole blocks of it."""

    def step(self, node, axes):
        if node.args[0] not in axes:
            return None
        a, src = axes[node.args[0]], static_shape(node.args[0])
        d = _norm(_dim_arg(node, 2), len(src or []))
        size = node.args[1]
        if src is None or not isinstance(size, int) or (d == a.dim and size % (a.extent * a.inner)):
            return None  # a piece would cut the axis
        return Step(node, a, {0: PIECE})

    def inputs(self, x, a, chain):
        d = _norm(_dim_arg(x, 2), len(static_shape(x.args[0]) or [0]))
        return [(x.args[0], a)] if d != a.dim else None


@rule(*BATCHED)
class _Attention(Rule):
    """A fused attention op: its axis is that of its first argument (query, or in the backward
    the output's gradient); each (batch, heads, ...) operand follows it (:func:`heads_axis`)."""

    def step(self, node, axes):
        spec = BATCHED[node.target]
        batched = _batched_args(node)
        ref = static_shape(node.args[0])
        reached = [heads_axis(axes[n], static_shape(n), ref) for _, n in batched if n in axes]
        if not reached or None in reached or any(r != reached[0] for r in reached):
            return None
        if any(a in axes for k, a in _tensor_args(node) if k not in spec.batched):
            return None
        a = reached[0]
        if (ops.arg(node, "dropout_p") or 0.0) != 0.0 or any(ops.arg(node, name) for name in spec.off):
            return None
        if any(ops.arg(node, name) is not None for name in spec.none):
            return None  # an attention bias or mask, or nested-tensor sequence offsets
        operands = {}
        for k, n in batched:
            shape = static_shape(n)
            want = heads_axis(a, ref, shape)
            if want is None or not want.fits(shape) or (n in axes and axes[n] != want):
                return None
            operands[k] = PIECE if n in axes else want
        return Step(node, a, operands)

    def inputs(self, x, a, chain):
        ref = static_shape(x.args[0])
        ins = [(n, heads_axis(a, ref, static_shape(n))) for _, n in _batched_args(x)]
        return ins if all(ia is not None for _, ia in ins) else None


@rule(ops.WAIT)
class _Wait(Rule):
    def step(self, node, axes):
        if static_shape(node) is None or node.args[0] not in axes:
            return None
        return Step(node, axes[node.args[0]], {0: PIECE})

    def inputs(self, x, a, chain):
        return [(x.args[0], a)]


@rule(ops.ALL_TO_ALL)
class _AllToAll(Rule):
    """Even splits, with the peers' blocks whole around the axis (:func:`all_to_all_fits`)."""

    def step(self, node, axes):
        a = axes.get(node.args[0])
        if static_shape(node) is None or a is None or not all_to_all_fits(node, a):
            return None
        return Step(node, a, {0: PIECE})

    def inputs(self, x, a, chain):
        return [(x.args[0], a)] if chain.admits(x) and all_to_all_fits(x, a) else None


@rule(ops.ALL_GATHER, ops.REDUCE_SCATTER)
class _GatherScatter(Rule):
    """Dim 0 holds the ranks' blocks: an all-gather stacks them (the axis' outer factor grows
    by the world size), a reduce-scatter keeps one (it must not cut a block)."""

    def step(self, node, axes):
        out, a = static_shape(node), axes.get(node.args[0])
        if out is None or a is None:
            return None
        if (
            node.target is ops.REDUCE_SCATTER
            and a.dim == 0
            and a.outer(static_shape(node.args[0])) % ops.world_size(node)
        ):
            return None
        return Step(node, a, {0: PIECE}) if a.fits(out) else None

    def inputs(self, x, a, chain):
        return [(x.args[0], a)] if chain.admits(x) else None


@rule(ops.aten.stack.default, ops.aten.cat.default)
class _Concat(Rule):
    """stack / cat of same-shaped region tensors with one axis (the per-expert loop stacks its
    experts' outputs). Along the axis dim, the pieces' blocks stack (the axis' outer factor
    grows): chunk c of the result is the pieces' chunks c (sequence parallelism's scatter layout)."""

    def step(self, node, axes):
        xs = node.args[0]
        if static_shape(node) is None or not all(isinstance(x, Node) and x in axes for x in xs):
            return None
        a, shape = axes[xs[0]], static_shape(xs[0])
        if shape is None or any(axes[x] != a or static_shape(x) != shape for x in xs):
            return None
        if node.target is ops.aten.stack.default:
            d = _norm(_dim_arg(node, 1), len(shape) + 1)
            return Step(node, Axis(a.dim + (d <= a.dim), a.extent, a.inner), {0: PIECE})
        return Step(node, a, {0: PIECE})

    def inputs(self, x, a, chain):
        stack = x.target is ops.aten.stack.default
        d = _norm(_dim_arg(x, 1), len(static_shape(x) or [0]))
        if not all(isinstance(n, Node) for n in x.args[0]):
            return None
        if d == a.dim:  # a cat along the axis dim: each piece brings whole blocks of it
            if stack or any(not a.fits(static_shape(n) or []) for n in x.args[0]):
                return None
            return [(n, a) for n in x.args[0]]
        ia = Axis(a.dim - (stack and d < a.dim), a.extent, a.inner)
        return [(n, ia) for n in x.args[0]]


@rule(*ops.RESHAPES)
class _Reshape(_Unary):
    """Where the factor stays whole (:func:`through_reshape`). view/reshape/_unsafe_view take
    the chunk's new shape; squeeze/unsqueeze/flatten keep their dim arguments valid because
    sizes, not ranks, change."""

    SHAPED = (ops.aten.view.default, ops.aten._unsafe_view.default, ops.aten.reshape.default)

    def chunked(self, node, out, a):
        new = through_reshape(static_shape(node.args[0]), a, out)
        if new is None:
            return None
        return Step(node, new, {0: PIECE}, (1, out) if node.target in self.SHAPED else None)

    def inputs(self, x, a, chain):
        sa = through_reshape(static_shape(x), a, static_shape(x.args[0]) or [])
        return [(x.args[0], sa)] if sa is not None else None


@rule(*ops.PERMUTES)
class _Permute(_Unary):
    def chunked(self, node, out, a):
        return Step(node, Axis(_perm(node, len(out)).index(a.dim), a.extent, a.inner), {0: PIECE})

    def inputs(self, x, a, chain):
        perm = _perm(x, len(static_shape(x)))
        return [(x.args[0], Axis(perm[a.dim], a.extent, a.inner))]


@rule(ops.aten.select.int)
class _Select(_Unary):
    """Of another dim than the axis' (the axis dim shifts down past it)."""

    def chunked(self, node, out, a):
        d = _norm(node.args[1], len(out) + 1)
        return None if d == a.dim else Step(node, Axis(a.dim - (d < a.dim), a.extent, a.inner), {0: PIECE})


@rule(ops.aten.slice.Tensor)
class _Slice(_Unary):
    """Of another dim than the axis', or of everything (DTensor's no-op slices)."""

    def chunked(self, node, out, a):
        d = _norm(node.args[1] if len(node.args) > 1 else 0, len(out))
        return None if d == a.dim and not ops.is_full_slice(node) else Step(node, a, {0: PIECE})


@rule(ops.aten.select_backward.default)
class _SelectBackward(_Unary):
    def chunked(self, node, out, a):
        d = _norm(node.args[2], len(out))
        return Step(node, Axis(a.dim + (d <= a.dim), a.extent, a.inner), {0: PIECE}, (1, out))


@rule(ops.aten.slice_backward.default)
class _SliceBackward(_Unary):
    def chunked(self, node, out, a):
        return None if _norm(node.args[2], len(out)) == a.dim else Step(node, a, {0: PIECE}, (1, out))


@rule(ops.aten.expand.default)
class _Expand(_Unary):
    """Along a dim it does not broadcast (GQA's repeated k/v heads)."""

    def chunked(self, node, out, a):
        src = static_shape(node.args[0])
        if len(src) != len(out) or src[a.dim] != out[a.dim]:
            return None
        return Step(node, a, {0: PIECE}, (1, out))

    def inputs(self, x, a, chain):
        src, shape = static_shape(x.args[0]), static_shape(x)
        return [(x.args[0], a)] if src is not None and len(src) == len(shape) and src[a.dim] == shape[a.dim] else None


@rule(ops.aten.detach.default)
class _Detach(_Unary):
    def chunked(self, node, out, a):
        return Step(node, a, {0: PIECE})


@rule(ops.aten.sum.dim_IntList, ops.aten.mean.dim)
class _Reduce(_Unary):
    """Over other dims: the axis dim shifts down past the reduced ones (unless kept). Over the
    axis: a sum becomes per-chunk partials (a mean's would need rescaling)."""

    def chunked(self, node, out, a):
        rank = len(static_shape(node.args[0]))
        dims = [_norm(d, rank) for d in (node.args[1] or range(rank))]
        keep = node.args[2] if len(node.args) > 2 else node.kwargs.get("keepdim", False)
        if a.dim in dims:
            return Step(node, None, {0: PIECE}) if node.target is ops.aten.sum.dim_IntList else None
        shift = 0 if keep else sum(d < a.dim for d in dims)
        return Step(node, Axis(a.dim - shift, a.extent, a.inner), {0: PIECE})


@rule(ops.aten.mm.default, when=ops.is_batched_matmul)
class _Matmul(Rule):
    """mm (M,K)@(K,N) and bmm (B,M,K)@(B,K,N) (or a grouped matmul of that form): the output
    follows an axis on M, N or B (the other side narrowed along B too); an axis on K, on both
    sides, makes the output a sum of partial products."""

    def step(self, node, axes):
        if _plain(node, axes) is None:
            return None
        lhs, rhs = node.args[0], node.args[1]
        if node.target is ops.LOOP_GROUPED_MM or static_shape(lhs) is None or static_shape(rhs) is None:
            return None
        bmm = ops.is_batched_matmul(node)
        m, k, k2, n = (1, 2, 1, 2) if bmm else (0, 1, 0, 1)
        la, ra = axes.get(lhs), axes.get(rhs)
        if ops.is_grouped_mm(node):
            # A grouped matmul is chunked by batch or rows only: CUDA's _grouped_mm needs 16-byte
            # aligned operands, which a slice of columns (N) or of K at any offset need not be
            # (slices of B or M start at a multiple of the row stride, which its checks align).
            # A sum over K is fine in bf16/fp16: it runs whole, on operands rebuilt from the chunks.
            v = ops.val(node)
            whole = (
                v is not None
                and v.dtype in LOW_PRECISION
                and ((la is not None and la.dim == k) or (ra is not None and ra.dim == k2))
            )
            if not (whole or (la is not None and la.dim in (0, m)) or (ra is not None and ra.dim == 0)):
                return None

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

    def inputs(self, x, a, chain):
        if x.target is ops.aten.mm.default:
            return [(x.args[0], a)] if a.dim == 0 else [(x.args[1], a)]
        if ops.is_grouped_mm(x) and a.dim == 2:
            return None  # columns of a grouped matmul: see step
        return {0: [(x.args[0], a), (x.args[1], a)], 1: [(x.args[0], a)], 2: [(x.args[1], a)]}[a.dim]


@rule(when=ops.is_pointwise)
class _Pointwise(Rule):
    """Elementwise ops and layout identities: every operand is its chunk, or broadcasts over
    the axis (a norm's (.., 1) scale: passed whole), or has the axis along other dims (narrowed)."""

    def step(self, node, axes):
        got = _plain(node, axes)
        if got is None:
            return None
        out, reached = got
        if node.target is ops.aten._to_copy.default and not ops.same_place_copy(node):
            return None
        full = [axes[n] for n in reached.values() if len(static_shape(n) or ()) == len(out)]
        if not full or not full[0].fits(out):
            return None
        axis, operands = full[0], {}
        for k, a in _tensor_args(node):
            if a in axes:  # its chunk: of the output's axis, or of the dim that axis broadcasts from
                sa = static_shape(a)
                same = sa is not None and len(sa) == len(out) and sa[axis.dim] == out[axis.dim]
                if axes[a] != (axis if same else _broadcast_treatment(a, out, axis)):
                    return None
                operands[k] = PIECE
            else:
                how = _broadcast_treatment(a, out, axis)
                if how is False:
                    return None
                operands[k] = how
        return Step(node, axis, operands)

    def inputs(self, x, a, chain):
        out = []
        for _, n in _tensor_args(x):
            how = _broadcast_treatment(n, static_shape(x), a)
            if how is False:
                return None
            if how is not None:
                out.append((n, how))
        return out or None


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
    if shape is None or not world or not axis.fits(shape) or not even_splits(coll):
        return False
    return axis.dim != 0 or axis.outer(shape) % world == 0


@dataclass
class Region:
    axis: Axis
    steps: list[Step]
    """In graph order."""
    axes: dict[Node, Axis]
    seeds: list[Node]
    """Tensors from outside the region it reads chunk by chunk (narrowed)."""
    whole: list[Node]
    """Region nodes that something outside the region reads whole."""
    deferred: list[Node] = field(default_factory=list)
    """Sums over the axis left out to run whole after the chunks (:func:`_deferrable`)."""
    invariant: list[Node] = field(default_factory=list)
    """Getitems outside the region of its attention ops' chunk-invariant results (RNG state,
    sequence lengths): they read the first chunk's op instead."""

    def levels(self) -> dict[Node, int]:
        """:func:`levels` of the region's steps and deferred sums (while the graph still holds them)."""
        order = {n: i for i, n in enumerate(self.steps[0].node.graph.nodes)} if self.steps else {}
        return levels(sorted([st.node for st in self.steps] + self.deferred, key=order.get))

    @property
    def matmuls(self) -> list[Node]:
        return [s.node for s in self.steps if s.node.target in ops.MATMULS]

    @property
    def collectives(self) -> list[Node]:
        return [s.node for s in self.steps if in_region_kind(s.node)]

    def score(self) -> tuple:
        """Most all-to-alls overlapped first; then room for a pipeline (up to 8 chunks);
        then the most matmuls chunked."""
        return (len(self.collectives), min(self.axis.extent, 8), len(self.matmuls), self.axis.extent)


class _Grower:
    """Builds a region: pulls the seed's chunks from as far upstream as they can come
    (through the all-to-all itself, layout ops, matmuls), then grows downstream."""

    def __init__(self, may_chain, defer=frozenset(), probe: bool = False, kinds=(ops.ALL_TO_ALL,)):
        self.may_chain = may_chain
        self.kinds = kinds
        """The collectives the region may take in (:data:`CHUNKABLE`)."""
        self.defer = defer
        self.probe = probe
        """Admit low-precision sums over the axis too (as candidates for deferral only)."""
        self.axes: dict[Node, Axis] = {}
        self.seeds: set[Node] = set()
        self.steps: dict[Node, Step] = {}

    def _save(self):
        return dict(self.axes), set(self.seeds), dict(self.steps)

    def _restore(self, saved):
        self.axes, self.seeds, self.steps = saved

    def pull(self, x: Node, a: Axis) -> bool:
        """Make ``x``'s chunks along ``a`` available: computed per chunk from its inputs
        where an op allows it, else narrowed from ``x`` itself (a seed)."""
        if x in self.axes:
            return self.axes[x] == a
        if x.target not in TUPLES:  # those return tuples: their getitems are checked
            shape = static_shape(x)
            if shape is None or not a.fits(shape):
                return False
        ins = inputs_for(x, a, self.may_chain, self.kinds)
        if ins:
            saved = self._save()
            if all(self.pull(i, ia) for i, ia in ins):
                st = step_of(x, self.axes)
                if st is not None and st.axis == a:
                    self.steps[x] = st
                    self.axes[x] = a
                    return True
            self._restore(saved)
        if x.target in TUPLES:
            return False
        self.seeds.add(x)
        self.axes[x] = a
        return True

    def pull_collective(self, x: Node, a: Axis) -> bool:
        """pull(), kept only when it brings an all-to-all into the region (else narrowing
        ``x`` itself is as good and cheaper)."""
        saved = self._save()
        before = {n for n in self.steps if in_region_kind(n)}
        if self.pull(x, a) and any(in_region_kind(n) and n not in before for n in self.steps):
            return True
        self._restore(saved)
        return False

    def grow(self, graph) -> None:
        for node in graph.nodes:
            if node in self.axes or node.op != "call_function":
                continue
            if not any(a in self.axes and a not in self.seeds for a in node.all_input_nodes):
                continue
            if node in self.defer or (
                ops.is_collective(node) and (node.target not in self.kinds or not self.may_chain(node))
            ):
                continue
            st = step_of(node, self.axes)
            if st is None or (_low_precision_sum(node, st) and not self.probe):
                # A low-precision reduction over the axis stays whole, on operands rebuilt from
                # the chunks: per-chunk partials would each be rounded before the sum.
                continue
            for k, how in list(st.operands.items()):
                arg = node.args[k] if isinstance(k, int) else node.kwargs[k]
                if isinstance(how, Axis) and isinstance(arg, Node) and self.pull_collective(arg, how):
                    st.operands[k] = PIECE
            self.steps[node] = st
            if st.axis is not None:
                self.axes[node] = st.axis


def _low_precision_sum(node: Node, st: Step) -> bool:
    """A reduction over the axis in bf16/fp16: it must not become per-chunk partials."""
    return st.axis is None and ops.val(node).dtype in LOW_PRECISION


def grow(start: Node, axis: Axis, may_chain=lambda coll: True, kinds=(ops.ALL_TO_ALL,)) -> Region | None:
    """The region of ``start`` (a collective's wait) chunked along ``axis`` (None: the
    collective itself cannot be chunked so); ``kinds``: the collectives it may take in."""
    g = _Grower(may_chain, probe=True, kinds=kinds)
    if not g.pull(start, axis) or start in g.seeds:
        return None
    g.grow(start.graph)
    defer = _deferrable(g.steps)
    if defer or any(_low_precision_sum(n, st) for n, st in g.steps.items()):
        # Grown again without them (their operands become tensors read whole), and without
        # the low-precision sums that cannot be deferred (they stay whole where they are).
        g = _Grower(may_chain, frozenset(defer), kinds=kinds)
        g.pull(start, axis)
        g.grow(start.graph)
    order = {n: i for i, n in enumerate(start.graph.nodes)}
    steps = sorted(g.steps.values(), key=lambda st: order[st.node])
    inside = set(g.steps)
    invariant = [u for n in g.axes if n.target in BATCHED for u in n.users if u not in inside and invariant_output(u)]
    whole = [n for n in g.axes if n not in g.seeds and any(u not in inside and u not in invariant for u in n.users)]
    return Region(
        axis,
        steps,
        g.axes,
        sorted(g.seeds, key=order.get),
        sorted(whole, key=order.get),
        sorted(g.defer, key=order.get),
        sorted(invariant, key=order.get),
    )


def levels(nodes) -> dict[Node, int]:
    """Per node (in graph order), the number of all-to-alls among ``nodes`` upstream of it;
    an all-to-all counts itself (its output is one level further than its input)."""
    level: dict[Node, int] = {}
    for node in nodes:
        lvl = max((level.get(i, 0) for i in node.all_input_nodes), default=0)
        level[node] = lvl + in_region_kind(node)
    return level


def _deferrable(steps: dict[Node, Step]) -> list[Node]:
    """Sums over the axis that no step reads and that an all-to-all of the region follows
    (one fed from their level or later): run whole after the chunks, they hide under that
    all-to-all's last chunks instead of paying partials (see the module docstring)."""
    order = {n: i for i, n in enumerate(next(iter(steps)).graph.nodes)} if steps else {}
    nodes = sorted(steps, key=order.get)
    level = levels(nodes)
    fed = [level[c] - 1 for c in nodes if in_region_kind(c)]
    return [
        n
        for n in nodes
        if steps[n].axis is None and not any(u in steps for u in n.users) and any(f >= level[n] for f in fed)
    ]


MAX_GROUPED = 64
"""Dims of at most this size (heads, batch: not sequence rows) also offer their indices in groups."""


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
            p = math.prod(dst[j + 1 :])
            if p % row == 0 and dst[j] > 1 and shape[0] % (dst[j] * (p // row)) == 0:
                out.append(Axis(0, dst[j], p // row))
    out.append(Axis(0, shape[0] // world, 1))
    out += [Axis(d, shape[d], 1) for d in range(1, len(shape)) if shape[d] > 1]
    # and groups of a dim's indices (heads in groups: with grouped-query attention, chunk c of
    # the k/v heads serves the query heads of group c)
    out += [
        Axis(d, e, shape[d] // e)
        for d in range(1, len(shape))
        if shape[d] <= MAX_GROUPED
        for e in range(2, shape[d])
        if shape[d] % e == 0
    ]
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
    split = shape[: axis.dim] + [o, axis.extent, axis.inner] + shape[axis.dim + 1 :]
    piece = b.slice(b.view(x, split), axis.dim + 1, start, start + n)
    return b.reshape(piece, axis.resized(shape, n))


def assemble(b: Builder, pieces: list[Node], sizes: list[int], axis: Axis, shape: list[int]) -> Node:
    """The whole tensor (of ``shape``) from its chunks along ``axis``."""
    if len(pieces) == 1:
        return pieces[0]
    o = axis.outer(shape)
    if o == 1 and axis.inner == 1:
        return b.cat(pieces, axis.dim)
    parts = [b.view(p, shape[: axis.dim] + [o, n, axis.inner] + shape[axis.dim + 1 :]) for p, n in zip(pieces, sizes)]
    return b.view(b.cat(parts, axis.dim + 1), shape)


_VIEWS = (ops.aten.view.default, ops.aten._unsafe_view.default)


def _viewable(x: Node, shape) -> bool:
    """Whether ``x`` can be viewed as ``shape`` without a copy. A chunk is a narrow of the
    whole tensor: where the original view merged a dim the chunk cuts with one it does not
    (the experts of a [world, local, ...] buffer, cut along local), the chunk's strides may
    no longer merge even though the whole tensor's did."""
    v = ops.val(x)
    if v is None:
        return False
    try:
        v.view(shape)
    except (RuntimeError, ValueError):  # fake tensors raise ValueError, real ones RuntimeError
        return False
    return True


def contiguous(b: Builder, x: Node) -> Node:
    v = ops.val(x)
    return x if v is not None and v.is_contiguous() else b.contiguous(x)


def replay(b: Builder, region: Region, sizes: list[int], marks: list | None = None) -> list[dict[Node, Node]]:
    """Build every step once per chunk; returns, per chunk, region node -> its chunk
    (for sums: its partial). ``marks``, if given, gets (chunk, step node, number of nodes
    created so far) after each step: which new nodes belong to which step of which chunk."""
    like = b.like
    try:
        return _replay(b, region, sizes, marks)
    finally:
        b.like = like


def _replay(b: Builder, region: Region, sizes: list[int], marks: list | None) -> list[dict[Node, Node]]:
    out = []
    off = 0
    for c, n in enumerate(sizes):
        narrowed: dict[tuple, Node] = {}

        def narrow_once(x, a):
            if (x, a) not in narrowed:
                narrowed[(x, a)] = narrow(b, x, a, off, n)
            return narrowed[(x, a)]

        piece: dict[Node, Node] = {x: narrow_once(x, region.axes[x]) for x in region.seeds}
        for st in region.steps:
            node = st.node
            b.like = node  # a chunk's nodes keep their original's provenance (module path, stack)

            def operand(k, a):
                how = st.operands.get(k)
                if isinstance(a, (list, tuple)):
                    return [operand(k, x) if isinstance(x, Node) else x for x in a]
                if how is PIECE:
                    return piece[a]
                if isinstance(how, Axis):
                    return narrow_once(a, how)
                return a

            args = [operand(i, a) if isinstance(a, (Node, list, tuple)) else a for i, a in enumerate(node.args)]
            kwargs = {k: operand(k, a) if isinstance(a, Node) else a for k, a in node.kwargs.items()}
            if st.shape_arg is not None:
                pos, shape = st.shape_arg
                args[pos] = st.axis.resized(shape, n)
                if node.target in _VIEWS and not _viewable(args[0], args[pos]):
                    args[0] = b.contiguous(args[0])
            if node.target is ops.aten.split.Tensor:
                d = _norm(args[2] if len(args) > 2 else node.kwargs.get("dim", 0), len(static_shape(node.args[0])))
                if d == st.axis.dim:  # each piece keeps whole blocks of the axis: fewer per chunk
                    args[1] = args[1] // (st.axis.extent * st.axis.inner) * n * st.axis.inner
            if node.target in CHUNKABLE:
                args[0] = contiguous(b, args[0])
            if node.target is ops.ALL_TO_ALL:
                per_peer = static_shape(args[0])[0] // ops.world_size(node)
                for i in (1, 2):
                    if args[i] is not None:
                        args[i] = [per_peer] * len(args[i])
            # A piece's view runs as a reshape: the same view where the strides allow, a copy
            # where the real input's strides differ from its fake value's (CPU flash
            # attention lays its output out like its query; its fake kernel does not).
            target = ops.aten.reshape.default if node.target in _VIEWS else node.target
            piece[node] = b.call(target, *args, **kwargs)
            if marks is not None:
                marks.append((c, node, len(b.created)))
        out.append(piece)
        off += n
    return out


def substitute(b: Builder, region: Region, sizes: list[int], marks: list | None = None) -> list[dict[Node, Node]]:
    """Replay the region per chunk (:func:`replay`), then point what reads it from outside at
    the chunks: tensors read whole at their reassembly, sums over the axis at the sum of
    their partials. If the replay fails (an op refused its chunk shapes), what it built is
    erased and the error raised: the graph is as it was."""
    try:
        pieces = replay(b, region, sizes, marks)
    except Exception:
        b.erase_created()
        raise
    for node in region.whole:
        node.replace_all_uses_with(assemble(b, [p[node] for p in pieces], sizes, region.axes[node], static_shape(node)))
    for item in region.invariant:
        item.replace_input_with(item.args[0], pieces[0][item.args[0]])
    for st in region.steps:
        if st.axis is None:
            st.node.replace_all_uses_with(add_partials(b, [p[st.node] for p in pieces]))
    return pieces


def add_partials(b: Builder, parts: list[Node]) -> Node:
    """Sum of per-chunk partials (fp32 and wider only: see :func:`grow`)."""
    acc = parts[0]
    for p in parts[1:]:
        acc = b.call(ops.ADD, acc, p)
    return acc
