"""Expert loops: a dropless MoE's per-expert Python loop, rewritten as grouped matmuls.

Users write a dropless MoE's experts as a loop over the groups of the received rows (as
Megatron's SequentialMLP), the group sizes known only at run time::

    sizes = counts_recv.tolist()                         # rows per (source rank, expert)
    outs = [expert_g(rows) for g, rows in enumerate(recv.split(sizes))]
    out = torch.cat(outs)

After AOTAutograd, forward and backward hold G copies of the expert's graph, each on its own
slice of the rows, with the weight gradients summed per expert: nothing passes/dropless.py
can cut into chunks of rows. This pass runs on Dynamo's graph, before AOTAutograd, and
replaces the G copies with one graph over all the rows, each matmul by per-group weights
becoming ``overlapc::grouped_mm(rows, W, offs[, index])`` (W: the expert bank the weights
are ``W[e_g]`` of, read in place through ``index``; else the weights stacked) (overlapc/runtime/grouped.py:
the same per-group matmuls, and a backward of the same op), ``offs`` the cumulative sizes.
AOTAutograd then derives a backward of grouped matmuls too, and both graphs' all-to-all
pairs become dropless pipelines.

Matched: ``split`` of a 2-D tensor along its rows by run-time sizes that are the elements of
one 1-D tensor (``.tolist()``), a ``cat`` of as many results along the rows, and between
them G copies of one graph (same ops, same constant arguments) made of: matmuls of rows by a
per-group 2-D tensor computed without the rows (``@``, ``mm``, ``matmul``, ``F.linear``
without bias), and pointwise ops of rows with scalars or 1-D tensors shared by every group.
Under autocast (a region in the graph, or entered by the caller) the matmuls' dtypes are the
autocast dtype's; the op's autocast rule casts as ``mm`` did, so the loop must sit in one
region with its ``cat`` (the grouped matmuls are placed before the ``cat``).
Anything else leaves the loop alone, reported with the reason.
"""

from __future__ import annotations

import operator

import networkx as nx
import torch
import torch.nn.functional as F
from torch.fx import GraphModule, Node

from overlapc.report import Site

from . import ops
from .deps import DepGraph

PATTERN = "expert_loop"

_SPLITS_F = {torch.split, torch.functional.split, torch.split_with_sizes}
_SPLITS_M = {"split", "split_with_sizes"}
_CATS = {torch.cat, torch.concat, torch.concatenate}
_MATMULS_F = {operator.matmul, torch.matmul, torch.mm}
_MATMULS_M = {"matmul", "mm", "__matmul__"}
_LINEAR = {F.linear, torch._C._nn.linear}
_POINTWISE_F = {
    operator.mul,
    operator.add,
    operator.sub,
    operator.truediv,
    operator.neg,
    torch.mul,
    torch.add,
    torch.sub,
    torch.div,
    torch.neg,
    torch.sigmoid,
    torch.tanh,
    torch.relu,
    torch.exp,
    F.silu,
    F.gelu,
    F.relu,
    F.sigmoid,
    F.tanh,
}
_POINTWISE_M = {
    "mul",
    "add",
    "sub",
    "div",
    "neg",
    "sigmoid",
    "tanh",
    "relu",
    "exp",
    "float",
    "half",
    "bfloat16",
    "to",
    "type_as",
    "__mul__",
    "__add__",
    "__sub__",
    "__truediv__",
}


class NotALoop(Exception):
    """The split ... cat is not a loop of one expert graph over row groups; says why."""


def _is(n: Node, funcs=(), methods=()) -> bool:
    return (n.op == "call_function" and n.target in funcs) or (n.op == "call_method" and n.target in methods)


def _arg(n: Node, i: int, name: str, default=None):
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def _val(n):
    return n.meta.get("example_value") if isinstance(n, Node) else None


def group_expert_loops(gm: GraphModule, options=None, graph_kind: str = "forward") -> list[Site]:
    """Rewrite every expert loop of ``gm`` (Dynamo's graph) in place; one report Site per
    ``split`` ... ``cat`` considered: rewritten, skipped with the reason, or found (left as
    it is: strategy "none" for its name, e.g. ``overrides={"*expert_loop*": {"strategy":
    "none"}}``)."""
    sites, deps = [], None
    for cat in [n for n in gm.graph.nodes if _is(n, _CATS)]:
        if deps is not None and cat not in deps.g:
            continue  # erased: it was inside a loop rewritten before
        outs = _arg(cat, 0, "tensors")
        if not isinstance(outs, (list, tuple)) or len(outs) < 2 or _arg(cat, 1, "dim", 0) != 0:
            continue
        deps = deps or DepGraph(gm.graph)
        split = _split_of(gm.graph, outs, deps)
        if split is None:
            continue
        name = f"{graph_kind}:{ops.module_path(cat) or ''}:{PATTERN}"
        name += f"#{sum(s.name.startswith(name) for s in sites)}" if any(s.name == name for s in sites) else ""
        site = Site(
            name=name,
            pattern=PATTERN,
            graph=graph_kind,
            status="skipped",
            collective=split.name,
            details={"groups": len(outs)},
        )
        if options is not None and options.for_site(name)["strategy"] == "none":
            site.status = "found"
            sites.append(site)
            continue
        try:
            site.matmuls = _rewrite(gm, split, cat, deps)
            site.status = "rewritten"
            deps.refresh()
        except NotALoop as e:
            site.reason = str(e)
        sites.append(site)
    if any(s.status == "rewritten" for s in sites):
        gm.graph.lint()
        gm.recompile()
    return sites


def _split_of(graph, outs, deps: DepGraph) -> Node | None:
    """The split whose piece g the cat's input g is computed from, for every g (a loop over
    the pieces), or None."""
    if not all(isinstance(o, Node) for o in outs):
        return None
    ancestors = [deps.ancestors(o) | {o} for o in outs]
    for n in reversed(graph.nodes):  # the nearest such split (graph order: the same on every rank)
        if n not in ancestors[0] or not _is(n, _SPLITS_F, _SPLITS_M):
            continue
        pieces = {u.args[1]: u for u in n.users if u.op == "call_function" and u.target is operator.getitem}
        if all(pieces.get(g) in anc for g, anc in enumerate(ancestors)):
            return n
    return None


def _rewrite(gm: GraphModule, split: Node, cat: Node, deps: DepGraph) -> list[str]:
    outs = list(_arg(cat, 0, "tensors"))
    g_count = len(outs)
    rows = split.args[0]
    sizes = next(
        (
            x
            for x in (_arg(split, 1, k) for k in ("split_size_or_sections", "split_size", "split_sizes"))
            if x is not None
        ),
        None,
    )
    dim = _arg(split, 2, "dim", 0)
    rv = _val(rows)
    if dim not in (0, -rv.dim() if rv is not None else 0) or rv is None or rv.dim() != 2:
        raise NotALoop(f"{split.name} does not cut a 2-D tensor along its rows")
    if not isinstance(sizes, (list, tuple)) or len(sizes) != g_count:
        raise NotALoop(f"{split.name} cuts {rows.name} into other pieces than the {g_count} that {cat.name} joins")
    counts = _sizes_tensor(sizes)
    pieces: dict[Node, int] = {}
    for u in split.users:
        if u.op == "call_function" and u.target is operator.getitem and isinstance(u.args[1], int):
            pieces[u] = u.args[1]
        else:
            raise NotALoop(f"{split.name} is read by {u.name}, not only by picking its pieces")
    under = nx.descendants(deps.g, split)
    regions = _autocast_regions(gm.graph)

    template: dict[tuple, tuple[str, object]] = {}  # tuple of per-group nodes -> (kind, how)
    order: list[tuple] = []
    matmuls: list[str] = []

    def match(nodes: tuple) -> str:
        first = nodes[0]
        if not all(isinstance(x, Node) for x in nodes):
            if any(isinstance(x, Node) for x in nodes) or any(x != first for x in nodes):
                raise NotALoop(f"the groups' graphs differ in an argument ({first!r} vs {nodes[-1]!r})")
            return "value"  # a constant (lists included), used as it is
        if nodes in template:
            return template[nodes][0]
        if all(x is first for x in nodes):
            if first in under:
                raise NotALoop(f"{first.name}, computed from the rows of every group, is read by each group")
            v = _val(first)
            if v is None:
                raise NotALoop(f"every group reads {first.name}, whose value the graph does not record")
            if isinstance(v, torch.Tensor) and v.dim() >= 2:
                raise NotALoop(
                    f"every group reads the same {v.dim()}-D tensor {first.name}; a shared "
                    "tensor can only be a scalar or a vector broadcast along the rows"
                )
            template[nodes] = ("shared", first)
            return "shared"
        if all(x in pieces for x in nodes):
            if [pieces[x] for x in nodes] != list(range(g_count)):
                raise NotALoop(f"the groups are not {split.name}'s pieces in order")
            template[nodes] = ("rows", None)
            return "rows"
        inside = [x in under for x in nodes]
        if not any(inside):
            vals = [_val(x) for x in nodes]
            if (
                not all(isinstance(v, torch.Tensor) and v.dim() == 2 for v in vals)
                or len({(tuple(v.shape), v.dtype) for v in vals}) != 1
                or not all(isinstance(s, int) for s in vals[0].shape)
            ):
                raise NotALoop(f"the per-group operands {nodes[0].name}, ... are not 2-D tensors of one static shape")
            template[nodes] = ("stacked", _bank(nodes))
            order.append(nodes)
            return "stacked"
        if not all(inside):
            raise NotALoop(
                f"{nodes[inside.index(False)].name} and {nodes[inside.index(True)].name} play one role "
                "in two groups, but only one is computed from the group's rows"
            )
        if (
            len({(x.op, x.target) for x in nodes}) != 1
            or len({len(x.args) for x in nodes}) != 1
            or len({tuple(sorted(x.kwargs)) for x in nodes}) != 1
        ):
            raise NotALoop(f"the groups' graphs differ at {first.name} ({first.target})")
        args = [match(tuple(x.args[i] for x in nodes)) for i in range(len(first.args))]
        kw = {k: match(tuple(x.kwargs[k] for x in nodes)) for k in first.kwargs}
        kinds = [*args, *kw.values()]
        what = getattr(first.target, "__name__", first.target)
        if _is(first, _MATMULS_F, _MATMULS_M) or _is(first, _LINEAR):
            linear = _is(first, _LINEAR)
            if linear and (len(first.args) > 2 or first.kwargs.get("bias") is not None):
                raise NotALoop(f"{first.name}: a linear layer with a bias per group")
            if len(first.args) != 2 or first.kwargs or args != ["rows", "stacked"]:
                raise NotALoop(f"{first.name}: a matmul that is not the group's rows by a per-group weight")
            dts = {getattr(_val(x), "dtype", None) for x in (first, *first.args)}
            if None in dts or len(dts) != 1 and regions.get(first) is None and not _ambient_autocast():
                raise NotALoop(
                    f"{first.name}: the matmul's result and operands have dtypes {sorted(map(str, dts))} "
                    "outside an autocast region"
                )
            template[nodes] = ("rows", "linear" if linear else "matmul")
            matmuls.append(first.name)
        elif _is(first, _POINTWISE_F, _POINTWISE_M):
            if "rows" not in kinds or "stacked" in kinds:
                raise NotALoop(f"{first.name} ({what}) mixes the rows with per-group tensors")
            template[nodes] = ("rows", "pointwise")
        else:
            raise NotALoop(f"{first.name} ({what}) is not a matmul by a per-group weight or a pointwise op")
        order.append(nodes)
        return "rows"

    for _g, o in enumerate(outs):
        if not isinstance(o, Node):
            raise NotALoop(f"{cat.name} joins a non-tensor")
    if match(tuple(outs)) != "rows":
        raise NotALoop(f"what {cat.name} joins is not computed from the groups' rows")
    if not matmuls:
        raise NotALoop("no matmul by a per-group weight between the split and the cat")
    per_group = {x for key, (kind, _) in template.items() if kind == "rows" for x in key if isinstance(x, Node)}
    if len({regions.get(x) for x in per_group | {cat}}) != 1:
        raise NotALoop(
            f"the loop and {cat.name} are not in one autocast region (the grouped matmuls would run "
            "under another autocast state than the loop's)"
        )
    for x in per_group | set(pieces):
        for u in x.users:
            if u not in per_group and u is not cat:
                raise NotALoop(f"{x.name} (one group's) is also read by {u.name}, outside the loop")

    graph = gm.graph
    new: dict[tuple, Node] = {}

    def get(nodes: tuple):
        if not isinstance(nodes[0], Node):
            return nodes[0]
        kind, how = template[nodes]
        if kind == "shared":
            return how
        if kind == "rows" and how is None:
            return rows
        return new[nodes]

    with graph.inserting_before(cat):
        offs = graph.call_function(torch.cumsum, (counts, 0))
        for nodes in order:
            kind, how = template[nodes]
            first = nodes[0]
            if kind == "stacked":  # an expert bank read per group, or a stacked copy
                new[nodes] = how[0] if how else graph.call_function(torch.stack, ([*nodes],))
                continue
            args = tuple(get(tuple(x.args[i] for x in nodes)) for i in range(len(first.args)))
            kwargs = {k: get(tuple(x.kwargs[k] for x in nodes)) for k in first.kwargs}
            if how in ("matmul", "linear"):
                w = args[1]
                if how == "linear":
                    w = graph.call_method("transpose", (w, -2, -1))
                bank = template[tuple(x.args[1] for x in nodes)][1]
                extra = (bank[1],) if bank else ()
                new[nodes] = graph.call_function(ops.LOOP_GROUPED_MM, (args[0], w, offs, *extra))
            elif first.op == "call_method":
                new[nodes] = graph.call_method(first.target, args, kwargs)
            else:
                new[nodes] = graph.call_function(first.target, args, kwargs)
    result = new[tuple(outs)]
    result.meta.update({k: v for k, v in cat.meta.items() if k in ("example_value", "nn_module_stack", "stack_trace")})
    cat.replace_all_uses_with(result)
    graph.erase_node(cat)
    pos = {n: i for i, n in enumerate(graph.nodes)}
    for x in sorted(per_group | set(pieces), key=pos.get, reverse=True):
        graph.erase_node(x)
    graph.erase_node(split)
    return matmuls


def _autocast_regions(graph) -> dict[Node, Node]:
    """Node -> the ``_enter_autocast`` of the innermost autocast region it is in (Dynamo
    records ``with torch.autocast(...)`` as a pair of calls around the region's nodes)."""
    regions, stack = {}, []
    for n in graph.nodes:
        if n.op == "call_function" and n.target is torch.amp.autocast_mode._exit_autocast:
            if n.args and n.args[0] in stack:
                stack = stack[: stack.index(n.args[0])]
            continue
        if stack:
            regions[n] = stack[-1]
        if n.op == "call_function" and n.target is torch.amp.autocast_mode._enter_autocast:
            stack.append(n)
    return regions


def _ambient_autocast() -> bool:
    """Autocast entered outside the compiled function: Dynamo's graph records no region, and
    AOTAutograd traces (and the graph runs) under the caller's state, which guards check."""
    return any(torch.is_autocast_enabled(d) for d in ("cpu", "cuda"))


def _bank(nodes: tuple) -> tuple[Node, list[int]] | None:
    """(W, [i_0, ...]) if the per-group weights are ``W[i_g]`` of one 3-D tensor W (an expert
    bank, e.g. a stacked parameter): the grouped matmul indexes it instead of stacking copies."""
    bank, index = None, []
    for x in nodes:
        if not (
            x.op == "call_function"
            and x.target is operator.getitem
            and isinstance(x.args[0], Node)
            and isinstance(x.args[1], int)
        ):
            return None
        if bank is None:
            bank = x.args[0]
        elif x.args[0] is not bank:
            return None
        index.append(x.args[1])
    v = _val(bank)
    if not isinstance(v, torch.Tensor) or v.dim() != 3 or not isinstance(v.shape[0], int):
        return None
    return bank, [i % v.shape[0] for i in index]


def _sizes_tensor(sizes) -> Node:
    """The 1-D tensor whose elements (``.tolist()``) the split sizes are."""
    src = None
    for i, s in enumerate(sizes):
        if not (
            isinstance(s, Node)
            and _is(s, methods={"item"})
            and isinstance(s.args[0], Node)
            and s.args[0].op == "call_function"
            and s.args[0].target is operator.getitem
            and s.args[0].args[1] == i
        ):
            raise NotALoop(
                "the split sizes are not the elements of one tensor read at run time "
                "(.tolist()); a loop over sizes known at compile time is not grouped"
            )
        t = s.args[0].args[0]
        if src is None:
            src = t
        elif t is not src:
            raise NotALoop(f"the split sizes come from two tensors ({src.name}, {t.name})")
    v = _val(src)
    if v is None or v.dim() != 1 or v.shape[0] != len(sizes):
        raise NotALoop(f"the split sizes are elements of {src.name}, which is not a 1-D tensor of {len(sizes)}")
    return src
