"""Dynamic shapes: one torch.compile(dynamic=True) model runs several batch sizes, with a
plan per shape bucket (overlapc/buckets.py), equal to eager on every rank.

Tolerances are those of tests/test_models_distributed.py (same ops, chunked): fp32 1e-5
with inner="eager", 1e-4 relative with inductor (fused reductions change summation order).
"""

from __future__ import annotations

import eager_check
import pytest
import torch
import torch.distributed as dist

from overlapc.buckets import bucket_of

TOL = {"eager": dict(rtol=1e-5, atol=1e-5), "inductor": dict(rtol=1e-4, atol=1e-5)}
SMALL = dict(n_layers=1, dim=64, n_heads=4, ffn_dim=128, vocab_size=64)


def test_buckets_are_power_of_two_ranges():
    assert [bucket_of(v) for v in (-3, 0, 1, 2, 3, 4, 7, 8, 15, 16)] == [-3, 0, 1, 2, 2, 4, 4, 8, 8, 16]


def test_plan_per_bucket(fake_mesh8):
    """One compiled function, two buckets: at the small one the cost model skips both sites
    (its reason names the planned numbers), at the large one it rewrites; a third size in
    the large bucket runs on that bucket's entry (no new compile, no guard on its exact value)."""
    import torch.distributed._functional_collectives as fc

    import overlapc
    from overlapc.options import Options

    group = fake_mesh8.get_group()
    w1, w2 = torch.randn(512, 512), torch.randn(512, 512)

    def mlp(x):
        h = fc.all_gather_tensor(x, 0, group) @ w1
        return fc.reduce_scatter_tensor(torch.relu(h) @ w2, "sum", 0, group)

    be = overlapc.Backend(Options.from_user(None, strategy="auto", hardware="cpu-default"), verify_plans=False)
    torch._dynamo.reset()
    fn = torch.compile(mlp, backend=be, dynamic=True)
    for b in (8, 12, 512, 700):  # 512 rows of width 512: no spurious equality guard
        assert fn(torch.randn(b, 512)).shape == (b, 512)
    (graph,) = be.bucketed
    assert sorted(k[0] for k in graph.entries) == [8, 512], graph.entries
    assert all(len(v) == 1 for v in graph.entries.values()), graph.entries
    by_bucket: dict[int, list] = {}
    for s in be.report.sites:
        by_bucket.setdefault(s.details["bucket"]["rows_at"], []).append(s)
    assert sorted(by_bucket) == [8, 512], by_bucket.keys()  # lower bounds of [8, 16) and [512, 1024)
    assert all(s.status == "skipped" and "predicted gain" in s.reason and "at s" in s.reason for s in by_bucket[8]), [
        s.reason for s in by_bucket[8]
    ]
    assert any(s.status == "rewritten" for s in by_bucket[512]), [s.reason for s in by_bucket[512]]


def test_bucket_plan_fits_its_smallest_size(fake_mesh8):
    """Sizes of one bucket share an entry (40, 56 and 48 rows, bucket [32, 64)), whatever a
    Python int argument is (any sign: a symbol too, guarded, not bucketed); a fixed count
    larger than the bucket's smallest size is clamped to it, not to the call's size, so
    every size of the bucket can be split (5 and 7 rows, bucket [4, 8): 4 chunks)."""
    import torch.distributed._functional_collectives as fc

    import overlapc
    from overlapc.options import Options

    group = fake_mesh8.get_group()
    w = torch.randn(16, 16)

    def layer(x, shift: int):
        return fc.all_gather_tensor(x, 0, group) @ w + shift

    def compiled(chunks):
        be = overlapc.Backend(
            Options.from_user(None, strategy="decompose", chunks=chunks, inner="eager"), verify_plans=False
        )
        torch._dynamo.reset()
        return torch.compile(layer, backend=be, dynamic=True), be

    fn, be = compiled(4)
    for rows, shift in ((40, -3), (56, 5), (48, 16)):
        assert fn(torch.randn(rows, 16), shift).shape == (8 * rows, 16)
    (graph,) = be.bucketed
    assert [len(v) for v in graph.entries.values()] == [1], graph.entries

    fn, be = compiled(8)
    for rows in (5, 7):
        assert fn(torch.randn(rows, 16), 1).shape == (8 * rows, 16)
    sites = [s for s in be.report.sites if s.pattern == "all_gather_matmul"]
    assert sites and all(s.status == "rewritten" and s.chunks == 4 for s in sites), [
        (s.status, s.chunks, s.reason) for s in sites
    ]
    assert sites[0].details["chunks_clamped"] == "8 -> 4: only 4 rows to split"


def test_entry_limit_falls_back_to_the_captured_graph(fake_mesh8):
    """Past dynamo's recompile limit a new size runs the graph as captured (no rewrite) with
    one warning, instead of compiling without bound; compiled buckets keep their entries.
    The backend holds its bucketed graphs weakly: dynamo's reset frees them."""
    import gc
    import warnings

    import torch._dynamo.config as dc
    import torch.distributed._functional_collectives as fc

    import overlapc
    from overlapc.options import Options

    group = fake_mesh8.get_group()
    w = torch.randn(16, 16)

    def layer(x):
        return fc.all_gather_tensor(x, 0, group) @ w

    be = overlapc.Backend(Options.from_user(None, strategy="decompose", chunks=2, inner="eager"), verify_plans=False)
    torch._dynamo.reset()
    fn = torch.compile(layer, backend=be, dynamic=True)
    with dc.patch(recompile_limit=2), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for rows in (8, 40, 130, 300, 41):  # buckets 8, 32, 128, 256, 32
            assert fn(torch.randn(rows, 16)).shape == (8 * rows, 16)
    (graph,) = be.bucketed
    assert graph.compiles == 2 and sorted(k[0] for k in graph.entries) == [8, 32]
    assert graph.fell_back == 2  # 130 and 300 rows; 41 ran bucket 32's entry
    limit = [str(c.message) for c in caught if "recompile_limit = 2" in str(c.message)]
    assert len(limit) == 1 and "without overlap" in limit[0], [str(c.message) for c in caught]
    del graph
    torch._dynamo.reset()
    gc.collect()
    assert be.bucketed == []


def run_batches(inner: str, batches: list[int], seq: int, options: dict | None = None):
    """Job: one compiled TP+SP Llama (dynamic=True) against an eager twin, batch by batch;
    forward output and every gradient compared after each step."""
    # Scalar C++ kernels: inductor's CPU vectorizer simplifies every symbolic stride with
    # sympy, about half of the inductor case's time (cProfile, 2026-12-05); the graph, the
    # rewrite and the buckets under test are the same without it. Patched for this job
    # only: the world's processes run the other tests' jobs after it.
    import torch._inductor.config as inductor_config

    with inductor_config.patch({"cpp.simdlen": 1}):
        return _run_batches(inner, batches, seq, options)


def _run_batches(inner, batches, seq, options):
    from torch.distributed.device_mesh import init_device_mesh

    import overlapc
    from overlapc.models import llama

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    ref, _ = llama.build_tp_sp(mesh, batch=batches[0], seq=seq, **SMALL)
    model, _ = llama.build_tp_sp(mesh, batch=batches[0], seq=seq, **SMALL)
    be = overlapc.backend(inner=inner, strategy="decompose", **(options or {}))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=be, dynamic=True)
    from torch._dynamo.utils import counters

    counters.clear()
    tol = TOL[inner]
    for step, b in enumerate(batches):
        tokens = llama.example_tokens(model.cfg, b, seq, seed=100 + step)
        outs = []
        for m, params in ((ref, ref), (compiled, model)):
            params.zero_grad(set_to_none=True)
            out = eager_check.step(m, (tokens,), seed=step)
            outs.append({"forward": out, **eager_check.grads(params)})
        eager_check.assert_matches(outs[1], outs[0], tol, where=f"batch {b} ")
    sites = [s for s in be.report.sites if s.pattern != "collective"]
    return {
        "dynamo_graphs": counters["stats"]["unique_graphs"],
        "rewritten": sum(s.status == "rewritten" for s in sites),
        "symbolic": sum(s.status == "rewritten" and isinstance(s.shapes["input"][0], str) for s in sites),
        "sites": len(sites),
        "planned_at": sorted({str(s.details["bucket"]["planned_at"]) for s in sites if "bucket" in s.details}),
        "entries": [{str(k): len(v) for k, v in g.entries.items()} for g in be.bucketed],
        "reasons": sorted({str(s.reason) for s in sites if s.status != "rewritten"}),
    }


def _check_world(res, expect_reuse: int):
    for r in res:
        assert r["rewritten"] == r["sites"] > 0 and r["symbolic"] == r["rewritten"], r
        # Bucketed graphs ran every size, and sizes of one bucket shared an entry.
        entries = sum(sum(e.values()) for e in r["entries"])
        assert r["entries"] and 1 <= entries <= expect_reuse, r


@pytest.mark.distributed
def test_dynamic_batches_eager_world2(world2):
    # seq 12 on 2 ranks: 6*B local rows; 3 chunks (weights 1, 2, 1) leave a remainder for
    # odd B, so the last chunk's symbolic size is exercised. Odd B also makes DTensor's
    # own view guard (B % 2) recompile at dynamo level: a second bucketed graph. Bucket
    # [4, 8): 6 runs on 4's entry. (Several buckets of one graph: test_plan_per_bucket.)
    batches = [4, 6, 5]
    res = world2.run(run_batches, "eager", batches, 12, {"chunks": 3})
    _check_world(res, expect_reuse=3)


@pytest.mark.distributed
@pytest.mark.extended  # 28 s, nearly all compile; world 2 above runs the same paths
def test_dynamic_batches_eager_world4(world4):
    res = world4.run(run_batches, "eager", [8, 12], 16)  # one bucket, [8, 16): one entry serves both
    _check_world(res, expect_reuse=1)


@pytest.mark.distributed
@pytest.mark.slow
def test_dynamic_batches_inductor_world2(world2):
    # 4 and 6 share the bucket [4, 8): one forward and one backward graph serve both.
    res = world2.run(run_batches, "inductor", [4, 6], 16)
    _check_world(res, expect_reuse=1)
