"""Adapting from the first calls (overlapc/runtime/adapt.py), on real gloo worlds.

The program is AG(x) @ w with a test op that sleeps for a given time after the matmul. An
extra pass changes that time in the rewritten program only, so which program is faster is
known: the adaptation must keep the rewritten program when it is faster and the baseline when
it is slower, on every rank, with every call's result equal to eager.
"""

from __future__ import annotations

import time

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

SLEEP = 0.02


@torch.library.custom_op("overlapc_test::pause", mutates_args=())
def pause(x: torch.Tensor, seconds: float) -> torch.Tensor:
    time.sleep(seconds)
    return x.clone()


@pause.register_fake
def _(x, seconds):
    return torch.empty_like(x)


def _retime(seconds: float):
    """An extra pass: the rewritten program's pause takes ``seconds`` instead."""

    def retime(gm):
        for n in gm.graph.nodes:
            if n.target is torch.ops.overlapc_test.pause.default:
                n.args = (n.args[0], seconds)

    return retime


def adapt_job(planned_pause: float, inner: str) -> dict:
    from overlapc import Backend, Options

    group = dist.group.WORLD
    rank = dist.get_rank()

    def fn(x, w):
        return torch.ops.overlapc_test.pause(funcol.all_gather_tensor(x, 0, group) @ w, SLEEP)

    # strategy "auto" (the default) with the site forced to a rewrite: the planner "chose" it
    opts = Options(inner=inner, microbatches=1, adapt=3, overrides={"*": {"strategy": "decompose", "chunks": 2}})
    be = Backend(opts, extra_passes=(_retime(planned_pause),))
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=be, fullgraph=True)
    w = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    for i in range(10):  # 2 warm-up calls + 3 timed each = 8, then the kept program
        x = torch.randn(32, 16, generator=torch.Generator().manual_seed(10 * i + rank))
        torch.testing.assert_close(compiled(x, w), fn(x, w), rtol=1e-5, atol=1e-5)
    site = next(s for s in be.report.sites if s.pattern == "all_gather_matmul")
    return {"measured": site.details.get("measured"), "status": site.status, "reason": site.reason}


@pytest.mark.distributed
@pytest.mark.parametrize("inner", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_adapt_keeps_the_faster_program(world2, inner):
    faster = world2.run(adapt_job, 0.0, inner)
    slower = world2.run(adapt_job, 3 * SLEEP, inner)
    for r in faster:
        assert r["measured"]["kept"] == "planned" and r["status"] == "rewritten", r
        assert r["measured"]["planned_ms"] < r["measured"]["baseline_ms"]
    for r in slower:
        assert r["measured"]["kept"] == "baseline" and r["status"] == "skipped", r
        assert "measured slower than the baseline" in r["reason"], r
    assert faster[0]["measured"] == faster[1]["measured"]  # agreed: the same numbers on every rank


def decide_job() -> list[str]:
    """Ranks that time the programs the other way round still keep the same one."""
    from overlapc.runtime.adapt import Adaptive

    fast, slow = (lambda a: time.sleep(0.001)), (lambda a: time.sleep(0.02))
    planned, baseline = (fast, slow) if dist.get_rank() == 0 else (slow, fast)
    kept = []
    for _ in range(2):
        ad = Adaptive(planned, baseline, kind="forward", rows=[], ranks=[0, 1], steps=2)
        for _ in range(6):
            ad([])
        kept.append(ad.kept)
    return kept


@pytest.mark.distributed
def test_adapt_agrees_across_ranks(world2):
    kept = world2.run(decide_job)
    # each program is slow on one rank: both medians are ~20 ms at the slowest rank; whichever
    # wins, both ranks keep the same one
    assert kept[0] == kept[1], kept
