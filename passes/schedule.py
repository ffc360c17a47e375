"""Schedule: issue collectives as early as their inputs allow, wait as late as users allow.

A list scheduler over the graph's dependency DAG (networkx). Nodes are emitted in
topological order; among the ready nodes it prefers

1. collectives, and the cheap layout ops (views, slices, contiguous copies) that only
   exist to feed one, so communication starts the moment its data exists;
2. any other node: first the compute that leads to the earliest collective (so the
   communication it feeds can start), then compute that feeds none, deferred at most to
   the next collective it preceded (bounded memory), otherwise in the original order;
3. waits (and the views that only reshape a wait's result) last, and among them the one
   whose result is needed first.

Communication then hides under whatever independent compute the graph has: the next
chunk's GEMM in a decomposed site, or, in backward, the weight-gradient GEMMs.

Where the plan's profile has measured times for every collective of the graph, the order
also follows estimated time (:class:`Timing`): compute that feeds no collective (weight
gradients) is spent only while a collective is estimated on the wire. Without that, every
ready weight gradient runs under the first collective after it, and the next one (in a
backward: the all-gather of the following layer's output gradient, or the embedding's) finds
nothing left to hide under. Held items wait at most until the collective after the one they
preceded is issued (bounded memory, as above).

Nodes with side effects (in-place updates of inputs, RNG state) are barriers: nothing
moves across them. Placeholders stay first and the output last. The result is a
topological order of the same nodes, so the same on every rank.
"""

from __future__ import annotations

import heapq
import operator
from dataclasses import dataclass, field

import networkx as nx
from torch.fx import Graph, Node

from overlapc.runtime import lanes as lanes_mod

from . import ops
from .forms import PRICED_AS

CHEAP = ops.LAYOUT_OPS | {
    ops.aten.slice.Tensor,
    ops.aten.select.int,
    ops.aten.narrow.default,
    ops.aten.split.Tensor,
    ops.aten.split_with_sizes.default,
    operator.getitem,
    ops.aten.expand.default,
}


def _is_barrier(node: Node) -> bool:
    if node.op != "call_function":
        return False
    if ops.is_collective(node) or node.target is ops.WAIT:
        return False
    return ops.is_impure(node)


def dependency_dag(graph: Graph) -> nx.DiGraph:
    """Data edges plus barrier edges (everything before a barrier -> it -> everything after)."""
    g = nx.DiGraph()
    nodes = list(graph.nodes)
    for n in nodes:
        g.add_node(n)
        for i in n.all_input_nodes:
            g.add_edge(i, n)
    last_barrier = None
    seen: list[Node] = []
    for n in nodes:
        if n.op in ("placeholder", "output"):
            continue
        if last_barrier is not None:
            g.add_edge(last_barrier, n)
        if _is_barrier(n):
            for m in seen:
                g.add_edge(m, n)
            last_barrier = n
            seen = []
        seen.append(n)
    return g


def _feeders(dag: nx.DiGraph, colls: list[Node]) -> set[Node]:
    """Collectives plus the cheap nodes whose only purpose is to feed them."""
    out = set(colls)
    stack = list(colls)
    while stack:
        n = stack.pop()
        for p in dag.predecessors(n):
            if p in out or p.op != "call_function" or p.target not in CHEAP:
                continue
            if all(u in out for u in dag.successors(p)):
                out.add(p)
                stack.append(p)
    return out


def _waiters(dag: nx.DiGraph, waits: list[Node]) -> set[Node]:
    """Waits plus the cheap nodes that only reshape their results."""
    out = set(waits)
    stack = list(waits)
    while stack:
        n = stack.pop()
        for u in dag.successors(n):
            if u in out or u.op != "call_function" or u.target not in CHEAP:
                continue
            if all(p in out or p.op in ("placeholder", "get_attr") for p in dag.predecessors(u)):
                out.add(u)
                stack.append(u)
    return out


@dataclass
class Timing:
    """Estimated seconds of the items :func:`list_schedule` places, for time-aware placement of
    compute that feeds no collective."""

    seconds: dict = field(default_factory=dict)
    """item -> seconds: a compute item's run time, a collective's time on the wire (absent: 0)."""
    wire: dict = field(default_factory=dict)
    """collective item -> the wire it is sent on (its process group): one at a time on each."""
    waited: dict = field(default_factory=dict)
    """wait item -> the collective item it completes."""


def list_schedule(
    items: list, preds: dict, early: set, late: set, collectives: set | None = None, timing: Timing | None = None
) -> list:
    """Topological order of ``items`` (given in their current order) that emits ``early``
    items as soon as they are ready, ``late`` items only when nothing else is ready (the
    one needed soonest first), and everything else in its current order.

    Given ``collectives``, among the other ready items those that lead to the earliest
    collective go first: compute that unblocks communication runs before compute that
    does not (in backward: input-gradient GEMMs, whose results are reduce-scattered,
    before weight-gradient GEMMs, which then run while the reduce-scatter is on the wire).
    Compute that feeds no collective is deferred at most to the next collective it
    preceded, never to the end of the graph.

    With ``timing`` (and ``collectives``), such compute is held back while no collective is
    estimated in flight and a wait or comm-feeding compute is ready instead, so it is left for
    the next collective to hide under; it is due (no longer held) once the collective after the
    one it preceded is issued. The order of the collectives themselves does not depend on
    ``timing``: it only decides between that compute and waits, which feed no collective issue
    ahead of the compute that does.

    ``preds[i]`` lists the items ``i`` depends on. Shared by the FX-level schedule and the
    inductor scheduler-node hook (overlapc.compiler), so both place comm the same way.
    """
    pos = {n: i for i, n in enumerate(items)}
    succs: dict = {n: [] for n in items}
    indeg = {}
    for n in items:
        ps = [p for p in dict.fromkeys(preds.get(n, ())) if p in pos and p is not n]
        indeg[n] = len(ps)
        for p in ps:
            succs[p].append(n)
    key = {n: (pos[n], 0) for n in items}
    first: dict = {}
    # following[p]: position of the collective after the one at position p (in the current order)
    coll_pos = sorted(pos[n] for n in collectives or ())
    following = {p: q for p, q in zip(coll_pos, coll_pos[1:] + [len(items)])}
    if collectives:
        # first[n]: position of the first collective n (transitively) feeds; items are in
        # a topological order, so one reverse pass suffices. An item that feeds none is
        # keyed by the next collective after it in the current order, behind that
        # collective's feeders: it may yield to comm-feeding compute, but only up to the
        # collective it already preceded, so (say) a weight-gradient GEMM is deferred past
        # its own layer's input-gradient GEMMs and no further (activation memory stays
        # bounded by one layer).
        inf = len(items)
        nxt = inf
        # Scheduling edges (ISSUE_AFTER) may point forward in the current order: walk a
        # topological order of ``preds`` (the current one where it is already one).
        forward = all(pos[p] < pos[n] for n in items for p in preds.get(n, ()) if p in pos and p is not n)
        topo = items if forward else list_schedule(items, preds, set(), set())
        for n in reversed(topo):
            if n in collectives:
                nxt = pos[n]
            f = min([pos[n] if n in collectives else inf] + [first[u] for u in succs[n]])
            first[n] = f
            key[n] = (f, 0) if f < inf else (nxt, 1)
    # When a late item is needed: the earliest position of a non-late item it feeds. Among
    # late items, those that lead to a collective go first, the earliest collective first: a
    # chain's next collective (reduce-scatter chunk c -> residual and norm of its rows ->
    # all-gather chunk c) is issued as soon as its chunk has arrived, not behind the waits
    # of chunks a whole-tensor user (the residual stream) needs first in the captured order.
    need: dict = {}
    for n in reversed(items):
        if n in late:
            need[n] = min((need[u] if u in late else pos[u] for u in succs[n]), default=len(items))
    ready_early, ready_mid, ready_late = [], [], []

    def push(n):
        if n in early:
            heapq.heappush(ready_early, (pos[n], n))
        elif n in late:
            heapq.heappush(ready_late, (first.get(n, len(items)), need[n], pos[n], n))
        else:
            heapq.heappush(ready_mid, (*key[n], pos[n], n))

    for n in items:
        if indeg[n] == 0:
            push(n)
    clock = _Clock(timing) if timing is not None and collectives else None
    issued: set[int] = set()

    def held(entry) -> bool:
        """Compute that feeds no collective, not yet due, with nothing on the wire to hide under."""
        f, deferred, *_ = entry
        return deferred == 1 and following.get(f, len(items)) not in issued and not clock.in_flight()

    order = []
    while ready_early or ready_mid or ready_late:
        q = ready_early or ready_mid or ready_late
        if q is ready_mid and clock is not None and held(ready_mid[0]):
            busy = [e for e in ready_mid if e[1] == 0]
            if busy:  # compute that leads to a collective: gets the wire going
                ready_mid.remove(e := min(busy))
                heapq.heapify(ready_mid)
                n = e[-1]
            else:
                n = heapq.heappop(ready_late or ready_mid)[-1]
        else:
            n = heapq.heappop(q)[-1]
        order.append(n)
        if collectives and n in collectives:
            issued.add(pos[n])
        if clock is not None:
            clock.run(n)
        for u in succs[n]:
            indeg[u] -= 1
            if indeg[u] == 0:
                push(u)
    if len(order) != len(items):
        raise RuntimeError("overlapc: the dependency graph has a cycle; refusing to reorder it")
    return order


class _Clock:
    """One compute thread and one wire per process group, advanced item by item in the order
    being built: a collective starts when it is issued and its wire is free; a wait ends when
    its collective does."""

    def __init__(self, timing: Timing):
        self.timing, self.now, self.free, self.done = timing, 0.0, {}, {}

    def in_flight(self) -> bool:
        return any(t > self.now for t in self.free.values())

    def run(self, n) -> None:
        tm = self.timing
        if n in tm.wire:
            g = tm.wire[n]
            self.free[g] = self.done[n] = max(self.now, self.free.get(g, 0.0)) + tm.seconds.get(n, 0.0)
        elif n in tm.waited:
            self.now = max(self.now, self.done.get(tm.waited[n], self.now))
        else:
            self.now += tm.seconds.get(n, 0.0)


# Backends on which at most one all-gather per group may be in flight. gloo (torch 2.13,
# CPU) corrupts the heap when two functional all-gathers of one group are outstanding at
# once over a slow link (one at a time never failed; the earlier note that it also failed
# with one gloo worker thread is void: the World's thread option never took effect, as
# init_process_group ignores gloo's pg_options), so each all-gather there is issued only
# after the previous one was waited on.
# All-to-alls are not serialized: 4 in flight, 100-150 rounds over a shaped link, inputs
# views of dropped buffers, stayed exact (serializing them halved the MoE overlap: the
# combine of chunk c then waits for the dispatch of chunk c + 1).
SERIAL_BACKENDS = ("gloo",)
SERIAL_OPS = (ops.ALL_GATHER,)
# Where a gloo group runs collectives on more than one worker thread (its default: 2), two
# of different gloo algorithms must not be in flight at once: an all-gather beside
# reduce-scatters (gloo runs those as all-reduces) over a shaped link hung in gloo's TCP
# transport ("Timed out waiting ... for send operation to complete") in 2 of 6 two-minute
# runs of benchmarks/experiments/gloo_stress.py, and aborted twice with a corrupted heap in the
# benchmark; reduce-scatters beside reduce-scatters did not fail (2 runs). One worker
# thread would run them in issue order, so there this is not done (not measured: such a
# group cannot be made through init_process_group). So on multi-threaded gloo groups a
# collective is issued only after every collective of the last run of another family was
# waited on.
GLOO_FAMILY = {
    ops.ALL_GATHER: "allgather",
    ops.REDUCE_SCATTER: "allreduce",
    ops.ALL_REDUCE: "allreduce",
    ops.ALL_TO_ALL: "alltoall",
}
ISSUE_AFTER = "overlapc_issue_after"
"""node.meta key: names of the nodes this one must not be scheduled before (scheduling
edges): the previous wait of a serialized all-gather, the waits of the other family's
collectives on a multi-threaded gloo group, the last chunked all-to-all of a region for its
deferred sums. Honoured by :func:`schedule` and the inductor hook (overlapc.compiler)."""


def issue_after(node: Node) -> tuple[str, ...]:
    """The names in ``node``'s scheduling edges (:data:`ISSUE_AFTER`)."""
    return tuple(node.meta.get(ISSUE_AFTER, ()))


def add_issue_after(node: Node, *before: Node) -> None:
    """Schedule ``node`` after each of ``before`` (recorded in node.meta[ISSUE_AFTER])."""
    names = issue_after(node)
    node.meta[ISSUE_AFTER] = names + tuple(b.name for b in before if b.name not in names and b is not node)


def serialize_collectives(nodes: list[Node], lanes: int = 0) -> dict[Node, list[Node]]:
    """{collective: the waits it must be issued after}, for groups on gloo.

    An all-gather waits for the previous all-gather of its group. Where the group has more
    than one worker thread, a collective also waits for every collective of the group's
    last run of another family (:data:`GLOO_FAMILY`, in the order of ``nodes``): runs of one
    family then never overlap runs of another, while the collectives inside a run (chunked
    reduce-scatters, all-to-alls) stay concurrent. Also records the edges in
    node.meta[ISSUE_AFTER], for schedulers that see the graph through another representation
    (the inductor hook in overlapc.compiler). They cannot create a cycle: each points at the
    wait of a collective earlier in a topological order, which cannot depend on this one.

    With ``lanes`` > 0, a gloo group's all-gathers move to that many lanes
    (overlapc/runtime/lanes.py), taken in turn: separate communicators over the same ranks, so
    they are no longer kept apart from the group's reduce-scatters, and up to ``lanes``
    all-gathers are in flight at once (one per lane). Only groups with an all-gather and some
    other collective in ``nodes`` get lanes: a lone all-gather has nothing to overlap with.
    """
    after: dict[Node, list[Node]] = {}
    serial: dict[str, tuple[bool, bool]] = {}
    last_wait: dict[tuple, Node] = {}
    runs: dict[str, list] = {}  # group -> [family, waits of the current run, waits of the run before]
    laned = _laned_groups(nodes) if lanes > 0 else set()
    gathers: dict[str, int] = {}
    for n in nodes:
        if n.target not in GLOO_FAMILY:
            continue
        g = ops.group_name(n)
        base = lanes_mod.base_group(g)
        if base not in serial:
            gloo = ops.group_backend(base) in SERIAL_BACKENDS
            serial[base] = (gloo, gloo and ops.group_comm_threads(base) > 1)
        one_gather, families_apart = serial[base]
        if n.target is ops.ALL_GATHER and (lanes_mod.is_lane(g) or (one_gather and g in laned and _on_cpu(n))):
            if not lanes_mod.is_lane(g):
                k = gathers[g] = gathers.get(g, -1) + 1
                g = lanes_mod.lane_name(g, k % lanes)
                ops.set_group_name(n, g)
            families_apart = False  # a lane carries all-gathers only
        before = []
        if one_gather and n.target in SERIAL_OPS and (g, n.target) in last_wait:
            before.append(last_wait[(g, n.target)])
        w = ops.wait_of(n)
        if families_apart:
            fam = GLOO_FAMILY[n.target]
            run = runs.setdefault(g, [fam, [], []])
            if run[0] != fam:
                run[:] = [fam, [], run[1]]
            before.extend(run[2])
            if w is not None:
                run[1].append(w)
        if w is not None and n.target in SERIAL_OPS:
            last_wait[(g, n.target)] = w
        if before:
            after[n] = before
            add_issue_after(n, *before)
    return after


def _on_cpu(coll: Node) -> bool:
    """Lanes carry CPU tensors only (they register gloo's CPU backend)."""
    v = ops.val(coll.args[0])
    return v is not None and v.device.type == "cpu"


def _laned_groups(nodes: list[Node]) -> set[str]:
    """Groups (not yet on lanes) whose all-gathers have something to overlap with."""
    count: dict[str, list[int]] = {}
    for n in nodes:
        if n.target in GLOO_FAMILY and not lanes_mod.is_lane(g := ops.group_name(n)):
            c = count.setdefault(g, [0, 0])
            c[n.target is ops.ALL_GATHER] += 1
    return {g for g, (others, gathers) in count.items() if gathers and gathers + others > 1}


TRUSTED = ("measured", "cached", "profile")
"""Where a collective's time must come from for the schedule to place compute by it: a
measurement (the live group's, or the profile's curve). A modelled link time can be off by
more than the compute it would place (a profile of another network); then no compute is held."""
EST_KEY = "overlapc_est_s"
"""node.meta key: the estimated seconds :func:`estimate` gave the node (read by the inductor hook)."""


def estimate(nodes: list[Node], profile) -> Timing | None:
    """Estimated seconds per node under ``profile`` (passes/cost.py): GEMMs and attention by
    their flops at the profile's GEMM rate, other compute by its output's bytes at the local copy
    rate, collectives by the profile's time for their kind, bytes and group size. None where
    ``profile`` is None, a collective's time would be modelled rather than measured
    (:data:`TRUSTED`), or a size is symbolic."""
    from . import cost

    if profile is None:
        return None
    tm = Timing()
    for n in nodes:
        if n.op != "call_function" or n.target in CHEAP:
            continue
        if ops.is_collective(n):
            # a reduce-scatter or all-gather sent as all-to-alls is priced as what it stands for
            kind, size, pieces = n.meta.get(PRICED_AS) or (
                ops.COST_KIND.get(n.target),
                ops.hinted_nbytes(ops.val(n.args[0])),
                1,
            )
            world = ops.world_size(n)
            if kind is None or world is None or size is None or profile.numbers_from(kind, world) not in TRUSTED:
                return None
            sec = cost.t_comm(kind, size, world, profile) / pieces
            tm.wire[n] = ops.group_name(n)
        elif n.target is ops.WAIT:
            tm.waited[n] = n.args[0]
            continue
        else:
            sec = _compute_seconds(n, profile)
        if sec is None or not getattr(sec, "is_number", True):
            return None
        tm.seconds[n] = float(sec)
    for n, sec in tm.seconds.items():
        n.meta[EST_KEY] = sec
    return tm


def _compute_seconds(n: Node, profile):
    from . import cost

    out = ops.val(n)
    if ops.is_matmul(n):
        lhs = ops.val(n.args[ops.MATMULS[n.target][0]])
        if lhs is None or out is None or None in (k := ops.hint(lhs.shape[-1]), m := ops.hint(out.shape[-2])):
            return None
        numel = ops.hint(out.numel())
        flops = None if numel is None else 2 * numel * k
        return None if flops is None else cost.t_gemm(flops, profile.gemm_for(ops.dtype_name(out)), rows=m)
    if "scaled_dot_product" in str(n.target):
        q, k = (ops.val(a) for a in n.args[:2])
        if q is None or k is None or None in (numel := ops.hint(q.numel()), s := ops.hint(k.shape[-2])):
            return None
        # QK^T and PV: 4 * batch * heads * L * S * E; the backward recomputes P and runs 4 more GEMMs
        flops = 4 * numel * s * (3 if "backward" in str(n.target) else 1)
        return cost.t_gemm(flops, profile.gemm_for(ops.dtype_name(q)))
    size = ops.hinted_nbytes(out)
    return 0.0 if out is None else None if size is None else size / profile.copy_bw


def schedule(graph: Graph, lanes: int = 0, profile=None) -> bool:
    """Reorder ``graph`` in place (``lanes``: see :func:`serialize_collectives`; ``profile``: the
    plan's, whose measured collective times let compute be placed by time, see :func:`estimate`).
    Returns whether the order or a collective's group changed."""
    nodes = list(graph.nodes)
    colls = [n for n in nodes if ops.is_collective(n)]
    if not colls:
        return False
    dag = dependency_dag(graph)
    early = _feeders(dag, colls)
    late = _waiters(dag, [n for n in nodes if n.target is ops.WAIT])
    preds = {n: list(dag.predecessors(n)) for n in nodes}
    groups = [ops.group_name(n) for n in colls]
    serialize_collectives(nodes, lanes)
    moved = groups != [ops.group_name(n) for n in colls]
    by_name = {n.name: n for n in nodes}
    for n in nodes:  # scheduling edges: serialized collectives, deferred sums (passes/all_to_all)
        preds[n].extend(by_name[a] for a in issue_after(n) if a in by_name and by_name[a] is not n)
    timing = estimate(nodes, profile)
    order = list_schedule(nodes, preds, early, late, collectives=set(colls), timing=timing)
    return _apply_order(graph, nodes, order) or moved


def legalize(graph: Graph) -> bool:
    """Stable topological sort: restore def-before-use after rewrites inserted nodes early."""
    nodes = list(graph.nodes)
    dag = dependency_dag(graph)
    preds = {n: list(dag.predecessors(n)) for n in nodes}
    return _apply_order(graph, nodes, list_schedule(nodes, preds, set(), set()))


def _apply_order(graph: Graph, before: list[Node], order: list[Node]) -> bool:
    if order == before:
        return False
    # Placeholders first and in their original order (it is the graph's signature), the
    # output last. Moving each node in turn to just before the output rebuilds the list.
    (out,) = [n for n in order if n.op == "output"]
    for n in [n for n in before if n.op == "placeholder"] + [n for n in order if n.op not in ("placeholder", "output")]:
        out.prepend(n)
    graph.lint()
    return True
