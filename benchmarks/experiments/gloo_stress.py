"""Stress gloo with functional collectives of two kinds in flight at once, over a shaped link.

    sudo python -m benchmarks.experiments.gloo_stress ag_rs --seconds 120 [--rate 532] [--lanes 2]

Each round issues what the row-chunked TP+SP forward issues around one MLP: an all-gather,
four reduce-scatters with a GEMM after each, another all-gather while the reduce-scatters
are in flight; then waits on all and checks every value. ``ag_ag`` has two all-gathers in
flight, ``rs_rs`` four reduce-scatters. Prints rounds and wrong results per rank, or the
failure. With ``--lanes N`` the all-gathers go, in turn, to N lanes (overlapc/runtime/lanes.py)
while the reduce-scatters stay on the group: the pattern overlapc's schedule issues on gloo.
With ``--forms all_to_all`` each round is compiled by overlapc with its collectives lowered to
all-to-all pieces (passes/forms.py, the default on gloo; its schedule off, so the issue order
is the one above), so every collective of the round is an all-to-all in flight at once.
Why: passes/schedule.py (what overlapc serializes on gloo). Not a test: the failures it
finds are rare (minutes), and it needs root for the cluster.
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.distributed as dist

ROWS, DIM = 256, 1024  # 1 MiB fp32 per rank and message: a chunk of the make-bench model


def stress_job(kind: str, seconds: float, lanes: int = 0, forms: str = "native") -> tuple[int, int]:
    import torch.distributed._functional_collectives as fc

    import overlapc
    from overlapc.runtime import lanes as lanes_mod

    g, r, w = dist.group.WORLD, dist.get_rank(), dist.get_world_size()
    names = [lanes_mod.lane_name(g.group_name, i) for i in range(lanes)]
    lanes_mod.ensure(names, 300.0)
    gathers = 0

    def gather_group():
        nonlocal gathers
        gathers += 1
        return names[gathers % lanes] if lanes else g

    weight = torch.randn(DIM, DIM)

    def issue(base, ys):
        # All-gather inputs are views into one buffer, as row chunks are.
        xs = [base[k * ROWS : (k + 1) * ROWS] for k in range(2)]
        ags, rss, acts = [], [], []
        if kind in ("ag_rs", "ag_ag"):
            ags.append(fc.all_gather_single(xs[0], 0, gather_group()))
        if kind == "ag_ag":
            ags.append(fc.all_gather_single(xs[1], 0, gather_group()))
        if kind in ("ag_rs", "rs_rs"):
            for y in ys:
                rss.append(fc.reduce_scatter_single(y, "sum", 0, g))
                acts.append(torch.relu(xs[0] @ weight))
        if kind == "ag_rs":
            ags.append(fc.all_gather_single(xs[1], 0, gather_group()))
        return ags, rss, acts

    if forms != "native":
        be = overlapc.backend(strategy="none", all_gather=forms, reduce_scatter=forms, schedule=False, inner="eager")
        issue = torch.compile(issue, backend=be, fullgraph=True)
    t0, rounds, wrong = time.time(), 0, 0
    while True:
        v = float(rounds % 7)
        base = torch.cat([torch.full((ROWS, DIM), r * 100 + v + k) for k in range(2)])
        ys = [torch.full((ROWS * w, DIM), float(r + 1 + k)) for k in range(4)]
        ags, rss, _ = issue(base, ys)
        del base
        for k, out in enumerate(ags):
            want = torch.cat([torch.full((ROWS, DIM), q * 100 + v + k) for q in range(w)])
            wrong += not torch.equal(fc.wait_tensor(out), want)
        for k, out in enumerate(rss):
            want = torch.full((ROWS, DIM), float(sum(q + 1 + k for q in range(w))))
            wrong += not torch.equal(fc.wait_tensor(out), want)
        rounds += 1
        # Every rank stops after the same round: a rank that checked its own clock alone
        # could start one more round than the others and wait on them forever.
        done = torch.tensor([float(time.time() - t0 >= seconds)])
        dist.all_reduce(done, op=dist.ReduceOp.MAX)
        if done.item():
            break
    return rounds, wrong


def main() -> int:
    from overlapc.testing.cluster import EmulatedCluster

    ap = argparse.ArgumentParser(prog="python -m benchmarks.experiments.gloo_stress")
    ap.add_argument("kind", choices=["ag_rs", "ag_ag", "rs_rs"])
    ap.add_argument("--seconds", type=float, default=120.0)
    ap.add_argument("--rate", type=float, default=532.0, help="link rate, Mbit/s")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--lanes", type=int, default=0, help="all-gathers on this many lanes (0: on the group)")
    ap.add_argument("--forms", choices=["native", "all_to_all"], default="native", help="collectives as all-to-alls")
    args = ap.parse_args()
    if args.lanes == 1 and args.kind != "rs_rs":
        ap.error("--lanes 1 puts both all-gathers of a round on one lane, which overlapc never does; use 0 or >= 2")
    with EmulatedCluster(args.world, args.rate) as cluster:
        world = cluster.world(timeout=args.seconds + 300)
        try:
            t = time.time()
            res = world.run(stress_job, args.kind, args.seconds, args.lanes, args.forms)
            print(
                f"{args.kind}, lanes {args.lanes}, forms {args.forms}: (rounds, wrong) per rank {res} "
                f"in {time.time() - t:.0f} s"
            )
            return int(any(bad for _, bad in res))
        except Exception as e:  # the finding: a hang (gloo's timeout) or a dead rank
            print(f"{args.kind}, lanes {args.lanes}: FAILED: {str(e)[-2000:]}")
            return 1
        finally:
            world.close()


if __name__ == "__main__":
    raise SystemExit(main())
