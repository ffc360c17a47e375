"""Adapt from the first calls: run the planned program and the baseline alternately, keep the faster.

The planner's choice is a prediction. For a graph it rewrote under ``strategy="auto"``, the
backend also compiles the graph as captured (the baseline), and :class:`Adaptive` calls the
two alternately: one warm-up call each, then ``options.adapt`` timed calls each. The ranks
that run the graph then exchange their median times through the c10d store. The store is
not the program's process group, which may still have collectives in flight; it also has a
timeout of its own. Each program is timed at its slowest rank, and the faster one is kept
on every rank. A plan measured slower than the baseline is never kept.

Every rank calls a graph the same number of times in the same order (the graphs hold
collectives), so all of them decide at the same call with the same numbers. The report rows
of the graph get ``details["measured"]`` (both medians and the program kept). Where the
baseline is kept, the rewritten rows become "skipped" with the measured times as the reason.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

log = logging.getLogger("overlapc")

WARMUP = 1
"""Calls of each program before timing: the first call allocates, connects and autotunes."""


def settle_calls(adapt: int) -> int:
    """Calls of a compiled model after which every graph that option ``adapt`` races has kept
    its program: the compiling call, both programs' warm-up and timed calls, and one spare.
    Timing earlier calls would time a mix of the two programs."""
    return 2 + 2 * (WARMUP + adapt)


class Adaptive:
    """A boxed callable (one list of inputs) over two compiled variants of one graph."""

    def __init__(self, planned, baseline, *, kind: str, rows: list, ranks: list[int], steps: int):
        self.fns = {"planned": planned, "baseline": baseline}
        self.times: dict[str, list[float]] = {"planned": [], "baseline": []}
        self.kind, self.rows, self.ranks, self.steps = kind, rows, ranks, steps
        self.calls = 0
        self.kept: str | None = None
        self._boxed_call = True

    def __call__(self, args):
        if self.kept is not None:
            return self.fns[self.kept](args)
        name = ("planned", "baseline")[self.calls % 2]
        cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = self.fns[name](args)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter() - t
        if self.calls >= 2 * WARMUP:
            self.times[name].append(t)
        self.calls += 1
        if all(len(v) >= self.steps for v in self.times.values()):
            self._decide()
        return out

    def _decide(self) -> None:
        from overlapc.agree import _exchange

        mine = (statistics.median(self.times["planned"]), statistics.median(self.times["baseline"]))
        got = _exchange("adapt/" + "_".join(map(str, self.ranks)), self.ranks, mine)
        planned, baseline = max(g[0] for g in got), max(g[1] for g in got)
        self.kept = "planned" if planned < baseline else "baseline"
        self.fns = {self.kept: self.fns[self.kept]}  # the other program's memory goes
        measured = {
            "planned_ms": round(planned * 1e3, 3),
            "baseline_ms": round(baseline * 1e3, 3),
            "calls": self.steps,
            "kept": self.kept,
        }
        for row in self.rows:
            row.details["measured"] = measured
            if self.kept == "baseline" and row.status == "rewritten":
                row.status, row.strategy, row.chunks = "skipped", None, None
                row.reason = (
                    f"measured slower than the baseline in the first calls of the {self.kind} graph "
                    f"({planned * 1e3:.1f} ms against {baseline * 1e3:.1f} ms, slowest rank, median of "
                    f"{self.steps}); the baseline runs (option adapt)"
                )
        log.info(
            "overlapc: %s graph: planned %.1f ms, baseline %.1f ms over %d calls: keeping the %s",
            self.kind,
            planned * 1e3,
            baseline * 1e3,
            self.steps,
            self.kept,
        )


def ranks_of(rows) -> list[int] | None:
    """The ranks that run a graph's collectives (the union of its sites' groups), or None
    where there is no distributed run to agree in."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    ranks: set[int] = set()
    for name in {r.group for r in rows if r.group is not None}:
        try:
            pg = _resolve_process_group(name)
        except Exception:  # noqa: BLE001 - a group this process cannot resolve: no agreement possible
            return None
        if dist.get_backend(pg) == "fake":
            return None
        ranks.update(dist.get_process_group_ranks(pg))
    return sorted(ranks) or None


def may_adapt(opts) -> bool:
    """Whether graphs may get a baseline to race against: option adapt under strategy "auto"
    (the planner's choice, not the user's), in a distributed run."""
    import torch.distributed as dist

    return bool(opts.adapt) and opts.strategy == "auto" and dist.is_available() and dist.is_initialized()


def race_ranks(changed: bool, rows) -> list[int] | None:
    """For a graph ``may_adapt`` allowed: the ranks that race it, where the planner changed it;
    else None."""
    return ranks_of(rows) if changed else None
