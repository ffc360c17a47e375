"""Benchmark: tensor parallelism without sequence parallelism (issue 33), baseline vs overlapc.

    sudo python -m benchmarks.bench_tp_only [--model tp|hf] [--rates 60] [--world-sizes 2 4]
                                            [--modes train forward]

Models: ``tp``, the reference Llama under its TP-only plan (models/llama.tp_plan); ``hf``,
transformers' ``LlamaForCausalLM`` under its own ``tp_plan="auto"`` (transformers and accelerate
installed). Per (rate, world, mode), one emulated cluster and one interleaved run
(benchmarks/harness.py) times the baseline and, in the same run:

- default: no options (``hardware=None``);
- no-auto-sp: defaults with ``auto_sp="off"`` (coalescing and chunked all-reduces only: the
  all-reduces stay all-reduces);
- decompose: ``strategy="decompose"`` under a profile calibrated inside the cluster.

Wire bytes are counted from each compiled step's collectives (benchmarks/common.wire_bytes).
Writes benchmarks/reports/DATE_HOST_tp_only_MODEL.md and a section of BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile

import torch
import torch.distributed as dist

from benchmarks import common, harness

MODELS = {
    # Wire-bound at 60 Mbit/s: each activation all-reduce (1 MiB) takes ~0.14 s on the link.
    "tp": (
        "overlapc.models.llama:build_tp",
        "TP-only Llama",
        dict(n_layers=1, dim=512, n_heads=8, ffn_dim=1408, vocab_size=256, batch=2, seq=256),
    ),
    "hf": (
        "benchmarks.bench_tp_only:build_hf",
        'transformers LlamaForCausalLM, tp_plan="auto"',
        dict(n_layers=1, dim=512, n_heads=8, ffn_dim=1408, vocab_size=256, batch=2, seq=256),
    ),
}
VARIANTS = [
    ["default", "hardware=null"],
    ["no-auto-sp", "hardware=null", "auto_sp=off"],
]
COLUMNS = ("default", "no-auto-sp", "decompose")


class _Logits(torch.nn.Module):
    """transformers' model as the harness steps it: token ids in, logits out."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids, use_cache=False).logits


def build_hf(mesh, *, n_layers, dim, n_heads, ffn_dim, vocab_size, batch, seq):
    """(module, inputs): a random LlamaForCausalLM saved and loaded back with transformers'
    TP plan, as a user loads a checkpoint (the same weights on every rank: one seed)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.distributed import DistributedConfig

    cfg = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=dim,
        intermediate_size=ffn_dim,
        num_hidden_layers=n_layers,
        num_attention_heads=n_heads,
        num_key_value_heads=n_heads,
        max_position_embeddings=seq,
    )
    # transformers saves on rank 0 only (whatever is_main_process says): rank 0 writes, every
    # rank reads the same files.
    torch.manual_seed(0)
    where = [tempfile.mkdtemp(prefix="overlapc-hf-") if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(where, src=0)
    path = where[0]
    if dist.get_rank() == 0:
        LlamaForCausalLM(cfg).save_pretrained(path)
    dist.barrier()
    model = LlamaForCausalLM.from_pretrained(
        path,
        distributed_config=DistributedConfig(tp_size=mesh.size(), tp_plan="auto"),
        device_mesh=mesh,
        dtype=torch.float32,
    )
    dist.barrier()
    if dist.get_rank() == 0:
        shutil.rmtree(path, ignore_errors=True)
    ids = torch.randint(0, vocab_size, (batch, seq), generator=torch.Generator().manual_seed(1))
    return _Logits(model), (ids,)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench_tp_only")
    p.add_argument("--model", choices=sorted(MODELS), default="tp")
    p.add_argument("--rates", type=float, nargs="+", default=[60])
    p.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    p.add_argument("--modes", nargs="+", default=["train", "forward"], choices=["train", "forward"])
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--inner", default="eager", choices=["eager", "inductor"])
    args = p.parse_args(argv)
    builder, title, model = MODELS[args.model]
    bench = harness.Bench(builder=builder, stem=f"tp_only_{args.model}", section="", title=title, describe="")
    rows = []
    for rate in args.rates:
        run_args = argparse.Namespace(
            world_sizes=args.world_sizes,
            modes=args.modes,
            rate=str(rate),
            inner=args.inner,
            chunks="auto",
            iters=args.iters,
            variant=VARIANTS,
            timeline=False,
        )
        rows += harness.run(bench, model, run_args)
    cmd = "sudo python -m benchmarks.bench_tp_only " + " ".join(sys.argv[1:] if argv is None else argv)
    write_report(args.model, title, model, rows, cmd)
    return 0


def _mib(n: int) -> str:
    return f"{n / 2**20:.1f}"


def write_report(name: str, title: str, model: dict, rows: list[dict], cmd: str) -> str:
    lines = [
        f"{title} ({', '.join(f'{k} {v}' for k, v in model.items())}, fp32, inner {rows[0]['inner']}), emulated "
        "cluster (one network namespace per rank, veth + tbf), one torch thread per rank, 2 CPU cores. "
        "Medians of interleaved steps; speedups against T_base in the same run. T_comm: the baseline's "
        "collectives replayed alone.",
        "",
        f"Reproduce: `{cmd}`",
        "",
        "| link Mbit/s | world | step | T_base | T_comm | T_compute | " + " | ".join(COLUMNS) + " |",
        "|---|---|---|---|---|---|" + "---|" * len(COLUMNS),
    ]
    for r in rows:
        v = {n: x["t"] for n, x in r.get("variants", {}).items()}
        v["decompose"] = r["t_overlapc"]
        lines.append(
            f"| {r['rate_mbit']:.0f} | {r['world_size']} | {r['mode']} | {r['t_base'] * 1e3:.0f} ms | "
            f"{r['t_comm'] * 1e3:.0f} ms | {r['t_compute'] * 1e3:.0f} ms | "
            + " | ".join(f"{v[n] * 1e3:.0f} ms ({r['t_base'] / v[n]:.2f}x)" if n in v else "n/a" for n in COLUMNS)
            + " |"
        )
    lines += [
        "",
        "Bytes each rank sends per step, MiB, counted from each compiled step's collectives (ring "
        "counts: an all-reduce 2(W-1)/W of its payload, a reduce-scatter (W-1)/W, an all-gather "
        "(W-1) times its input), baseline → no-auto-sp → default:",
        "",
        "| world | step | forward | backward | total ratio default / baseline |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        wire = r.get("wire", {})
        base, off, dflt = (wire.get(k, {}) for k in ("base", "no-auto-sp", "default"))
        graphs = ("inference",) if r["mode"] == "forward" else ("forward", "backward")
        cells = [" → ".join(_mib(v.get(g, 0)) for v in (base, off, dflt)) for g in graphs]
        if len(cells) == 1:
            cells.append("n/a")
        total = sum(base.values())
        ratio = f"{sum(dflt.values()) / total:.2f}" if total else "n/a"
        lines.append(f"| {r['world_size']} | {r['mode']} | {cells[0]} | {cells[1]} | {ratio} |")
    body = "\n".join(lines)
    return common.write_run_report(
        f"tp_only_{name}",
        f"TP without sequence parallelism: {title}",
        f"TP without sequence parallelism, {title} (issue 33)",
        body,
        rows,
    )


if __name__ == "__main__":
    sys.exit(main())
