"""GPU check of the fused kernels on one device, peers emulated as separate buffers.

    python -m benchmarks.gpu_check                  # on a CUDA machine: numerics + TFLOP/s, < 5 min
    python -m benchmarks.gpu_check --smoke          # anywhere (CPU: Triton interpreter, tiny shapes)

For each bf16 LLM shape (M = world * M_L gathered rows, K, N = the local slice of a
column-parallel weight) it checks:

- AllGather+GEMM (``ag_gemm_consumer``): the gathered buffer is filled chunk by chunk from
  ``world`` separate "peer" shards by a producer on a side stream (copy, then a flag write),
  while the consumer GEMM on the main stream waits on the flags. Numerics against
  ``torch.cat(shards) @ B``; TFLOP/s with the flags already up (the GEMM alone: its
  efficiency against torch.mm is the target, >= 90%), and with the producer running.
- GEMM+ReduceScatter (``gemm_rs_producer`` + ``rs_reduce_consumer``): rank 0's producer
  writes its tiles into ``world`` separate "owner" buffers (pointer tables) and raises
  their flags; the other sources' partials of rank 0's rows are pre-filled with their
  flags up, so the consumer reduces ``world`` partials. Numerics against the sum of
  partial GEMMs; TFLOP/s of the producer GEMM against torch.mm of the same shape.

First, the symmetric-memory workspace itself on a group of one rank (``workspace_check``:
torch's symmetric memory on a GPU): host-raised flags must reach a spinning consumer grid,
and the watchdog's abort must end one that waits forever.

Block sizes: every candidate of ``overlapc.kernels.gemm.configs`` is timed per shape and
the best kept (autotuning, keyed on M, N, K). Prints a table and writes JSON to
``--out`` (default: gpu_check.json).
"""
from __future__ import annotations

import argparse
import json
import time

import torch


def _bench(fn, reps: int) -> float:
    """Median seconds of ``fn`` (device-synchronised)."""
    from overlapc.calibrate import _median
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    return _median(lambda: (fn(), sync()), reps)


def ag_gemm(M_L, K, N, world, dtype, dev, reps, chunks=4):
    from overlapc.kernels import INTERPRET
    from overlapc.kernels.gemm import ag_gemm_consumer, configs

    shards = [torch.randn(M_L, K, dtype=dtype, device=dev) / K ** 0.25 for _ in range(world)]
    b = torch.randn(K, N, dtype=dtype, device=dev) / K ** 0.25
    buf = torch.empty(world * M_L, K, dtype=dtype, device=dev)
    flags = torch.zeros(world * chunks, dtype=torch.int32, device=dev)
    abort = torch.zeros(1, dtype=torch.int32, device=dev)
    out = torch.empty(world * M_L, N, dtype=dtype, device=dev)
    chunk_rows = -(-M_L // chunks)
    prec = "ieee" if dtype == torch.float32 else "tf32"
    epoch = [0]

    def launch(cfg):
        grid = (-(-world * M_L // cfg["BLOCK_M"]) * -(-N // cfg["BLOCK_N"]),)
        ag_gemm_consumer[grid](buf, b, out, flags, abort, M_L, N, K, world, 0, chunks, chunk_rows, M_L, epoch[0],
                               b.stride(0), b.stride(1), out.stride(0), out.stride(1),
                               UPCAST=INTERPRET, PRECISION=prec, **cfg)

    epochs = torch.arange(0, 4096, dtype=torch.int32, device=dev)

    def produce():
        # Copies only (cudaMemcpyAsync, no kernels): the producer needs no SM that the
        # spinning consumer could be holding.
        for c in range(chunks):
            r0, r1 = c * chunk_rows, min(M_L, (c + 1) * chunk_rows)
            for src in range(world):
                buf[src * M_L + r0: src * M_L + r1].copy_(shards[src][r0:r1])
                f = src * chunks + c
                flags[f:f + 1].copy_(epochs[epoch[0]:epoch[0] + 1])

    # Data in place, flags up: the GEMM alone, per config.
    epoch[0] = 1
    produce()
    cands = configs(world * M_L, N, K)
    timed = [(_bench(lambda c=c: launch(c), reps), c) for c in cands]
    t_fused, cfg = min(timed, key=lambda x: x[0])
    ref = torch.cat(shards) @ b
    launch(cfg)
    err = (out.float() - ref.float()).abs().max().item()
    t_mm = _bench(lambda: torch.mm(buf, b), reps)
    # With the producer running on a side stream (the consumer waits on its flags).
    t_pipe = None
    if dev.type == "cuda":
        side = torch.cuda.Stream()

        def pipelined():
            epoch[0] += 1
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                produce()
            launch(cfg)
            torch.cuda.current_stream().wait_stream(side)

        # If the consumer's spinning tiles ever starved the producer, the host raises the
        # abort word (pinned host memory, visible to the kernel) instead of hanging.
        host_abort = torch.zeros(1, dtype=torch.int32).pin_memory()
        device_abort, abort = abort, host_abort  # launch() reads `abort` from this scope
        import threading
        done = threading.Event()
        threading.Thread(target=lambda: done.wait(60) or host_abort.fill_(1), daemon=True).start()
        pipelined()
        torch.cuda.synchronize()
        done.set()
        if int(host_abort[0]):
            raise SystemExit("ag_gemm: the consumer starved the producer (aborted after 60 s)")
        abort = device_abort
        t_pipe = _bench(pipelined, reps)
        launch(cfg)
        err = max(err, (out.float() - ref.float()).abs().max().item())
    flops = 2 * world * M_L * K * N
    return dict(kernel="ag_gemm", M=world * M_L, K=K, N=N, world=world, max_err=err,
                ref_scale=ref.float().abs().max().item(), tflops_fused=flops / t_fused / 1e12,
                tflops_mm=flops / t_mm / 1e12, ratio=t_mm / t_fused,
                tflops_with_producer=(flops / t_pipe / 1e12) if t_pipe else None, config=cfg)


def gemm_rs(M, K, N, world, dtype, dev, reps):
    from overlapc.kernels import INTERPRET, tl_dtype
    from overlapc.kernels.gemm import configs, gemm_rs_producer, rs_reduce_consumer

    M_O = M // world
    a = torch.randn(M, K, dtype=dtype, device=dev) / K ** 0.25
    b = torch.randn(K, N, dtype=dtype, device=dev) / K ** 0.25
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
            partials = []
            for src in range(1, world):
                p = torch.randn(M_O, N, dtype=dtype, device=dev)
                owners[0][src * M_O:(src + 1) * M_O].copy_(p)
                sigs[0][src * tiles:(src + 1) * tiles].fill_(1)
                partials.append(p)
        kw = dict(BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], BLOCK_K=cfg["BLOCK_K"], GROUP_M=cfg["GROUP_M"],
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])

        def producer(keep=sigs):  # keep: the signal pads must outlive the pointer table
            gemm_rs_producer[(world * tiles,)](a, b, buf_table, sig_table, M_O, N, K, world, 0, M_O, 1,
                                               a.stride(0), a.stride(1), b.stride(0), b.stride(1),
                                               UPCAST=INTERPRET, PRECISION=prec, OUT_DTYPE=tl_dtype(dtype), **kw)
        if not reduce:
            return producer
        producer()
        rs_reduce_consumer[(tiles,)](owners[0], out, sigs[0], abort, M_O, N, world, 1, out.stride(0), out.stride(1),
                                     BLOCK_M=cfg["BLOCK_M"], BLOCK_N=cfg["BLOCK_N"], GROUP_M=cfg["GROUP_M"],
                                     UPCAST=INTERPRET)
        return partials

    cands = configs(M_O, N, K)
    timed = [(_bench(run(c), reps), c) for c in cands]
    t_fused, cfg = min(timed, key=lambda x: x[0])
    partials = run(cfg, reduce=True)
    full = (a.float() @ b.float())
    # Rank 0 owns rows [0, M_O) of the scatter (dim 0): its own partial plus the others'.
    ref = full[:M_O] + sum(p.float() for p in partials)
    err = (out.float() - ref).abs().max().item()
    # Each owner received the right rows of rank 0's GEMM.
    for w, o in enumerate(owners):
        err = max(err, (o[:M_O].float() - full[w * M_O:(w + 1) * M_O]).abs().max().item())
    t_mm = _bench(lambda: torch.mm(a, b), reps)
    flops = 2 * M * K * N
    return dict(kernel="gemm_rs", M=M, K=K, N=N, world=world, max_err=err, ref_scale=ref.abs().max().item(),
                tflops_fused=flops / t_fused / 1e12, tflops_mm=flops / t_mm / 1e12, ratio=t_mm / t_fused,
                config=cfg)


def workspace_check(dev, timeout: float = 20.0) -> dict:
    """overlapc's symmetric-memory workspace (overlapc/runtime/symm.py) on a group of one rank
    (nccl and torch's symmetric memory on a GPU; gloo and POSIX shm on the CPU): (1) a
    consumer grid waits on flags that a host thread raises with ``SymmetricMemory.store``
    from the copy stream (pinned-memory copies: they must land while the spinning tiles
    hold the SMs); (2) a consumer waits on a flag nobody raises, and the call's watchdog
    (``fused._Watchdog``, the abort word via the abort stream) must end it. A kernel that
    never returns is reported and the process exits, instead of hanging the session."""
    import os
    import threading

    import torch.distributed as dist

    from overlapc.kernels import INTERPRET
    from overlapc.kernels.gemm import ag_gemm_consumer, configs
    from overlapc.runtime import fused, symm

    cuda = dev.type == "cuda"
    if not dist.is_initialized():
        dist.init_process_group("nccl" if cuda else "gloo", store=dist.HashStore(), rank=0, world_size=1,
                                **({"device_id": dev} if cuda else {}))
    group = dist.group.WORLD
    dtype = torch.bfloat16
    M, K, N, chunks = (16384, 1024, 1024, 64) if cuda else (64, 32, 32, 4)
    t0 = time.perf_counter()
    ws = symm.workspace(group, M * K * 2, chunks, dev, timeout)
    t_rdv = time.perf_counter() - t0
    a = ws.view(0, (M, K), dtype)
    a.copy_(torch.randn(M, K, dtype=dtype, device=dev))
    b = torch.randn(K, N, dtype=dtype, device=dev) / K ** 0.5
    out = torch.empty(M, N, dtype=dtype, device=dev)
    cfg = dict(configs(M, N, K)[-1])
    tiles = -(-M // cfg["BLOCK_M"]) * -(-N // cfg["BLOCK_N"])

    def consume(epoch):
        ag_gemm_consumer[(tiles,)](a, b, out, ws.flags(), ws.abort_word(), M, N, K, 1, 0, chunks, M // chunks,
                                   1, epoch, b.stride(0), b.stride(1), out.stride(0), out.stride(1),
                                   UPCAST=INTERPRET, PRECISION="tf32", **cfg)

    def finished(what: str) -> float:
        """Seconds until the device is idle; exits the process if it never gets there."""
        t = time.perf_counter()
        if cuda:
            waiter = threading.Thread(target=torch.cuda.synchronize, daemon=True)
            waiter.start()
            waiter.join(timeout + 10)
            if waiter.is_alive():
                print(f"FAIL workspace: {what}: the kernel did not return in {timeout + 10:.0f} s", flush=True)
                os._exit(2)
        return time.perf_counter() - t

    res = dict(backend="torch symmetric memory" if cuda else "POSIX shm", rendezvous_s=round(t_rdv, 3))
    # (1) flags raised from the host while the grid spins
    epoch = ws.next_epoch()
    dog = fused._Watchdog(ws, timeout)

    def raise_flags():
        time.sleep(0.2)
        with ws.on("copy"):
            for f in range(chunks):
                ws.store(ws.flags()[f:f + 1], epoch)

    t = time.perf_counter()
    threading.Thread(target=raise_flags, daemon=True).start()
    consume(epoch)
    finished("consumer waiting on host-raised flags")
    dog.stop()
    res["flags_landed_s"] = round(time.perf_counter() - t, 3)
    res["flags_ok"] = not dog.fired and not int(ws.abort_word()[0])
    res["max_err"] = (out.float() - (a.float() @ b.float())).abs().max().item()
    # (2) nobody raises the flags: the watchdog's abort must end the grid
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


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes (runs under the interpreter on a CPU)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", default="gpu_check.json")
    args = p.parse_args(argv)
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
    wcheck = workspace_check(dev)
    print(f"workspace ({wcheck['backend']}): {wcheck}", flush=True)
    rows = []
    t0 = time.time()
    for M, K, N in shapes:
        rows.append(ag_gemm(M // world, K, N, world, dtype, dev, args.reps))
        rows.append(gemm_rs(M, K, N, world, dtype, dev, args.reps))
        print(f"[{time.time() - t0:5.0f} s] {rows[-2]}\n{' ' * 9}{rows[-1]}", flush=True)
    print(f"\ndevice: {torch.cuda.get_device_name() if dev.type == 'cuda' else 'cpu (interpreter)'}, "
          f"torch {torch.__version__}, bf16, world {world} emulated")
    print(f"{'kernel':8} {'M':>6} {'K':>6} {'N':>6} {'fused TF/s':>10} {'mm TF/s':>8} {'fused/mm':>8} "
          f"{'+producer':>9} {'max err':>8}")
    for r in rows:
        wp = f"{r['tflops_with_producer']:.0f}" if r.get("tflops_with_producer") else "-"
        print(f"{r['kernel']:8} {r['M']:6} {r['K']:6} {r['N']:6} {r['tflops_fused']:10.1f} {r['tflops_mm']:8.1f} "
              f"{r['ratio']:8.2f} {wp:>9} {r['max_err']:8.3g}")
    with open(args.out, "w") as f:
        json.dump(dict(device=str(dev), torch=torch.__version__, workspace=wcheck, rows=rows), f, indent=1)
    bad = [r for r in rows if r["max_err"] > 0.02 * max(1.0, r["ref_scale"])]
    if bad:
        raise SystemExit(f"numerics: {len(bad)} kernel(s) off the reference by more than 2% of its scale")
    if not (wcheck["flags_ok"] and wcheck["abort_ok"] and wcheck["max_err"] < 0.05):
        raise SystemExit(f"workspace check failed: {wcheck}")


if __name__ == "__main__":
    main()
