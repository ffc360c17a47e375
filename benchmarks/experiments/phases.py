"""Forward and backward of the TP+SP training step timed apart, same run: the baseline, row
chunks alone, micro-batch slices alone and the default (``microbatches="auto"``: the
planner's choice per graph), on an emulated cluster, under a profile calibrated inside it.

    sudo python -m benchmarks.experiments.phases --world 2 --rate 532 [--iters 9]

The step's two graphs are planned apart, so whether the planner picked right for each shows
only per phase: a whole-step time mixes both. Every call is synchronous on CPU (gloo's waits
are in the graphs), so the forward's time ends when its last collective has. Prints median
ms per phase. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import random
import statistics

import torch
import torch.distributed as dist

from benchmarks import common, harness

MODEL = dict(n_layers=2, dim=1024, n_heads=16, ffn_dim=2816, vocab_size=256, batch=2, seq=512)  # make bench's


def phases_job(profile: str, iters: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from overlapc import Backend, Options

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    variants = {
        "baseline": dict(strategy="none", schedule=False),
        "row chunks": dict(strategy="decompose", microbatches=1),
        "slices": dict(strategy="none", microbatches=2),
        "default": dict(strategy="decompose"),
    }
    forwards = {}
    for name, opts in variants.items():
        torch.manual_seed(0)
        model, inputs = harness._build({"builder": "overlapc.models.llama:build_tp_sp"})(mesh, **MODEL)
        compiled = torch.compile(model, backend=Backend(Options(inner="eager", hardware=profile, **opts)))

        def forward(compiled=compiled, model=model, inputs=inputs):
            for p in model.parameters():
                p.grad = None
            return compiled(*inputs).float().pow(2).mean()

        for _ in range(2):  # compiled on the first calls
            forward().backward()
        forwards[name] = forward
    out = {n: ([], []) for n in forwards}
    rng = random.Random(0)  # the same order on every rank
    for _ in range(iters):
        for n in rng.sample(list(forwards), len(forwards)):
            loss = []
            out[n][0].append(common.timed(lambda: loss.append(forwards[n]())))
            out[n][1].append(common.timed(lambda: loss[0].backward()))
    return {n: (statistics.median(f) * 1e3, statistics.median(b) * 1e3) for n, (f, b) in out.items()}


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.experiments.phases")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rate", type=float, default=532.0, help="link rate, Mbit/s")
    p.add_argument("--iters", type=int, default=9)
    args = p.parse_args(argv)
    times, _ = harness.run_calibrated(args.world, args.rate, phases_job, args.iters)
    print(f"TP+SP training step, world {args.world}, {args.rate:g} Mbit/s, medians of {args.iters}")
    for n, (f, b) in times.items():
        print(f"  {n:11s} forward {f:8.1f} ms  backward {b:8.1f} ms  step {f + b:8.1f} ms")


if __name__ == "__main__":
    main()
