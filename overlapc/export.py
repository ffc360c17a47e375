"""Ahead of time: rewrite a ``torch.export`` program into one that saves, loads and runs.

    ep = torch.export.export(model, (x,))           # functional collectives in forward
    ep = overlapc.rewrite(ep, options={"chunks": 4})
    torch.export.save(ep, "model.pt2")              # later, on each rank of the same layout:
    torch.export.load("model.pt2").module()(x)

The program's graph goes through the same pipeline as the backend's graphs (passes.optimize:
coalesce, match, plan, lower, schedule) under the kind "inference", and the result is a new
``ExportedProgram`` with the same signature. Its report is ``overlapc.last_report()``'s and
the result's ``overlapc_report`` attribute (not saved with the program).

The rewritten program names its process groups as the exported one did (c10d's group names,
"0" for the default group): it runs on every rank of a world with the same group layout.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from torch.fx import GraphModule

from .errors import OverlapError
from .options import Options
from .report import Report

log = logging.getLogger("overlapc")


def rewrite(ep, *, options: dict | Options | None = None):
    """``ep`` rewritten by overlapc: a new ``torch.export.ExportedProgram`` (``ep`` is unchanged)."""
    from torch.export import ExportedProgram

    from overlapc.compiler import _GLOBAL_LOCK, _GLOBAL_REPORT
    from overlapc.passes import optimize
    from overlapc.passes.build import copy_graph_module

    if not isinstance(ep, ExportedProgram):
        raise OverlapError(
            "overlapc.rewrite takes a torch.export.ExportedProgram (from torch.export.export or "
            f"torch.export.load); got {type(ep).__name__}"
        )
    # Planned once, ahead of time: the plan depends on the options, not on link timings taken
    # while the program is rewritten (measure=True in ``options`` still asks for them).
    given = dataclasses.asdict(options) if isinstance(options, Options) else dict(options or {})
    given.setdefault("measure", False)
    if not isinstance(options, Options) and given.get("lanes"):
        raise OverlapError(
            "option 'lanes' is not available to overlapc.rewrite: lanes are process groups this "
            "process makes, and a saved program names its groups"
        )
    given["lanes"] = 0  # the program keeps its collectives on the groups it was exported with
    if _is_joint(ep):
        # Micro-batch slices of a joint forward + backward program give the scheduler a cycle
        # (passes/schedule.py refuses it): not chosen unless asked for.
        given.setdefault("microbatches", 1)
    opts = Options.from_user(given)
    if "fuse" in (opts.strategy, *(o.get("strategy") for o in opts.overrides.values())):
        raise OverlapError(
            "strategy 'fuse' is not available to overlapc.rewrite: the fused kernels are Triton "
            "ops over symmetric memory that a saved program cannot carry; use 'auto' or 'decompose'"
        )
    check_groups(ep.graph_module)
    # Core ATen: the ops the matchers read. A new program; ``ep`` stays as it was.
    ep = ep.run_decompositions(_decompositions())
    gm = copy_graph_module(ep.graph_module)
    try:
        rows = optimize(gm, "inference", opts)
    except RuntimeError as e:
        if "cycle" not in str(e):
            raise
        raise OverlapError(
            f"overlapc.rewrite could not schedule this program ({e}); with micro-batch slices "
            "(option microbatches) on a joint forward + backward program, pass microbatches=1"
        ) from e
    fused = [r.name for r in rows if r.strategy == "fuse"]
    if fused:  # a profile that prices fused kernels, under strategy "auto"
        raise OverlapError(
            f"the planner chose fused kernels for {', '.join(fused)}, which a saved program cannot "
            "carry; pass options={'strategy': 'decompose'} or a profile without fused kernels"
        )
    out = ep._update(gm, _renamed_outputs(ep.graph_signature, gm))
    report = Report()
    report.extend(rows)
    out.overlapc_report = report
    with _GLOBAL_LOCK:
        _GLOBAL_REPORT.extend(rows)
    return out


def _is_joint(ep) -> bool:
    """A program whose outputs include gradients (torch.export's joint forward + backward)."""
    from torch.export.graph_signature import OutputKind

    return any(
        spec.kind in (OutputKind.GRADIENT_TO_PARAMETER, OutputKind.GRADIENT_TO_USER_INPUT, OutputKind.LOSS_OUTPUT)
        for spec in ep.graph_signature.output_specs
    )


def _linear(x, w, b=None):
    """A linear as a 2-D GEMM on the flattened rows, as AOTAutograd's graphs have it (the core
    decomposition goes through matmul, which gives a bmm for 3-D inputs that need grads)."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.mm(rows, w.t()) if b is None else torch.addmm(b, rows, w.t())
    return out.view(*x.shape[:-1], w.shape[0])


def _decompositions():
    table = torch.export.default_decompositions()
    table[torch.ops.aten.linear.default] = _linear
    return table


def _renamed_outputs(signature, gm: GraphModule):
    """``signature`` with its outputs named after the rewritten graph's output values (a
    rewrite may replace the node an output was, e.g. a wait by the chunks' concatenation)."""
    from torch.export.graph_signature import TensorArgument

    values = torch.fx.node.map_arg(gm.graph.output_node().args[0], lambda n: n)
    flat = values if isinstance(values, (list, tuple)) else [values]
    specs = []
    for spec, value in zip(signature.output_specs, flat):
        if isinstance(spec.arg, TensorArgument) and isinstance(value, torch.fx.Node):
            spec = dataclasses.replace(spec, arg=TensorArgument(name=value.name))
        specs.append(spec)
    return dataclasses.replace(signature, output_specs=specs)


def check_groups(gm: GraphModule) -> None:
    """Each collective's group exists here with the size the program was exported for."""
    import torch.distributed as dist

    from overlapc.passes import ops

    for node in gm.graph.nodes:
        if not ops.is_collective(node):
            continue
        name = ops.group_name(node)
        # the size the program was exported for, where the op records it (its own argument)
        size = ops.world_size(node) if node.target in (ops.ALL_GATHER, ops.REDUCE_SCATTER) else None
        if not dist.is_initialized():
            raise OverlapError(
                f"the program's {ops.collective_name(node)} ({node.name}) runs on process group "
                f"{name!r}: initialize the same process-group layout (init_process_group, and the "
                "same new_group calls) before overlapc.rewrite"
            )
        try:
            from torch.distributed.distributed_c10d import _resolve_process_group

            have = _resolve_process_group(name).size()
        except Exception:  # noqa: BLE001 - c10d raises several kinds for an unknown name
            raise OverlapError(
                f"the program's {ops.collective_name(node)} ({node.name}) runs on process group "
                f"{name!r}, which this process does not have: create the same groups, in the same "
                "order, before overlapc.rewrite"
            ) from None
        if isinstance(size, int) and size != have:
            raise OverlapError(
                f"the program's {ops.collective_name(node)} ({node.name}) is for a group of {size} "
                f"ranks; process group {name!r} here has {have}: export (or load) it in a world of "
                f"{size}"
            )
