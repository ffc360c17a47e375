"""Reduce-scatters as all-to-all + local sum, all-gathers as all-to-alls (passes/forms.py,
options reduce_scatter and all_gather).

Which collectives are lowered, on the fake process group (its backend is "fake", so "auto"
keeps them); values against gloo's own reduce-scatter and all-gather on real worlds. Whole
models with the lowering on (the default on gloo) are checked against eager in
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


def _ag_mm(x, w):
    return funcol.all_gather_tensor(x, 0, dist.group.WORLD) @ w


def _kinds(gm) -> dict[str, int]:
    out: dict[str, int] = {}
    for n in gm.graph.nodes:
        if ops.is_collective(n):
            out[ops.COST_KIND[n.target]] = out.get(ops.COST_KIND[n.target], 0) + 1
    return out


SMALL = {  # kind: (fn, shapes of its inputs, the site pattern)
    "reduce_scatter": (_mm_rs, [(64, 16), (16, 8)], "matmul_reduce_scatter"),
    "all_gather": (_ag_mm, [(8, 16), (16, 8)], "all_gather_matmul"),
}


@pytest.mark.parametrize(
    "kind,how,strategy,want",
    [
        ("reduce_scatter", "all_to_all", "decompose", {"all_to_all": 2}),  # each chunk of the rewritten site
        ("reduce_scatter", "all_to_all", "auto", {"all_to_all": 1}),
        ("reduce_scatter", "native", "decompose", {"reduce_scatter": 2}),
        ("reduce_scatter", "auto", "decompose", {"reduce_scatter": 2}),  # the fake group is not gloo
        ("reduce_scatter", "auto", "none", {"reduce_scatter": 1}),  # "none" rewrites nothing unless asked
        ("reduce_scatter", "all_to_all", "none", {"all_to_all": 1}),
        ("all_gather", "all_to_all", "decompose", {"all_to_all": 2}),
        ("all_gather", "native", "decompose", {"all_gather": 2}),
        ("all_gather", "auto", "decompose", {"all_gather": 2}),
        ("all_gather", "all_to_all", "none", {"all_to_all": 1}),
    ],
)
def test_which_collectives_are_lowered(fake_mesh8, kind, how, strategy, want):
    fn, shapes, pattern = SMALL[kind]
    opts = {"strategy": strategy, "chunks": 2, kind: how, "schedule": False}
    report, graphs = capture(fn, *(torch.randn(*s) for s in shapes), options=opts)
    ((_, gm),) = graphs
    assert _kinds(gm) == want
    (row,) = report.by(pattern=pattern)
    assert (f"{kind}_as" in row.details) == ("all_to_all" in want)
    for a2a in (n for n in gm.graph.nodes if n.target is ops.ALL_TO_ALL):
        rows = ops.val(a2a.args[0]).shape[0]
        if kind == "reduce_scatter":  # block j of the input to rank j, then the blocks summed
            assert list(a2a.args[1]) == list(a2a.args[2]) == [rows // 8] * 8
            assert any(u.target is ops.aten.sum.dim_IntList for w in a2a.users for v in w.users for u in v.users)
        else:  # W copies of the input, one row each
            assert list(a2a.args[1]) == list(a2a.args[2]) == [1] * 8 and rows == 8


@pytest.mark.parametrize(
    "opts,lowered",
    [({}, True), ({"strategy": "none"}, False), ({"strategy": "none", "microbatches": 2}, True)],
    ids=["auto", "none", "none+slices"],
)
def test_auto_on_gloo(fake_mesh8, monkeypatch, opts, lowered):
    """ "auto" lowers on gloo groups; under strategy "none" only where slices rewrite the graph."""
    from overlapc.passes import forms

    colls = []
    for fn, x, w in (
        (_mm_rs, torch.randn(64, 16), torch.randn(16, 8)),
        (_ag_mm, torch.randn(8, 16), torch.randn(16, 8)),
    ):
        _, graphs = capture(fn, x, w, options={"strategy": "none"})
        ((_, gm),) = graphs
        colls += [n for n in gm.graph.nodes if n.target in (ops.REDUCE_SCATTER, ops.ALL_GATHER)]
    assert len(colls) == 2
    monkeypatch.setattr(ops, "group_backend", lambda name: "gloo")
    assert [forms.lowerable(n, Options(**opts)) for n in colls] == [lowered] * 2
    assert not any(forms.lowerable(n, Options(**opts, reduce_scatter="native", all_gather="native")) for n in colls)


@pytest.mark.parametrize(
    "kind,fn,shapes,result",
    [
        # (1024, 128) input at world 8: 64 KiB per peer; the rank's (128, 128) share comes out
        ("reduce_scatter", _mm_rs, [(1024, 16), (16, 128)], [128, 128]),
        # (64, 256) input: 64 KiB to each peer; the matmul reads the (512, 256) gathered rows
        ("all_gather", _ag_mm, [(64, 256), (256, 8)], [512, 256]),
    ],
)
def test_large_collectives_go_in_pieces(fake_mesh8, kind, fn, shapes, result):
    """Two 32 KiB pieces per peer, each an all-to-all of one column range of every block (an
    all-gather: of the input, copied once per peer), issued before either is waited on, the
    result in the collective's layout."""
    opts = {"strategy": "none", kind: "all_to_all", "schedule": False}
    _, graphs = capture(fn, *(torch.randn(*s) for s in shapes), options=opts)
    ((_, gm),) = graphs
    seq = list(gm.graph.nodes)
    a2as = [n for n in seq if n.target is ops.ALL_TO_ALL]
    assert len(a2as) == 2 and [list(ops.val(n.args[0]).shape) for n in a2as] == [[8, 8192]] * 2
    assert max(seq.index(n) for n in a2as) < min(seq.index(ops.wait_of(n)) for n in a2as)
    if kind == "reduce_scatter":
        (got,) = [n for n in seq if n.op == "output"][0].args[0]
    else:
        (got,) = [n.args[0] for n in seq if n.target is ops.aten.mm.default]
    assert list(ops.val(got).shape) == result


@pytest.mark.parametrize("verdict,a2as", [("whole", 1), ("pieces", 2), ("native", 0)])
def test_auto_sends_the_measured_form(fake_mesh8, monkeypatch, verdict, a2as):
    """Under "auto" on gloo, the form live.choose_forms measured fastest for the group: one
    all-to-all, pieces (64 KiB per peer: two), or gloo's own."""
    from overlapc.passes import forms

    monkeypatch.setattr(ops, "group_backend", lambda name: "gloo")
    monkeypatch.setattr(forms, "VERDICT", {(dist.group.WORLD.group_name, ops.ALL_GATHER): verdict})
    opts = {"strategy": "none", "microbatches": 2, "schedule": False, "measure": False}
    _, graphs = capture(_ag, torch.randn(64, 256), options=opts)
    ((_, gm),) = graphs
    assert sum(n.target is ops.ALL_TO_ALL for n in gm.graph.nodes) == a2as


def test_the_live_group_times_the_form_that_runs(fake_mesh8):
    _, graphs = capture(_mm_rs, torch.randn(64, 16), torch.randn(16, 8), options={"strategy": "none"})
    ((_, gm),) = graphs
    kinds = lambda opts: {n.kind for ns in live.needs_of(gm.graph, opts).values() for n in ns}  # noqa: E731
    assert kinds(Options(reduce_scatter="all_to_all")) == {live.RS_A2A}
    assert kinds(Options(reduce_scatter="native")) == {"reduce_scatter"}
    _, graphs = capture(_ag_mm, torch.randn(8, 16), torch.randn(16, 8), options={"strategy": "none"})
    ((_, gm),) = graphs
    assert kinds(Options(all_gather="all_to_all")) == {live.AG_A2A}
    assert kinds(Options(all_gather="native")) == {"all_gather"}


@pytest.mark.parametrize("name", ["reduce_scatter", "all_gather"])
def test_bad_form_option_names_the_choices(name):
    with pytest.raises(OverlapError, match=rf"{name}.*'auto'.*'all_to_all'.*'native'"):
        overlapc.Options.from_user({name: "ring"})


def _lowered_errors(cases, collective_op: str, detail: str) -> list[float]:
    """Per (fn, args, options): the compiled fn's max error against eager (gloo's own
    collectives), after checking that every ``collective_op`` of it ran as all-to-alls."""
    errs = []
    for fn, args, opts in cases:
        want = fn(*args)
        torch._dynamo.reset()
        be = overlapc.backend(inner="eager", adapt=0, **opts)
        got = torch.compile(fn, backend=be, fullgraph=True)(*args)
        rows = [r for r in be.report.sites if r.collective_op == collective_op]
        assert rows and all(r.details.get(detail) == "all_to_all pieces" for r in rows), be.report
        assert got.shape == want.shape and got.dtype == want.dtype
        errs.append((got.float() - want.float()).abs().max().item())
    return errs


def scatter_job(dtype_name: str) -> list[float]:
    """Each form's error against gloo's own reduce-scatter of the same inputs, on this rank."""
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(dist.get_rank())
    # 256 KiB of fp32: sent in pieces (passes/forms.piece_count), 4 at world 2, 2 at world 4
    x, w = torch.randn(1024, 16, generator=g).to(dtype), torch.randn(16, 64, generator=g).to(dtype)
    opts = {"strategy": "decompose", "chunks": 2, "reduce_scatter": "all_to_all"}
    return _lowered_errors(
        [(_mm_rs, (x, w), opts), (_avg_rs, (x,), opts)], "reduce_scatter_tensor", "reduce_scatter_as"
    )


@pytest.mark.distributed
@pytest.mark.parametrize("world_name", ["world2", "world4"])
def test_all_to_all_form_equals_gloo_reduce_scatter(world_name, request):
    """fp32: the W partials of an element are summed in another order than gloo's all-reduce
    ring: within 1e-5 of O(10) sums (a few ulp). At world 2 one add either way: equal."""
    world = request.getfixturevalue(world_name)
    for errs in world.run(scatter_job, "float32"):
        assert max(errs) <= (0.0 if world_name == "world2" else 1e-5), errs


def _ag(x):
    return funcol.all_gather_tensor(x * 2, 0, dist.group.WORLD)


def gather_job(dtype_name: str) -> tuple[float, float]:
    """The all-to-all form against gloo's own all-gather of the same inputs, on this rank: a
    bare all-gather of 256 KiB of fp32 (pieces: 16 at world 2, 8 at world 4) and an
    all-gather -> matmul site cut in 2 chunks, both lowered."""
    dtype = getattr(torch, dtype_name)
    g = torch.Generator().manual_seed(dist.get_rank())
    x, w = torch.randn(256, 256, generator=g).to(dtype), torch.randn(256, 32, generator=g).to(dtype)
    cases = [
        (_ag, (x,), {"strategy": "none", "all_gather": "all_to_all"}),
        (_ag_mm, (x, w), {"strategy": "decompose", "chunks": 2, "all_gather": "all_to_all"}),
    ]
    return _lowered_errors(cases, "all_gather_into_tensor", "all_gather_as")


@pytest.mark.distributed
@pytest.mark.parametrize("world_name", ["world2", "world4"])
def test_all_to_all_form_equals_gloo_all_gather(world_name, request):
    """Moving bytes changes no value: the bare all-gather is exact. The site's two chunk
    matmuls of 256 of the rows each may block the sum over k=256 otherwise than one matmul of all
    rows: fp32 within 1e-4 of |values| ~ 16 (a few ulp)."""
    world = request.getfixturevalue(world_name)
    for exact, site in world.run(gather_job, "float32"):
        assert exact == 0.0 and site <= 1e-4, (exact, site)


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
        be = overlapc.backend(inner="eager", microbatches=1, measure=True, adapt=0, reduce_scatter="all_to_all")
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
