"""Structure: which sites explain() finds in the reference models, at world size 8 (fake PG).

Each expected count is derived in a comment from the model's parallel plan.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import overlapc
from overlapc.explain import capture
from overlapc.models import llama, moe

L = 2  # decoder layers


def counts(report):
    return {f"{g}/{p}": n for (g, p), n in report.counts().items()}


@pytest.fixture(scope="module")
def tp_sp_report(fake_mesh8):
    model, inputs = llama.build_tp_sp(fake_mesh8, n_layers=L)
    return overlapc.explain(model, *inputs, options={"strategy": "none"})


@pytest.fixture(scope="module")
def tp_report(fake_mesh8):
    model, inputs = llama.build_tp(fake_mesh8, n_layers=L)
    return overlapc.explain(model, *inputs, options={"strategy": "none"})


def test_tp_sp_counts(tp_sp_report):
    assert counts(tp_sp_report) == {
        # per layer: AG(norm(x)) -> q/k/v (one site), AG(norm(h)) -> gate/up (one site);
        # plus the final norm's AG -> output projection.
        "forward/all_gather_matmul": 2 * L + 1,
        # per layer: wo -> RS and w2 -> RS (RowwiseParallel(output_layouts=Shard(1))).
        "forward/matmul_reduce_scatter": 2 * L,
        # embedding -> RS (producer is an embedding lookup, not a matmul) and the output
        # projection's mm -> AG(Replicate) (a matmul feeding an all-gather is no site kind).
        "forward/collective": 2,
        # per layer: the grads of the two RS are AGs, each feeding dgrad and wgrad mms.
        "backward/all_gather_matmul": 2 * L,
        # per layer: the grads of the two AGs are RSs of summed dgrads (dq@Wq+dk@Wk+dv@Wv,
        # dg@W1+du@W3); plus the output projection's dgrad -> RS.
        "backward/matmul_reduce_scatter": 2 * L + 1,
        # the embedding's grad AG feeds embedding_dense_backward, not a matmul.
        "backward/collective": 1,
    }


def test_tp_sp_shared_gathers(tp_sp_report):
    fw = tp_sp_report.by(graph="forward", pattern="all_gather_matmul")
    by_module = {s.module: s for s in fw}
    # q/k/v share one all-gather; gate/up share another.
    assert len(by_module["layers.0.attention"].matmuls) == 3
    assert len(by_module["layers.0.feed_forward"].matmuls) == 2
    assert len(by_module["output"].matmuls) == 1
    for s in fw:
        assert s.dim == 1, "sequence parallel gathers the sequence dim (1) of (batch, seq, dim)"
        assert s.world_size == 8 and s.group is not None
        assert all(r == "lhs:rows" for r in s.details["roles"].values())
    rs = {s.module: s for s in tp_sp_report.by(graph="forward", pattern="matmul_reduce_scatter")}
    assert set(rs) == {f"layers.{i}.{m}" for i in range(L) for m in ("attention.wo", "feed_forward.w2")}
    assert all(s.dim == 1 and s.details["producer"] == "single" for s in rs.values())


def test_tp_sp_backward_mirrors(tp_sp_report):
    bw_ag = tp_sp_report.by(graph="backward", pattern="all_gather_matmul")
    for s in bw_ag:
        # The gathered output-grad feeds the input-grad mm (gathered rows -> output rows) and
        # the weight-grad mm (gathered^T @ x: the gathered dim is contracted).
        roles = sorted(s.details["roles"].values())
        assert roles == ["lhs:contraction", "lhs:rows"], roles
    summed = [
        s for s in tp_sp_report.by(graph="backward", pattern="matmul_reduce_scatter") if s.details["producer"] == "sum"
    ]
    # q/k/v and gate/up dgrads per layer are sums.
    assert sorted(len(s.matmuls) for s in summed) == [2] * L + [3] * L


def test_tp_sp_layer_is_one_chain(fake_mesh8):
    """Rows flow chunk by chunk across sites: every all-gather chunk whose shard comes from a
    reduce-scatter through the residual add and RMSNorm waits for that chunk of it alone. In
    forward that is wo -> MLP and w2 -> the next layer's q/k/v; in backward its mirror (the
    norms' input gradients plus the residual's)."""
    from overlapc.passes import ops
    from overlapc.passes.lower import SITE_WAIT

    model, inputs = llama.build_tp_sp(fake_mesh8, n_layers=L, batch=2, seq=48)

    def step(tokens):
        loss = model(tokens).float().pow(2).mean()
        loss.backward()
        return loss

    report, graphs = capture(step, *inputs, options={"strategy": "decompose", "chunks": 3, "microbatches": 1})
    chained = {(s.graph, s.module): s.details.get("rows_from") for s in report.by(pattern="all_gather_matmul")}
    for i in range(L):
        assert chained["forward", f"layers.{i}.feed_forward"] == [
            f"forward:layers.{i}.attention.wo:matmul_reduce_scatter"
        ]
    # the residual x + attn(x) + mlp(h): chunk c of both row-parallel outputs since attention
    assert chained["forward", "layers.1.attention"] == [
        "forward:layers.0.attention.wo:matmul_reduce_scatter",
        "forward:layers.0.feed_forward.w2:matmul_reduce_scatter",
    ]
    assert chained["backward", "layers.0.attention.wo"], chained  # RS of q/k/v-side grads -> norm backward -> AG
    rows_from = {s.name: s.details.get("rows_from") for s in report.sites}
    checked = 0
    for _, gm in graphs:
        for ag in (n for n in gm.graph.nodes if n.target is ops.ALL_GATHER):
            site = ops.wait_of(ag).meta.get(SITE_WAIT, ("",))[0]
            if not rows_from.get(site):
                continue
            upstream, seen, stack = [], set(), [ag]
            while stack:
                for p in stack.pop().all_input_nodes:
                    if p not in seen:
                        seen.add(p)
                        stack.append(p)
                        if p.target is ops.WAIT and p.args[0].target is ops.REDUCE_SCATTER:
                            upstream.append(p.meta.get(SITE_WAIT, (p.name,))[0])
            for source in rows_from[site]:  # one chunk of each source, not all of them
                assert upstream.count(source) == 1, (site, ag.name, source, upstream)
            checked += 1
    # every gather but layer 0's q/k/v (after the embedding) in forward, each in backward
    assert sum(1 for s in report.by(pattern="all_gather_matmul") if s.details.get("rows_from")) == 4 * L
    # and each MLP's reduce-scatter reads its gather's chunks: w2 in forward, w1/w3's input grads in backward
    mlp_rs = {s.name: s.details.get("rows_from") for s in report.by(pattern="matmul_reduce_scatter")}
    for i in range(L):
        assert mlp_rs[f"forward:layers.{i}.feed_forward.w2:matmul_reduce_scatter"] == [
            f"forward:layers.{i}.feed_forward:all_gather_matmul"
        ]
        assert mlp_rs[f"backward:layers.{i}.feed_forward:matmul_reduce_scatter"] == [
            f"backward:layers.{i}.feed_forward.w2:all_gather_matmul"
        ]
    assert sum(1 for v in mlp_rs.values() if v) == 2 * L
    assert checked == 3 * 4 * L, checked  # 3 chunks of each


def test_tp_counts(tp_report):
    assert counts(tp_report) == {
        # per layer: wo -> AR and w2 -> AR (RowwiseParallel, Replicate output).
        "forward/matmul_all_reduce": 2 * L,
        # embedding -> AR (not a matmul) and output mm -> AG(Replicate).
        "forward/collective": 2,
        # per layer: DTensor all-reduces each column-parallel input grad on its own: dq@Wq,
        # dk@Wk, dv@Wv, dg@W1, du@W3 (5 sites); plus the output projection's dgrad.
        "backward/matmul_all_reduce": 5 * L + 1,
        # per layer: x's grad sums the q/k/v all-reduces, h's the w1/w3 ones: two sums to
        # coalesce (found, not rewritten: strategy "none").
        "backward/all_reduce_sum": 2 * L,
        # the joint graph's one region of row-wise ops after all-reduces (16 rows a rank):
        # found, left as it is under strategy "none"
        "forward/all_reduce_rows": 1,
    }
    (rows,) = tp_report.by(pattern="all_reduce_rows")
    assert rows.status == "skipped" and rows.reason == "strategy 'none'"
    merged = sorted(len(s.details["all_reduces"]) for s in tp_report.by(pattern="all_reduce_sum"))
    assert merged == [2] * L + [3] * L


def _all_reduce_bytes(gm) -> int:
    """Bytes this rank all-reduces in a graph, counted from its all-reduce nodes."""
    from overlapc.passes import ops

    return sum(
        ops.val(n.args[0]).numel() * ops.val(n.args[0]).element_size()
        for n in gm.graph.nodes
        if n.target is ops.ALL_REDUCE
    )


@pytest.mark.parametrize("strategy", ["auto", "decompose"])
def test_tp_coalesced_bytes(fake_mesh8, strategy):
    """The rewritten backward graph all-reduces 2 activations' worth a layer instead of 5
    (plus the output projection's dgrad), however the planner then chunks them."""
    model, inputs = llama.build_tp(fake_mesh8, n_layers=L)
    # all-reduces kept as all-reduces (automatic SP off), to count what coalescing saves
    report, graphs = capture(model, *inputs, options={"strategy": strategy, "auto_sp": "off"})
    base_model, base_inputs = llama.build_tp(fake_mesh8, n_layers=L)
    _, base = capture(base_model, *base_inputs, options={"strategy": "none"})
    act = 2 * 64 * llama.LlamaConfig.dim * 4  # (batch, seq, dim) fp32
    got = {kind: _all_reduce_bytes(gm) for kind, gm in graphs}
    want = {kind: _all_reduce_bytes(gm) for kind, gm in base}
    assert want["backward"] == (5 * L + 1) * act and got["backward"] == (2 * L + 1) * act
    assert got["forward"] == want["forward"] == (2 * L + 1) * act  # the embedding's too
    rows = report.by(pattern="all_reduce_sum", status="rewritten")
    assert len(rows) == 2 * L
    assert sum(r.details["bytes_saved"] for r in rows) == 3 * L * act


@pytest.mark.parametrize("form", ["bmm", "loop", "grouped"])
def test_moe_counts(fake_mesh8, form):
    # torch._grouped_mm takes only bf16 on CPU
    model, inputs = moe.build_ep(fake_mesh8, expert_form=form, dtype="bfloat16" if form == "grouped" else "float32")
    report = overlapc.explain(model, *inputs, options={"strategy": "none"})
    assert counts(report) == {
        # dispatch A2A -> expert w1/w3 GEMMs; expert w2 GEMM -> combine A2A.
        "forward/all_to_all_matmul": 1,
        "forward/matmul_all_to_all": 1,
        # the combine's grad A2A -> w2 dgrad/wgrad GEMMs; summed w1/w3 dgrads -> the
        # dispatch's grad A2A.
        "backward/all_to_all_matmul": 1,
        "backward/matmul_all_to_all": 1,
    }
    fw = report.by(graph="forward", pattern="all_to_all_matmul")[0]
    assert len(fw.matmuls) == 2  # w1 and w3 (8 experts over 8 ranks: one local expert)


@pytest.mark.parametrize(
    "form,dtype", [("bmm", "float32"), ("loop", "float32"), ("bmm", "bfloat16"), ("grouped", "bfloat16")]
)
def test_moe_decomposed_along_capacity(fake_mesh8, form, dtype):
    """Each dispatch all-to-all is chunked along the capacity slots (Axis(0, cap): 8 experts
    over 8 ranks leave one local expert, so chunking experts is impossible) and its combine
    all-to-all is chained to it, forward and backward."""
    model, inputs = moe.build_ep(fake_mesh8, expert_form=form, tokens=64, dtype=dtype)
    cap = moe.capacity(model.cfg, 64)
    report, graphs = capture(model, *inputs, options={"strategy": "decompose", "chunks": 3})
    sites = [s for s in report.sites if s.pattern != "collective"]
    assert len(sites) == 4 and all(s.status == "rewritten" and s.chunks == 3 for s in sites), str(report)
    for s in report.by(pattern="all_to_all_matmul"):
        assert s.details["axis"] == {"dim": 0, "extent": cap, "inner": 1}
        assert len(s.details["chained"]) == 1
    for s in report.by(pattern="matmul_all_to_all"):
        assert s.details["chained_from"].endswith("all_to_all_matmul")
    # The expert weight gradients (sums over the capacity slots, read by nothing in the region,
    # followed by the dispatch's grad all-to-all) run whole after the chunks, not as partials
    # (in bf16 they are whole anyway: they are still ordered after the chunks).
    bw = report.by(graph="backward", pattern="all_to_all_matmul")[0]
    assert len(bw.details["whole_after_chunks"]) == 3, bw.details  # w1, w2, w3
    # ... scheduled after every chunk's all-to-all has been issued (under the last transfers).
    (bw_graph,) = [g for kind, g in graphs if kind == "backward"]
    order = {n.name: i for i, n in enumerate(bw_graph.graph.nodes)}
    last_a2a = max(i for n, i in order.items() if n.startswith("all_to_all_single"))
    assert all(order[n] > last_a2a for n in bw.details["whole_after_chunks"]), order
    assert all("whole_after_chunks" not in s.details for s in report.by(graph="forward"))
    # The region's first all-to-all (its chunks' inputs all exist at once: the dispatch, and in
    # backward the combine's gradient) issues chunk c + 1 only after chunk c's wait.
    from overlapc.passes import ops
    from overlapc.passes.schedule import issue_after

    for kind, g in graphs:
        nodes = list(g.graph.nodes)
        pos = {n.name: i for i, n in enumerate(nodes)}
        later = [n for n in nodes if n.target is ops.ALL_TO_ALL and issue_after(n)]
        assert len(later) == 2, (kind, [n.name for n in later])
        for n in later:
            (w,) = issue_after(n)
            assert nodes[pos[w]].target is ops.WAIT and pos[w] < pos[n.name]


def test_ulysses_one_region_per_graph(fake_mesh8):
    """Ulysses at world 8 with 32 heads (4 local): forward has 3 matmul -> all-to-all sites
    (q, k, v projections) and 1 all-to-all -> matmul (output projection); backward the
    mirror. The first site of each graph takes all four all-to-alls into one region
    chunked along the local heads; the others are reported as chained into it."""
    from overlapc.models import ulysses

    model, inputs = ulysses.build_ulysses(fake_mesh8, batch=2, seq=64, dim=256, n_heads=32)
    report = overlapc.explain(model, *inputs, options={"strategy": "decompose", "chunks": 4})
    assert counts(report) == {
        "forward/matmul_all_to_all": 3,
        "forward/all_to_all_matmul": 1,
        "backward/matmul_all_to_all": 1,
        "backward/all_to_all_matmul": 3,
    }
    for graph in ("forward", "backward"):
        first, *rest = [s for s in report.sites if s.graph == graph]
        assert first.status == "rewritten" and len(first.details["chained"]) == 3, str(report)
        assert first.details["axis"]["extent"] == 4
        assert all(s.status == "rewritten" and s.details["chained_from"] == first.name for s in rest)


@pytest.mark.parametrize("gqa", ["repeat", "sdpa"])
def test_ulysses_gqa_one_region_per_graph(fake_mesh8, gqa):
    """Grouped-query attention at world 8, batch 1: 32 query heads and 16 k/v heads, 4 and 2
    per rank. Chunk c of the k/v heads serves query heads [2c, 2c + 2): the region runs
    through the k/v heads' repetition (expand + reshape) or through attention taking fewer
    k/v heads (enable_gqa), so all four all-to-alls are one region per graph, chunked along
    the 2 local k/v heads (query heads in pairs). Before, each all-to-all had a region of
    its own, ending at attention."""
    from overlapc.models import ulysses

    model, inputs = ulysses.build_ulysses(fake_mesh8, batch=1, seq=64, dim=256, n_heads=32, n_kv_heads=16, gqa=gqa)
    report = overlapc.explain(model, *inputs, options={"strategy": "decompose", "chunks": 4})
    for graph in ("forward", "backward"):
        first, *rest = [s for s in report.sites if s.graph == graph]
        assert first.status == "rewritten" and len(first.details["chained"]) == 3, str(report)
        assert first.details["axis"]["extent"] == 2 and first.chunks == 2, first.details["axis"]
        assert all(s.status == "rewritten" and s.details["chained_from"] == first.name for s in rest)


@pytest.mark.parametrize(
    "kw,msg",
    [
        (dict(n_kv_heads=3), "n_kv_heads=3 does not divide n_heads=8"),
        (dict(gqa="mqa"), "gqa='mqa': expected 'repeat' or 'sdpa'"),
    ],
)
def test_ulysses_config_errors(kw, msg):
    from overlapc.models import ulysses

    with pytest.raises(ValueError, match=msg):
        ulysses.UlyssesAttention(ulysses.UlyssesConfig(**kw))


@pytest.mark.parametrize("kind", ["flash", "efficient", "cudnn"])
def test_sdpa_stand_ins_are_attention(kind):
    """The CPU stand-ins of the CUDA kernels (tests/sdpa_doubles.py) compute SDPA: output
    and gradients (through the ops' own backward ops) as F.scaled_dot_product_attention's."""
    import sdpa_doubles

    sdpa_doubles.register()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 3, 40, 8, generator=g) for _ in range(3))
    grad = torch.randn(2, 3, 40, 8, generator=g)
    got = []
    for fused in (False, True):
        qkv = [t.clone().requires_grad_() for t in (q, k, v)]
        y = sdpa_doubles.call(kind, *qkv, True) if fused else F.scaled_dot_product_attention(*qkv, is_causal=True)
        y.backward(grad)
        got.append([y, *(t.grad for t in qkv)])
    for a, b in zip(*got):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kind", ["flash", "efficient", "cudnn"])
def test_ulysses_region_goes_through_cuda_fused_attention(fake_mesh8, kind):
    """On a GPU, SDPA traces to CUDA's fused kernels, which also return RNG state and
    sequence lengths (and, for efficient attention, a logsumexp padded to 32 rows): the
    region still runs from the q/k/v projections through attention to the output projection,
    forward and backward, each chunk of heads calling the kernel once; the chunk-invariant
    results (saved for the backward) come from the first chunk's call. The kernels run
    here as CPU stand-ins (tests/sdpa_doubles.py); graphs only, no values checked."""
    import sdpa_doubles

    from overlapc.models import ulysses
    from overlapc.passes import ops

    sdpa_doubles.register()
    model, inputs = ulysses.build_ulysses(fake_mesh8, batch=2, seq=64, dim=256, n_heads=32)
    model.__class__ = sdpa_doubles.fused_ulysses(kind)
    report, graphs = capture(model, *inputs, options={"strategy": "decompose", "chunks": 4})
    for graph in ("forward", "backward"):
        first, *rest = [s for s in report.sites if s.graph == graph]
        assert first.status == "rewritten" and len(first.details["chained"]) == 3, str(report)
        assert first.details["axis"]["extent"] == 4
    op = getattr(ops.aten, sdpa_doubles.OPS[kind])
    for graph, target in (("forward", op.default), ("backward", getattr(ops.aten, op.__name__ + "_backward").default)):
        (gm,) = [g for k, g in graphs if k == graph]
        assert sum(n.target is target for n in gm.graph.nodes) == 4, (graph, gm.graph)


@pytest.mark.parametrize("on", [True, False])
def test_partial_sums_become_addmm_chains(fake_mesh8, on):
    """Ulysses backward chunked over heads: each q/k/v input gradient is a sum of per-head-
    chunk partial GEMMs. With addmm_partials (the default) every partial after the first is
    an addmm into the running sum, at its mm's place (each addmm before the next chunk's
    all-to-all wait that its mm followed); off: mm then add, as the rewrite built them."""
    from overlapc.models import ulysses
    from overlapc.passes import ops

    model, inputs = ulysses.build_ulysses(fake_mesh8, batch=2, seq=64, dim=256, n_heads=32)
    _, graphs = capture(model, *inputs, options={"strategy": "decompose", "chunks": 4, "addmm_partials": on})
    (bw,) = [g for kind, g in graphs if kind == "backward"]
    nodes = list(bw.graph.nodes)
    adds = [n for n in nodes if n.target is ops.ADD and n.meta.get("overlapc")]
    addmms = [n for n in nodes if n.target is ops.aten.addmm.default]
    if not on:
        assert len(adds) >= 9 and not addmms, (len(adds), len(addmms))  # 3 projections x 3 partial adds
        return
    assert not adds and len(addmms) >= 9, (len(adds), len(addmms))
    # The partial of the last head chunk cannot start before that chunk's all-to-all has
    # arrived; the earlier ones do not wait for the last all-to-all.
    pos = {n: i for i, n in enumerate(nodes)}
    last_wait = max(pos[n] for n in nodes if n.target is ops.WAIT)
    assert sum(pos[n] < last_wait for n in addmms) >= 6, [pos[n] for n in addmms]


def test_failed_region_replay_leaves_graph_unchanged(fake_mesh8, monkeypatch):
    """If building the chunks fails midway (an op refusing its chunk shapes), the nodes
    built so far are removed and the site is skipped with the error: never half-rewritten."""
    from overlapc.passes import axis

    def replay(b, region, sizes, marks=None):
        b.view(region.seeds[0], axis.static_shape(region.seeds[0]))  # something built already
        raise RuntimeError("chunk shape refused")

    monkeypatch.setattr(axis, "replay", replay)
    model, inputs = moe.build_ep(fake_mesh8, tokens=64)
    report = overlapc.explain(model, *inputs, options={"strategy": "decompose"})
    sites = [s for s in report.sites if s.pattern != "collective"]
    assert len(sites) == 4 and all(s.status == "skipped" and "chunk shape refused" in s.reason for s in sites), str(
        report
    )


def _a2a_program(group, variant):
    import torch
    import torch.distributed._functional_collectives as funcol

    def fn(x, w):
        n = x.shape[0] // 8
        splits = [n] * 8 if variant != "uneven" else [n - 1] + [n] * 6 + [n + 1]
        r = funcol.all_to_all_single(x, splits, splits, group)
        r3 = r.view(8, -1, x.shape[1])
        if variant == "self":  # the matmul's other operand is the received buffer too
            return torch.bmm(r3, r3.transpose(1, 2)).sum()
        return torch.bmm(r3, w).sum()

    return fn


@pytest.mark.parametrize(
    "variant,pattern,reason",
    [
        ("uneven", "all_to_all_matmul", "uneven or run-time split sizes"),
        ("self", "collective", "depends on the all-to-all itself"),
    ],
)
def test_unsupported_all_to_all_left_alone(fake_mesh8, variant, pattern, reason):
    import torch

    fn = _a2a_program(fake_mesh8.get_group(), variant)
    report = overlapc.explain(fn, torch.randn(64, 16), torch.randn(8, 16, 4), options={"strategy": "decompose"})
    (site,) = report.by(pattern=pattern)
    assert site.status == "skipped" and reason in site.reason, str(report)


def test_inference_graph(fake_mesh8):
    import torch

    model, inputs = llama.build_tp_sp(fake_mesh8, n_layers=1)
    with torch.no_grad():
        report = overlapc.explain(model, *inputs, options={"strategy": "none"})
    graphs = {s.graph for s in report.sites}
    assert graphs == {"inference"}
    assert counts(report)["inference/all_gather_matmul"] == 3


def test_report_json_and_table(tp_sp_report):
    import json

    d = json.loads(tp_sp_report.to_json())
    assert len(d["sites"]) == len(tp_sp_report.sites)
    assert {
        "name",
        "pattern",
        "graph",
        "status",
        "reason",
        "strategy",
        "chunks",
        "group",
        "collective",
        "matmuls",
        "shapes",
    } <= set(d["sites"][0])
    table = str(tp_sp_report)
    assert "all_gather_matmul" in table and "layers.0.attention" in table
    names = [s.name for s in tp_sp_report.sites]
    assert len(set(names)) == len(names), "site names are unique"
    # every collective is reported: collective rows carry a reason
    assert all(s.reason for s in tp_sp_report.sites if s.pattern == "collective")


def test_full_slices_are_seen_through(fake_mesh8):
    """When seq == max_seq_len DTensor's redistribute adds a no-op slice after the gather
    (slice(g, 1, 0, S)); every site must still be found and decomposed."""
    model, inputs = llama.build_tp_sp(fake_mesh8, n_layers=1, seq=64, max_seq_len=64)
    report = overlapc.explain(model, *inputs, options={"strategy": "decompose"})
    assert counts(report)["forward/all_gather_matmul"] == 3
    assert all(s.status == "rewritten" for s in report.sites if s.pattern != "collective"), str(report)


def test_auto_leaves_small_sites_alone(fake_mesh8):
    """strategy "auto" skips sites where the cost model predicts no gain, saying why with the
    numbers; "decompose" rewrites them anyway. The all-to-all regions' rule is unchanged."""
    from overlapc.passes.plan import auto_chunks

    model, inputs = llama.build_tp_sp(fake_mesh8, n_layers=1)
    report = overlapc.explain(model, *inputs, options={"hardware": "cpu-default"})
    sites = [s for s in report.sites if s.pattern != "collective"]
    assert sites and all(s.status == "skipped" and "predicted gain" in s.reason for s in sites)
    assert all("profile 'cpu-default'" in s.reason and s.details["predicted"]["gain"] < 0.03 for s in sites)
    assert [auto_chunks(n) for n in (16, 64, 96, 128, 100000)] == [2, 2, 3, 4, 4]


def test_unmatched_overrides_are_listed(fake_mesh8, caplog):
    model, inputs = llama.build_tp_sp(fake_mesh8, n_layers=1)
    report = overlapc.explain(
        model,
        *inputs,
        options={
            "strategy": "none",
            "overrides": {"*:layers.*.attention.wo:*": {"chunks": 2}, "*:layers.*.attn.wo:*": {"chunks": 2}},
        },
    )
    assert report.unmatched_overrides == ["*:layers.*.attn.wo:*"]
    assert "overrides that matched no site: '*:layers.*.attn.wo:*'" in str(report)
    assert any("matched no site" in r.getMessage() and "attn.wo" in r.getMessage() for r in caplog.records)


@pytest.mark.parametrize(
    "raw,want",
    [
        # torchtitan's parallelize replaces forward with a closure over the module
        (
            "L['self']._modules['layers']._modules['0']._modules['attention'].forward.__closure__[0].cell_contents"
            ".__self__._modules['wo']",
            "layers.0.attention.wo",
        ),
        ("L['self'].layers['0']._checkpoint_wrapped_module.attention.wq", "layers.0.attention.wq"),  # AC wrapper
        ("L['self']._orig_mod.layers.1.feed_forward", "layers.1.feed_forward"),  # an OptimizedModule inside
        # activation checkpointing inside the compile: dynamo reaches the wrapped module by __dict__
        (
            "L['self'].layers.0.__dict__['_modules']['_checkpoint_wrapped_module'].attention.wo",
            "layers.0.attention.wo",
        ),
        ("L['args'][0].model.layers.0.self_attn.o_proj", "model.layers.0.self_attn.o_proj"),  # transformers
    ],
)
def test_module_paths_are_user_fqns(raw, want):
    from torch.fx import Graph

    from overlapc.passes import ops

    node = Graph().placeholder("x")
    node.meta["nn_module_stack"] = {"k": (raw, torch.nn.Linear)}
    assert ops.module_path(node) == want


def test_layout_ops_keep_place_and_width():
    """A cast is a layout op, a device move is not; a bitcast is one only between dtypes of
    one width (gloo gathers fp8 as uint8)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from overlapc.passes import ops

    def f(x):
        y = x.to(torch.float64).to("meta")
        return x.to(torch.float8_e4m3fn).view(torch.uint8), x.view(torch.uint8), y

    g = make_fx(f)(torch.randn(2, 4))
    calls = [n for n in g.graph.nodes if n.op == "call_function" and n.target is not ops.aten.detach.default]
    got = [(n.target, ops.is_layout(n)) for n in calls]
    a = ops.aten
    assert got == [
        (a._to_copy.default, True),
        (a._to_copy.default, False),
        (a._to_copy.default, True),
        (a.view.dtype, True),
        (a.view.dtype, False),
    ], got
