"""The main job (`make demo`): a real 2-process CPU world compiles the reference TP+SP
Llama block with backend="overlapc", prints what it found and did, and checks outputs and
gradients against eager on every rank. Then what it is for:

- as root, two ranks on an emulated 100 Mbit/s link (overlapc/testing/cluster.py) time
  training steps of a wire-bound block, the baseline and backend="overlapc" with no options
  interleaved, and draw the two step times;
- otherwise, the planner's predicted timeline of that block on such a link (a fake world of 2).

Either way it names the PNG it wrote.

    python -m overlapc.demo [--world-size 2] [--inner inductor|eager] [--strategy auto|decompose|fuse|none]
                            [--show auto|measured|predicted|none] [--png overlapc_demo.png]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
import torch.distributed as dist

CONFIG = dict(n_layers=2, dim=128, n_heads=8, ffn_dim=256, vocab_size=128, batch=2, seq=64)
WIRE = dict(n_layers=1, dim=2048, n_heads=16, ffn_dim=5632, vocab_size=256, batch=1, seq=256)
"""A TP+SP block whose collectives take about as long as its compute at RATE_MBIT on 2 cores."""
RATE_MBIT = 100


def demo_job(inner: str, strategy: str, chunks):
    from torch.distributed.device_mesh import init_device_mesh

    import overlapc
    from overlapc.models import llama

    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    ref_model, (tokens,) = llama.build_tp_sp(mesh, **CONFIG)
    model, _ = llama.build_tp_sp(mesh, **CONFIG)
    options = {"inner": inner, "strategy": strategy, "chunks": chunks}
    table = str(overlapc.explain(model, tokens, options=options)) if rank == 0 else ""

    overlapc.reset_report()
    compiled = torch.compile(model, backend="overlapc", options=options)
    g = torch.Generator().manual_seed(7)
    t0 = time.perf_counter()
    out = compiled(tokens)
    weight = torch.randn(out.shape, generator=g)
    (out * weight).sum().backward()
    compile_s = time.perf_counter() - t0
    ref = ref_model(tokens)
    (ref * weight).sum().backward()

    # fp32; inductor fuses and vectorises reductions, so summation order differs from eager.
    tol = dict(rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(out, ref, **tol)
    worst = {"forward": (out - ref).abs().max().item()}
    for (name, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        a, b = p.grad.to_local(), q.grad.to_local()
        torch.testing.assert_close(a, b, **tol, msg=lambda m: f"rank {rank} grad {name}: {m}")
        worst[name] = (a - b).abs().max().item()
    report = overlapc.last_report()
    rewritten = sum(1 for s in report.sites if s.status == "rewritten")
    sites = sum(1 for s in report.sites if s.pattern != "collective")
    return {
        "rank": rank,
        "table": table,
        "max_err_forward": worst["forward"],
        "max_err_grad": max(v for k, v in worst.items() if k != "forward"),
        "n_grads": len(worst) - 1,
        "sites": sites,
        "rewritten": rewritten,
        "compile_s": compile_s,
    }


def timing_job(steps: int) -> dict:
    """On every rank: training steps of the WIRE block, the baseline (the captured graphs, no
    overlap) and backend="overlapc" with no options, interleaved after both settled (option
    adapt races its graphs in the first calls). Medians at the slowest rank."""
    from torch.distributed.device_mesh import init_device_mesh

    import overlapc
    from overlapc.models import llama
    from overlapc.runtime import adapt

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    runs = {}
    for name, backend in (("baseline", overlapc.backend(strategy="none", schedule=False)), ("overlapc", "overlapc")):
        torch.manual_seed(0)
        model, (tokens,) = llama.build_tp_sp(mesh, **WIRE)
        runs[name] = (torch.compile(model, backend=backend), model, tokens)

    def step(name):
        compiled, model, tokens = runs[name]
        model.zero_grad(set_to_none=True)
        dist.barrier()
        t0 = time.perf_counter()
        compiled(tokens).sum().backward()
        return time.perf_counter() - t0

    for name in runs:
        for _ in range(adapt.settle_calls(overlapc.Options().adapt)):
            step(name)
    times = {name: [] for name in runs}
    for i in range(steps):
        for name in list(runs)[:: 1 if i % 2 else -1]:  # alternate which goes first
            times[name].append(step(name))
    medians = torch.tensor([statistics.median(times[n]) for n in runs])
    dist.all_reduce(medians, op=dist.ReduceOp.MAX)
    rep = overlapc.last_report()
    return {
        **dict(zip(runs, medians.tolist())),
        "rewritten": sum(s.status == "rewritten" for s in rep.sites),
        "kept": sorted({s.details["measured"]["kept"] for s in rep.sites if s.details.get("measured")}),
    }


def _bars(png: str, title: str, times: dict[str, float]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 2.4))
    names = list(times)
    ax.barh(names, [times[n] * 1e3 for n in names], color=["#888888", "#2a7ab9"])
    for i, n in enumerate(names):
        ax.text(times[n] * 1e3, i, f" {times[n] * 1e3:.0f} ms", va="center")
    ax.set_xlabel("training step (ms, median at the slowest rank)")
    ax.set_title(title, fontsize=9)
    ax.invert_yaxis()
    fig.tight_layout()
    fig.savefig(png, dpi=110)
    plt.close(fig)


def show_measured(png: str, steps: int = 7) -> list[str]:
    from overlapc.testing.cluster import EmulatedCluster

    print(f"\nmeasured: 2 ranks on an emulated {RATE_MBIT} Mbit/s link, training steps of a TP+SP block {WIRE}")
    EmulatedCluster.cleanup_stale()
    with EmulatedCluster(2, rate_mbit=RATE_MBIT) as cluster, cluster.world(timeout=1800) as world:
        r = world.run(timing_job, steps)[0]
    print(
        f"  baseline {r['baseline'] * 1e3:.0f} ms, backend='overlapc' {r['overlapc'] * 1e3:.0f} ms: "
        f"{r['baseline'] / r['overlapc']:.2f}x ({r['rewritten']} sites rewritten; "
        f"adapt kept: {', '.join(r['kept']) or '-'})"
    )
    title = f"2 ranks, {RATE_MBIT} Mbit/s: {r['baseline'] / r['overlapc']:.2f}x with backend='overlapc', no options"
    _bars(png, title, {"baseline": r["baseline"], "overlapc": r["overlapc"]})
    return [png]


def show_predicted(png: str) -> list[str]:
    """The planner's timeline of the WIRE block (fake world of 2) on a link of RATE_MBIT: this
    machine's built-in profile with its link slowed down to that rate."""
    from importlib import resources

    from overlapc.cli import fake_world
    from overlapc.explain import explain
    from overlapc.models import llama
    from overlapc.options import Options
    from overlapc.plan_view import write_trace

    prof = json.loads(resources.files("overlapc").joinpath("profiles/cpu-default.json").read_text())
    prof["name"] = f"cpu-default at {RATE_MBIT} Mbit/s"
    prof["link"]["beta_gbps"] = RATE_MBIT / 8e3
    prof.pop("measured", None)  # its transfer curves are loopback's
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "profile.json")
        with open(path, "w") as f:
            json.dump(prof, f)
        opts = Options(hardware=path, measure=False)
        model, (tokens,) = llama.build_tp_sp(fake_world(2), **WIRE)
        report = explain(model, tokens, options=opts)
        written = write_trace(report, opts, png.rsplit(".", 1)[0] + ".json")
    rewritten = sum(s.status == "rewritten" for s in report.sites)
    print(f"\npredicted: the planner's timeline of a TP+SP block {WIRE}, 2 ranks, {RATE_MBIT} Mbit/s link")
    print(f"  {rewritten} sites rewritten (baseline above, overlapc's plan below; not run as root: no link to time)")
    return written


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m overlapc.demo")
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--inner", default="inductor", choices=["inductor", "eager"])
    # "decompose": the demo's model is small, below the size at which "auto" rewrites.
    p.add_argument("--strategy", default="decompose", choices=["auto", "decompose", "fuse", "none"])
    p.add_argument("--chunks", default="auto")
    p.add_argument("--show", default="auto", choices=["auto", "measured", "predicted", "none"])
    p.add_argument("--png", default="overlapc_demo.png")
    args = p.parse_args(argv)
    chunks = args.chunks if args.chunks == "auto" else int(args.chunks)

    from overlapc.testing.world import World, WorldError

    print(
        f"overlapc demo: {args.world_size} gloo ranks on CPU, Llama-style TP+SP model "
        f"({CONFIG['n_layers']} layers, dim {CONFIG['dim']}), backend='overlapc', inner={args.inner}"
    )
    with World(args.world_size, timeout=900) as world:
        try:
            results = world.run(demo_job, args.inner, args.strategy, chunks)
        except WorldError as e:
            print(f"FAILED: {e}", file=sys.stderr)
            return 1
    print("\nexplain (rank 0):")
    print(results[0]["table"])
    print()
    for r in results:
        print(
            f"rank {r['rank']}: {r['sites']} sites in the compiled graphs, {r['rewritten']} rewritten; "
            f"forward max |diff| vs eager {r['max_err_forward']:.2e}, "
            f"{r['n_grads']} grads max |diff| {r['max_err_grad']:.2e} "
            f"(first step incl. compile {r['compile_s']:.1f} s)"
        )
    print("\nOK: outputs and gradients equal eager on every rank (fp32, rtol 1e-4, atol 1e-5).")
    show = args.show
    if show == "auto":  # the emulated link needs root, ip and tc
        show = "measured" if os.geteuid() == 0 and shutil.which("ip") and shutil.which("tc") else "predicted"
    if show != "none":
        for path in (show_measured if show == "measured" else show_predicted)(args.png):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
