"""GPU check of the fused kernels on one device, peers emulated as separate buffers.

    python -m benchmarks.gpu_check --stage workspace   # on a CUDA machine, one part per process:
    python -m benchmarks.gpu_check --stage pipe        #   a kernel that never returns wedges the
    python -m benchmarks.gpu_check --stage ag          #   GPU context, so a hang in one part
    python -m benchmarks.gpu_check --stage rs          #   must not cost the others (~30 s each)
    python -m benchmarks.gpu_check --smoke             # anywhere, every part (CPU: interpreter, tiny shapes)

Parts (``--stage``; ``all``, the default, runs them in one process):

- ``rs``: GEMM+ReduceScatter. Rank 0's producer (``gemm_rs_producer``) writes its tiles into
  ``world`` separate "owner" buffers (pointer tables) and raises their flags; the other
  sources' partials of rank 0's rows are pre-filled with their flags up, so the consumer
  (``rs_reduce_consumer``) reduces ``world`` partials. Numerics against the sum of partial
  GEMMs; TFLOP/s of the producer against torch.mm of the same shape (target >= 90%).
- ``ag``: AllGather+GEMM consumer (``ag_gemm_consumer``) with every chunk's flag up (the
  GEMM alone): numerics against ``torch.cat(shards) @ B``, TFLOP/s against torch.mm.
- ``pipe``: the same consumer while a producer on a side stream fills the gathered buffer
  chunk by chunk (device-to-device copies, each followed by its flag, stored as the op
  stores them: a pinned copy); a watchdog raises the abort word if it starves.
- ``workspace``: overlapc's symmetric-memory workspace on a one-rank group (torch's
  symmetric memory on a GPU), see ``workspace_check``.
- ``ops``: the fused ops themselves between processes, one GPU each (skipped with fewer).

Every M x N x K: M = world * M_L gathered rows, K, N = the local slice of a column-parallel
weight, bf16 LLM shapes. Block sizes: every candidate of ``overlapc.kernels.gemm.configs``
is timed per shape and the best kept. Prints a table and writes JSON to ``--out``
(default: gpu_check.json). Measured on one H100: BENCHMARKS.md, "Fused kernels on one H100".
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def _bench(fn, reps: int) -> float:
    """Median seconds of ``fn``. On a GPU: device time between CUDA events over back-to-back
    calls (``triton.testing.do_bench``, L2 flushed between calls), so the host's launch
    cost -- larger for a Triton launch than for torch.mm -- is not charged to the kernel.
    On the CPU: wall time of synchronous calls."""
    if torch.cuda.is_available():
        from triton.testing import do_bench

        return do_bench(fn, warmup=10, rep=max(20, 5 * reps), return_mode="median") / 1e3
    from overlapc.calibrate import _median

    return _median(fn, reps)


def _fail_exit(what: str) -> None:
    """Report what never finished, with every thread's stack, and end the process (a kernel
    that never returns wedges the GPU context: nothing after it could run anyway)."""
    import faulthandler
    import os
    import sys

    print(f"FAIL {what}", flush=True)
    faulthandler.dump_traceback(sys.stdout, all_threads=True)
    sys.stdout.flush()
    os._exit(3)


def _guard(what: str, seconds: float) -> None:
    """Wait for the device to finish, at most ``seconds``, else ``_fail_exit``."""
    if not torch.cuda.is_available():
        return
    import threading

    waiter = threading.Thread(target=torch.cuda.synchronize, daemon=True)
    waiter.start()
    waiter.join(seconds)
    if waiter.is_alive():
        _fail_exit(f"{what}: the device did not finish in {seconds:.0f} s")


class _deadline:
    """Context: ``_fail_exit`` if the block (which may wait on the device inside a library,
    e.g. ``do_bench``'s own synchronize) has not ended after ``seconds``."""

    def __init__(self, what: str, seconds: float):
        import threading

        self._t = threading.Timer(seconds, _fail_exit, args=(f"{what}: not done after {seconds:.0f} s",))
        self._t.daemon = True

    def __enter__(self):
        self._t.start()

    def __exit__(self, *exc):
        self._t.cancel()


def _join(th, what: str, seconds: float) -> None:
    th.join(seconds)
    if th.is_alive():
        _fail_exit(f"{what}: the producer thread did not finish in {seconds:.0f} s")


def _tune(make, cands, reps) -> list[tuple[float, dict]]:
    """(seconds, config) of each candidate; one that fails to compile or run times as inf
    (and is named), unless all do."""
    timed, errors = [], []
    for c in cands:
        try:
            with _deadline(f"timing config {c}", 60):
                timed.append((_bench(make(c), reps), c))
        except Exception as e:  # e.g. a tile that needs more shared memory than the device has
            errors.append(f"{c}: {type(e).__name__}: {str(e)[:200]}")
            timed.append((float("inf"), c))
    for e in errors:
        print(f"  config failed: {e}", flush=True)
    if len(errors) == len(cands):
        raise RuntimeError(f"every candidate config failed; first: {errors[0]}")
    return timed


def _per_config(timed, flops) -> list[str]:
    return [
        f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{c['num_warps']} s{c['num_stages']}: {flops / t / 1e12:.0f}"
        for t, c in timed
        if t != float("inf")
    ]


def ag_gemm(M_L, K, N, world, dtype, dev, reps, chunks=4, pipe=False):
    from overlapc.kernels import INTERPRET
    from overlapc.kernels.gemm import ag_gemm_consumer, configs
    from overlapc.runtime.symm import store_word as store  # flags and the abort word, as the op stores them

    shards = [torch.randn(M_L, K, dtype=dtype, device=dev) / K**0.25 for _ in range(world)]
    b = torch.randn(K, N, dtype=dtype, device=dev) / K**0.25
    buf = torch.empty(world * M_L, K, dtype=dtype, device=dev)
    flags = torch.zeros(world * chunks, dtype=torch.int32, device=dev)
    abort = torch.zeros(1, dtype=torch.int32, device=dev)
    out = torch.empty(world * M_L, N, dtype=dtype, device=dev)
    chunk_rows = -(-M_L // chunks)
    prec = "ieee" if dtype == torch.float32 else "tf32"
    epoch = [0]

    def launch(cfg):
        grid = (-(-world * M_L // cfg["BLOCK_M"]) * -(-N // cfg["BLOCK_N"]),)
        ag_gemm_consumer[grid](
            buf,
            b,
            out,
            flags,
            abort,
            M_L,
            N,
            K,
            world,
            0,
            chunks,
            chunk_rows,
            M_L,
            epoch[0],
            b.stride(0),
            b.stride(1),
            out.stride(0),
            out.stride(1),
            UPCAST=INTERPRET,
            PRECISION=prec,
            **cfg,
        )

    def produce():
        # Device-to-device data copies, each chunk followed by its flag.
        for c in range(chunks):
            r0, r1 = c * chunk_rows, min(M_L, (c + 1) * chunk_rows)
            for src in range(world):
                buf[src * M_L + r0 : src * M_L + r1].copy_(shards[src][r0:r1])
                f = src * chunks + c
                store(flags[f : f + 1], epoch[0])

    # Data in place, flags up: the GEMM alone, per config.
    epoch[0] = 1
    produce()
    cands = configs(world * M_L, N, K)
    launch(cands[-1])
    _guard(f"ag_gemm consumer {world * M_L}x{K}x{N} with every flag already up", 30)
    ref = torch.cat(shards) @ b
    flops = 2 * world * M_L * K * N
    if pipe:
        return _ag_pipelined(
            launch,
            produce,
            store,
            cands[min(2, len(cands) - 1)],
            buf,
            out,
            abort,
            epoch,
            ref,
            flops,
            dev,
            reps,
            dict(M=world * M_L, K=K, N=N, world=world),
        )
    timed = _tune(lambda c: lambda: launch(c), cands, reps)
    t_fused, cfg = min(timed, key=lambda x: x[0])
    out.zero_()  # the checked result is this config's, not an earlier candidate's
    launch(cfg)
    err = (out.float() - ref.float()).abs().max().item()
    with _deadline("timing torch.mm", 60):
        t_mm = _bench(lambda: torch.mm(buf, b), reps)
    return dict(
        kernel="ag_gemm",
        M=world * M_L,
        K=K,
        N=N,
        world=world,
        max_err=err,
        ref_scale=ref.float().abs().max().item(),
        tflops_fused=flops / t_fused / 1e12,
        tflops_mm=flops / t_mm / 1e12,
        ratio=t_mm / t_fused,
        tflops_with_producer=None,
        config=cfg,
        per_config=_per_config(timed, flops),
    )


def _ag_pipelined(launch, produce, store, cfg, buf, out, abort, epoch, ref, flops, dev, reps, shape) -> dict:
    """The AG consumer while a producer fills the gathered buffer chunk by chunk (on a GPU:
    on a side stream; on the CPU: in a thread, the consumer running under the interpreter in
    this one). A watchdog raises the abort word, as the op's does, if the consumer starves."""
    import threading

    cuda = dev.type == "cuda"
    side, abort_stream = (torch.cuda.Stream(), torch.cuda.Stream()) if cuda else (None, None)

    def pipelined():
        epoch[0] += 1
        if cuda:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                produce()
            launch(cfg)
            torch.cuda.current_stream().wait_stream(side)
        else:
            th = threading.Thread(target=produce, daemon=True)
            th.start()
            launch(cfg)
            _join(th, "ag_gemm producer", 60)

    fired, done = threading.Event(), threading.Event()

    def watchdog(seconds):
        if not done.wait(seconds):
            fired.set()
            if cuda:
                with torch.cuda.stream(abort_stream):
                    store(abort, 1)
            else:
                store(abort, 1)

    threading.Thread(target=watchdog, args=(20.0,), daemon=True).start()
    try:
        # Stale data must not pass: the buffer and the output are cleared first, so a tile
        # that did not wait for its chunk reads zeros.
        buf.zero_()
        out.zero_()
        pipelined()
        _guard("ag_gemm consumer with the producer on a side stream (watchdog abort after 20 s)", 35)
        if fired.is_set():
            raise RuntimeError("ag_gemm: the consumer starved the producer (aborted after 20 s)")
        err = (out.float() - ref.float()).abs().max().item()
        with _deadline("timed pipelined ag_gemm calls", 35):
            t_pipe = _bench(pipelined, reps)
        _guard("timed pipelined ag_gemm calls", 35)
        if fired.is_set():
            raise RuntimeError("ag_gemm: a timed pipelined call starved its producer (aborted after 20 s)")
    finally:
        done.set()
    return dict(
        kernel="ag_gemm+producer",
        **shape,
        max_err=err,
        ref_scale=ref.float().abs().max().item(),
        tflops_fused=None,
        tflops_mm=None,
        ratio=None,
        tflops_with_producer=flops / t_pipe / 1e12,
        config=cfg,
        per_config=[],
    )


def gemm_rs(M, K, N, world, dtype, dev, reps):
    from overlapc.kernels import INTERPRET, tl_dtype
    from overlapc.kernels.gemm import configs, gemm_rs_producer, rs_reduce_consumer

    M_O = M // world
    a = torch.randn(M, K, dtype=dtype, device=dev) / K**0.25
    b = torch.randn(K, N, dtype=dtype, device=dev) / K**0.25
    owners = [torch.zeros(world * M_O, N, dtype=dtype, device=dev) for _ in range(world)]
    buf_table = torch.tensor([o.data_ptr() for o in owners], dtype=torch.int64, device=dev)
    prec = "ieee" if dtype == torch.float32 else "tf32"
    out = torch.empty(M_O, N, dtype=dtype, device=dev)
    abort = torch.zeros(1, dtype=torch.int32, device=dev)

    def run(cfg, reduce=False):
        tiles = -(-M_O // cfg["BLOCK_M"]) * -(-N // cfg["BLOCK_N"])
        sigs = [torch.zeros(world * tiles, dtype=torch.int32, device=dev) for _ in range(world)]
        sig_table = torch.tensor([s.data_ptr() for s in sigs], dtype=torch.int64, device=dev)
        if reduce:  # the other sources' partials of rank 0's rows have arrived
            for o in owners:  # the tuning runs wrote every slot: the checked run starts clean
                o.zero_()
            out.zero_()
            partials = []
            for src in range(1, world):
                p = torch.randn(M_O, N, dtype=dtype, device=dev)
                owners[0][src * M_O : (src + 1) * M_O].copy_(p)
                sigs[0][src * tiles : (src + 1) * tiles].fill_(1)
                partials.append(p)
        kw = dict(
            BLOCK_M=cfg["BLOCK_M"],
            BLOCK_N=cfg["BLOCK_N"],
            BLOCK_K=cfg["BLOCK_K"],
            GROUP_M=cfg["GROUP_M"],
            num_warps=cfg["num_warps"],
            num_stages=cfg["num_stages"],
        )

        def producer(keep=sigs):  # keep: the signal pads must outlive the pointer table
            gemm_rs_producer[(world * tiles,)](
                a,
                b,
                buf_table,
                sig_table,
                M_O,
                N,
                K,
                world,
                0,
                M_O,
                1,
                a.stride(0),
                a.stride(1),
                b.stride(0),
                b.stride(1),
                UPCAST=INTERPRET,
                PRECISION=prec,
                OUT_DTYPE=tl_dtype(dtype),
                **kw,
            )

        if not reduce:
            return producer
        producer()
        rs_reduce_consumer[(tiles,)](
            owners[0],
            out,
            sigs[0],
            abort,
            M_O,
            N,
            world,
            1,
            out.stride(0),
            out.stride(1),
            BLOCK_M=cfg["BLOCK_M"],
            BLOCK_N=cfg["BLOCK_N"],
            GROUP_M=cfg["GROUP_M"],
            UPCAST=INTERPRET,
        )
        _guard(f"rs_reduce_consumer {M_O}x{N} with every flag already up", 30)
        return partials

    cands = configs(M_O, N, K)
    timed = _tune(run, cands, reps)
    t_fused, cfg = min(timed, key=lambda x: x[0])
    partials = run(cfg, reduce=True)
    full = a.float() @ b.float()
    # Rank 0 owns rows [0, M_O) of the scatter (dim 0): its own partial plus the others'.
    ref = full[:M_O] + sum(p.float() for p in partials)
    err = (out.float() - ref).abs().max().item()
    # Each owner received the right rows of rank 0's GEMM.
    for w, o in enumerate(owners):
        err = max(err, (o[:M_O].float() - full[w * M_O : (w + 1) * M_O]).abs().max().item())
    with _deadline("timing torch.mm", 60):
        t_mm = _bench(lambda: torch.mm(a, b), reps)
    flops = 2 * M * K * N
    return dict(
        kernel="gemm_rs",
        M=M,
        K=K,
        N=N,
        world=world,
        max_err=err,
        ref_scale=ref.abs().max().item(),
        tflops_fused=flops / t_fused / 1e12,
        tflops_mm=flops / t_mm / 1e12,
        ratio=t_mm / t_fused,
        config=cfg,
        per_config=_per_config(timed, flops),
    )


def workspace_check(dev, timeout: float = 10.0) -> dict:
    """overlapc's symmetric-memory workspace (overlapc/runtime/symm.py) on a group of one rank
    (nccl and torch's symmetric memory on a GPU; gloo and POSIX shm on the CPU), each part
    while a consumer grid spins on the workspace's flags: (1) a host thread raises the flags
    with ``SymmetricMemory.store`` from the copy stream (pinned-memory copies: they must land
    while the spinning tiles hold the SMs); (2) the AG copy engine's own work: device-to-device
    data chunks, each followed by its flag; (3) nine back-to-back calls issued as the op issues
    them; (4) nobody raises the flags, and the call's watchdog (``fused._Watchdog``, the abort
    word via the abort stream) must end the grid. A kernel that never returns is reported and
    the process exits, instead of hanging the session."""
    import threading

    import torch.distributed as dist

    from overlapc.kernels import INTERPRET
    from overlapc.kernels.gemm import ag_gemm_consumer, configs
    from overlapc.runtime import fused, symm

    cuda = dev.type == "cuda"
    if not dist.is_initialized():
        dist.init_process_group(
            "nccl" if cuda else "gloo",
            store=dist.HashStore(),
            rank=0,
            world_size=1,
            **({"device_id": torch.device("cuda", torch.cuda.current_device())} if cuda else {}),
        )
    group = dist.group.WORLD
    dtype = torch.bfloat16
    M, K, N, chunks = (16384, 1024, 1024, 64) if cuda else (64, 32, 32, 4)
    t0 = time.perf_counter()
    ws = symm.workspace(group, M * K * 2, chunks, dev, timeout)
    t_rdv = time.perf_counter() - t0
    a = ws.view(0, (M, K), dtype)
    a.copy_(torch.randn(M, K, dtype=dtype, device=dev))
    b = torch.randn(K, N, dtype=dtype, device=dev) / K**0.5
    out = torch.empty(M, N, dtype=dtype, device=dev)
    cfg = dict(configs(M, N, K)[-1])
    tiles = -(-M // cfg["BLOCK_M"]) * -(-N // cfg["BLOCK_N"])

    def consume(epoch):
        ag_gemm_consumer[(tiles,)](
            a,
            b,
            out,
            ws.flags(),
            ws.abort_word(),
            M,
            N,
            K,
            1,
            0,
            chunks,
            M // chunks,
            1,
            epoch,
            b.stride(0),
            b.stride(1),
            out.stride(0),
            out.stride(1),
            UPCAST=INTERPRET,
            PRECISION="tf32",
            **cfg,
        )

    def finished(what: str) -> None:
        _guard(f"workspace: {what}", timeout + 10)

    res = dict(backend="torch symmetric memory" if cuda else "POSIX shm", rendezvous_s=round(t_rdv, 3))
    # (1) flags raised from the host while the grid spins
    epoch = ws.next_epoch()
    dog = fused._Watchdog(ws, timeout)

    def raise_flags(epoch):
        time.sleep(0.2)
        with ws.on("copy"):
            for f in range(chunks):
                ws.store(ws.flags()[f : f + 1], epoch)

    t = time.perf_counter()
    th = threading.Thread(target=raise_flags, args=(epoch,), daemon=True)
    th.start()
    consume(epoch)
    finished("consumer waiting on host-raised flags")
    _join(th, "raising flags", 30)
    dog.stop()
    res["flags_landed_s"] = round(time.perf_counter() - t, 3)
    res["flags_ok"] = not dog.fired and not int(ws.abort_word()[0])
    res["max_err"] = (out.float() - (a.float() @ b.float())).abs().max().item()
    print(f"workspace (1) flags: {res}", flush=True)
    # (2) the AG copy engine's own work while the grid spins: data chunks copied device to
    # device, each followed by its flag (fused.all_gather_matmul's producer, one rank)
    # Every check starts from a cleared buffer and output (a tile that read before its
    # chunk landed reads zeros), and successive calls copy different sources.
    srcs = [torch.randn(M, K, dtype=dtype, device=dev) for _ in range(2)]
    src = srcs[0]
    rows = M // chunks

    def produce(epoch, delay, src):
        time.sleep(delay)
        with ws.on("copy"):
            for f in range(chunks):
                a[f * rows : (f + 1) * rows].copy_(src[f * rows : (f + 1) * rows])
                ws.store(ws.flags()[f : f + 1], epoch)

    a.zero_()
    out.zero_()
    ws.fork("copy")  # the copies come after the clearing
    epoch = ws.next_epoch()
    dog = fused._Watchdog(ws, timeout)
    t = time.perf_counter()
    th = threading.Thread(target=produce, args=(epoch, 0.2, src), daemon=True)
    th.start()
    consume(epoch)
    finished("consumer waiting on device-to-device data copies and their flags")
    _join(th, "the data copies", 30)
    ws.join("copy")
    dog.stop()
    res["data_landed_s"] = round(time.perf_counter() - t, 3)
    res["data_ok"] = not dog.fired and not int(ws.abort_word()[0])
    res["data_max_err"] = (out.float() - (src.float() @ b.float())).abs().max().item()
    print(f"workspace (2) data: {res}", flush=True)
    # (3) back-to-back calls as the op issues them: fork the copy stream, producer thread, consumer, join
    consume(epoch)
    finished("one consumer with every flag up")
    t = time.perf_counter()
    consume(epoch)
    finished("one consumer with every flag up")
    res["consumer_alone_s"] = round(time.perf_counter() - t, 5)
    a.zero_()
    out.zero_()
    dog = fused._Watchdog(ws, timeout)
    t = time.perf_counter()
    n = 9  # odd: the last call copies srcs[0], the one before srcs[1]
    for i in range(n):
        epoch = ws.next_epoch()
        ws.fork("copy")
        th = threading.Thread(target=produce, args=(epoch, 0.0, srcs[i % 2]), daemon=True)
        th.start()
        consume(epoch)
        _join(th, f"back-to-back call {i}'s copies", 30)
        ws.join("copy")
    finished(f"{n} back-to-back producer+consumer calls")
    dog.stop()
    res["pipelined_call_s"] = round((time.perf_counter() - t) / n, 5)
    res["pipelined_ok"] = not dog.fired and not int(ws.abort_word()[0])
    res["pipelined_max_err"] = (out.float() - (srcs[(n - 1) % 2].float() @ b.float())).abs().max().item()
    print(f"workspace (3) back-to-back: {res}", flush=True)
    # (4), last (if it hangs, nothing after it runs): nobody raises the flags, and the
    # watchdog's abort must end the grid
    epoch = ws.next_epoch()
    dog = fused._Watchdog(ws, 1.0)
    t = time.perf_counter()
    consume(epoch)
    finished("consumer waiting for the watchdog's abort")
    dog.stop()
    res["abort_after_s"] = round(time.perf_counter() - t, 3)
    res["abort_ok"] = dog.fired and bool(int(ws.abort_word()[0]))
    symm.release_all()
    dist.destroy_process_group()
    return res


def fused_ops_rank(rank: int, world: int, port: int) -> dict:
    """One rank of ``fused_ops_check``: the fused ops themselves
    (``overlapc/runtime/fused.py``: the workspace rendezvous, the copy engine's thread and
    stream, pinned-memory stores into peers' signal words, done words, the watchdog) between
    processes. Every operand is made from a seed, so each rank computes the reference
    locally, without a collective."""
    import torch.distributed as dist

    from overlapc.kernels.gemm import configs
    from overlapc.runtime import fused, symm

    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", rank) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(dev)
    dist.init_process_group(
        "nccl" if cuda else "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world,
        timeout=__import__("datetime").timedelta(seconds=60),
    )
    gname = dist.group.WORLD.group_name
    res = dict(rank=rank, cases=[])

    def operand(seed, *shape, dtype):
        g = torch.Generator().manual_seed(seed)
        return (torch.randn(*shape, generator=g) / shape[-1] ** 0.25).to(dtype).to(dev)

    # (kind, shape of a rank's operand, dim, N): 2-D and 3-D, dim 0 and an inner dim
    if cuda:
        cases = [
            ("ag", (256, 512), 0, 384),
            ("ag", (2, 96, 512), 1, 256),
            ("rs", (512, 512), 0, 384),
            ("rs", (2, 192, 512), 1, 256),
        ]
    else:
        cases = [("ag", (8, 32), 0, 24), ("ag", (2, 6, 32), 1, 16), ("rs", (16, 32), 0, 24), ("rs", (2, 8, 32), 1, 16)]
    for dtype in (torch.bfloat16, torch.float32):
        for i, (kind, shape, d, N) in enumerate(cases):
            K = shape[-1]
            b = operand(1000 + i, K, N, dtype=dtype)
            if kind == "ag":
                shards = [operand(10 * r + i, *shape, dtype=dtype) for r in range(world)]
                full = torch.cat(shards, d)
                Mg = full.numel() // K
                cfg = configs(Mg, N, K)[-1]
                fused._TUNED[("ag", Mg, N, K, dtype, dev.type)] = cfg  # autotuning would time local scratch only
                ref = full.float() @ b.float()
                errs = []
                for _call in range(2):  # two calls: the second waits on the first's done words
                    g, outs = fused.all_gather_matmul(
                        shards[rank], [b], d, gname, chunks=4, timeout=15.0, return_a=True, min_flops=0
                    )
                    errs.append((outs[0].float() - ref).abs().max().item())
                    errs.append((g.float() - full.float()).abs().max().item())
            else:
                parts = [operand(10 * r + i, *shape, dtype=dtype) for r in range(world)]
                M_O = parts[0].numel() // K // world
                cfg = configs(M_O, N, K)[-1]
                fused._TUNED[("rs", M_O, N, K, dtype, dev.type)] = cfg  # no autotuning: the handshake is checked
                ref = sum(p.float() @ b.float() for p in parts).chunk(world, d)[rank]
                errs = []
                for _call in range(2):
                    out = fused.matmul_reduce_scatter(parts[rank], b, d, gname, timeout=15.0, min_flops=0)
                    errs.append((out.float() - ref).abs().max().item())
            res["cases"].append(
                dict(
                    kind=kind,
                    shape=list(shape),
                    dim=d,
                    N=N,
                    dtype=str(dtype).split(".")[-1],
                    max_err=max(errs),
                    ref_scale=ref.abs().max().item(),
                )
            )
    res["fused_calls"] = fused.calls["fused"]
    symm.release_all()
    dist.destroy_process_group()
    return res


def fused_ops_check(world: int = 2, timeout: float = 60.0) -> dict:
    """``world`` processes, one per GPU (on the CPU: gloo and POSIX shared memory), run the
    fused ops against each other: the ops' own path across processes, which the emulated
    peers above do not take. Each rank is a subprocess; all are killed after ``timeout``
    seconds. Torch's symmetric memory refuses two ranks on one GPU ("detected allocations
    from overlapping devices from different ranks", torch 2.11), so with fewer GPUs than
    ranks the check is skipped."""
    if torch.cuda.is_available() and torch.cuda.device_count() < world:
        return dict(
            world=world,
            ranks=[],
            failed=[],
            skipped=f"{torch.cuda.device_count()} GPU(s) for {world} ranks: torch's symmetric memory "
            "takes one rank per GPU",
        )
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "benchmarks.gpu_check",
                "--ops-rank",
                str(r),
                "--ops-world",
                str(world),
                "--port",
                str(port),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    deadline = time.monotonic() + timeout
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1.0, deadline - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            outs.append(p.communicate()[0] + f"\n(killed after {timeout:.0f} s)")
    ranks, logs = [], []
    for r, (p, text) in enumerate(zip(procs, outs)):
        line = [t for t in text.splitlines() if t.startswith("OPS_RESULT ")]
        if p.returncode == 0 and line:
            ranks.append(json.loads(line[-1][len("OPS_RESULT ") :]))
        else:
            logs.append(f"rank {r} (exit {p.returncode}):\n" + text[-3000:])
    return dict(world=world, ranks=ranks, failed=logs)


def grouped_check(dev, smoke: bool, reps: int) -> dict:
    """overlapc::grouped_mm (a dropless expert loop regrouped, passes/expert_loop.py) on this
    device and torch: forward and gradients against the loop it replaces (the same mm per
    group: expect exact), and its time beside the loop's and torch._grouped_mm's."""
    from overlapc.runtime.grouped import grouped_mm

    dtype = torch.bfloat16
    g, e, k, n, rows = (4, 2, 64, 48, 16) if smoke else (16, 4, 4096, 2048, 1024)
    gen = torch.Generator(device="cpu").manual_seed(0)
    sizes = torch.randint(0, 2 * rows, (g,), generator=gen).tolist()
    sizes[1] = 0  # an empty group
    x = torch.randn(sum(sizes), k, generator=gen).to(dev, dtype)
    w = (torch.randn(e, k, n, generator=gen) * k**-0.5).to(dev, dtype)
    index = [i % e for i in range(g)]
    offs = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
    dy = torch.randn(sum(sizes), n, generator=gen).to(dev, dtype)

    def loop(xx, ww):
        return torch.cat([r @ ww[index[i]] for i, r in enumerate(xx.split(sizes))])

    res = {}
    for name, f in (("op", lambda xx, ww: grouped_mm(xx, ww, offs, index)), ("loop", loop)):
        xx, ww = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = f(xx, ww)
        y.backward(dy)
        res[name] = (y.detach(), xx.grad, ww.grad)
    errs = {t: (a.float() - b.float()).abs().max().item() for t, a, b in zip(("y", "dx", "dw"), res["op"], res["loop"])}
    out = {"groups": g, "experts": e, "K": k, "N": n, "rows": sum(sizes), "max_err_vs_loop": errs}
    flops = 2 * sum(sizes) * k * n
    out["tflops_op"] = flops / _bench(lambda: grouped_mm(x, w, offs, index), reps) / 1e12
    out["tflops_loop"] = flops / _bench(lambda: loop(x, w), reps) / 1e12
    if dev.type == "cuda" and hasattr(torch, "_grouped_mm"):
        wg = w[index].contiguous()
        try:
            out["tflops_torch_grouped_mm"] = flops / _bench(lambda: torch._grouped_mm(x, wg, offs=offs), reps) / 1e12
        except Exception as ex:  # noqa: BLE001 -- a torch/GPU without the kernel: say so
            out["torch_grouped_mm"] = f"{type(ex).__name__}: {ex}"
    return out


def ulysses_check(dev, smoke: bool) -> dict:
    """The Ulysses block compiled by overlapc on this device, against eager: whichever fused
    attention kernel SDPA picks here (CUDA: flash, efficient or cuDNN) must stay inside the
    head-chunked region, called once per chunk in forward and backward (passes/axis.BATCHED),
    and the outputs and gradients must match eager's. A one-rank group (nccl on a GPU): the
    all-to-alls move nothing, the graphs are those of any world size."""
    import tempfile

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from overlapc import Backend, Options
    from overlapc.models import ulysses
    from overlapc.passes.axis import BATCHED

    chunks = 4
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    store = tempfile.NamedTemporaryFile(delete=False).name
    dist.init_process_group(
        "nccl" if dev.type == "cuda" else "gloo", init_method=f"file://{store}", rank=0, world_size=1
    )
    try:
        mesh = init_device_mesh(dev.type, (1,))
        kw = dict(batch=2, seq=64, dim=128, n_heads=8) if smoke else dict(batch=2, seq=4096, dim=2048, n_heads=16)
        ref, (x,) = ulysses.build_ulysses(mesh, **kw)
        model, _ = ulysses.build_ulysses(mesh, **kw)
        ref, model, x = ref.to(dev, dtype), model.to(dev, dtype), x.detach().to(dev, dtype)
        be = Backend(Options(strategy="decompose", inner="eager", chunks=chunks), keep_graphs=True)
        dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dev, dtype)
        res = []
        for m, f in ((ref, ref), (model, torch.compile(model, backend=be))):
            xi = x.clone().requires_grad_()
            y = f(xi)
            y.backward(dy)
            res.append([y.detach(), xi.grad, *(p.grad for p in m.parameters())])
        errs = [(a.float() - b.float()).abs().max().item() for a, b in zip(*res)]
        scale = max(b.float().abs().max().item() for b in res[0])
        calls = {
            kind: {
                str(n.target): sum(m.target is n.target for m in gm.graph.nodes)
                for n in gm.graph.nodes
                if n.target in BATCHED
            }
            for kind, gm in be.graphs
        }
        sites = sorted(
            {(s.graph, s.pattern, s.status, s.chunks, s.reason) for s in be.report.sites if s.pattern != "collective"}
        )
        out = {
            "dtype": str(dtype),
            **kw,
            "chunks": chunks,
            "attention_calls": calls,
            "sites": sites,
            "max_err": max(errs),
            "ref_scale": scale,
        }
        problems = []
        if any(st != "rewritten" for _, _, st, _, _ in sites) or len(sites) != 4:
            problems.append(f"not every all-to-all site rewritten: {sites}")
        for kind in ("forward", "backward"):
            got = {k for g, _, _, k, _ in sites if g == kind}  # chunks of heads, or of the batch (2)
            if len(got) != 1 or list(calls.get(kind, {}).values()) != list(got):
                problems.append(f"{kind}: attention calls {calls.get(kind)} (want one op, once per chunk: {got})")
        if max(errs) > 0.02 * max(1.0, scale):
            problems.append(f"max err {max(errs):.3g} against eager (scale {scale:.3g})")
        out["problems"] = problems
        return out
    finally:
        dist.destroy_process_group()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes (runs under the interpreter on a CPU)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default="gpu_check.json")
    p.add_argument(
        "--budget",
        type=float,
        default=240.0,
        help="seconds after which no further kernel check starts (the workspace check still runs)",
    )
    p.add_argument(
        "--stage",
        default="all",
        choices=["all", "rs", "ag", "pipe", "workspace", "ops", "grouped", "ulysses"],
        help="run one part only (a GPU hang ends its process: run the parts as separate processes)",
    )
    p.add_argument(
        "--ops",
        type=int,
        default=2,
        metavar="WORLD",
        help="ranks (processes, one GPU each) of the fused-op check (0: skip it)",
    )
    p.add_argument("--ops-rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--ops-world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.ops_rank is not None:  # one rank of fused_ops_check
        print("OPS_RESULT " + json.dumps(fused_ops_rank(args.ops_rank, args.ops_world, args.port)), flush=True)
        return
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu" and not args.smoke:
        p.error("no CUDA device: run with --smoke (interpreter, tiny shapes) or on a GPU machine")
    dtype = torch.bfloat16
    world = 8
    if args.smoke:
        shapes = [(64, 48, 40)]
        args.reps = 1
    else:  # (M, K, N): Llama-style column-parallel (N = 8192/8, 28672/8) and row-parallel shapes
        shapes = [(8192, 8192, 1024), (8192, 8192, 3584), (16384, 8192, 1024), (8192, 3584, 8192)]
    import platform
    import traceback

    import triton

    env = dict(
        device=torch.cuda.get_device_name() if dev.type == "cuda" else "cpu (interpreter)",
        torch=torch.__version__,
        triton=triton.__version__,
        python=platform.python_version(),
    )
    print(f"gpu_check: {env}", flush=True)
    out = dict(env=env, rows=[], errors=[], workspace=None, ops=None, grouped=None, ulysses=None)

    def save():
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)

    # Each check in turn, each failure recorded and the next one still run (a device lease is
    # short); the workspace check last (the fused ops run in subprocesses of their own),
    # because a kernel that never returns ends the process.
    if dev.type == "cuda":  # where a hang that no guard covers sits (a tuning loop, say)
        import faulthandler
        import sys

        faulthandler.dump_traceback_later(45, repeat=True, file=sys.stdout)
    st = args.stage
    kernels = [("gemm_rs", gemm_rs, lambda M, K, N: (M, K, N), {})] if st in ("all", "rs") else []
    if st in ("all", "ag"):
        kernels.append(("ag_gemm", ag_gemm, lambda M, K, N: (M // world, K, N), {}))
    if st in ("all", "pipe"):
        kernels.append(("ag_gemm+producer", ag_gemm, lambda M, K, N: (M // world, K, N), dict(pipe=True)))
    t0 = time.time()
    for name, fn, shape_args, kw in kernels:
        for M, K, N in shapes[:1] if kw.get("pipe") else shapes:
            if time.time() - t0 > args.budget:
                out["errors"].append(f"{name} {M}x{K}x{N}: skipped, past the {args.budget:.0f} s budget")
                continue
            try:
                row = fn(*shape_args(M, K, N), world, dtype, dev, args.reps, **kw)
                out["rows"].append(row)
                print(f"[{time.time() - t0:5.0f} s] {row}", flush=True)
            except Exception as e:
                out["errors"].append(f"{name} {M}x{K}x{N}: {type(e).__name__}: {e}")
                print(f"[{time.time() - t0:5.0f} s] FAIL {name} {M}x{K}x{N}\n{traceback.format_exc()}", flush=True)
            save()

    def part(key: str, name: str, run, problems=lambda res: [], label=None) -> None:
        """One check: its result under out[key], printed as ``label(result)`` (default: name);
        its problems, or the exception it raised, as errors. A failure does not stop the rest."""
        try:
            out[key] = res = run()
            print(f"{label(res) if label else name}: {res}", flush=True)
            out["errors"].extend(problems(res))
        except Exception as e:
            out["errors"].append(f"{name}: {type(e).__name__}: {e}")
            print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
        save()

    if st in ("all", "grouped"):
        part(
            "grouped",
            "grouped_mm",
            lambda: grouped_check(dev, args.smoke, args.reps),
            lambda gr: (
                [f"grouped_mm differs from the loop it replaces: {gr['max_err_vs_loop']}"]
                if any(v != 0 for v in gr["max_err_vs_loop"].values())
                else []
            ),
        )
    if st in ("all", "ulysses"):
        part(
            "ulysses",
            "ulysses",
            lambda: ulysses_check(dev, args.smoke),
            lambda ul: [f"ulysses: {p}" for p in ul["problems"]],
        )
    if args.ops and st in ("all", "ops"):
        out["ops"] = sh = fused_ops_check(args.ops)
        if sh.get("skipped"):
            print(f"fused ops world skipped: {sh['skipped']}", flush=True)
        for r in sh["ranks"]:
            for c in r["cases"]:
                print(f"fused ops world {sh['world']} rank {r['rank']}: {c}", flush=True)
        for f in sh["failed"]:
            print(f"FAIL fused ops world: {f}", flush=True)
        save()
    if st in ("all", "workspace"):
        part("workspace", "workspace", lambda: workspace_check(dev), label=lambda w: f"workspace ({w['backend']})")
    rows = out["rows"]
    print(f"\ndevice: {env['device']}, torch {env['torch']}, triton {env['triton']}, bf16, world {world} emulated")
    print(
        f"{'kernel':16} {'M':>6} {'K':>6} {'N':>6} {'fused TF/s':>10} {'mm TF/s':>8} {'fused/mm':>8} "
        f"{'+producer':>9} {'max err':>8}  config"
    )

    def num(v, fmt):
        return "-" if v is None else format(v, fmt)

    for r in rows:
        c = r["config"]
        print(
            f"{r['kernel']:16} {r['M']:6} {r['K']:6} {r['N']:6} {num(r['tflops_fused'], '.1f'):>10} "
            f"{num(r['tflops_mm'], '.1f'):>8} {num(r['ratio'], '.2f'):>8} "
            f"{num(r.get('tflops_with_producer'), '.0f'):>9} "
            f"{r['max_err']:8.3g}  "
            f"{c['BLOCK_M']}x{c['BLOCK_N']}x{c['BLOCK_K']} w{c['num_warps']} s{c['num_stages']}"
        )
    for e in out["errors"]:
        print(f"error: {e}")
    problems = list(out["errors"])
    problems += [
        f"{r['kernel']} {r['M']}x{r['K']}x{r['N']}: max err {r['max_err']:.3g} is over 2% of the "
        f"reference's scale {r['ref_scale']:.3g}"
        for r in rows
        if r["max_err"] > 0.02 * max(1.0, r["ref_scale"])
    ]
    w = out["workspace"]
    if w and not (
        w["flags_ok"]
        and w["abort_ok"]
        and w["data_ok"]
        and w["pipelined_ok"]
        and max(w["max_err"], w["data_max_err"], w["pipelined_max_err"]) < 0.05
    ):
        problems.append(f"workspace check failed: {w}")
    sh = out["ops"]
    if sh:
        problems += [f"fused ops world: {f.splitlines()[0]}" for f in sh["failed"]]
        problems += [
            f"fused ops world rank {r['rank']}: {c}"
            for r in sh["ranks"]
            for c in r["cases"]
            if c["max_err"] > 0.02 * max(1.0, c["ref_scale"])
        ]
    if problems:
        raise SystemExit("gpu_check: " + "; ".join(problems))


if __name__ == "__main__":
    main()
