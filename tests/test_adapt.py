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

from overlapc.runtime.adapt import ROUNDS, settle_calls

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
        for _ in range(2 + 2 * 2 * ROUNDS):  # a tie: every round runs
            ad([])
        kept.append(ad.kept)
    return kept


@pytest.mark.distributed
def test_adapt_agrees_across_ranks(world2):
    kept = world2.run(decide_job)
    # each program is slow on one rank: both medians are ~20 ms at the slowest rank; whichever
    # wins, both ranks keep the same one
    assert kept[0] == kept[1] and None not in kept[0], kept


def rounds_job(planned_s: float) -> dict:
    """Two programs, the baseline taking 0.1 s: the one kept, and the call at which it is."""
    from overlapc.runtime.adapt import Adaptive

    ad = Adaptive(
        lambda a: time.sleep(planned_s), lambda a: time.sleep(0.1), kind="forward", rows=[], ranks=[0, 1], steps=2
    )
    for i in range(2 + 2 * 2 * ROUNDS):
        ad([])
        if ad.kept is not None:
            return {"kept": ad.kept, "decided_at": i}
    return {"kept": None}


@pytest.mark.distributed
def test_adapt_takes_more_rounds_only_where_close(world2):
    """Programs 2x apart are decided after one round of timed calls; equal ones (far within
    adapt.CLOSE: 0.1 s sleeps, noise of a few ms) run every round, then one is kept."""
    for r in world2.run(rounds_job, 0.2):
        assert r == {"kept": "baseline", "decided_at": 2 + 2 * 2 - 1}, r
    for r in world2.run(rounds_job, 0.1):
        assert r["kept"] in ("planned", "baseline") and r["decided_at"] == 2 + 2 * 2 * ROUNDS - 1, r


def alternative_job() -> dict:
    """Three programs; the alternative is the fastest on every rank."""
    from overlapc.report import Site
    from overlapc.runtime.adapt import Adaptive

    def sleeper(seconds):
        return lambda a: time.sleep(seconds)

    planned_rows = [
        Site(name="forward:w:all_gather_matmul", pattern="all_gather_matmul", graph="forward", status="rewritten")
    ]
    alt_rows = [Site(name="forward:x:microbatch", pattern="microbatch", graph="forward", status="rewritten")]
    added = []
    ad = Adaptive(
        sleeper(0.02),
        sleeper(0.03),
        kind="forward",
        rows=planned_rows,
        ranks=[0, 1],
        steps=2,
        alternative=(sleeper(0.002), alt_rows, "2 micro-batch slices"),
        add_rows=added.extend,
    )
    order = []
    for _ in range(9):  # 3 warm-up calls and 2 timed each: decided at the 9th
        ad([])
        order.append(ad.kept)
    return {
        "kept": ad.kept,
        "decided_at": order.index("alternative"),
        "planned": (planned_rows[0].status, planned_rows[0].reason),
        "added": [r.name for r in added],
        "measured": alt_rows[0].details.get("measured"),
    }


@pytest.mark.distributed
def test_adapt_keeps_a_faster_alternative(world2):
    for r in world2.run(alternative_job):
        assert r["kept"] == "alternative" and r["decided_at"] == 8, r
        status, reason = r["planned"]
        assert status == "skipped" and "measured slower than the alternative (2 micro-batch slices)" in reason, r
        assert r["added"] == ["forward:x:microbatch"], r
        m = r["measured"]
        assert m["kept"] == "alternative" and m["alternative_ms"] < m["planned_ms"] < m["baseline_ms"], m


def compiled_alternative_job(inner: str) -> dict:
    """A graph the planner chunks by rows, compiled with microbatches "auto": option adapt
    also compiles two micro-batch slices and races them; every call equals eager."""
    from overlapc import Backend, Options

    group = dist.group.WORLD
    rank = dist.get_rank()

    def fn(x, w):
        return funcol.all_gather_tensor(x, 1, group) @ w

    opts = Options(inner=inner, adapt=2, overrides={"*": {"strategy": "decompose", "chunks": 2}})
    be = Backend(opts)
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=be, fullgraph=True)
    w = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    for i in range(settle_calls(2)):  # close programs: every round runs
        x = torch.randn(4, 8, 16, generator=torch.Generator().manual_seed(10 * i + rank))
        torch.testing.assert_close(compiled(x, w), fn(x, w), rtol=1e-5, atol=1e-5)
    site = next(s for s in be.report.sites if s.pattern == "all_gather_matmul")
    return site.details.get("measured") or {}


@pytest.mark.distributed
@pytest.mark.parametrize("inner", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_adapt_races_the_slices_alternative(world2, inner):
    got = world2.run(compiled_alternative_job, inner)
    assert got[0] == got[1], got  # agreed
    assert got[0].get("alternative") == "2 micro-batch slices", got[0]
    assert {"planned_ms", "alternative_ms", "baseline_ms"} <= got[0].keys(), got[0]
