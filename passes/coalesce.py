"""All-reduce coalescing: all-reduces whose results meet only in a sum become one.

Tensor parallelism without sequence parallelism all-reduces the input gradient of every
column-parallel linear on its own (DTensor's backward, transformers' ``tp_plan``), and the
gradients of the projections that read one tensor are then summed::

    Before::  g = wait(all_reduce(dq @ Wq)) + wait(all_reduce(dk @ Wk)) + wait(all_reduce(dv @ Wv))
    After::   g = wait(all_reduce(dq @ Wq + dk @ Wk + dv @ Wv))

Summation is linear, so AR(a) + AR(b) = AR(a + b): k all-reduces become one that moves the
bytes of one. The partials are summed locally first (the k - 1 adds the sum did anyway), and
the one all-reduce of a sum of matmuls is then a ``matmul_all_reduce`` site like any other
(its producer form is "sum"), which the planner may chunk.

A sum here is a tree of ``aten.add.Tensor`` nodes (alpha 1, equal shapes and dtypes: no
broadcasting) whose inner nodes have no other user. Its leaves that are, through
dtype-preserving layout ops (views, reshapes, permutes, copies), the waited result of a sum
all-reduce used nowhere else are coalesced, per process group and dtype; the other leaves are
added to the result afterwards. The sum is reassociated: values differ from the baseline's by
rounding (fp32: ~1e-7 relative; bf16: a few units in the last place).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from torch.fx import Graph, Node

from overlapc.options import Options
from overlapc.report import Site

from . import ops
from .build import Builder

PATTERN = "all_reduce_sum"
# Layout ops a leaf may pass through: AR(x) viewed equals AR(x viewed); a dtype change would
# move the reduction into another precision, so casts end the walk.
_LEAF_OPS = ops.RESHAPES | ops.PERMUTES | {ops.aten.clone.default, ops.aten.alias.default, ops.aten.contiguous.default}


@dataclass
class _Leaf:
    coll: Node
    wait: Node
    chain: list[Node]
    """Layout nodes from the wait to the summed value, in order."""

    @property
    def value(self) -> Node:
        return self.chain[-1] if self.chain else self.wait


@dataclass
class _Group:
    root: Node
    inner: list[Node]
    """The tree's add nodes, the root included."""
    leaves: list[_Leaf]
    others: list = field(default_factory=list)
    """Leaves that are not coalesced (replicated terms, other groups, scalars)."""


def _is_plain_add(node: Node) -> bool:
    return (
        node.op == "call_function"
        and node.target is ops.ADD
        and node.kwargs.get("alpha", 1) == 1
        and len(node.args) == 2
        and all(isinstance(a, Node) for a in node.args)
    )


def _same_tensor_type(a: Node, b: Node) -> bool:
    va, vb = ops.val(a), ops.val(b)
    return (
        va is not None
        and vb is not None
        and va.dtype == vb.dtype
        and [str(s) for s in va.shape] == [str(s) for s in vb.shape]
    )


def _leaf(node: Node, root: Node) -> _Leaf | None:
    """The sum all-reduce behind ``node`` through single-use layout ops, or None."""
    if not isinstance(node, Node) or len(node.users) != 1 or not _same_tensor_type(node, root):
        return None  # the all-reduced value is needed on its own elsewhere too
    chain = []
    while node.target in _LEAF_OPS:
        chain.append(node)
        node = node.args[0]
        if not isinstance(node, Node) or len(node.users) != 1:
            return None
    if node.target is not ops.WAIT or len(node.users) != 1:
        return None
    coll = node.args[0]
    if (
        not isinstance(coll, Node)
        or coll.target is not ops.ALL_REDUCE
        or ops.reduce_op(coll) != "sum"
        or ops.wait_of(coll) is not node
        or ops.val(coll.args[0]) is None
        or ops.val(coll.args[0]).dtype != ops.val(root).dtype
    ):
        return None
    return _Leaf(coll, node, list(reversed(chain)))


def _trees(graph: Graph) -> list[tuple[Node, list[Node], list]]:
    """(root, add nodes, leaves) of every maximal sum tree, in graph order of the roots."""
    adds = [n for n in graph.nodes if _is_plain_add(n)]
    inner: set[Node] = set()
    for n in adds:
        users = list(n.users)
        if len(users) == 1 and _is_plain_add(users[0]) and _same_tensor_type(n, users[0]):
            inner.add(n)
    out = []
    for root in adds:
        if root in inner:
            continue
        nodes, leaves, todo = [], [], [root]
        while todo:
            n = todo.pop()
            nodes.append(n)
            for a in n.args:
                (todo if a in inner and _same_tensor_type(a, root) else leaves).append(a)
        out.append((root, nodes, leaves))
    return out


def find_groups(graph: Graph) -> list[_Group]:
    """Each sum with at least two coalescable all-reduces of one group and dtype."""
    groups = []
    for root, nodes, leaves in _trees(graph):
        by_key: dict[tuple, list[_Leaf]] = {}
        others = []
        for a in leaves:
            # A term summed twice (x + x) stays as it is: its all-reduce has two uses here.
            lf = _leaf(a, root) if leaves.count(a) == 1 else None
            if lf is None:
                others.append(a)
            else:
                by_key.setdefault((ops.group_name(lf.coll), ops.val(lf.coll.args[0]).dtype), []).append(lf)
        if not any(len(v) > 1 for v in by_key.values()):
            continue
        # One coalesced group per sum: the largest (ties: the first); the rest stay leaves.
        best = max(by_key.values(), key=len)
        for v in by_key.values():
            if v is not best:
                others += [lf.value for lf in v]
        groups.append(_Group(root, nodes, best, others))
    return groups


def _replay(b: Builder, x: Node, chain: list[Node]) -> Node:
    """``chain``'s layout ops applied to ``x`` instead of the all-reduce's result."""
    for n in chain:
        x = b.call(n.target, x, *n.args[1:], **n.kwargs)
    return x


def _rewrite(group: _Group) -> Node:
    graph = group.root.graph
    b = Builder(graph, like=group.root)
    first = group.leaves[0].coll
    with graph.inserting_before(group.root):
        total = None
        for lf in group.leaves:
            part = _replay(b, lf.coll.args[0], lf.chain)
            total = part if total is None else b.call(ops.ADD, total, part)
        coll = b.call(ops.ALL_REDUCE, total, "sum", ops.group_name(first))
        for k in ("nn_module_stack", "fwd_nn_module_stack", "stack_trace"):
            if k in first.meta:
                coll.meta[k] = first.meta[k]
        out = b.call(ops.WAIT, coll)
        for other in group.others:
            out = b.call(ops.ADD, out, other)
    group.root.replace_all_uses_with(out)
    # The old tree, then each leaf's chain, wait and all-reduce, users first.
    for n in group.inner:
        graph.erase_node(n)
    for lf in group.leaves:
        for n in reversed(lf.chain):
            if not n.users:
                graph.erase_node(n)
        graph.erase_node(lf.wait)
        graph.erase_node(lf.coll)
    return coll


def _module(leaves: list[_Leaf]) -> str | None:
    return ops.common_module(ops.module_path(lf.coll.args[0]) or ops.module_path(lf.coll) for lf in leaves)


def coalesce_all_reduces(graph: Graph, graph_kind: str, options: Options, kind_of=None) -> list[Site]:
    """Coalesce every sum of all-reduces in ``graph`` (unless its strategy is "none");
    one report row per sum. ``kind_of(node)`` names a joint graph's rows forward or backward."""
    rows, seen = [], {}
    for group in find_groups(graph):
        first = group.leaves[0].coll
        graph_kind = kind_of(first) if kind_of else graph_kind
        v = ops.val(first.args[0])
        n = ops.hint(v.numel())
        nbytes = None if n is None else n * v.element_size()
        module = _module(group.leaves)
        base = f"{graph_kind}:{module or first.name}:{PATTERN}"
        seen[base] = seen.get(base, 0) + 1
        name = base if seen[base] == 1 else f"{base}#{seen[base]}"
        merged = [lf.coll.name for lf in group.leaves]
        row = Site(
            name=name,
            pattern=PATTERN,
            graph=graph_kind,
            status="found",
            group=ops.group_name(first),
            world_size=ops.world_size(first),
            collective=first.name,
            collective_op="all_reduce",
            module=module,
            dtype=ops.dtype_name(v),
            comm_bytes=nbytes,
            shapes={"input": [ops.hint(s) for s in v.shape], "output": [ops.hint(s) for s in v.shape]},
            details={"all_reduces": merged, "bytes_saved": None if nbytes is None else (len(merged) - 1) * nbytes},
        )
        if options.for_site(name)["strategy"] == "none":
            row.reason = "strategy 'none': the all-reduces are left as they are"
        else:
            row.collective = _rewrite(group).name
            row.status, row.strategy = "rewritten", "coalesce"
        rows.append(row)
    return rows
