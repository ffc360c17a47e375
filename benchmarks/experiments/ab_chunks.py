"""Same-run A/B of chunk counts on an all-to-all model (the Ulysses attention block, the
capacity MoE layer or the dropless one, as their benchmarks build them): the baseline and overlapc with the
sites matching ``--sites`` held at fixed chunk counts (per-site overrides; the cost model
still picks the axis that can honour the count, and everything else), under a profile
calibrated inside the cluster first. Emulated cluster, interleaved rounds.

    sudo python -m benchmarks.experiments.ab_chunks --model ulysses --world 2 --rate 658 --chunks auto 2 4
    sudo python -m benchmarks.experiments.ab_chunks --model moe --world 2 --rate 388 --chunks auto 3 4 6
    sudo python -m benchmarks.experiments.ab_chunks --model ulysses --world 4 --rate 266 --chunks 2 4 \
        --off addmm_partials
    sudo python -m benchmarks.experiments.ab_chunks --model dropless --world 4 --rate 140 --chunks auto 2 3 6

Prints the median step times (ms), each variant's chunk counts and speedups, and the time
it saves beside what the cost model predicts its rewritten sites save. A
measurement, not a test.
"""

from __future__ import annotations

import argparse
import json
import statistics

import torch
import torch.distributed as dist

from benchmarks import common, harness

_MOE = dict(tokens=1024, dim=1024, hidden=2048, n_experts=8, top_k=2, capacity_factor=1.25)
MODELS = {  # builder, keyword arguments (the defaults of bench_ulysses / bench_moe), sites held
    "ulysses": ("overlapc.models.ulysses:build_ulysses", dict(dim=1024, n_heads=16, batch=2, seq=2048), "backward:*"),
    "moe": ("overlapc.models.moe:build_ep", dict(_MOE, expert_form="bmm", dtype="float32"), "*"),
    "dropless": ("overlapc.models.moe:build_ep", dict(_MOE, form="dropless", dtype="bfloat16"), "*"),
}


def ab_job(
    profile: str,
    model_name: str,
    mode: str,
    sites: str,
    counts: list,
    iters: int,
    off: list | None = None,
    inner: str = "eager",
):
    from torch.distributed.device_mesh import init_device_mesh

    from overlapc import Backend, Options

    builder, kw, _ = MODELS[model_name]
    # the dropless form's split sizes come from .tolist(): keep them in the graph (as bench_moe does)
    torch._dynamo.config.capture_scalar_outputs = kw.get("form") == "dropless"
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    steps, chunks, saved, preds = {}, {}, {}, {}
    # "compute": the baseline with its collectives replaced by local copies (compute alone).
    # ``off``: boolean options also measured switched off, beside each count (same-run A/B).
    variants = [("base", None, {}), ("compute", None, {})] + [
        (f"{sites} {c}" + "".join(f" {o}=False" for o in flip), c, {o: False for o in flip})
        for c in counts
        for flip in ([], *([o] for o in off or []))
    ]
    for name, c, extra in variants:
        if name == "compute":
            be = harness.compute_alone(inner)
        elif c is None:
            be = Backend(Options(inner=inner, strategy="none", schedule=False))
        else:
            be = Backend(
                Options(
                    inner=inner,
                    strategy="decompose",
                    chunks="auto",
                    hardware=profile,
                    overrides={} if c == "auto" else {sites: {"chunks": int(c)}},
                    **extra,
                )
            )
        torch.manual_seed(0)
        model, inputs = harness._build({"builder": builder})(mesh, **kw)
        step = harness._step_fn(torch.compile(model, backend=be), model, inputs, mode)
        step()  # compiled on the first calls
        step()
        steps[name] = step
        saved[name] = round(harness.predicted_saving(be.report) * 1e3, 1)
        # ("chunks" in a prediction is the model's best count; "used_chunks" the site's.)
        preds[name] = {
            s.name: {**s.details["predicted"], "status": s.status, "used_chunks": s.chunks}
            for s in be.report.sites
            if s.details.get("predicted")
        }
        chunks[name] = sorted({(s.name.split(":")[0], s.chunks) for s in be.report.sites if s.status == "rewritten"})
    t = common.interleaved(steps, iters)
    return {k: round(statistics.median(v) * 1e3, 1) for k, v in t.items()}, chunks, saved, preds


def main(argv=None):
    p = argparse.ArgumentParser(prog="python -m benchmarks.experiments.ab_chunks")
    p.add_argument("--model", default="ulysses", choices=sorted(MODELS))
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--rate", type=float, default=658.0, help="link rate, Mbit/s")
    p.add_argument("--mode", default="train", choices=["train", "forward"])
    p.add_argument("--chunks", nargs="+", default=["auto", "2", "4"])
    p.add_argument(
        "--sites",
        default=None,
        help="the sites held at each count (a site-name glob; default: the Ulysses backward's, every MoE site)",
    )
    p.add_argument(
        "--off",
        nargs="*",
        default=[],
        metavar="OPTION",
        help="boolean options (e.g. addmm_partials) also measured set to False beside each count",
    )
    p.add_argument("--save", metavar="FILE", help="write the profile, times and every site's prediction as JSON")
    p.add_argument("--iters", type=int, default=11)
    p.add_argument("--inner", default="eager", choices=["eager", "inductor"])
    args = p.parse_args(argv)
    sites = args.sites or MODELS[args.model][2]
    (t, chunks, saved, preds), prof = harness.run_calibrated(
        args.world, args.rate, ab_job, args.model, args.mode, sites, args.chunks, args.iters, args.off, args.inner
    )
    if args.save:
        with open(args.save, "w") as f:
            json.dump({"args": vars(args), "profile": prof, "times_ms": t, "predicted": preds}, f, indent=1)
    print(
        f"{args.model}, world {args.world} {args.rate:g} Mbit/s {args.mode}, inner={args.inner}; "
        f"profile overlap_loss {prof['overlap_loss']}, "
        f"concurrent_excess {prof.get('concurrent_excess')}, "
        f"comm_loss {prof.get('comm_loss')}"
    )
    for k, v in t.items():
        print(
            f"  {k:28s} {v:8.1f} ms  speedup {t['base'] / v:.2f}x  saves {t['base'] - v:6.1f} ms, predicted "
            f"{saved[k]:6.1f} ms  chunks {chunks[k]}"
        )
        rw = [p for p in preds[k].values() if p["status"] == "rewritten" and "base_ms" in p]
        if rw:  # the model's view of what it rewrote, unrewritten (regions counted once)
            print(
                f"  {'':28s} model of the rewritten sites unchunked: {sum(p['base_ms'] for p in rw):.1f} ms "
                f"(comm {sum(p['comm_ms'] for p in rw):.1f}, GEMMs {sum(p['gemm_ms'] for p in rw):.1f})"
            )


if __name__ == "__main__":
    main()
