"""Ranks agree on the plan before any rewritten collective runs.

A rewrite replaces one collective by several; if two ranks plan one graph differently
(different options, or different input shapes on different ranks), they issue different
collectives and wait on each other forever. So, when a graph that holds collectives is
compiled (which every rank of its groups does, at the same point of the program), the
ranks of each of its groups exchange what they planned, once, with a blocking
``all_gather_object`` on that group, and every rank raises the same ``OverlapError``,
naming the first site that differs, instead of hanging.
"""
from __future__ import annotations

from typing import Iterable

from .errors import OverlapError
from .report import Site

SKIP_BACKENDS = ("fake",)
"""Process groups whose collectives do not communicate (explain, tracing)."""


def plan_key(site: Site) -> tuple:
    """What must be identical across ranks for one site: everything that decides which
    collectives the rewritten graph issues."""
    return (site.name, site.pattern, site.collective_op, site.status, site.strategy, site.chunks,
            repr(site.shapes.get("input")), repr(site.shapes.get("output")))


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


def _real_tensors():
    """Compilation runs under fake-tensor and tracing modes; the exchange needs real tensors."""
    import contextlib

    from torch._subclasses.fake_tensor import unset_fake_temporarily
    from torch.fx.experimental.proxy_tensor import disable_proxy_modes_tracing

    stack = contextlib.ExitStack()
    stack.enter_context(unset_fake_temporarily())
    stack.enter_context(disable_proxy_modes_tracing())
    return stack


def check_plans_agree(graph_kind: str, sites: Iterable[Site]) -> None:
    """Exchange this graph's plan with the other ranks of every group it uses; raise
    OverlapError on every rank if any two ranks differ. A no-op outside a distributed run."""
    import torch.distributed as dist

    sites = list(sites)
    if not sites or not dist.is_available() or not dist.is_initialized():
        return
    from overlapc.passes.ops import group_backend
    from torch.distributed.distributed_c10d import _resolve_process_group

    keys = [plan_key(s) for s in sites]
    for name in sorted({s.group for s in sites if s.group is not None}):
        if group_backend(name) in SKIP_BACKENDS:
            continue
        pg = _resolve_process_group(name)
        gathered: list = [None] * dist.get_world_size(pg)
        with _real_tensors():
            dist.all_gather_object(gathered, keys, group=pg)
        ranks = dist.get_process_group_ranks(pg)
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
                f"{name!r} must compile with the same overlapc options and the same input shapes.")
