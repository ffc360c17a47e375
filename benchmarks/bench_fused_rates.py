"""TFLOP/s of overlapc's fused GEMM kernels against torch.mm of the same shape, on one GPU with
the peers emulated as separate buffers (benchmarks/fused_peers.py). Kernel rates, not an
overlap speedup.

    python -m benchmarks.bench_fused_rates [--out FILE]   # on a CUDA machine
    python -m benchmarks.bench_fused_rates --smoke         # anywhere (CPU: interpreter, tiny shapes)

Per shape (M x K x N, M = 8 * M_L gathered rows, bf16 LLM shapes):

- ``ag_gemm``: the AllGather+GEMM consumer with every flag up (the GEMM alone);
- ``gemm_rs``: the GEMM+ReduceScatter producer writing 8 owner buffers;
- ``ag_gemm+producer`` (first shape, one config): the consumer while a producer on a side
  stream fills the gathered buffer chunk by chunk;
- ``grouped_mm``: ``overlapc::grouped_mm`` against the loop of mms it replaces and
  ``torch._grouped_mm``.

Otherwise every candidate of ``overlapc.kernels.gemm.configs`` is timed and the best kept
(``benchmarks.common.kernel_seconds``: device time, medians of ``triton.testing.do_bench``).
Numerics are tests/gpu's; ``max_err`` here only shows that the best config computed the
product. Measured on one H100: BENCHMARKS.md, "Fused kernels on one H100".
"""

from __future__ import annotations

import argparse
import json
import time
import traceback

import torch

from benchmarks.common import kernel_seconds
from benchmarks.fused_peers import (
    LLM_SHAPES,
    SMOKE_SHAPES,
    WORLD,
    AllGatherGemm,
    GemmReduceScatter,
    Pipelined,
    config_name,
    deadline,
    device_done,
    env,
    max_err,
)


def _tune(make, cands, reps) -> list[tuple[float, dict]]:
    """(seconds, config) of each candidate; one that fails to compile or run times as inf
    (and is named), unless all do."""
    timed, errors = [], []
    for c in cands:
        try:
            with deadline(f"timing config {config_name(c)}", 60):
                timed.append((kernel_seconds(make(c), reps), c))
        except Exception as e:  # e.g. a tile that needs more shared memory than the device has
            errors.append(f"{config_name(c)}: {type(e).__name__}: {str(e)[:200]}")
            timed.append((float("inf"), c))
    for e in errors:
        print(f"  config failed: {e}", flush=True)
    if len(errors) == len(cands):
        raise RuntimeError(f"every candidate config failed; first: {errors[0]}")
    return timed


def _row(kernel: str, shape: dict, flops: int, timed, t_mm: float, err: float) -> dict:
    t, cfg = min(timed, key=lambda x: x[0])
    return dict(
        kernel=kernel,
        **shape,
        tflops_fused=flops / t / 1e12,
        tflops_mm=flops / t_mm / 1e12,
        ratio=t_mm / t,
        max_err=err,
        config=config_name(cfg),
        per_config={config_name(c): flops / s / 1e12 for s, c in timed if s != float("inf")},
    )


def _mm_seconds(a, b, reps) -> float:
    with deadline("timing torch.mm", 60):
        return kernel_seconds(lambda: torch.mm(a, b), reps)


def ag_rate(M, K, N, dev, reps) -> dict:
    p = AllGatherGemm(M // WORLD, K, N, WORLD, torch.bfloat16, dev)
    p.fill()
    timed = _tune(lambda c: lambda: p.launch(c), p.configs(), reps)
    best = min(timed, key=lambda x: x[0])[1]
    p.out.zero_()
    p.launch(best)
    device_done(f"ag_gemm consumer {M}x{K}x{N} with every flag up", 30)
    err = max_err(p.out, p.reference())
    return _row("ag_gemm", p.shape, p.flops, timed, _mm_seconds(p.buf, p.b, reps), err)


def rs_rate(M, K, N, dev, reps) -> dict:
    p = GemmReduceScatter(M, K, N, WORLD, torch.bfloat16, dev)
    timed = _tune(lambda c: p.producer(c)[0], p.configs(), reps)
    best = min(timed, key=lambda x: x[0])[1]
    errs = p.reduce(best)
    return _row("gemm_rs", p.shape, p.flops, timed, _mm_seconds(p.a, p.b, reps), errs["max_err"])


def pipelined_rate(M, K, N, dev, reps) -> dict:
    p = AllGatherGemm(M // WORLD, K, N, WORLD, torch.bfloat16, dev)
    cands = p.configs()
    cfg = cands[min(2, len(cands) - 1)]
    p.fill()
    p.launch(cfg)  # compiled before the watchdog's clock runs
    device_done(f"ag_gemm consumer {M}x{K}x{N} with every flag up", 30)
    with Pipelined(p, cfg, patience=20.0) as run:
        with deadline("timed pipelined ag_gemm calls", 35):
            t = kernel_seconds(run, reps)
        device_done("timed pipelined ag_gemm calls", 35)
        if run.starved:
            raise RuntimeError("ag_gemm: a timed pipelined call starved its producer (aborted after 20 s)")
    err = max_err(p.out, p.reference())
    t_mm = _mm_seconds(p.buf, p.b, reps)
    return _row("ag_gemm+producer", p.shape, p.flops, [(t, cfg)], t_mm, err)


def grouped_rate(dev, smoke: bool, reps: int) -> dict:
    """``grouped_mm`` over a dropless expert loop's groups (one empty), against the loop of
    mms it replaces and, where this torch has it on this device, ``torch._grouped_mm``."""
    from overlapc.runtime.grouped import grouped_mm

    dtype = torch.bfloat16
    g, e, k, n, rows = (4, 2, 64, 48, 16) if smoke else (16, 4, 4096, 2048, 1024)
    gen = torch.Generator(device="cpu").manual_seed(0)
    sizes = torch.randint(0, 2 * rows, (g,), generator=gen).tolist()
    sizes[1] = 0
    x = torch.randn(sum(sizes), k, generator=gen).to(dev, dtype)
    w = (torch.randn(e, k, n, generator=gen) * k**-0.5).to(dev, dtype)
    index = [i % e for i in range(g)]
    offs = torch.tensor(sizes, device=dev).cumsum(0).to(torch.int32)
    flops = 2 * sum(sizes) * k * n

    def loop():
        return torch.cat([r @ w[index[i]] for i, r in enumerate(x.split(sizes))])

    out = dict(kernel="grouped_mm", groups=g, experts=e, K=k, N=n, rows=sum(sizes))
    out["tflops_op"] = flops / kernel_seconds(lambda: grouped_mm(x, w, offs, index), reps) / 1e12
    out["tflops_loop"] = flops / kernel_seconds(loop, reps) / 1e12
    if dev.type == "cuda" and hasattr(torch, "_grouped_mm"):
        wg = w[index].contiguous()
        try:
            out["tflops_torch_grouped_mm"] = (
                flops / kernel_seconds(lambda: torch._grouped_mm(x, wg, offs=offs), reps) / 1e12
            )
        except Exception as ex:  # noqa: BLE001 -- a torch/GPU without the kernel: say so
            out["torch_grouped_mm"] = f"{type(ex).__name__}: {ex}"
    return out


def _num(v, fmt) -> str:
    return "-" if v is None else format(v, fmt)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny shapes (runs under the interpreter on a CPU)")
    p.add_argument("--reps", type=int, default=10)
    p.add_argument("--out", help="also write the results as one JSON file")
    p.add_argument("--budget", type=float, default=150.0, help="seconds after which no further measurement starts")
    args = p.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if dev.type == "cpu" and not args.smoke:
        p.error("no CUDA device: run with --smoke (interpreter, tiny shapes) or on a GPU machine")
    shapes = SMOKE_SHAPES if args.smoke else LLM_SHAPES
    reps = 1 if args.smoke else args.reps
    out = dict(env=env(dev), rows=[], errors=[])
    print(f"bench_fused_rates: {out['env']}", flush=True)
    jobs = [("gemm_rs", rs_rate, s) for s in shapes] + [("ag_gemm", ag_rate, s) for s in shapes]
    jobs.append(("ag_gemm+producer", pipelined_rate, shapes[0]))
    if dev.type == "cuda":  # where a hang that no guard covers sits (a tuning loop, say), every 45 s
        import faulthandler
        import sys

        faulthandler.dump_traceback_later(45, repeat=True, file=sys.stdout)
    t0 = time.time()
    for name, fn, (M, K, N) in jobs:
        if time.time() - t0 > args.budget:
            out["errors"].append(f"{name} {M}x{K}x{N}: skipped, past the {args.budget:.0f} s budget")
            continue
        try:
            row = fn(M, K, N, dev, reps)
            out["rows"].append(row)
            print(f"[{time.time() - t0:5.0f} s] {row}", flush=True)
        except Exception as e:
            out["errors"].append(f"{name} {M}x{K}x{N}: {type(e).__name__}: {e}")
            print(f"[{time.time() - t0:5.0f} s] FAIL {name} {M}x{K}x{N}\n{traceback.format_exc()}", flush=True)
    try:
        out["grouped"] = gr = grouped_rate(dev, args.smoke, reps)
        print(f"grouped_mm: {gr}", flush=True)
    except Exception as e:
        out["errors"].append(f"grouped_mm: {type(e).__name__}: {e}")
        print(f"FAIL grouped_mm\n{traceback.format_exc()}", flush=True)

    e = out["env"]
    print(f"\ndevice: {e['device']}, torch {e['torch']}, triton {e['triton']}, bf16, world {WORLD} emulated")
    print(
        f"{'kernel':16} {'M':>6} {'K':>6} {'N':>6} {'fused TF/s':>10} {'mm TF/s':>8} {'fused/mm':>8} "
        f"{'max err':>8}  config"
    )
    for r in out["rows"]:
        print(
            f"{r['kernel']:16} {r['M']:6} {r['K']:6} {r['N']:6} {_num(r['tflops_fused'], '.1f'):>10} "
            f"{_num(r['tflops_mm'], '.1f'):>8} {_num(r['ratio'], '.2f'):>8} {r['max_err']:8.3g}  {r['config']}"
        )
    for err in out["errors"]:
        print(f"error: {err}")
    print("RESULT " + json.dumps(dict(stage="rates", **out)), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    if out["errors"]:
        raise SystemExit(f"bench_fused_rates: {len(out['errors'])} error(s)")


if __name__ == "__main__":
    main()
