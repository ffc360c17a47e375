"""Quantise before the gather: an all-gather whose result is only cast to float8, with one
scale for the whole tensor or one per row, becomes a float8 all-gather of the shard, cast
with the same scales.

torchao's float8 linears quantise their inputs tensorwise: ``scale = amax(|x|) / fp8_max``,
``x_fp8 = clamp(x / scale).to(fp8)``. In tensor parallelism the operand is often gathered in
bf16 and quantised after (a float8 training backward gathers the output gradient so), so
the gather moves twice the bytes it has to, and no GEMM reads the gathered tensor directly:
the all-gather is no site. Here::

    g = all_gather(x); s = f(amax(h(g))); q = e(g, s).to(fp8); ... q ...

becomes::

    s = f(all_reduce_max(amax(h(x)))); q = all_gather(e(x, s).to(fp8)); ... q ...

where ``h`` and ``e`` are elementwise ops whose other operands are single numbers. An
elementwise op commutes with a gather along rows, and the largest element of the gathered
tensor is the largest of the shards' largest, so the scale and every fp8 byte are the ones the
program computed: the result is bit for bit the same. The gather then moves one byte per
element (as uint8: gloo has no float8 type, a bitcast either side) and feeds the GEMM
directly, which makes it an all-gather -> matmul site (passes/all_gather_matmul.py).

Rowwise scales (torchao's rowwise recipe: ``amax(|g|, dim=-1, keepdim=True)``) are computed
from each row alone, so the shard's rows get theirs locally, with no all-reduce; the scales
are gathered beside the float8 rows (4 bytes a row), and the GEMM's chunks take their rows'
scales.

A gathered tensor read by anything else (a bf16 GEMM, a sum over some dims, a rowwise scale)
is left as it is and reported with the reason.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
from torch.fx import Graph, Node
from torch.fx.node import map_arg

from overlapc.options import Options
from overlapc.report import Site

from . import ops
from .axis import static_shape
from .build import Builder
from .normalize import erase_collective, remove_dead_nodes, split_cat_gather
from .sites import Loose

aten = torch.ops.aten
CONVERT = torch.ops.prims.convert_element_type.default  # a cast in eager and inductor graphs alike
PATTERN = "fp8_gather"
FP8 = {torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz}


class _NotThis(Exception):
    """The gather is not one this pass rewrites; the message says why."""


def _is_full_max(node: Node) -> bool:
    """A max over every element (amax over all dims, or max without dims)."""
    if node.op != "call_function":
        return False
    if node.target is aten.max.default:
        return True
    if node.target is not aten.amax.default:
        return False
    dims = ops.arg(node, "dim", [])
    rank = len(static_shape(node.args[0]) or [])
    return not dims or sorted(d % rank for d in dims) == list(range(rank))


def _is_elementwise(node: Node) -> bool:
    if not ops.is_pointwise(node) or ops.is_impure(node):
        return False
    tags = getattr(node.target, "tags", ())
    if torch.Tag.nondeterministic_seeded in tags:
        return False
    return node.target is not aten._to_copy.default or ops.same_place_copy(node)


def _numel_one(a) -> bool:
    if not isinstance(a, Node):
        return True
    shape = static_shape(a)
    return shape is not None and math.prod(shape) == 1


def _is_row_max(node: Node) -> bool:
    """A max over the last dim that keeps it (a rowwise scale's amax)."""
    if node.op != "call_function" or node.target is not aten.amax.default:
        return False
    rank = len(static_shape(node.args[0]) or [])
    dims = ops.arg(node, "dim", [])
    return rank > 0 and [d % rank for d in dims] == [rank - 1] and bool(ops.arg(node, "keepdim", False))


class _Plan:
    """What the gathered value ``wait`` flows into: ``region`` nodes (in graph order) computed
    row by row, each the gathered size or one value per row (in any layout of the leading dims:
    ``reshapes`` keep the last dim); the full maxes ``maxes`` read from them; and the
    ``exits``, region nodes read outside it (float8 casts of the gathered size, and per-row
    values such as rowwise scales), each gathered in the rewrite. On the shard, region values
    keep the shard's own layout; an exit is reshaped after its gather."""

    def __init__(self, wait: Node):
        self.wait = wait
        self.region: list[Node] = []
        self.maxes: list[Node] = []
        self.exits: list[Node] = []
        self.reshapes: set[Node] = set()
        shape = static_shape(wait)
        if shape is None:
            raise _NotThis("the gathered tensor's shape is symbolic")
        k, total = shape[-1], math.prod(shape)

        def full(n) -> bool:
            s = static_shape(n)
            return s is not None and s[-1] == k and math.prod(s) == total

        def per_row(n) -> bool:
            s = static_shape(n)
            return s is not None and s[-1] == 1 and math.prod(s) * k == total

        inside, casts = {wait}, []
        for node in _after(wait):
            read = [a for a in node.all_input_nodes if a in inside]
            if not read:
                continue
            if _is_full_max(node):
                self.maxes.append(node)
                continue
            others = [a for a in node.all_input_nodes if a not in inside]
            if node.target in ops.RESHAPES and (full(node) or per_row(node)) and (full(read[0]) == full(node)):
                self.reshapes.add(node)
            elif not (_is_row_max(node) and full(read[0])) and not (
                _is_elementwise(node) and (full(node) or per_row(node)) and all(map(_numel_one, others))
            ):
                if all(a is not wait and per_row(a) for a in read):
                    continue  # reads per-row values only (a rowwise scale): they leave, gathered
                raise _NotThis(f"the gathered tensor is also read by {ops.op_name(node)} ({node.name})")
            self.region.append(node)
            v = ops.val(node)
            if v is not None and v.dtype in FP8 and full(node):
                casts.append(node)  # its users are free: they read float8 bytes
            else:
                inside.add(node)
        if not casts:
            raise _NotThis("the gathered tensor is not cast to float8 row by row")
        self.exits = list(casts)
        for node in [wait, *self.region]:
            if node in casts:
                continue
            outside = [u for u in node.users if u not in inside and u not in casts and u not in self.maxes]
            if outside and node is not wait and per_row(node):
                self.exits.append(node)  # a per-row value read outside: gathered too (4 bytes a row)
            elif outside:
                u = outside[0]
                raise _NotThis(f"the gathered tensor is also read by {ops.op_name(u)} ({u.name})")
        self.exits.sort(key=self.region.index)


def _cast_to_fp8(wait: Node) -> bool:
    """Whether elementwise ops (and reshapes) from the gathered tensor reach a float8 value."""
    todo, seen = [wait], {wait}
    while todo:
        for u in todo.pop().users:
            if u in seen or not (_is_elementwise(u) or u.target in ops.RESHAPES):
                continue
            v = ops.val(u)
            if v is not None and v.dtype in FP8:
                return True
            seen.add(u)
            todo.append(u)
    return False


def _after(node: Node):
    """The nodes after ``node`` in its graph."""
    n = node.next
    while n.op != "root":
        yield n
        n = n.next


def _rewrite(ag: Node, wait: Node, plan: _Plan, dim: int) -> None:
    """``plan.wait`` is the gathered tensor: ``wait`` itself, or for a gather along ``dim`` > 0
    the cat of its rank pieces (passes/normalize.split_cat_gather), rebuilt alike for each exit."""
    graph = ag.graph
    shard, world, group = ag.args[0], ag.args[1], ops.group_name(ag)
    local = {plan.wait: shard}

    def gather(b: Builder, t: Node) -> Node:
        done = b.call(ops.WAIT, b.call(ops.ALL_GATHER, t, world, group))
        if dim == 0:
            return done
        n = static_shape(t)[0]
        return b.cat([b.slice(done, 0, r * n, (r + 1) * n) for r in range(world)], dim)

    def replay(b: Builder, node: Node) -> Node:
        args, kwargs = map_arg((node.args, node.kwargs), lambda a: local.get(a, a))
        return b.call(node.target, *args, **kwargs)

    inside = set(plan.region) | set(plan.maxes)
    for node in ops.in_graph_order(plan.region + plan.maxes):
        b = Builder(graph, like=node)
        with graph.inserting_before(node):
            if node in plan.maxes:
                # gloo reduces no bf16: the max travels as fp32, exact either way
                m = b.call(CONVERT, replay(b, node), torch.float32)
                m = b.call(ops.WAIT, b.call(ops.ALL_REDUCE, m, "max", group))
                node.replace_all_uses_with(b.call(CONVERT, m, ops.val(node).dtype))
                graph.erase_node(node)
                continue
            local[node] = local[node.args[0]] if node in plan.reshapes else replay(b, node)
            if node in plan.exits:
                dtype = ops.val(node).dtype
                # gloo has no float8 type: float8 travels as uint8, a bitcast either side
                raw = b.call(aten.view.dtype, local[node], torch.uint8) if dtype in FP8 else local[node]
                done = gather(b, raw)
                gathered = b.call(aten.view.dtype, done, dtype) if dtype in FP8 else done
                if static_shape(gathered) != static_shape(node):  # the shard kept its own layout
                    gathered = b.reshape(gathered, static_shape(node))
                node.replace_all_uses_with(gathered, delete_user_cb=lambda u: u not in inside)
    for node in reversed(plan.region):
        if not node.users:
            graph.erase_node(node)
    remove_dead_nodes(graph)  # the rank pieces and their cat, for a gather along dim > 0
    erase_collective(ag, wait)


def quantize_before_gather(graph: Graph, graph_kind: str, options: Options) -> list[Site]:
    """Rewrite every all-gather this applies to; a report row for each gather cast to float8."""
    rows: list[Site] = []
    seen: dict[str, int] = {}
    for ag in [n for n in graph.nodes if n.target is ops.ALL_GATHER]:
        wait = ops.wait_of(ag)
        if wait is None:
            continue
        v = ops.val(wait)
        if v is None or v.dtype in FP8 or not v.is_floating_point():
            continue
        # a gather along another dim than 0: wait -> rank pieces -> cat along that dim
        gathered, dim = split_cat_gather(wait, ops.world_size(ag)) or (wait, 0)
        if not _cast_to_fp8(gathered):
            continue  # no float8 here: the all-gather -> matmul finder's case
        try:
            plan = _Plan(gathered)
        except _NotThis as e:
            rows.append(_row(ag, wait, graph_kind, "skipped", str(e), seen))
            continue
        row = _row(ag, wait, graph_kind, "found", None, seen)
        if options.for_site(row.name)["strategy"] == "none":
            row.status, row.reason = "skipped", "strategy 'none'"
        else:
            after = sum(ops.nbytes(n) for n in plan.exits) // ops.world_size(ag)
            row.details["wire_bytes"] = {"before": row.comm_bytes, "after": after}  # this rank's shard
            _rewrite(ag, wait, plan, dim)
            row.status, row.strategy = "rewritten", "quantize_before_gather"
        rows.append(row)
    if any(r.status == "rewritten" for r in rows):
        graph.lint()
    return rows


def _row(ag: Node, wait: Node, graph_kind: str, status: str, reason: str | None, seen: dict) -> Site:
    """A report row: the gather's own (as a loose collective's), under this pattern's name;
    ``seen`` counts names so far, so that a module's second gather is "#2"."""
    module = ops.module_path(ag.args[0]) or ops.module_path(wait)
    base = f"{graph_kind}:{module or ag.name}:{PATTERN}"
    seen[base] = seen.get(base, 0) + 1
    name = base if seen[base] == 1 else f"{base}#{seen[base]}"
    row = Loose(ag, reason or "", name, graph_kind).to_report()
    return replace(row, pattern=PATTERN, status=status, reason=reason, module=module, comm_bytes=ops.nbytes(ag.args[0]))
