"""Adapt from the first calls: run the planned program, its alternative and the baseline
alternately, keep the fastest.

The planner's choice is a prediction. For a graph it rewrote under ``strategy="auto"``, the
backend also compiles the graph as captured (the baseline) and, where ``microbatches`` is
"auto", the plan of the other family: micro-batch slices where the planner chose row chunks,
row chunks where it chose slices (the two choices the cost model ranks against each other,
and the one it gets wrong most: BENCHMARKS.md's defaults table). :class:`Adaptive` calls
the programs in turn: one warm-up call each, then rounds of ``options.adapt`` timed calls
each (a second and third round only where the two fastest are close). After each round the
ranks that run the graph exchange their median times through the c10d store. The
store is not the program's process group, which may still have collectives in flight; it
also has a timeout of its own. Each program is timed at its slowest rank, and the fastest
is kept on every rank. A rewrite measured slower than the baseline is never kept.

Every rank calls a graph the same number of times in the same order (the graphs hold
collectives), so all of them decide at the same call with the same numbers. The report rows
of the graph get ``details["measured"]`` (the medians and the program kept). Where another
program is kept, the planned rows become "skipped" with the measured times as the reason;
where the alternative is kept, its rows join the report.
"""

from __future__ import annotations

import logging
import statistics
import time

import torch

log = logging.getLogger("overlapc")

WARMUP = 1
"""Calls of each program before timing: the first call allocates, connects and autotunes."""


PROGRAMS = 3
"""At most this many programs race: the planned one, its alternative, the baseline."""
CLOSE = 0.1
ROUNDS = 3
"""Where the runner-up's median is within ``CLOSE`` of the fastest's after a round of
``adapt`` timed calls each, another round follows, up to ``ROUNDS``, and the medians are
taken over every round: on an emulated link a step now and then stalls on TCP, which a
median of one round's calls does not absorb (docs/cost_model.md, "Adapting from the first
calls", links the run that showed it)."""


def settle_calls(adapt: int) -> int:
    """Calls of a compiled model after which every graph that option ``adapt`` races has kept
    its program: the compiling call, every program's warm-up and timed calls (every round),
    and one spare. Timing earlier calls would time a mix of the programs."""
    return 2 + PROGRAMS * (WARMUP + adapt * ROUNDS)


class Adaptive:
    """A boxed callable (one list of inputs) over two or three compiled variants of one graph:
    the planned program, optionally its alternative (``(program, report rows, label)``: the
    plan the planner ranked next, e.g. micro-batch slices instead of row chunks), and the
    graph as captured. ``add_rows`` reports the alternative's rows where it is kept."""

    def __init__(
        self,
        planned,
        baseline,
        *,
        kind: str,
        rows: list,
        ranks: list[int],
        steps: int,
        alternative: tuple | None = None,
        add_rows=None,
    ):
        self.fns = {"planned": planned}
        self.alt_rows, self.alt_label = [], ""
        if alternative is not None:
            self.fns["alternative"], self.alt_rows, self.alt_label = alternative
        self.fns["baseline"] = baseline
        self.order = list(self.fns)
        self.times: dict[str, list[float]] = {n: [] for n in self.order}
        self.kind, self.rows, self.ranks, self.steps = kind, rows, ranks, steps
        self.add_rows = add_rows
        self.calls = 0
        self.rounds = 1
        self.kept: str | None = None
        self._boxed_call = True

    def __call__(self, args):
        if self.kept is not None:
            return self.fns[self.kept](args)
        name = self.order[self.calls % len(self.order)]
        cuda = any(isinstance(a, torch.Tensor) and a.is_cuda for a in args)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = self.fns[name](args)
        if cuda:
            torch.cuda.synchronize()
        t = time.perf_counter() - t
        if self.calls >= len(self.order) * WARMUP:
            self.times[name].append(t)
        self.calls += 1
        if all(len(v) >= self.steps * self.rounds for v in self.times.values()):
            self._decide()
        return out

    def _decide(self) -> None:
        from overlapc.agree import _exchange

        mine = [statistics.median(self.times[n]) for n in self.order]
        got = _exchange("adapt/" + "_".join(map(str, self.ranks)), self.ranks, mine)
        slowest = {n: max(g[i] for g in got) for i, n in enumerate(self.order)}
        # The fastest; on a tie the baseline: a rewrite is kept only where it beats it.
        ranked = sorted(self.order, key=lambda n: (slowest[n], n != "baseline"))
        if self.rounds < ROUNDS and slowest[ranked[1]] < (1 + CLOSE) * slowest[ranked[0]]:
            self.rounds += 1  # agreed numbers: every rank goes on alike
            return
        self.kept = ranked[0]
        self.fns = {self.kept: self.fns[self.kept]}  # the other programs' memory goes
        planned, baseline = slowest["planned"], slowest["baseline"]
        calls = self.steps * self.rounds
        measured = {
            "planned_ms": round(planned * 1e3, 3),
            "baseline_ms": round(baseline * 1e3, 3),
            "calls": calls,
            "kept": self.kept,
        }
        if "alternative" in slowest:
            measured["alternative_ms"] = round(slowest["alternative"] * 1e3, 3)
            measured["alternative"] = self.alt_label
        for row in self.rows:
            row.details["measured"] = measured
            if self.kept != "planned" and row.status == "rewritten":
                row.status, row.strategy, row.chunks = "skipped", None, None
                if self.kept == "baseline":
                    row.reason = (
                        f"measured slower than the baseline in the first calls of the {self.kind} graph "
                        f"({planned * 1e3:.1f} ms against {baseline * 1e3:.1f} ms, slowest rank, median of "
                        f"{calls}); the baseline runs (option adapt)"
                    )
                else:
                    row.reason = (
                        f"measured slower than the alternative ({self.alt_label}) in the first calls of the "
                        f"{self.kind} graph ({planned * 1e3:.1f} ms against "
                        f"{slowest['alternative'] * 1e3:.1f} ms, slowest rank, median of {calls}); "
                        "the alternative runs (option adapt)"
                    )
        if self.kept == "alternative":
            for row in self.alt_rows:
                row.details["measured"] = measured
            if self.add_rows is not None:
                self.add_rows(self.alt_rows)
        log.info(
            "overlapc: %s graph: %s over %d calls: keeping the %s",
            self.kind,
            ", ".join(f"{n} {slowest[n] * 1e3:.1f} ms" for n in self.order),
            calls,
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
