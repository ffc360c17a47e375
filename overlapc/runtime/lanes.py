"""Lanes: extra gloo process groups over a group's ranks that carry its all-gathers.

One gloo group must not have an all-gather in flight beside another all-gather, or beside
reduce-scatters and all-reduces (passes/schedule.py says what failed), so on the group alone
an all-gather chunk waits for the reduce-scatter chunks before it. A lane is a separate
gloo communicator (its own connections, tags and worker threads) over the same ranks: the
schedule puts all-gathers on lanes, alternating, so an all-gather chunk and a reduce-scatter
chunk, or two all-gathers, are on the wire together. benchmarks/gloo_stress.py ``lanes``
runs that mix over a shaped link.

Lanes are made when a graph that uses them is compiled, after the ranks agreed on its plan
(overlapc/agree.py): the same point every rank of the group reaches in the same order, the
rule plan agreement already relies on. A rank that never arrives makes the others raise
after the timeout. Lanes live outside torch.distributed's own registry of groups (they
change no name a user's later ``new_group`` gets) and are shut down at exit or when the
group they serve is replaced by a new one of the same name.
"""

from __future__ import annotations

import atexit
import datetime
import threading
import weakref

from ..errors import OverlapError

SEP = "~overlapc_lane"
"""A lane's name is ``<group name><SEP><index>``."""

_LOCK = threading.Lock()
_LANES: dict[str, tuple[weakref.ref, object]] = {}
"""lane name -> (weak reference to the group it serves, the lane's ProcessGroup)."""
_GENERATION: dict[str, int] = {}
"""Per group name: how many times its lanes were made in this process (the store prefix)."""


def lane_name(group: str, index: int) -> str:
    return f"{group}{SEP}{index}"


def base_group(name: str) -> str:
    """The group a lane serves (a name that is no lane: itself)."""
    return name.split(SEP, 1)[0]


def is_lane(name: str) -> bool:
    return SEP in name


def ensure(names, timeout: float) -> list[str]:
    """Make every lane in ``names`` that does not exist yet for its group; returns those made.

    Every rank of the group must call this for the same lanes in the same order."""
    made = []
    for name in sorted({n for n in names if isinstance(n, str) and is_lane(n)}):
        if _make(name, timeout):
            made.append(name)
    return made


def lanes_in(graph) -> list[str]:
    """Names of the lanes a graph's collectives use."""
    from overlapc.passes import ops

    return sorted({g for n in graph.nodes if ops.is_collective(n) and is_lane(g := ops.group_name(n) or "")})


def _make(name: str, timeout: float) -> bool:
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import PrefixStore, ProcessGroup, ProcessGroupGloo, _register_process_group
    from torch.distributed.distributed_c10d import _get_default_store, _resolve_process_group

    group = base_group(name)
    try:
        base = _resolve_process_group(group)
    except Exception as e:
        raise OverlapError(f"overlapc lane {name!r}: its process group {group!r} does not exist here") from e
    if base._get_backend_name() != "gloo":  # only gloo groups get lanes (a fake group in tests)
        return False
    with _LOCK:
        held = _LANES.get(name)
        if held is not None and held[0]() is base:
            return False
        if held is not None:  # the group was destroyed and made again under the same name
            _drop(name)
        gen = _GENERATION[group] = _GENERATION.get(group, -1) + 1
        rank, size = dist.get_rank(base), base.size()
        store = PrefixStore(f"overlapc/lane/{name}/{gen}/", _get_default_store())
        try:
            pg = ProcessGroup(store, rank, size)
            pg._set_default_backend(ProcessGroup.BackendType.GLOO)
            gloo = ProcessGroupGloo(PrefixStore("cpu/", store), rank, size, datetime.timedelta(seconds=timeout))
            pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, gloo)
            pg._set_group_name(name)
        except Exception as e:
            raise OverlapError(
                f"overlapc could not connect lane {name!r} of process group {group!r} within {timeout:g} s "
                f"(rank {rank} of {size}): {e}. Every rank of the group must compile the same graphs in the "
                "same order; option lanes=0 keeps all collectives on the group itself"
            ) from e
        _register_process_group(name, pg)
        _LANES[name] = (weakref.ref(base), pg)
    return True


def _drop(name: str) -> None:
    from torch._C._distributed_c10d import _unregister_process_group

    _, pg = _LANES.pop(name)
    try:
        _unregister_process_group(name)
    finally:
        _shutdown(pg)


def _shutdown(pg) -> None:
    try:
        pg.shutdown()
    except Exception:  # an already broken connection: nothing left to release
        pass


def destroy() -> None:
    """Shut down and unregister every lane of this process."""
    with _LOCK:
        for name in list(_LANES):
            _drop(name)


def live() -> list[str]:
    """Names of the lanes this process holds."""
    with _LOCK:
        return sorted(_LANES)


atexit.register(destroy)
