"""Matchers on hand-written functional-collective programs (fake process group, world size 8).

Each program is traced by Dynamo + AOTAutograd exactly as the backend would; the
finders then run on the captured graphs alone.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

import overlapc
from overlapc.explain import capture
from overlapc.passes.all_gather_matmul import find_all_gather_matmul_sites
from overlapc.passes.deps import DepGraph
from overlapc.passes.matmul_reduce_scatter import find_matmul_reduce_scatter_sites

W = 8
NONE = {"strategy": "none"}


def explain(fn, *args):
    return overlapc.explain(fn, *args, options=NONE)


def only(report):
    """Rows of the forward (or, without grads, inference) graph."""
    return [s for s in report.sites if s.graph != "backward"]


def _group():
    return dist.group.WORLD


def _skip_inner_gathers_on_torch_2_11():
    if torch.__version__ < (2, 12):
        pytest.skip(
            "torch 2.11's Dynamo graph-breaks on funcol.all_gather_tensor with gather_dim != 0 "
            "(it skips torch._utils._maybe_view_chunk_cat): the gather runs outside the graph"
        )


# ---------------------------------------------------------------- all-gather -> matmul


@pytest.mark.parametrize(
    "shape,dim,role",
    [
        ((16, 32), 0, "rows"),  # 2-D, gather rows
        ((16, 32), 1, "contraction"),  # 2-D, gather the contraction dim
        ((2, 8, 32), 0, "rows"),  # 3-D, gather batch: flattens into rows
        ((2, 8, 32), 1, "rows"),  # 3-D, gather sequence (split + cat idiom)
        ((2, 8, 32), 2, "contraction"),
    ],
)
def test_all_gather_matmul_dims(fake_mesh8, shape, dim, role):
    if dim:
        _skip_inner_gathers_on_torch_2_11()
    k_local = shape[-1]
    k = k_local * (W if dim == len(shape) - 1 else 1)

    def fn(x, w):
        g = funcol.all_gather_tensor(x, gather_dim=dim, group=_group())
        return F.linear(g, w)

    x = torch.randn(*shape)
    w = torch.randn(24, k, requires_grad=True)
    rows = only(explain(fn, x, w))
    (site,) = [s for s in rows if s.pattern == "all_gather_matmul"]
    assert site.dim == dim and site.world_size == W
    assert list(site.details["roles"].values()) == [f"lhs:{role}"]
    assert site.shapes["input"][0] == shape[0] if dim else True


def test_several_consumers_one_site(fake_mesh8):
    _skip_inner_gathers_on_torch_2_11()

    def fn(x, wq, wk, wv):
        g = funcol.all_gather_tensor(x, gather_dim=1, group=_group())
        return F.linear(g, wq), F.linear(g, wk), F.linear(g, wv)

    x = torch.randn(2, 4, 32)
    ws = [torch.randn(16, 32) for _ in range(3)]
    rows = only(explain(fn, x, *ws))
    assert [s.pattern for s in rows] == ["all_gather_matmul"]
    assert len(rows[0].matmuls) == 3


def test_gathered_also_returned(fake_mesh8):
    def fn(x, w):
        g = funcol.all_gather_tensor(x, gather_dim=0, group=_group())
        return g @ w, g

    rows = only(explain(fn, torch.randn(4, 32), torch.randn(32, 16)))
    (site,) = rows
    assert site.pattern == "all_gather_matmul"
    assert site.details["other_users"], "the graph output still needs the whole gathered tensor"


def test_transposed_weight_and_dtype_view(fake_mesh8):
    def fn(x, w):
        g = funcol.all_gather_tensor(x, gather_dim=0, group=_group())
        return g.float() @ w.t()

    rows = only(explain(fn, torch.randn(4, 32, dtype=torch.bfloat16), torch.randn(16, 32)))
    assert [s.pattern for s in rows] == ["all_gather_matmul"]
    assert rows[0].dtype == "bfloat16"


def test_weight_depends_on_gather(fake_mesh8):
    def fn(x, w):
        g = funcol.all_gather_tensor(x, gather_dim=0, group=_group())
        return g @ (w + g.sum())

    rows = only(explain(fn, torch.randn(4, 32), torch.randn(32, 32)))
    (row,) = rows
    assert row.pattern == "collective"
    assert "depends on the all-gather" in row.reason


def test_gather_without_matmul(fake_mesh8):
    def fn(x):
        return torch.relu(funcol.all_gather_tensor(x, gather_dim=0, group=_group()))

    (row,) = only(explain(fn, torch.randn(4, 32)))
    assert row.pattern == "collective" and row.reason.startswith("no matmul consumer")
    assert "relu" in row.reason


def test_finder_alone(fake_mesh8):
    """find_*_sites runs on a captured graph without the rest of the pipeline."""

    def fn(x, w):
        g = funcol.all_gather_tensor(x, gather_dim=0, group=_group())
        y = g @ w
        return funcol.reduce_scatter_tensor(y, "sum", scatter_dim=0, group=_group())

    _, graphs = capture(fn, torch.randn(4, 32), torch.randn(32, 16), options=NONE)
    ((kind, gm),) = graphs
    deps = DepGraph(gm.graph)
    ag, loose = find_all_gather_matmul_sites(gm.graph, deps)
    rs, loose2 = find_matmul_reduce_scatter_sites(gm.graph, deps)
    assert len(ag) == 1 and len(rs) == 1 and not loose and not loose2
    # AG -> mm -> RS: the same matmul is the consumer of one site and the producer of the other.
    assert ag[0].matmuls == rs[0].matmuls
    assert ag[0].check(deps) is None


# ---------------------------------------------------------------- matmul -> reduce-scatter / all-reduce


@pytest.mark.parametrize("scatter_dim", [0, 1])
def test_matmul_reduce_scatter(fake_mesh8, scatter_dim):
    def fn(x, w):
        return funcol.reduce_scatter_tensor(F.linear(x, w), "sum", scatter_dim=scatter_dim, group=_group())

    rows = only(explain(fn, torch.randn(8, 16, 32), torch.randn(24, 32)))
    (site,) = rows
    assert site.pattern == "matmul_reduce_scatter" and site.dim == scatter_dim
    assert list(site.details["roles"].values()) == ["rows"]


def test_summed_matmuls_reduce_scatter(fake_mesh8):
    def fn(a, b, c, wa, wb, wc):
        y = a @ wa + b @ wb + c @ wc
        return funcol.reduce_scatter_tensor(y, "sum", scatter_dim=0, group=_group())

    args = [torch.randn(16, 8) for _ in range(3)] + [torch.randn(8, 32) for _ in range(3)]
    (site,) = only(explain(fn, *args))
    assert site.pattern == "matmul_reduce_scatter"
    assert site.details["producer"] == "sum" and len(site.matmuls) == 3


def test_summed_matmuls_all_reduce(fake_mesh8):
    def fn(a, b, wa, wb):
        return funcol.all_reduce(a @ wa + b @ wb, "sum", group=_group())

    (site,) = only(explain(fn, torch.randn(16, 8), torch.randn(16, 8), torch.randn(8, 4), torch.randn(8, 4)))
    assert site.pattern == "matmul_all_reduce" and len(site.matmuls) == 2


def test_matmul_result_used_twice(fake_mesh8):
    def fn(x, w):
        y = x @ w
        return funcol.reduce_scatter_tensor(y, "sum", scatter_dim=0, group=_group()), y.relu()

    (row,) = only(explain(fn, torch.randn(16, 8), torch.randn(8, 32)))
    assert row.pattern == "collective"
    assert row.reason.startswith("matmul result has other users")


def test_all_reduce_of_residual_sum(fake_mesh8):
    def fn(x, w):
        return funcol.all_reduce(x @ w + x, "sum", group=_group())

    (row,) = only(explain(fn, torch.randn(16, 16), torch.randn(16, 16)))
    assert row.pattern == "collective" and "not a matmul" in row.reason


def test_all_reduce_without_matmul(fake_mesh8):
    def fn(x):
        return funcol.all_reduce(x * 2, "sum", group=_group())

    (row,) = only(explain(fn, torch.randn(4, 4)))
    assert row.pattern == "collective" and "mul" in row.reason


def test_no_collectives(fake_mesh8):
    report = explain(lambda x, w: x @ w, torch.randn(4, 4), torch.randn(4, 4))
    assert report.sites == []
    assert "no collectives" in str(report)


def test_backward_sites_of_function(fake_mesh8):
    """A function with inputs that require grad: backward graph sites are found too."""

    def fn(x, w):
        g = funcol.all_gather_tensor(x, gather_dim=0, group=_group())
        return g @ w

    x = torch.randn(4, 32, requires_grad=True)
    w = torch.randn(32, 16, requires_grad=True)
    report = explain(fn, x, w)
    # backward: dx = RS(dy @ w^T), the mirror of the forward all-gather
    assert [(s.graph, s.pattern) for s in report.sites] == [
        ("forward", "all_gather_matmul"),
        ("backward", "matmul_reduce_scatter"),
    ]
