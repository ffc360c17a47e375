"""Fused AllGather+GEMM and GEMM+ReduceScatter over symmetric memory, as custom ops.

``torch.ops.overlapc.fused_all_gather_matmul(a, bs, gather_dim, group_name, chunks, timeout,
return_a) -> [gathered, *outs]``: ``outs[i] = all_gather(a, gather_dim) @ bs[i]``, and the
gathered tensor itself when ``return_a`` (else an empty tensor).

``torch.ops.overlapc.fused_matmul_reduce_scatter(a, b, scatter_dim, group_name, timeout)``:
``reduce_scatter(a @ b, "sum", scatter_dim)``.

Each has a fake implementation (shapes only), so compiled graphs and inductor treat a
call as one op. One call, on every rank (the call is collective)::

    AG+GEMM   e = next epoch
              copy engine (a side thread; a side stream on a GPU): for chunk c, for peer p
                  (local first): shard rows of chunk c -> slot RANK of p's buffer; flag
              consumer GEMM (main thread): tiles rank-rotated, each waits on its rows' flags
              done(e) -> every peer
    GEMM+RS   e = next epoch; wait until every peer is done with e - 1
              producer GEMM: tiles of the next rank first, each into slot RANK of its
                  owner's buffer, then the owner's flag
              consumer: per local tile, wait on each source's flag, sum sources in rank order
              done(e) -> every peer

A watchdog raises this rank's abort word after ``timeout`` seconds; the waiting kernel
stops, and the call raises an ``OverlapError`` naming the op, the rank and what had not
arrived, after raising every peer's abort word so that they stop too.

Below ``min_flops`` (the size where fusion cannot pay: per-call rendezvous of flags, a
launch per consumer, and, under the Triton interpreter, nothing to gain at all) the op
runs the plain ops instead: ``all_gather_into_tensor`` + ``mm``, ``mm`` +
``reduce_scatter_tensor``. The default is 0 on the CPU (the interpreter is there to test the
fused path) and ``GPU_MIN_FLOPS`` elsewhere.
"""

from __future__ import annotations

import math
import threading
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from overlapc.errors import OverlapError

from . import symm

GPU_MIN_FLOPS = 1 << 34  # ~17 GFLOP: ~25 us of an H100's bf16 peak, where a chunk pipeline has nothing to hide
AG_OP = "overlapc::fused_all_gather_matmul"
RS_OP = "overlapc::fused_matmul_reduce_scatter"
calls = {"fused": 0, "fallback": 0}  # per process, what ran (tests check the fused path ran)


def _group(group_name: str):
    return dist.distributed_c10d._resolve_process_group(group_name)


def _rows(shape, dim: int) -> tuple[int, int, int]:
    """(rows, outer, inner) of a tensor whose dims before the last are rows, for a gather or
    scatter on ``dim``: rows = outer * dim_size * inner_rest."""
    lead = list(shape[:-1])
    outer = math.prod(lead[:dim])
    return math.prod(lead), outer, math.prod(lead[dim:])


def _check_dim(op: str, x: torch.Tensor, dim: int, what: str) -> int:
    if x.dim() < 2:
        raise OverlapError(f"{op}: the {what} operand must have at least 2 dims, got shape {tuple(x.shape)}")
    d = dim % x.dim()
    if d == x.dim() - 1:
        raise OverlapError(
            f"{op}: {what} on the last dim (the contraction dim) is not fused; "
            f"allowed: dims 0..{x.dim() - 2} of shape {tuple(x.shape)}"
        )
    return d


def _min_flops(device: torch.device, min_flops: int | None) -> int:
    if min_flops is not None:
        return min_flops
    return 0 if device.type == "cpu" else GPU_MIN_FLOPS


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


class Watchdog:
    """Raises the abort word of ``ws`` (this rank) when ``timeout`` seconds pass, unless
    ``stop`` comes first; ``fired`` says whether it did. Each fused call runs one."""

    def __init__(self, ws: symm.SymmetricMemory, timeout: float):
        self.fired = False

        def fire():
            self.fired = True
            ws.abort()

        self.deadline = time.monotonic() + timeout
        self._t = threading.Timer(timeout, fire)
        self._t.daemon = True
        self._t.start()

    def stop(self):
        self._t.cancel()


def _finish(ws: symm.SymmetricMemory, dog: Watchdog, op: str, epoch: int, missing) -> None:
    """After the kernels: raise if the call was aborted (by this rank's watchdog or a peer)."""
    dog.stop()
    if not int(ws.abort_word()[0]):
        return
    symm.discard(ws)  # its peers' state is unknown now: the next call rendezvouses afresh
    if dog.fired:
        ws.fail(op, missing())
    ws.check_abort(op)


_TUNED: dict[tuple, dict] = {}  # (kernel, M, N, K, dtype, device type) -> block sizes
_CONFIG_KEYS = ("BLOCK_M", "BLOCK_N", "BLOCK_K", "GROUP_M", "num_warps", "num_stages")


def pin_config(kind: str, M: int, N: int, K: int, dtype: torch.dtype, device, cfg: dict) -> None:
    """Launch kernel ``kind`` with block sizes ``cfg`` (a ``kernels.gemm.configs`` entry) on an
    M x N x K problem instead of timing the candidates on its first call. ``kind`` "ag": the AG
    consumer, M = the gathered rows; "rs": the RS producer, M = the rows each rank owns. For
    checks of the ops' handshake: the tuner times local scratch only, and for "rs" it adds
    an all-reduce of the ranks' times. Where ``configs`` offers one candidate, that one runs."""
    if kind not in ("ag", "rs"):
        raise ValueError(f"pin_config: kind must be 'ag' or 'rs', got {kind!r}")
    missing = [k for k in _CONFIG_KEYS if k not in cfg]
    if missing:
        raise ValueError(f"pin_config: cfg lacks {missing} (it needs {list(_CONFIG_KEYS)})")
    _TUNED[(kind, M, N, K, dtype, torch.device(device).type)] = dict(cfg)


def _launch_config(kind: str, M: int, N: int, K: int, dtype: torch.dtype, device: torch.device, group=None):
    """(block sizes, interpreting?, number of output tiles) of an M x N x K tile grid of
    kernel ``kind`` ("ag": the AG consumer, "rs": the RS producer over ``world`` owners)."""
    import triton

    from overlapc.kernels import INTERPRET, interpreter_problem
    from overlapc.kernels.gemm import configs

    why = interpreter_problem()
    if why:
        raise OverlapError(f"fused {kind} kernel: {why}")
    cands = configs(M, N, K)
    cfg = dict(cands[0])
    if len(cands) > 1:
        key = (kind, M, N, K, dtype, device.type)
        if key not in _TUNED:
            _TUNED[key] = _autotune(kind, cands, M, N, K, dtype, device, group)
        cfg = dict(_TUNED[key])
    return cfg, INTERPRET, triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"])


def _autotune(kind: str, cands: list[dict], M: int, N: int, K: int, dtype, device, group) -> dict:
    """The fastest of ``cands`` for this shape, timed on local scratch (the same kernel as a
    plain GEMM: one rank, one chunk, flags already up; nothing crosses ranks). For the RS
    producer every rank must tile alike (flags are per tile, and the owner's consumer walks
    its own tiles), so the ranks' times are summed (an all-reduce) before the pick."""
    from overlapc.kernels import INTERPRET, tl_dtype
    from overlapc.kernels.gemm import ag_gemm_consumer, gemm_rs_producer

    world = 1 if group is None else dist.get_world_size(group)
    rows = M if kind == "ag" else world * M  # the RS producer computes every owner's rows
    a = torch.randn(rows, K, dtype=dtype, device=device)
    b = torch.randn(K, N, dtype=dtype, device=device)
    out = torch.empty(rows, N, dtype=dtype, device=device)
    tiles = [-(-rows // c["BLOCK_M"]) * -(-N // c["BLOCK_N"]) for c in cands]
    flags = torch.ones(max(tiles), dtype=torch.int32, device=device)  # up at epoch 1
    abort = torch.zeros(1, dtype=torch.int32, device=device)
    table = lambda t: torch.tensor([t.data_ptr()], dtype=torch.int64, device=device)  # noqa: E731
    bufs, sigs = table(out), table(flags)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def launch(cfg, tiles):
        if kind == "ag":
            ag_gemm_consumer[(tiles,)](
                a,
                b,
                out,
                flags,
                abort,
                rows,
                N,
                K,
                1,
                0,
                1,
                rows,
                1,
                1,
                b.stride(0),
                b.stride(1),
                out.stride(0),
                out.stride(1),
                UPCAST=INTERPRET,
                PRECISION=_precision(dtype),
                **cfg,
            )
        else:
            gemm_rs_producer[(tiles,)](
                a,
                b,
                bufs,
                sigs,
                rows,
                N,
                K,
                1,
                0,
                1,
                1,
                a.stride(0),
                a.stride(1),
                b.stride(0),
                b.stride(1),
                UPCAST=INTERPRET,
                PRECISION=_precision(dtype),
                OUT_DTYPE=tl_dtype(dtype),
                **cfg,
            )

    from overlapc.calibrate import median_seconds

    times = [median_seconds(lambda c=cfg, n=n: (launch(c, n), sync()), 3) for cfg, n in zip(cands, tiles)]
    if kind == "rs" and world > 1:
        t = funcol.all_reduce(torch.tensor(times, dtype=torch.float64, device=device), "sum", group)
        times = (funcol.wait_tensor(t) if isinstance(t, funcol.AsyncCollectiveTensor) else t).tolist()
    return cands[min(range(len(cands)), key=times.__getitem__)]


# ------------------------------------------------------------------ AllGather + GEMM
def all_gather_matmul(
    a: torch.Tensor,
    bs: list[torch.Tensor],
    gather_dim: int,
    group_name: str,
    chunks: int = 4,
    timeout: float = 300.0,
    return_a: bool = False,
    min_flops: int | None = None,
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    op = AG_OP
    d = _check_dim(op, a, gather_dim, "gathered")
    group = _group(group_name)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    K = a.shape[-1]
    for b in bs:
        if b.dim() != 2 or b.shape[0] != K or b.dtype != a.dtype:
            raise OverlapError(f"{op}: every b must be [K={K}, N] of dtype {a.dtype}, got {tuple(b.shape)} {b.dtype}")
    if chunks < 1:
        raise OverlapError(f"{op}: chunks must be >= 1, got {chunks}")
    M_L, outer, inner = _rows(a.shape, d)
    gshape = list(a.shape)
    gshape[d] *= world
    flops = 2 * world * M_L * K * sum(b.shape[1] for b in bs)
    if world == 1 or flops < _min_flops(a.device, min_flops) or M_L == 0:
        calls["fallback"] += 1
        g = funcol.all_gather_tensor(a.contiguous(), d, group)
        g = funcol.wait_tensor(g) if isinstance(g, funcol.AsyncCollectiveTensor) else g
        outs = [torch.matmul(g, b) for b in bs]
        return (g if return_a else a.new_empty(0)), outs
    calls["fused"] += 1
    chunks = min(chunks, M_L)
    chunk_rows = -(-M_L // chunks)
    chunks = -(-M_L // chunk_rows)
    esize = a.element_size()
    ws = symm.workspace(group, world * M_L * K * esize, world * chunks, a.device, timeout)
    epoch = ws.next_epoch()
    dog = Watchdog(ws, timeout)
    shard = a.contiguous().view(M_L, K)

    # Copy engine: rank-rotated peers, chunk-major (every peer's chunk 0 goes out first). On a
    # GPU it queues copies and flag stores on its own stream, after the work that made ``a``.
    error: list[BaseException] = []
    ws.fork("copy")

    def produce():
        try:
            with ws.on("copy"):
                peers = [(rank + i) % world for i in range(world)]
                ready = set()
                for c in range(chunks):
                    r0, r1 = c * chunk_rows, min(M_L, (c + 1) * chunk_rows)
                    for p in peers:
                        if p not in ready:  # p has finished reading the previous call from its buffer
                            while int(ws.done()[p]) < epoch - 1:
                                if int(ws.abort_word()[0]):
                                    return
                                time.sleep(0)
                            ready.add(p)
                        ws.view(p, (world, M_L, K), a.dtype)[rank, r0:r1].copy_(shard[r0:r1])
                        ws.store(ws.flags(p)[rank * chunks + c : rank * chunks + c + 1], epoch)
        except BaseException as e:  # surfaced on the calling thread
            error.append(e)

    producer = threading.Thread(target=produce, name="overlapc-ag-producer", daemon=True)
    producer.start()

    from overlapc.kernels.gemm import ag_gemm_consumer

    buf = ws.view(rank, (world * M_L, K), a.dtype)
    outs = []
    for b in bs:
        N = b.shape[1]
        out = torch.empty(world * M_L, N, dtype=a.dtype, device=a.device)
        cfg, interpret, tiles = _launch_config("ag", world * M_L, N, K, a.dtype, a.device)
        ag_gemm_consumer[(tiles,)](
            buf,
            b,
            out,
            ws.flags(),
            ws.abort_word(),
            M_L,
            N,
            K,
            world,
            rank,
            chunks,
            chunk_rows,
            inner,
            epoch,
            b.stride(0),
            b.stride(1),
            out.stride(0),
            out.stride(1),
            UPCAST=interpret,
            PRECISION=_precision(a.dtype),
            **cfg,
        )
        outs.append(out.view(*gshape[:-1], N))
        if int(ws.abort_word()[0]):
            break
    gathered = a.new_empty(0)
    if return_a and not int(ws.abort_word()[0]):
        # Slot-major [world, outer, inner, K] -> the gathered layout [outer, world, inner, K],
        # always a copy: the buffer is the peers' to overwrite in the next call.
        gathered = torch.empty(gshape, dtype=a.dtype, device=a.device)
        gathered.view(outer, world, inner, K).copy_(buf.view(world, outer, inner, K).transpose(0, 1))
    producer.join(timeout=max(0.0, dog.deadline - time.monotonic()) + 1.0)
    ws.join("copy")

    def missing():
        flags = ws.flags()[: world * chunks].view(world, chunks)
        late = [(s, c) for s in range(world) for c in range(chunks) if int(flags[s, c]) < epoch]
        return (
            f"waited {timeout:.0f} s for gathered chunks (source rank, chunk) {late[:8]}"
            f"{' ...' if len(late) > 8 else ''} of call {epoch}"
        )

    _finish(ws, dog, op, epoch, missing)
    if error:
        raise OverlapError(f"{op}: the copy engine failed on rank {rank}: {error[0]}") from error[0]
    ws.signal_done(epoch)
    return gathered, outs


# ------------------------------------------------------------------ GEMM + ReduceScatter
def matmul_reduce_scatter(
    a: torch.Tensor,
    b: torch.Tensor,
    scatter_dim: int,
    group_name: str,
    timeout: float = 300.0,
    min_flops: int | None = None,
) -> torch.Tensor:
    op = RS_OP
    d = _check_dim(op, a, scatter_dim, "scattered")
    group = _group(group_name)
    world, rank = dist.get_world_size(group), dist.get_rank(group)
    K = a.shape[-1]
    if b.dim() != 2 or b.shape[0] != K or b.dtype != a.dtype:
        raise OverlapError(f"{op}: b must be [K={K}, N] of dtype {a.dtype}, got {tuple(b.shape)} {b.dtype}")
    if a.shape[d] % world:
        raise OverlapError(f"{op}: dim {d} of shape {tuple(a.shape)} is not divisible by the world size {world}")
    N = b.shape[1]
    M, outer, inner_all = _rows(a.shape, d)
    oshape = list(a.shape[:-1]) + [N]
    oshape[d] //= world
    if world == 1 or 2 * M * N * K < _min_flops(a.device, min_flops) or M == 0:
        calls["fallback"] += 1
        y = torch.matmul(a, b)
        out = funcol.reduce_scatter_tensor(y.contiguous(), "sum", d, group)
        return funcol.wait_tensor(out) if isinstance(out, funcol.AsyncCollectiveTensor) else out
    calls["fused"] += 1
    M_O, inner = M // world, inner_all // world
    a2 = a.reshape(M, K)
    cfg, interpret, tiles = _launch_config("rs", M_O, N, K, a.dtype, a.device, group)
    ws = symm.workspace(group, world * M_O * N * a.element_size(), world * tiles, a.device, timeout)
    epoch = ws.next_epoch()
    dog = Watchdog(ws, timeout)
    try:
        ws.wait_done(epoch, dog.deadline, op)  # peers have read the previous call out of their buffers
    except OverlapError:
        dog.stop()
        symm.discard(ws)
        raise

    from overlapc.kernels import tl_dtype
    from overlapc.kernels.gemm import gemm_rs_producer, rs_reduce_consumer

    gemm_rs_producer[(world * tiles,)](
        a2,
        b,
        ws.buffer_ptrs,
        ws.signal_ptrs,
        M_O,
        N,
        K,
        world,
        rank,
        inner,
        epoch,
        a2.stride(0),
        a2.stride(1),
        b.stride(0),
        b.stride(1),
        UPCAST=interpret,
        PRECISION=_precision(a.dtype),
        OUT_DTYPE=tl_dtype(a.dtype),
        **cfg,
    )
    out = torch.empty(M_O, N, dtype=a.dtype, device=a.device)
    rs_reduce_consumer[(tiles,)](
        ws.view(rank, (world * M_O, N), a.dtype),
        out,
        ws.flags(),
        ws.abort_word(),
        M_O,
        N,
        world,
        epoch,
        out.stride(0),
        out.stride(1),
        BLOCK_M=cfg["BLOCK_M"],
        BLOCK_N=cfg["BLOCK_N"],
        GROUP_M=cfg["GROUP_M"],
        UPCAST=interpret,
    )

    def missing():
        flags = ws.flags()[: world * tiles].view(world, tiles)
        late = [s for s in range(world) if bool((flags[s] < epoch).any())]
        return f"waited {timeout:.0f} s for the partial tiles of source ranks {late} of call {epoch}"

    _finish(ws, dog, op, epoch, missing)
    ws.signal_done(epoch)
    return out.view(oshape)


# ------------------------------------------------------------------ torch.library ops
_lib = torch.library.Library("overlapc", "FRAGMENT")
_lib.define(
    "fused_all_gather_matmul(Tensor a, Tensor[] bs, int gather_dim, str group_name, int chunks, "
    "float timeout, bool return_a) -> Tensor[]"
)
_lib.define("fused_matmul_reduce_scatter(Tensor a, Tensor b, int scatter_dim, str group_name, float timeout) -> Tensor")


def _ag_impl(a, bs, gather_dim, group_name, chunks, timeout, return_a):
    g, outs = all_gather_matmul(a, list(bs), gather_dim, group_name, chunks, timeout, return_a)
    return [g, *outs]


def _ag_fake(a, bs, gather_dim, group_name, chunks, timeout, return_a):
    world = dist.get_world_size(_group(group_name))
    d = gather_dim % a.dim()
    gshape = list(a.shape)
    gshape[d] = gshape[d] * world
    outs = [a.new_empty(gshape[:-1] + [b.shape[1]]) for b in bs]
    return [a.new_empty(gshape) if return_a else a.new_empty(0), *outs]


def _rs_impl(a, b, scatter_dim, group_name, timeout):
    return matmul_reduce_scatter(a, b, scatter_dim, group_name, timeout)


def _rs_fake(a, b, scatter_dim, group_name, timeout):
    world = dist.get_world_size(_group(group_name))
    d = scatter_dim % a.dim()
    shape = list(a.shape[:-1]) + [b.shape[1]]
    shape[d] = shape[d] // world
    return a.new_empty(shape)


for _dev in ("CPU", "CUDA"):
    _lib.impl("fused_all_gather_matmul", _ag_impl, _dev)
    _lib.impl("fused_matmul_reduce_scatter", _rs_impl, _dev)
torch.library.register_fake("overlapc::fused_all_gather_matmul", _ag_fake, lib=_lib)
torch.library.register_fake("overlapc::fused_matmul_reduce_scatter", _rs_fake, lib=_lib)
