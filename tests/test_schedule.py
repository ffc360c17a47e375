"""Where communication ends up: the FX schedule, the gloo all-gather chain, and inductor.

Structural checks on a fake process group (world size 8): after a rewrite, every
chunk's collective is issued before the GEMMs that do not need it, each wait sits right
before the first GEMM that needs it, and inductor's generated code keeps that order.
"""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import overlapc
from overlapc.explain import capture
from overlapc.passes import ops
from overlapc.passes.rows import ancestors
from overlapc.passes.schedule import ISSUE_AFTER, Timing, issue_after, list_schedule, serialize_collectives
from overlapc.runtime import lanes

CHUNKS = 3


def ag_mm_rs(x, w1, w2):
    g = funcol.all_gather_tensor(x, gather_dim=0, group=dist.group.WORLD)
    h = torch.relu(g @ w1)
    return funcol.reduce_scatter_tensor(h @ w2, "sum", scatter_dim=0, group=dist.group.WORLD)


def _inputs():
    return torch.randn(16, 32), torch.randn(32, 64), torch.randn(64, 32)


def _order(gm, kinds):
    return [(n.name, k) for n in gm.graph.nodes for k, pred in kinds.items() if pred(n)]


def test_list_schedule_places_comm():
    # a -> coll -> wait -> use ; independent compute x1, x2 in between
    items = ["a", "x1", "coll", "x2", "wait", "use"]
    preds = {"coll": ["a"], "wait": ["coll"], "use": ["wait", "x2"], "x2": ["x1"]}
    order = list_schedule(items, preds, early={"coll"}, late={"wait"})
    assert order.index("coll") < order.index("x1"), "collective issued as soon as its input exists"
    assert order.index("wait") == order.index("use") - 1, "wait placed right before its first user"


def test_list_schedule_comm_first_is_bounded():
    # Two backward layers, each: wgrad (feeds no collective) listed before dgrad -> rs.
    # Layer 1's dgrad feeds layer 0's compute. Comm-first runs dgrad before wgrad so the
    # reduce-scatter is on the wire during wgrad; wgrad1 must not slide past layer 0.
    items = ["g1", "wgrad1", "dgrad1", "rs1", "wait1", "wgrad0", "dgrad0", "rs0", "wait0", "out"]
    preds = {
        "wgrad1": ["g1"],
        "dgrad1": ["g1"],
        "rs1": ["dgrad1"],
        "wait1": ["rs1"],
        "wgrad0": ["dgrad1"],
        "dgrad0": ["dgrad1"],
        "rs0": ["dgrad0"],
        "wait0": ["rs0"],
        "out": ["wait1", "wait0", "wgrad1", "wgrad0"],
    }
    early, late = {"rs1", "rs0"}, {"wait1", "wait0"}
    plain = list_schedule(items, preds, early, late)
    assert plain.index("wgrad1") < plain.index("dgrad1"), "without collectives: original order"
    order = list_schedule(items, preds, early, late, collectives=early)
    assert order.index("dgrad1") < order.index("rs1") < order.index("wgrad1"), order
    assert order.index("wgrad1") < order.index("dgrad0"), "deferral bounded to the next collective"
    assert order.index("dgrad0") < order.index("rs0") < order.index("wgrad0"), order


def test_list_schedule_waits_that_feed_comm_first():
    # Reduce-scatter chunks rs0, rs1; the residual stream (cat) reads both and comes first in
    # the captured order; norm0 reads chunk 0 and a view of an earlier collective's result
    # (vx: a late item too) and feeds the next all-gather's chunk 0. The all-gather must go
    # out once chunk 0 is in, not after every chunk's wait.
    items = ["ax", "wx", "vx", "rs0", "rs1", "w0", "w1", "cat", "norm0", "ag0", "wag0", "norm1", "ag1", "wag1", "out"]
    preds = {
        "wx": ["ax"],
        "vx": ["wx"],
        "rs0": ["wx"],
        "rs1": ["wx"],
        "w0": ["rs0"],
        "w1": ["rs1"],
        "cat": ["w0", "w1"],
        "norm0": ["w0", "vx"],
        "ag0": ["norm0"],
        "wag0": ["ag0"],
        "norm1": ["w1", "vx"],
        "ag1": ["norm1"],
        "wag1": ["ag1"],
        "out": ["cat", "wag0", "wag1"],
    }
    early, late = {"ax", "rs0", "rs1", "ag0", "ag1"}, {"wx", "vx", "w0", "w1", "wag0", "wag1"}
    order = list_schedule(items, preds, early, late, collectives=early)
    assert order.index("w0") < order.index("ag0") < order.index("w1"), order


def test_list_schedule_keeps_weight_gradients_for_the_next_collective():
    # A backward's tail: dgrad -> rs, then rs's result -> ag -> its user. Two weight gradients
    # (feed no collective) are ready when rs is issued. Greedy, both run under rs and the ag
    # finds nothing to hide under; by estimated time, rs holds one of them and the other is
    # left for the ag.
    items = ["g", "dgrad", "rs", "wg1", "wg2", "wait_rs", "ag", "wait_ag", "use", "out"]
    preds = {
        "dgrad": ["g"],
        "rs": ["dgrad"],
        "wg1": ["g"],
        "wg2": ["g"],
        "wait_rs": ["rs"],
        "ag": ["wait_rs"],
        "wait_ag": ["ag"],
        "use": ["wait_ag"],
        "out": ["use", "wg1", "wg2"],
    }
    early, late = {"rs", "ag"}, {"wait_rs", "wait_ag"}
    greedy = list_schedule(items, preds, early, late, collectives=early)
    assert greedy.index("wg2") < greedy.index("wait_rs") < greedy.index("ag"), greedy

    def timing(comm: float) -> Timing:
        return Timing(
            seconds={"dgrad": 1.0, "wg1": 1.0, "wg2": 1.0, "use": 0.1, "rs": comm, "ag": comm},
            wire={"rs": "tp", "ag": "tp"},
            waited={"wait_rs": "rs", "wait_ag": "ag"},
        )

    order = list_schedule(items, preds, early, late, collectives=early, timing=timing(1.0))
    assert order.index("rs") < order.index("wg1") < order.index("wait_rs"), order
    assert order.index("ag") < order.index("wg2") < order.index("wait_ag"), order
    # collectives issued in the same order whatever the estimates
    assert [n for n in order if n in early] == [n for n in greedy if n in early]
    # comm long enough for both under rs: the greedy order
    assert list_schedule(items, preds, early, late, collectives=early, timing=timing(5.0)) == greedy


def test_list_schedule_holds_no_further_than_the_next_collective():
    # Estimated comm of zero (a link much faster than the estimate's) must not push a weight
    # gradient to the end: held items are due once the collective after the one they preceded
    # is issued.
    items = ["wg", "a", "c1", "w1", "b", "c2", "w2", "d", "c3", "w3", "out"]
    preds = {
        "c1": ["a"],
        "w1": ["c1"],
        "b": ["w1"],
        "c2": ["b"],
        "w2": ["c2"],
        "d": ["w2"],
        "c3": ["d"],
        "w3": ["c3"],
        "out": ["w3", "wg"],
    }
    early, late = {"c1", "c2", "c3"}, {"w1", "w2", "w3"}
    tm = Timing(
        seconds={"wg": 1.0, "a": 1.0, "b": 1.0, "d": 1.0},
        wire={"c1": "g", "c2": "g", "c3": "g"},
        waited={"w1": "c1", "w2": "c2", "w3": "c3"},
    )
    order = list_schedule(items, preds, early, late, collectives=early, timing=tm)
    assert order.index("c2") < order.index("wg") < order.index("c3"), order


def test_estimates_need_measured_collective_times(fake_mesh8):
    # The profile's link formula alone (no measured curve for the group) places nothing by time.
    import dataclasses

    from overlapc.passes import cost
    from overlapc.passes.schedule import estimate

    report, graphs = capture(ag_mm_rs, *_inputs(), options={"strategy": "decompose", "chunks": CHUNKS})
    ((_, gm),) = graphs
    nodes = list(gm.graph.nodes)
    base = cost.load_profile("cpu-default")
    modelled = dataclasses.replace(base, curves={}, world_curves={})
    assert estimate(nodes, modelled) is None
    pts = ((1024, 1e-3), (1 << 20, 1e-1))
    measured = dataclasses.replace(
        modelled, world_curves={8: {"all_gather": pts, "reduce_scatter": pts}}, provenance={}
    )
    tm = estimate(nodes, measured)
    assert tm is not None
    colls = [n for n in nodes if ops.is_collective(n)]
    assert set(tm.wire) == set(colls) and all(tm.seconds[c] > 0 for c in colls)
    mms = [n for n in nodes if n.target is ops.aten.mm.default]
    assert mms and all(tm.seconds[m] > 0 for m in mms)
    # Sent as all-to-alls (passes/forms.py), each piece is priced as its share of the kind it
    # stands for: the live group measured that kind, not "all_to_all".
    lowered = {"strategy": "decompose", "chunks": CHUNKS, "reduce_scatter": "all_to_all", "all_gather": "all_to_all"}
    _, ((_, gm),) = capture(ag_mm_rs, *_inputs(), options=lowered)
    nodes = list(gm.graph.nodes)
    a2as = [n for n in nodes if n.target is ops.ALL_TO_ALL]
    assert a2as and not any(n.target in (ops.ALL_GATHER, ops.REDUCE_SCATTER) for n in nodes)
    tm = estimate(nodes, measured)
    assert tm is not None and all(tm.seconds[a] > 0 for a in a2as)


def test_schedule_keeps_the_signature(fake_mesh8):
    # The second input feeds the collective, the first does not: comm-first ranks the
    # second placeholder first, but placeholders are the graph's signature.
    from torch.fx import Graph

    from overlapc.passes.schedule import schedule

    g = Graph()
    w, x = g.placeholder("w"), g.placeholder("x")
    r = g.call_function(ops.aten.relu.default, (w,))
    ag = g.call_function(ops.ALL_GATHER, (x, 8, dist.group.WORLD.group_name))
    y = g.call_function(ops.aten.add.Tensor, (r, g.call_function(ops.WAIT, (ag,))))
    g.output(y)
    assert schedule(g), "the collective moves ahead of relu"
    nodes = list(g.nodes)
    assert [n.name for n in nodes if n.op == "placeholder"] == ["w", "x"]
    assert nodes.index(ag) < nodes.index(r)


def test_rewritten_graph_order(fake_mesh8):
    report, graphs = capture(ag_mm_rs, *_inputs(), options={"strategy": "decompose", "chunks": CHUNKS})
    assert [s.status for s in report.sites] == ["rewritten", "rewritten"]
    ((_, gm),) = graphs
    seq = [n for n in gm.graph.nodes if n.op == "call_function"]
    ags = [n for n in seq if n.target is ops.ALL_GATHER]
    waits = [ops.wait_of(n) for n in ags]
    mms = [n for n in seq if n.target is ops.aten.mm.default]
    rss = [n for n in seq if n.target is ops.REDUCE_SCATTER]
    pos = {n: i for i, n in enumerate(seq)}
    assert len(ags) == len(rss) == CHUNKS
    # all gathers issued before the first gathered chunk is waited on (fake PG: no chain)
    assert max(pos[a] for a in ags) < min(pos[w] for w in waits)
    # chunk c's GEMM follows chunk c's wait and precedes chunk c+1's wait
    first_mms = [min((m for m in mms if w in m.all_input_nodes), key=pos.get) for w in waits]
    for c in range(CHUNKS - 1):
        assert pos[waits[c]] < pos[first_mms[c]] < pos[waits[c + 1]]
    # each reduce-scatter is issued right after its chunk's GEMM, before the next chunk's GEMM
    rs_in = [r.args[0] for r in rss]
    for c in range(CHUNKS - 1):
        assert pos[rss[c]] < pos[rs_in[c + 1]]


def _ancestors(node):
    return ancestors([node])


def test_row_chunks_chain_from_gather_to_scatter(fake_mesh8):
    """AG -> mm -> relu -> mm -> RS with the same row layout (an MLP): reduce-scatter chunk
    c reads gathered range c's GEMM through relu, so it waits for no later range."""
    report, graphs = capture(ag_mm_rs, *_inputs(), options={"strategy": "decompose", "chunks": CHUNKS})
    ((_, gm),) = graphs
    seq = list(gm.graph.nodes)
    waits = [ops.wait_of(n) for n in seq if n.target is ops.ALL_GATHER]
    rss = [n for n in seq if n.target is ops.REDUCE_SCATTER]
    for c, rs in enumerate(rss):
        anc = _ancestors(rs)
        assert waits[c] in anc, f"scatter chunk {c} computes from gathered range {c}"
        assert not anc & set(waits[c + 1 :]), f"scatter chunk {c} waits for a later gathered range"
    # Not chained when the layouts differ: 2 chunks for the scatter, 3 for the gather.
    report, graphs = capture(
        ag_mm_rs,
        *_inputs(),
        options={"strategy": "decompose", "chunks": CHUNKS, "overrides": {"*matmul_reduce_scatter": {"chunks": 2}}},
    )
    ((_, gm),) = graphs
    seq = list(gm.graph.nodes)
    waits = [ops.wait_of(n) for n in seq if n.target is ops.ALL_GATHER]
    first_rs = next(n for n in seq if n.target is ops.REDUCE_SCATTER)
    assert set(waits) <= _ancestors(first_rs)


@pytest.mark.parametrize("rs_as", ["native", "all_to_all"])
def test_gloo_all_gathers_are_chained(fake_mesh8, monkeypatch, rs_as):
    """On gloo, a chunk's all-gather is issued only after the previous chunk was waited on;
    with more than one gloo worker thread, the reduce-scatters (another gloo algorithm, run
    natively or as all-to-alls) only after every all-gather of the run before them was waited on."""
    monkeypatch.setattr(ops, "group_backend", lambda name: "gloo")
    monkeypatch.setattr(ops, "group_comm_threads", lambda name: 2)
    opts = {"strategy": "decompose", "chunks": CHUNKS, "lanes": 0, "reduce_scatter": rs_as, "all_gather": "native"}
    report, graphs = capture(ag_mm_rs, *_inputs(), options=opts)
    ((_, gm),) = graphs
    seq = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(seq)}
    ags = [n for n in seq if n.target is ops.ALL_GATHER]
    for prev, nxt in zip(ags, ags[1:]):
        w = ops.wait_of(prev)
        assert issue_after(nxt) == (w.name,)
        assert pos[w] < pos[nxt], "the next all-gather waits for the previous one"
        # ... but it is issued before the previous chunk's GEMM, which it overlaps
        mm = next(u for u in w.users if u.target is ops.aten.mm.default)
        assert pos[nxt] < pos[mm]
    after = serialize_collectives(seq)
    assert [n for n in after if n.target is ops.ALL_GATHER] == ags[1:]
    rss = [n for n in seq if n.target is {"native": ops.REDUCE_SCATTER, "all_to_all": ops.ALL_TO_ALL}[rs_as]]
    waits = [ops.wait_of(n) for n in ags]
    assert rss and all(after[rs] == waits for rs in rss), {rs.name: after.get(rs) for rs in rss}
    assert all(pos[w] < pos[rs] for rs in rss for w in waits)
    # One worker thread runs collectives in issue order: only the all-gathers are chained.
    monkeypatch.setattr(ops, "group_comm_threads", lambda name: 1)
    for n in seq:
        n.meta.pop(ISSUE_AFTER, None)
    assert list(serialize_collectives(seq)) == ags[1:]


def test_gloo_all_to_all_forms_share_the_wire(fake_mesh8, monkeypatch):
    """By default on gloo both kinds run as all-to-alls (passes/forms.py): one gloo algorithm,
    neither chained nor kept apart, so the all-gather chunks are all issued before the first
    GEMM and the reduce-scatter chunks before the last all-gather chunk was waited on."""
    monkeypatch.setattr(ops, "group_backend", lambda name: "gloo")
    monkeypatch.setattr(ops, "group_comm_threads", lambda name: 2)
    report, graphs = capture(ag_mm_rs, *_inputs(), options={"strategy": "decompose", "chunks": CHUNKS})
    ((_, gm),) = graphs
    seq = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(seq)}
    a2as = [n for n in seq if n.target is ops.ALL_TO_ALL]
    assert not any(n.target in (ops.ALL_GATHER, ops.REDUCE_SCATTER) for n in seq)
    assert a2as and not serialize_collectives(seq) and not any(issue_after(n) for n in seq)
    gathers = [n for n in a2as if list(n.args[1]) == [1] * 8 and ops.val(n.args[0]).shape[0] == 8]
    scatters = [n for n in a2as if n not in gathers]
    first_mm = min(pos[n] for n in seq if n.target is ops.aten.mm.default)
    assert len(gathers) == CHUNKS and all(pos[n] < first_mm for n in gathers)
    assert min(pos[n] for n in scatters) < max(pos[ops.wait_of(n)] for n in gathers)


@pytest.mark.slow
def test_inductor_keeps_the_overlap(fake_mesh8):
    """inductor fuses and re-sorts kernels; the generated code must keep chunk order."""
    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    be = overlapc.backend(strategy="decompose", chunks=CHUNKS)
    fn = torch.compile(ag_mm_rs, backend=be)
    _, codes = run_and_get_code(fn, *_inputs())
    code = "\n".join(codes)
    lines = [
        ln.strip()
        for ln in code.splitlines()
        if "all_gather_into_tensor.default(" in ln
        or "wait_tensor.default(" in ln
        or "extern_kernels.mm(" in ln
        or "reduce_scatter_tensor.default(" in ln
    ]
    kinds = [
        "ag" if "all_gather" in ln else "rs" if "reduce_scatter" in ln else "wait" if "wait" in ln else "mm"
        for ln in lines
    ]
    # every gather issued up front, then: wait, GEMM(s) of that chunk, wait, GEMM(s), ...
    assert kinds[:CHUNKS] == ["ag"] * CHUNKS, kinds
    first_mm = kinds.index("mm")
    assert kinds[CHUNKS:first_mm] == ["wait"], f"only chunk 0 is waited on before the first GEMM: {kinds}"
    # reduce-scatters are issued between GEMMs, and waited on only after the last one
    last_mm = len(kinds) - 1 - kinds[::-1].index("mm")
    rs_pos = [i for i, k in enumerate(kinds) if k == "rs"]
    assert len(rs_pos) == CHUNKS and rs_pos[0] < last_mm, kinds
    assert all(k == "wait" for k in kinds[last_mm + 1 :] if k != "rs"), kinds
    assert re.search(r"reduce_scatter_tensor\.default\(", code)


def test_scheduling_edges_may_point_forward():
    """An ISSUE_AFTER edge (a deferred weight gradient after the last chunk's all-to-all)
    may name a node later in the current order: the result still respects it."""
    from overlapc.passes.schedule import list_schedule

    items = ["wgrad", "dgrad", "coll", "wait"]
    preds = {"wgrad": ["coll"], "coll": ["dgrad"], "wait": ["coll"]}
    order = list_schedule(items, preds, early={"coll"}, late={"wait"}, collectives={"coll"})
    assert order.index("dgrad") < order.index("coll") < order.index("wgrad") < order.index("wait"), order


def test_gloo_all_gathers_take_lanes(fake_mesh8, monkeypatch):
    """With lanes, a gloo group's all-gathers move to the lanes in turn: one in flight per lane,
    and none kept apart from the group's reduce-scatters, which stay on the group (as all-to-alls)."""
    monkeypatch.setattr(ops, "group_backend", lambda name: "gloo")
    monkeypatch.setattr(ops, "group_comm_threads", lambda name: 2)
    report, graphs = capture(ag_mm_rs, *_inputs(), options={"strategy": "decompose", "chunks": CHUNKS, "lanes": 2})
    ((_, gm),) = graphs
    seq = list(gm.graph.nodes)
    ags = [n for n in seq if n.target is ops.ALL_GATHER]
    rss = [n for n in seq if n.target in (ops.REDUCE_SCATTER, ops.ALL_TO_ALL)]  # gloo: RS as all-to-all
    group = ops.group_name(rss[0])
    assert len(ags) == CHUNKS and not lanes.is_lane(group)
    assert [ops.group_name(n) for n in ags] == [lanes.lane_name(group, c % 2) for c in range(CHUNKS)]
    for c, n in enumerate(ags):  # chained to the previous all-gather of its own lane only
        assert issue_after(n) == ((ops.wait_of(ags[c - 2]).name,) if c >= 2 else ())
    assert all(issue_after(rs) == () for rs in rss)
    assert lanes.lanes_in(gm.graph) == [lanes.lane_name(group, 0), lanes.lane_name(group, 1)]
