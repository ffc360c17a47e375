"""Expert loops regrouped (passes/expert_loop.py) and the op they become (overlapc::grouped_mm).

Single process: the pass runs on Dynamo's graph before AOTAutograd and needs no
collective; the distributed dropless cases (tests/test_all_to_all_distributed.py) check
the loop form end to end, pipelined, on every rank.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from overlapc.runtime.grouped import grouped_mm

SIZES = [3, 0, 9, 4]  # an empty group, a large one


def _operands(dtype=torch.float64, sizes=SIZES, k=5, n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    rows = sum(sizes)
    return (
        torch.randn(rows, k, generator=g, dtype=dtype),
        torch.randn(len(sizes), k, n, generator=g, dtype=dtype),
        torch.tensor(sizes),
    )


@pytest.mark.parametrize("index", [None, [1, 0, 1, 0]])
def test_grouped_mm_is_the_loop_forward_and_backward(index):
    """Without index: one weight per group. With it: a bank of 2 experts, each read by two
    groups (as a loop over (source rank, local expert) groups reads it)."""
    x, w, counts = _operands()
    if index is not None:
        w = w[:2]
    pick = index or list(range(len(SIZES)))
    offs = torch.cumsum(counts, 0)
    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    y1 = grouped_mm(x1, w1, offs, index)
    y2 = torch.cat([rows @ w2[pick[g]] for g, rows in enumerate(x2.split(SIZES))])
    assert torch.equal(y1, y2)  # the same mm per group, on the same rows
    grad = torch.randn_like(y1)
    y1.backward(grad)
    y2.backward(grad)
    torch.testing.assert_close(x1.grad, x2.grad, rtol=0, atol=1e-12)
    torch.testing.assert_close(w1.grad, w2.grad, rtol=0, atol=1e-12)
    if index is None:
        assert torch.equal(w1.grad[1], torch.zeros_like(w1.grad[1]))  # the empty group's weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_mm_under_autocast_casts_as_the_loops_mm(dtype):
    """fp32 rows and expert bank under autocast: the rows cast once, each W[e_g] as it is
    used, the bank's gradient added in fp32 per group (as autograd adds the casts' gradients):
    bit for bit the loop's result and gradients."""
    x, w, counts = _operands(torch.float32)
    index = [1, 0, 1, 0]
    offs = torch.cumsum(counts, 0)
    got = []
    for loop in (False, True):
        xg, wg = x.clone().requires_grad_(), w[:2].clone().requires_grad_()
        with torch.autocast("cpu", dtype=dtype):
            y = (
                torch.cat([r @ wg[index[g]] for g, r in enumerate(xg.split(SIZES))])
                if loop
                else grouped_mm(xg, wg, offs, index)
            )
        y.float().mul(torch.linspace(-1, 1, y.numel()).reshape(y.shape)).sum().backward()
        got.append((y, xg.grad, wg.grad))
    for a, b in zip(*got):
        assert a.dtype == b.dtype and torch.equal(a, b)
    assert got[0][0].dtype == dtype


def test_grouped_mm_weight_gradient_form_and_bad_offsets():
    x, w, counts = _operands()
    b = torch.randn(x.shape[0], 6, dtype=x.dtype)
    offs = torch.cumsum(counts, 0).to(torch.int32)
    out = grouped_mm(x.t(), b, offs)
    want = torch.stack([a.t() @ c for a, c in zip(x.split(SIZES), b.split(SIZES))])
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    with torch._subclasses.fake_tensor.FakeTensorMode():
        with pytest.raises(ValueError, match="offs must be a 1-D int32/int64 tensor"):
            grouped_mm(torch.empty(4, 5), torch.empty(2, 5, 6), torch.empty(2))
        with pytest.raises(ValueError, match=r"takes \(R, K\) x \(G, K, N\) or \(K, R\) x \(R, N\)"):
            grouped_mm(torch.empty(4, 5, 1), torch.empty(2, 5, 6), torch.empty(2, dtype=torch.int64))
        with pytest.raises(ValueError, match=r"index \[0, 2\] must give each of the 2 groups a weight in 0..1"):
            grouped_mm(torch.empty(4, 5), torch.empty(2, 5, 6), torch.empty(2, dtype=torch.int64), [0, 2])


# ------------------------------------------------------------------------- the pass


def _swiglu_loop(x, counts, w1, w3, w2):
    outs = []
    for g, rows in enumerate(x.split(counts.tolist())):
        h = F.silu(rows @ w1[g]) * (rows @ w3[g])
        outs.append(h @ w2[g])
    return torch.cat(outs)


def _linear_loop(x, counts, w1, w3, w2):
    """nn.Linear-style weights (out, in), a scalar shared by every group."""
    outs = []
    for g, rows in enumerate(torch.split(x, counts.tolist())):
        outs.append(F.linear(F.gelu(F.linear(rows, w1[g].t())) * 0.5, w2[g].t()))
    return torch.cat(outs)


def _chained_loops(x, counts, w1, w3, w2):
    """Two loops, the second over the first's result; a vector shared by every group."""
    b = w3[0, 0]
    h = torch.cat([F.silu(rows @ w1[g]) + b for g, rows in enumerate(x.split(counts.tolist()))])
    return torch.cat([rows @ w2[g] for g, rows in enumerate(h.split(counts.tolist()))])


def _autocast_loop(x, counts, w1, w3, w2):
    with torch.autocast("cpu", dtype=torch.bfloat16):
        return _swiglu_loop(x, counts, w1, w3, w2)


def _autocast_cat_outside(x, counts, w1, w3, w2):
    """The groups computed under autocast, joined after it: the grouped matmuls would have to
    run before the cat, outside the region."""
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outs = [rows @ w1[g] for g, rows in enumerate(x.split(counts.tolist()))]
    return torch.cat(outs)


def _static_loop(x, counts, w1, w3, w2):
    return torch.cat([rows @ w1[g] for g, rows in enumerate(x.split(SIZES))])


def _mixed_loop(x, counts, w1, w3, w2):
    outs = []
    for g, rows in enumerate(x.split(counts.tolist())):
        act = F.gelu if g == 0 else F.silu
        outs.append(act(rows @ w1[g]))
    return torch.cat(outs)


def _leaky_loop(x, counts, w1, w3, w2):
    hs, outs = [], []
    for g, rows in enumerate(x.split(counts.tolist())):
        hs.append(rows @ w1[g])
        outs.append(F.silu(hs[-1]) @ w2[g])
    return torch.cat(outs) + hs[0].sum()


def _compile_and_compare(fn, dtype=torch.float32, tol=1e-5):
    import overlapc
    from overlapc import Backend, Options

    g = torch.Generator().manual_seed(1)
    x = torch.randn(sum(SIZES), 8, generator=g).to(dtype)
    w1, w3 = (torch.randn(len(SIZES), 8, 12, generator=g).to(dtype) for _ in range(2))
    w2 = torch.randn(len(SIZES), 12, 8, generator=g).to(dtype)
    counts = torch.tensor(SIZES)
    be = Backend(Options(strategy="decompose", inner="eager"), keep_graphs=True, verify_plans=False)
    results = []
    torch._dynamo.reset()
    for f in (fn, torch.compile(fn, backend=be, fullgraph=True)):
        args = [t.clone().requires_grad_() for t in (x, w1, w3, w2)]
        with torch._dynamo.config.patch(capture_scalar_outputs=True):
            y = f(args[0], counts, *args[1:])
        y.backward(torch.ones_like(y))
        results.append((y.detach(), [a.grad for a in args]))
    (y0, g0), (y1, g1) = results
    assert y1.dtype == y0.dtype
    torch.testing.assert_close(y1, y0, rtol=tol, atol=tol)
    for a, b in zip(g1, g0):
        assert (a is None) == (b is None) and (a is None or a.dtype == b.dtype)
        if a is not None:
            torch.testing.assert_close(a, b, rtol=tol, atol=tol)
    assert overlapc is not None
    return be


def _count(be, kind, target):
    return sum(
        n.op == "call_function" and n.target is target for k, gm in be.graphs if k == kind for n in gm.graph.nodes
    )


@pytest.mark.parametrize("fn", [_swiglu_loop, _linear_loop])
def test_a_loop_over_run_time_groups_becomes_grouped_matmuls(fn):
    be = _compile_and_compare(fn)
    [site] = be.report.by(pattern="expert_loop")
    assert site.status == "rewritten" and site.details["groups"] == len(SIZES), site
    gmm, mm = torch.ops.overlapc.grouped_mm.default, torch.ops.aten.mm.default
    n = 3 if fn is _swiglu_loop else 2
    assert _count(be, "forward", gmm) == n and _count(be, "forward", mm) == 0
    # w1[g] of one bank is read in place (index), no stacked copy; w1[g].t() is stacked
    stacks = _count(be, "forward", torch.ops.aten.stack.default) + _count(be, "forward", torch.ops.aten.cat.default)
    assert stacks == (0 if fn is _swiglu_loop else 2), stacks
    # the backward AOTAutograd derived: data and weight gradients, grouped, no per-group mm
    assert _count(be, "backward", gmm) == 2 * n and _count(be, "backward", mm) == 0


def test_chained_loops_are_both_regrouped():
    be = _compile_and_compare(_chained_loops)
    sites = be.report.by(pattern="expert_loop")
    assert [s.status for s in sites] == ["rewritten", "rewritten"], sites
    assert _count(be, "forward", torch.ops.overlapc.grouped_mm.default) == 2


def test_a_loop_under_autocast_is_regrouped_with_mms_casts():
    """overlapc::grouped_mm's autocast rule casts as the loop's mm did (the rows to bf16, each
    W[e_g] as it is used; weight gradients added in fp32): bit for bit eager's result and
    gradients, in bf16 and fp32."""
    be = _compile_and_compare(_autocast_loop, tol=0)
    [site] = be.report.by(pattern="expert_loop")
    assert site.status == "rewritten", site
    gmm = torch.ops.overlapc.grouped_mm.default
    assert _count(be, "forward", gmm) == 3 and _count(be, "forward", torch.ops.aten.mm.default) == 0
    assert _count(be, "backward", gmm) == 6


@pytest.mark.parametrize(
    "fn, why",
    [
        (_static_loop, "a loop over sizes known at compile time is not grouped"),
        (_autocast_cat_outside, "not in one autocast region"),
        (_mixed_loop, "the groups' graphs differ at"),
        (_leaky_loop, "is also read by"),
    ],
)
def test_other_loops_are_left_alone_with_the_reason(fn, why):
    be = _compile_and_compare(fn)
    sites = be.report.by(pattern="expert_loop")
    assert len(sites) == 1 and sites[0].status == "skipped" and why in sites[0].reason, sites
    assert _count(be, "forward", torch.ops.overlapc.grouped_mm.default) == 0
