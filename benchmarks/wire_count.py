"""Bytes on the wire per rank and step of the TP-only Llama (issue 33), counted.

    python -m benchmarks.wire_count [--world-sizes 2 4] [--modes train forward]

One step of each program in a gloo world (no link shaping: bytes do not depend on the rate),
its collectives counted from the compiled graphs as they run (benchmarks/common.wire_bytes).
The programs are bench_tp_only's, in the collective forms its 60 Mbit/s run chose (reported
per variant in its results): the baseline in gloo's own forms; no-auto-sp and default with
all-gathers (and default's reduce-scatters) as all-to-alls. Prints a markdown table.
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.distributed as dist

from benchmarks import common
from overlapc.testing.world import World

MODEL = dict(n_layers=1, dim=512, n_heads=8, ffn_dim=1408, vocab_size=256, batch=2, seq=256)
A2A = {"reduce_scatter": "all_to_all", "all_gather": "all_to_all"}
VARIANTS = {
    "baseline": {"strategy": "none", "schedule": False},
    "no-auto-sp": {"auto_sp": "off", **A2A},
    "default": dict(A2A),
}


def count_job(mode: str) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from overlapc import Backend, Options
    from overlapc.models.llama import build_tp

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    out = {}
    for name, opts in VARIANTS.items():
        torch._dynamo.reset()
        model, (tok,) = build_tp(mesh, **MODEL)
        be = Backend(Options(inner="eager", measure=False, adapt=0, **opts), keep_graphs=True)
        compiled = torch.compile(model, backend=be)
        if mode == "forward":
            with torch.no_grad():
                compiled(tok)
        else:
            compiled(tok).float().pow(2).mean().backward()
        out[name] = common.wire_bytes(be.graphs)
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.wire_count")
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--modes", nargs="+", default=["train", "forward"], choices=["train", "forward"])
    args = p.parse_args(argv)
    mib = lambda n: f"{n / 2**20:.2f}"  # noqa: E731
    print("| world | step | graph | " + " | ".join(VARIANTS) + " | default / baseline |")
    print("|---|---|---|" + "---|" * (len(VARIANTS) + 1))
    for w in args.world_sizes:
        with World(w, timeout=900) as world:
            for mode in args.modes:
                res = world.run(count_job, mode)[0]
                kinds = ("inference",) if mode == "forward" else ("forward", "backward")
                for k in kinds:
                    cells = [mib(res[v].get(k, 0)) for v in VARIANTS]
                    ratio = res["default"].get(k, 0) / max(res["baseline"].get(k, 1), 1)
                    print(f"| {w} | {mode} | {k} | " + " | ".join(cells) + f" | {ratio:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
