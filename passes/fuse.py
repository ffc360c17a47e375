"""Fuse: replace an AllGather -> matmul or matmul -> ReduceScatter site by one fused op.

AllGather -> matmul::

    w = wait(all_gather(x, dim=d)); y_i = mm(reshape(w, (M, K)), W_i)      # i = q, k, v ...
  becomes
    r = overlapc.fused_all_gather_matmul(x, [W_1, ..], d, group, chunks, timeout, return_a)
    y_i = reshape(r[1 + i], (M, N_i));  users of w read r[0] (return_a: only when there are any)

matmul -> ReduceScatter::

    y = mm(a, W); out = wait(reduce_scatter(reshape(y, S), dim=d))
  becomes
    out = overlapc.fused_matmul_reduce_scatter(reshape(a, S[:-1] + [K]), W, d, group, timeout)

  A sum of matmuls (backward's dgrad of q/k/v: dq @ Wq + dk @ Wk + dv @ Wv) becomes one
  matmul over the concatenated contraction dims, ``cat([a_i], 1) @ cat([W_i], 0)`` (a copy
  of the operands, and a different fp32 summation order than the separate GEMMs + adds).

The ops (overlapc/runtime/fused.py) run Triton kernels over symmetric memory; their fake
implementations give inductor one extern kernel per site. What the fused kernels do not
take is reported and left alone: a consumer reached through a dtype cast or an ``addmm``
bias (of an all-gather: the other consumers are still fused), transposed
outputs, ``avg`` reductions, groups whose backend has no symmetric memory here.
"""

from __future__ import annotations

import math

import torch
from torch.fx import Node

from overlapc.runtime import fused as _fused  # noqa: F401  (registers torch.ops.overlapc.fused_*)
from overlapc.runtime import symm

from . import ops
from .all_gather_matmul import AllGatherMatmulSite, row_uses
from .build import Builder
from .matmul_reduce_scatter import MatmulReduceScatterSite
from .normalize import erase_collective, remove_dead_nodes
from .rows import static_shape

FUSED_KINDS = (AllGatherMatmulSite, MatmulReduceScatterSite)
AG_OP = torch.ops.overlapc.fused_all_gather_matmul.default
RS_OP = torch.ops.overlapc.fused_matmul_reduce_scatter.default


def backend_support(site) -> str | None:
    """None when the site's group and device have a symmetric-memory backend here."""
    try:
        import torch.distributed as dist

        group = dist.distributed_c10d._resolve_process_group(site.group)
    except Exception as e:  # noqa: BLE001
        return f"process group {site.group!r} cannot be resolved: {e}"
    v = ops.val(site.coll.args[0])
    if v is not None and v.device.type != "cpu":
        return (
            symm.cuda_supported(group)
            if v.device.type == "cuda"
            else f"no symmetric-memory backend for {v.device.type} tensors"
        )
    return symm.cpu_supported(group)


def _fusable_ag_uses(site: AllGatherMatmulSite) -> tuple[list, list[str]]:
    out, why = [], []
    for u in row_uses(site):
        mm = u.matmul
        if mm.target is not ops.aten.mm.default:
            why.append(f"{mm.name} is {mm.target.__name__.split('.')[0]} (only mm is fused)")
            continue
        if any(p.target in ops.IDENTITIES and p.target is not ops.aten.clone.default for p in u.path):
            why.append(f"{mm.name} reads the gathered tensor through a cast")
            continue
        w = ops.val(mm.args[1])
        if w is None or w.dim() != 2 or w.dtype != ops.val(site.shard).dtype:
            why.append(f"{mm.name}'s weight is not a 2-D tensor of the activation's dtype")
            continue
        out.append(u)
    return out, why


def can_fuse(site, deps) -> str | None:
    """Why the site cannot be fused (None: it can)."""
    if not isinstance(site, FUSED_KINDS):
        return (
            f"no fused kernel for {site.pattern} sites (fused: all_gather_matmul, "
            "matmul_reduce_scatter); strategy 'decompose' rewrites it"
        )
    why = backend_support(site)
    if why:
        return f"no symmetric memory for this group: {why}"
    from overlapc.kernels import interpreter_problem  # imported when fusing: it sets TRITON_INTERPRET on a CPU

    why = interpreter_problem()
    if why:
        return f"the fused kernels cannot run here: {why}"
    if any(not isinstance(d, int) for d in ops.shape(site.coll.args[0]) or ()):
        return "dynamic shapes: the fused ops are planned for static shapes (strategy 'decompose' chunks them)"
    if isinstance(site, AllGatherMatmulSite):
        from .all_gather_matmul import can_rewrite

        why = can_rewrite(site, deps)
        if why:
            return why
        uses, why = _fusable_ag_uses(site)
        if not uses:
            return "no consumer the fused kernel takes: " + "; ".join(why)
        if why:
            site.details["fuse_left_whole"] = why
        return None
    return _rs_why(site)


def _rs_why(site: MatmulReduceScatterSite) -> str | None:
    if site.reduce_op != "sum":
        return f"reduce op {site.reduce_op!r} is not fused (sum is)"
    prod = site.producer
    if prod.form not in ("single", "sum"):
        return f"the scattered tensor is a {prod.form} of matmuls; the fused kernel takes one mm or a sum of mms"
    for p in prod.path:
        if p.target is ops.ADD and (p.kwargs or len(p.args) != 2):
            return f"{p.name} is an add with alpha"
        if p.target not in ops.RESHAPES and p.target is not ops.ADD:
            return "the matmul outputs reach the reduce-scatter through more than reshapes and adds"
    shape = static_shape(site.scattered)
    if shape is None:
        return "dynamic shapes"
    d = site.scatter_dim
    if d == len(shape) - 1:
        return "scattered along the last (output column) dim"
    if shape[d] % site.world:
        return f"size {shape[d]} along the scatter dim is not divisible by the world size {site.world}"
    dtypes = set()
    for mm in prod.matmuls:
        if mm.target is not ops.aten.mm.default:
            return f"{mm.name} is {mm.target.__name__.split('.')[0]} (only mm is fused)"
        yshape = static_shape(mm)
        if yshape is None or shape[-1] != yshape[-1] or math.prod(shape[:-1]) != yshape[0]:
            return f"the scatter does not keep {mm.name}'s output columns as its last dim"
        w, a = ops.val(mm.args[1]), ops.val(mm.args[0])
        if w is None or a is None:
            return f"{mm.name} has operands without metadata"
        dtypes |= {w.dtype, a.dtype}
    if len(dtypes) != 1:
        return "the matmuls' operands have different dtypes"
    return None


def rewrite(site, chunks: int, timeout: float) -> None:
    if isinstance(site, AllGatherMatmulSite):
        _rewrite_ag(site, chunks, timeout)
    else:
        _rewrite_rs(site, timeout)


def _rewrite_ag(site: AllGatherMatmulSite, chunks: int, timeout: float) -> None:
    graph = site.coll.graph
    uses, _ = _fusable_ag_uses(site)
    order = {n: i for i, n in enumerate(graph.nodes)}
    uses.sort(key=lambda u: order[u.matmul])
    mms = [u.matmul for u in uses]
    fused_mms = set(mms)
    # The gathered tensor is still needed by whatever is not a fused consumer.
    return_a = any(n not in fused_mms and not _only_feeds(n, fused_mms) for n in ops.data_users(site.gathered))
    b = Builder(graph, like=site.coll)
    with graph.inserting_before(mms[0]):
        call = b.call(
            AG_OP, site.shard, [mm.args[1] for mm in mms], site.gather_dim, site.group, chunks, float(timeout), return_a
        )
        outs = [b.reshape(b.getitem(call, 1 + i), ops.shape(mm)) for i, mm in enumerate(mms)]
        gathered = b.getitem(call, 0) if return_a else None
    for mm, out in zip(mms, outs):
        mm.replace_all_uses_with(out)
        graph.erase_node(mm)
    if gathered is not None:  # before dead-node removal, which would take the unused getitem
        site.gathered.replace_all_uses_with(gathered)
    remove_dead_nodes(graph)
    erase_collective(site.coll, site.wait)


def _only_feeds(node: Node, targets: set[Node]) -> bool:
    """``node`` is a layout op whose every use leads only to ``targets`` (the fused mms)."""
    if node.target not in ops.LAYOUT_OPS:
        return False
    users = ops.data_users(node)
    return bool(users) and all(u in targets or _only_feeds(u, targets) for u in users)


def _rewrite_rs(site: MatmulReduceScatterSite, timeout: float) -> None:
    graph = site.coll.graph
    mms = site.producer.matmuls
    shape = static_shape(site.scattered)
    b = Builder(graph, like=site.coll)
    with graph.inserting_before(site.coll):
        # A sum of matmuls sum_i a_i @ w_i is one matmul [a_1 .. a_n] @ [w_1; ..; w_n].
        a = b.cat([mm.args[0] for mm in mms], 1)
        w = b.cat([mm.args[1] for mm in mms], 0)
        a = b.reshape(a, [*shape[:-1], static_shape(a)[-1]])
        out = b.call(RS_OP, a, w, site.scatter_dim, site.group, float(timeout))
    site.wait.replace_all_uses_with(out)
    erase_collective(site.coll, site.wait)
    remove_dead_nodes(graph)
