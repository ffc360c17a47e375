"""Measure the live process group when a graph is compiled, so the planner prices the
user's own network instead of a profile's guess.

A graph's collectives are priced by the cost model (passes/cost.t_comm) from a profile's
link numbers; on a link unlike the profile's (a 60 Mbit/s one priced as loopback), every
decision is wrong. So, where ``hardware`` is not given and ``measure`` is on, compiling a
graph that holds collectives times each of its collective kinds on the group it runs on,
at the sizes its plans can issue (the whole collective and its 2-, 4- and 8-way chunks),
and the planner reads those times as the profile's curves for groups of that size.

Every rank of the group takes part in the same measurements in the same order:

1. the ranks exchange what they need measured through the c10d store (as plan agreement
   does, overlapc/agree.py): a rank that compiles another graph gets an ``OverlapError``
   naming the difference, and a rank that never arrives is the store's timeout, not a hang;
2. the measurements run on a process group of their own (same ranks and backend), never
   on the program's group, which may have collectives in flight;
3. each time is the slowest rank's, so every rank holds the same numbers and plans alike.

Times are cached per (backend, ranks, hosts, kind, dtype, elements), in memory and in
``$OVERLAPC_CACHE/live/`` (rank 0's file is the one read, and its numbers are sent to the
others): a recompile, a later shape bucket or the next run measures nothing it has. A
corrupt cache file is ignored with a warning. The first use of a disk cache in a process
times its largest size once more: one off by more than ``STALE`` (a link that changed under
the same hosts) drops the file's numbers, and the group is measured again.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import socket
import time
import warnings
from datetime import timedelta

import torch

log = logging.getLogger("overlapc")

CHUNK_DIVISORS = (1, 2, 4, 8)
"""Sizes measured per collective: the whole, and the chunks of 2, 4 and 8 (the planner's
counts in between read the curve between them)."""
BUDGET_S = 2.0
"""Seconds of measurement per compiled graph; sizes left when it is spent are priced by the
model (the curve's last segment extended, or the profile's link)."""
REPS = 3
"""Timed runs per size after a warm-up (one where a run takes longer than ``SLOW_S``; none
where the link is warm and the first run takes that long)."""
SLOW_S = 0.05
LINEAR = 0.9
"""Sizes of a kind are measured smallest first. Once doubling the bytes takes at least this
fraction of twice the time, the link is bandwidth-bound there: larger sizes are left to the
curve's last segment, extended (on a 60 Mbit/s link, the whole and half collectives were
most of the measurement's time, and lie on that line)."""
MERGE = 0.15
"""Sizes within this fraction of one already requested are measured once."""

STALE = 1.5
"""A disk cache whose largest size now times more than this factor off its cached time (either
way) is stale: the network changed under the same ranks and hosts. Above the noise between
repeated measurements of one size, below the gap between link rates worth replanning for."""

_MEMO: dict[tuple, float] = {}
"""(backend, ranks, hosts, kind, dtype, elements) -> seconds: this process's measurements."""
_CHECKED: set[tuple] = set()
"""(backend, ranks, hosts) whose disk cache this process has checked against the live group."""
SPENT: list[dict] = []
"""One entry per graph whose collectives were priced from the live group: its kind, seconds
spent measuring (and checking) at compile time, sizes measured and cached. Benchmarks read
it to report the compile time measurement adds."""


@dataclasses.dataclass(frozen=True)
class Need:
    """One collective to time: ``kind`` over the group, ``numel`` elements of ``dtype`` per rank."""

    kind: str
    dtype: str
    numel: int

    @property
    def nbytes(self) -> int:
        return self.numel * getattr(torch, self.dtype).itemsize


RS_A2A = "reduce_scatter_a2a"
"""The kind of a reduce-scatter that runs as an all-to-all and a sum (passes/forms.py): timed in
that form, cached apart from the backend's own, priced as "reduce_scatter"."""
AG_A2A = "all_gather_a2a"
"""The kind of an all-gather that runs as all-to-alls (passes/forms.py); priced as "all_gather"."""
AS_A2A = {"reduce_scatter": RS_A2A, "all_gather": AG_A2A}
WHOLE = "_whole"
"""Suffix of a lowered kind sent as one all-to-all, not in pieces (forms.VERDICT "whole")."""
PRICED_AS = {**{v: k for k, v in AS_A2A.items()}, **{v + WHOLE: k for k, v in AS_A2A.items()}}


def a2a_kind(kind: str, form: str) -> str:
    """The measured kind of ``kind`` ("reduce_scatter", "all_gather") lowered in ``form``."""
    return AS_A2A[kind] + (WHOLE if form == "whole" else "")


def needs_of(graph, options=None) -> dict[str, list[Need]]:
    """Per process-group name, the collectives to time for the graph's collectives: every
    kind at each collective's size and its chunks' sizes, merged where within ``MERGE``."""
    from overlapc.passes import forms, ops
    from overlapc.passes.axis import even_splits

    out: dict[str, list[Need]] = {}
    for node in graph.nodes:
        kind = ops.COST_KIND.get(node.target)
        if kind in AS_A2A and options is not None and forms.lowerable(node, options):
            kind = a2a_kind(kind, forms.form_of(node, options))
        v = ops.val(node.args[0]) if kind else None
        name, world = (ops.group_name(node), ops.world_size(node)) if kind else (None, None)
        numel = ops.hint(v.numel()) if v is not None else None
        if kind is None or name is None or not world or not numel:
            continue
        if kind == "all_to_all" and not even_splits(node):
            continue  # each rank sends its own rows (dropless pipelines: priced by the model)
        unit = 1 if PRICED_AS.get(kind, kind) == "all_gather" else world  # inputs split across the ranks
        have = out.setdefault(name, [])
        for d in CHUNK_DIVISORS:
            n = max(unit, numel // d // unit * unit)
            need = Need(kind, ops.dtype_name(v), n)
            if not any(h.kind == kind and h.dtype == need.dtype and abs(h.numel - n) <= MERGE * n for h in have):
                have.append(need)
    for have in out.values():  # largest first: the whole collectives matter most if the budget runs out
        have.sort(key=lambda n: (-n.nbytes, n.kind, n.dtype))
    return out


def _live_group(name: str, options):
    """The process group ``name`` if its collectives are to be timed under ``options`` (measure
    on, no profile named, a real group), else None."""
    import torch.distributed as dist

    if not options.measure or options.hardware is not None or not dist.is_available() or not dist.is_initialized():
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    try:
        pg = _resolve_process_group(name)
    except (ValueError, RuntimeError, KeyError):
        return None
    return None if dist.get_backend(pg) in ("fake",) else pg


def _timed(pg, name: str, needs: list[Need], options, graph_kind: str) -> dict:
    # Compilers call the passes under their fake (and tracing) modes: the measurements are
    # real tensors and real collectives.
    from torch.utils._python_dispatch import _disable_current_modes

    with _disable_current_modes():
        return _measure_group(pg, name, needs, options, graph_kind)


A2A_MARGIN = 1.1
"""Under "auto", a kind runs as all-to-alls unless its own form is faster than the faster
all-to-all form (pieces or whole) by more than this factor: as all-to-alls both kinds share
the wire, which one collective timed alone does not show (BENCHMARKS.md, "Defaults": the
"native AG" column at 60 Mbit/s, world 4, where the two forms alone take the same time)."""


def choose_forms(graph, options, graph_kind: str = "") -> dict:
    """Where option ``reduce_scatter`` or ``all_gather`` is "auto" and the group's backend is one
    passes/forms.py lowers on: time the kind's own form and its all-to-all forms (in pieces, and
    whole where it would go in pieces) at the graph's largest such collective on the live
    group, and record the form to run for the group (forms.VERDICT: "native", "pieces" or
    "whole"), so that the lowering follows the user's link: pieces beat gloo's forms on a slow
    link, and lose to them where per-message costs dominate. Every rank gets the same agreed
    times, so the same verdicts. Returns {(group, kind): form}."""
    import torch.distributed as dist

    from overlapc.passes import forms, ops

    largest: dict[tuple, Need] = {}
    for node in graph.nodes:
        if node.target not in forms.OPTION or getattr(options, forms.OPTION[node.target]) != "auto":
            continue
        name = ops.group_name(node)
        if name is None or not forms.lowerable(node, options, measured=False):
            continue
        v = ops.val(node.args[0])
        need = Need(ops.COST_KIND[node.target], ops.dtype_name(v), ops.hint(v.numel()))
        key = (name, node.target)
        if key not in largest or need.nbytes > largest[key].nbytes:
            largest[key] = need
    out = {}
    for name in sorted({k[0] for k in largest}):
        pg = _live_group(name, options)
        if pg is None:
            continue
        world = dist.get_world_size(pg)
        kinds = sorted((k for k in largest if k[0] == name), key=lambda k: ops.COST_KIND[k[1]])
        cands = {}  # (group, kind) -> {form: need}
        for k in kinds:
            own = largest[k]
            split = forms.piece_count(own.kind == "all_gather", own.nbytes, world) > 1
            forms_ = ("pieces", "whole") if split else ("pieces",)
            cands[k] = {"native": own, **{f: dataclasses.replace(own, kind=a2a_kind(own.kind, f)) for f in forms_}}
        times = _timed(pg, name, [n for c in cands.values() for n in c.values()], options, graph_kind)
        for k, c in cands.items():
            got = {f: times[n][0] for f, n in c.items() if n in times}
            if "native" in got and "pieces" in got:
                best = min((f for f in got if f != "native"), key=got.get)
                out[k] = forms.VERDICT[k] = best if got[best] <= A2A_MARGIN * got["native"] else "native"
    return out


def measured_profile(graph, base, options, graph_kind: str = ""):
    """``base`` with curves measured on the live groups of ``graph``'s collectives (where
    ``options.measure`` is on, ``options.hardware`` is not set and the group communicates);
    ``base`` itself where nothing is measured."""
    import torch.distributed as dist

    curves: dict[int, dict[str, list]] = {}
    sources: dict[tuple, str] = {}
    t0, counts = time.perf_counter(), {"measured": 0, "cached": 0}
    for name, needs in sorted(needs_of(graph, options).items()):
        pg = _live_group(name, options)
        if pg is None:
            continue
        world = dist.get_world_size(pg)
        times = _timed(pg, name, needs, options, graph_kind)
        for need, (t, how) in times.items():
            kind = PRICED_AS.get(need.kind, need.kind)
            curves.setdefault(world, {}).setdefault(kind, []).append((need.nbytes, t))
            counts[how] += 1
            if sources.get((kind, world)) != "measured":  # a kind is "measured" if any size was
                sources[(kind, world)] = how
    if not curves:
        return base
    SPENT.append({"graph": graph_kind, "seconds": time.perf_counter() - t0, **counts})
    from overlapc.passes.cost import _monotone

    # Two groups of one size (a 2-D mesh's TP and DP groups) share the curves: per size, the
    # upper envelope of their points (a group's own curve would need the group in the model).
    merged = {w: {k: _monotone(v) for k, v in kinds.items()} for w, kinds in curves.items()}
    note = (
        f"; the graph's collectives timed on the live group(s): {counts['measured']} size(s) measured, "
        f"{counts['cached']} cached, {time.perf_counter() - t0:.2f} s"
    )
    return dataclasses.replace(
        base,
        name=f"{base.name}+measured",
        source=base.source + note,
        world_curves={**base.world_curves, **merged},
        provenance={**base.provenance, **sources},
    )


def _measure_group(pg, name: str, needs: list[Need], options, graph_kind: str):
    """{need: (seconds, "measured" or "cached")} for one group, the same on all its ranks."""
    import torch.distributed as dist

    from overlapc.agree import _exchange
    from overlapc.errors import OverlapError

    backend = str(dist.get_backend(pg))
    ranks = dist.get_process_group_ranks(pg)
    request = [dataclasses.astuple(n) for n in needs]
    mine = {"request": request, "host": socket.gethostname()}
    got = _exchange(f"live/{name}", ranks, mine)
    for rank, theirs in zip(ranks, got):
        if theirs["request"] != request:
            raise OverlapError(
                f"ranks compiled different {graph_kind or 'graphs'} with collectives on group {name!r}: rank "
                f"{dist.get_rank()} would measure {_brief(request)}, rank {rank} {_brief(theirs['request'])}. "
                "Every rank of a group must compile the same graph with the same input shapes."
            )
    key = (backend, tuple(ranks), tuple(g["host"] for g in got))
    on_rank0 = dist.get_rank() == ranks[0]
    # Rank 0's numbers (memory, then its disk cache) are everyone's: a rank with a cache of
    # its own must not measure less than the others (its collectives would have no peers).
    known, on_disk, check = {}, {}, None
    if on_rank0:
        on_disk = _load_disk(key)
        known = {n: _MEMO[key + dataclasses.astuple(n)] for n in needs if key + dataclasses.astuple(n) in _MEMO}
        from_disk = {n: t for n, t in on_disk.items() if n in needs and n not in known}
        known.update(from_disk)
        if from_disk and key not in _CHECKED:
            largest = max(from_disk, key=lambda n: (n.nbytes, dataclasses.astuple(n)))
            check = {
                "from_disk": [dataclasses.astuple(n) for n in from_disk],
                "largest": dataclasses.astuple(largest),
                "cached": from_disk[largest],
            }
    linked = (backend, tuple(ranks)) in _Link.GROUPS
    shared = _exchange(
        f"live/{name}",
        ranks,
        {
            "known": [dataclasses.astuple(n) + (t,) for n, t in known.items()],
            "nonce": os.urandom(8).hex(),
            "linked": linked,
            "check": check,
        },
    )
    if not all(g["linked"] for g in shared):  # a rank lost its link (a restarted worker): all make a new one
        _Link.GROUPS.pop((backend, tuple(ranks)), None)
    shared = shared[0]
    known = {Need(*row[:3]): row[3] for row in shared["known"]}
    t0 = time.perf_counter()
    link, fresh = None, {}
    _CHECKED.add(key)
    check = shared["check"]
    if check:
        # Every rank times rank 0's largest cached size: the same collective, the same verdict.
        largest = Need(*check["largest"])
        link = _Link.open(backend, ranks, shared["nonce"], options)
        now, runs = _time_collective(link, largest)
        if not 1 / STALE <= now / check["cached"] <= STALE:
            log.warning(
                "overlapc: the measurement cache of group %s is stale (%s %s x%d: %.2f ms cached, %.2f ms now); "
                "measuring the group again",
                name,
                largest.kind,
                largest.dtype,
                largest.numel,
                check["cached"] * 1e3,
                now * 1e3,
            )
            for row in check["from_disk"]:
                known.pop(Need(*row), None)
            fresh = {largest: (now, runs)}
    stale = bool(fresh)
    times = {**known, **{n: t for n, (t, _) in fresh.items()}}
    spent = sum(t * runs for t, runs in fresh.values())
    for need in sorted(needs, key=lambda n: (n.kind, n.dtype, n.nbytes)):
        if need in times:
            continue
        if spent >= BUDGET_S:
            break  # agreed: ``spent`` is a sum of agreed times
        below = sorted(
            (n.nbytes, t)
            for n, t in times.items()
            if (n.kind, n.dtype) == (need.kind, need.dtype) and n.nbytes < need.nbytes
        )
        if len(below) >= 2 and below[-1][1] >= LINEAR * below[-2][1] * below[-1][0] / below[-2][0]:
            continue  # bandwidth-bound: the curve's last segment prices the larger sizes
        warm = link is not None
        link = link or _Link.open(backend, ranks, shared["nonce"], options)
        t, runs = _time_collective(link, need, warm)
        times[need] = t
        spent += t * runs
    for need, t in times.items():
        _MEMO[key + dataclasses.astuple(need)] = t
    if on_rank0 and (stale or len(times) > len(known)):
        _save_disk(key, times if stale else {**on_disk, **times})
    log.info(
        "overlapc: measured %d collective size(s) on group %s in %.2f s (%d cached)",
        len(times) - len(known),
        name,
        time.perf_counter() - t0,
        len(known),
    )
    return {n: (t, "cached" if n in known else "measured") for n, t in times.items()}


def _brief(request) -> str:
    return ", ".join(f"{k} {d} x{n}" for k, d, n in request[:4]) + (" ..." if len(request) > 4 else "")


class _Link:
    """The collectives a measurement runs, on a process group of its own: the program's
    group may have collectives in flight (gloo corrupts its state when one of ours joins
    them). On gloo, a backend object built on the default store under a prefix the ranks
    agreed on (not ``new_group``, whose names repeat once groups are destroyed and made
    again, so a new group can meet an old one's addresses in the store); elsewhere, a
    group of the same ranks made once by those ranks."""

    GROUPS: dict = {}
    """(backend, ranks) -> the link, made once per process."""

    def __init__(self, pg, gloo: bool, device: str):
        self.pg, self.gloo, self.device = pg, gloo, device

    @classmethod
    def open(cls, backend: str, ranks: list[int], nonce: str, options) -> _Link:
        import torch.distributed as dist
        from torch.distributed.distributed_c10d import _get_default_store

        timeout = timedelta(seconds=min(float(options.timeout), 120.0))
        key = (backend, tuple(ranks))
        if key not in cls.GROUPS:
            if backend == "gloo":
                store = dist.PrefixStore(f"overlapc/live/{'_'.join(map(str, ranks))}/{nonce}", _get_default_store())
                pg = dist.ProcessGroupGloo(store, ranks.index(dist.get_rank()), len(ranks), timeout)
            else:
                pg = dist.new_group(ranks, backend=backend, timeout=timeout, use_local_synchronization=True)
            cls.GROUPS[key] = cls(pg, backend == "gloo", "cuda" if backend == "nccl" else "cpu")
        return cls.GROUPS[key]

    @property
    def size(self) -> int:
        import torch.distributed as dist

        return self.pg.size() if self.gloo else dist.get_world_size(self.pg)

    def barrier(self):
        import torch.distributed as dist

        self.pg.barrier(dist.BarrierOptions()).wait() if self.gloo else dist.barrier(self.pg)

    def slowest(self, t: float) -> float:
        """The largest ``t`` of all ranks, on every rank."""
        import torch.distributed as dist

        v = torch.tensor([t], dtype=torch.float64, device=self.device)
        if self.gloo:
            opts = dist.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.MAX
            self.pg.allreduce([v], opts).wait()
        else:
            dist.all_reduce(v, dist.ReduceOp.MAX, group=self.pg)
        return float(v.item())

    def run(self, kind: str, out, x):
        import torch.distributed as dist

        if kind in PRICED_AS:
            self._pieces(kind, out, x)
            return
        if self.gloo:
            work = {
                "all_gather": lambda: self.pg._allgather_base(out, x),
                "reduce_scatter": lambda: self.pg._reduce_scatter_base(out, x, dist.ReduceScatterOptions()),
                "all_reduce": lambda: self.pg.allreduce([x]),
                "all_to_all": lambda: self.pg.alltoall_base(out, x, [], []),
            }[kind]()
            work.wait()
            return
        {
            "all_gather": lambda: dist.all_gather_into_tensor(out, x, group=self.pg),
            "reduce_scatter": lambda: dist.reduce_scatter_tensor(out, x, group=self.pg),
            "all_reduce": lambda: dist.all_reduce(x, group=self.pg),
            "all_to_all": lambda: dist.all_to_all_single(out, x, group=self.pg),
        }[kind]()

    def _pieces(self, kind: str, out, x):
        """A reduce-scatter or an all-gather as passes/forms.py lowers it: all-to-alls of
        column pieces of every block, all issued, then waited (a reduce-scatter's blocks of
        each piece then summed)."""
        import torch.distributed as dist

        from overlapc.passes.forms import piece_bounds, piece_count

        w = self.size
        rs = PRICED_AS[kind] == "reduce_scatter"
        got = out.view(1 if rs else w, -1)
        blocks = x.view(w, -1) if rs else x.view(1, -1).expand(w, -1)  # all-gather: the input to every peer
        k = 1 if kind.endswith(WHOLE) else piece_count(not rs, x.numel() * x.element_size(), w)
        bounds = piece_bounds(blocks.shape[1], k)
        sends = [blocks[:, lo:hi].contiguous() for lo, hi in zip(bounds, bounds[1:])]
        recvs = [torch.empty_like(t) for t in sends]
        if self.gloo:
            works = [self.pg.alltoall_base(r, t, [], []) for r, t in zip(recvs, sends)]
        else:
            works = [dist.all_to_all_single(r, t, group=self.pg, async_op=True) for r, t in zip(recvs, sends)]
        for wk, r, lo, hi in zip(works, recvs, bounds, bounds[1:]):
            wk.wait()
            if rs:
                got[0, lo:hi] = r.sum(0)
            else:
                got[:, lo:hi] = r


def collective_fn(link: _Link, need: Need):
    """A callable that runs one collective of ``need`` on ``link`` (tests replace this with a
    double that adds a delay in proportion to the bytes: a slow link without root)."""
    dtype = getattr(torch, need.dtype)
    x = torch.zeros(need.numel, dtype=dtype, device=link.device)
    kind = PRICED_AS.get(need.kind, need.kind)
    n_out = {"all_gather": link.size * need.numel, "reduce_scatter": need.numel // link.size}.get(kind, need.numel)
    out = torch.empty(n_out, dtype=dtype, device=link.device)
    return lambda: link.run(need.kind, out, x)


def _time_collective(link: _Link, need: Need, warm: bool = False) -> tuple[float, int]:
    """Seconds of one collective of ``need``, the slowest rank's typical time (barrier before
    each run), and the runs it took. On a ``warm`` link (connections made) a first run longer
    than ``SLOW_S`` is the time: at that length one run's noise is small against it."""
    from overlapc.calibrate import _typical

    run = collective_fn(link, need)

    def once() -> float:
        link.barrier()
        t = time.perf_counter()
        run()
        if link.device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter() - t

    first = link.slowest(once())  # also the warm-up: connections, allocations
    if warm and first >= SLOW_S:
        return first, 1
    reps = REPS if first < SLOW_S else 1
    return link.slowest(_typical([once() for _ in range(reps)])), 1 + reps


def _cache_file(key: tuple):
    from overlapc.passes.cost import CACHE_DIR

    backend, ranks, hosts = key
    digest = hashlib.sha1(repr((ranks, hosts)).encode()).hexdigest()[:12]
    return CACHE_DIR / "live" / f"{backend}-w{len(ranks)}-{digest}.json"


def _load_disk(key: tuple) -> dict[Need, float]:
    path = _cache_file(key)
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        return {Need(k, d, int(n)): float(t) for k, d, n, t in data["times"]}
    except (ValueError, KeyError, TypeError) as e:
        warnings.warn(
            f"overlapc: ignoring the corrupt measurement cache {path} ({type(e).__name__}: {e}); "
            "the group is measured again",
            stacklevel=2,
        )
        return {}


def _save_disk(key: tuple, times: dict[Need, float]) -> None:
    """Write the group's cache file: ``times`` is everything to keep (what was read, and more)."""
    path = _cache_file(key)
    rows = [[n.kind, n.dtype, n.numel, t] for n, t in times.items()]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"backend": key[0], "ranks": list(key[1]), "hosts": list(key[2]), "times": rows}))
        tmp.replace(path)
    except OSError as e:  # a read-only home: the numbers still serve this process
        log.warning("overlapc: could not write the measurement cache %s: %s", path, e)
