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

- CPU (``rendezvous_cpu``): POSIX shared memory. Each rank creates a segment
  (``/dev/shm/overlapc-<job>-<group>-g<gen>-r<rank>``, mode 0600), publishes its name in the
  process group's store, maps every peer's, and once every rank has mapped every segment
  the names are unlinked: the memory lives on in the mappings, and nothing is left in
  /dev/shm when a rank dies later, even by SIGKILL. If the rendezvous fails, every rank
  unlinks every name of that rendezvous; an ``atexit`` hook unlinks what a process still
  owns. The same Triton kernels then run across real processes under ``TRITON_INTERPRET=1``.
- CUDA (``rendezvous_cuda``): torch's symmetric memory
  (``torch.distributed._symmetric_memory``: ``empty`` + ``rendezvous`` over the group, nccl).
  One allocation per rank holds data and signal words in the same layout as the CPU
  backend (the signal words live in overlapc's own region, not in torch's fixed-size signal
  pad, which torch's own barriers use); every peer's region is mapped here through
  ``get_buffer``, and the pointer tables live on the device. Host writes to signal words
  (flags raised by the copy engine, done words, abort words) are copies from pinned host
  memory: they run on a copy engine, so they land even while a spinning kernel holds every
  SM (a fill kernel would queue behind it). The copy engine and the watchdog work on their
  own streams (``SymmetricMemory.on``). Run on one H100 as a one-rank group only
  (tests/gpu/checks.py's workspace stage: host-raised flags landed in a spinning grid;
  the abort did not end one, which the kernels' atomic read of the abort word is meant to
  fix, unverified there; docs/fused_kernels.md). No multi-GPU world has run it: the CPU tests
  run the same assembly through a stand-in for torch's handle.
"""

from __future__ import annotations

import atexit
import contextlib
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
    """None when ``group`` (None: any nccl group) can use the CUDA backend here, else why not."""
    if not torch.cuda.is_available():
        return "no CUDA device here: the CUDA symmetric-memory workspace needs one"
    try:
        from torch.distributed import _symmetric_memory as sm

        sm.empty, sm.rendezvous  # noqa: B018
    except (ImportError, AttributeError) as e:
        return f"torch {torch.__version__} has no symmetric memory ({e})"
    if group is not None and dist.get_backend(group) != "nccl":
        return f"process group backend {dist.get_backend(group)!r}: CUDA symmetric memory needs nccl"
    return None


def store_word(word: torch.Tensor, value: int) -> None:
    """Write ``value`` into signal word(s) ``word``, on the current stream. On a GPU: a copy
    from pinned host memory, which a copy engine runs, so it lands even while spinning
    kernels hold every SM (a fill kernel would queue behind them)."""
    if word.device.type == "cpu":
        word.fill_(value)
    else:
        word.copy_(torch.full(word.shape, value, dtype=word.dtype).pin_memory(), non_blocking=True)


@dataclass
class SymmetricMemory:
    group: object
    rank: int
    world: int
    nbytes: int
    n_signals: int
    buffers: list[torch.Tensor]  # uint8 [nbytes] per rank, as mapped here
    signals: list[torch.Tensor]  # int32 [n_signals] per rank, as mapped here
    buffer_ptrs: torch.Tensor  # int64 [world]
    signal_ptrs: torch.Tensor  # int64 [world]
    epoch: int = 0
    _keep: list = field(default_factory=list, repr=False)
    _streams: dict = field(default_factory=dict, repr=False)

    # ---------------------------------------------------------------- layout
    @property
    def n_flags(self) -> int:
        return self.n_signals - self.world - 1

    def flags(self, peer: int | None = None) -> torch.Tensor:
        return self.signals[self.rank if peer is None else peer][: self.n_flags]

    def done(self, peer: int | None = None) -> torch.Tensor:
        return self.signals[self.rank if peer is None else peer][self.n_flags : self.n_flags + self.world]

    def abort_word(self, peer: int | None = None) -> torch.Tensor:
        return self.signals[self.rank if peer is None else peer][-1:]

    def view(self, peer: int, shape, dtype: torch.dtype) -> torch.Tensor:
        """Rank ``peer``'s data buffer as a contiguous tensor of ``shape`` / ``dtype``."""
        n = 1
        for s in shape:
            n *= s
        nbytes = n * torch.empty((), dtype=dtype).element_size()
        return self.buffers[peer][:nbytes].view(dtype).view(shape)

    # ---------------------------------------------------------------- host access
    @property
    def device(self) -> torch.device:
        return self.signals[self.rank].device

    def store(self, word: torch.Tensor, value: int) -> None:
        """Write ``value`` into signal word(s) ``word`` (this rank's or a peer's): ``store_word``."""
        store_word(word, value)

    def _stream(self, name: str):
        if name not in self._streams:
            self._streams[name] = torch.cuda.Stream(self.device)
        return self._streams[name]

    def on(self, name: str):
        """Context: run on this workspace's stream ``name`` (a GPU; nothing to do on the CPU)."""
        if self.device.type == "cpu":
            return contextlib.nullcontext()
        return torch.cuda.stream(self._stream(name))

    def fork(self, name: str) -> None:
        """Stream ``name`` waits for the work queued so far on the current stream."""
        if self.device.type != "cpu":
            self._stream(name).wait_stream(torch.cuda.current_stream(self.device))

    def join(self, name: str) -> None:
        """The current stream waits for what stream ``name`` has queued."""
        if self.device.type != "cpu" and name in self._streams:
            torch.cuda.current_stream(self.device).wait_stream(self._streams[name])

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
            self.store(self.done(p)[self.rank : self.rank + 1], epoch)

    def check_abort(self, op: str) -> None:
        if int(self.abort_word()[0]):
            raise OverlapError(f"{op}: aborted: a peer rank of group {_group_name(self.group)!r} failed this call")

    def fail(self, op: str, what: str) -> None:
        """Abort the call on every rank (peers stop waiting at once) and raise."""
        for p in range(self.world):
            self.abort(p)
        raise OverlapError(f"{op}: timed out on rank {self.rank} of group {_group_name(self.group)!r}: {what}")

    def abort(self, peer: int | None = None) -> None:
        """Raise the abort word of ``peer`` (default: this rank), on the abort stream."""
        with self.on("abort"):
            self.store(self.abort_word(peer), 1)

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
    raw = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
    return _assemble(group, rank, world, raw, _round_up(nbytes, mmap.PAGESIZE), n_signals, keep=[maps, raw])


def _assemble(
    group, rank: int, world: int, raw: list[torch.Tensor], data_bytes: int, n_signals: int, keep: list
) -> SymmetricMemory:
    """The workspace over every rank's region as mapped here (``raw[p]``: uint8, data bytes
    then the signal words): the one layout of both backends."""
    buffers = [r[:data_bytes] for r in raw]
    signals = [r[data_bytes : data_bytes + 4 * n_signals].view(torch.int32) for r in raw]
    dev = raw[rank].device
    return SymmetricMemory(
        group,
        rank,
        world,
        data_bytes,
        n_signals,
        buffers,
        signals,
        torch.tensor([b.data_ptr() for b in buffers], dtype=torch.int64, device=dev),
        torch.tensor([s.data_ptr() for s in signals], dtype=torch.int64, device=dev),
        _keep=keep,
    )


# -------------------------------------------------------------------- CUDA backend
def rendezvous_cuda(group, nbytes: int, n_flags: int, device: torch.device, sm=None) -> SymmetricMemory:
    """Collective over ``group``: one region per rank from torch's symmetric memory (``sm``:
    ``torch.distributed._symmetric_memory``, or a stand-in with its ``empty`` /
    ``rendezvous`` / ``get_buffer`` / ``barrier`` in tests), signal words zeroed on every rank
    before any rank can raise one."""
    if sm is None:
        from torch.distributed import _symmetric_memory as sm
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    gname = _group_name(group)
    n_signals = n_flags + world + 1
    data_bytes = _round_up(nbytes, 256)
    total = data_bytes + _round_up(4 * n_signals, 256)
    try:
        local = sm.empty(total, dtype=torch.uint8, device=device)
        local[data_bytes:].zero_()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        handle = sm.rendezvous(local, gname)
        raw = [handle.get_buffer(p, (total,), torch.uint8, 0) for p in range(world)]
        handle.barrier()  # every rank's signal words are zero before any rank can raise one
    except Exception as e:
        raise OverlapError(f"symmetric memory rendezvous of group {gname!r} failed on rank {rank}: {e}") from e
    return _assemble(group, rank, world, raw, data_bytes, n_signals, keep=[local, handle, raw])


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
    if device.type == "cpu":
        new = rendezvous_cpu(group, nbytes, n_flags, timeout)
    else:
        why = cuda_supported(group) if device.type == "cuda" else f"no symmetric-memory backend for {device.type}"
        if why:
            raise OverlapError(f"symmetric memory on {device}: {why}")
        new = rendezvous_cuda(group, nbytes, n_flags, device)
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
