"""All-reduce coalescing (passes/coalesce.py) on hand-written programs, fake process group.

Which sums are coalesced and which are left alone, read from the report and from the
rewritten graph's all-reduce nodes. Numerics against eager on real worlds are in
tests/test_rewrites_distributed.py (programs col_ar and par_ar) and
tests/test_models_distributed.py (the TP-only Llama).
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from overlapc.explain import capture
from overlapc.passes import ops


def _ar(x, group=None):
    return funcol.all_reduce(x, "sum", group or dist.group.WORLD)


def _run(fn, *args, options=None):
    report, graphs = capture(fn, *args, options={"strategy": "decompose", "schedule": False, **(options or {})})
    gm = dict(graphs)["inference"]
    ars = [n for n in gm.graph.nodes if n.target is ops.ALL_REDUCE]
    return report, ars


def _x(*shape):
    return torch.randn(*shape)


def test_sum_of_three_through_views(fake_mesh8):
    def fn(a, b, c, w):
        return (_ar(a @ w).view(2, 4, 8) + _ar(b @ w).view(2, 4, 8)) + _ar(c @ w).view(2, 4, 8)

    report, ars = _run(fn, _x(8, 16), _x(8, 16), _x(8, 16), _x(16, 8))
    (row,) = report.by(pattern="all_reduce_sum")
    assert row.status == "rewritten" and len(row.details["all_reduces"]) == 3
    assert row.details["bytes_saved"] == 2 * 8 * 8 * 4
    # one all-reduce of a sum of matmuls, chunked by the matmul_all_reduce rewrite
    (site,) = report.by(pattern="matmul_all_reduce")
    assert site.status == "rewritten" and site.details["producer"] == "sum" and len(site.matmuls) == 3
    assert sum(ops.val(n.args[0]).numel() for n in ars) == 8 * 8


def test_replicated_term_stays_outside(fake_mesh8):
    def fn(a, b, r, w):
        return r + _ar(a @ w) + _ar(b @ w)  # r is this rank's own: added after the all-reduce

    report, ars = _run(fn, _x(8, 16), _x(8, 16), _x(8, 8), _x(16, 8), options={"strategy": "auto"})
    (row,) = report.by(pattern="all_reduce_sum")
    assert row.status == "rewritten"
    assert sum(ops.val(n.args[0]).numel() for n in ars) == 64


def _used_elsewhere(a, b, w):
    ya = _ar(a @ w)
    return ya + _ar(b @ w), ya.relu()  # a's all-reduce is needed whole on its own


def _twice(a, b, w):
    y = _ar(a @ w)
    return y + y


def _cast(a, b, w):  # a cast between the wait and the sum changes the reduction's precision
    return _ar(a @ w).float() + _ar(b @ w).float()


def _broadcast(a, b, w):
    return _ar(a @ w) + _ar((b @ w)[:1])


@pytest.mark.parametrize(
    "fn,dtype",
    [(_used_elsewhere, torch.float32), (_twice, torch.float32), (_cast, torch.bfloat16), (_broadcast, torch.float32)],
    ids=["used_elsewhere", "twice", "cast", "broadcast"],
)
def test_left_alone(fake_mesh8, fn, dtype):
    x, w = _x(8, 16).to(dtype), _x(16, 8).to(dtype)
    report, ars = _run(fn, x, x, w)
    assert not report.by(pattern="all_reduce_sum"), str(report)
    assert len(ars) >= 2


def test_groups_and_dtypes_apart(fake_mesh8):
    sub = dist.new_group([0, 1, 2, 3])

    def fn(a, b, c, w):
        return _ar(a @ w) + _ar(b @ w, sub) + _ar(c @ w)  # only the two world all-reduces meet

    report, ars = _run(fn, _x(8, 16), _x(8, 16), _x(8, 16), _x(16, 8))
    (row,) = report.by(pattern="all_reduce_sum")
    assert len(row.details["all_reduces"]) == 2 and row.group == dist.group.WORLD.group_name
    per_group = {}
    for n in ars:
        per_group[ops.group_name(n)] = per_group.get(ops.group_name(n), 0) + ops.val(n.args[0]).numel()
    assert per_group == {dist.group.WORLD.group_name: 64, sub.group_name: 64}


@pytest.mark.parametrize(
    "options",
    [{"strategy": "none"}, {"overrides": {"*:all_reduce_sum": {"strategy": "none"}}}],
    ids=["strategy", "override"],
)
def test_strategy_none_reports(fake_mesh8, options):
    def fn(a, b, w):
        return _ar(a @ w) + _ar(b @ w)

    x, w = _x(8, 16), _x(16, 8)
    report, ars = _run(fn, x, x, w, options=options)
    (row,) = report.by(pattern="all_reduce_sum")
    assert row.status == "found" and "strategy 'none'" in row.reason
    assert len(ars) >= 2
