"""Axis tracking (passes/axis.py) on real tensors: a chunk taken before a reshape, then
reshaped, equals the chunk taken after it along the mapped axis; None only when the
reshape splits the factor."""

from __future__ import annotations

import math

import pytest
import torch

from overlapc.passes.axis import Axis, through_reshape


def take(t: torch.Tensor, a: Axis, start: int, n: int) -> torch.Tensor:
    s = list(t.shape)
    o = a.outer(s)
    v = t.reshape(s[: a.dim] + [o, a.extent, a.inner] + s[a.dim + 1 :])
    return v.narrow(a.dim + 1, start, n).reshape(a.resized(s, n))


CASES = [
    # (src shape, axis on src, dst shape): MoE dispatch / combine, Ulysses, flattening
    ([256, 64], Axis(0, 32), [2, 4, 32, 64]),  # capacity slots of (E*cap, d) -> (ep, n_local, cap, d)
    ([4, 2, 32, 64], Axis(2, 32), [4, 64, 64]),  # (n_local, ep, cap, d) -> (n_local, ep*cap, d)
    ([4, 64, 64], Axis(1, 32), [4, 2, 32, 64]),
    ([2, 4, 32, 64], Axis(2, 32), [256, 64]),
    ([32, 2, 4, 8], Axis(2, 4), [32, 64]),  # local heads inside the model dim
    ([6, 10], Axis(1, 5, 2), [60]),
    ([6, 10], Axis(0, 3, 1), [2, 3, 10]),
]


@pytest.mark.parametrize("src,a,dst", CASES)
def test_chunk_commutes_with_reshape(src, a, dst):
    t = torch.arange(math.prod(src)).reshape(src)
    b = through_reshape(src, a, dst)
    assert b is not None and b.fits(dst)
    for start, n in ((0, 1), (1, a.extent - 1), (0, a.extent)):
        before = take(t, a, start, n).reshape(b.resized(dst, n))
        torch.testing.assert_close(before, take(t.reshape(dst), b, start, n), rtol=0, atol=0)


def test_split_factor_is_refused():
    # (6, 10) -> (4, 15): the extent-5 factor of dim 1 straddles the new dims
    assert through_reshape([6, 10], Axis(1, 5, 2), [4, 15]) is None
    # (8, 3) -> (2, 12): rows factor 4 (inner 1) of dim 0 is cut by the new dim boundary
    assert through_reshape([8, 3], Axis(0, 4, 2), [2, 12]) is None
    # 6 = 2 x 3 read as 3 x 2: the extent-3 factor straddles both new dims
    assert through_reshape([6, 10], Axis(0, 3, 1), [3, 2, 10]) is None


@pytest.mark.parametrize("op", ["bmm", "grouped"])
def test_grouped_matmul_is_chunked_by_batch_or_rows_only(op):
    """torch._grouped_mm of two 3-D operands is a bmm by another name, but CUDA's kernel needs
    16-byte aligned operands: a slice of its columns (or of K) need not be, so it is chunked
    along the batch and the rows only; bmm along its columns too."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from overlapc.passes.axis import step_of

    mm = torch.bmm if op == "bmm" else torch._grouped_mm
    x, w = torch.randn(4, 32, 16, dtype=torch.bfloat16), torch.randn(4, 16, 24, dtype=torch.bfloat16)
    gm = make_fx(lambda x, w: mm(x, w), tracing_mode="fake")(x, w)
    xn, wn = [n for n in gm.graph.nodes if n.op == "placeholder"]
    (node,) = [n for n in gm.graph.nodes if n.op == "call_function"]
    assert step_of(node, {xn: Axis(0, 4)}) is not None  # batch
    assert step_of(node, {xn: Axis(1, 32)}) is not None  # rows
    assert step_of(node, {wn: Axis(0, 4)}) is not None  # batch, from the weight's side
    assert (step_of(node, {wn: Axis(2, 24)}) is not None) == (op == "bmm")  # columns
    # K on both sides: a sum over the axis, in bf16 run whole on rebuilt operands (allowed)
    assert step_of(node, {xn: Axis(2, 16), wn: Axis(1, 16)}) is not None


TWO_WAY = {
    "view": ((4, 48), lambda x: x.view(4, 8, 6)),
    "permute": ((4, 6, 8), lambda x: x.permute(2, 0, 1)),
    "transpose": ((4, 6), lambda x: x.t()),
    "mm": ((8, 6), (6, 4), lambda x, w: x @ w),
    "bmm": ((2, 8, 6), (2, 6, 4), lambda x, w: torch.bmm(x, w)),
    "broadcast_mul": ((8, 6), (6,), lambda x, s: x * s),
    "norm_scale": ((8, 6), (8, 1), lambda x, r: x * r),
    "cat": ((4, 6), (4, 6), lambda x, y: torch.cat([x, y], 1)),
    "cat_rows": ((4, 6), (4, 6), lambda x, y: torch.cat([x, y], 0)),
    "stack": ((4, 6), (4, 6), lambda x, y: torch.stack([x, y], 1)),
    "expand": ((4, 1, 6), lambda x: x.expand(4, 3, 6)),
    "split": ((8, 6), lambda x: torch.split(x, 3, 1)[1]),
    "cast": ((8, 6), lambda x: x.to(torch.float64)),
}


@pytest.mark.parametrize("name", sorted(TWO_WAY))
def test_each_rule_answers_both_directions_alike(name):
    """Each op's rule, asked upstream which input chunks give its output's chunk along an axis,
    and then downstream what those chunks give, answers that same axis: a region pulled
    through the op and one grown through it agree (the pull keeps only such answers)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from overlapc.passes.axis import inputs_for, static_shape, step_of

    *shapes, fn = TWO_WAY[name]
    gm = make_fx(fn, tracing_mode="fake")(*[torch.randn(s) for s in shapes])
    answered = 0
    for node in gm.graph.nodes:
        shape = static_shape(node) if node.op == "call_function" else None
        for d, size in enumerate(shape or []):
            for a in (Axis(d, size), *([Axis(d, size // 2, 2)] if size % 2 == 0 and size > 2 else [])):
                ins = inputs_for(node, a)
                if ins is None:
                    continue
                st = step_of(node, dict(ins))
                assert st is not None and st.axis == a, (node.format_node(), a, ins)
                answered += 1
    assert answered, f"no rule of {name} answered upstream"
