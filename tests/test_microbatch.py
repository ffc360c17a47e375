"""Option ``microbatches``: the TP+SP model's batch cut into slices that interleave
(passes/microbatch.py), against eager on every rank, forward and every gradient.

Tolerances:
- fp32 (inner="eager"; inner="inductor": rtol 1e-4, it also fuses the norms' reductions
  and reorders their sums): each slice runs the same ATen ops on fewer rows (GEMMs with smaller M may block
  differently), weight gradients are sums of per-slice partials (another association of
  the batch sum), and the sliced reduce-scatters add across ranks per slice: last-bit
  differences, bounded by 1e-5 relative and absolute (as for the row-chunked rewrites).
- bf16: eager bf16 itself is far from the exact result (every GEMM output and norm is
  rounded to 8 bits), and sums over the batch stay whole in bf16 (passes/axis.py: no
  rounded partials), so overlapc is compared with an fp32 evaluation of the same bf16
  weights: its error may not exceed twice eager bf16's plus one bf16 ulp of the largest value.
"""

from __future__ import annotations

from pathlib import Path

import eager_check
import pytest
import torch
import torch.distributed as dist

SMALL = dict(n_layers=1, dim=64, n_heads=4, ffn_dim=128, vocab_size=64, seq=16)
SLOW_LINK = str(Path(__file__).parent / "data" / "slow-link.json")
"""A made-up profile under which SMALL's communication and compute are of one order (see its "source")."""


def _run(model, tokens, seed, fn=None):
    out = eager_check.step(model if fn is None else fn, (tokens,), seed)
    return {"output": out, **eager_check.grads(model)}


def microbatch_job(config: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    import overlapc
    from overlapc.models import llama

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    kw = {**SMALL, "batch": config["batch"], "dtype": config["dtype"]}
    ref, (tokens,) = llama.build_tp_sp(mesh, **kw)
    model, _ = llama.build_tp_sp(mesh, **kw)
    be = overlapc.backend(**{"inner": "eager", **config["options"]})
    got = _run(model, tokens, seed=3, fn=torch.compile(model, backend=be))
    want = _run(ref, tokens, seed=3)
    errs = {}
    if config["dtype"] == "bfloat16":
        truth, _ = llama.build_tp_sp(mesh, **kw)
        exact = _run(truth.float(), tokens, seed=3)
        for k, v in exact.items():
            ulp = v.abs().max().item() * 2**-8
            errs[k] = ((got[k].float() - v).abs().max().item(), (want[k].float() - v).abs().max().item(), ulp)
    else:
        # inductor also fuses the norms' reductions and pointwise ops (another summation order)
        rtol = 1e-4 if config["options"].get("inner") == "inductor" else 1e-5
        assert got.keys() == want.keys()
        for k in want:
            torch.testing.assert_close(
                got[k], want[k], rtol=rtol, atol=1e-5, msg=lambda m: f"rank {dist.get_rank()} {k}: {m}"
            )
    cuts = sorted(
        (s.graph, s.status, s.chunks, len(s.details.get("collectives", [])))
        for s in be.report.sites
        if s.pattern == "microbatch"
    )
    sites = sorted(
        {(s.graph, s.pattern, s.status) for s in be.report.sites if s.pattern not in ("microbatch", "collective")}
    )
    return {"cuts": cuts, "sites": sites, "errs": errs}


CASES = {
    # microbatches only: the slices' collectives whole, interleaved by the schedule
    "slices-only": dict(batch=2, dtype="float32", options=dict(microbatches=2, strategy="none")),
    # slices, and every site inside them decomposed into row chunks
    "slices+chunks": dict(batch=2, dtype="float32", options=dict(microbatches=2, strategy="decompose", chunks=2)),
    # a batch of 3 in 2 slices: uneven (1 and 2 sequences)
    "uneven": dict(batch=3, dtype="float32", options=dict(microbatches=2, strategy="none")),
    "bf16": dict(batch=2, dtype="bfloat16", options=dict(microbatches=2, strategy="decompose", chunks=2)),
    "inductor": dict(batch=2, dtype="float32", options=dict(microbatches=2, strategy="none", inner="inductor")),
    # the planner's choice: under SLOW_LINK at world 2, row chunks in the forward, slices in the backward
    "auto": dict(batch=2, dtype="float32", options=dict(microbatches="auto", hardware=SLOW_LINK)),
}


def _check(results, config):
    slices = min(config["options"]["microbatches"], config["batch"])
    for r in results:
        graphs = {g for g, *_ in r["cuts"]}
        assert graphs == {"forward", "backward"}, r["cuts"]
        for _graph, status, chunks, colls in r["cuts"]:
            assert status == "rewritten" and chunks == slices and colls >= 4, r["cuts"]
        if config["options"]["strategy"] == "decompose":
            assert r["sites"] and all(st == "rewritten" for *_, st in r["sites"]), r["sites"]
        for k, (ovl, base, ulp) in r["errs"].items():
            assert ovl <= 2 * base + ulp, (k, ovl, base, ulp)


@pytest.mark.distributed
@pytest.mark.parametrize("case", ["slices-only", "slices+chunks", "uneven", "bf16"])
def test_microbatches_world2(world2, case):
    _check(world2.run(microbatch_job, CASES[case]), CASES[case])


@pytest.mark.distributed
@pytest.mark.slow
def test_microbatches_inductor_world2(world2):
    _check(world2.run(microbatch_job, CASES["inductor"]), CASES["inductor"])


@pytest.mark.distributed
def test_microbatches_auto_world2(world2):
    """microbatches="auto" cuts the backward (slices predicted to save more there) and leaves
    the forward to its row-chunked sites: both against eager, every rank."""
    for r in world2.run(microbatch_job, CASES["auto"]):
        assert [c[:3] for c in r["cuts"]] == [("backward", "rewritten", 2)], r["cuts"]
        assert {(g, st) for g, _, st in r["sites"]} == {("forward", "rewritten"), ("backward", "skipped")}, r["sites"]


@pytest.mark.distributed
def test_microbatches_world4(world4):
    _check(world4.run(microbatch_job, CASES["slices-only"]), CASES["slices-only"])


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "2"])
def test_microbatches_option_is_checked(bad):
    from overlapc import Options
    from overlapc.errors import OverlapError

    with pytest.raises(OverlapError, match="'microbatches' must be an int >= 1 .1: off. or \"auto\""):
        Options(microbatches=bad)


def test_microbatches_auto_follows_the_cost_model(fake_mesh8):
    """World 8 (fake PG): where microbatches="auto" cuts a graph, the model predicted the
    slices to save more than the row-chunked sites they take in, and those sites stay whole
    (with why); where it declines, those sites say why; strategy "none" cuts nothing (the
    baseline of every benchmark)."""
    import overlapc
    from overlapc.models import llama

    kw = dict(SMALL, n_heads=8)

    def explain(**options):
        model, inputs = llama.build_tp_sp(fake_mesh8, batch=2, **kw)
        return overlapc.explain(model, *inputs, options={"microbatches": "auto", **options})

    cut = explain(hardware=SLOW_LINK)
    rows = [s for s in cut.sites if s.pattern == "microbatch"]
    assert {(s.graph, s.status, s.chunks) for s in rows} == {("forward", "rewritten", 2), ("backward", "rewritten", 2)}
    for s in rows:
        p = s.details["predicted"]
        assert p["base_ms"] - p["sliced_ms"] > max(p["row_chunks_saving_ms"], 0.03 * p["base_ms"]), p
    inside = [s for s in cut.sites if s.pattern not in ("microbatch", "collective")]
    assert inside and all(s.status == "skipped" and "inside the micro-batch slices" in s.reason for s in inside)

    declined = explain(hardware="cpu-default")  # latency-bound at these shapes: slices cost more
    assert not [s for s in declined.sites if s.pattern == "microbatch"]
    said = [s.details.get("microbatches", "") for s in declined.sites if s.pattern != "collective"]
    assert said and all("not cut" in why for why in said), said

    rep = explain(hardware=SLOW_LINK, strategy="none")
    assert not [s for s in rep.sites if s.pattern == "microbatch" or "microbatches" in s.details], str(rep)


def test_microbatches_report_skips_with_reason(fake_mesh8):
    """A batch of 1 cannot be cut: the graphs run unchanged, and the report says why."""
    import overlapc
    from overlapc.models import llama

    model, inputs = llama.build_tp_sp(fake_mesh8, n_layers=1, batch=1)
    rep = overlapc.explain(model, *inputs, options={"microbatches": 2, "strategy": "none"})
    rows = [s for s in rep.sites if s.pattern == "microbatch"]
    assert {s.graph for s in rows} == {"forward", "backward"}
    for s in rows:
        assert s.status == "skipped" and "batch (dim 0" in s.reason, s


def test_microbatches_structure(fake_mesh8):
    """World 8 (fake PG), 2 layers: every site of the forward and backward appears once per
    slice, under its own module (the slices keep their original nodes' provenance)."""
    import overlapc
    from overlapc.models import llama

    model, inputs = llama.build_tp_sp(fake_mesh8, n_layers=2, batch=2)
    plain = overlapc.explain(model, *inputs, options={"strategy": "none"})
    model, inputs = llama.build_tp_sp(fake_mesh8, n_layers=2, batch=2)
    sliced = overlapc.explain(model, *inputs, options={"strategy": "none", "microbatches": 2})
    for (graph, pattern), n in plain.counts().items():
        if pattern != "collective":
            assert sliced.counts()[(graph, pattern)] == 2 * n, (graph, pattern, sliced.counts())

    def modules(rep):
        return sorted(s.module for s in rep.sites if s.pattern not in ("collective", "microbatch"))

    assert modules(sliced) == sorted(2 * modules(plain))
    cuts = [s for s in sliced.sites if s.pattern == "microbatch"]
    assert {(s.graph, s.status, s.chunks) for s in cuts} == {("forward", "rewritten", 2), ("backward", "rewritten", 2)}
    # more slices asked for than the batch has: as many as it has
    model, inputs = llama.build_tp_sp(fake_mesh8, n_layers=1, batch=2)
    capped = overlapc.explain(model, *inputs, options={"strategy": "none", "microbatches": 4})
    assert {s.chunks for s in capped.sites if s.pattern == "microbatch"} == {2}


def test_microbatch_failed_replay_is_reported(fake_mesh8, monkeypatch):
    """A sliced replay that fails midway leaves the graph as it was (its sites still found
    as without slices) and the report says why."""
    import overlapc
    from overlapc.models import llama
    from overlapc.passes import axis

    def replay(b, region, sizes, marks=None):
        b.view(region.seeds[0], axis.static_shape(region.seeds[0]))  # something built already
        raise RuntimeError("slice shape refused")

    model, inputs = llama.build_tp_sp(fake_mesh8, n_layers=1, batch=2)
    plain = overlapc.explain(model, *inputs, options={"strategy": "none"})
    monkeypatch.setattr(axis, "replay", replay)
    model, inputs = llama.build_tp_sp(fake_mesh8, n_layers=1, batch=2)
    rep = overlapc.explain(model, *inputs, options={"strategy": "none", "microbatches": 2})
    cuts = [s for s in rep.sites if s.pattern == "microbatch"]
    assert cuts and all(s.status == "skipped" and "slice shape refused" in s.reason for s in cuts), str(rep)
    assert {k: v for k, v in rep.counts().items() if k[1] != "microbatch"} == plain.counts()


def test_microbatch_region_goes_through_cuda_fused_attention(fake_mesh8, monkeypatch):
    """On a GPU, SDPA traces to CUDA's fused kernels (here their CPU stand-ins,
    tests/sdpa_doubles.py): batch slices run through them as through the CPU's flash op,
    taking in the same collectives, forward and backward."""
    import sdpa_doubles

    import overlapc
    from overlapc.models import llama

    sdpa_doubles.register()

    def cut(kind):
        if kind is not None:
            monkeypatch.setattr(
                torch.nn.functional,
                "scaled_dot_product_attention",
                lambda q, k, v, is_causal=False: sdpa_doubles.call(kind, q, k, v, is_causal),
            )
        model, inputs = llama.build_tp_sp(fake_mesh8, n_layers=1, batch=2)
        report = overlapc.explain(model, *inputs, options={"strategy": "none", "microbatches": 2})
        return sorted(
            (s.graph, s.status, s.chunks, s.details["collectives"], s.details["sums_after_slices"])
            for s in report.sites
            if s.pattern == "microbatch"
        )

    cpu = cut(None)
    assert [c[:3] for c in cpu] == [("backward", "rewritten", 2), ("forward", "rewritten", 2)], cpu
    for kind in ("flash", "efficient"):
        assert cut(kind) == cpu, kind
