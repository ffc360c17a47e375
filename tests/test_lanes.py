"""Lanes (overlapc/runtime/lanes.py) in real gloo worlds: all-gathers on extra communicators,
equal to eager; made once per group, remade after destroy, and a rank that never arrives is
an error within the timeout, not a hang."""

from __future__ import annotations

import math
import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F
from eager_check import assert_matches

TOL = dict(rtol=1e-5, atol=1e-5)  # fp32; chunked reduce-scatters sum in another order (last bits)


def mlp(x, w1, w2, group):
    """AG -> mm -> relu -> mm -> RS: chunked all-gathers and reduce-scatters of one group in
    forward and again in backward."""
    g = funcol.all_gather_tensor_autograd(x, gather_dim=0, group=group)
    y = F.linear(torch.relu(F.linear(g, w1)), w2)
    return funcol.reduce_scatter_tensor_autograd(y, "sum", scatter_dim=0, group=group)


def _step(f, x, w1, w2):
    x, w1, w2 = (t.detach().clone().requires_grad_(True) for t in (x, w1, w2))
    out = f(x, w1, w2)
    (out * torch.arange(out.numel(), dtype=out.dtype).view(out.shape).sin()).sum().backward()
    return {"out": out.detach(), "x": x.grad, "w1": w1.grad, "w2": w2.grad}


def lanes_job(inner: str) -> dict:
    import overlapc
    from overlapc.passes import ops
    from overlapc.runtime import lanes

    group, rank = dist.group.WORLD, dist.get_rank()
    gen = torch.Generator().manual_seed(11 + rank)
    x = torch.randn(16, 32, generator=gen)
    gw = torch.Generator().manual_seed(5)
    w1, w2 = torch.randn(48, 32, generator=gw) / math.sqrt(32), torch.randn(32, 48, generator=gw) / math.sqrt(48)
    want = _step(lambda a, b, c: mlp(a, b, c, group), x, w1, w2)
    out = {}
    for attempt in ("first", "after destroy"):
        torch._dynamo.reset()
        be = overlapc.Backend(
            overlapc.Options(inner=inner, strategy="decompose", chunks=4, microbatches=1, lanes=2), keep_graphs=True
        )
        got = _step(torch.compile(lambda a, b, c: mlp(a, b, c, group), backend=be, fullgraph=True), x, w1, w2)
        err = assert_matches(got, want, TOL, f"{attempt}: ")
        live = lanes.live()
        groups = {
            kind: sorted({ops.group_name(n) for n in gm.graph.nodes if n.target is ops.ALL_GATHER})
            for kind, gm in be.graphs
        }
        out[attempt] = {"err": err, "live": live, "gather_groups": groups}
        lanes.destroy()
    out["after"] = lanes.live()
    out["base"] = group.group_name
    return out


@pytest.mark.distributed
@pytest.mark.parametrize("inner", ["eager", pytest.param("inductor", marks=pytest.mark.extended)])
def test_lanes_carry_all_gathers(world2, inner):
    from overlapc.runtime import lanes

    for r in world2.run(lanes_job, inner):
        want = [lanes.lane_name(r["base"], i) for i in range(2)]
        for attempt in ("first", "after destroy"):
            got = r[attempt]
            assert got["live"] == want, got
            if inner == "eager":  # inductor's graphs are the post-grad ones, not kept here
                assert got["gather_groups"] == {"forward": want, "backward": want}, got
        assert r["after"] == []


def missing_rank_job() -> tuple[str, float, list, list]:
    """A group with a 3 s timeout whose rank 1 never makes the lane: rank 0 raises within the
    group's timeout. Then a lane both ranks make goes away with its group."""
    import datetime
    import gc

    from overlapc.errors import OverlapError
    from overlapc.runtime import lanes

    g = dist.new_group([0, 1], timeout=datetime.timedelta(seconds=3))
    msg, took = "", 0.0
    if dist.get_rank() == 0:
        t0 = time.monotonic()
        try:
            lanes.ensure([lanes.lane_name(g.group_name, 7)])
            msg = "made"
        except OverlapError as e:
            msg = str(e)
        took = time.monotonic() - t0
    dist.barrier()
    both = lanes.lane_name(g.group_name, 0)
    lanes.ensure([both])
    made = [n for n in lanes.live() if lanes.base_group(n) == g.group_name]
    dist.destroy_process_group(g)
    del g
    gc.collect()
    left = [n for n in lanes.live() if n == both]
    return msg, took, made, left


@pytest.mark.distributed
def test_lane_without_peer_raises_and_lanes_go_with_their_group(world2):
    """Rank 1 never makes the lane: rank 0 raises within the group's timeout, naming the lane
    and option lanes=0. A lane both made is shut down once its group is gone."""
    from overlapc.runtime import lanes

    results = world2.run(missing_rank_job)
    msg, took, made, left = results[0]
    assert "could not connect lane" in msg and "lanes=0" in msg, msg
    assert took < 3.0 + 10, took
    assert any(n.endswith(lanes.SEP + "0") for n in made), made
    for _, _, _, left in results:
        assert left == [], left
