"""Graph passes of overlapc: normalize -> match -> plan -> lower -> schedule.

Installed as ``overlapc.passes``. Each step is a module that can be used and tested
alone; :func:`optimize` is the pipeline.
"""

from __future__ import annotations

from torch.fx import GraphModule

from overlapc.options import Options
from overlapc.report import Site

from . import ops
from .accumulate import fold_partial_sums
from .auto_sp import auto_sequence_parallel
from .deps import DepGraph
from .forms import lower_collectives
from .fp8_gather import quantize_before_gather
from .lower import lower_sites
from .match import find_sites
from .microbatch import slice_microbatches
from .normalize import normalize
from .plan import graph_profile, plan_sites
from .schedule import legalize, schedule


def optimize(gm: GraphModule, graph_kind: str, options: Options | None = None, joint_done: bool = False) -> list[Site]:
    """Run the pipeline on one captured graph in place; return its report rows in graph order.
    ``joint_done``: the all-reduce passes (coalescing, automatic sequence parallelism) already ran
    on the joint or inference graph this one comes from (overlapc.compiler)."""
    options = options or Options()
    normalize(gm)
    merged = [] if joint_done else auto_sequence_parallel(gm.graph, graph_kind, options)
    merged += quantize_before_gather(gm.graph, graph_kind, options)
    profile = graph_profile(gm.graph, graph_kind, options)
    slicing = slice_microbatches(gm.graph, graph_kind, options, profile)
    deps = DepGraph(gm.graph)
    sites, loose = find_sites(gm.graph, graph_kind, deps)
    order = {n.name: i for i, n in enumerate(gm.graph.nodes)}
    for s in sites:
        s.snapshot()
    plan_sites(slicing.priced(sites), options, deps, profile)
    slicing.settle(sites)
    rewritten = lower_sites(gm.graph, sites)
    if rewritten:
        legalize(gm.graph)
    as_all_to_all = lower_collectives(gm.graph, options)
    if (rewritten or slicing.sliced) and options.addmm_partials:
        fold_partial_sums(gm.graph)
    reordered = options.schedule and schedule(gm.graph, options.lanes, profile)
    # Tells the inductor inner compiler to keep this order through its own scheduler.
    gm.meta["overlapc_changed"] = bool(rewritten or reordered or slicing.sliced or as_all_to_all)
    rows = [s.to_report() for s in sites] + [c.to_report() for c in loose]
    for r in rows:
        for kind, groups in as_all_to_all.items():
            if r.collective_op == ops.MATCHED_COLLECTIVES[kind] and r.group in groups:
                r.details[f"{ops.COST_KIND[kind]}_as"] = groups[r.group]
    rows.sort(key=lambda r: order.get(r.collective, 0))
    rows = slicing.rows + merged + rows
    gm.graph.lint()
    gm.recompile()
    return rows
