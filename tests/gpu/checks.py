"""Checks of the fused kernels and the ops built on them, on one GPU (peers emulated as
separate buffers, benchmarks/fused_peers.py) or on the CPU (Triton's interpreter, tiny shapes).

    python -m tests.gpu.checks --stage ag       # one stage per process on a GPU: a kernel that
    python -m tests.gpu.checks --list           #   never returns wedges the GPU context
    python -m tests.gpu.checks --smoke          # every stage in this process (CPU: interpreter)

tests/gpu/test_gpu_checks.py runs each stage in its own process under ``pytest -m gpu``;
scripts/gpu_check.sh runs them on a lent GPU without pytest; tests/test_fused_kernels.py runs
``--smoke`` on the CPU in the default suite. Stages (``STAGES``: name -> its deadline on a GPU):

- ``workspace``: overlapc's symmetric-memory workspace on a one-rank group, see ``workspace``.
- ``pipe``: the AG consumer while a producer on a side stream fills the gathered buffer chunk
  by chunk, under the op's watchdog; every call starts from a cleared buffer.
- ``ag``: the AG consumer with every flag up, each candidate config: ``cat(shards) @ B``.
- ``rs``: the RS producer into ``world`` owner buffers and rank 0's consumer, each candidate
  config: the sum of partial GEMMs, and every owner's slot.
- ``ops``: the fused ops between processes, one GPU each (skipped with fewer).
- ``grouped``: ``overlapc::grouped_mm`` against the loop it replaces (exact).
- ``ulysses``: the Ulysses block compiled, SDPA's kernel inside the head-chunked region.

Each stage returns a dict whose ``problems`` lists what failed (empty: passed); the CLI prints
it as one ``RESULT {json}`` line. Rates are benchmarks/bench_fused_rates.py's.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

from benchmarks.fused_peers import (
    LLM_SHAPES,
    SMOKE_SHAPES,
    WORLD,
    AllGatherGemm,
    GemmReduceScatter,
    Pipelined,
    config_name,
    device_done,
    env,
    join,
    max_err,
)


def _within(err: float, scale: float) -> bool:
    # bf16 outputs of K-long fp32 sums: 2% of the larger of 1 and the reference's magnitude.
    return err <= 0.02 * max(1.0, scale)


def _shapes(smoke: bool) -> list[tuple[int, int, int]]:
    """(M, K, N): one LLM shape, and one that is no multiple of any block size (the tiles'
    masks run, and Triton compiles the kernels without its divisibility hints)."""
    return SMOKE_SHAPES if smoke else [LLM_SHAPES[0], (WORLD * 1000, 1000, 1000)]


# ---------------------------------------------------------------------- kernels, emulated peers


def ag(dev, smoke: bool) -> dict:
    cases, problems = [], []
    for M, K, N in _shapes(smoke):
        p = AllGatherGemm(M // WORLD, K, N, WORLD, torch.bfloat16, dev)
        p.fill()
        ref = p.reference()
        for cfg in p.configs():
            p.out.zero_()  # each config's own result is checked, not an earlier one's
            p.launch(cfg)
            device_done(f"ag_gemm consumer {M}x{K}x{N} {config_name(cfg)} with every flag up", 30)
            case = dict(M=M, K=K, N=N, config=config_name(cfg), max_err=max_err(p.out, ref))
            case["ref_scale"] = ref.float().abs().max().item()
            cases.append(case)
            if not _within(case["max_err"], case["ref_scale"]):
                problems.append(f"ag_gemm {case}: error over 2% of the reference's scale")
    return dict(cases=cases, problems=problems)


def rs(dev, smoke: bool) -> dict:
    cases, problems = [], []
    for M, K, N in _shapes(smoke):
        p = GemmReduceScatter(M, K, N, WORLD, torch.bfloat16, dev)
        for cfg in p.configs():
            case = dict(M=M, K=K, N=N, config=config_name(cfg), **p.reduce(cfg))
            cases.append(case)
            if not _within(max(case["max_err"], case["slot_max_err"]), case["ref_scale"]):
                problems.append(f"gemm_rs {case}: error over 2% of the reference's scale")
    return dict(cases=cases, problems=problems)


def pipe(dev, smoke: bool, calls: int | None = None) -> dict:
    """``calls`` back-to-back calls, each from a cleared buffer and output (a tile that reads
    before its chunk lands reads zeros) and each checked."""
    M, K, N = _shapes(smoke)[0]
    p = AllGatherGemm(M // WORLD, K, N, WORLD, torch.bfloat16, dev)
    cands = p.configs()
    cfg = cands[min(2, len(cands) - 1)]
    p.fill()
    p.launch(cfg)  # compiled before the watchdog's clock runs
    device_done(f"ag_gemm consumer {M}x{K}x{N} with every flag already up", 30)
    # The exact reference is this kernel with its rows all in place: torch's GEMM sums in
    # another order, so its bf16 result differs by an ulp where a sum lies near a rounding
    # boundary, and a tile that read rows before they landed shows only against the kernel.
    alone = p.out.clone()
    ref = p.reference()
    errs, off = [], []
    calls = calls or (3 if smoke else 10)
    with Pipelined(p, cfg, patience=20.0) as run:
        for i in range(calls):
            p.buf.zero_()
            p.out.zero_()
            run()
            device_done(f"pipelined call {i}: consumer with the producer on a side stream (abort after 20 s)", 35)
            errs.append(max_err(p.out, ref))
            off.append(max_err(p.out, alone))
        starved = run.starved
    res = dict(M=M, K=K, N=N, config=config_name(cfg), calls=calls, max_err=max(errs), starved=starved)
    res["max_err_vs_alone"] = max(off)
    res["ref_scale"] = ref.float().abs().max().item()
    problems = ["pipe: the consumer starved its producer (the watchdog aborted it)"] if starved else []
    if res["max_err_vs_alone"] != 0.0:
        problems.append(f"pipe: pipelined calls differ from the consumer with every row in place (per call: {off})")
    if not _within(res["max_err"], res["ref_scale"]):
        problems.append(f"pipe: max err {res['max_err']:.3g} over 2% of the reference's scale (per call: {errs})")
    return dict(res, problems=problems)


# ---------------------------------------------------------------------- the runtime


def workspace(dev, smoke: bool, timeout: float = 10.0) -> dict:
    """overlapc's symmetric-memory workspace (overlapc/runtime/symm.py) on a group of one rank
    (nccl and torch's symmetric memory on a GPU; gloo and POSIX shm on the CPU), each part
    while a consumer grid spins on the workspace's flags: (1) a host thread raises the flags
    with ``SymmetricMemory.store`` from the copy stream (pinned-memory copies: they must land
    while the spinning tiles hold the SMs); (2) the AG copy engine's own work: device-to-device
    data chunks, each followed by its flag; (3) nine back-to-back calls issued as the op issues
    them; (4) nobody raises the flags, and the op's watchdog (``fused.Watchdog``, the abort
    word via the abort stream) must end the grid; last, since a grid it fails to end hangs."""
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
    M, K, N, chunks = (64, 32, 32, 4) if smoke else (16384, 1024, 1024, 64)
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
        device_done(f"workspace: {what}", timeout + 10)

    def ok(dog) -> bool:
        return not dog.fired and not int(ws.abort_word()[0])

    res = dict(backend="torch symmetric memory" if cuda else "POSIX shm", rendezvous_s=round(t_rdv, 3))
    # (1) flags raised from the host while the grid spins
    epoch = ws.next_epoch()
    dog = fused.Watchdog(ws, timeout)

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
    join(th, "raising flags", 30)
    dog.stop()
    res["flags_landed_s"] = round(time.perf_counter() - t, 3)
    res["flags_ok"] = ok(dog)
    res["max_err"] = max_err(out, a.float() @ b.float())
    print(f"workspace (1) flags: {res}", flush=True)
    # (2) the AG copy engine's own work while the grid spins: data chunks copied device to
    # device, each followed by its flag (fused.all_gather_matmul's producer, one rank).
    # Every part starts from a cleared buffer and output (a tile that read before its chunk
    # landed reads zeros), and successive calls copy different sources.
    srcs = [torch.randn(M, K, dtype=dtype, device=dev) for _ in range(2)]
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
    dog = fused.Watchdog(ws, timeout)
    t = time.perf_counter()
    th = threading.Thread(target=produce, args=(epoch, 0.2, srcs[0]), daemon=True)
    th.start()
    consume(epoch)
    finished("consumer waiting on device-to-device data copies and their flags")
    join(th, "the data copies", 30)
    ws.join("copy")
    dog.stop()
    res["data_landed_s"] = round(time.perf_counter() - t, 3)
    res["data_ok"] = ok(dog)
    res["data_max_err"] = max_err(out, srcs[0].float() @ b.float())
    print(f"workspace (2) data: {res}", flush=True)
    # (3) back-to-back calls as the op issues them: fork the copy stream, producer thread,
    # consumer, join
    consume(epoch)
    finished("one consumer with every flag up")
    t = time.perf_counter()
    consume(epoch)
    finished("one consumer with every flag up")
    res["consumer_alone_s"] = round(time.perf_counter() - t, 5)
    a.zero_()
    out.zero_()
    dog = fused.Watchdog(ws, timeout)
    t = time.perf_counter()
    n = 9  # odd: the last call copies srcs[0], the one before srcs[1]
    for i in range(n):
        epoch = ws.next_epoch()
        ws.fork("copy")
        th = threading.Thread(target=produce, args=(epoch, 0.0, srcs[i % 2]), daemon=True)
        th.start()
        consume(epoch)
        join(th, f"back-to-back call {i}'s copies", 30)
        ws.join("copy")
    finished(f"{n} back-to-back producer+consumer calls")
    dog.stop()
    res["pipelined_call_s"] = round((time.perf_counter() - t) / n, 5)
    res["pipelined_ok"] = ok(dog)
    res["pipelined_max_err"] = max_err(out, srcs[(n - 1) % 2].float() @ b.float())
    print(f"workspace (3) back-to-back: {res}", flush=True)
    # (4) nobody raises the flags: the watchdog's abort must end the grid
    epoch = ws.next_epoch()
    dog = fused.Watchdog(ws, 1.0)
    t = time.perf_counter()
    consume(epoch)
    finished("consumer waiting for the watchdog's abort")
    dog.stop()
    res["abort_after_s"] = round(time.perf_counter() - t, 3)
    res["abort_ok"] = dog.fired and bool(int(ws.abort_word()[0]))
    symm.release_all()
    dist.destroy_process_group()
    problems = [f"workspace: {k} is false" for k in ("flags_ok", "data_ok", "pipelined_ok", "abort_ok") if not res[k]]
    worst = max(res["max_err"], res["data_max_err"], res["pipelined_max_err"])
    if worst >= 0.05:  # K = 1024 (32 on the CPU), B scaled by K^-1/2: outputs of unit size
        problems.append(f"workspace: max err {worst:.3g} (want < 0.05)")
    return dict(res, problems=problems)


def ops_rank(rank: int, world: int, port: int) -> dict:
    """One rank of ``ops``: the fused ops themselves (``overlapc/runtime/fused.py``: the
    workspace rendezvous, the copy engine's thread and stream, pinned-memory stores into
    peers' signal words, done words, the watchdog) between processes. Every operand is made
    from a seed, so each rank computes the reference locally, without a collective."""
    import datetime

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
        timeout=datetime.timedelta(seconds=60),
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
            errs = []
            if kind == "ag":
                shards = [operand(10 * r + i, *shape, dtype=dtype) for r in range(world)]
                full = torch.cat(shards, d)
                Mg = full.numel() // K
                # Pinned: the tuner would time local scratch, and the handshake is what is checked.
                fused.pin_config("ag", Mg, N, K, dtype, dev, configs(Mg, N, K)[-1])
                ref = full.float() @ b.float()
                for _call in range(2):  # two calls: the second waits on the first's done words
                    g, outs = fused.all_gather_matmul(
                        shards[rank], [b], d, gname, chunks=4, timeout=15.0, return_a=True, min_flops=0
                    )
                    errs.append(max_err(outs[0], ref))
                    errs.append(max_err(g, full))
            else:
                parts = [operand(10 * r + i, *shape, dtype=dtype) for r in range(world)]
                M_O = parts[0].numel() // K // world
                fused.pin_config("rs", M_O, N, K, dtype, dev, configs(M_O, N, K)[-1])
                ref = sum(p.float() @ b.float() for p in parts).chunk(world, d)[rank]
                for _call in range(2):
                    out = fused.matmul_reduce_scatter(parts[rank], b, d, gname, timeout=15.0, min_flops=0)
                    errs.append(max_err(out, ref))
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


def ops(dev, smoke: bool, world: int = 2, timeout: float = 60.0) -> dict:
    """``world`` processes, one per GPU (on the CPU: gloo and POSIX shared memory), run the
    fused ops against each other: the ops' own path across processes, which the emulated
    peers above do not take. Each rank is a subprocess; all are killed after ``timeout``
    seconds. Torch's symmetric memory refuses two ranks on one GPU ("detected allocations
    from overlapping devices from different ranks", torch 2.11), so with fewer GPUs than
    ranks the stage is skipped."""
    if dev.type == "cuda" and torch.cuda.device_count() < world:
        return dict(
            world=world,
            ranks=[],
            problems=[],
            skipped=f"{torch.cuda.device_count()} GPU(s) for {world} ranks: torch's symmetric memory "
            "takes one rank per GPU",
        )
    import socket
    import subprocess

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "tests.gpu.checks", "--ops-world", str(world), "--port", str(port), "--ops-rank"]
    procs = [
        subprocess.Popen(cmd + [str(r)], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for r in range(world)
    ]
    end = time.monotonic() + timeout
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=max(1.0, end - time.monotonic()))[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            outs.append(p.communicate()[0] + f"\n(killed after {timeout:.0f} s)")
    ranks, problems = [], []
    for r, (p, text) in enumerate(zip(procs, outs)):
        line = [t for t in text.splitlines() if t.startswith("OPS_RESULT ")]
        if p.returncode == 0 and line:
            ranks.append(json.loads(line[-1][len("OPS_RESULT ") :]))
        else:
            print(f"FAIL ops rank {r} (exit {p.returncode}):\n{text[-3000:]}", flush=True)
            last = text.strip().splitlines()[-1] if text.strip() else "no output"
            problems.append(f"ops: rank {r} exited {p.returncode}: {last}")
    for r in ranks:
        problems += [f"ops rank {r['rank']}: {c}" for c in r["cases"] if not _within(c["max_err"], c["ref_scale"])]
        n = 2 * len(r["cases"])  # two calls per case and dtype, none falling back to the plain ops
        if r["fused_calls"] != n:
            problems.append(f"ops rank {r['rank']}: {r['fused_calls']} fused calls of {n} (the rest fell back)")
    return dict(world=world, ranks=ranks, problems=problems)


def grouped(dev, smoke: bool) -> dict:
    """overlapc::grouped_mm (a dropless expert loop regrouped, passes/expert_loop.py):
    forward and gradients against the loop it replaces, the same mm per group: exact."""
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
    errs = {t: max_err(a, b) for t, a, b in zip(("y", "dx", "dw"), res["op"], res["loop"])}
    problems = [f"grouped_mm differs from the loop it replaces: {errs}"] if any(errs.values()) else []
    return dict(groups=g, experts=e, K=k, N=n, rows=sum(sizes), max_err_vs_loop=errs, problems=problems)


def ulysses(dev, smoke: bool) -> dict:
    """The Ulysses block compiled by overlapc on this device, against eager: whichever fused
    attention kernel SDPA picks here (CUDA: flash, efficient or cuDNN) must stay inside the
    head-chunked region, called once per chunk in forward and backward (passes/axis.BATCHED),
    and the outputs and gradients must match eager's. A one-rank group (nccl on a GPU): the
    all-to-alls move nothing, the graphs are those of any world size."""
    import tempfile

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from overlapc import Backend, Options
    from overlapc.models import ulysses as ulysses_model
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
        ref, (x,) = ulysses_model.build_ulysses(mesh, **kw)
        model, _ = ulysses_model.build_ulysses(mesh, **kw)
        ref, model, x = ref.to(dev, dtype), model.to(dev, dtype), x.detach().to(dev, dtype)
        be = Backend(Options(strategy="decompose", inner="eager", chunks=chunks), keep_graphs=True)
        dy = torch.randn(x.shape, generator=torch.Generator().manual_seed(1)).to(dev, dtype)
        res = []
        for m, f in ((ref, ref), (model, torch.compile(model, backend=be))):
            xi = x.clone().requires_grad_()
            y = f(xi)
            y.backward(dy)
            res.append([y.detach(), xi.grad, *(p.grad for p in m.parameters())])
        errs = [max_err(a, b) for a, b in zip(*res)]
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
        problems = []
        if any(st != "rewritten" for _, _, st, _, _ in sites) or len(sites) != 4:
            problems.append(f"ulysses: not every all-to-all site rewritten: {sites}")
        for kind in ("forward", "backward"):
            got = {k for g, _, _, k, _ in sites if g == kind}  # chunks of heads, or of the batch (2)
            if len(got) != 1 or list(calls.get(kind, {}).values()) != list(got):
                problems.append(
                    f"ulysses {kind}: attention calls {calls.get(kind)} (want one op, once per chunk: {got})"
                )
        if not _within(max(errs), scale):
            problems.append(f"ulysses: max err {max(errs):.3g} against eager (scale {scale:.3g})")
        return dict(
            dtype=str(dtype),
            **kw,
            chunks=chunks,
            attention_calls=calls,
            sites=sites,
            max_err=max(errs),
            ref_scale=scale,
            problems=problems,
        )
    finally:
        dist.destroy_process_group()


# Order and deadlines (seconds on a GPU, the process's start and compiles included) for a run
# of one stage per process: the runtime's own handshakes first, so that a hang later costs them
# nothing; the stages that compile most last. The deadlines leave room: the parts of the check
# these stages come from took about 15 s each on an H100 (BENCHMARKS.md, fused kernels).
STAGES = {
    "workspace": (workspace, 60),
    "pipe": (pipe, 45),
    "ag": (ag, 60),
    "rs": (rs, 60),
    "ops": (ops, 75),
    "grouped": (grouped, 30),
    "ulysses": (ulysses, 90),
}


def run_stage(name: str, dev, smoke: bool) -> dict:
    """Stage ``name``'s result; an exception it raises becomes its problem."""
    import traceback

    t = time.perf_counter()
    try:
        res = STAGES[name][0](dev, smoke)
    except Exception as e:
        print(f"FAIL {name}\n{traceback.format_exc()}", flush=True)
        res = dict(problems=[f"{name}: {type(e).__name__}: {e}"])
    res["seconds"] = round(time.perf_counter() - t, 1)
    print("RESULT " + json.dumps(dict(stage=name, **res), default=str), flush=True)
    return res


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--stage", default="all", choices=["all", *STAGES], help="one stage (default: all, in order)")
    p.add_argument("--smoke", action="store_true", help="tiny shapes (runs under the interpreter on a CPU)")
    p.add_argument("--out", help="also write the results as one JSON file")
    p.add_argument("--list", action="store_true", help="print each stage and its deadline on a GPU, and exit")
    p.add_argument("--ops-rank", type=int, help=argparse.SUPPRESS)
    p.add_argument("--ops-world", type=int, help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.list:
        for name, (_, seconds) in STAGES.items():
            print(name, seconds)
        return
    if args.ops_rank is not None:  # one rank of the ops stage
        print("OPS_RESULT " + json.dumps(ops_rank(args.ops_rank, args.ops_world, args.port)), flush=True)
        return
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu" and not args.smoke:
        p.error("no CUDA device: run with --smoke (interpreter, tiny shapes) or on a GPU machine")
    if dev.type == "cuda":  # where a hang that no guard covers sits, every 45 s
        import faulthandler

        faulthandler.dump_traceback_later(45, repeat=True, file=sys.stdout)
    out = dict(env=env(dev), stages={})
    print(f"checks: {out['env']}", flush=True)
    for name in STAGES if args.stage == "all" else [args.stage]:
        out["stages"][name] = run_stage(name, dev, args.smoke)
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1, default=str)
    problems = [q for res in out["stages"].values() for q in res["problems"]]
    for q in problems:
        print(f"problem: {q}", flush=True)
    if problems:
        raise SystemExit(f"checks: {len(problems)} problem(s)")


if __name__ == "__main__":
    main()
