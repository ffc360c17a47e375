"""FP8 matmul sites: ``torch._scaled_mm`` as the matmul of AG -> mm and mm -> RS, written
as torchao's float8 linears lower to it (real gloo worlds; torch runs _scaled_mm on CPU).

- Row-parallel output (mm -> RS, or mm -> AR without SP): x and w are cast to float8_e4m3fn with tensorwise scales
  (one per tensor) or rowwise scales (one per row of x, one per output column of w), and
  the bf16 product is reduce-scattered (all-reduced). A chunk's GEMM slices the rowwise scale with its rows.
- Column-parallel input (AG -> mm): torchao's "float8 all-gather" casts the shard before
  the gather, with a tensorwise scale, so the gather moves fp8 bytes and the GEMM reads
  them. Rowwise scales of gathered rows are gathered beside them; each chunk's GEMM takes
  its rows' scales. A bf16 gather quantised rowwise after it is quantised before it instead.
- Training (``Float8Linear``, torchao's float8 linear with tensorwise scales): the forward
  gathers bf16 rows and the backward the bf16 output gradient, each quantised after the
  gather. passes/fp8_gather.py moves the quantisation before the gather (the scale's amax
  all-reduced), which makes both all-gather -> _scaled_mm sites.

Tolerances: the AG consumer's chunk GEMMs compute the same dot products of the same fp8
rows (each output element's K-sum is one dot product either way), so they equal eager bit for
bit, and are asserted so. The RS/AR side's chunks reduce bf16 partials across ranks, and gloo
may sum an element's W partials in another order for another message size (its all-reduce
does at world 4), so each element may be rounded differently: a few ulp of the largest
partial sum, bounded by bf16's rtol 1.6e-2 and atol 2 ulp of the largest reference value
(2^-6 * max|ref|), as in tests/test_rewrites_distributed.py. A chunk given another chunk's
scales would be off by the ratio of two rows' scales (tens of percent), far outside it.
"""

from __future__ import annotations

import eager_check
import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

F8 = torch.float8_e4m3fn
F8_MAX = torch.finfo(F8).max


def to_f8(x, rowwise: bool):
    """(fp8 tensor, fp32 scale) as torchao computes them: scale = amax / fp8 max, per row
    (shape (M, 1)) or per tensor (shape ())."""
    amax = x.abs().amax(dim=-1, keepdim=True) if rowwise else x.abs().amax()
    scale = (amax.float().clamp(min=1e-12) / F8_MAX).to(torch.float32)
    return (x.float() / scale).clamp(-F8_MAX, F8_MAX).to(F8), scale


def row_parallel(x, w, group, rowwise, reduce="scatter"):
    """(B*S, K/W) @ (K/W, N) in fp8, bf16 partial sums reduce-scattered over rows (SP) or
    all-reduced (TP without SP)."""
    xq, sx = to_f8(x, rowwise)
    wq, sw = to_f8(w, rowwise)  # w is (N, K/W): per output column when rowwise
    y = torch._scaled_mm(xq, wq.t(), sx, sw.t() if rowwise else sw, out_dtype=torch.bfloat16)
    if reduce == "all":
        return funcol.all_reduce(y, "sum", group)
    return funcol.reduce_scatter_tensor(y, "sum", 0, group)


def col_parallel_f8_gather(x, w, group):
    """Tensorwise fp8 all-gather: one scale agreed across ranks (max of the amaxes), the
    shard cast before the gather, the GEMM on the gathered fp8 rows."""
    amax = funcol.all_reduce(x.abs().amax().float(), "max", group)
    sx = amax.clamp(min=1e-12) / F8_MAX
    xq = (x.float() / sx).clamp(-F8_MAX, F8_MAX).to(F8)
    # gloo has no fp8 dtype: the bytes travel as uint8, a bitcast either side (as torchao
    # does for its float8 all-gather on backends without fp8).
    g = funcol.all_gather_tensor(xq.view(torch.uint8), 0, group).view(F8)
    wq, sw = to_f8(w, False)
    return torch._scaled_mm(g, wq.t(), sx, sw, out_dtype=torch.bfloat16)


def col_parallel_gathered_scales(x, w, group):
    """fp8 rows and their rowwise scales gathered apart: each of the GEMM's chunks takes its
    rows of the gathered scales."""
    xq, sx = to_f8(x, True)
    g = funcol.all_gather_tensor(xq.view(torch.uint8), 0, group).view(F8)
    gs = funcol.all_gather_tensor(sx, 0, group)
    wq, sw = to_f8(w, True)
    return torch._scaled_mm(g, wq.t(), gs, sw.t(), out_dtype=torch.bfloat16)


def col_parallel_rowwise(x, w, group):
    """bf16 all-gather, then rowwise quantisation of the gathered rows (torchao's rowwise
    recipe): quantised before the gather instead, the scales gathered beside the rows."""
    g = funcol.all_gather_tensor(x, 0, group)
    gq, sg = to_f8(g, True)
    wq, sw = to_f8(w, True)
    return torch._scaled_mm(gq, wq.t(), sg, sw.t(), out_dtype=torch.bfloat16)


E5 = torch.float8_e5m2


def quantize(x, dtype):
    """(fp8 tensor, fp32 scale) with one scale for the tensor, in the fp8 type ``dtype``."""
    fmax = torch.finfo(dtype).max
    scale = x.abs().amax().float().clamp(min=1e-12) / fmax
    return (x.float() / scale).clamp(-fmax, fmax).to(dtype), scale


class Float8Linear(torch.autograd.Function):
    """A float8 training linear as torchao lowers it (tensorwise scales): e4m3 input and
    weight forward; the output gradient cast to e5m2 for the input and weight gradients."""

    @staticmethod
    def forward(ctx, x, w):
        xq, sx = quantize(x, F8)
        wq, sw = quantize(w, F8)
        ctx.save_for_backward(xq, sx, wq, sw)
        return torch._scaled_mm(xq, wq.t(), sx, sw, out_dtype=torch.bfloat16)

    @staticmethod
    def backward(ctx, grad):
        xq, sx, wq, sw = ctx.saved_tensors
        gq, sg = quantize(grad, E5)
        # _scaled_mm takes its right operand column-major
        gx = torch._scaled_mm(gq, wq.t().contiguous().t(), sg, sw, out_dtype=torch.bfloat16)
        gw = torch._scaled_mm(gq.t().contiguous(), xq.t().contiguous().t(), sg, sx, out_dtype=torch.bfloat16)
        return gx, gw


def fp8_mlp(x, w1, w2, group):
    """TP+SP MLP of float8 linears: the bf16 rows gathered then quantised (forward), the
    output gradient gathered then quantised (backward), the bf16 partials reduce-scattered
    (forward) and the input gradient's (backward)."""
    xg = funcol.all_gather_tensor_autograd(x, 0, group)
    h = Float8Linear.apply(xg, w1)
    z = Float8Linear.apply(torch.nn.functional.silu(h), w2)
    return funcol.reduce_scatter_tensor_autograd(z, "sum", 0, group)


def col_parallel_gather_read_twice(x, w, group):
    """bf16 rows gathered, quantised for one GEMM and read as they are by another: the
    gather must stay bf16."""
    g = funcol.all_gather_tensor(x, 0, group)
    gq, sg = quantize(g, F8)
    wq, sw = quantize(w, F8)
    return torch._scaled_mm(gq, wq.t(), sg, sw, out_dtype=torch.bfloat16) + g @ w.t()


def fp8_mlp_seq(x, w1, w2, group):
    """``fp8_mlp`` on (batch, sequence, dim) activations sharded along the sequence (SP's
    layout): the gathers run along dim 1, and the float8 linears flatten the rows first."""
    xg = funcol.all_gather_tensor_autograd(x, 1, group)
    h = Float8Linear.apply(xg.reshape(-1, xg.shape[-1]), w1)
    z = Float8Linear.apply(torch.nn.functional.silu(h), w2).view(*xg.shape[:-1], -1)
    return funcol.reduce_scatter_tensor_autograd(z, "sum", 1, group)


PROGRAMS = {
    "rs_tensorwise": lambda x, w, grp: row_parallel(x, w, grp, False),
    "rs_rowwise": lambda x, w, grp: row_parallel(x, w, grp, True),
    "ar_rowwise": lambda x, w, grp: row_parallel(x, w, grp, True, reduce="all"),
    "ag_f8_gather": col_parallel_f8_gather,
    "ag_rowwise_after_gather": col_parallel_rowwise,
    "ag_rowwise_gathered_scales": col_parallel_gathered_scales,
    "ag_read_twice": col_parallel_gather_read_twice,
}
# What each program's sites must become under "decompose": (pattern, status, reason fragment).
EXPECTED = {
    "rs_tensorwise": [("matmul_reduce_scatter", "rewritten", "")],
    "rs_rowwise": [("matmul_reduce_scatter", "rewritten", "")],
    "ar_rowwise": [("matmul_all_reduce", "rewritten", "")],
    "ag_f8_gather": [("all_gather_matmul", "rewritten", ""), ("collective", "skipped", "not a matmul")],
    "ag_rowwise_after_gather": [
        ("fp8_gather", "rewritten", ""),
        ("all_gather_matmul", "rewritten", ""),
        ("collective", "skipped", "no matmul consumer"),
    ],
    "ag_rowwise_gathered_scales": [
        ("all_gather_matmul", "rewritten", ""),
        ("collective", "skipped", "no matmul consumer"),
    ],
    "ag_read_twice": [("fp8_gather", "skipped", "also read by"), ("all_gather_matmul", "rewritten", "")],
}


def check_fp8(name: str, inner: str, chunks: int):
    """Job: compile one program with strategy "decompose"; compare with eager (see the
    module's tolerances)."""
    import overlapc

    group = dist.group.WORLD.group_name
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(16 * world if name[:2] in ("rs", "ar") else 16, 64, generator=g).to(torch.bfloat16)
    w = torch.randn(32, 64, generator=g).to(torch.bfloat16)
    fn = PROGRAMS[name]
    want = fn(x, w, group)
    overlapc.reset_report()
    got = torch.compile(fn, backend="overlapc", options={"strategy": "decompose", "chunks": chunks, "inner": inner})(
        x, w, group
    )
    # ag_read_twice adds a bf16 product, which inductor fuses into an addmm that rounds once
    # where eager rounds twice: bf16's bound, like the reduced programs'.
    rounded = name[:2] in ("rs", "ar") or name == "ag_read_twice"
    tol = dict(rtol=1.6e-2, atol=2**-6 * want.abs().max().item()) if rounded else dict(rtol=0, atol=0)
    torch.testing.assert_close(got, want, **tol, msg=lambda m: f"rank {rank} {name}: {m}")
    return [(s.pattern, s.status, s.reason) for s in overlapc.last_report().sites]


def check_all(inner: str):
    """Job: every program, chunks 2 and 3 (3 does not divide the rows evenly). Under inductor,
    only the rewritten programs at 3 chunks: its layout of the sliced scales is what differs."""
    out = {}
    rewritten = [n for n in PROGRAMS if any(st == "rewritten" for _, st, _ in EXPECTED[n])]
    for name in PROGRAMS if inner == "eager" else rewritten:
        for chunks in (2, 3) if inner == "eager" else (3,):
            out[name, chunks] = check_fp8(name, inner, chunks)
    return out


def _matches(rows, want):
    rows = sorted(rows, key=lambda r: (r[0], r[1]))
    want = sorted(want, key=lambda r: (r[0], r[1]))
    return len(rows) == len(want) and all(
        r[0] == p and r[1] == st and frag in (r[2] or "") for r, (p, st, frag) in zip(rows, want)
    )


@pytest.mark.distributed
@pytest.mark.parametrize("inner", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_fp8_sites_match_eager(world2, inner):
    for rank_result in world2.run(check_all, inner):
        for (name, chunks), rows in rank_result.items():
            assert _matches(rows, EXPECTED[name]), (name, chunks, rows)


@pytest.mark.distributed
@pytest.mark.extended
def test_fp8_sites_world4(world4):
    for rank_result in world4.run(check_all, "eager"):
        for (name, chunks), rows in rank_result.items():
            assert _matches(rows, EXPECTED[name]), (name, chunks, rows)


# Per graph, forward and backward alike: the gather quantised after becomes a float8 gather
# of the shard (its scale's max all-reduced), an all-gather -> matmul site; mm -> RS as before.
TRAIN_EXPECTED = [
    ("fp8_gather", "rewritten", ""),
    ("collective", "skipped", "a max all-reduce"),
    ("all_gather_matmul", "rewritten", ""),
    ("matmul_reduce_scatter", "rewritten", ""),
]


def check_fp8_training(inner: str, chunks: int, seq: bool = False):
    """Job: one training step of ``fp8_mlp`` compiled with strategy "decompose", against the
    same step uncompiled (inner eager) or compiled by inductor alone (inner inductor: its
    float8 casts round a few elements differently from eager's, the same with or without
    overlapc). Returns the report rows and each value's largest difference."""
    import overlapc

    group = dist.group.WORLD.group_name
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(100 + rank)
    params = [
        torch.randn(*((2, 8) if seq else (16,)), 64, generator=g),  # this rank's rows
        torch.randn(32, 64, generator=torch.Generator().manual_seed(7)),  # w1, column-parallel
        torch.randn(64, 32, generator=torch.Generator().manual_seed(9)),  # w2, row-parallel
    ]
    params = [p.to(torch.bfloat16).requires_grad_() for p in params]
    weight = torch.randn(params[0].shape, generator=torch.Generator().manual_seed(3))  # the output's rows
    program = fp8_mlp_seq if seq else fp8_mlp

    def step(fn):
        for p in params:
            p.grad = None
        out = fn(*params, group)
        (out.float() * weight).sum().backward()
        return {"out": out.detach(), **{f"grad{i}": p.grad.clone() for i, p in enumerate(params)}}

    want = step(program if inner == "eager" else torch.compile(program, backend="inductor"))
    overlapc.reset_report()
    opts = {"strategy": "decompose", "chunks": chunks, "inner": inner}
    got = step(torch.compile(program, backend="overlapc", options=opts))

    def tol(ref):
        # world 2: a reduce-scatter sums two partials, the same in either order: bit for bit.
        # Beyond, chunks may sum in another order: bf16's bound (the module's tolerances).
        return dict(rtol=0, atol=0) if world == 2 else dict(rtol=1.6e-2, atol=2**-6 * ref.abs().max().item())

    eager_check.assert_matches(got, want, tol, where=f"chunks {chunks} ")
    return [(s.graph, s.pattern, s.status, s.reason) for s in overlapc.last_report().sites]


def check_training_all(inner: str):
    out = {c: check_fp8_training(inner, c) for c in ((2, 3) if inner == "eager" else (3,))}
    out["seq"] = check_fp8_training(inner, 2, seq=True)  # gathered along the sequence
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("inner", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_fp8_training_gathers_float8(world2, inner):
    """A float8 training step (forward and backward): every gather quantised after becomes a
    float8 gather feeding its GEMMs, chunked with them, and the step equals the uncompiled one
    bit for bit."""
    for rank_result in world2.run(check_training_all, inner):
        for chunks, rows in rank_result.items():
            for graph in ("forward", "backward"):
                got = [r[1:] for r in rows if r[0] == graph]
                assert _matches(got, TRAIN_EXPECTED), (chunks, graph, rows)


@pytest.mark.distributed
@pytest.mark.extended
def test_fp8_training_world4(world4):
    for rank_result in world4.run(check_training_all, "eager"):
        for chunks, rows in rank_result.items():
            for graph in ("forward", "backward"):
                assert _matches([r[1:] for r in rows if r[0] == graph], TRAIN_EXPECTED), (chunks, graph, rows)
