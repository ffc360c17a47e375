"""Reduce-scatters and all-gathers as all-to-alls where the backend's own forms are slow.

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

An all-gather is an all-to-all whose W send blocks are all the rank's own input::

    Before::  out = wait(all_gather_into_tensor(x, W, group))              # x: (m, ...)
    After::   out = wait(all_to_all_single(expand(x, (W, m, ...)), ...))  # block i from rank i

The same bytes on the wire as gloo's all-gather, and the same values, bit for bit. Two reasons
to send it so on gloo: its all-gather stalls on the TCP transport where all-to-all pieces of
the same bytes do not (a 1 MiB all-gather at world 2 over a shaped link: 102 ms, in pieces
73 ms; benchmarks/experiments/rs_forms.py), and all-to-alls are one gloo algorithm with the
lowered reduce-scatters, so the all-gather chunks of one site and the reduce-scatter chunks of
another may be on the wire together (passes/schedule.py keeps gloo's algorithms apart and
all-gathers one at a time; all-to-alls are neither).

A large all-to-all is sent in pieces (:func:`piece_count`), each an all-to-all of a column range of
every block, all issued before the first is waited on: on gloo's TCP transport one message of
hundreds of KiB per peer ran at half the link rate after another collective, where the same
bytes in pieces kept it. Block i of the result comes from rank i on every rank, so a
reduce-scatter's sum has one fixed order, the same for every block; values differ from gloo's
all-reduce order by rounding only (fp32: ~1e-7 relative; bf16: the sum is accumulated in fp32
and rounded once).

This is a lowering, not a site: it runs after the sites are rewritten, on every collective of
the kind in the graph (the chunks a rewrite issued included), so the planner prices such
collectives as all-to-alls (:func:`lowered_groups`, passes/plan.py; the live group is timed in
this form, overlapc/runtime/live.py). Options ``reduce_scatter`` and ``all_gather``: "auto"
lowers on gloo groups (under strategy "none" only where micro-batch slices rewrite the graph
anyway), "all_to_all" on every group, "native" nowhere.
"""

from __future__ import annotations

import math

import torch
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
"""Backends whose reduce-scatter is an all-reduce underneath and whose all-gather stalls."""
PRICED_AS = "overlapc_priced_as"
"""node.meta key of an all-to-all this lowering issued: (the kind it stands for, that collective's
bytes per rank, the pieces it was cut into). The live group timed the lowered collective whole,
under its kind (overlapc/runtime/live.py), so a piece is priced as that share of it."""
OPTION = {ops.REDUCE_SCATTER: "reduce_scatter", ops.ALL_GATHER: "all_gather"}
"""The option that says how each lowered kind runs."""
VERDICT: dict[tuple, str] = {}
"""(group name, kind) -> the form "auto" runs it in there: "native", "pieces" (all-to-alls in
:func:`piece_count`) or "whole" (one all-to-all), the fastest measured on the live group at compile
time (overlapc/runtime/live.choose_forms). Without a measurement (option ``measure`` off, a
profile named), "auto" lowers on the backends of LOWERED_BACKENDS, in pieces."""


def _group_lowered(name: str | None, kind, options: Options, measured: bool = True) -> bool:
    how = getattr(options, OPTION[kind])
    if how == "native" or name is None:
        return False
    if how == AS_ALL_TO_ALL:
        return True
    if options.strategy == "none" and not options.fixed_slices:  # "auto" under "none": report only, nothing changes
        return False
    if kind is ops.ALL_GATHER and options.lanes > 0:  # lanes carry gloo's own all-gathers
        return False
    from overlapc.runtime import lanes

    if ops.group_backend(lanes.base_group(name)) not in LOWERED_BACKENDS:
        return False
    return _verdict(name, kind) != "native" if measured else True


def _verdict(name: str, kind) -> str:
    """The form :data:`VERDICT` holds for ``kind`` on group ``name`` (a lane: its base group);
    "pieces" where nothing was measured."""
    from overlapc.runtime import lanes

    return VERDICT.get((lanes.base_group(name), kind), "pieces")


def form_of(coll: Node, options: Options) -> str:
    """The all-to-all form a lowered collective is sent in: "pieces", or "whole" where "auto"
    measured that faster on its group."""
    if getattr(options, OPTION[coll.target]) != "auto":
        return "pieces"
    return "whole" if _verdict(ops.group_name(coll), coll.target) == "whole" else "pieces"


def piece_count(gather: bool, nbytes: int, world: int) -> int:
    """All-to-alls one reduce-scatter, or all-gather (``gather``), of ``nbytes`` per rank is
    sent as: an all-gather sends its whole input to every peer, as a reduce-scatter of
    ``nbytes * world`` does."""
    sent = nbytes * world if gather else nbytes
    return max(1, min(MAX_PIECES, math.ceil(sent / world / PIECE_BYTES)))


def piece_bounds(cols: int, k: int) -> list[int]:
    """Column bounds of ``k`` pieces of a block of ``cols`` columns: piece p is [b[p], b[p + 1])."""
    return [cols * p // k for p in range(k + 1)]


def lowerable(coll: Node, options: Options, measured: bool = True) -> bool:
    """Whether ``coll`` runs as all-to-alls under ``options``: a reduce-scatter (sum or
    average) of a static dim 0 that the world divides, or an all-gather of a static input,
    floating point or int32/int64, over a group the kind's option lowers (``measured``: where
    the form measured faster, :data:`VERDICT`)."""
    if coll.target not in OPTION or (coll.target is ops.REDUCE_SCATTER and coll.args[1] not in ("sum", "avg")):
        return False
    world, v = coll.args[2] if coll.target is ops.REDUCE_SCATTER else coll.args[1], ops.val(coll.args[0])
    if not isinstance(world, int) or world < 2 or v is None or v.dim() == 0:
        return False
    rows = v.shape[0]
    static = all(isinstance(s, int) for s in v.shape)
    return (
        static
        and (coll.target is ops.ALL_GATHER or rows % world == 0)
        and (v.is_floating_point() or v.dtype in (torch.int32, torch.int64))
        and ops.wait_of(coll) is not None
        and _group_lowered(ops.group_name(coll), coll.target, options, measured)
    )


def lowered_groups(graph: Graph, options: Options, kind=ops.REDUCE_SCATTER) -> set[str]:
    """Names of the groups whose collectives of ``kind`` in ``graph`` :func:`lower_collectives`
    would lower."""
    return {ops.group_name(n) for n in graph.nodes if n.target is kind and lowerable(n, options)}


def lower_collectives(graph: Graph, options: Options) -> dict:
    """Rewrite each :func:`lowerable` collective of ``graph`` in place as all-to-alls (and, for a
    reduce-scatter, a sum of the blocks received); returns {kind: {name of a group whose ones
    were rewritten: "all_to_all pieces" or "all_to_all whole"}}."""
    done: dict = {}
    for coll in [n for n in graph.nodes if lowerable(n, options)]:
        form = form_of(coll, options)
        if coll.target is ops.REDUCE_SCATTER:
            _lower_reduce_scatter(graph, coll, form == "whole")
        else:
            _lower_all_gather(graph, coll, form == "whole")
        done.setdefault(coll.target, {})[ops.group_name(coll)] = f"all_to_all {form}"
        graph.erase_node(coll)
    return done


def _issue(b: Builder, sends: list[Node], rows: int, world: int, group, priced: tuple) -> list[Node]:
    a2as = [b.call(ops.ALL_TO_ALL, t, [rows] * world, [rows] * world, group) for t in sends]
    for a in a2as:
        a.meta[PRICED_AS] = (*priced, len(a2as))
    return a2as


def _waits(b: Builder, a2as: list[Node], wait: Node) -> list[Node]:
    """The waits of ``a2as``, labelled as ``wait`` was: a rewritten site's chunk then still
    names its site when a peer fails (overlapc/runtime/waits.py)."""
    tag = wait.meta.get(SITE_WAIT)
    out = []
    for a2a in a2as:
        waited = b.call(ops.WAIT, a2a)
        if tag is not None:
            waited.meta[SITE_WAIT] = tag
        out.append(waited)
    return out


def _lower_reduce_scatter(graph: Graph, rs: Node, whole: bool) -> None:
    wait = ops.wait_of(rs)
    x, op, world, group = rs.args[:4]
    v = ops.val(x)
    shape, block = list(v.shape), v.numel() // world
    k = 1 if whole else piece_count(False, v.numel() * v.element_size(), world)
    bounds = piece_bounds(block, k)
    b = Builder(graph, like=rs)
    with graph.inserting_before(rs):
        if k == 1:
            sends = [x]
        else:  # piece p: columns [bounds[p], bounds[p + 1]) of every rank's block
            blocks = b.reshape(x, [world, block])
            sends = [b.contiguous(b.slice(blocks, 1, lo, hi)) for lo, hi in zip(bounds, bounds[1:])]
        a2as = _issue(b, sends, 1 if k > 1 else shape[0] // world, world, group, ("reduce_scatter", ops.nbytes(x)))
    with graph.inserting_before(wait):
        parts = [
            b.call(ops.aten.sum.dim_IntList, b.view(got, [world, hi - lo]), [0])
            for got, lo, hi in zip(_waits(b, a2as, wait), bounds, bounds[1:])
        ]
        out = b.view(parts[0] if k == 1 else b.cat(parts, 0), [shape[0] // world, *shape[1:]])
        if op == "avg":
            out = b.call(ops.aten.div.Tensor, out, world)
    wait.replace_all_uses_with(out)
    graph.erase_node(wait)


def _lower_all_gather(graph: Graph, ag: Node, whole: bool) -> None:
    wait = ops.wait_of(ag)
    x, world, group = ag.args[:3]
    v = ops.val(x)
    shape, block = list(v.shape), v.numel()
    k = 1 if whole else piece_count(True, block * v.element_size(), world)
    bounds = piece_bounds(block, k)
    b = Builder(graph, like=ag)
    with graph.inserting_before(ag):
        flat = b.reshape(x, [1, block])
        # piece p: columns [bounds[p], bounds[p + 1]) of the input, one copy per peer
        sends = [
            b.contiguous(b.call(ops.aten.expand.default, b.slice(flat, 1, lo, hi), [world, hi - lo]))
            for lo, hi in zip(bounds, bounds[1:])
        ]
        a2as = _issue(b, sends, 1, world, group, ("all_gather", ops.nbytes(x)))
    with graph.inserting_before(wait):
        got = [b.view(g, [world, hi - lo]) for g, lo, hi in zip(_waits(b, a2as, wait), bounds, bounds[1:])]
        out = b.view(got[0] if k == 1 else b.cat(got, 1), [shape[0] * world, *shape[1:]])
    wait.replace_all_uses_with(out)
    graph.erase_node(wait)
