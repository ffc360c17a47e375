"""The ATen and functional-collective ops the passes recognise, in one place."""

from __future__ import annotations

import math
import re
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch.fx import Node

aten = torch.ops.aten
prims = torch.ops.prims
c10d = torch.ops._c10d_functional

ALL_GATHER = c10d.all_gather_into_tensor.default
REDUCE_SCATTER = c10d.reduce_scatter_tensor.default
ALL_REDUCE = c10d.all_reduce.default
ALL_TO_ALL = c10d.all_to_all_single.default
WAIT = c10d.wait_tensor.default

# Collectives the passes match, by short name.
MATCHED_COLLECTIVES = {
    ALL_GATHER: "all_gather_into_tensor",
    REDUCE_SCATTER: "reduce_scatter_tensor",
    ALL_REDUCE: "all_reduce",
    ALL_TO_ALL: "all_to_all_single",
}
COST_KIND = {
    ALL_GATHER: "all_gather",
    REDUCE_SCATTER: "reduce_scatter",
    ALL_REDUCE: "all_reduce",
    ALL_TO_ALL: "all_to_all",
}
"""The collective kinds of the cost model (passes/cost.t_comm)."""

# matmul op -> (lhs arg index, rhs arg index)
MATMULS = {
    aten.mm.default: (0, 1),
    aten.addmm.default: (1, 2),
    aten.bmm.default: (0, 1),
    aten.baddbmm.default: (1, 2),
}
SCALED_MM = aten._scaled_mm.default
MATMULS[SCALED_MM] = (0, 1)
"""FP8 GEMMs as torchao lowers them: _scaled_mm(a, b, scale_a, scale_b, ...), the scales
tensorwise (one number) or rowwise (scale_a (M, 1), scale_b (1, N)). See scale_kind."""
GROUPED_MM = aten._grouped_mm.default if hasattr(aten, "_grouped_mm") else None
if GROUPED_MM is not None:
    MATMULS[GROUPED_MM] = (0, 1)
from overlapc.runtime.grouped import GROUPED_MM as LOOP_GROUPED_MM  # noqa: E402 -- registers the op

MATMULS[LOOP_GROUPED_MM] = (0, 1)
"""overlapc's grouped matmul (an expert loop regrouped, passes/expert_loop.py): always with
run-time offsets, so only dropless pipelines take it (passes/axis.py chunks none)."""

# Ops that only change how a tensor's elements are laid out or typed: matching sees through
# them. Each takes the tensor as its first argument.
RESHAPES = {
    aten.view.default,
    aten._unsafe_view.default,
    aten.reshape.default,
    aten.squeeze.dim,
    aten.squeeze.dims,
    aten.squeeze.default,
    aten.unsqueeze.default,
    aten.flatten.using_ints,
}
PERMUTES = {aten.t.default, aten.transpose.int, aten.permute.default}
IDENTITIES = {
    aten.clone.default,
    aten.alias.default,
    aten._to_copy.default,
    prims.convert_element_type.default,
    aten.contiguous.default,
    aten.detach.default,  # AOT detaches the output of a bitcast (a view autograd cannot see through)
    aten.view.dtype,  # a bitcast between dtypes of one width (gloo gathers fp8 as uint8): see is_identity
}
LAYOUT_OPS = RESHAPES | PERMUTES | IDENTITIES


def is_pointwise(node: Node) -> bool:
    """An elementwise op (torch's pointwise tag) or a layout identity (clone, cast): a chunk
    of its inputs gives the same chunk of its output."""
    tags = getattr(node.target, "tags", ())
    return node.op == "call_function" and (torch.Tag.pointwise in tags or is_identity(node))


def is_identity(node: Node) -> bool:
    """A layout identity: same elements, same shape (a clone, a cast, a bitcast of one width)."""
    if node.op != "call_function" or node.target not in IDENTITIES:
        return False
    if node.target is aten.view.dtype:
        src, out = val(node.args[0]), val(node)
        return src is not None and out is not None and src.element_size() == out.element_size()
    return True


def scale_kind(node: Node) -> str | None:
    """How a _scaled_mm's scale_a covers its left operand: "tensor" (one number, passed whole
    to every chunk of rows), "row" ((M, 1): a chunk takes its rows' scales), or None (neither:
    a chunk of rows could not take its part of it)."""
    a, s = shape(node.args[0]), shape(node.args[2])
    if a is None or s is None:
        return None
    if math.prod(s) == 1:
        return "tensor"
    return "row" if s == [a[0], 1] else None


def is_scaled_rowwise(node: Node) -> bool:
    """A _scaled_mm whose scale_a is not one number (see scale_kind)."""
    return node.target is SCALED_MM and scale_kind(node) != "tensor"


ADD = aten.add.Tensor


def is_collective(node: Node) -> bool:
    """Any functional collective (matched or not), excluding waits."""
    return (
        node.op == "call_function"
        and isinstance(node.target, torch._ops.OpOverload)
        and node.target.namespace == "_c10d_functional"
        and node.target is not WAIT
    )


def collective_name(node: Node) -> str:
    return MATCHED_COLLECTIVES.get(node.target) or node.target._schema.name.split("::")[-1]


def arg(node: Node, name: str, default=None):
    """Argument ``name`` of an OpOverload call, positional or keyword."""
    for i, a in enumerate(node.target._schema.arguments):
        if a.name == name:
            return node.args[i] if i < len(node.args) else node.kwargs.get(name, default)
    return default


def is_impure(node: Node) -> bool:
    """``node.is_impure()``, except ops tagged nondeterministic_seeded only for a dropout
    whose probability is 0 (attention kernels): they draw no random numbers then, so they
    may be removed when dead and reordered like any pure op."""
    t = node.target
    if (
        node.op == "call_function"
        and isinstance(t, torch._ops.OpOverload)
        and any(a.name == "dropout_p" for a in t._schema.arguments)
        and arg(node, "dropout_p", 0.0) == 0.0
    ):
        try:
            return node.is_impure(impure_random=False)
        except TypeError:  # a torch without the switch
            pass
    return node.is_impure()


def is_matmul(node: Node) -> bool:
    return node.op == "call_function" and node.target in MATMULS


def is_batched_matmul(node: Node) -> bool:
    """``bmm``, or ``torch._grouped_mm`` of two 3-D operands with no offsets, bias or output
    dtype: a bmm by another name (a capacity-form MoE's experts written as grouped matmuls;
    its backward is grouped matmuls of the same kind)."""
    if node.op != "call_function":
        return False
    if node.target is aten.bmm.default:
        return True
    if not is_grouped_mm(node) or len(node.args) != 2:
        return False
    if any(v is not None for v in node.kwargs.values()):
        return False
    a, b = (shape(x) for x in node.args)
    return a is not None and b is not None and len(a) == 3 and len(b) == 3


def is_grouped_mm(node: Node) -> bool:
    return GROUPED_MM is not None and node.op == "call_function" and node.target is GROUPED_MM


def is_full_slice(node: Node) -> bool:
    """slice(x, d, 0, end >= size, 1): selects everything, a no-op (DTensor emits these)."""
    if node.op != "call_function" or node.target is not aten.slice.Tensor:
        return False
    src = shape(node.args[0])
    args = list(node.args) + [None] * (5 - len(node.args))
    d, start, end, step = (args[1] if args[1] is not None else 0), args[2], args[3], args[4]
    if src is None or not isinstance(d, int):
        return False
    size = src[d]
    return (
        start in (None, 0)
        and (end is None or (isinstance(end, int) and isinstance(size, int) and end >= size))
        and step in (None, 1)
    )


def is_layout(node: Node) -> bool:
    if is_full_slice(node):
        return True
    if node.op != "call_function" or node.target not in LAYOUT_OPS:
        return False
    if node.target is aten._to_copy.default:
        return same_place_copy(node)  # a dtype change is transparent; a device or layout change is not
    if node.target is aten.view.dtype:
        return is_identity(node)
    return True


def same_place_copy(node: Node) -> bool:
    """A ``_to_copy`` that changes at most the dtype (or memory format): no device or layout
    move (the tracer, and autograd's backward of a cast, spell out layout and device even
    where they do not change)."""
    kw, src = dict(node.kwargs), val(node.args[0])
    device = kw.pop("device", None)
    if device is not None and (src is None or torch.device(device) != src.device):
        return False
    if kw.pop("layout", None) not in (None, torch.strided) or kw.pop("pin_memory", None):
        return False
    kw.pop("non_blocking", None)
    return set(kw) <= {"dtype", "memory_format"}


def val(node) -> torch.Tensor | None:
    v = node.meta.get("val") if isinstance(node, Node) else None
    return v if isinstance(v, torch.Tensor) else None


def nbytes(node) -> int | None:
    """Bytes of a node's value (None where it has none)."""
    v = val(node)
    return None if v is None else v.numel() * v.element_size()


def hinted_nbytes(v: torch.Tensor | None) -> int | None:
    """Bytes of ``v`` with symbolic sizes at their bucket's values (:func:`hint`); None where
    ``v`` is None or a size is not known."""
    n = hint(v.numel()) if v is not None else None
    return None if n is None else n * v.element_size()


def shape(node) -> list | None:
    v = val(node)
    return list(v.shape) if v is not None else None


META_QUERIES = {aten.sym_size.int, aten.sym_stride.int, aten.sym_numel.default, aten.sym_storage_offset.default}


def data_users(node: Node) -> list[Node]:
    """Users that read the tensor's data: not sym_size & co. (dynamic-shape graphs query sizes)."""
    return [u for u in node.users if u.target not in META_QUERIES]


def wait_of(coll: Node) -> Node | None:
    """The wait_tensor that completes a collective, if it is its only user."""
    users = data_users(coll)
    if len(users) == 1 and users[0].target is WAIT:
        return users[0]
    return None


_GROUP_ARG = {ALL_GATHER: 2, REDUCE_SCATTER: 3, ALL_REDUCE: 2, ALL_TO_ALL: 3}
"""Position of the process-group name among each matched collective's arguments."""


def group_name(coll: Node) -> str | None:
    """The process-group name argument of a functional collective."""
    if coll.target in _GROUP_ARG:
        return coll.args[_GROUP_ARG[coll.target]]
    for a in reversed(coll.args):
        if isinstance(a, str):
            return a
    return None


def world_size(coll: Node) -> int | None:
    t = coll.target
    if t is ALL_GATHER:
        return coll.args[1] if isinstance(coll.args[1], int) else None
    if t is REDUCE_SCATTER:
        return coll.args[2] if isinstance(coll.args[2], int) else None
    if t is ALL_TO_ALL:
        splits = coll.args[1] or coll.args[2]
        if splits:
            return len(splits)
    name = group_name(coll)
    if name is None:
        return None
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        return _resolve_process_group(name).size()
    except Exception:
        return None


def set_group_name(coll: Node, name: str) -> None:
    """Point a functional collective at the process group called ``name``."""
    args = list(coll.args)
    args[_GROUP_ARG[coll.target]] = name
    coll.args = tuple(args)


def group_backend(name: str | None) -> str | None:
    """Name of the backend ("gloo", "nccl", "fake", ...) of the process group called ``name``."""
    if name is None:
        return None
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        pg = _resolve_process_group(name)
        return pg._get_backend_name() if hasattr(pg, "_get_backend_name") else str(pg.name())
    except Exception:
        return None


GLOO_DEFAULT_THREADS = 2
"""ProcessGroupGloo's worker threads unless its options say otherwise (what
init_process_group gives every gloo group): the guess where a group's count cannot be read."""


def group_comm_threads(name: str | None) -> int | None:
    """Collectives the process group called ``name`` runs at once: a gloo group's worker
    threads (read from its options, else ``GLOO_DEFAULT_THREADS``), 1 on other backends;
    None where the group cannot be resolved."""
    backend = group_backend(name)
    if backend is None:
        return None
    if backend != "gloo":
        return 1
    try:
        from torch.distributed.distributed_c10d import _resolve_process_group

        return int(_resolve_process_group(name)._get_backend(torch.device("cpu")).options._threads)
    except Exception:
        return GLOO_DEFAULT_THREADS


def reduce_op(coll: Node) -> str | None:
    if coll.target in (REDUCE_SCATTER, ALL_REDUCE):
        return coll.args[1]
    return None


def op_name(n: Node) -> str:
    """A node's op as a report names it ("abs", "mm", "the graph output")."""
    if n.op == "output":
        return "the graph output"
    if n.op == "call_function":
        return getattr(n.target, "__name__", str(n.target)).split(".")[0]
    return n.op


def module_path(node: Node) -> str | None:
    """Dotted path of the innermost nn.Module a node came from, as the graph recorded it."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    path, cls = list(stack.values())[-1][:2]
    if path in ("L['self']", "L['mod']", "self", ""):
        return getattr(cls, "__name__", None) if isinstance(cls, type) else str(cls).rsplit(".", 1)[-1] or None
    # Dynamo spells list items and attributes as ['0'] / _modules['x'] in some versions.
    # A module reached through its instance dict (dynamo's spelling inside a checkpointed
    # region): __dict__['_modules']['x'] is the child x.
    path = re.sub(r"\.__dict__\['_(?:modules|parameters|buffers)'\]", "", path)
    path = path.replace("._modules['", ".")
    # The root module's own source: L['self'], L['mod'], or L['args'][0] where a decorator
    # (transformers' forward wrappers) hands the module to the traced function.
    path = re.sub(r"^(?:L\['\w+'\](?:\[\d+\])*|self)\.?", "", path)
    path = path.replace("['", ".").replace("']", "")
    # Wrappers between a module and its children, as named_modules() does not show them: a
    # bound method's closure (torchtitan replaces forward with one), activation checkpointing's,
    # FSDP's and torch.compile's wrapper attributes.
    path = re.sub(r"(?:^|\.)\w+\.__closure__\[\d+\]\.cell_contents(?:\.__self__)?", "", path)
    return strip_wrappers(path) or None


# Attributes by which wrappers hold the module they wrap: named_modules() shows them, but a
# user's names (and the name the wrapped module had before wrapping) leave them out.
WRAPPERS = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod")


def strip_wrappers(path: str) -> str:
    """A dotted module path without wrappers' attributes (and without empty parts)."""
    return ".".join(p for p in path.split(".") if p and p not in WRAPPERS)


def common_module(paths) -> str | None:
    """The deepest module path that every one of ``paths`` lies under (the first path where they
    share none); None without paths."""
    import os

    paths = [p for p in paths if p]
    if not paths:
        return None
    return ".".join(os.path.commonprefix([p.split(".") for p in paths])) or paths[0]


def in_graph_order(nodes) -> list[Node]:
    """Nodes sorted by their position in their graph (duplicates dropped)."""
    nodes = list(dict.fromkeys(nodes))
    if len(nodes) < 2:
        return nodes
    pos = {n: i for i, n in enumerate(nodes[0].graph.nodes)}
    return sorted(nodes, key=lambda n: pos.get(n, -1))


# ----------------------------------------------------------------------------- symbolic sizes

_BUCKET: ContextVar[dict | None] = ContextVar("overlapc_bucket", default=None)


@contextmanager
def shape_bucket(representatives: dict):
    """Plan and rewrite graphs with symbolic sizes for one shape bucket (overlapc/buckets.py).

    ``representatives`` maps each size symbol to the value the planner decides on. Inside,
    the rewrites accept symbolic shapes: their size arithmetic stays symbolic, and every
    comparison they make becomes a guard of the bucket's shape environment, which the
    dispatcher checks on each call."""
    import sympy

    token = _BUCKET.set({k: sympy.Integer(v) for k, v in representatives.items()})
    try:
        yield
    finally:
        _BUCKET.reset(token)


def bucket_sizes() -> dict[str, int] | None:
    """The current shape bucket's representative sizes by symbol name (None outside one)."""
    reps = _BUCKET.get()
    return None if reps is None else {str(k): int(v) for k, v in sorted(reps.items(), key=str)}


def symbolic_ok() -> bool:
    """True while a shape bucket is being compiled: symbolic shapes may be rewritten."""
    return _BUCKET.get() is not None


def dtype_name(t: torch.Tensor) -> str:
    """A tensor's dtype as profiles and reports name it: "float32", "bfloat16", ..."""
    return str(t.dtype).replace("torch.", "")


def hint(x) -> int | None:
    """An int for a size: itself, or a symbolic size at the bucket's representative values
    (None outside a bucket, or for sizes known only at run time)."""
    if not isinstance(x, torch.SymInt):
        return int(x)
    expr = x.node.expr
    if expr.is_number:
        return int(expr)
    reps = _BUCKET.get()
    if reps is None or not expr.free_symbols <= reps.keys():
        return None
    return int(expr.xreplace(reps))
