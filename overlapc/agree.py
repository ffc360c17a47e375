"""Ranks agree on the plan before any rewritten collective runs.

A rewrite replaces one collective by several; if two ranks plan one graph differently
(different options, or different input shapes on different ranks), they issue different
collectives and wait on each other forever. So, when a graph that holds collectives is
compiled (which every rank of its groups does, at the same point of the program), the
ranks of each of its groups exchange what they planned, once, through the c10d store
(not the group itself, see ``_exchange``), and every rank raises the same
``OverlapError``, naming the first site that differs, instead of hanging.
"""

from __future__ import annotations

from collections.abc import Iterable

from .errors import OverlapError
from .report import Site

SKIP_BACKENDS = ("fake",)
"""Process groups whose collectives do not communicate (explain, tracing)."""


def plan_key(site: Site) -> tuple:
    """What must be identical across ranks for one site: everything that decides which
    collectives the rewritten graph issues. Where the rewrite cuts rows at run time (the
    dropless pipeline: split sizes are exchanged, chunks follow from them on both ends),
    ranks may hold different numbers of rows: only the other dims must agree."""
    inp, out = site.shapes.get("input"), site.shapes.get("output")
    if site.details.get("rows") == "at run time":
        inp, out = (s[1:] if isinstance(s, list) else s for s in (inp, out))
    return (site.name, site.pattern, site.collective_op, site.status, site.strategy, site.chunks, repr(inp), repr(out))


def _describe(key: tuple | None) -> str:
    if key is None:
        return "no such site"
    name, pattern, op, status, strategy, chunks, inp, out = key
    plan = f"{strategy}/{chunks}" if strategy else status
    return f"{pattern} ({op}) {plan}, input {inp} -> {out}"


def first_difference(mine: list[tuple], theirs: list[tuple]) -> tuple[int, tuple | None, tuple | None] | None:
    """(index, my key, their key) of the first site the two plans disagree on, or None."""
    for i in range(max(len(mine), len(theirs))):
        a = mine[i] if i < len(mine) else None
        b = theirs[i] if i < len(theirs) else None
        if a != b:
            return i, a, b
    return None


_EXCHANGES: dict[str, int] = {}
"""Exchanges done per group in this process: the key prefix of the next one (every rank of a
group compiles the same graphs in the same order, so the counters agree)."""


def _exchange(pg_name: str, ranks: list[int], payload) -> list:
    """All-gather ``payload`` among ``ranks`` through the default store, not the process
    group: the group may still have asynchronous functional collectives of the program in
    flight (gloo corrupts its state when a second one of a group joins them), and the store
    has its own timeout, so a rank that never arrives is an error, not a hang."""
    import pickle

    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _get_default_store

    store = _get_default_store()
    seq = _EXCHANGES[pg_name] = _EXCHANGES.get(pg_name, -1) + 1
    prefix = f"overlapc/plan/{pg_name}/{seq}"
    store.set(f"{prefix}/{dist.get_rank()}", pickle.dumps(payload))
    return [pickle.loads(store.get(f"{prefix}/{r}")) for r in ranks]


def check_plans_agree(graph_kind: str, sites: Iterable[Site]) -> None:
    """Exchange this graph's plan with the other ranks of every group it uses; raise
    OverlapError on every rank if any two ranks differ. A no-op outside a distributed run."""
    import torch.distributed as dist

    sites = list(sites)
    if not sites or not dist.is_available() or not dist.is_initialized():
        return
    from torch.distributed.distributed_c10d import _resolve_process_group

    keys = [plan_key(s) for s in sites]
    for name in sorted({s.group for s in sites if s.group is not None}):
        pg = _resolve_process_group(name)
        if dist.get_backend(pg) in SKIP_BACKENDS:
            continue
        ranks = dist.get_process_group_ranks(pg)
        gathered = _exchange(name, ranks, keys)
        for rank, theirs in zip(ranks[1:], gathered[1:]):
            diff = first_difference(gathered[0], theirs)
            if diff is None:
                continue
            i, a, b = diff
            site = (a or b)[0]
            raise OverlapError(
                f"ranks planned the {graph_kind} graph differently at site {site!r} (#{i}): "
                f"rank {ranks[0]}: {_describe(a)}; rank {rank}: {_describe(b)}. The rewritten "
                f"collectives would not match and the ranks would hang. Every rank of group "
                f"{name!r} must compile with the same overlapc options and the same input shapes."
            )
