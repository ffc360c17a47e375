"""The two fused GEMM kernels and their launch configurations.

Both compute ``C = A @ B`` tile by tile with grouped tile ordering (``GROUP_M`` row tiles
share B's column tiles while they are hot in L2) and fp32 accumulation, and differ in
where rows come from / go to:

``ag_gemm_consumer``: A is the gathered buffer ``[world * M_L, K]`` (rank-major, one slot
per source rank), filled by a producer that raises flag ``src * CHUNKS + c`` when rows
``[c * CHUNK_ROWS, (c + 1) * CHUNK_ROWS)`` of slot ``src`` have landed. Tiles are walked
rank-rotated (the local slot first, then the next rank's, ...), and a tile waits on the
flags of exactly the rows it covers before loading A. Output row remap (``INNER``): buffer
row ``src * M_L + o * INNER + i`` is output row ``o * world * INNER + src * INNER + i``, so a
gather on an inner dim (``[B, S/world, K]`` gathered on dim 1) comes out in its own layout.

``gemm_rs_producer``: the grid walks (owner, local row tile, column tile) with owners in
rank-rotated order starting at the next rank (its tiles leave first, the local ones last);
local row ``j`` of owner ``w`` is row ``(j // INNER) * world * INNER + w * INNER + j % INNER``
of C (the scatter layout), and the finished tile goes to slot ``RANK`` of owner ``w``'s
buffer, followed by a release of flag ``RANK * TILES + tile`` in owner ``w``'s signal pad.
``rs_reduce_consumer`` then sums, per local tile, the slots of every source in rank order
(the same order on every rank) once their flags are up.

Waits spin on the flag and on this rank's abort word: a host watchdog raises the abort
word when the call's timeout passes, so a dead peer ends the kernel instead of hanging it.
Under the interpreter the programs of a grid run one after another in one thread, so a
kernel waits only on producers in another thread (the AG copy engine) or another process.
(overlapc/kernels/__init__.py makes Triton's standard library interpretable when it was
imported before ``TRITON_INTERPRET`` was set.)
"""

from __future__ import annotations

import triton
import triton.language as tl

from . import INTERPRET


@triton.jit
def _wait_flag(flag_ptr, abort_ptr, epoch):
    # Acquire: the data the flag guards is visible once the flag is seen. The abort word is
    # read with an atomic too: on an H100 (Triton 3.6) a grid spinning on a volatile load of
    # it never saw the host raise it, while atomic reads of the flags saw theirs land.
    v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
    ab = tl.atomic_add(abort_ptr, 0, sem="relaxed", scope="sys")
    while (v < epoch) & (ab == 0):
        v = tl.atomic_add(flag_ptr, 0, sem="acquire", scope="sys")
        ab = tl.atomic_add(abort_ptr, 0, sem="relaxed", scope="sys")


@triton.jit
def _downcast(x, DTYPE: tl.constexpr, UPCAST: tl.constexpr):
    # fp32 -> DTYPE, round to nearest even. The interpreter truncates fp32 -> bf16 (1 ulp off
    # torch); there, round by hand on the bits.
    if UPCAST and DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = bits + 0x7FFF + ((bits >> 16) & 1)
        bits = tl.where(x != x, bits, rounded)  # NaN stays NaN
        return (bits >> 16).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(DTYPE)


@triton.jit
def _tile_ids(pid, num_pid_m, num_pid_n, GROUP_M: tl.constexpr):
    # Grouped ordering: GROUP_M row tiles walk the column tiles together.
    num_pid_in_group = GROUP_M * num_pid_n
    group_id = pid // num_pid_in_group
    first_pid_m = group_id * GROUP_M
    group_size_m = tl.minimum(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + ((pid % num_pid_in_group) % group_size_m)
    pid_n = (pid % num_pid_in_group) // group_size_m
    return pid_m, pid_n


@triton.jit
def ag_gemm_consumer(
    # pointers
    a_ptr,
    b_ptr,
    c_ptr,
    flag_ptr,
    abort_ptr,
    # sizes
    M_L,
    N,
    K,
    WORLD,
    RANK,
    CHUNKS,
    CHUNK_ROWS,
    INNER,
    EPOCH,
    # strides (A is the contiguous buffer: row stride K)
    stride_bk,
    stride_bn,
    stride_cm,
    stride_cn,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
):
    M = WORLD * M_L
    num_pid_m = (M + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    pid_m, pid_n = _tile_ids(tl.program_id(0), num_pid_m, num_pid_n, GROUP_M)
    # Rank rotation: start at the tile holding this rank's first row.
    pid_m = (pid_m + (RANK * M_L) // BLOCK_M) % num_pid_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = rm < M
    mask_n = rn < N

    # Wait for every chunk this tile's rows fall in (flags are monotone in the row index).
    first = pid_m * BLOCK_M
    last = tl.minimum(first + BLOCK_M, M) - 1
    f0 = (first // M_L) * CHUNKS + (first % M_L) // CHUNK_ROWS
    f1 = (last // M_L) * CHUNKS + (last % M_L) // CHUNK_ROWS
    for f in range(f0, f1 + 1):
        _wait_flag(flag_ptr + f, abort_ptr, EPOCH)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    rm64 = rm.to(tl.int64)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mask_k = rk < K
        a = tl.load(a_ptr + rm64[:, None] * K + rk[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(
            b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn, mask=mask_k[:, None] & mask_n[None, :], other=0.0
        )
        if UPCAST:  # the interpreter's dot has no bf16
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)

    src = rm // M_L
    j = rm % M_L
    out_row = (j // INNER) * (WORLD * INNER) + src * INNER + j % INNER
    c = c_ptr + out_row.to(tl.int64)[:, None] * stride_cm + rn[None, :] * stride_cn
    tl.store(c, _downcast(acc, c_ptr.dtype.element_ty, UPCAST), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def gemm_rs_producer(
    # pointers
    a_ptr,
    b_ptr,
    buf_table_ptr,
    sig_table_ptr,
    # sizes
    M_O,
    N,
    K,
    WORLD,
    RANK,
    INNER,
    EPOCH,
    # strides
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
    PRECISION: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):
    num_pid_m = (M_O + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    tiles = num_pid_m * num_pid_n
    pid = tl.program_id(0)
    owner = (RANK + 1 + pid // tiles) % WORLD  # the next rank's tiles first, the local ones last
    tile = pid % tiles
    pid_m, pid_n = _tile_ids(tile, num_pid_m, num_pid_n, GROUP_M)

    j = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # owner-local rows
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = j < M_O
    mask_n = rn < N
    row = ((j // INNER) * (WORLD * INNER) + owner * INNER + j % INNER).to(tl.int64)

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        rk = k0 + tl.arange(0, BLOCK_K)
        mask_k = rk < K
        a = tl.load(
            a_ptr + row[:, None] * stride_am + rk[None, :] * stride_ak,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        b = tl.load(
            b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn, mask=mask_k[:, None] & mask_n[None, :], other=0.0
        )
        if UPCAST:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=PRECISION)

    # Slot RANK of the owner's buffer: [WORLD, M_O, N], contiguous.
    dst = tl.load(buf_table_ptr + owner).to(tl.pointer_type(OUT_DTYPE))
    offs = (RANK * M_O + j).to(tl.int64)[:, None] * N + rn[None, :]
    tl.store(dst + offs, _downcast(acc, OUT_DTYPE, UPCAST), mask=mask_m[:, None] & mask_n[None, :])
    sig = tl.load(sig_table_ptr + owner).to(tl.pointer_type(tl.int32))
    tl.atomic_xchg(sig + RANK * tiles + tile, EPOCH, sem="release", scope="sys")


@triton.jit
def rs_reduce_consumer(
    # pointers
    buf_ptr,
    out_ptr,
    flag_ptr,
    abort_ptr,
    # sizes
    M_O,
    N,
    WORLD,
    EPOCH,
    # strides
    stride_om,
    stride_on,
    # meta-parameters
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    GROUP_M: tl.constexpr,
    UPCAST: tl.constexpr,
):
    num_pid_m = (M_O + BLOCK_M - 1) // BLOCK_M
    num_pid_n = (N + BLOCK_N - 1) // BLOCK_N
    tiles = num_pid_m * num_pid_n
    tile = tl.program_id(0)
    pid_m, pid_n = _tile_ids(tile, num_pid_m, num_pid_n, GROUP_M)
    j = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = (j < M_O)[:, None] & (rn < N)[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for src in range(0, WORLD):  # rank order: the same summation order on every rank
        _wait_flag(flag_ptr + src * tiles + tile, abort_ptr, EPOCH)
        offs = (src * M_O + j).to(tl.int64)[:, None] * N + rn[None, :]
        acc += tl.load(buf_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(
        out_ptr + j.to(tl.int64)[:, None] * stride_om + rn[None, :] * stride_on,
        _downcast(acc, out_ptr.dtype.element_ty, UPCAST),
        mask=mask,
    )


# ------------------------------------------------------------------ configurations
def configs(M: int, N: int, K: int) -> list[dict]:
    """Candidate block sizes, keyed on the problem (the GPU autotuner times them)."""
    if INTERPRET:  # the interpreter runs numpy per tile: few, mid-sized tiles are fastest
        return [dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=4, num_warps=4, num_stages=1)]
    out = []
    for bm, bn, bk, w, s in [
        (128, 256, 64, 8, 3),
        (256, 128, 64, 8, 3),
        (128, 128, 64, 4, 4),
        (128, 128, 32, 4, 4),
        (128, 64, 64, 4, 4),
        (64, 128, 64, 4, 4),
        (64, 64, 64, 4, 4),
    ]:
        if bm <= max(16, triton.next_power_of_2(M)) * 2 and bn <= max(16, triton.next_power_of_2(N)) * 2:
            out.append(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8, num_warps=w, num_stages=s))
    return out or [dict(BLOCK_M=64, BLOCK_N=64, BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=2)]
