"""Same-run A/B of the Ulysses attention block: the baseline and overlapc with the
backward's all-to-all sites held at fixed chunk counts (per-site overrides; the cost
model still picks the axis that can honour the count, and everything else), under a
profile calibrated inside the cluster first. Emulated cluster, interleaved rounds.

    sudo python -m benchmarks.ab_ulysses --world 2 --rate 658 --backward-chunks auto 2 4

Prints the median step times (ms), each variant's chunk counts and speedups, and the time
it saves beside what the cost model predicts its rewritten sites save. A
measurement, not a test.
"""
from __future__ import annotations

import argparse
import os
import statistics

import torch
import torch.distributed as dist

from benchmarks import common, harness

MODEL = dict(dim=1024, n_heads=16, batch=2, seq=2048)


def ab_job(mode: str, profile: str, backward_chunks: list, iters: int):
    from torch.distributed.device_mesh import init_device_mesh

    from overlapc import Backend, Options
    from overlapc.models import ulysses

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    steps, chunks, saved = {}, {}, {}
    variants = [("base", None)] + [(f"backward {c}", c) for c in backward_chunks]
    for name, c in variants:
        o = (Options(inner="eager", strategy="none", schedule=False) if c is None else
             Options(inner="eager", strategy="decompose", chunks="auto", hardware=profile,
                     overrides={} if c == "auto" else {"backward:*": {"chunks": int(c)}}))
        torch.manual_seed(0)
        model, inputs = ulysses.build_ulysses(mesh, **MODEL)
        be = Backend(o)
        step = harness._step_fn(torch.compile(model, backend=be), model, inputs, mode)
        step()  # compiled on the first calls
        step()
        steps[name] = step
        saved[name] = round(harness.predicted_saving(be.report) * 1e3, 1)
        chunks[name] = sorted({(s.name.split(":")[0], s.chunks) for s in be.report.sites if s.status == "rewritten"})
    t = common.interleaved(steps, iters)
    return {k: round(statistics.median(v) * 1e3, 1) for k, v in t.items()}, chunks, saved


def main(argv=None):
    from benchmarks.cluster import EmulatedCluster

    p = argparse.ArgumentParser(prog="python -m benchmarks.ab_ulysses")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rate", type=float, default=658.0, help="link rate, Mbit/s")
    p.add_argument("--mode", default="train", choices=["train", "forward"])
    p.add_argument("--backward-chunks", nargs="+", default=["auto", "2", "4"])
    p.add_argument("--iters", type=int, default=11)
    args = p.parse_args(argv)
    EmulatedCluster.cleanup_stale()
    with EmulatedCluster(args.world, rate_mbit=args.rate) as cluster:
        with cluster.world(timeout=1800) as world:
            path, prof = harness._calibrated_profile(world, args.world, args.rate)
            try:
                t, chunks, saved = world.run(ab_job, args.mode, path, args.backward_chunks, args.iters)[0]
            finally:
                os.unlink(path)
    print(f"world {args.world} {args.rate:g} Mbit/s {args.mode}; profile overlap_loss {prof['overlap_loss']}, "
          f"concurrent_excess {prof.get('concurrent_excess')}, "
          f"comm_loss {prof.get('comm_loss')}")
    for k, v in t.items():
        print(f"  {k:12s} {v:8.1f} ms  speedup {t['base'] / v:.2f}x  saves {t['base'] - v:6.1f} ms, predicted "
              f"{saved[k]:6.1f} ms  chunks {chunks[k]}")


if __name__ == "__main__":
    main()
