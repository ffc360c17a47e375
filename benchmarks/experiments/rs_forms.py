"""Reduce-scatter on gloo, three ways, on the emulated cluster: gloo's own reduce-scatter (an
all-reduce underneath), an all-to-all followed by the local sum of the blocks received, the
same in column pieces all in flight (what passes/forms.py lowers it to); and, for scale, an
all-reduce of the same input and an all-gather of one rank's share, by gloo and as all-to-all
pieces (each rank's share sent to every rank: the bytes of a ring all-gather). Medians of ``--reps``
barrier-separated calls per form, interleaved round by round, at the slowest rank.

    sudo python -m benchmarks.experiments.rs_forms [--rate 60] [--worlds 2 4] [--mib 1 4]

Writes benchmarks/reports/DATE_HOST_rs_forms.md and the section "Reduce-scatter on gloo" of
BENCHMARKS.md. A measurement, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as fc

from overlapc.passes import forms

FORMS = (
    "all_reduce",
    "reduce_scatter",
    "all_to_all + sum",
    "pieces + sum",
    "all_gather of the share",
    "all_gather as all-to-all pieces",
)


def forms_job(numel: int, reps: int) -> dict[str, float]:
    torch.set_num_threads(1)
    world, group = dist.get_world_size(), dist.group.WORLD
    x = torch.randn(numel)
    share = x[: numel // world].clone()

    def a2a_sum():
        got = fc.wait_tensor(fc.all_to_all_single(x, [numel // world] * world, [numel // world] * world, group))
        return got.view(world, -1).sum(0)

    def pieces_sum():  # what passes/forms.py issues: column pieces of every block, all in flight
        k = forms.piece_count(False, x.numel() * x.element_size(), world)
        blocks, cols = x.view(world, -1), numel // world
        bounds = forms.piece_bounds(cols, k)
        sends = [blocks[:, lo:hi].contiguous() for lo, hi in zip(bounds, bounds[1:])]
        outs = [fc.all_to_all_single(t, [1] * world, [1] * world, group) for t in sends]
        return torch.cat([fc.wait_tensor(o).sum(0) for o in outs])

    def gather_pieces():  # the share sent to every rank by all-to-alls: what an all-gather moves
        k = forms.piece_count(True, share.numel() * share.element_size(), world)
        copies, cols = share.expand(world, -1), share.numel()
        bounds = forms.piece_bounds(cols, k)
        sends = [copies[:, lo:hi].contiguous() for lo, hi in zip(bounds, bounds[1:])]
        outs = [fc.all_to_all_single(t, [1] * world, [1] * world, group) for t in sends]
        return torch.cat([fc.wait_tensor(o) for o in outs], 1).reshape(-1)

    run = {
        "all_gather as all-to-all pieces": gather_pieces,
        "pieces + sum": pieces_sum,
        "all_reduce": lambda: fc.wait_tensor(fc.all_reduce(x, "sum", group)),
        "reduce_scatter": lambda: fc.wait_tensor(fc.reduce_scatter_tensor(x, "sum", 0, group)),
        "all_to_all + sum": a2a_sum,
        "all_gather of the share": lambda: fc.wait_tensor(fc.all_gather_tensor(share, 0, group)),
    }
    torch.testing.assert_close(run["all_to_all + sum"](), run["reduce_scatter"](), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(run["pieces + sum"](), run["reduce_scatter"](), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(
        run["all_gather as all-to-all pieces"](), run["all_gather of the share"](), rtol=0, atol=0
    )
    times: dict[str, list[float]] = {f: [] for f in FORMS}
    for _ in range(reps):
        for f in FORMS:
            dist.barrier()
            t = time.perf_counter()
            run[f]()
            slowest = torch.tensor([time.perf_counter() - t])
            dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
            times[f].append(slowest.item())
    return {f: statistics.median(v) for f, v in times.items()}


def main(argv=None) -> int:
    from benchmarks import common
    from overlapc.testing.cluster import EmulatedCluster

    p = argparse.ArgumentParser(prog="python -m benchmarks.experiments.rs_forms")
    p.add_argument("--rate", type=float, default=60.0, help="link rate, Mbit/s")
    p.add_argument("--worlds", type=int, nargs="+", default=[2, 4])
    p.add_argument("--mib", type=float, nargs="+", default=[1, 4], help="input size per rank, MiB (fp32)")
    p.add_argument("--reps", type=int, default=5)
    args = p.parse_args(argv)
    rows = []
    for w in args.worlds:
        with EmulatedCluster(w, rate_mbit=args.rate) as cluster:
            world = cluster.world(timeout=900)
            try:
                for mib in args.mib:
                    numel = int(mib * 2**20) // 4 // w * w
                    t = world.run(forms_job, numel, args.reps)[0]
                    rows.append({"world": w, "mib": mib, **t})
                    print(rows[-1], flush=True)
            finally:
                world.close()
    cmd = "sudo python -m benchmarks.experiments.rs_forms " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = [
        f"Emulated cluster at {args.rate:.0f} Mbit/s (one network namespace per rank, veth + tbf), gloo, fp32, "
        f"medians of {args.reps} calls at the slowest rank. Input: MiB per rank.",
        "",
        f"Reproduce: `{cmd}`",
        "",
        "| world | input | " + " | ".join(FORMS) + " | reduce-scatter / pieces + sum |",
        "|---|---|" + "---|" * (len(FORMS) + 1),
    ]
    for r in rows:
        cells = " | ".join(f"{r[f] * 1e3:.0f} ms" for f in FORMS)
        ratio = r["reduce_scatter"] / r["pieces + sum"]
        lines.append(f"| {r['world']} | {r['mib']:g} MiB | {cells} | {ratio:.2f}x |")
    common.write_run_report("rs_forms", "Reduce-scatter on gloo", "Reduce-scatter on gloo", "\n".join(lines), rows)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
