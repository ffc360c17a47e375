"""Dropless all-to-all sites: uneven, run-time splits, pipelined by a run-time op.

Found (forward of a dropless MoE layer; the backward has the same shape, with the weight
gradients as sums over rows)::

    recv = wait(all_to_all(xs, out_s, in_s))            # dispatch: splits are SymInts
    h    = silu(grouped_mm(recv, W1, offs)) * grouped_mm(recv, W3, offs)
    out  = grouped_mm(h, W2, offs)                      # the *body*: row by row
    back = wait(all_to_all(out, in_s, out_s))           # combine: the same splits, swapped

Chunk boundaries depend on the split sizes, which exist only at run time, so the axis
regions of passes/axis.py (static chunks) cannot be used. Instead the dispatch, the body
and the combine become one call of :class:`overlapc.runtime.dropless.DroplessPipeline`,
which cuts every peer's block into chunks when the sizes are known and runs the body per
chunk (see that module). The body must be row-wise: each op is pointwise, a matmul of the
rows by a weight (``mm``, ``_grouped_mm`` with the body's ``offs``), a transpose feeding a
reduction, or a reduction over rows (``mm(t(a), b)``, ``_grouped_mm(t(a), b, offs)``:
weight gradients). The reductions (with their transposes) are the pipeline's *tail*: they
run once, whole, on their row operands reassembled from the chunks, after the last
combine chunk has been issued -- under that chunk's transfer, at the GEMM efficiency of
all the rows, in the model's own dtype and order (no per-chunk partial sums). Anything
else that reads the body's tensors is outside the pipeline and gets them whole, after it
(activations the backward saves).
"""

from __future__ import annotations

import math
import operator
import weakref
from dataclasses import dataclass, field

import sympy
import torch
from torch.fx import Graph, GraphModule, Node

from overlapc.runtime.dropless import DroplessPipeline, register

from . import ops
from .deps import DepGraph

aten = torch.ops.aten
GROUPED_MM = ops.GROUPED_MM
LOOP_GROUPED_MM = ops.LOOP_GROUPED_MM
GROUPED = tuple(t for t in (GROUPED_MM, LOOP_GROUPED_MM) if t is not None)
"""Grouped matmuls with offsets: torch's, and overlapc's (an expert loop, passes/expert_loop.py)."""
GEMMS = frozenset({aten.mm.default, *GROUPED})
"""The GEMMs a body may hold."""
TRANSPOSES = {aten.t.default, aten.transpose.int}

PIPELINE = "overlapc_dropless"
"""node.meta key on a dispatch all-to-all: its analysed :class:`Pipeline` (or the reason it has none)."""


class NotPipelined(Exception):
    """The all-to-all pair cannot be pipelined; the message says why."""


@dataclass(eq=False)
class Pipeline:
    dispatch: Node
    dispatch_wait: Node
    combine: Node
    combine_wait: Node
    nodes: list[Node]
    """The body, in graph order (without the dispatch wait)."""
    kinds: dict
    """node -> "row" | "rowT" | "reduced" for the dispatch wait and every body node."""
    row_inputs: list[Node]
    consts: list[Node]
    offs: Node | None
    row_outputs: list[Node]
    reduced_outputs: list[Node]
    moved: list[Node]
    """Nodes between the dispatch and the combine that read body results: they run after the pipeline."""
    tail_consts: list[Node] = field(default_factory=list)
    """Inputs of the tail from outside the body (used whole; e.g. saved activations, transposed)."""


def _same_splits(a, b) -> bool:
    if a is None or b is None or len(a) != len(b):
        return False
    return all(x is y or (isinstance(x, int) and isinstance(y, int) and x == y) for x, y in zip(a, b))


def find_pipeline(coll: Node, deps: DepGraph) -> Pipeline:
    """The pipeline ``coll`` is the dispatch or the combine of; raises NotPipelined."""
    cached = coll.meta.get(PIPELINE)
    if isinstance(cached, Pipeline):
        return cached
    try:
        p = _analyse(coll, deps)
    except NotPipelined as as_dispatch:
        # Perhaps coll is a combine: find the dispatch whose splits it swaps.
        why = as_dispatch
        for d in coll.graph.nodes:
            if d is coll:
                break
            if (
                d.target is ops.ALL_TO_ALL
                and _same_splits(d.args[1], coll.args[2])
                and _same_splits(d.args[2], coll.args[1])
                and d.args[3] == coll.args[3]
            ):
                try:
                    p = _analyse(d, deps)
                except NotPipelined as e:
                    why = e  # the pair exists; what is between them is the problem
                    continue
                if p.combine is coll:
                    return p
        raise why from None
    return p


def _analyse(d: Node, deps: DepGraph) -> Pipeline:
    w = ops.wait_of(d)
    if w is None:
        raise NotPipelined("the all-to-all is not completed by a single wait_tensor")
    out_s, in_s = d.args[1], d.args[2]
    if out_s is None or in_s is None:
        raise NotPipelined("even splits (handled by the static chunking)")
    nodes = list(d.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    combine = None
    for n in nodes[pos[w] + 1 :]:
        if (
            n.target is ops.ALL_TO_ALL
            and _same_splits(n.args[1], in_s)
            and _same_splits(n.args[2], out_s)
            and n.args[3] == d.args[3]
            and isinstance(n.args[0], Node)
            and deps.depends(n.args[0], w)
        ):
            combine = n
            break
    if combine is None:
        raise NotPipelined(
            "no all-to-all after it sends the rows back with the same splits swapped (a dispatch without its combine)"
        )
    cw = ops.wait_of(combine)
    if cw is None:
        raise NotPipelined("the combining all-to-all is not completed by a single wait_tensor")

    kinds: dict[Node, str] = {w: "row"}
    body: list[Node] = []
    refused: dict[Node, str] = {}
    for n in nodes[pos[w] + 1 : pos[combine]]:
        if not any(a in kinds for a in n.all_input_nodes):
            continue
        kind, why = _classify(n, kinds)
        if kind is None:
            refused[n] = why
            continue
        kinds[n] = kind
        body.append(n)
    target = combine.args[0]
    if kinds.get(target) != "row":
        path = [n for n in refused if n is target or deps.depends(target, n)]
        culprit = f"{path[0].name} ({refused[path[0]]})" if path else target.name
        raise NotPipelined(f"what the combine sends is not computed row by row from the dispatched rows: {culprit}")

    # Inputs from outside the body: row-aligned (indexed per chunk) or whole (weights).
    roles: dict[Node, str] = {}
    offs = None
    for n in body:
        for a, role in _input_roles(n, kinds):
            if role == "offs":
                if offs is not None and a is not offs:
                    raise NotPipelined(f"the grouped matmuls use different offsets ({offs.name}, {a.name})")
                offs = a
                continue
            if role == "symbol":
                raise NotPipelined(f"{n.name} uses the run-time size {a.name}, which changes per chunk")
            if roles.setdefault(a, role) != role:
                raise NotPipelined(f"{a.name} is read both row by row and whole")
    for a in [*roles, *([offs] if offs is not None else [])]:
        if deps.depends(a, w):
            raise NotPipelined(
                f"{a.name} feeds the body but is not computed row by row from the dispatched rows: "
                "no chunk could start before all of them have arrived"
            )

    # Weight gradients that read the body's rows with an operand from outside it (the saved
    # activation, transposed), between the all-to-alls or after the combine: the pipeline's
    # tail (run whole under the last combine chunks instead of after the pipeline).
    tail_consts: list[Node] = []
    for n in nodes[pos[w] + 1 :]:
        if n in kinds or n is combine:
            continue
        outside = _tail_gemm(n, kinds, pos, pos[d])
        if outside is None:
            continue
        kinds[n] = "reduced"
        body.append(n)
        tail_consts += [a for a in outside if a is not offs and roles.get(a) != "row" and a not in tail_consts]
    body.sort(key=pos.get)

    inside = set(body) | {w}
    row_outputs, reduced_outputs = [], []
    for n in [w, *body]:
        outside = [u for u in n.users if u not in inside and not (u is combine and n is target)]
        if n is w and len(d.users) > 1:  # sizes of the dispatch's result queried: answered by the wait's
            outside.append(d)
        if not outside:
            continue
        if kinds[n] == "rowT":
            raise NotPipelined(f"the transpose {n.name} is read outside the body")
        (row_outputs if kinds[n] == "row" else reduced_outputs).append(n)
    moved = [n for n in nodes[pos[w] + 1 : pos[combine]] if n not in inside and deps.depends(n, w)]
    return Pipeline(
        d,
        w,
        combine,
        cw,
        body,
        kinds,
        [a for a, r in roles.items() if r == "row"],
        [a for a, r in roles.items() if r == "const"],
        offs,
        row_outputs,
        reduced_outputs,
        moved,
        tail_consts,
    )


def _tail_gemm(n: Node, kinds: dict, pos: dict, before: int) -> list[Node] | None:
    """If ``n`` can run in the tail, its inputs from outside the body, else None: a matmul
    reading the body's rows whose other inputs exist before position ``before`` (the
    dispatch) and whose result has no run-time size (a weight gradient)."""
    if n.op != "call_function" or n.target not in GEMMS:
        return None
    v = ops.val(n)
    if (
        v is None
        or not all(isinstance(x, int) for x in v.shape)
        or not any(kinds.get(a) in ("row", "rowT") for a in n.all_input_nodes)
    ):
        return None
    outside = [a for a in n.all_input_nodes if a not in kinds]
    return outside if all(pos[a] < before or _hoistable(a, pos, before) for a in outside) else None


def _hoistable(a: Node, pos: dict, before: int) -> bool:
    """A transpose made after position ``before`` (the dispatch) of a tensor made before it:
    free to move up (eager backward graphs transpose a saved activation for its weight
    gradient only where that gradient is computed, after the all-to-alls)."""
    return a.op == "call_function" and a.target in TRANSPOSES and all(pos[x] < before for x in a.all_input_nodes)


def _same_dim0(a: Node, b: Node) -> bool:
    va, vb = ops.val(a), ops.val(b)
    if va is None or vb is None or va.dim() == 0 or vb.dim() == 0:
        return False
    x, y = va.shape[0], vb.shape[0]
    if isinstance(x, torch.SymInt) or isinstance(y, torch.SymInt):
        ex = x.node.expr if isinstance(x, torch.SymInt) else x
        ey = y.node.expr if isinstance(y, torch.SymInt) else y
        return ex == ey
    return x == y


def _classify(n: Node, kinds: dict) -> tuple[str | None, str]:
    if n.op != "call_function":
        return None, "not an op"
    t = n.target
    tensor_ins = [a for a in n.all_input_nodes if ops.val(a) is not None]
    if ops.is_pointwise(n):
        out = ops.val(n)
        if out is None or out.dim() == 0:
            return None, "pointwise op without a tensor result"
        for a in tensor_ins:
            if a in kinds and (kinds[a] != "row" or not _same_dim0(a, n) or ops.val(a).dim() != out.dim()):
                return None, f"mixes rows with {a.name} ({kinds[a]})"
        return "row", ""
    if t in TRANSPOSES:
        a = n.args[0]
        dims = sorted(d % 2 for d in n.args[1:3]) if t is aten.transpose.int else [0, 1]
        if kinds.get(a) == "row" and ops.val(a).dim() == 2 and dims == [0, 1]:
            return "rowT", ""
        return None, "transpose of something other than a 2-D row tensor"
    if t in GEMMS:
        a, b = n.args[0], n.args[1]
        ka, kb = kinds.get(a), kinds.get(b)
        if t in GROUPED:
            if ops.arg(n, "bias") is not None:
                return None, "grouped matmul with a bias"
            if ops.arg(n, "offs") in kinds:
                return None, "grouped matmul offsets computed from the rows"
            if ka == "row" and kb is None and ops.val(b) is not None and ops.val(b).dim() == 3:
                return "row", ""
        elif ka == "row" and kb is None:
            return "row", ""
        if ka == "rowT" and kb == "row":
            return "reduced", ""
        return None, f"{t.__name__} with operands ({ka or 'outside'}, {kb or 'outside'})"
    return None, f"{getattr(t, '__name__', t)} is not row-wise"


def _input_roles(n: Node, kinds: dict):
    """(input, "row" | "const" | "offs" | "symbol") for the inputs of body node n from outside it."""
    out = ops.val(n)
    offs = ops.arg(n, "offs") if n.target in GROUPED else None
    for a in n.all_input_nodes:
        if a in kinds:
            continue
        if a is offs:
            yield a, "offs"
        elif ops.val(a) is None:
            yield a, "symbol"
        elif n.target in GEMMS:
            yield a, "const"
        else:  # pointwise: an operand of the output's full shape is read row by row
            va = ops.val(a)
            one = isinstance(va.shape[0], int) and va.shape[0] == 1  # broadcast along the rows
            yield a, ("row" if va.dim() == out.dim() and _same_dim0(a, n) and not one else "const")


def pipeline_matmuls(p: Pipeline) -> list[Node]:
    """The body's GEMMs (``mm``, ``_grouped_mm``), in graph order."""
    return [n for n in p.nodes if n.target in GEMMS]


_BALANCED_ROWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""ShapeEnv -> {sum of a dispatch's run-time send splits: the rows it sends}. A forward
pipeline sends a number of rows (T * top_k) cut by run-time splits; the backward's pipeline
sends the gradient of what the forward's combine returned, whose rows are those same
splits' sum, symbolic there but always the forward's number. (What each rank receives is
priced at balanced routing either way.)"""


def note_rows(p: Pipeline) -> None:
    """Remember what the sum of ``p``'s send splits is, where its rows are a number."""
    xs = ops.val(p.dispatch.args[0])
    splits = p.dispatch.args[2] if len(p.dispatch.args) > 2 else None
    if xs is None or xs.dim() == 0 or not isinstance(splits, (list, tuple)):
        return
    rows = ops.hint(xs.shape[0])
    syms = [s.meta.get("val") if isinstance(s, Node) else s for s in splits]
    if rows is None or not syms or not all(isinstance(v, torch.SymInt) for v in syms):
        return
    env = syms[0].node.shape_env
    _BALANCED_ROWS.setdefault(env, {})[sympy.Add(*(v.node.expr for v in syms))] = rows


def rows_at_balance(size) -> int | None:
    """A pipeline's rows sent: the number, or a sum of run-time splits that :func:`note_rows`
    saw a forward pipeline send as a number."""
    h = ops.hint(size)
    if h is not None or not isinstance(size, torch.SymInt):
        return h
    return _BALANCED_ROWS.get(size.node.shape_env, {}).get(size.node.expr)


def sent_bytes(p: Pipeline) -> int | None:
    """Bytes the pipeline's dispatch sends from this rank (rows by :func:`rows_at_balance`);
    None where a size is not known."""
    xs = ops.val(p.dispatch.args[0])
    if xs is None or xs.dim() == 0:
        return None
    rows, rest = rows_at_balance(xs.shape[0]), [ops.hint(d) for d in xs.shape[1:]]
    if rows is None or None in rest:
        return None
    return rows * math.prod(rest) * xs.element_size()


def pipeline_stages(p: Pipeline):
    """The cost model's view of a dropless pipeline, as passes/all_to_all.region_stages gives
    a region's: ([dispatch all-to-all, the body's GEMMs, combine all-to-all], bytes the
    run-time op copies, 0 (no partial sums: the weight gradients run whole), dtype), priced as if
    routing were balanced (every rank receives as many rows as it sends: the split sizes
    exist only at run time); None where a size is not a number.

    GEMMs: each matmul of the body over the received rows R (``mm``; ``_grouped_mm``: one
    call whose groups have R / groups rows each, the rows term's M); the weight gradients
    (``mm(t(a), b)``, the tail) run whole after the last chunk (the compute stage's
    ``after``, M = a's columns). Copies: the send buffer cut into per-chunk blocks, the
    combined rows put back in place, each row input gathered and each row output (and row
    tensor the tail reads) assembled by chunk."""
    from .cost import Stage

    def num(*dims) -> int:
        out = 1
        for d in dims:
            h = ops.hint(d)
            if h is None:
                raise NotPipelined("a run-time size")
            out *= h
        return out

    xs, back = ops.val(p.dispatch.args[0]), ops.val(p.combine.args[0])
    if xs is None or back is None or xs.dim() == 0:
        return None
    try:
        rows, sent = rows_at_balance(xs.shape[0]), sent_bytes(p)
        if rows is None or sent is None:
            raise NotPipelined("a run-time size")
        returned = rows * num(*back.shape[1:]) * back.element_size()
        flops, per_call_rows, late, late_calls, late_fm = 0, rows, 0, 0, 0.0
        matmuls = pipeline_matmuls(p)
        for n in matmuls:
            a, b = ops.val(n.args[0]), ops.val(n.args[1])
            if p.kinds[n] == "row":  # (R, K) x (K, N) or grouped (R, K) x (G, K, N)
                flops += 2 * rows * num(a.shape[-1]) * num(b.shape[-1])
                index = ops.arg(n, "index") if n.target is LOOP_GROUPED_MM else None
                groups = len(index) if index else num(b.shape[0]) if n.target in GROUPED else 1
                per_call_rows = min(per_call_rows, max(1, rows // groups))
            else:  # weight gradient, whole after the chunks: (K, R) x (R, N)
                f = 2 * rows * num(a.shape[0]) * num(b.shape[-1])
                late, late_calls, late_fm = late + f, late_calls + 1, late_fm + f / num(a.shape[0])
        copied = sent + returned
        extra, _ = _tail_sources(p)
        for n in [*p.row_inputs, *p.row_outputs, *extra]:
            v = ops.val(n)
            copied += rows * num(*v.shape[1:]) * v.element_size()
    except NotPipelined:
        return None
    body_calls = len(matmuls) - late_calls
    stages = [
        Stage("comm", "all_to_all", sent),
        Stage(
            "compute",
            "gemm",
            flops,
            max(body_calls, 1),
            per_call_rows,
            True,
            late,
            late_calls,
            round(late / late_fm) if late_fm else None,
        ),
        Stage("comm", "all_to_all", returned),
    ]
    return stages, copied, 0, ops.dtype_name(xs)


def can_pipeline(site, deps: DepGraph) -> str | None:
    """None (and ``site.pipeline`` set) if the site's all-to-all pair can be pipelined, else why not."""
    try:
        p = find_pipeline(site.coll, deps)
    except NotPipelined as e:
        return f"uneven or run-time split sizes: {e}"
    p.dispatch.meta[PIPELINE] = p
    site.pipeline = p
    note_rows(p)
    site.details["pipeline"] = {
        "dispatch": p.dispatch.name,
        "combine": p.combine.name,
        "body_ops": len(p.nodes),
        "row_inputs": len(p.row_inputs),
        "reduced_outputs": len(p.reduced_outputs),
    }
    return None


def rewrite(site, chunks: int, site_of) -> None:
    """Replace dispatch, body and combine by one DroplessPipeline call (chunked at run time)."""
    p: Pipeline = site.pipeline
    graph = p.combine.graph
    results = [p.combine_wait, *p.row_outputs, *p.reduced_outputs]
    shapes = []
    for i, n in enumerate(results):
        v = ops.val(n)
        rows = "sent" if i == 0 else "received" if n in p.row_outputs else None
        tail = list(v.shape[1:]) if rows else list(v.shape)
        if any(isinstance(d, torch.SymInt) for d in tail):
            site.skip(f"{n.name} has a run-time size besides its rows: {list(v.shape)}")
            return False
        shapes.append((rows, tail, v.dtype))
    runner = DroplessPipeline(
        body=_body(p),
        group_name=ops.group_name(p.dispatch),
        chunks=chunks,
        n_row_inputs=len(p.row_inputs),
        n_row_outputs=len(p.row_outputs),
        tail=_tail(p),
        tail_sources=_tail_sources(p)[1],
        n_tail_consts=len(p.tail_consts),
        site=site.name,
        out_shapes=shapes,
    )
    out_s, in_s = p.dispatch.args[1], p.dispatch.args[2]
    order = {n: i for i, n in enumerate(graph.nodes)}
    for a in p.tail_consts:  # transposes hoisted by _tail_gemm: made before the call that reads them
        if order[a] > order[p.combine]:
            p.combine.prepend(a)
    with graph.inserting_before(p.combine):
        call = graph.call_function(
            torch.ops.overlapc.dropless_pipeline.default,
            (
                register(runner),
                p.dispatch.args[0],
                list(in_s),
                list(out_s),
                p.offs,
                list(p.row_inputs),
                [*p.consts, *p.tail_consts],
            ),
        )
        call.meta["val"] = [n.meta.get("val") for n in results]
        call.meta["overlapc"] = True
        for k in ("nn_module_stack", "stack_trace"):
            if k in p.combine.meta:
                call.meta[k] = p.combine.meta[k]
        items = []
        for i, n in enumerate(results):
            g = graph.call_function(operator.getitem, (call, i))
            g.meta["val"] = n.meta.get("val")
            items.append(g)
    anchor = items[-1]
    for n in p.moved:
        anchor.append(n)
        anchor = n
    for n, g in zip(results, items):
        n.replace_all_uses_with(g)
    # Size queries (sym_size) on the collectives themselves: the same shapes as their waits'.
    for coll, wait in ((p.combine, p.combine_wait), (p.dispatch, p.dispatch_wait)):
        for u in list(coll.users):
            if u is not wait:
                u.replace_input_with(coll, items[results.index(wait)])
    for n in [p.combine_wait, p.combine, *reversed(p.nodes), p.dispatch_wait, p.dispatch]:
        if not n.users:
            graph.erase_node(n)
        else:
            raise RuntimeError(f"overlapc: dropless rewrite left {n.name} with users {list(n.users)}")
    other = site_of(p.combine if site.coll is p.dispatch else p.dispatch)
    for s in other:
        if s is not site:
            s.status, s.strategy, s.chunks = "rewritten", "decompose", chunks
            s.details.update(chained_from=site.name, rows="at run time")
    site.details["chunking"] = "at run time: every peer's block in chunks weighted 1,2,..,2,1"
    site.details["rows"] = "at run time"  # row counts may differ across ranks (overlapc/agree.py)


def _tail_nodes(p: Pipeline) -> list[Node]:
    """The reductions over rows and the transposes feeding them (only they read a transpose)."""
    return [n for n in p.nodes if p.kinds[n] in ("reduced", "rowT")]


def _tail_rows(p: Pipeline) -> list[Node]:
    """The row tensors the tail reads (the sources of its transposes, its right operands),
    in order of first use."""
    nodes = _tail_nodes(p)
    tail = set(nodes)
    out: list[Node] = []
    for n in nodes:
        for a in n.all_input_nodes:
            if a not in tail and (p.kinds.get(a) == "row" or a in p.row_inputs) and a not in out:
                out.append(a)
    return out


def _tail_sources(p: Pipeline) -> tuple[list[Node], list[tuple[str, int]]]:
    """(the tail rows the body must return, where each tail row comes from): ("input", j) a
    row input, passed whole; ("row_output", i) a row output, assembled anyway; ("body", k)
    the k-th extra body output, assembled for the tail."""
    extra, sources = [], []
    for r in _tail_rows(p):
        if r in p.row_inputs:
            sources.append(("input", p.row_inputs.index(r)))
        elif r in p.row_outputs:
            sources.append(("row_output", p.row_outputs.index(r)))
        else:
            sources.append(("body", len(extra)))
            extra.append(r)
    return extra, sources


def _body(p: Pipeline) -> GraphModule:
    """The per-chunk graph: (recv, offs, *row_inputs, *consts) -> (combine input, *row
    outputs, *the tail rows it computes)."""
    g = Graph()
    env: dict[Node, Node] = {p.dispatch_wait: g.placeholder("recv")}
    offs = g.placeholder("offs")
    if p.offs is not None:
        env[p.offs] = offs
    for i, n in enumerate(p.row_inputs):
        env[n] = g.placeholder(f"row_{i}")
    for i, n in enumerate(p.consts):
        env[n] = g.placeholder(f"const_{i}")
    tail = set(_tail_nodes(p))
    for n in p.nodes:
        if n not in tail:
            env[n] = g.node_copy(n, lambda a: env[a])
    extra, _ = _tail_sources(p)
    g.output((env[p.combine.args[0]], *[env[n] for n in p.row_outputs], *[env[n] for n in extra]))
    return GraphModule(torch.nn.Module(), g)


def _tail(p: Pipeline) -> GraphModule | None:
    """The whole-rows graph of the reductions: (*tail rows, offs, *tail consts) -> reduced outputs."""
    nodes = _tail_nodes(p)
    if not nodes:
        return None
    g = Graph()
    env: dict[Node, Node] = {r: g.placeholder(f"rows_{i}") for i, r in enumerate(_tail_rows(p))}
    offs = g.placeholder("offs")
    if p.offs is not None:
        env[p.offs] = offs
    for i, n in enumerate(p.tail_consts):
        env[n] = g.placeholder(f"const_{i}")
    for n in nodes:
        env[n] = g.node_copy(n, lambda a: env[a])
    g.output(tuple(env[n] for n in p.reduced_outputs))
    return GraphModule(torch.nn.Module(), g)
