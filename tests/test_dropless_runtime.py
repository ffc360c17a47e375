"""The run-time chunking of the dropless pipeline (overlapc/runtime/dropless.py), single process."""

from __future__ import annotations

import random

import torch

from overlapc.runtime.dropless import _chunk_offsets, _place, _starts, _take, boundaries, chunk_weights


def _rows(starts, bounds, c) -> torch.Tensor:
    """Indices (in the full received buffer) of the rows of chunk ``c``, in chunk order."""
    return torch.cat([torch.arange(s + b[c], s + b[c + 1]) for s, b in zip(starts, bounds)])


def test_boundaries_cover_every_row_once():
    for n in (0, 1, 2, 5, 17, 100):
        for chunks in (1, 2, 3, 4, 8):
            b = boundaries(n, chunk_weights(chunks))
            assert b[0] == 0 and b[-1] == n and all(x <= y for x, y in zip(b, b[1:])), (n, chunks, b)
    assert boundaries(12, chunk_weights(4)) == [0, 2, 6, 10, 12]  # weights 1, 2, 2, 1


def test_chunk_offsets_count_each_group_in_each_chunk():
    """Brute force: label every received row with its group, take chunk c's rows, count."""
    rng = random.Random(0)
    for _ in range(200):
        world, n_local, chunks = rng.randint(1, 4), rng.randint(1, 3), rng.randint(1, 6)
        counts = [rng.choice([0, 0, 1, 2, 7]) for _ in range(world * n_local)]  # groups (src, expert)
        splits = [sum(counts[r * n_local : (r + 1) * n_local]) for r in range(world)]
        ends = torch.cumsum(torch.tensor(counts), 0)
        label = torch.repeat_interleave(torch.arange(len(counts)), torch.tensor(counts))
        starts, bounds = _starts(splits), [boundaries(n, chunk_weights(chunks)) for n in splits]
        seen = []
        for c in range(chunks):
            idx = _rows(starts, bounds, c)
            seen.append(idx)
            assert torch.equal(_take(label, starts, bounds, c), label[idx])
            want = torch.cumsum(torch.bincount(label[idx], minlength=len(counts)), 0)
            assert torch.equal(_chunk_offsets(ends, starts, bounds, c), want), (counts, c)
            assert torch.equal(label[idx], label[idx].sort().values)  # groups stay in order
        assert torch.equal(torch.cat(seen).sort().values, torch.arange(sum(splits)))
        # _place puts chunk rows back where they came from
        data = torch.arange(sum(splits)).float().unsqueeze(1)
        assert torch.equal(_place([data[i] for i in seen], starts, bounds, sum(splits)), data)


def test_tail_takes_weight_gradients_only_when_their_other_operands_precede_the_dispatch():
    """passes/dropless._tail_gemm: a GEMM over the body's rows (transposed) by a tensor that
    exists before the dispatch runs in the tail; one by a tensor computed after the dispatch
    (here: after the node standing for it) cannot, since the tail runs inside the op."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from overlapc.passes.dropless import _tail_gemm

    def f(rows, early, late_in):
        dispatch = rows * 2  # stands for the dispatch (position `before`)
        late = late_in + 1  # computed after it
        return torch.mm(dispatch.t(), early), torch.mm(dispatch.t(), late), torch.mm(early.t(), early)

    gm = make_fx(f, tracing_mode="fake")(torch.randn(6, 4), torch.randn(6, 3), torch.randn(6, 3))
    nodes = list(gm.graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    (dispatch,) = [n for n in nodes if n.target is torch.ops.aten.mul.Tensor]
    kinds = {
        dispatch: "row",
        **{n: "rowT" for n in nodes if n.target is torch.ops.aten.t.default and n.args[0] is dispatch},
    }
    mm_early, mm_late, mm_outside = [n for n in nodes if n.target is torch.ops.aten.mm.default]
    early = nodes[0].next  # the second placeholder
    assert _tail_gemm(mm_early, kinds, pos, pos[dispatch]) == [early]
    assert _tail_gemm(mm_late, kinds, pos, pos[dispatch]) is None
    assert _tail_gemm(mm_outside, kinds, pos, pos[dispatch]) is None  # reads no body rows


def test_a_body_that_fails_to_compile_runs_uncompiled(monkeypatch):
    """Under inner="inductor" a pipeline compiles its body at the first run; a compile that
    fails is reported and the body runs as it is, then and after."""
    import logging

    from torch.fx import symbolic_trace

    from overlapc.runtime import dropless

    def body(recv, offs, w):
        return (torch.relu(recv) @ w,)

    gm = symbolic_trace(body)
    p = dropless.DroplessPipeline(
        body=gm, group_name="0", chunks=2, n_row_inputs=0, n_row_outputs=0, site="s0", compile_body=True
    )

    def broken(*a, **k):
        def run(*args):
            raise RuntimeError("no lowering for aten.frobnicate")

        return run

    monkeypatch.setattr(torch, "compile", broken)
    x, w = torch.randn(5, 4), torch.randn(4, 3)
    seen = []

    class Catch(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    handler = Catch(logging.WARNING)
    logging.getLogger("overlapc").addHandler(handler)
    try:
        (out,) = p._run_body(x, None, w)
    finally:
        logging.getLogger("overlapc").removeHandler(handler)
    assert torch.equal(out, torch.relu(x) @ w)
    assert any(
        "dropless pipeline s0: its compiled body failed (RuntimeError: no lowering for aten.frobnicate)" in m
        for m in seen
    ), seen
    assert p._body_fn is gm
    (again,) = p._run_body(x, None, w)
    assert torch.equal(again, out)
