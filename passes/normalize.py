"""Normalize: make graphs from Dynamo/AOTAutograd/inductor look alike to the matchers.

Two parts:

- :func:`normalize` mutates the graph only to remove dead nodes (AOTAutograd's backward
  graphs carry rematerialised forward nodes nobody uses; they would otherwise look like
  extra sites). Collectives are never removed: every rank must issue the same ones.
- The walkers see through what real graphs put between a collective and its matmul,
  without rewriting it: views/reshapes/``_unsafe_view``, ``t``/``transpose``/``permute``,
  ``clone``, dtype casts, and the split + cat idioms that functional collectives emit for
  gathers and scatters on inner dims::

      ag = all_gather_into_tensor(x, W, g); w = wait_tensor(ag)       # gathers dim 0
      parts = split(w, x.shape[0]); y = cat(parts, dim=d)             # ... moved to dim d

      parts = split(y, y.shape[d] // W, dim=d); c = cat(parts)        # scatters dim d
      rs = reduce_scatter_tensor(c, "sum", W, g)                      # ... via dim 0

  Each walker tracks which dims of the tensor it reaches hold the gathered (or
  scattered) dim, so a matcher can tell whether the collective dim lands on the matmul's
  rows, columns or contraction dim.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

from torch.fx import Graph, GraphModule, Node

from . import ops

Dims = frozenset


def normalize(gm: GraphModule) -> bool:
    """Remove dead, side-effect-free nodes, and return waited collectives as their wait's
    result. Returns whether the graph changed."""
    changed = output_waited(gm.graph)
    return remove_dead_nodes(gm.graph) or changed


def output_waited(graph: Graph) -> bool:
    """Where a graph outputs a collective's result beside the wait_tensor that completes it, it
    outputs the wait's result instead, so that the wait is the collective's one user.

    A checkpointing policy that saves a collective's output (torchtitan's saves every
    reduce-scatter) makes the partitioner save the tensor the collective returns, before its
    wait; the backward waits on it again. The wait's result is the same tensor, complete, and a
    wait on a completed tensor is a no-op, so the exchange changes no value."""
    changed = False
    outputs = [n for n in graph.nodes if n.op == "output"]
    for node in graph.nodes:
        if not ops.is_collective(node):
            continue
        users = ops.data_users(node)
        waits = [u for u in users if u.target is ops.WAIT]
        if len(waits) != 1 or not any(u in outputs for u in users):
            continue
        if any(u.target is not ops.WAIT and u not in outputs for u in users):
            continue
        for out in outputs:
            out.replace_input_with(node, waits[0])
        changed = True
    return changed


def remove_dead_nodes(graph: Graph) -> bool:
    changed = False
    for node in reversed(list(graph.nodes)):
        if node.op != "call_function" or node.users:
            continue
        if ops.is_collective(node) or node.target is ops.WAIT or ops.is_impure(node):
            continue
        graph.erase_node(node)
        changed = True
    return changed


def erase_collective(coll: Node, wait: Node) -> None:
    """Erase a collective and its wait once a rewrite has replaced every use of the wait.

    Also erases what only the collective used (the split + cat idiom, a contiguous copy)."""
    graph = coll.graph
    if wait.users:
        raise RuntimeError(f"overlapc: {wait.name} still has users after rewriting {coll.name}")
    graph.erase_node(wait)
    graph.erase_node(coll)
    remove_dead_nodes(graph)


# ----------------------------------------------------------------------------- dim tracking


def _reshape_groups(src: list, dst: list):
    """Pair up runs of src dims and dst dims whose sizes multiply to the same number."""
    groups, i, j = [], 0, 0
    while i < len(src) and j < len(dst):
        si, dj = [i], [j]
        ps, pd = src[i], dst[j]
        i, j = i + 1, j + 1
        while ps != pd:
            if ps < pd:
                if i >= len(src):
                    return None
                ps *= src[i]
                si.append(i)
                i += 1
            else:
                if j >= len(dst):
                    return None
                pd *= dst[j]
                dj.append(j)
                j += 1
        groups.append((si, dj))
    if not groups:
        return [(list(range(len(src))), list(range(len(dst))))]
    # Trailing size-1 dims join the last group.
    groups[-1][0].extend(range(i, len(src)))
    groups[-1][1].extend(range(j, len(dst)))
    return groups


def map_dims(node: Node, dims: Dims | None) -> Dims | None:
    """Dims of ``node``'s output that hold the elements of ``dims`` of its first input.

    None means unknown (symbolic shapes that cannot be compared, or an op not understood).
    """
    if dims is None:
        return None
    t = node.target
    if ops.is_identity(node) or ops.is_full_slice(node):
        return dims
    src, dst = ops.shape(node.args[0]), ops.shape(node)
    if t in ops.RESHAPES:
        if src is None or dst is None:
            return None
        try:
            groups = _reshape_groups(src, dst)
        except TypeError:  # symbolic sizes that cannot be ordered
            return None
        if groups is None:
            return None
        out = set()
        for si, dj in groups:
            if dims & set(si):
                big = [d for d in dj if dst[d] != 1]
                out.update(big or dj[:1])
        return Dims(out)
    if t is ops.aten.t.default:
        return dims if src is None or len(src) < 2 else Dims({1 - d for d in dims})
    if t is ops.aten.transpose.int:
        rank = len(src) if src is not None else None
        a, b = (d % rank if rank else d for d in node.args[1:3])
        return Dims({b if d == a else a if d == b else d for d in dims})
    if t is ops.aten.permute.default:
        perm = [p % len(src) if src else p for p in node.args[1]]
        return Dims({i for i, p in enumerate(perm) if p in dims})
    return None


# ----------------------------------------------------------------------------- idioms


def _rank_pieces(parts: list, world: int) -> tuple[Node, int, set[Node]] | None:
    """Are ``parts`` the ``world`` equal, in-order pieces of one tensor y along one dim?

    Two spellings occur: ``getitem(split(y, s, d), r)`` (one split, or one per piece) and
    ``slice(y, d, r * s, (r + 1) * s)``. Returns (y, d, the nodes that read y directly).
    """
    if len(parts) != world or not all(isinstance(p, Node) for p in parts):
        return None
    if all(p.target is operator.getitem for p in parts):
        splits = {p.args[0] for p in parts}
        if any(sp.target not in (ops.aten.split.Tensor, ops.aten.split_with_sizes.default) for sp in splits):
            return None
        if [p.args[1] for p in parts] != list(range(world)):
            return None
        ys = {sp.args[0] for sp in splits}
        dims = {sp.args[2] if len(sp.args) > 2 else sp.kwargs.get("dim", 0) for sp in splits}
        feeders = splits
    elif all(p.target is ops.aten.slice.Tensor for p in parts):
        ys = {p.args[0] for p in parts}
        dims = {p.args[1] if len(p.args) > 1 else 0 for p in parts}
        bounds = [(p.args[2], p.args[3]) if len(p.args) > 3 else (None, None) for p in parts]
        step = bounds[0][1] - bounds[0][0] if isinstance(bounds[0][0], int) and isinstance(bounds[0][1], int) else None
        if step is None or bounds != [(r * step, (r + 1) * step) for r in range(world)]:
            return None
        if any(len(p.args) > 4 and p.args[4] != 1 for p in parts):
            return None
        feeders = set(parts)
    else:
        return None
    if len(ys) != 1 or len(dims) != 1:
        return None
    y = ys.pop()
    rank = len(ops.shape(y) or [0])
    d = dims.pop()
    return y, (d % rank if rank else d), feeders


def split_cat_gather(wait: Node, world: int) -> tuple[Node, int] | None:
    """wait -> W in-order pieces along dim 0 -> cat(pieces, dim d): returns (cat, d)."""
    users = ops.data_users(wait)
    # pieces are getitems of a split of the wait, or slices of it
    pieces = [
        u
        for f in users
        for u in (ops.data_users(f) if f.target in (ops.aten.split.Tensor, ops.aten.split_with_sizes.default) else [f])
    ]
    cats = {u for p in pieces for u in ops.data_users(p)}
    if len(cats) != 1:
        return None
    cat = cats.pop()
    if cat.target is not ops.aten.cat.default or any(len(ops.data_users(p)) != 1 for p in pieces):
        return None
    found = _rank_pieces(list(cat.args[0]), world)
    if found is None or found[0] is not wait or found[1] != 0 or set(cat.args[0]) != set(pieces):
        return None
    rank = len(ops.shape(cat) or [0])
    d = cat.args[1] if len(cat.args) > 1 else cat.kwargs.get("dim", 0)
    return cat, (d % rank if rank else d)


def split_cat_scatter(inp: Node, world: int) -> tuple[Node, int, set[Node]] | None:
    """cat(W in-order pieces of y along dim d) feeding a reduce-scatter: (y, d, readers of y)."""
    if inp.target is not ops.aten.cat.default:
        return None
    cat_dim = inp.args[1] if len(inp.args) > 1 else inp.kwargs.get("dim", 0)
    if cat_dim != 0:
        return None
    return _rank_pieces(list(inp.args[0]), world)


# ----------------------------------------------------------------------------- walkers


@dataclass
class Use:
    """A matmul operand reached from a source value through layout ops only."""

    matmul: Node
    arg: int
    """Index of the operand in matmul.args."""
    side: str
    """"lhs" or "rhs"."""
    dims: Dims | None
    """Dims of the operand holding the collective's dim (None: unknown)."""
    path: list[Node] = field(default_factory=list)
    """Layout nodes from the source (exclusive) to the operand (inclusive)."""

    @property
    def other(self) -> Node | None:
        """The matmul's other operand."""
        lhs, rhs = ops.MATMULS[self.matmul.target]
        o = self.matmul.args[rhs if self.side == "lhs" else lhs]
        return o if isinstance(o, Node) else None

    @property
    def role(self) -> str:
        """Where the collective dim lands: "rows" (M), "cols" (N), "contraction" (K), "batch"."""
        return operand_role(self.matmul, self.side, self.dims)


def operand_role(matmul: Node, side: str, dims: Dims | None) -> str:
    if dims is None or len(dims) != 1:
        return "unknown"
    (d,) = dims
    rank = len(ops.shape(matmul.args[ops.MATMULS[matmul.target][0 if side == "lhs" else 1]]) or [2])
    d = d - (rank - 2)  # batched matmuls: leading dims are batch dims
    if d < 0:
        return "batch"
    if side == "lhs":
        return "rows" if d == 0 else "contraction"
    return "contraction" if d == 0 else "cols"


INDEXING = {
    ops.aten.select.int,
    ops.aten.slice.Tensor,
    ops.aten.narrow.default,
    ops.aten.split.Tensor,
    ops.aten.split_with_sizes.default,
    ops.aten.unbind.int,
    operator.getitem,
}


def matmul_uses(src: Node, dims: Dims | None, *, through_indexing: bool = False) -> tuple[list[Use], list[Node]]:
    """Matmul operands reachable from ``src`` through layout ops, and the other users met.

    With ``through_indexing``, also through select/slice/split/unbind (per-expert loops
    index one expert's rows out of a packed tensor); dims are unknown past those.
    """
    uses, others = [], []

    def walk(node: Node, dims, path):
        for user in ops.data_users(node):
            if ops.is_matmul(user):
                lhs, rhs = ops.MATMULS[user.target]
                hit = False
                for side, idx in (("lhs", lhs), ("rhs", rhs)):
                    if idx < len(user.args) and user.args[idx] is node:
                        uses.append(Use(user, idx, side, dims, path))
                        hit = True
                if not hit:  # e.g. the bias of addmm
                    others.append(user)
            elif ops.is_layout(user) and user.args[0] is node:
                walk(user, map_dims(user, dims), path + [user])
            elif through_indexing and user.op == "call_function" and user.target in INDEXING and user.args[0] is node:
                walk(user, None, path + [user])
            else:
                others.append(user)

    walk(src, dims, [])
    return uses, others


@dataclass
class Producer:
    """The matmuls whose results, through layout ops and adds, form a collective's input."""

    matmuls: list[Node]
    dims: list[Dims | None]
    """Per matmul: dims of its output that hold the collective's dim."""
    form: str
    """"single" (one matmul), "sum" (a sum of matmuls), "concat" (matmuls stacked,
    concatenated or placed into a packed tensor) or "concat+sum" (both)."""
    path: list[Node] = field(default_factory=list)
    """Nodes between the matmuls and the collective input (layout ops, adds, cat/stack)."""


# Nodes a matmul producer may pass through besides layout ops (see matmul_producer).
PRODUCER_GLUE = {
    ops.ADD,
    ops.aten.cat.default,
    ops.aten.stack.default,
    ops.aten.select_backward.default,
    ops.aten.slice_backward.default,
}


class NoProducer(Exception):
    """Why a collective's input is not (a sum of) matmul results; str() is the reason."""


def _inverse_map(node: Node, dims: Dims | None) -> Dims | None:
    """Dims of ``node``'s first input that its output ``dims`` come from."""
    if dims is None:
        return None
    src = ops.shape(node.args[0])
    if src is None:
        return None
    cand = set()
    for d in range(len(src)):
        out = map_dims(node, Dims({d}))
        if out is None:
            return None
        if out & dims:
            cand.add(d)
    return Dims(cand)


def matmul_producer(x: Node, dims: Dims | None, consumers: set[Node]) -> Producer:
    """Walk up from a collective's input ``x`` to the matmul(s) that produce it.

    ``consumers`` are the nodes allowed to use ``x`` (the collective, or the split nodes of
    the split + cat idiom). Every node further up must have the walk as its only user:
    otherwise the matmul's full result is needed elsewhere, and chunking it would leave
    the full GEMM in place beside the chunked one.
    """
    path: list[Node] = []
    matmuls: list[Node] = []
    mdims: list = []
    forms: set[str] = set()

    def up(node: Node, dims, first: bool):
        if not (ops.is_matmul(node) or ops.is_layout(node) or node.target in PRODUCER_GLUE):
            what = getattr(node.target, "__name__", str(node.target)) if node.op == "call_function" else node.op
            raise NoProducer(f"producer is {what} ({node.name}), not a matmul")
        users = ops.data_users(node)
        extra = [u for u in users if u not in consumers] if first else (users if len(users) != 1 else [])
        if extra:
            users = ", ".join(u.name for u in users)
            raise NoProducer(f"matmul result has other users ({node.name} is used by {users})")
        if ops.is_matmul(node):
            matmuls.append(node)
            mdims.append(dims)
            return
        if ops.is_layout(node):
            path.append(node)
            up(node.args[0], _inverse_map(node, dims), False)
            return
        if (
            node.target is ops.ADD
            and node.kwargs.get("alpha", 1) == 1
            and sum(isinstance(a, Node) for a in node.args[:2]) == 1
        ):
            # x + c (Python's sum() starts with 0 + first): acts on every row alike.
            path.append(node)
            up(next(a for a in node.args[:2] if isinstance(a, Node)), dims, False)
            return
        if (
            node.target is ops.ADD
            and all(isinstance(a, Node) for a in node.args[:2])
            and node.kwargs.get("alpha", 1) == 1
            and ops.shape(node.args[0]) == ops.shape(node.args[1])
        ):
            path.append(node)
            forms.add("sum")
            up(node.args[0], dims, False)
            up(node.args[1], dims, False)
            return
        if node.target in (ops.aten.select_backward.default, ops.aten.slice_backward.default):
            # A per-expert result placed into a zero tensor of the packed shape (backward of x[e]).
            path.append(node)
            forms.add("concat")
            up(node.args[0], None, False)
            return
        if node.target in (ops.aten.cat.default, ops.aten.stack.default):
            cat_dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim", 0)
            path.append(node)
            forms.add("concat")
            for part in node.args[0]:
                # Stacking adds a dim; concatenation keeps rank. Track conservatively.
                up(part, None if node.target is ops.aten.stack.default or (dims and cat_dim in dims) else dims, False)
            return
        raise NoProducer(f"producer is {node.target.__name__} ({node.name}), not a plain sum of matmuls")

    up(x, dims, True)
    form = "+".join(sorted(forms)) or "single"  # "single", "sum", "concat" or "concat+sum"
    return Producer(matmuls, mdims, form, path)
