"""Lanes: extra gloo process groups over a group's ranks that carry its all-gathers.

One gloo group must not have an all-gather in flight beside another all-gather, or beside
reduce-scatters and all-reduces (passes/schedule.py says what failed), so on the group alone
an all-gather chunk waits for the reduce-scatter chunks before it. A lane is a separate
gloo communicator (its own connections, tags and worker threads) over the same ranks: the
schedule puts all-gathers on lanes, alternating, so an all-gather chunk and a reduce-scatter
chunk, or two all-gathers, are on the wire together. benchmarks/experiments/gloo_stress.py ``lanes``
runs that mix over a shaped link.

Lanes are made when a graph that uses them is compiled, after the ranks agreed on its plan
(overlapc/agree.py): the same point every rank of the group reaches in the same order, the
rule plan agreement already relies on. They take the group's own options (timeout, network
devices, worker threads), so a rank that never arrives makes the others raise after the
group's timeout. Lanes live outside torch.distributed's own registry of groups (they change
no name a user's later ``new_group`` gets) and are shut down at exit, when the group they
serve is garbage-collected, or when a new group takes its name. A graph compiled before its
lanes were shut down names lanes that no longer exist: compile it again.
"""

from __future__ import annotations

import atexit
import datetime
import threading
import weakref

from ..errors import OverlapError

SEP = "~overlapc_lane"
"""A lane's name is ``<group name><SEP><index>``."""

_LOCK = threading.RLock()  # re-entered by _release when a collection runs inside _make
_LANES: dict[str, tuple[weakref.ref, object]] = {}
"""lane name -> (weak reference to the group it serves, the lane's ProcessGroup)."""


def lane_name(group: str, index: int) -> str:
    return f"{group}{SEP}{index}"


def base_group(name: str) -> str:
    """The group a lane serves (a name that is no lane: itself)."""
    return name.split(SEP, 1)[0]


def is_lane(name: str) -> bool:
    return SEP in name


def ensure(names, timeout: float | None = None) -> list[str]:
    """Make every lane in ``names`` that does not exist yet for its group; returns those made.
    ``timeout``: seconds to connect and to wait in each collective (default: the group's own).

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


def _make(name: str, timeout: float | None) -> bool:
    import torch
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
        rank, size = base.rank(), base.size()
        store = _get_default_store()
        # A namespace every member of this group instance agrees on: the members of one
        # making arrive together (they are at the same point of the program), so the count of
        # arrivals at this name, divided by the group's size, is the same on each.
        gen = (store.add(f"overlapc/lane-arrivals/{name}", 1) - 1) // size
        prefixed = PrefixStore(f"overlapc/lane/{name}/{gen}/", store)
        own = base._get_backend(torch.device("cpu")).options
        opts = ProcessGroupGloo._Options()
        opts._timeout = datetime.timedelta(seconds=timeout) if timeout else own._timeout
        opts._devices = own._devices
        opts._threads = own._threads
        try:
            pg = ProcessGroup(prefixed, rank, size)
            pg._set_default_backend(ProcessGroup.BackendType.GLOO)
            gloo = ProcessGroupGloo(PrefixStore("cpu/", prefixed), rank, size, opts)
            pg._register_backend(torch.device("cpu"), ProcessGroup.BackendType.GLOO, gloo)
            pg._set_group_name(name)
        except Exception as e:
            raise OverlapError(
                f"overlapc could not connect lane {name!r} of process group {group!r} within "
                f"{opts._timeout.total_seconds():g} s (rank {rank} of {size}): {e}. Every rank of the group "
                "must compile the same graphs in the same order; option lanes=0 keeps all collectives on "
                "the group itself"
            ) from e
        _register_process_group(name, pg)
        _LANES[name] = (weakref.ref(base), pg)
    weakref.finalize(base, _release, name, pg)
    return True


def _release(name: str, pg) -> None:
    """The group a lane served is gone: shut the lane down (unless a new one took its name)."""
    with _LOCK:
        held = _LANES.get(name)
        if held is not None and held[1] is pg:
            _drop(name)


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
