"""FP8 matmul sites: ``torch._scaled_mm`` as the matmul of AG -> mm and mm -> RS, written
as torchao's float8 linears lower to it (real gloo worlds; torch runs _scaled_mm on CPU).

- Row-parallel output (mm -> RS, or mm -> AR without SP): x and w are cast to float8_e4m3fn with tensorwise scales
  (one per tensor) or rowwise scales (one per row of x, one per output column of w), and
  the bf16 product is reduce-scattered (all-reduced). A chunk's GEMM slices the rowwise scale with its rows.
- Column-parallel input (AG -> mm): torchao's "float8 all-gather" casts the shard before
  the gather, with a tensorwise scale, so the gather moves fp8 bytes and the GEMM reads
  them. Rowwise scales of a gathered operand are computed after the gather (from its rows'
  amax): that site is reported with its reason, and left alone.

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
    """fp8 rows and their rowwise scales gathered apart: the GEMM's chunks would need their
    part of the gathered scales, which the rewrite does not slice yet."""
    xq, sx = to_f8(x, True)
    g = funcol.all_gather_tensor(xq.view(torch.uint8), 0, group).view(F8)
    gs = funcol.all_gather_tensor(sx, 0, group)
    wq, sw = to_f8(w, True)
    return torch._scaled_mm(g, wq.t(), gs, sw.t(), out_dtype=torch.bfloat16)


def col_parallel_rowwise(x, w, group):
    """bf16 all-gather, then rowwise quantisation of the gathered rows: not a site."""
    g = funcol.all_gather_tensor(x, 0, group)
    gq, sg = to_f8(g, True)
    wq, sw = to_f8(w, True)
    return torch._scaled_mm(gq, wq.t(), sg, sw.t(), out_dtype=torch.bfloat16)


PROGRAMS = {
    "rs_tensorwise": lambda x, w, grp: row_parallel(x, w, grp, False),
    "rs_rowwise": lambda x, w, grp: row_parallel(x, w, grp, True),
    "ar_rowwise": lambda x, w, grp: row_parallel(x, w, grp, True, reduce="all"),
    "ag_f8_gather": col_parallel_f8_gather,
    "ag_rowwise_after_gather": col_parallel_rowwise,
    "ag_rowwise_gathered_scales": col_parallel_gathered_scales,
}
# What each program's sites must become under "decompose": (pattern, status, reason fragment).
EXPECTED = {
    "rs_tensorwise": [("matmul_reduce_scatter", "rewritten", "")],
    "rs_rowwise": [("matmul_reduce_scatter", "rewritten", "")],
    "ar_rowwise": [("matmul_all_reduce", "rewritten", "")],
    "ag_f8_gather": [("all_gather_matmul", "rewritten", ""), ("collective", "skipped", "not a matmul")],
    "ag_rowwise_after_gather": [("collective", "skipped", "no matmul consumer")],
    "ag_rowwise_gathered_scales": [
        ("all_gather_matmul", "skipped", "scales the gathered rows rowwise"),
        ("collective", "skipped", "no matmul consumer"),
    ],
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
    reduced = name[:2] in ("rs", "ar")
    tol = dict(rtol=1.6e-2, atol=2**-6 * want.abs().max().item()) if reduced else dict(rtol=0, atol=0)
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
