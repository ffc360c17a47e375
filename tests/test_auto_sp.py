"""Automatic sequence parallelism (passes/auto_sp.py) on traced programs, fake process group.

Which all-reduces become reduce-scatter + row-wise ops + all-gather, read from the report and
the rewritten graphs; numerics against eager on real worlds are in
tests/test_models_distributed.py (test_tp_auto_sequence_parallel) and
tests/test_transformers_tp.py.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
from torch.distributed.tensor import DeviceMesh, DTensor, Replicate, distribute_tensor

import overlapc
from overlapc.explain import capture
from overlapc.passes import auto_sp, ops


def _ar(x):
    return funcol.all_reduce(x, "sum", dist.group.WORLD)


def _rms(h, w):
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5) * w


def _local(*xs):
    return [x.to_local() if isinstance(x, DTensor) else x for x in xs]


def _block(x, o, w1, g):
    x, g = _local(x, g)
    h = x + _ar(o @ w1)  # residual add after a row-parallel linear
    return _rms(h, g) @ w1.t()


def _targets(gm, target):
    return [n for n in gm.graph.nodes if n.target is target]


def _capture(fn, *args, **options):
    report, graphs = capture(fn, *args, options={"strategy": "auto", "schedule": False, **options})
    return report, dict(graphs)["inference"]


def _args(rows, dim=16, replicated=True):
    """(x, o, w1, g): the residual x and the norm weight g replicated DTensors (overlapc then
    knows every rank holds them equal), o this rank's partial input."""
    x, o, w1, g = torch.randn(rows, dim), torch.randn(rows, dim), torch.randn(dim, dim), torch.randn(dim)
    if replicated:
        mesh = DeviceMesh("cpu", list(range(dist.get_world_size())))
        x, g = (distribute_tensor(t, mesh, [Replicate()]) for t in (x, g))
    return x, o, w1, g


def test_residual_norm_becomes_reduce_scatter_and_all_gather(fake_mesh8):
    report, gm = _capture(_block, *_args(8 * 16))
    (row,) = report.by(pattern=auto_sp.PATTERN)
    assert row.status == "rewritten", row.reason
    assert row.details["all_reduces"] == 1 and row.details["all_gathers"] == 1
    assert not _targets(gm, ops.ALL_REDUCE)
    (rs,) = _targets(gm, ops.REDUCE_SCATTER)
    assert ops.shape(rs.args[0]) == [128, 16]
    # the replicated residual is cut to this rank's rows, at run time
    (cut,) = _targets(gm, torch.ops.overlapc.local_rows.default)
    assert ops.shape(cut) == [16, 16]
    # the norm ran on 16 rows, then one all-gather fed the matmul
    (ag,) = _targets(gm, ops.ALL_GATHER)
    assert ops.shape(ag.args[0]) == [16, 16]


def test_decode_rows_keep_the_all_reduce(fake_mesh8):
    report, gm = _capture(_block, *_args(8 * 4))
    (row,) = report.by(pattern=auto_sp.PATTERN)
    assert row.status == "skipped" and "4 rows a rank" in row.reason
    assert len(_targets(gm, ops.ALL_REDUCE)) == 1 and not _targets(gm, ops.REDUCE_SCATTER)


def test_off_keeps_every_all_reduce(fake_mesh8):
    report, gm = _capture(_block, *_args(8 * 16), auto_sp="off")
    (row,) = report.by(pattern=auto_sp.PATTERN)
    assert row.status == "skipped" and row.reason == "auto_sp 'off'"
    assert len(_targets(gm, ops.ALL_REDUCE)) == 1


def test_operands_not_known_replicated_keep_the_all_reduce(fake_mesh8):
    """A plain tensor input may differ by rank: each rank's rows would be computed with its own
    residual, so the rows stay whole."""
    report, gm = _capture(_block, *_args(8 * 16, replicated=False))
    (row,) = report.by(pattern=auto_sp.PATTERN)
    assert row.status == "skipped" and "not known to be the same on every rank" in row.reason, row.reason
    assert len(_targets(gm, ops.ALL_REDUCE)) == 1


def _gathered_twice(x, o, w1, g):
    x, g = _local(x, g)
    h = x + _ar(o @ w1)
    return h.relu() @ w1, h.sigmoid() @ w1.t()  # the rows leave through two different values


def _straight_to_matmul(x, o, w1, g):
    return _ar(o @ w1) @ w1  # nothing row-wise to save


def test_regions_that_do_not_pay_stay(fake_mesh8):
    report, gm = _capture(_gathered_twice, *_args(8 * 16))
    (row,) = report.by(pattern=auto_sp.PATTERN)
    assert row.status == "skipped" and "leave the region 2 times for 1 all-reduces" in row.reason, row.reason
    assert len(_targets(gm, ops.ALL_REDUCE)) == 1


def test_all_reduce_without_row_work_is_no_candidate(fake_mesh8):
    report, gm = _capture(_straight_to_matmul, *_args(8 * 16))
    assert not report.by(pattern=auto_sp.PATTERN)  # nothing row-wise: not reported at all
    assert len(_targets(gm, ops.ALL_REDUCE)) == 1


def _per_position(x, o, w1, table):
    (table,) = _local(table)
    return (_ar(o @ w1).view(8, 16, 16) * table.view(16, 1)).sum(-1, keepdim=True)  # broadcast along rows


def test_broadcast_along_some_row_dims_is_an_exit(fake_mesh8):
    x, o, w1, _ = _args(128)
    report, gm = _capture(_per_position, x, o, w1, _args(16, 1)[0].reshape(16))
    assert not report.by(pattern=auto_sp.PATTERN)  # the multiply needs whole rows: nothing row-wise
    assert len(_targets(gm, ops.ALL_REDUCE)) == 1


def test_invalid_option_names_the_choices():
    with pytest.raises(overlapc.OverlapError, match="'auto_sp' must be one of 'auto', 'off'"):
        overlapc.Options(auto_sp="on")


@pytest.mark.parametrize("seed", range(6))
def test_random_blocks_move_no_more_bytes(fake_mesh8, seed):
    """Random layer shapes: a rewritten region never moves more than SLACK times the bytes of
    its all-reduces, and its gathers feed exactly the matmuls the all-reduces fed."""
    g = torch.Generator().manual_seed(seed)
    rows = 8 * int(torch.randint(1, 6, (1,), generator=g)) * 8
    dim = int(torch.randint(1, 5, (1,), generator=g)) * 8
    report, gm = _capture(
        _block, *_args(rows, dim), strategy="decompose", chunks=int(torch.randint(2, 5, (1,), generator=g))
    )
    (row,) = report.by(pattern=auto_sp.PATTERN)
    wire = row.details["wire_bytes"]
    if row.status == "rewritten":
        assert wire["after"] <= auto_sp.SLACK * wire["before"]
        assert not _targets(gm, ops.ALL_REDUCE)
    else:
        assert rows // 8 < auto_sp.MIN_ROWS
