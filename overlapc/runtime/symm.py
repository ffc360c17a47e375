"""Symmetric memory: every rank of a group holds a same-shaped buffer and signal pad that
every peer can address, through a table of pointers.

Layout (one per group, both backends)::

    rank r:  data[nbytes]                     peers' GEMM tiles / gathered chunks land here
             signal[n_flags + world + 1] int32 flags[...]   arrival flags, value = epoch of the call
                                               done[world]  done[p] = last epoch peer p finished reading
                                               abort[1]     non-zero: stop waiting, the call failed
    buffer_ptrs[world], signal_ptrs[world]     int64 addresses of every rank's data / signal, as
                                               mapped in *this* process (what kernels index)

Flags never reset: call k of a workspace raises flags to k (the *epoch*), and waiters wait
for ``flag >= k``. Every call is collective and calls run in the same order on every rank,
so epochs agree without communication.

Backends:

- CPU (``SymmetricMemory.cpu``): POSIX shared memory. Each rank creates a segment
  (``/dev/shm/overlapc-<job>-<group>-g<gen>-r<rank>``, mode 0600), publishes its name in the
  process group's store, maps every peer's, and once every rank has mapped every segment
  the names are unlinked: the memory lives on in the mappings, and nothing is left in
  /dev/shm when a rank dies later, even by SIGKILL. If the rendezvous fails, every rank
  unlinks every name of that rendezvous; an ``atexit`` hook unlinks what a process still
  owns. The same Triton kernels then run across real processes under ``TRITON_INTERPRET=1``.
- CUDA: not built yet. The kernels are the same; the multi-GPU workspace would come from
  torch's symmetric memory (``torch.distributed._symmetric_memory``), but no GPU world was
  available to test it, so ``cuda_supported`` says so and the planner does not fuse there.
"""
from __future__ import annotations

import atexit
import datetime
import mmap
import os
import threading
import time
import uuid
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from overlapc.errors import OverlapError

SHM_DIR = "/dev/shm"
PREFIX = "overlapc-"
_JOB = uuid.uuid4().hex[:12]
_OWNED: set[str] = set()  # names this process created and has not unlinked yet
_LOCK = threading.Lock()


def _unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass
    _OWNED.discard(name)


@atexit.register
def _unlink_owned() -> None:
    for name in list(_OWNED):
        _unlink(name)


def leaked_segments() -> list[str]:
    """Names of overlapc segments in /dev/shm (tests check that there are none)."""
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(PREFIX))
    except FileNotFoundError:
        return []


def cpu_supported(group) -> str | None:
    """None when ``group`` can use the CPU backend, else why not."""
    if not os.path.isdir(SHM_DIR):
        return f"no {SHM_DIR}: POSIX shared memory is not available"
    backend = dist.get_backend(group)
    if backend not in ("gloo", "fake"):
        return f"process group backend {backend!r}: CPU symmetric memory needs gloo"
    return None


def cuda_supported(group) -> str | None:
    return "the CUDA symmetric-memory workspace is not built yet (the kernels are; see overlapc/runtime/symm.py)"


@dataclass
class SymmetricMemory:
    group: object
    rank: int
    world: int
    nbytes: int
    n_signals: int
    buffers: list[torch.Tensor]          # uint8 [nbytes] per rank, as mapped here
    signals: list[torch.Tensor]          # int32 [n_signals] per rank, as mapped here
    buffer_ptrs: torch.Tensor            # int64 [world]
    signal_ptrs: torch.Tensor            # int64 [world]
    epoch: int = 0
    _keep: list = field(default_factory=list, repr=False)

    # ---------------------------------------------------------------- layout
    @property
    def n_flags(self) -> int:
        return self.n_signals - self.world - 1

    def flags(self, peer: int | None = None) -> torch.Tensor:
        return self.signals[self.rank if peer is None else peer][: self.n_flags]

    def done(self, peer: int | None = None) -> torch.Tensor:
        return self.signals[self.rank if peer is None else peer][self.n_flags: self.n_flags + self.world]

    def abort_word(self, peer: int | None = None) -> torch.Tensor:
        return self.signals[self.rank if peer is None else peer][-1:]

    def view(self, peer: int, shape, dtype: torch.dtype) -> torch.Tensor:
        """Rank ``peer``'s data buffer as a contiguous tensor of ``shape`` / ``dtype``."""
        n = 1
        for s in shape:
            n *= s
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        return self.buffers[peer][:nbytes].view(dtype).view(shape)

    # ---------------------------------------------------------------- protocol
    def next_epoch(self) -> int:
        self.epoch += 1
        return self.epoch

    def wait_done(self, epoch: int, deadline: float, op: str) -> None:
        """Before writing call ``epoch``'s data into peers' buffers: every peer has finished
        reading call ``epoch - 1`` out of its own."""
        done = self.done()
        while True:
            lag = [p for p in range(self.world) if int(done[p]) < epoch - 1]
            if not lag:
                return
            self.check_abort(op)
            if time.monotonic() > deadline:
                self.fail(op, f"ranks {lag} did not finish the previous call")
            time.sleep(0)

    def signal_done(self, epoch: int) -> None:
        """This rank has finished reading its buffer for call ``epoch``: tell every peer."""
        for p in range(self.world):
            self.done(p)[self.rank] = epoch

    def check_abort(self, op: str) -> None:
        if int(self.abort_word()[0]):
            raise OverlapError(f"{op}: aborted: a peer rank of group {_group_name(self.group)!r} failed this call")

    def fail(self, op: str, what: str) -> None:
        """Abort the call on every rank (peers stop waiting at once) and raise."""
        for p in range(self.world):
            self.abort_word(p)[0] = 1
        raise OverlapError(f"{op}: timed out on rank {self.rank} of group {_group_name(self.group)!r}: {what}")

    def close(self) -> None:
        self._keep.clear()
        self.buffers, self.signals = [], []


def _group_name(group) -> str:
    return getattr(group, "group_name", None) or "default"


# -------------------------------------------------------------------- CPU backend
_GEN: dict[str, int] = {}


def rendezvous_cpu(group, nbytes: int, n_flags: int, timeout: float = 60.0) -> SymmetricMemory:
    """Collective over ``group``: allocate and map a workspace on every rank."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    gname = _group_name(group)
    gen = _GEN[gname] = _GEN.get(gname, 0) + 1
    n_signals = n_flags + world + 1
    size = _round_up(nbytes, mmap.PAGESIZE) + _round_up(4 * n_signals, mmap.PAGESIZE)
    safe = "".join(c if c.isalnum() else "_" for c in gname)[:40]
    name = f"{PREFIX}{_JOB}-{safe}-g{gen}-r{rank}"
    store = dist.distributed_c10d._get_default_store()
    key = f"overlapc/symm/{gname}/{gen}"
    names = [None] * world
    with _LOCK:
        fd = os.open(os.path.join(SHM_DIR, name), os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
        _OWNED.add(name)
    try:
        os.ftruncate(fd, size)
        store.set(f"{key}/name/{rank}", name)
        maps: list[mmap.mmap] = []
        wait = datetime.timedelta(seconds=timeout)
        for p in range(world):
            if p == rank:
                names[p] = name
                maps.append(mmap.mmap(fd, size))
                continue
            store.wait([f"{key}/name/{p}"], wait)
            names[p] = store.get(f"{key}/name/{p}").decode()
            pfd = os.open(os.path.join(SHM_DIR, names[p]), os.O_RDWR)
            try:
                maps.append(mmap.mmap(pfd, size))
            finally:
                os.close(pfd)
        store.set(f"{key}/mapped/{rank}", "1")
        store.wait([f"{key}/mapped/{p}" for p in range(world)], wait)
    except Exception as e:
        for n in names:
            if n:
                _unlink(n)
        _unlink(name)
        raise OverlapError(f"symmetric memory rendezvous of group {gname!r} failed on rank {rank}: {e}") from e
    finally:
        os.close(fd)
    _unlink(name)  # every rank has mapped it: the memory lives on in the mappings
    data_bytes = _round_up(nbytes, mmap.PAGESIZE)
    raw = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
    buffers = [r[:data_bytes] for r in raw]
    signals = [r[data_bytes:data_bytes + 4 * n_signals].view(torch.int32) for r in raw]
    return SymmetricMemory(group, rank, world, data_bytes, n_signals, buffers, signals,
                           torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64),
                           torch.tensor([s.data_ptr() for s in signals], dtype=torch.int64),
                           _keep=[maps, raw])


# -------------------------------------------------------------------- workspaces
_WORKSPACES: dict[tuple[str, str], SymmetricMemory] = {}


def workspace(group, nbytes: int, n_flags: int, device: torch.device, timeout: float) -> SymmetricMemory:
    """The group's workspace, grown (collectively: every rank asks for the same sizes,
    because every rank runs the same call with the same shapes) when a call needs more."""
    key = (_group_name(group), device.type)
    ws = _WORKSPACES.get(key)
    if ws is not None and ws.nbytes >= nbytes and ws.n_flags >= n_flags:
        return ws
    if ws is not None:
        nbytes, n_flags = max(nbytes, ws.nbytes), max(n_flags, ws.n_flags)
    # Grow geometrically so a model with many shapes rendezvouses a few times, not per shape.
    nbytes, n_flags = _pow2(nbytes), _pow2(max(n_flags, 64))
    if device.type != "cpu":
        raise OverlapError(f"symmetric memory on {device.type}: {cuda_supported(group)}")
    new = rendezvous_cpu(group, nbytes, n_flags, timeout)
    if ws is not None:  # every rank is past the old workspace's last call: it is in this rendezvous
        ws.close()
    _WORKSPACES[key] = new
    return new


def discard(ws: SymmetricMemory) -> None:
    """Forget a workspace whose call failed (peers may be dead or mid-call)."""
    for k, v in list(_WORKSPACES.items()):
        if v is ws:
            del _WORKSPACES[k]


def release_all() -> None:
    for ws in _WORKSPACES.values():
        ws.close()
    _WORKSPACES.clear()


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())
