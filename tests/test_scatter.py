"""Reduce-scatters as all-to-all + local sum (passes/scatter.py, option reduce_scatter).

Which reduce-scatters are lowered, on the fake process group (its backend is "fake", so
"auto" keeps them); values against gloo's own reduce-scatter on real worlds. Whole models
with the lowering on (the default on gloo) are checked against eager in
tests/test_models_distributed.py and tests/test_rewrites_distributed.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import overlapc
from overlapc.errors import OverlapError
from overlapc.explain import capture
from overlapc.options import Options
from overlapc.passes import ops
from overlapc.runtime import live


def _mm_rs(x, w):
    return funcol.reduce_scatter_tensor(x @ w, "sum", 0, dist.group.WORLD)


def _avg_rs(x):
    return funcol.reduce_scatter_tensor(x * 2, "avg", 0, dist.group.WORLD)


def _kinds(gm) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in gm.graph.nodes:
        if ops.is_collective(n):
            out[ops.COST_KIND[n.target]] = out.get(ops.COST_KIND[n.target], 0) + 1
    return out


@pytest.mark.parametrize(
    "how,strategy,want",
    [
        ("all_to_all", "decompose", {"all_to_all": 2}),  # each chunk of the rewritten site
        ("all_to_all", "auto", {"all_to_all": 1}),
        ("native", "decompose", {"reduce_scatter": 2}),
        ("auto", "decompose", {"reduce_scatter": 2}),  # the fake group is not gloo
        ("auto", "none", {"reduce_scatter": 1}),  # "none" rewrites nothing unless asked
        ("all_to_all", "none", {"all_to_all": 1}),
    ],
)
def test_which_reduce_scatters_are_lowered(fake_mesh8, how, strategy, want):
    opts = {"strategy": strategy, "chunks": 2, "reduce_scatter": how, "schedule": False}
    report, graphs = capture(_mm_rs, torch.randn(64, 16), torch.randn(16, 8), options=opts)
    ((_, gm),) = graphs
    assert _kinds(gm) == want
    (row,) = report.by(pattern="matmul_reduce_scatter")
    assert ("reduce_scatter_as" in row.details) == ("all_to_all" in want)
    if "all_to_all" in want:
        a2a = next(n for n in gm.graph.nodes if n.target is ops.ALL_TO_ALL)
        rows = ops.val(a2a.args[0]).shape[0]
        assert list(a2a.args[1]) == list(a2a.args[2]) == [rows // 8] * 8
        assert any(u.target is ops.aten.sum.dim_IntList for w in a2a.users for v in w.users for u in v.users)


@pytest.mark.parametrize(
    "opts,lowered",
    [({}, True), ({"strategy": "none"}, False), ({"strategy": "none", "microbatches": 2}, True)],
    ids=["auto", "none", "none+slices"],
)
def test_auto_on_gloo(fake_mesh8, monkeypatch, opts, lowered):
    """ "auto" lowers on gloo groups; under strategy "none" only where slices rewrite the graph."""
    from overlapc.passes import scatter

    _, graphs = capture(_mm_rs, torch.randn(64, 16), torch.randn(16, 8), options={"strategy": "none"})
    ((_, gm),) = graphs
    (rs,) = [n for n in gm.graph.nodes if n.target is ops.REDUCE_SCATTER]
    monkeypatch.setattr(ops, "group_backend", lambda name: "gloo")
    assert scatter.lowerable(rs, Options(**opts)) is lowered


def test_large_reduce_scatters_go_in_pieces(fake_mesh8):
    """A (1024, 128) fp32 input at world 8: 64 KiB per peer, two 32 KiB pieces, each an
    all-to-all of one column range of every block, issued before either is waited on."""
    opts = {"strategy": "none", "reduce_scatter": "all_to_all", "schedule": False}
    _, graphs = capture(_mm_rs, torch.randn(1024, 16), torch.randn(16, 128), options=opts)
    ((_, gm),) = graphs
    seq = list(gm.graph.nodes)
    a2as = [n for n in seq if n.target is ops.ALL_TO_ALL]
    assert len(a2as) == 2 and [list(ops.val(n.args[0]).shape) for n in a2as] == [[8, 8192]] * 2
    assert max(seq.index(n) for n in a2as) < min(seq.index(ops.wait_of(n)) for n in a2as)
    (out,) = [n for n in seq if n.op == "output"][0].args[0]
    assert list(ops.val(out).shape) == [128, 128]


def test_the_live_group_times_the_form_that_runs(fake_mesh8):
    _, graphs = capture(_mm_rs, torch.randn(64, 16), torch.randn(16, 8), options={"strategy": "none"})
    ((_, gm),) = graphs
    kinds = lambda opts: {n.kind for ns in live.needs_of(gm.graph, opts).values() for n in ns}  # noqa: E731
    assert kinds(Options(reduce_scatter="all_to_all")) == {live.RS_A2A}
    assert kinds(Options(reduce_scatter="native")) == {"reduce_scatter"}


def test_bad_reduce_scatter_option_names_the_choices():
    with pytest.raises(OverlapError, match=r"reduce_scatter.*'auto'.*'all_to_all'.*'native'"):
        overlapc.Options.from_user({"reduce_scatter": "ring"})


def scatter_job(dtype_name: str) -> list[float]:
    """Each form's error against gloo's own reduce-scatter of the same inputs, on this rank."""
    dtype = getattr(torch, dtype_name)
    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    # 256 KiB of fp32: sent in pieces (passes/scatter.pieces), 4 at world 2, 2 at world 4
    x, w = torch.randn(1024, 16, generator=g).to(dtype), torch.randn(16, 64, generator=g).to(dtype)
    errs = []
    for fn, args in ((_mm_rs, (x, w)), (_avg_rs, (x,))):
        want = fn(*args)
        torch._dynamo.reset()
        be = overlapc.backend(strategy="decompose", chunks=2, reduce_scatter="auto", inner="eager", adapt=0)
        got = torch.compile(fn, backend=be, fullgraph=True)(*args)
        rows = [r for r in be.report.sites if r.collective_op == "reduce_scatter_tensor"]
        assert rows and all(r.details.get("reduce_scatter_as") == "all_to_all" for r in rows), be.report
        assert got.shape == want.shape and got.dtype == want.dtype
        errs.append((got.float() - want.float()).abs().max().item())
    return errs


@pytest.mark.distributed
@pytest.mark.parametrize("world_name", ["world2", "world4"])
def test_all_to_all_form_equals_gloo_reduce_scatter(world_name, request):
    """fp32: the W partials of an element are summed in another order than gloo's all-reduce
    ring: within 1e-5 of O(10) sums (a few ulp). At world 2 one add either way: equal."""
    world = request.getfixturevalue(world_name)
    for errs in world.run(scatter_job, "float32"):
        assert max(errs) <= (0.0 if world_name == "world2" else 1e-5), errs


def measure_job(cache_dir: str) -> tuple[str, set]:
    """A reduce-scatter site compiled with the live-group measurement on (a real gloo link, no
    double): where its numbers came from, and the kinds this process timed."""
    from pathlib import Path

    from overlapc.passes import cost

    saved = cost.CACHE_DIR
    cost.CACHE_DIR = Path(cache_dir)
    live._MEMO.clear()
    live._CHECKED.clear()
    try:
        torch._dynamo.reset()
        be = overlapc.backend(inner="eager", microbatches=1, measure=True, adapt=0)
        torch.compile(_mm_rs, backend=be)(torch.randn(512, 64), torch.randn(64, 128))  # 256 KiB: 4 pieces
        (site,) = be.report.by(pattern="matmul_reduce_scatter")
        return site.details["predicted"]["numbers"], {k[3] for k in live._MEMO}
    finally:
        cost.CACHE_DIR = saved
        live._MEMO.clear()
        live._CHECKED.clear()


@pytest.mark.distributed
def test_live_group_times_the_pieces_form(world2, tmp_path):
    for numbers, kinds in world2.run(measure_job, str(tmp_path)):
        assert numbers == "measured" and kinds == {live.RS_A2A}, (numbers, kinds)
