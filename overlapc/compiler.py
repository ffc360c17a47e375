"""The torch.compile backend: capture with AOTAutograd, rewrite, run with the inner compiler.

    torch.compile(model, backend="overlapc")                          # registered entry point
    torch.compile(model, backend="overlapc", options={"chunks": 4})
    torch.compile(model, backend=overlapc.backend(strategy="decompose"))

Dynamo hands the backend a torch-level graph. AOTAutograd turns it into ATen forward and
backward graphs in which collectives are functional ops. Where the passes run depends on
the inner compiler:

- ``inner="eager"``: in AOTAutograd's forward/backward/inference compilers; the rewritten
  graphs then run as they are.
- ``inner="inductor"``: as inductor's post-grad custom pass, on the graphs inductor is
  about to lower, so that its own decompositions and pattern passes have already run.
"""

from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

import torch

from .options import Options
from .repairs import eager_partition, inductor_partitioner, waited_inputs, with_waited_args
from .report import Report

log = logging.getLogger("overlapc")

# Every compile through the registered "overlapc" name adds its sites here; see last_report().
_GLOBAL_REPORT = Report()
_GLOBAL_LOCK = threading.Lock()


def last_report() -> Report:
    """Sites of every graph compiled through backend="overlapc" in this process (since reset_report())."""
    return _GLOBAL_REPORT


def reset_report():
    with _GLOBAL_LOCK:
        _GLOBAL_REPORT.sites.clear()


class Backend:
    """A torch.compile backend with fixed options; ``.report`` collects what it did."""

    def __init__(
        self,
        options: Options | None = None,
        report: Report | None = None,
        keep_graphs: bool = False,
        extra_passes: tuple = (),
        verify_plans: bool = True,
    ):
        self.options = options or Options()
        self.verify_plans = verify_plans
        """Exchange each graph's plan across ranks when it is compiled (overlapc.agree);
        off for explain(), which runs no collective."""
        self.report = report if report is not None else Report()
        self.extra_passes = tuple(extra_passes)
        """Callables gm -> None run after overlapc's passes (benchmarks use this to strip comm)."""
        self.graphs: list[tuple[str, torch.fx.GraphModule]] | None = [] if keep_graphs else None
        """With keep_graphs: (graph kind, rewritten GraphModule) of every graph compiled."""
        self._bucketed: list = []
        self.warned_overrides: set[str] = set()
        self.pending_rows: list = []
        """Rows of the pass on a joint graph, reported with the next graph compiled."""
        self.__name__ = "overlapc"

    def __call__(self, gm: torch.fx.GraphModule, example_inputs, **kwargs):
        opts = self.options
        extra = dict(kwargs.pop("options", None) or {})
        if kwargs.get("mode") not in (None, "default"):
            extra["mode"] = kwargs.pop("mode")
        kwargs.pop("mode", None)
        if kwargs:
            extra.update(kwargs)
        if extra:
            opts = Options.from_user(opts, **extra)
        return compile_graph(gm, example_inputs, opts, self)

    @property
    def bucketed(self) -> list:
        """The BucketedGraph of every live graph compiled with symbolic sizes (overlapc/buckets.py).
        Weak references: the graphs live as long as dynamo's cache holds them."""
        return [g for g in (r() for r in list(self._bucketed)) if g is not None]

    def __repr__(self):
        return f"overlapc.Backend({self.options})"


def backend(**options: Any) -> Backend:
    """A torch.compile backend with these options: ``torch.compile(m, backend=overlapc.backend(chunks=4))``."""
    return Backend(Options.from_user(None, **options))


def overlapc_backend(gm: torch.fx.GraphModule, example_inputs, options: dict | None = None, **kwargs):
    """The entry point registered as ``torch_dynamo_backends: overlapc``."""
    opts = Options.from_user(options)
    return Backend(opts, _GLOBAL_REPORT)(gm, example_inputs, **kwargs)


def compile_graph(gm, example_inputs, opts: Options, be: Backend):
    example_inputs, waited = waited_inputs(example_inputs)
    return with_waited_args(_compile_located(gm, example_inputs, opts, be), waited)


def _compile_located(gm, example_inputs, opts: Options, be: Backend):
    from .blocks import compile_per_block, locate

    # Called inside dynamo's compile of the first call: the running modules tell which block
    # of which model this graph is (module.compile() per block; see overlapc/blocks.py).
    colls = _has_collectives(gm)
    loc = locate(gm) if colls else None
    if loc is not None and loc.prefix:
        return compile_per_block(
            gm,
            loc,
            opts,
            lambda g, serving: _compile_graph(g, example_inputs, opts, be, serving, colls),
            lambda rows: _add_rows_locked(be, rows),
        )
    return _compile_graph(gm, example_inputs, opts, be, None, colls)


def _compile_graph(gm, example_inputs, opts: Options, be: Backend, serving, colls: bool):
    from .buckets import BucketedGraph, symbolic_inputs

    values = symbolic_inputs(gm) if colls else None
    if values is not None:
        # Sizes are symbols: plan and compile per shape bucket, at the first call in it.
        bucketed = BucketedGraph(gm, values, lambda g, fakes: _compile_static(g, fakes, opts, be, serving))
        be._bucketed[:] = [r for r in be._bucketed if r() is not None] + [weakref.ref(bucketed)]
        return bucketed
    return _compile_static(gm, example_inputs, opts, be, serving)


def _add_rows(be: Backend, rows, serving=None) -> None:
    """Report rows of one compiled program, also under every block that runs it; the caller
    holds _GLOBAL_LOCK."""
    be.report.extend(rows)
    if serving is not None:
        serving.rows.extend(rows)
        be.report.extend(serving.copies(rows, serving.aliases))


def _add_rows_locked(be: Backend, rows, serving=None) -> None:
    with _GLOBAL_LOCK:
        _add_rows(be, rows, serving)


def _alternative_options(opts: Options, planned_rows) -> tuple[str, Options]:
    """The other family's options for option adapt to race (only where ``microbatches`` is
    "auto": a number is the user's choice): micro-batch slices alone where the planner chose
    row chunks, row chunks where it chose slices. Every rank plans it like any graph."""
    if any(r.pattern == "microbatch" and r.status == "rewritten" for r in planned_rows):
        return "row chunks, no slices", Options.from_user(opts, microbatches=1)
    return "2 micro-batch slices", Options.from_user(opts, microbatches=2, strategy="none")


def _differs(changed: bool, rows, planned_rows) -> bool:
    """Whether an alternative's plan is worth racing: it changes the graph, and not as planned."""

    def plan(rs):
        return sorted((r.name, r.status, r.strategy, r.chunks) for r in rs)

    return changed and plan(rows) != plan(planned_rows)


def _raced_copies(g, opts: Options):
    """Copies of ``g`` before the passes change it, for option adapt: the baseline (None where
    the graph is not adapted; :func:`_lower_base` gives it the planned graph's collective forms) and the
    graph the alternative is planned on (None unless ``microbatches`` is "auto": the planner
    chose between slices and row chunks; the other races)."""
    from overlapc.passes.build import copy_graph_module

    from .runtime.adapt import may_adapt

    base = copy_graph_module(g) if may_adapt(opts) else None
    other = copy_graph_module(g) if base is not None and opts.microbatches == "auto" else None
    return base, other


def _lower_base(base, opts: Options):
    """The program to beat runs its reduce-scatters and all-gathers as the planned one does
    (passes/forms.py): the race decides the sites, not the collective forms. Called after the
    passes ran on the planned graph, which measured the forms on the live group."""
    from overlapc.passes.forms import lower_collectives

    if lower_collectives(base.graph, opts):
        base.recompile()
    return base


def _alternative(gm, kind: str, opts: Options, be: Backend, serving, planned_rows):
    """The alternative (see ``_alternative_options``) applied to ``gm``: (graph, report rows,
    label), or None where it changes nothing or plans the same."""
    label, alt = _alternative_options(opts, planned_rows)
    rows = _run_passes(gm, kind, alt, be, serving, record=False)
    return (gm, rows, label) if _differs(bool(gm.meta.get("overlapc_changed")), rows, planned_rows) else None


def _has_collectives(gm) -> bool:
    """Whether the ATen graphs may hold collectives: explicit functional collectives, or
    DTensors (whose redistributions become collectives only when AOTAutograd traces)."""
    from torch.distributed.tensor import DTensor

    for n in gm.graph.nodes:
        if n.op == "call_function" and "_c10d_functional" in str(n.target):  # every functional collective
            return True
        if isinstance(n.meta.get("example_value"), DTensor):
            return True
    return False


def _compile_static(gm, example_inputs, opts: Options, be: Backend, serving=None):
    log.info("overlapc: compiling a graph of %d nodes (%s)", len(gm.graph.nodes), _brief(opts))
    from torch._functorch import config as functorch_config

    # Before AOTAutograd, so that the backward it derives is grouped too.
    from overlapc.passes.expert_loop import group_expert_loops

    loops = group_expert_loops(gm, opts, "forward" if torch.is_grad_enabled() else "inference")
    with _GLOBAL_LOCK:
        _add_rows(be, loops, serving)
    for s in loops:
        log.info("overlapc: %s %s%s", s.name, s.status, f" ({s.reason})" if s.reason else "")
    # A cache hit would skip the passes, and with them the report.
    with functorch_config.patch(enable_autograd_cache=False):
        if opts.inner == "eager":
            return _compile_eager(gm, example_inputs, opts, be, serving)
        return _compile_inductor(gm, example_inputs, opts, be, serving)


def _run_passes(gm, kind: str, opts: Options, be: Backend, serving=None, record: bool = True):
    """overlapc's passes on one ATen graph; with ``record``, its rows go to the report (an
    alternative program, raced by option adapt, reports its rows only where it is kept)."""
    from overlapc.passes import optimize

    sites = optimize(gm, kind, opts, joint_done=True)
    for p in be.extra_passes:
        p(gm)
    if be.extra_passes:
        gm.recompile()
    if be.verify_plans:
        from .agree import check_plans_agree

        check_plans_agree(kind, sites)
        from .runtime import lanes

        # After the plans agreed: every rank of a group then makes its lanes at the same point.
        # (explain() agrees on nothing and runs nothing: its graphs need no lanes.)
        lanes.ensure(lanes.lanes_in(gm.graph))
    if not record:
        return sites
    with _GLOBAL_LOCK:
        sites, be.pending_rows = be.pending_rows + sites, []
        _add_rows(be, sites, serving)
        if be.graphs is not None:
            be.graphs.append((kind, gm))
        # After the last graph of a capture (its backward, or an inference graph): a glob that
        # matched no site so far is most likely a typo or a name from another layout.
        if opts.overrides and kind in ("backward", "inference"):
            # Names of the blocks that may run this program count as matched.
            names = [s.name for s in be.report.sites] + (serving.names(serving.rows) if serving else [])
            for glob in opts.unmatched_overrides(names):
                if glob not in be.warned_overrides:
                    be.warned_overrides.add(glob)
                    log.warning(
                        "overlapc: override %r matched no site; site names look like %r (see overlapc.explain)",
                        glob,
                        next(
                            (s.name for s in sites if s.pattern != "collective"),
                            "forward:layers.0.attention:all_gather_matmul",
                        ),
                    )
    if sites:
        from .report import format_table

        log.info("overlapc: %s graph\n%s", kind, format_table(sites))
    return sites


def _name_failures(compiled, kind: str, sites: list[str]) -> None:
    """Make a collective failure inside an inductor-compiled graph name its rewritten sites
    (inductor writes the waits itself, so the exact chunk is not known)."""
    from .runtime.waits import named_failures

    inner = getattr(compiled, "current_callable", None)
    if sites and callable(inner):
        compiled.current_callable = named_failures(inner, kind, sites)
    elif sites:
        log.info(
            "overlapc: this inductor's compiled graph has no current_callable; "
            "collective failures in it will not name their sites"
        )


def _compile_eager(gm, example_inputs, opts, be, serving=None):
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    rows_pass = _RowsPass(opts, be, example_inputs)

    def compiler(kind):
        def compile_fn(g, _inputs):

            from .runtime.adapt import Adaptive, race_ranks
            from .runtime.waits import name_waits

            if kind == "inference":
                rows_pass(g.graph)
                g.recompile()
            base, other = _raced_copies(g, opts)
            sites = _run_passes(g, kind, opts, be, serving)
            # A failing chunked collective names its site and chunk.
            planned = make_boxed_func(name_waits(g).forward)
            ranks = base is not None and race_ranks(bool(g.meta.get("overlapc_changed")), sites)
            if ranks:
                alt = _alternative(other, kind, opts, be, serving, sites) if other is not None else None
                if alt is not None:
                    alt = (make_boxed_func(name_waits(alt[0]).forward), *alt[1:])
                return Adaptive(
                    planned,
                    make_boxed_func(_lower_base(base, opts).forward),
                    kind=kind,
                    rows=sites,
                    ranks=ranks,
                    steps=opts.adapt,
                    alternative=alt,
                    add_rows=lambda rows: _add_rows_locked(be, rows, serving),
                )
            return planned

        return compile_fn

    return aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        inference_compiler=compiler("inference"),
        partition_fn=eager_partition(rows_pass),
    )(gm, example_inputs)


def _replicated_inputs(example_inputs) -> list:
    """Per graph input of the program (a tensor subclass flattens to its inner tensors, as
    AOTAutograd flattens it), the process groups its value is replicated over, for automatic
    sequence parallelism (passes/auto_sp.py): a DTensor's mesh dims with a Replicate placement,
    and a plain ``nn.Parameter`` over every group of the program's DTensor meshes. Tensor
    parallelism leaves a module it does not shard (a norm) with plain parameters that every
    rank holds equal, as DTensor's implicit replication does; overlapc relies on it too (option
    ``auto_sp="off"`` where a program holds them unequal on purpose). Other inputs: none."""
    from torch.distributed.tensor import DTensor, Replicate

    meshes = {x.device_mesh for x in example_inputs if isinstance(x, DTensor)}
    groups = {m.get_group(i).group_name for m in meshes for i in range(m.ndim)}

    def flat(x, same: set) -> list:
        if not isinstance(x, torch.Tensor) or not hasattr(x, "__tensor_flatten__"):
            return [same]
        if isinstance(x, DTensor):
            mesh = x.device_mesh
            same = {mesh.get_group(i).group_name for i, p in enumerate(x.placements) if isinstance(p, Replicate)}
        out = []
        for i, attr in enumerate(x.__tensor_flatten__()[0]):
            out += flat(getattr(x, attr), same if i == 0 and isinstance(x, DTensor) else set())
        return out

    out = []
    for x in example_inputs:
        out += flat(x, set(groups) if isinstance(x, torch.nn.Parameter) else set())
    return out


class _RowsPass:
    """Automatic sequence parallelism (passes/auto_sp.py) on a joint or inference graph, before
    the partitioner: its rows go to the report with the next graph's."""

    def __init__(self, opts: Options, be: Backend, example_inputs=()):
        self.opts, self.be = opts, be
        self.replicated = _replicated_inputs(example_inputs)

    def __call__(self, graph: torch.fx.Graph) -> None:
        from overlapc.passes import ops
        from overlapc.passes.auto_sp import auto_sequence_parallel

        if not any(n.target is ops.ALL_REDUCE for n in graph.nodes):
            return
        joint = any(n.op == "placeholder" and n.name.startswith("tangents") for n in graph.nodes)
        rows = auto_sequence_parallel(graph, "joint" if joint else "inference", self.opts, self.replicated)
        with _GLOBAL_LOCK:
            self.be.pending_rows.extend(rows)

    def uuid(self):
        return None  # never cache: the report must be rebuilt on every compile


def _overlap_pass_class():
    from torch._inductor.custom_graph_pass import CustomGraphPass

    class OverlapPass(CustomGraphPass):
        """inductor post-grad custom pass; the graph kind comes from the inner-compile call."""

        def __init__(self, opts: Options, be: Backend, serving=None, record: bool = True):
            self.opts, self.be, self.serving, self.record = opts, be, serving, record
            self.kind = "forward"
            self.rewritten: list[str] = []
            self.sites: list = []
            self.changed = False

        def __call__(self, graph: torch.fx.Graph) -> None:
            gm = graph.owning_module
            sites = _run_passes(gm, self.kind, self.opts, self.be, self.serving, record=self.record)
            self.sites, self.changed = sites, bool(gm.meta.get("overlapc_changed"))
            self.rewritten = [s.name for s in sites if s.status == "rewritten"]
            from .runtime.dropless import pipelines_of

            for p in pipelines_of(graph):  # their bodies are decomposed graphs: compile them too
                p.compile_body = True
            if gm.meta.get("overlapc_changed"):
                _keep_order_in_inductor()

        def uuid(self):
            return None  # never cache: the report must be rebuilt on every compile

    return OverlapPass


def _compile_inductor(gm, example_inputs, opts, be, serving=None):
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    pass_ = _overlap_pass_class()(opts, be, serving)

    from .runtime.adapt import Adaptive, race_ranks

    def order_kept():
        # The pass may switch scheduler settings for its graph (see _keep_order_in_inductor);
        # they are restored for the next one.
        return inductor_config.patch(
            {k: getattr(inductor_config, k) for k in _ORDER_SETTINGS if hasattr(inductor_config, k)}
        )

    def compile_beside(g, inputs, kw, graph_pass):
        """``g`` compiled again beside the planned program (the baseline: no pass; the
        alternative: its own): its callable, or None where its outputs are laid out otherwise.
        The tracing context holds the output strides of one compile (the planned one's, which
        AOTAutograd uses): this compile must not see or keep its own."""
        ctx = torch._guards.TracingContext.try_get()
        strides = list(ctx.output_strides) if ctx is not None and ctx.output_strides is not None else None
        if strides is not None:
            ctx.output_strides.clear()
        try:
            with order_kept(), inductor_config.patch({"post_grad_custom_post_pass": graph_pass}):
                out = compile_fx_inner(g, inputs, **kw)
            same = strides is None or list(ctx.output_strides) == strides
        finally:
            if strides is not None:
                ctx.output_strides[:] = strides
        if not same:  # AOTAutograd would restride its outputs wrongly
            log.info("overlapc: %s graph: a raced program's outputs have other strides; not raced", pass_.kind)
            return None
        return out.current_callable if callable(getattr(out, "current_callable", None)) else None

    def inner_compile(g, inputs, **kw):
        pass_.kind = "backward" if kw.get("is_backward") else "inference" if kw.get("is_inference") else "forward"
        pass_.rewritten, pass_.sites, pass_.changed = [], [], False
        base, other = _raced_copies(g, opts)
        with order_kept():
            out = compile_fx_inner(g, inputs, **kw)
        _name_failures(out, pass_.kind, pass_.rewritten)
        ranks = base is not None and race_ranks(pass_.changed, pass_.sites)
        if not ranks or not callable(getattr(out, "current_callable", None)):
            return out
        baseline = compile_beside(_lower_base(base, opts), inputs, kw, None)  # the program to beat
        if baseline is None:
            return out
        alt = None
        if other is not None:
            label, alt_opts = _alternative_options(opts, pass_.sites)
            alt_pass = _overlap_pass_class()(alt_opts, be, serving, record=False)
            alt_pass.kind = pass_.kind
            fn = compile_beside(other, inputs, kw, alt_pass)
            if fn is not None and _differs(alt_pass.changed, alt_pass.sites, pass_.sites):
                alt = (fn, alt_pass.sites, label)
        out.current_callable = Adaptive(
            out.current_callable,
            baseline,
            kind=pass_.kind,
            rows=pass_.sites,
            ranks=ranks,
            steps=opts.adapt,
            alternative=alt,
            add_rows=lambda rows: _add_rows_locked(be, rows, serving),
        )
        return out

    patches = {
        "post_grad_custom_post_pass": pass_,
        "joint_custom_pre_pass": _RowsPass(opts, be, example_inputs),
        "fx_graph_cache": False,
    }
    if opts.mode and opts.mode != "default":
        patches.update(torch._inductor.list_mode_options(opts.mode))
    patches.update(_inductor_guards(inductor_config))
    partitioner = inductor_partitioner(inductor_config)
    if partitioner is not None:
        patches["custom_partitioner_fn"] = partitioner
    return compile_fx(gm, example_inputs, inner_compile=inner_compile, config_patches=patches)


def _inductor_guards(inductor_config) -> dict:
    """inductor's own comm reordering passes, off: overlapc places the collectives it emits."""
    guards = {}
    for key in ("reorder_for_compute_comm_overlap", "aten_distributed_optimizations.enable_overlap_scheduling"):
        if key in inductor_config._config:
            guards[key] = False
    return guards


# Settings _keep_order_in_inductor changes for one graph, restored after it compiles.
_ORDER_SETTINGS = ("reorder_for_peak_memory", "_post_fusion_custom_pass")


def _keep_order_in_inductor():
    """Keep overlapc's comm/compute order through inductor's scheduler, for this graph.

    inductor fuses kernels and then re-sorts its nodes depth-first by buffer name; a kernel
    fused with an early node pulls its dependencies forward in that order, which can issue
    a chunk's collective only after an earlier chunk's GEMM, or wait for every chunk before
    the first GEMM. After fusion, the nodes are re-ordered with the same list scheduler as
    the FX graph (collectives as soon as ready, waits as late as possible, the rest in
    order); the peak-memory reordering that would run after it is switched off.
    """
    from torch._inductor import config as inductor_config

    inductor_config.reorder_for_peak_memory = False
    if not hasattr(inductor_config, "_post_fusion_custom_pass"):
        log.info("overlapc: this inductor has no post-fusion hook; its scheduler may move comm")
        return
    prev = inductor_config._post_fusion_custom_pass

    def hook(nodes):
        if prev is not None:
            nodes = prev(nodes)
        return reorder_scheduler_nodes(nodes)

    inductor_config._post_fusion_custom_pass = hook


def _origins(snode) -> list:
    """FX nodes an inductor scheduler node was lowered from."""
    ir_node = getattr(snode, "node", None)
    origins = getattr(ir_node, "origins", None) if ir_node is not None else None
    return list(origins or ())


def reorder_scheduler_nodes(nodes: list) -> list:
    from torch._inductor.utils import is_collective, is_wait

    from overlapc.passes.schedule import issue_after, list_schedule

    producer = {}
    for n in nodes:
        for name in n.get_buffer_names():
            producer[name] = n
        for name in n.get_operation_names():
            producer.setdefault(name, n)
    preds = {n: [producer[d.name] for d in n.unmet_dependencies if d.name in producer] for n in nodes}
    # Scheduling edges the FX schedule recorded (see passes/schedule.serialize_collectives).
    by_origin = {}
    for n in nodes:
        for o in _origins(n):
            by_origin.setdefault(o.name, n)
    for n in nodes:
        for o in _origins(n):
            preds[n].extend(by_origin[a] for a in issue_after(o) if a in by_origin and by_origin[a] is not n)
    early = {n for n in nodes if getattr(n, "node", None) is not None and is_collective(n.node) and not is_wait(n.node)}
    late = {n for n in nodes if getattr(n, "node", None) is not None and is_wait(n.node)}
    try:
        return list_schedule(nodes, preds, early, late, collectives=early, timing=_timing(nodes, preds, early, late))
    except RuntimeError as e:  # an FX scheduling edge that inductor's fusion turned into a cycle
        log.warning("overlapc: kept inductor's node order (%s)", e)
        return nodes


def _timing(nodes: list, preds: dict, early: set, late: set):
    """The FX schedule's estimates (passes/schedule.estimate) carried to inductor's scheduler
    nodes through their origins: a node's seconds are its origins'. None where the FX graph
    had none, or a collective's origin lost them."""
    from overlapc.passes import ops
    from overlapc.passes.schedule import EST_KEY, Timing

    tm = Timing()
    for n in nodes:
        origins = _origins(n)
        if n in early:
            colls = [o for o in origins if ops.is_collective(o) and EST_KEY in o.meta]
            if not colls:
                return None
            tm.wire[n] = ops.group_name(colls[0])
        elif n in late:
            waited = [p for p in preds[n] if p in early]
            if waited:
                tm.waited[n] = waited[0]
            continue
        tm.seconds[n] = sum(o.meta.get(EST_KEY, 0.0) for o in origins)
    return tm if tm.wire else None


def _brief(opts: Options) -> str:
    d = Options()
    diff = {k: getattr(opts, k) for k in Options.names() if getattr(opts, k) != getattr(d, k)}
    return ", ".join(f"{k}={v!r}" for k, v in diff.items()) or "defaults"
