"""Same-run A/B of the capacity MoE layer at fixed chunk counts: the baseline, overlapc as
built (dispatch chunks issued one at a time, each after the previous one arrived), and
overlapc with every dispatch chunk issued at once (the scheduling edges of
passes/all_to_all._one_at_a_time left out). Emulated cluster, interleaved rounds.

    sudo python -m benchmarks.experiments.ab_moe --world 4 --rate 350 --mode train --chunks 2 4

Prints the median step times (ms) per chunk count. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import torch.distributed as dist

from benchmarks import common, harness

MODEL = dict(
    tokens=1024, dim=1024, hidden=2048, n_experts=8, top_k=2, capacity_factor=1.25, expert_form="bmm", dtype="float32"
)


def ab_job(mode: str, chunks, iters: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from overlapc import Backend, Options
    from overlapc.models import moe
    from overlapc.passes import all_to_all

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    steps = {}
    edges = all_to_all._one_at_a_time
    for name in ("base", "one_at_a_time", "all_at_once"):
        o = (
            Options(inner="eager", strategy="none", schedule=False)
            if name == "base"
            else Options(inner="eager", strategy="decompose", chunks=chunks)
        )
        torch.manual_seed(0)
        model, inputs = moe.build_ep(mesh, **MODEL)
        step = harness._step_fn(torch.compile(model, backend=Backend(o)), model, inputs, mode)
        all_to_all._one_at_a_time = (lambda *a: None) if name == "all_at_once" else edges
        try:  # compiled on the first calls
            step()
            step()
        finally:
            all_to_all._one_at_a_time = edges
        steps[name] = step
    t = common.interleaved(steps, iters)
    return {k: round(statistics.median(v) * 1e3, 1) for k, v in t.items()}


def main(argv=None):
    from overlapc.testing.cluster import EmulatedCluster

    p = argparse.ArgumentParser(prog="python -m benchmarks.experiments.ab_moe")
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--rate", type=float, default=350.0, help="link rate, Mbit/s")
    p.add_argument("--mode", default="train", choices=["train", "forward"])
    p.add_argument("--chunks", nargs="+", default=["2", "4"])
    p.add_argument("--iters", type=int, default=7)
    args = p.parse_args(argv)
    EmulatedCluster.cleanup_stale()
    with EmulatedCluster(args.world, rate_mbit=args.rate) as cluster:
        with cluster.world(timeout=1800) as world:
            for ch in args.chunks:
                ch = ch if ch == "auto" else int(ch)
                r = world.run(ab_job, args.mode, ch, args.iters)[0]
                times = "  ".join(f"{k} {v} ms" for k, v in r.items())
                print(
                    f"world {args.world} {args.rate:g} Mbit/s {args.mode} chunks {ch}: {times}  speedup "
                    f"{r['base'] / r['one_at_a_time']:.2f}x (all at once {r['base'] / r['all_at_once']:.2f}x)",
                    flush=True,
                )


if __name__ == "__main__":
    main()
