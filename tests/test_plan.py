"""The cost model and planner (passes/cost.py, passes/plan.py), profiles, `overlapc plan`
and `overlapc calibrate`. Predictions are checked against the formulas, not against
timings (those are in benchmarks/bench_plan.py)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import sympy
import torch

import overlapc
from overlapc import OverlapError
from overlapc.passes import cost


@pytest.mark.parametrize("name", ["cpu-default", "h100-nvlink", "h200-nvlink", "ib-400g"])
def test_builtin_profiles_load_and_name_their_source(name):
    p = cost.load_profile(name)
    assert p.name == name and len(p.source) > 80
    assert p.link.alpha > 0 and p.link.beta > 0 and p.gemm["float32"].peak_flops > 0
    if name != "cpu-default":
        assert "datasheet" in p.source


def test_bad_profiles_are_errors_that_say_what_is_allowed(tmp_path, monkeypatch):
    with pytest.raises(OverlapError, match="option 'hardware' must be one of 'cpu-local'.*got 'a100'"):
        overlapc.Options(hardware="a100")
    bad = tmp_path / "p.json"
    bad.write_text(json.dumps({"name": "x", "source": "y", "gemm": {}}))
    with pytest.raises(OverlapError, match=f"hardware profile '{bad}' is malformed: KeyError"):
        cost.load_profile(str(bad))
    monkeypatch.setattr(cost, "CACHE_DIR", tmp_path / "none")
    with pytest.raises(OverlapError, match="run `overlapc calibrate"):
        cost.load_profile("cpu-local")
    assert cost.default_profile_name() == "cpu-default"


def test_collective_formulas():
    p = cost.load_profile("h100-nvlink")
    a, b = p.link.alpha, p.link.beta
    B = 8 << 20
    assert float(cost.t_comm("all_gather", B, 8, p)) == pytest.approx(7 * a + 7 * B / b)
    assert float(cost.t_comm("reduce_scatter", B, 8, p)) == pytest.approx(7 * a + 7 / 8 * B / b)
    assert float(cost.t_comm("all_reduce", B, 8, p)) == pytest.approx(2 * (7 * a + 7 / 8 * B / b))
    assert float(cost.t_comm("all_gather", B, 1, p)) == 0
    g = p.gemm["bfloat16"]
    assert float(cost.t_gemm(g.half_flops, g)) == pytest.approx(2 * g.half_flops / (g.peak_flops * g.eff_max))


def test_measured_curves_replace_alpha_beta_where_sizes_are_numbers():
    d = json.loads((cost.PROFILE_DIR / "cpu-default.json").read_text())
    ab = cost.profile_from_dict(d)
    # A link that slows per byte for big messages (TCP over a shaped veth does), noisy at the
    # small end: 1 MiB in 10 ms, 4 MiB in 60 ms (not 40), 8 KiB measured slower than 64 KiB.
    d["curves"] = {"all_to_all": [[4 << 20, 0.060], [8 << 10, 0.002], [64 << 10, 0.001], [1 << 20, 0.010]]}
    d["curves_world"] = 2
    p = cost.profile_from_dict(d)
    assert [t for _, t in p.curves["all_to_all"]] == [0.002, 0.002, 0.010, 0.060]  # sorted, non-decreasing
    assert float(cost.t_comm("all_to_all", 1 << 20, 2, p)) == pytest.approx(0.010)
    assert float(cost.t_comm("all_to_all", 2.5 * (1 << 20), 2, p)) == pytest.approx(0.035)  # between points
    assert float(cost.t_comm("all_to_all", 8 << 20, 2, p)) == pytest.approx(0.060 + 4 * 0.050 / 3)  # last slope
    # Four chunks of 1 MiB beat the whole 4 MiB here: the curve lets the model see it.
    assert 4 * float(cost.t_comm("all_to_all", 1 << 20, 2, p)) < float(cost.t_comm("all_to_all", 4 << 20, 2, p))
    # Kinds without a curve, groups of another size, and symbolic sizes keep the alpha-beta formula.
    assert cost.t_comm("all_gather", 1 << 20, 2, p) == cost.t_comm("all_gather", 1 << 20, 2, ab)
    assert cost.t_comm("all_to_all", 1 << 20, 4, p) == cost.t_comm("all_to_all", 1 << 20, 4, ab)
    s = sympy.Symbol("s", positive=True, integer=True)
    assert cost.t_comm("all_to_all", s * 1024, 2, p) == cost.t_comm("all_to_all", s * 1024, 2, ab)


def test_symbolic_shapes_give_expressions_that_agree_with_numbers():
    p = cost.load_profile("h100-nvlink")
    g = p.gemm["bfloat16"]
    s0 = sympy.Symbol("s0", positive=True, integer=True)
    rows = 512 * s0
    nbytes, flops = rows * 4096 * 2, 2 * rows * 8 * 4096 * 1024
    expr = cost.t_pipeline(True, flops, "all_gather", nbytes, 8, g, p, 4, copy_bytes=rows * 8 * 1024 * 2)
    assert expr.free_symbols == {s0}
    num = cost.t_pipeline(
        True, flops.subs(s0, 4), "all_gather", nbytes.subs(s0, 4), 8, g, p, 4, copy_bytes=4 * 512 * 8 * 1024 * 2
    )
    assert float(expr.subs(s0, 4)) == pytest.approx(float(num))


def test_flow_is_the_issue_order_recurrence():
    # Two stages (AG -> GEMM): transfers back to back, GEMM i after transfer i and GEMM i-1.
    evs, end = cost.flow([[1, 1, 1], [5, 0.1, 0.1]], ["comm", "compute"])
    assert float(end) == pytest.approx(6.2)  # 1 + 5 + 0.1 + 0.1: the first GEMM holds the rest up
    assert [(s, i, float(t0)) for s, i, t0, _ in evs] == [
        (0, 0, 0),
        (0, 1, 1),
        (0, 2, 2),
        (1, 0, 1),
        (1, 1, 6),
        (1, 2, 6.1),
    ]
    # Three stages on two lanes (MoE: dispatch, experts, combine): the combines queue behind
    # every dispatch on the one comm lane.
    evs, end = cost.flow([[1, 1], [3, 3], [1, 1]], ["comm", "compute", "comm"])
    starts = {(s, i): float(t0) for s, i, t0, _ in evs}
    assert starts == {(0, 0): 0, (0, 1): 1, (1, 0): 1, (1, 1): 4, (2, 0): 4, (2, 1): 7}
    assert float(end) == 8
    # A deferred task (whole weight gradients) holds the compute lane after its stage's last
    # chunk; the next stage's chunks do not wait for it.
    evs, end = cost.flow([[1, 1], [2, 2], [1, 1]], ["comm", "compute", "comm"], after=[0, 3, 0])
    starts = {(s, i): float(t0) for s, i, t0, _ in evs}
    assert starts[(1, -1)] == 5 and starts[(2, 0)] == 3 and starts[(2, 1)] == 5 and float(end) == 8
    # Overlap loss: a GEMM lengthened by its share of the transfer running under it.
    _, lossy = cost.flow([[2, 2], [2, 2]], ["comm", "compute"], loss=0.5)
    assert float(lossy) == pytest.approx(2 + (2 + 0.5 * 2) + 2)


def test_comm_loss_lengthens_a_transfer_by_the_gemms_under_it():
    # GEMM -> reduce-scatter, comm-bound (GEMM chunks 1, transfer chunks 4): the compute-side
    # loss alone cannot slow the pipeline (the short GEMMs hide whole), so a host whose
    # transfers are CPU work would look as fast as one whose wire is the bottleneck.
    gs, cs = [1, 1, 1], [4, 4, 4]
    _, free = cost.flow([gs, cs], ["compute", "comm"], loss=1.0)
    assert float(free) == pytest.approx(1 + 12)
    # comm_loss 1: transfers 0 and 1 each have a GEMM (chunks 1 and 2) under them.
    _, cpu = cost.flow([gs, cs], ["compute", "comm"], loss=1.0, comm_loss=[0, 1.0])
    assert float(cpu) == pytest.approx(1 + 12 + 2)
    # The same through a profile: comm_loss by kind (an all-reduce reads the reduce-scatter's).
    p = dataclasses.replace(cost.load_profile("h100-nvlink"), comm_loss={"reduce_scatter": 0.5})
    assert cost.comm_loss_of("all_reduce", p) == 0.5 and cost.comm_loss_of("all_gather", p) == 0.0
    assert cost.comm_loss_of("gemm", p) == 0.0
    st = [cost.Stage("compute", "gemm", 2 * 4096**3), cost.Stage("comm", "reduce_scatter", 64 << 20)]
    g = p.gemm["bfloat16"]
    lossless = dataclasses.replace(p, comm_loss={})
    assert float(cost.t_stages(st, 8, g, p, 4)) > float(cost.t_stages(st, 8, g, lossless, 4))


def test_loaded_latency_is_paid_by_chunks_only():
    # A chunk's collective runs while its rank computes the pipeline's GEMMs; its latency is
    # the profile's loaded one. The baseline's (one whole collective, alone) keeps the idle one.
    p = dataclasses.replace(cost.load_profile("h100-nvlink"), concurrent_reductions=False)
    loaded = dataclasses.replace(p, loaded_latency={"reduce_scatter": 3.0})
    st = cost.Stage("comm", "all_reduce", 1 << 20)  # an all-reduce reads the reduce-scatter's factor
    lat = float(cost.t_comm("all_reduce", 0, 8, p))
    assert lat > 0
    fr = cost.chunk_fracs(4)
    idle, busy = (
        cost.stage_times(st, fr, 8, p.gemm["bfloat16"], p),
        cost.stage_times(st, fr, 8, p.gemm["bfloat16"], loaded),
    )
    assert [float(b - i) for i, b in zip(idle, busy)] == pytest.approx([2 * lat] * 4)
    assert cost.stage_times(st, [1], 8, p.gemm["bfloat16"], loaded) == cost.stage_times(
        st, [1], 8, p.gemm["bfloat16"], p
    )
    ag = cost.Stage("comm", "all_gather", 1 << 20)
    assert cost.stage_times(ag, fr, 8, p.gemm["bfloat16"], loaded) == cost.stage_times(ag, fr, 8, p.gemm["bfloat16"], p)
    # read from a profile file's dict; values below 1 mean "not slower"
    d = json.loads((cost.PROFILE_DIR / "h100-nvlink.json").read_text())
    assert cost.profile_from_dict({**d, "loaded_latency": {"all_gather": 0.5}}).loaded_latency == {"all_gather": 1.0}


def test_fresh_outputs_page_fault_in_the_baseline_not_in_small_chunks():
    # glibc maps outputs of >= 32 MiB fresh on every call: the whole GEMM of a big site pays
    # the first touch of its output; row chunks (smaller outputs) do not, unless the rewrite
    # reassembles them into a whole tensor (an all-gather site's consumers).
    p = dataclasses.replace(cost.load_profile("h100-nvlink"), fresh_bytes=32 << 20, fresh_bw=1e9)
    g = p.gemm["bfloat16"]
    f, out = 2 * 4096 * 4096 * 4096, 4096 * 4096 * 2  # 32 MiB of bf16 output
    fr = cost.chunk_fracs(4)
    rs = cost.Stage("compute", "gemm", f, 1, 4096, out_bytes=out)
    bare = dataclasses.replace(rs, out_bytes=0)
    assert float(cost.stage_times(rs, [1], 8, g, p)[0] - cost.stage_times(bare, [1], 8, g, p)[0]) == pytest.approx(
        out / 1e9
    )
    assert cost.stage_times(rs, fr, 8, g, p) == cost.stage_times(bare, fr, 8, g, p)
    ag = dataclasses.replace(rs, out_whole=True)
    extra = sum(float(a - b) for a, b in zip(cost.stage_times(ag, fr, 8, g, p), cost.stage_times(bare, fr, 8, g, p)))
    assert extra == pytest.approx(out / 1e9)
    small = dataclasses.replace(rs, out_bytes=out // 2)
    assert cost.stage_times(small, [1], 8, g, p) == cost.stage_times(bare, [1], 8, g, p)
    d = json.loads((cost.PROFILE_DIR / "h100-nvlink.json").read_text())
    q = cost.profile_from_dict({**d, "fresh_alloc": {"bytes": 1024, "gbps": 2.5}})
    assert (q.fresh_bytes, q.fresh_bw) == (1024, 2.5e9)
    assert cost.profile_from_dict(d).fresh_bytes == 0  # GPU profiles: a caching allocator, no such cost


def test_skinny_gemms_pay_the_rows_term():
    g = cost.Gemm(1e12, 1.0, 0.0, half_rows=64)
    f = 2 * 1024 * 1024 * 1024
    assert float(cost.t_gemm(f, g, rows=64)) == pytest.approx(2 * float(cost.t_gemm(f, g)))
    assert float(cost.t_gemm(f, g, rows=0)) == float(cost.t_gemm(f, g))  # no rows: no term, no division by 0
    p = cost.load_profile("h100-nvlink")
    p = cost.Profile(**{**p.__dict__, "gemm": {"float32": g}})
    cut = cost.Stage("compute", "gemm", f, 1, rows=512)  # the chunks cut the rows: 128 rows each at n=4
    kept = cost.Stage("compute", "gemm", f, 1, rows=512, rows_chunked=False)  # chunks of heads: rows stay
    fr = cost.chunk_fracs(4, 512)
    assert sum(map(float, cost.stage_times(cut, fr, 8, g, p))) == pytest.approx(f / 1e12 * 1.5)
    assert sum(map(float, cost.stage_times(kept, fr, 8, g, p))) == pytest.approx(f / 1e12 * 1.125)
    # Batched GEMMs (bmm: rows per batch entry, e.g. per expert) have their own rows term; 0: as mm's.
    gb = dataclasses.replace(g, half_rows_batched=128)
    assert float(cost.t_gemm(f, gb, rows=64, batched=True)) == pytest.approx(3 * float(cost.t_gemm(f, g)))
    assert float(cost.t_gemm(f, g, rows=64, batched=True)) == pytest.approx(2 * float(cost.t_gemm(f, g)))
    bcut = dataclasses.replace(cut, batched=True)
    assert sum(map(float, cost.stage_times(bcut, fr, 8, gb, p))) == pytest.approx(f / 1e12 * 2.0)
    assert cost.Stage(**bcut.to_dict()) == bcut  # plans round-trip through JSON (traces, re-scoring)


def test_concurrent_reductions_hide_latency_under_a_neighbours_transfer():
    # gloo: chunked reduce-scatters issued at once run two at a time. Bandwidth-bound chunks
    # cost what the whole does (each later chunk adds its transfer only); latency-bound ones
    # add half their time each (two threads).
    serial = dataclasses.replace(cost.load_profile("h100-nvlink"), rs_factor=2.0, concurrent_reductions=False)
    p = dataclasses.replace(serial, concurrent_reductions=True, comm_threads=2)
    B = 1 << 30
    st = cost.Stage("comm", "reduce_scatter", B)
    fr = cost.chunk_fracs(8)
    lat = float(cost.t_comm("reduce_scatter", 0, 4, p))
    big = [float(t) for t in cost.stage_times(st, fr, 4, None, p)]
    whole = float(cost.t_comm("reduce_scatter", B, 4, p))
    assert big[0] == pytest.approx(float(cost.t_comm("reduce_scatter", B * fr[0], 4, p)))
    assert sum(big) == pytest.approx(whole)
    tiny = [float(t) for t in cost.stage_times(cost.Stage("comm", "reduce_scatter", 4096), fr, 4, None, p)]
    one = [float(cost.t_comm("reduce_scatter", 4096 * f, 4, p)) for f in fr]
    assert tiny[0] == pytest.approx(one[0]) and tiny[0] > lat
    assert tiny[1:] == pytest.approx([t / 2 for t in one[1:]])
    # Without concurrency (NCCL on one stream) every chunk pays its whole time.
    assert sum(float(t) for t in cost.stage_times(st, fr, 4, None, serial)) == pytest.approx(whole + 7 * lat)


def test_a_chunks_several_all_to_alls_hide_what_is_beyond_the_link_rate():
    # Ulysses: q, k and v go through one all-to-all each; the schedule issues a chunk's three
    # at once (the unrewritten graph waits on each), so each pays its bytes at the link's best
    # rate and only concurrent_excess of the rest. A measured curve slower per byte for big
    # messages (one TCP connection does not fill a shaped link):
    curve = ((1 << 20, 0.0066), (4 << 20, 0.038), (8 << 20, 0.092))
    serial = dataclasses.replace(cost.load_profile("h100-nvlink"), curves={"all_to_all": curve}, curves_world=2)
    p = dataclasses.replace(serial, concurrent_excess=0.5)
    B = 3 * (8 << 20)
    qkv, one = cost.Stage("comm", "all_to_all", B, count=3), cost.Stage("comm", "all_to_all", B // 3)
    rate = 0.0066 / (1 << 20)  # the best per byte: the 1 MiB point
    assert float(cost.t_link("all_to_all", 4 << 20, 2, p)) == pytest.approx(rate * (4 << 20))
    halves = [float(t) for t in cost.stage_times(qkv, cost.chunk_fracs(2), 2, None, p)]
    assert halves == pytest.approx([3 * (rate * (4 << 20) + 0.5 * (0.038 - rate * (4 << 20)))] * 2)
    serial_halves = [float(t) for t in cost.stage_times(qkv, cost.chunk_fracs(2), 2, None, serial)]
    assert serial_halves == pytest.approx([3 * 0.038] * 2)
    # Whole (the baseline waits on each) and one collective per chunk: as before.
    assert float(cost.stage_times(qkv, [1], 2, None, p)[0]) == pytest.approx(3 * 0.092)
    assert cost.stage_times(one, cost.chunk_fracs(2), 2, None, p) == cost.stage_times(
        one, cost.chunk_fracs(2), 2, None, serial
    )
    # Without a curve the excess is the formula's latency.
    ab = dataclasses.replace(p, curves={})
    lat = float(cost.t_comm("all_to_all", 0, 2, ab))
    t = [float(x) for x in cost.stage_times(qkv, cost.chunk_fracs(2), 2, None, ab)]
    assert t == pytest.approx([3 * (float(cost.t_comm("all_to_all", 4 << 20, 2, ab)) - 0.5 * lat)] * 2)


def test_pipeline_matches_flow_plus_overheads():
    p = cost.load_profile("h100-nvlink")
    g = p.gemm["bfloat16"]
    nbytes, flops, n = 8 << 20, 2 * 4096 * 4096 * 1024, 4
    t = float(cost.t_pipeline(True, flops, "all_gather", nbytes, 8, g, p, n, copy_bytes=1 << 20))
    fr = cost.chunk_fracs(n)
    cs = [float(cost.t_comm("all_gather", nbytes * f, 8, p)) for f in fr]
    gs = [float(cost.t_gemm(flops * f, g)) for f in fr]
    _, end = cost.flow([cs, gs], ["comm", "compute"], p.overlap_loss)
    assert t == pytest.approx(float(end) + (n - 1) * p.chunk_overhead + (1 << 20) / p.copy_bw)


def test_predict_prefers_overlap_when_balanced_and_skips_tiny_sites():
    p = cost.load_profile("h100-nvlink")
    # Llama-8B-like column-parallel GEMM, TP 8: comm and GEMM of the same order.
    big = cost.predict("all_gather_matmul", 8192 // 8 * 4096 * 2, 2 * 8192 * 4096 * 1792, 8, "bfloat16", p, 1024)
    assert big.strategy == "decompose" and big.gain > p.min_gain and 2 <= big.chunks <= 8
    assert big.best == min(big.per_chunks.values())
    # The pipeline can hide at most the shorter of comm and GEMM.
    assert big.base - big.best <= min(big.comm, big.gemm) + 1e-12
    tiny = cost.predict("all_gather_matmul", 16 * 128 * 2, 2 * 128 * 128 * 128, 8, "bfloat16", p, 16)
    assert tiny.gain < 0  # per-chunk latency costs more than there is to hide
    # Chunking has a cost: 8 chunks are predicted slower than the best count. (The curve need
    # not be monotone: tapered chunks 1,2,1 leave more exposed than 1,2,2,1 at similar cost.)
    assert big.per_chunks[8] > big.best and big.chunks < 8


def test_predictions_are_memoised_by_value_profile_included(monkeypatch):
    """A model's layers repeat the same sites: the second prediction of one is the first's
    (not computed again), a copy the caller may change; another profile is another prediction."""
    p = cost.load_profile("h100-nvlink")
    args = ("all_gather_matmul", 1024 * 4096 * 2, 2 * 8192 * 4096 * 1792, 8, "bfloat16")
    computed = []
    real = cost._predict_stages
    monkeypatch.setattr(cost, "_predict_stages", lambda *a: computed.append(a) or real(*a))
    cost._PREDICTIONS.clear()
    first = cost.predict(*args, p, 1024)
    first.per_chunks.clear()
    first.stages.clear()
    again = cost.predict(*args, p, 1024)
    assert again.per_chunks and again.stages and again.best == min(again.per_chunks.values())
    assert len(computed) == 1
    slower = dataclasses.replace(p, link=cost.Link(p.link.alpha, p.link.beta / 4))
    assert cost.predict(*args, slower, 1024).comm > 3 * again.comm  # a quarter of the bandwidth (+ latency)
    assert len(computed) == 2


def test_auto_skips_small_sites_with_the_models_reason(fake_mesh8):
    from overlapc.models import llama

    model, inputs = llama.build_tp_sp(fake_mesh8, n_layers=1)
    report = overlapc.explain(model, *inputs, options={"hardware": "h100-nvlink"})
    sites = [s for s in report.sites if s.pattern != "collective"]
    assert sites and all(s.status == "skipped" for s in sites)
    for s in sites:
        assert "predicted gain" in s.reason and "below the threshold 2% of profile 'h100-nvlink'" in s.reason, s.reason
        assert "M=" in s.reason and s.details["predicted"]["base_ms"] > 0


def _balanced_profile(tmp_path) -> str:
    prof = json.loads((cost.PROFILE_DIR / "h100-nvlink.json").read_text())
    prof.update(name="balanced", link={"alpha_us": 1.0, "beta_gbps": 100})
    prof["gemm"]["bfloat16"] = {"peak_tflops": 40, "eff_max": 1.0, "half_gflop": 0.1}
    path = tmp_path / "balanced.json"
    path.write_text(json.dumps(prof))
    return str(path)


def test_auto_overlaps_large_sites_with_the_models_chunk_count(fake_mesh8, tmp_path):
    from overlapc.models import llama

    model, inputs = llama.build_tp_sp(
        fake_mesh8, n_layers=1, dim=2048, n_heads=16, ffn_dim=5632, seq=4096, batch=1, dtype="bfloat16"
    )
    # A profile (a file, as users pass their own) where this shape's transfers and GEMMs
    # take about as long: overlap pays.
    path = _balanced_profile(tmp_path)
    report = overlapc.explain(model, *inputs, options={"hardware": str(path)})
    modelled = [s for s in report.sites if s.details.get("predicted")]
    assert len(modelled) == 10
    rewritten = [s for s in modelled if s.status == "rewritten"]
    assert len(rewritten) >= 6, str(report)
    for s in rewritten:
        p = s.details["predicted"]
        assert s.chunks == p["chunks"] and p["gain"] >= 0.02 and p["profile"] == "balanced"
    for s in modelled:
        if s.status == "skipped":
            assert "predicted gain" in s.reason


def test_plan_cli_json_and_trace(tmp_path, capsys):
    from overlapc.cli import main

    trace = tmp_path / "plan.json"
    rc = main(
        [
            "plan",
            "overlapc.models.llama:build_tp_sp",
            "--world-size",
            "8",
            "--hardware",
            _balanced_profile(tmp_path),
            "--arg",
            "dim=2048",
            "--arg",
            "n_heads=16",
            "--arg",
            "ffn_dim=5632",
            "--arg",
            "seq=4096",
            "--arg",
            "batch=1",
            "--arg",
            "dtype='bfloat16'",
            "--arg",
            "n_layers=1",
            "--json",
            "--trace",
            str(trace),
        ]
    )
    assert rc == 0
    out = capsys.readouterr().out
    rows = json.loads(out[: out.rindex("]") + 1])
    assert len(rows) == 10 and all(r["profile"] == "balanced" and r["base_ms"] > 0 for r in rows)
    events = json.loads(trace.read_text())["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert {e["pid"] for e in spans} == {0, 1} and {e["cat"] for e in spans} == {"compute", "comm"}
    planned = [e for e in spans if e["pid"] == 1]
    assert any(e["name"].startswith("gemm 1") for e in planned)  # a chunked site is drawn chunk by chunk
    assert (tmp_path / "plan.png").stat().st_size > 1000
    assert main(["plan", "overlapc.models.llama:build_tp_sp", "-w", "8", "--hardware", "tpu"]) == 2


def calibrate_job():
    from overlapc.calibrate import measure

    return measure(reps=3)


@pytest.mark.distributed
def test_calibrate_gives_every_rank_rank0s_numbers(world2, tmp_path):
    profs = world2.run(calibrate_job)
    assert profs[0] == profs[1]
    p = profs[0]
    assert p["link"]["beta_gbps"] > 0 and p["link"]["alpha_us"] > 0 and p["copy_gbps"] > 0
    assert p["gemm"]["float32"]["peak_tflops"] > 0
    # Curve points are bytes of one rank's input, what t_comm is given: the all-to-all sends
    # what the all-gather of the same point gathers; the model gives back the measured times.
    assert p["curves_world"] == 2 and {k: len(v) for k, v in p["curves"].items()} == {"all_gather": 5, "all_to_all": 5}
    prof = cost.profile_from_dict(p)
    for (b_ag, _), (b_a2a, _) in zip(p["curves"]["all_gather"], p["curves"]["all_to_all"]):
        assert b_a2a == 2 * b_ag
    for kind in ("all_gather", "all_to_all"):
        for b, t in prof.curves[kind]:
            assert float(cost.t_comm(kind, b, 2, prof)) == pytest.approx(t)
    assert 0.0 <= p["concurrent_excess"] <= 1.0
    assert set(p["loaded_latency"]) == {"all_gather", "reduce_scatter"} and min(p["loaded_latency"].values()) >= 1.0
    assert all(g["half_rows"] >= 0 and g["half_rows_batched"] >= 0 for g in p["gemm"].values())
    assert p["fresh_alloc"] is None or (p["fresh_alloc"]["bytes"] == 32 << 20 and p["fresh_alloc"]["gbps"] > 0)
    f = tmp_path / "local.json"
    f.write_text(json.dumps(p))
    assert cost.load_profile(str(f)).name == "cpu-local"


def test_calibration_takes_the_typical_time_of_a_bimodal_transfer():
    # Over a shaped TCP link a big transfer takes one of two times, about half and half: a
    # median lands on either mode; the mean without the extremes stays between them.
    from overlapc.calibrate import _typical

    runs = [100, 167, 101, 166, 99, 168, 100, 167, 500]  # one straggler
    assert _typical(runs) == pytest.approx((sum(runs) - 99 - 500) / 7)
    a, b = [100] * 4 + [167] * 5, [100] * 5 + [167] * 4  # medians 167 and 100
    assert abs(_typical(a) - _typical(b)) < 0.07 * _typical(a)
    assert _typical([3, 1, 2]) == 2  # too few to drop any: the median


def _moe_plan(mesh, profile, overrides=None, **kw):
    from overlapc.models import moe

    model, inputs = moe.build_ep(mesh, **kw)
    return overlapc.explain(model, *inputs, options={"hardware": profile, "overrides": overrides or {}})


def test_all_to_all_regions_are_planned_by_the_model(fake_mesh8, tmp_path):
    # Small MoE on H100 NVLink: per-chunk latency outweighs what there is to hide.
    small = _moe_plan(fake_mesh8, "h100-nvlink")
    a2a = [s for s in small.sites if s.pattern in ("all_to_all_matmul", "matmul_all_to_all")]
    assert len(a2a) == 4 and all(s.status == "skipped" for s in a2a), str(small)
    first = a2a[0]
    assert "predicted gain" in first.reason and "region of 2 all-to-alls" in first.reason, first.reason
    pred = first.details["predicted"]
    assert [st["lane"] for st in pred["stages"]] == ["comm", "compute", "comm"]  # dispatch, experts, combine
    assert pred["stages"][0]["kind"] == "all_to_all" and pred["stages"][1]["count"] >= 2
    chained = [s for s in a2a if s.details.get("modelled_with")]
    assert chained and all(s.reason.startswith("in the region of ") for s in chained)
    # A chained site's own override wins over its region's model skip: the combine is planned
    # by itself (its own region: the experts upstream of it and the combine).
    forced = _moe_plan(fake_mesh8, "h100-nvlink", overrides={"forward:*:matmul_all_to_all": {"strategy": "decompose"}})
    combine = next(s for s in forced.sites if s.name.startswith("forward:") and s.pattern == "matmul_all_to_all")
    assert combine.status == "rewritten" and "modelled_with" not in combine.details, (combine.status, combine.reason)
    # A site left alone (strategy "none") is not part of the region another site's prediction prices.
    alone = _moe_plan(fake_mesh8, "h100-nvlink", overrides={"forward:*:matmul_all_to_all": {"strategy": "none"}})
    dispatch = next(s for s in alone.sites if s.name.startswith("forward:") and s.pattern == "all_to_all_matmul")
    assert [st["lane"] for st in dispatch.details["predicted"]["stages"]] == ["comm", "compute"]
    # Large tokens on a profile where the all-to-alls take about as long as the experts: rewritten,
    # with the model's chunk count, each region predicted (and counted) once.
    balanced = _balanced_profile(tmp_path)
    big = _moe_plan(fake_mesh8, balanced, tokens=8192, dim=2048, hidden=4096)
    rewritten = [s for s in big.sites if s.status == "rewritten" and s.pattern != "collective"]
    owners = [s for s in rewritten if s.details.get("predicted")]
    assert len(owners) == 2 and len(rewritten) == 4, str(big)  # forward and backward regions
    for s in owners:
        p = s.details["predicted"]
        assert s.chunks == p["chunks"] and p["gain"] >= 0.02 and p["best_ms"] == min(p["by_chunks_ms"].values())
        assert p["extent"] == s.details["axis"]["extent"]
        # The planned timeline is the model's own flow: it ends at the predicted time.
        _, planned = cost.site_events(p, 8, cost.load_profile(balanced), "decompose", s.chunks)
        assert max(t + d for _, _, t, d in planned) * 1e3 == pytest.approx(p["best_ms"], rel=1e-3)
    # The backward's expert weight gradients are priced whole, after the experts' chunks.
    bw = next(s for s in owners if s.graph == "backward").details["predicted"]["stages"]
    assert [(st["lane"], st["after_count"]) for st in bw] == [("comm", 0), ("compute", 3), ("comm", 0)], bw
    assert bw[1]["after"] > 0


def test_ulysses_region_has_projection_attention_and_output_stages(fake_mesh8, tmp_path):
    from overlapc.models import ulysses

    model, inputs = ulysses.build_ulysses(fake_mesh8, seq=8192, batch=1, dim=2048, n_heads=16)
    report = overlapc.explain(model, *inputs, options={"hardware": _balanced_profile(tmp_path)})
    owners = [s for s in report.sites if s.details.get("predicted")]
    assert len(owners) == 2, str(report)  # one region forward, one backward
    fwd = next(s for s in owners if s.graph == "forward").details["predicted"]
    assert [st["lane"] for st in fwd["stages"]] == ["compute", "comm", "compute", "comm", "compute"]
    q_k_v, attn = fwd["stages"][1], fwd["stages"][2]
    assert q_k_v["count"] == 3 and attn["amount"] == 4 * 8192 * 8192 * 2048 // 8 // 2  # q, k, v; causal attention


def _dropless_sites(mesh, profile, overrides=None, **kw):
    """The all-to-all sites of a dropless MoE training step, compiled for real (fake process
    group): its split sizes come from .tolist(), which explain()'s fake tensors cannot give."""
    if torch.__version__ < (2, 12):
        pytest.skip(
            "torch 2.11's fake process group leaves all_to_all_single's output unwritten "
            "(2.13's copies the input): the model's run-time split sizes would be garbage"
        )
    from overlapc import Backend, Options
    from overlapc.models import moe

    cfg = dict(
        tokens=64, dim=64, hidden=128, n_experts=8, top_k=2, form="dropless", expert_form="grouped", dtype="bfloat16"
    )
    cfg.update(kw)
    model, inputs = moe.build_ep(mesh, **cfg)
    be = Backend(Options(hardware=profile, overrides=overrides or {}))
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        torch.compile(model, backend=be)(*inputs).float().sum().backward()
    return cfg, [s for s in be.report.sites if s.pattern in ("all_to_all_matmul", "matmul_all_to_all")]


def test_dropless_pipelines_are_priced_at_balanced_routing(fake_mesh8, tmp_path):
    # Tokens and widths where, under this profile (GEMMs at full rate at any size), the
    # all-to-alls take about as long as the experts.
    prof = json.loads(open(_balanced_profile(tmp_path)).read())
    prof["gemm"]["bfloat16"]["half_gflop"] = 0.0
    (tmp_path / "flat.json").write_text(json.dumps(prof))
    cfg, sites = _dropless_sites(fake_mesh8, str(tmp_path / "flat.json"), tokens=4096, dim=256, hidden=256)
    fwd = [s for s in sites if s.graph == "forward"]
    assert len(fwd) == 2 and len(sites) == 4, [s.name for s in sites]
    owner, follower = fwd
    pred = owner.details["predicted"]
    rows = cfg["tokens"] * cfg["top_k"]  # sent per rank, and received at balanced routing
    assert [(st["lane"], st["kind"]) for st in pred["stages"]] == [
        ("comm", "all_to_all"),
        ("compute", "gemm"),
        ("comm", "all_to_all"),
    ]
    assert pred["stages"][0]["amount"] == pred["stages"][2]["amount"] == rows * cfg["dim"] * 2  # bf16
    # w1, w3: (rows, dim) x (dim, hidden); w2: (rows, hidden) x (hidden, dim); one call each.
    assert pred["stages"][1]["amount"] == 3 * 2 * rows * cfg["dim"] * cfg["hidden"]
    assert pred["stages"][1]["count"] == 3 and pred["stages"][1]["rows"] == rows // cfg["n_experts"]
    assert pred["extent"] is None and set(pred["by_chunks_ms"]) == {str(n) for n in range(2, 9)}
    # The combine follows the dispatch (one op runs both), with its decision.
    assert follower.details["modelled_with"] == owner.name
    assert (owner.status, owner.chunks, follower.status, follower.chunks) == ("rewritten", pred["chunks"]) * 2, (
        owner.reason
    )
    # The backward sends the sum of the forward's run-time send splits (symbolic there),
    # which is always what the forward sent: priced like the forward, from its number, with
    # the tail's weight gradients run whole after the chunks.
    bwd = [s for s in sites if s.graph == "backward"]
    assert len(bwd) == 2
    bpred = next(s.details["predicted"] for s in bwd if "predicted" in s.details)
    assert bpred["stages"][0]["amount"] == bpred["stages"][2]["amount"] == rows * cfg["dim"] * 2
    assert bpred["stages"][1]["after"] == 3 * 2 * rows * cfg["dim"] * cfg["hidden"]  # three weight gradients
    assert all(s.status == "rewritten" and s.chunks == bpred["chunks"] for s in bwd), [s.reason for s in bwd]
    # Its weight gradients are the pipeline's tail, whole (grouped matmuls of t(rows)); the
    # input gradients run per chunk in the body.
    from overlapc.passes.dropless import GROUPED_MM
    from overlapc.runtime.dropless import _PIPELINES

    runners = {r.site: r for r in _PIPELINES.values()}
    bw = runners[next(s.name for s in sites if s.graph == "backward" and s.name in runners)]
    fw = runners[owner.name]
    mms = lambda g: sum(n.target is GROUPED_MM for n in g.graph.nodes)  # noqa: E731
    assert fw.tail is None and mms(fw.body) == 3
    assert mms(bw.tail) == 3 and mms(bw.body) == 3 and len(bw.tail_sources) >= 2, bw.tail.code
    # Tiny pipeline on H100 NVLink: latency outweighs what there is to hide; the pair is skipped.
    _, sites = _dropless_sites(fake_mesh8, "h100-nvlink")
    owner, follower = [s for s in sites if s.graph == "forward"]
    assert owner.status == "skipped" and owner.reason.startswith("predicted gain"), owner.reason
    assert "a dropless pipeline of 3 GEMMs, 128 rows sent per rank" in owner.reason
    assert follower.status == "skipped" and follower.reason.startswith(f"in the pipeline of {owner.name}: ")
    # One op runs both all-to-alls or neither: the combine left alone keeps the dispatch too.
    _, sites = _dropless_sites(
        fake_mesh8,
        str(tmp_path / "flat.json"),
        tokens=4096,
        dim=256,
        hidden=256,
        overrides={"forward:*:matmul_all_to_all": {"strategy": "none"}},
    )
    owner, follower = [s for s in sites if s.graph == "forward"]
    assert follower.status == "found" and owner.status == "skipped", (owner.status, owner.reason)
    assert f"other all-to-all, {follower.name.split(':')[1]}, is left alone" in owner.reason


@pytest.mark.parametrize("half_rows, batched, axis", [(0, 0, "slots"), (4096, 0, "experts"), (0, 4096, "experts")])
def test_moe_axis_is_the_models_choice(fake_mesh8, tmp_path, half_rows, batched, axis):
    """Capacity-slot chunks allow more chunks but make every chunk's GEMM stream all the
    local experts' weights for fewer rows; whole-expert chunks use each weight once. With a
    rows term the model prefers experts; without, the finer slot pipeline. The experts are
    bmm: the batched rows term (half_rows_batched) is theirs; 0 falls back to mm's."""
    prof = json.loads(open(_balanced_profile(tmp_path)).read())
    prof["gemm"]["float32"] = {
        "peak_tflops": 20,
        "eff_max": 1.0,
        "half_gflop": 0.0,
        "half_rows": half_rows,
        "half_rows_batched": batched,
    }
    prof["link"] = {"alpha_us": 1.0, "beta_gbps": 6}  # the all-to-alls about as long as the experts
    path = tmp_path / f"rows{half_rows}-{batched}.json"
    path.write_text(json.dumps(prof))
    report = _moe_plan(fake_mesh8, str(path), tokens=8192, dim=2048, hidden=4096, n_experts=32)
    local = 32 // 8
    for s in report.sites:
        if s.pattern == "collective" or not s.details.get("predicted"):
            continue
        assert s.status == "rewritten", str(report)
        a = s.details["axis"]
        if axis == "experts":
            assert a["extent"] == local and a["inner"] > 1 and s.chunks <= local, a
        else:
            assert a["extent"] > local and a["inner"] == 1, a
