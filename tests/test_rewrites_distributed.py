"""Every rewrite against eager, on every rank, forward and backward (real gloo worlds).

Programs are written with functional collectives (autograd-aware forms), so each forward
site has its mirror in backward: AG -> mm in forward gives a (summed) mm -> RS in backward
and vice versa. Each case compiles with strategy "decompose" and a fixed chunk count,
checks the backend really rewrote the sites it should, and compares the outputs and the
gradients of every input and weight with eager.

Tolerances (measured maxima are far below them, see test output with -s):
- fp32: a gathered chunk's GEMM runs the same dot products as the full GEMM, but BLAS
  may block and vectorise a smaller M differently (and operand alignment changes); a
  chunked reduce-scatter/all-reduce sums each element across ranks in another order.
  Both give last-bit differences: rtol = atol = 1e-5 (about 100 ulp at 1.0).
- bf16: the same reorderings, but each partial result is rounded to 8 bits of mantissa:
  one ulp is 2^-8 = 0.4% relative, so rtol = 1.6e-2 (torch's bf16 default) and
  atol = 2e-2 (outputs and grads are O(1)-O(10) here).
- bf16, all-reduces coalesced (col_ar, par_ar): AR(a) + AR(b) becomes AR(a + b), so each
  element's sum of k partials on W ranks is rounded at other points. The error is then a few
  ulp of the largest partial sum, not of the (possibly cancelled) result: atol grows to
  2 ulp of the largest reference value, 2^-6 * max|ref|.
- bf16 at world > 2, reduce-scatters: on gloo they run as an all-to-all and a local sum
  (passes/forms.py), which rounds the sum of W partials once, where gloo's all-reduce rounds
  it at each of W - 1 steps. The difference is again a few ulp of the largest partial sum: the
  same atol. (At world 2 both round the one add once: equal.)
"""

from __future__ import annotations

import functools
import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=1.6e-2, atol=2e-2)}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


class AllReduceSum(torch.autograd.Function):
    """Megatron's row-parallel "g": all-reduce forward, identity backward."""

    @staticmethod
    def forward(ctx, x, group):
        return funcol.all_reduce(x, "sum", group)

    @staticmethod
    def backward(ctx, g):
        return g, None


def ag_mm(xs, ws, dim, group):
    g = funcol.all_gather_tensor_autograd(xs[0], gather_dim=dim, group=group)
    return tuple(F.linear(g, w) for w in ws)


def mm_rs(xs, ws, dim, group):
    y = sum(F.linear(x, w) for x, w in zip(xs, ws))  # len(ws) > 1: a summed producer
    return (funcol.reduce_scatter_tensor_autograd(y, "sum", scatter_dim=dim, group=group),)


def mm_ar(xs, ws, dim, group):
    y = sum(F.linear(x, w) for x, w in zip(xs, ws))
    return (AllReduceSum.apply(y, group),)


class CopyToParallel(torch.autograd.Function):
    """Megatron's column-parallel "f": identity forward, all-reduce of the input grad backward."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return funcol.all_reduce(g, "sum", ctx.group), None


def col_ar(xs, ws, dim, group):
    """Column-parallel projections of one input, each with its own "f" (DTensor's and
    transformers' TP plans): x's grad sums one all-reduce per projection, plus x's own term."""
    x = xs[0]
    return tuple(F.linear(CopyToParallel.apply(x, group), w) for w in ws) + (x * 2,)


def par_ar(xs, ws, dim, group):
    """A parallel block (GPT-J, PaLM): row-parallel outputs all-reduced apart, through views,
    then summed with a local term that broadcasts."""
    out = xs[0].sum(-1, keepdim=True)
    for x, w in zip(xs, ws):
        y = AllReduceSum.apply(F.linear(x.flatten(0, -2), w), group)
        out = out + y.view(*x.shape[:-1], -1)
    return (out,)


def ag_wgrad(xs, ws, dim, group):
    """A gathered activation read only by a sum over its rows: the weight gradient for which
    selective checkpointing recomputes a gather (ws[0] is (N, gathered rows))."""
    g = funcol.all_gather_tensor_autograd(xs[0], gather_dim=dim, group=group)
    return (ws[0] @ g.reshape(-1, g.shape[-1]),)


def _rms(h, gamma):
    hf = h.float()  # as the reference Llama's RMSNorm: in fp32, cast back
    return (hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + 1e-5)).type_as(h) * gamma


def rs_norm_ag(xs, ws, dim, group, norm="rms"):
    """A layer boundary under SP: row-parallel mm -> RS -> residual add -> RMSNorm or LayerNorm
    -> AG -> column-parallel mm. The all-gather's chunks are computed from the reduce-scatter's
    chunks (forward, and the mirror in backward: RS -> norm backward -> + residual grad -> AG)."""
    w0, w1, gamma, *beta = ws  # a bias for LayerNorm only
    h = funcol.reduce_scatter_tensor_autograd(F.linear(xs[0], w0), "sum", scatter_dim=dim, group=group) + xs[1]
    n = _rms(h, gamma) if norm == "rms" else F.layer_norm(h, h.shape[-1:], gamma, beta[0])
    g = funcol.all_gather_tensor_autograd(n, gather_dim=dim, group=group)
    return F.linear(g, w1), h


def mlp(xs, ws, dim, group):
    """A SwiGLU MLP under SP: AG -> w1, w3 -> SiLU * mul -> w2 -> RS. Where the gathered rows of
    chunk c are the rows the reduce-scatter's chunk c needs (a batch of one along the sequence,
    or dim 0), w2's chunk c is computed from w1/w3's chunk c: one pipeline through the MLP."""
    w1, w3, w2 = ws
    g = funcol.all_gather_tensor_autograd(xs[0], gather_dim=dim, group=group)
    h = F.silu(F.linear(g, w1)) * F.linear(g, w3)
    return (funcol.reduce_scatter_tensor_autograd(F.linear(h, w2), "sum", scatter_dim=dim, group=group),)


PROGRAMS = {
    "ag_mm": ag_mm,
    "mlp": mlp,
    "mm_rs": mm_rs,
    "mm_ar": mm_ar,
    "col_ar": col_ar,
    "par_ar": par_ar,
    "rs_norm_ag": rs_norm_ag,
    "ag_wgrad": ag_wgrad,
}
# Sites each program must show rewritten, forward and backward (see the module docstring).
EXPECT = {
    "ag_mm": {("forward", "all_gather_matmul"), ("backward", "matmul_reduce_scatter")},
    "mm_rs": {("forward", "matmul_reduce_scatter"), ("backward", "all_gather_matmul")},
    "mm_ar": {("forward", "matmul_all_reduce")},
    # the coalesced all-reduce of a sum of matmuls is a matmul_all_reduce site of its own
    "col_ar": {("backward", "all_reduce_sum"), ("backward", "matmul_all_reduce")},
    "par_ar": {("forward", "all_reduce_sum"), ("forward", "matmul_all_reduce")},
    "ag_wgrad": {("forward", "all_gather_matmul")},
    "mlp": {
        ("forward", "all_gather_matmul"),
        ("forward", "matmul_reduce_scatter"),
        ("backward", "all_gather_matmul"),
        ("backward", "matmul_reduce_scatter"),
    },
    "rs_norm_ag": {
        ("forward", "matmul_reduce_scatter"),
        ("forward", "all_gather_matmul"),
        ("backward", "matmul_reduce_scatter"),
        ("backward", "all_gather_matmul"),
    },
}


def expected(case) -> set:
    """Sites the case must show rewritten: a single all-reduce has nothing to coalesce with."""
    if case["program"] in ("col_ar", "par_ar") and case["n_mm"] < 2:
        return set()
    return EXPECT[case["program"]]


def make_inputs(case, world, rank):
    """Per-rank activations (seed base + rank), weights shared by all ranks."""
    prog, shape, dim, n_mm = case["program"], list(case["shape"]), case["dim"], case["n_mm"]
    dtype = DTYPES[case["dtype"]]
    k, n = shape[-1], case["n"]
    g = torch.Generator().manual_seed(1000 + rank)
    if prog == "rs_norm_ag":
        full = list(shape)
        full[dim] *= world
        gw = torch.Generator().manual_seed(7)
        ws = [torch.randn(k, k, generator=gw) / math.sqrt(k), torch.randn(n, k, generator=gw) / math.sqrt(k)]
        ws.append(1 + 0.1 * torch.randn(k, generator=gw))
        if case.get("norm") == "ln":
            ws.append(0.1 * torch.randn(k, generator=gw))
        xs = [torch.randn(full, generator=g), torch.randn(shape, generator=g)]
        return [x.to(dtype) for x in xs], [w.to(dtype) for w in ws]
    if prog == "mlp":
        gw = torch.Generator().manual_seed(7)
        ws = [torch.randn(n, k, generator=gw) / math.sqrt(k) for _ in range(2)]
        ws.append(torch.randn(k, n, generator=gw) / math.sqrt(n))
        return [torch.randn(shape, generator=g).to(dtype)], [w.to(dtype) for w in ws]
    if prog == "ag_wgrad":
        rows = math.prod(shape[:-1]) * world
        w = torch.randn(n, rows, generator=torch.Generator().manual_seed(7)) / math.sqrt(rows)
        return [torch.randn(shape, generator=g).to(dtype)], [w.to(dtype)]
    if prog in ("ag_mm", "col_ar"):
        xs = [torch.randn(shape, generator=g)]
    else:  # the full activation: mm_rs scatters it along dim, so that dim holds world * shape[dim]
        full = list(shape)
        if prog == "mm_rs":
            full[dim] *= world
        xs = [torch.randn(full, generator=g) for _ in range(n_mm)]
    gw = torch.Generator().manual_seed(7)
    ws = [torch.randn(n, k, generator=gw) / math.sqrt(k) for _ in range(n_mm)]
    return [x.to(dtype) for x in xs], [w.to(dtype) for w in ws]


def run_case(case) -> dict:
    import overlapc

    group = dist.group.WORLD
    world, rank = dist.get_world_size(), dist.get_rank()
    fn = PROGRAMS[case["program"]]
    if case["program"] == "rs_norm_ag":
        fn = functools.partial(fn, norm=case.get("norm", "rms"))
    xs, ws = make_inputs(case, world, rank)
    dtype = DTYPES[case["dtype"]]

    def step(f, xs, ws):
        xs = [x.detach().clone().requires_grad_(True) for x in xs]
        ws = [w.detach().clone().requires_grad_(True) for w in ws]
        outs = f(xs, ws)
        gen = torch.Generator().manual_seed(3 + rank)
        loss = sum((o.float() * torch.randn(o.shape, generator=gen)).sum() for o in outs)
        loss.backward()
        return [o.detach() for o in outs], [t.grad for t in xs + ws]

    ref_out, ref_grads = step(lambda a, b: fn(a, b, case["dim"], group), xs, ws)
    torch._dynamo.reset()
    # row chunks only: micro-batch slices (microbatches="auto") would take these sites in
    be = overlapc.backend(inner=case.get("inner", "eager"), strategy="decompose", chunks=case["chunks"], microbatches=1)
    compiled = torch.compile(lambda a, b: fn(a, b, case["dim"], group), backend=be, fullgraph=True)
    out, grads = step(compiled, xs, ws)

    rewritten = {(s.graph, s.pattern) for s in be.report.sites if s.status == "rewritten"}
    missing = expected(case) - rewritten
    assert not missing, f"{case}: not rewritten: {missing}\n{be.report}"
    if case["program"] == "rs_norm_ag" or case.get("chained"):  # chunks read chunk by chunk
        chained = {s.graph for s in be.report.sites if s.details.get("rows_from") and s.status == "rewritten"}
        assert chained == {"forward", "backward"}, f"{case}: chained in {chained}\n{be.report}"
    if case["program"] == "mlp" and case.get("chained"):  # w2's reduce-scatter reads w1/w3's chunks
        fw = [s for s in be.report.sites if s.graph == "forward" and s.pattern == "matmul_reduce_scatter"]
        assert fw and all(s.details.get("rows_from") for s in fw), f"{case}: MLP not chained\n{be.report}"
    err = 0.0
    for i, (a, b) in enumerate(zip(out + grads, ref_out + ref_grads)):
        what = f"rank {rank} {case} {'output' if i < len(out) else 'grad'} {i}"
        tol = dict(TOL[dtype])
        # bf16 sums reordered: coalesced all-reduces, a sum over gathered rows cut into chunks
        reordered = case["program"] in ("col_ar", "par_ar", "ag_wgrad") or dist.get_world_size(group) > 2
        if dtype == torch.bfloat16 and reordered:
            tol["atol"] = max(tol["atol"], 2**-6 * b.abs().max().item())
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"{what}: {m}")
        err = max(err, (a.float() - b.float()).abs().max().item())
    return {"max_abs_err": err, "chunks": sorted({s.chunks for s in be.report.sites if s.chunks})}


def run_cases(cases: list[dict]) -> list[dict]:
    return [run_case(c) for c in cases]


def matrix(world: int) -> list[dict]:
    """World 2: chunk counts 2, 3 and 2 x world; world 4 (4 ranks on 2 cores: slow): 2 x world."""
    cases = []
    for dtype in DTYPES:
        for chunks in sorted({2 * world} | ({2, 3} if world == 2 else set())):
            # gather/scatter dim 0 of 2-D activations, dim 0 and the inner (sequence) dim of 3-D ones
            for shape, dim in [((8, 16), 0), ((2, 8, 16), 0), ((2, 8, 16), 1)]:
                cases.append(dict(program="ag_mm", shape=shape, dim=dim, n_mm=1, n=24, chunks=chunks, dtype=dtype))
                cases.append(dict(program="mm_rs", shape=shape, dim=dim, n_mm=1, n=24, chunks=chunks, dtype=dtype))
            cases.append(dict(program="mm_ar", shape=(2, 8, 16), dim=0, n_mm=1, n=24, chunks=chunks, dtype=dtype))
        # several consumers of one gather (q/k/v) and summed producers
        cases.append(dict(program="ag_mm", shape=(2, 8, 16), dim=1, n_mm=3, n=24, chunks=world, dtype=dtype))
        cases.append(dict(program="mm_rs", shape=(2, 8, 16), dim=1, n_mm=3, n=24, chunks=world, dtype=dtype))
        cases.append(dict(program="mm_ar", shape=(8, 16), dim=0, n_mm=2, n=24, chunks=world, dtype=dtype))
        # all-reduces coalesced: q/k/v-like input grads (backward), a parallel block (forward)
        cases.append(dict(program="col_ar", shape=(2, 8, 16), dim=0, n_mm=3, n=24, chunks=world, dtype=dtype))
        cases.append(dict(program="par_ar", shape=(2, 8, 16), dim=0, n_mm=2, n=24, chunks=2, dtype=dtype))
        # a layer boundary: RS -> residual add -> norm -> AG, chunk by chunk
        for norm in ("rms", "ln"):
            case = dict(program="rs_norm_ag", shape=(2, 8, 16), dim=1, n_mm=1, n=24, chunks=world, dtype=dtype)
            cases.append({**case, "norm": norm})
        # one pipeline through a SwiGLU MLP: gathered along dim 0, and along the sequence with a
        # batch of one (recorded in another form than the reduce-scatter's: the same rows) and two
        for shape, dim, chained in [((8, 16), 0, True), ((1, 8, 16), 1, True), ((2, 8, 16), 1, True)]:
            case = dict(program="mlp", shape=shape, dim=dim, n_mm=1, n=24, chunks=world, dtype=dtype)
            cases.append({**case, "chained": chained})
        # a sum over the gathered rows (weight gradient), gathered along dim 0 and the sequence
        for shape, dim in [((8, 16), 0), ((2, 8, 16), 1)]:
            cases.append(dict(program="ag_wgrad", shape=shape, dim=dim, n_mm=1, n=24, chunks=world, dtype=dtype))
    # uneven chunks: 7 rows in 3 pieces, 10 rows in 4
    cases.append(dict(program="ag_mm", shape=(7, 16), dim=0, n_mm=1, n=24, chunks=3, dtype="fp32"))
    cases.append(dict(program="mm_rs", shape=(5, 2, 16), dim=0, n_mm=2, n=24, chunks=4, dtype="fp32"))
    return cases


@pytest.mark.distributed
@pytest.mark.parametrize("world_name", ["world2", "world4"])
def test_rewrites_match_eager(world_name, request):
    world = request.getfixturevalue(world_name)
    cases = matrix(world.world_size)
    results = world.run(run_cases, cases)
    worst = max(r["max_abs_err"] for rank in results for r in rank)
    print(f"\n{world_name}: {len(cases)} cases x {world.world_size} ranks, max |err| {worst:.3g}")
    for case, r in zip(cases, results[0]):
        if case["dtype"] == "fp32" and case["program"] == "ag_mm" and case["n_mm"] == 1:
            # all-gather -> GEMM changes no reduction order: measured exact here
            assert r["max_abs_err"] <= 1e-5, (case, r)


@pytest.mark.distributed
@pytest.mark.slow
def test_rewrites_match_eager_inductor(world2):
    cases = [
        dict(
            program=p,
            shape=(2, 8, 16),
            dim=1,
            n_mm=2 if p != "ag_mm" else 3,
            n=24,
            chunks=3,
            dtype="fp32",
            inner="inductor",
        )
        for p in PROGRAMS
    ]
    world2.run(run_cases, cases)


def no_site_job():
    """A program with no sites (and an unsupported one) compiles and runs unchanged."""
    import overlapc

    group = dist.group.WORLD
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(dist.get_rank()))
    w = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))

    def fn(x, w):
        g = funcol.all_gather_tensor(x, gather_dim=0, group=group)  # no matmul consumer
        y = x @ w  # no collective
        return torch.relu(g), funcol.all_reduce(y.relu(), "sum", group)  # AR of a non-matmul

    be = overlapc.backend(inner="eager")
    got = torch.compile(fn, backend=be)(x, w)
    want = fn(x, w)
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert all(s.status != "rewritten" for s in be.report.sites)
    return sorted(s.reason for s in be.report.sites)


@pytest.mark.distributed
def test_no_sites_runs_unchanged(world2):
    reasons = world2.run(no_site_job)[0]
    assert len(reasons) == 2 and any("no matmul consumer" in r for r in reasons), reasons


# ---------------------------------------------------------------- property-based

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402


@st.composite
def random_case(draw):
    program = draw(st.sampled_from(sorted(PROGRAMS)))
    ndim = draw(st.integers(2, 3))
    shape = [draw(st.integers(1, 5)) for _ in range(ndim - 1)] + [draw(st.sampled_from([8, 12, 16]))]
    if math.prod(shape[:-1]) < 2:  # a single row cannot be chunked
        shape[0] = 2
    dim = draw(st.integers(0, ndim - 2))
    return dict(
        program=program,
        shape=tuple(shape),
        dim=dim,
        n_mm=draw(st.integers(1, 3)),
        n=draw(st.sampled_from([8, 20])),
        chunks=draw(st.integers(2, 5)),
        dtype="fp32",
        norm=draw(st.sampled_from(["rms", "ln"])),
    )


@pytest.mark.distributed
@settings(
    max_examples=int(__import__("os").environ.get("OVERLAPC_HYPOTHESIS_EXAMPLES", "15")),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(case=random_case())
def test_rewrites_property(world2, case):
    """Random shapes, dims, consumers and chunk counts on a reused world: zero mismatches."""
    world2.run(run_cases, [case])
