"""Building new nodes with consistent metadata.

Every node a rewrite creates gets ``meta["val"]`` computed by running its op on the fake
values of its inputs, in the graph's own fake mode: shapes, strides and dtypes stay right
for the passes that follow (ours and inductor's). Nodes also inherit the module stack and
stack trace of the node they stand in for, so reports and profiles still point at the
user's code.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
from torch._guards import detect_fake_mode
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx import Graph, GraphModule, Node
from torch.fx.experimental.symbolic_shapes import ShapeEnv
from torch.utils import _pytree as pytree

from overlapc.runtime.dropless import chunk_weights

from . import ops

_INHERITED = ("nn_module_stack", "fwd_nn_module_stack", "stack_trace", "source_fn_stack", "seq_nr", "partitioner_tag")


class Builder:
    """Creates nodes before ``anchor`` (or appends), with meta["val"] and inherited provenance."""

    def __init__(self, graph: Graph, like: Node | None = None):
        self.graph = graph
        self.like = like
        vals = [n.meta.get("val") for n in graph.nodes if isinstance(n.meta.get("val"), torch.Tensor)]
        self.fake_mode = detect_fake_mode(vals) or FakeTensorMode(shape_env=ShapeEnv())
        self.created: list[Node] = []
        self._sym_nodes: dict | None = None

    def call(self, op, *args, **kwargs) -> Node:
        args, kwargs = pytree.tree_map_only(torch.SymInt, self.sym, (args, kwargs))
        # The op runs on fake values before its node exists: an op that refuses its inputs
        # leaves nothing behind that a caller's clean-up (erasing ``created``) would miss.
        val = self._fake_run(op, args, kwargs)
        node = self.graph.call_function(op, tuple(args), kwargs)
        node.meta["val"] = val
        if self.like is not None:
            for k in _INHERITED:
                if k in self.like.meta:
                    node.meta[k] = self.like.meta[k]
        node.meta["overlapc"] = True
        self.created.append(node)
        return node

    def sym(self, x: torch.SymInt):
        """A graph value for a size: the int itself when it is known, else nodes that
        compute it at run time from the graph's size inputs (sym_size of a placeholder, or
        a SymInt placeholder), e.g. ``floordiv(mul(sym_size(x, 0), 64), 3)``."""
        expr = x.node.expr
        if expr.is_number:
            return int(expr)
        if self._sym_nodes is None:
            self._sym_nodes = _size_sources(self.graph)
        memo = self._sym_nodes
        saved = self.like

        def build(e):
            if e.is_Integer:
                return int(e)
            if e in memo:
                return memo[e]
            fn = _SYM_OPS.get(type(e).__name__)
            if e.is_Symbol or fn is None or (e.is_Pow and not (e.exp.is_Integer and e.exp > 0)):
                raise NotImplementedError(f"overlapc: cannot compute the size {e} in the graph")
            if e.is_Pow:
                parts = [build(e.base)] * int(e.exp)
            else:
                parts = [build(a) for a in e.args]
            out = parts[0]
            for p in parts[1:]:
                out = self.call(fn, out, p)
            memo[e] = out
            return out

        self.like = None  # size nodes are shared between sites: no provenance
        try:
            return build(expr)
        finally:
            self.like = saved

    def _fake_run(self, op, args, kwargs) -> Any:
        def to_val(a):
            if isinstance(a, Node):
                v = a.meta.get("val")
                if v is None:
                    raise RuntimeError(f"overlapc: input {a.name} of a new {op} node has no meta['val']")
                return v
            return a

        fargs, fkwargs = pytree.tree_map(to_val, (args, kwargs))
        with self.fake_mode:
            return op(*fargs, **fkwargs)

    # -- short forms for the ops rewrites use
    def getitem(self, node: Node, i: int) -> Node:
        import operator

        return self.call(operator.getitem, node, i)

    def view(self, x: Node, shape) -> Node:
        return self.call(ops.aten.view.default, x, list(shape))

    def erase_created(self) -> None:
        """Erase every node this builder made, users first (a failed rewrite's clean-up)."""
        for n in reversed(self.created):
            self.graph.erase_node(n)
        self.created.clear()
        self._sym_nodes = None  # its size nodes may have been among them

    def reshape(self, x: Node, shape) -> Node:
        return self.call(ops.aten.reshape.default, x, list(shape))

    def slice(self, x: Node, dim: int, start: int, end: int) -> Node:
        return self.call(ops.aten.slice.Tensor, x, dim, start, end)

    def permute(self, x: Node, perm) -> Node:
        return self.call(ops.aten.permute.default, x, list(perm))

    def contiguous(self, x: Node) -> Node:
        return self.call(ops.aten.clone.default, x, memory_format=torch.contiguous_format)

    def cat(self, xs: list[Node], dim: int) -> Node:
        return xs[0] if len(xs) == 1 else self.call(ops.aten.cat.default, list(xs), dim)


_SYM_OPS = {
    "Add": operator.add,
    "Mul": operator.mul,
    "Pow": operator.mul,
    "FloorDiv": operator.floordiv,
    "Mod": operator.mod,
    "PythonMod": operator.mod,
    "Max": torch.sym_max,
    "Min": torch.sym_min,
}


def _size_sources(graph: Graph) -> dict:
    """Size symbol -> a node holding it: a SymInt placeholder, or a new sym_size of the
    first placeholder tensor with that symbol as a dim (inserted after the placeholders)."""
    found: dict = {}
    holders, last = [], None
    for n in graph.nodes:
        if n.op != "placeholder":
            break
        last = n
        v = n.meta.get("val")
        if isinstance(v, torch.SymInt) and v.node.expr.is_Symbol:
            found.setdefault(v.node.expr, n)
        elif isinstance(v, torch.Tensor):
            holders.append((n, v))
    for n, v in holders:
        for d, size in enumerate(v.shape):
            e = size.node.expr if isinstance(size, torch.SymInt) else None
            if e is not None and e.is_Symbol and e not in found:
                with graph.inserting_after(last):
                    node = graph.call_function(ops.aten.sym_size.int, (n, d))
                node.meta["val"] = size
                found[e] = last = node
    return found


def chunk_sizes(n: int, chunks: int, taper: bool = True) -> list[int]:
    """``n`` rows in ``chunks`` positive parts.

    With ``taper`` (3 chunks or more) the first and the last part are half the size of
    the others (weights 1, 2, ..., 2, 1). A pipeline cannot hide its first step (the
    first chunk's transfer before any GEMM, or the first GEMM before any transfer) nor
    its last; halving those halves what stays exposed, without more chunks.
    """
    if chunks < 1 or n < chunks:
        raise ValueError(f"cannot split {n} rows into {chunks} non-empty chunks")
    weights = chunk_weights(chunks) if taper else [1] * chunks
    total = sum(weights)
    if isinstance(n, torch.SymInt):
        # A size known at run time: the same weights, rounded down, the last part takes
        # the remainder. The one guard: every part is non-empty (n >= total).
        if n < total:
            weights, total = [1] * chunks, chunks
        sizes = [n * w // total for w in weights[:-1]]
        return sizes + [n - sum(sizes)]
    sizes = [max(1, n * w // total) for w in weights]
    # Hand out the remainder (or take back an excess) from the middle out.
    order = sorted(range(chunks), key=lambda i: (-weights[i], abs(i - (chunks - 1) / 2)))
    k = 0
    while sum(sizes) != n:
        i = order[k % chunks]
        if sum(sizes) < n:
            sizes[i] += 1
        elif sizes[i] > 1:
            sizes[i] -= 1
        k += 1
    return sizes


def movedim_perm(rank: int, src: int, dst: int) -> list[int]:
    order = [d for d in range(rank) if d != src]
    order.insert(dst, src)
    return order


def copy_graph_module(gm: GraphModule) -> GraphModule:
    """A new GraphModule over a copy of ``gm``'s graph, sharing its submodules, parameters
    and each node's meta values (the fake tensors): a graph to rewrite while ``gm`` stays.
    Graph submodules (higher-order ops' bodies, a checkpointed region's) are copied the same
    way, so that a rewrite or renaming of the copy leaves ``gm``'s own bodies as they are."""
    graph = Graph()
    graph.output(graph.graph_copy(gm.graph, {}))
    new = GraphModule(gm, graph)
    new.meta.update(gm.meta)
    for name, sub in list(new.named_children()):
        if isinstance(sub, GraphModule):
            setattr(new, name, copy_graph_module(sub))
    return new
