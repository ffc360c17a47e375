"""Automatic sequence parallelism: an all-reduce followed by row-wise ops becomes a
reduce-scatter, the row-wise ops on this rank's rows, and an all-gather where whole rows
are needed again.

Tensor parallelism without sequence parallelism all-reduces the output of every row-parallel
linear, then every rank runs the same residual add and norm on all rows::

    Before::  h = x + wait(all_reduce(o));  n = rmsnorm(h);  q = n @ Wq
    After::   h_r = x_r + wait(reduce_scatter(o));  n_r = rmsnorm(h_r);  q = wait(all_gather(n_r)) @ Wq

A reduce-scatter and an all-gather move the bytes of one all-reduce, so where each
all-reduce's rows leave the region once, the wire carries the same bytes. The row-wise ops
then run on 1/W of the rows, and both collectives are sites the matmul rewrites pipeline:
the reduce-scatter under the matmul that produces it, the all-gather under the matmul that
consumes it (an all-reduce hides only under its producer).

The pass runs on the joint forward-backward graph, before the partitioner splits it, so the
forward saves the shards the backward reads, and the backward (the norm's backward on the
rows of the reduce-scattered gradient) is rewritten in the same region. It runs on inference
graphs as they are.

**The region.** Seeds are sum all-reduces over at least 2-D values whose leading dims hold N
rows, N divisible by the group size W. A node joins the region when it acts on each row alone
and reads a region value:

- elementwise ops (torch's pointwise tag, casts, clones; never random ones), whose other
  operands broadcast along the rows (a weight, a scalar) or have every row (they are cut to
  this rank's rows by ``overlapc::local_rows``);
- views and reshapes that keep the last dim and the N rows, and ``expand`` of a per-row value;
- ``sum``/``mean`` over the last dim with ``keepdim``.

A ``sum`` over every row dim (a norm weight's gradient) reads the region and leaves it as a
partial sum: it becomes the sum of this rank's rows, all-reduced (the bytes of one weight).
Every other use of a region value is an exit, where its rows are all-gathered (once per value,
views of it share the gather).

**Where it pays.** A region (a connected set of seeds and ops) is rewritten when it moves at
most ``SLACK`` times the bytes of its all-reduces (exits plus partial sums against seeds), it
has row-wise work to save, and each rank gets at least ``MIN_ROWS`` rows (decode steps, a few
rows a rank, keep their all-reduces: latency, not bytes, is their cost).

Numerics: each row's ops are the baseline's, in the same order; the reduce-scatter sums the
same partials as the all-reduce. A partial sum over rows is reassociated (this rank's rows,
then across ranks): fp32 ~1e-6 relative, bf16 a few units in the last place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, Node

from overlapc.options import Options
from overlapc.report import Site

from . import ops
from .axis import static_shape
from .build import Builder
from .coalesce import coalesce_all_reduces

PATTERN = "all_reduce_rows"
MIN_ROWS = 16
"""Rows per rank below which a region keeps its all-reduces (decode)."""
SLACK = 1.05
"""Bytes the rewritten region may move beyond its all-reduces': its partial sums, a weight's
bytes each, are small beside the rows' activations."""

aten = ops.aten
_VIEWS = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
# Same elements, same rows: views of a region value share its shard and its gather.
_SAME = _VIEWS | {aten.detach.default, aten.alias.default, aten.clone.default}
_ROW_REDUCTIONS = {aten.sum.dim_IntList, aten.mean.dim}


@dataclass
class _Info:
    key: tuple
    """(group, world size, rows N): values of one key share a row split."""
    shape: list[int]
    comp: int
    base: Node
    """The value whose shard this one is (itself, unless a view or clone of another)."""


@dataclass
class _Region:
    key: tuple
    seeds: list[Node] = field(default_factory=list)
    nodes: list[Node] = field(default_factory=list)
    partials: list[Node] = field(default_factory=list)
    exits: dict = field(default_factory=dict)
    """base value -> nodes whose outside users need it whole."""
    work: int = 0
    unproven: Node | None = None
    """An operand that kept a row-wise op out of the region: not known to be replicated."""

    @property
    def group(self) -> str:
        return self.key[0]

    @property
    def world(self) -> int:
        return self.key[1]

    @property
    def rows(self) -> int:
        return self.key[2]


def _seed(node: Node) -> tuple | None:
    """(key, shape) when ``node`` is the wait of a sum all-reduce over rows that split."""
    if node.target is not ops.WAIT or not isinstance(node.args[0], Node):
        return None
    coll = node.args[0]
    if coll.target is not ops.ALL_REDUCE or ops.reduce_op(coll) != "sum" or ops.wait_of(coll) is not node:
        return None
    s, w, g = static_shape(coll.args[0]), ops.world_size(coll), ops.group_name(coll)
    if s is None or len(s) < 2 or not w or w < 2 or g is None:
        return None
    n = math.prod(s[:-1])
    if n % w:
        return None
    return (g, w, n), s


def _dims(node: Node, rank: int) -> list[int] | None:
    d = ops.arg(node, "dim")
    if d is None:
        return None
    return sorted(x % rank for x in ([d] if isinstance(d, int) else d))


def _replicated(graph: Graph, group: str, inputs: dict[Node, frozenset]) -> set[Node]:
    """Nodes whose value is the same on every rank of ``group``: inputs known replicated over it
    (``inputs``: a DTensor's Replicate placements), constants, the results of all-reduces and
    all-gathers over it, and what deterministic ops compute from those alone."""
    out: set[Node] = set()
    for node in graph.nodes:
        if node.op == "placeholder":
            ok = group in inputs.get(node, ())
        elif node.op == "get_attr":
            ok = True
        elif node.op != "call_function":
            ok = False
        elif node.target is ops.WAIT:
            coll = node.args[0]
            ok = (
                isinstance(coll, Node)
                and coll.target in (ops.ALL_REDUCE, ops.ALL_GATHER)
                and ops.group_name(coll) == group
            )
        elif ops.is_collective(node) or ops.is_impure(node):
            ok = False
        else:
            ok = all(a in out for a in node.all_input_nodes)
        if ok:
            out.add(node)
    return out


class _Finder:
    def __init__(self, graph: Graph, inputs: dict[Node, frozenset] | None = None):
        self.graph = graph
        self.inputs = inputs or {}
        self._same: dict[str, set[Node]] = {}
        self.unproven: dict[int, Node] = {}
        """Component -> an operand that kept a row-wise op out: not known to be replicated."""
        self.info: dict[Node, _Info] = {}
        self.parent: list[int] = []
        self.partial: dict[Node, int] = {}
        self.kind: dict[Node, str] = {}
        """Region node -> how it is rewritten: seed, same, expand, rowred, pointwise."""
        self.operands: dict[Node, dict] = {}
        """Region node -> its outside tensor operands' treatment: "bcast" or "local"."""

    def same(self, group: str) -> set[Node]:
        if group not in self._same:
            self._same[group] = _replicated(self.graph, group, self.inputs)
        return self._same[group]

    def _comp(self) -> int:
        self.parent.append(len(self.parent))
        return len(self.parent) - 1

    def find(self, c: int) -> int:
        while self.parent[c] != c:
            self.parent[c] = self.parent[self.parent[c]]
            c = self.parent[c]
        return c

    def _union(self, comps: list[int]) -> int:
        roots = {self.find(c) for c in comps}
        root = min(roots)
        for r in roots:
            self.parent[r] = root
        return root

    def run(self) -> None:
        for node in self.graph.nodes:
            if node.op != "call_function":
                continue
            seed = _seed(node)
            if seed is not None:
                key, s = seed
                self.info[node] = _Info(key, s, self._comp(), node)
                self.kind[node] = "seed"
                continue
            ins = [a for a in node.all_input_nodes if a in self.info]
            if not ins:
                continue
            keys = {self.info[a].key for a in ins}
            if len(keys) != 1:
                continue
            self._classify(node, ins, keys.pop())

    def _classify(self, node: Node, ins: list[Node], key: tuple) -> None:
        out = static_shape(node)
        src = self.info[ins[0]]
        comp = lambda: self._union([self.info[a].comp for a in ins])  # noqa: E731
        t = node.target
        if out is None:
            return
        rows = key[2]
        lead = out[:-1]
        if t in _SAME and node.args[0] is ins[0] and len(ins) == 1:
            if len(out) >= 2 and out[-1] == src.shape[-1] and math.prod(lead) == rows:
                self.info[node] = _Info(key, out, comp(), src.base)
                self.kind[node] = "same"
            return
        if t is aten.expand.default and node.args[0] is ins[0]:
            if src.shape[-1] == 1 and src.shape[:-1] == lead:
                self.info[node] = _Info(key, out, comp(), node)
                self.kind[node] = "expand"
            return
        if t in _ROW_REDUCTIONS and node.args[0] is ins[0] and len(node.all_input_nodes) == 1:
            rank = len(src.shape)
            dims = _dims(node, rank)
            if dims == [rank - 1] and ops.arg(node, "keepdim", False):
                self.info[node] = _Info(key, out, comp(), node)
                self.kind[node] = "rowred"
            elif t is aten.sum.dim_IntList and dims == list(range(rank - 1)):
                self.partial[node] = comp()
            return
        if not ops.is_pointwise(node) or ops.is_impure(node) or len(out) < 2 or math.prod(lead) != rows:
            return
        treat = {}
        for a in node.all_input_nodes:
            s = static_shape(a)
            if s is None:
                return
            if a in self.info:
                if self.info[a].shape[:-1] != lead or self.info[a].shape[-1] not in (1, out[-1]):
                    return
                continue
            if a not in self.same(key[0]):
                # Each rank would compute its rows with its own operand: wrong unless equal.
                self.unproven.setdefault(self.find(src.comp), a)
                return
            aligned = [1] * (len(out) - len(s)) + s
            if len(aligned) != len(out) or aligned[-1] not in (1, out[-1]):
                return
            if all(d == 1 for d in aligned[:-1]):
                treat[a] = "bcast"
            elif aligned[:-1] == lead:
                treat[a] = "local"
            else:
                return  # broadcast along some row dims only (e.g. a per-position table)
        self.info[node] = _Info(key, out, comp(), node)
        self.kind[node] = "pointwise"
        self.operands[node] = treat

    def regions(self) -> list[_Region]:
        by_root: dict[int, _Region] = {}
        for node, inf in self.info.items():
            r = by_root.setdefault(self.find(inf.comp), _Region(inf.key))
            r.nodes.append(node)
            if self.kind[node] == "seed":
                r.seeds.append(node)
            elif self.kind[node] in ("pointwise", "rowred", "expand"):
                r.work += 1
        for node, c in self.partial.items():
            by_root[self.find(c)].partials.append(node)
        for c, a in self.unproven.items():
            if self.find(c) in by_root:
                by_root[self.find(c)].unproven = a
        inside = set(self.info) | set(self.partial)
        for node, inf in self.info.items():
            if any(u not in inside for u in node.users):
                # A widening cast leaves as its narrower input, cast after the gather.
                src = node.args[0] if _is_widening_cast(node) and node.args[0] in self.info else None
                base = self.info[src].base if src is not None else inf.base
                by_root[self.find(inf.comp)].exits.setdefault(base, []).append(node)
        return list(by_root.values())


def _is_widening_cast(node: Node) -> bool:
    if not ops.is_identity(node) or node.target in _SAME or not isinstance(node.args[0], Node):
        return False
    a, b = ops.val(node.args[0]), ops.val(node)
    return a is not None and b is not None and a.element_size() < b.element_size()


def _bytes(region: _Region) -> tuple[int, int]:
    """(wire bytes per rank before, after): an all-reduce moves 2(W-1)/W of its bytes, a
    reduce-scatter or an all-gather (W-1)/W of its whole tensor's."""
    w = region.world
    seeds = sum(ops.nbytes(s.args[0].args[0]) for s in region.seeds)
    exits = sum(ops.nbytes(b) for b in region.exits)
    partial = sum(ops.nbytes(p) for p in region.partials)
    before = 2 * seeds * (w - 1) // w
    after = (seeds + exits + 2 * partial) * (w - 1) // w
    return before, after


def _why_not(region: _Region, before: int, after: int) -> str | None:
    """Why ``region`` stays as it is (``before`` and ``after``: its :func:`_bytes`), or None."""
    if region.rows // region.world < MIN_ROWS:
        return (
            f"{region.rows // region.world} rows a rank, fewer than {MIN_ROWS}: "
            "a decode-sized step's collectives cost latency, not bytes"
        )
    if not region.work and region.unproven is not None:
        return (
            f"{region.unproven.name} is not known to be the same on every rank (a DTensor with a Replicate "
            "placement, a constant, or a collective's result): the row-wise ops it feeds cannot run on "
            "each rank's rows"
        )
    if after > SLACK * before:
        return (
            f"the rows leave the region {len(region.exits)} times for {len(region.seeds)} all-reduces: "
            f"{after} bytes a rank instead of {before}"
        )
    return None


def _rewrite(region: _Region, finder: _Finder) -> None:
    graph = region.nodes[0].graph
    g, w, n = region.key
    shard: dict[Node, Node] = {}
    local: dict[Node, Node] = {}
    from overlapc.runtime import shard as _shard_ops  # noqa: F401  (registers overlapc::local_rows)

    local_rows = torch.ops.overlapc.local_rows.default
    order = {x: i for i, x in enumerate(graph.nodes)}
    for node in sorted(region.nodes, key=order.__getitem__):
        b = Builder(graph, like=node)
        kind = finder.kind[node]
        with graph.inserting_before(node):
            if kind == "seed":
                x = node.args[0].args[0]
                rs = b.call(ops.REDUCE_SCATTER, b.reshape(x, [n, static_shape(x)[-1]]), "sum", w, g)
                shard[node] = b.call(ops.WAIT, rs)
            elif kind == "same":
                src = shard[node.args[0]]
                shard[node] = (
                    b.call(node.target, src, *node.args[1:], **node.kwargs) if node.target not in _VIEWS else src
                )
            elif kind == "expand":
                shard[node] = b.call(aten.expand.default, shard[node.args[0]], [n // w, static_shape(node)[-1]])
            elif kind == "rowred":
                shard[node] = b.call(node.target, shard[node.args[0]], [-1], True, **_dtype(node))
            else:

                def operand(a):
                    if not isinstance(a, Node):
                        return a
                    if a in shard:
                        return shard[a]
                    s = static_shape(a)
                    if not s:
                        return a
                    if finder.operands[node][a] == "bcast":
                        return b.reshape(a, [s[-1]])
                    if a not in local:  # first needed here: later nodes share it
                        local[a] = b.call(local_rows, b.reshape(a, [n, s[-1]]), w, g)
                    return local[a]

                args = [operand(a) for a in node.args]
                kwargs = {k: operand(v) for k, v in node.kwargs.items()}
                shard[node] = b.call(node.target, *args, **kwargs)
    inside = set(region.nodes) | set(region.partials)
    for base, users in region.exits.items():
        b = Builder(graph, like=base)
        with graph.inserting_before(shard[base].next):
            whole = b.call(ops.WAIT, b.call(ops.ALL_GATHER, shard[base], w, g))
        for node in users:
            with graph.inserting_before(node):
                nb = Builder(graph, like=node)
                if _is_widening_cast(node) and ops.val(node.args[0]).dtype == ops.val(whole).dtype:
                    v = nb.call(node.target, nb.view(whole, static_shape(node.args[0])), *node.args[1:], **node.kwargs)
                else:
                    v = nb.view(whole, static_shape(node))
            node.replace_all_uses_with(v, delete_user_cb=lambda u: u not in inside)
    for p in region.partials:
        b = Builder(graph, like=p)
        with graph.inserting_before(p):
            rows = b.call(aten.sum.dim_IntList, shard[p.args[0]], [0], False, **_dtype(p))
            total = b.call(ops.WAIT, b.call(ops.ALL_REDUCE, rows, "sum", g))
            out = b.view(total, static_shape(p))
        p.replace_all_uses_with(out)
    dead = sorted(inside | {s.args[0] for s in region.seeds}, key=order.__getitem__, reverse=True)
    for node in dead:
        if not node.users:
            graph.erase_node(node)


def _placeholder_groups(graph: Graph, replicated_inputs: list | None) -> dict[Node, frozenset]:
    """Placeholder -> groups its value is replicated over, from the compiled program's inputs
    (one set per input, in order; a joint graph's tangents come after them). Unknown (empty)
    where the counts differ: a tensor subclass other than DTensor flattens to several."""
    if not replicated_inputs:
        return {}
    inputs = [n for n in graph.nodes if n.op == "placeholder" and not n.name.startswith("tangents")]
    if len(inputs) != len(replicated_inputs):
        return {}
    return {n: frozenset(g) for n, g in zip(inputs, replicated_inputs)}


def _dtype(node: Node) -> dict:
    """A reduction's dtype keyword, the one keyword its rewrite keeps (dim and keepdim change)."""
    return {"dtype": node.kwargs["dtype"]} if node.kwargs.get("dtype") is not None else {}


def _kind(node: Node, backward: set[Node], default: str) -> str:
    if default != "joint":
        return default
    return "backward" if node in backward else "forward"


def _backward_nodes(graph: Graph) -> set[Node]:
    """Nodes that read a tangent: the backward half of a joint graph."""
    out: set[Node] = set()
    for node in graph.nodes:
        if (node.op == "placeholder" and node.name.startswith("tangents")) or any(
            a in out for a in node.all_input_nodes
        ):
            out.add(node)
    return out


def auto_sequence_parallel(
    graph: Graph, graph_kind: str, options: Options, replicated_inputs: list | None = None
) -> list[Site]:
    """Rewrite every region of ``graph`` that pays; one report row per region found.
    ``graph_kind`` "joint" names each row forward or backward by its first all-reduce.

    Sums of all-reduces are coalesced first (passes/coalesce.py): a region's reduce-scatter
    then carries the summed partials once, not each term's."""
    backward = _backward_nodes(graph) if graph_kind == "joint" else set()
    rows = coalesce_all_reduces(graph, graph_kind, options, kind_of=lambda n: _kind(n, backward, graph_kind))
    finder = _Finder(graph, _placeholder_groups(graph, replicated_inputs))
    finder.run()
    seen: dict[str, int] = {}
    for region in finder.regions():
        if not region.work and region.unproven is None:
            continue  # all-reduces whose results no row-wise op reads: not a candidate, no row
        first = region.seeds[0].args[0]
        kind = _kind(region.seeds[0], backward, graph_kind)
        module = ops.common_module(ops.module_path(s.args[0]) for s in region.seeds)
        before, after = _bytes(region)
        base = f"{kind}:{module or first.name}:{PATTERN}"
        seen[base] = seen.get(base, 0) + 1
        row = Site(
            name=base if seen[base] == 1 else f"{base}#{seen[base]}",
            pattern=PATTERN,
            graph=kind,
            status="found",
            group=region.group,
            world_size=region.world,
            collective=first.name,
            collective_op="all_reduce",
            module=module,
            dtype=ops.dtype_name(ops.val(first)),
            comm_bytes=sum(ops.nbytes(s.args[0].args[0]) for s in region.seeds),
            shapes={"input": static_shape(first.args[0]), "output": static_shape(first.args[0])},
            details={
                "all_reduces": len(region.seeds),
                "all_gathers": len(region.exits),
                "partial_sums": len(region.partials),
                "rows": region.rows,
                "wire_bytes": {"before": before, "after": after},
            },
        )
        why = _why_not(region, before, after)
        if options.auto_sp == "off" or options.for_site(row.name)["strategy"] == "none":
            why = "auto_sp 'off'" if options.auto_sp == "off" else "strategy 'none'"
        if why:
            row.status, row.reason = "skipped", why
        else:
            _rewrite(region, finder)
            row.status, row.strategy = "rewritten", "sequence_parallel"
        rows.append(row)
    if any(r.status == "rewritten" for r in rows):
        graph.lint()
    return rows
