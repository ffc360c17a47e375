"""Command line: ahead-of-time explain and rewrite, on a fake process group (no devices).

    overlapc explain MODULE:CALLABLE --world-size N [--json] [--option k=v ...] [--arg k=v ...]
    overlapc rewrite MODULE:CALLABLE --world-size N -o DIR [--option k=v ...] [--arg k=v ...]
    overlapc rewrite MODULE:CALLABLE --world-size N --export OUT.pt2 [--option k=v ...]
    overlapc explain FILE.pt2 [--world-size N] [--option k=v ...]
    overlapc plan MODULE:CALLABLE --world-size N [--hardware PROFILE] [--json] [--trace FILE]
    overlapc calibrate --world-size N [--out FILE]

CALLABLE is called as ``CALLABLE(mesh, **args)`` with a 1-D DeviceMesh of N ranks and
returns ``(model, example_inputs)``. Everything runs in this one process on the fake
process group: shapes are right, values meaningless, nothing is sent. ``--export`` writes
the rewritten ``torch.export`` program (overlapc.rewrite) for a world of N with the same
group layout; ``explain FILE.pt2`` reports what overlapc does to a saved program.

Errors in what was typed (a MODULE:CALLABLE that does not import, a bad world size or
option) exit with status 2 and one line on stderr.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import os
import sys
from typing import Any

from .errors import OverlapError

EXIT_USAGE = 2


class UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    def error(self, message):
        raise UsageError(message)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(prog="overlapc", description="Computation-communication overlap for distributed PyTorch.")
    sub = p.add_subparsers(dest="cmd", required=True, parser_class=_Parser)

    def common(sp, world_required=True):
        sp.add_argument(
            "target",
            metavar="MODULE:CALLABLE",
            help="callable(mesh, **args) -> (model, example_inputs)"
            + ("" if world_required else "; or a saved torch.export program, FILE.pt2"),
        )
        sp.add_argument(
            "--world-size",
            "-w",
            type=_world_size,
            required=world_required,
            help="ranks in the mesh (>= 1)"
            + ("" if world_required else "; for FILE.pt2, default: read from its collectives"),
        )
        sp.add_argument(
            "--option",
            "-O",
            action="append",
            default=[],
            metavar="K=V",
            help="an overlapc option, e.g. chunks=4 (repeatable)",
        )
        sp.add_argument(
            "--arg",
            "-a",
            action="append",
            default=[],
            metavar="K=V",
            help="a keyword argument for CALLABLE, e.g. n_layers=2 (repeatable)",
        )

    ex = sub.add_parser("explain", help="report every matmul-collective site and what would be done")
    common(ex, world_required=False)
    ex.add_argument("--json", action="store_true", help="print the report as JSON")
    rw = sub.add_parser("rewrite", help="write the rewritten graphs' code and the report")
    common(rw)
    rw.add_argument("-o", "--out", metavar="DIR", help="output directory for the graphs' code and the report")
    rw.add_argument(
        "--export", metavar="OUT.pt2", help="export the model (torch.export), rewrite it and save the program here"
    )
    pl = sub.add_parser("plan", help="per-site predictions of the cost model for a cluster that need not be here")
    common(pl)
    pl.add_argument(
        "--hardware",
        "-H",
        default=None,
        metavar="PROFILE",
        help="profile name (cpu-local, cpu-default, h100-nvlink, h200-nvlink, ib-400g) or JSON file",
    )
    pl.add_argument("--json", action="store_true", help="print the predictions as JSON")
    pl.add_argument("--trace", metavar="FILE", help="write a Chrome trace (Perfetto) of one step; a PNG beside it")
    cal = sub.add_parser("calibrate", help="measure this machine's profile (GEMM rates, link alpha/beta)")
    cal.add_argument(
        "--world-size",
        "-w",
        type=_world_size,
        default=None,
        help="ranks of a local gloo world to spawn; leave it out under torchrun (RANK, WORLD_SIZE set): "
        "the launched world is measured, its own network",
    )
    cal.add_argument(
        "--out",
        "-o",
        default=None,
        metavar="FILE",
        help="where to write the profile (default: the cpu-local profile in ~/.cache/overlapc)",
    )
    return p


def _world_size(s: str) -> int:
    try:
        n = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {s!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be an integer >= 1, got {n}")
    return n


def _kv(items: list[str], what: str) -> dict[str, Any]:
    out = {}
    for item in items:
        if "=" not in item:
            raise UsageError(f"--{what} {item!r}: expected K=V")
        k, v = item.split("=", 1)
        try:
            out[k.strip()] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            out[k.strip()] = v  # a bare word: a string
    return out


def load_target(spec: str):
    if spec.count(":") != 1:
        raise UsageError(f"{spec!r} is not MODULE:CALLABLE (e.g. overlapc.models.llama:build_tp_sp)")
    mod_name, attr = spec.split(":")
    if os.getcwd() not in sys.path:
        sys.path.insert(0, os.getcwd())
    try:
        mod = importlib.import_module(mod_name)
    except Exception as e:  # ImportError, or an error raised while importing it
        raise UsageError(f"cannot import module {mod_name!r}: {type(e).__name__}: {e}") from None
    obj = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise UsageError(f"module {mod_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise UsageError(f"{spec!r} is not callable")
    return obj


def fake_world(world_size: int):
    """A fake process group of ``world_size`` ranks in this process, and its 1-D mesh."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    return init_device_mesh("cpu", (world_size,))


def build(args):
    from .options import Options

    opts = Options.from_user(_kv(args.option, "option"))
    target = load_target(args.target)
    mesh = fake_world(args.world_size)
    try:
        built = target(mesh, **_kv(args.arg, "arg"))
    except TypeError as e:
        raise UsageError(f"{args.target}(mesh, ...) failed: {e}") from None
    except ValueError as e:
        raise UsageError(f"{args.target}(mesh, ...) rejected its arguments: {e}") from None
    if not (isinstance(built, tuple) and len(built) == 2):
        raise UsageError(f"{args.target} must return (model, example_inputs); got {type(built).__name__}")
    model, inputs = built
    if not isinstance(inputs, (tuple, list)):
        inputs = (inputs,)
    return model, tuple(inputs), opts


def _saved_program(args):
    """A saved torch.export program, and a fake world of the size its collectives were
    exported for (or --world-size)."""
    import torch

    from .passes import ops

    if not os.path.isfile(args.target):
        raise UsageError(f"no such file: {args.target!r}")
    try:
        ep = torch.export.load(args.target)
    except Exception as e:  # noqa: BLE001 - whatever torch.export.load raises, one line
        raise UsageError(f"cannot load {args.target!r} as a torch.export program: {type(e).__name__}: {e}") from None
    # all-gathers and reduce-scatters carry their group's size; other collectives resolve it
    sizes = {ops.world_size(n) for n in ep.graph.nodes if n.target in (ops.ALL_GATHER, ops.REDUCE_SCATTER)} - {None}
    has_comm = any(ops.is_collective(n) for n in ep.graph.nodes)
    if args.world_size is None and has_comm and not sizes:
        raise UsageError(
            f"{args.target}: its collectives do not record their group's size (all-reduces, "
            "all-to-alls): give --world-size N"
        )
    world = args.world_size or (max(sizes) if sizes else 1)
    fake_world(world)
    return ep, world


def cmd_explain(args) -> int:
    from .explain import explain

    if args.target.endswith(".pt2"):
        from collections import Counter

        from .export import rewrite
        from .passes import ops

        ep, world = _saved_program(args)
        # What the program holds (strategy "none"), unless options ask what a rewrite would do.
        new = rewrite(ep, options=_kv(args.option, "option") or {"strategy": "none"})
        if args.json:
            print(new.overlapc_report.to_json())
            return 0
        held = Counter(ops.collective_name(n) for n in ep.graph.nodes if ops.is_collective(n))
        print(
            f"{args.target}: a program for a world of {world}; collectives: "
            + (", ".join(f"{k} x{v}" for k, v in sorted(held.items())) or "none")
        )
        print(str(new.overlapc_report))
        return 0
    if args.world_size is None:
        raise UsageError("explain MODULE:CALLABLE needs --world-size N")
    model, inputs, opts = build(args)
    report = explain(model, *inputs, options=opts)
    print(report.to_json() if args.json else str(report))
    return 0


def cmd_export(args, model, inputs, opts) -> int:
    import torch

    from .export import rewrite

    try:
        ep = torch.export.export(model, inputs)
    except Exception as e:  # noqa: BLE001 - torch.export's refusal, in one line
        first = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise UsageError(
            f"torch.export could not export {args.target}: {type(e).__name__}: {first} "
            "(DTensor-parallelized modules do not export; write the layers with functional "
            "collectives, e.g. overlapc.models.megatron)"
        ) from None
    new = rewrite(ep, options=opts)
    torch.export.save(new, args.export)
    print(str(new.overlapc_report))
    print(f"wrote {args.export}: a program for a world of {args.world_size} with the same process groups")
    return 0


def cmd_rewrite(args) -> int:
    from .explain import capture

    if not args.out and not args.export:
        raise UsageError("rewrite needs -o DIR (the graphs' code and the report) or --export OUT.pt2, or both")
    model, inputs, opts = build(args)
    if args.export:
        cmd_export(args, model, inputs, opts)
        if not args.out:
            return 0
    report, graphs = capture(model, *inputs, options=opts)
    os.makedirs(args.out, exist_ok=True)
    counts: dict[str, int] = {}
    written = []
    for kind, gm in graphs:
        i = counts.get(kind, 0)
        counts[kind] = i + 1
        path = os.path.join(args.out, f"{kind}_{i}.py")
        with open(path, "w") as f:
            f.write(f"# overlapc rewrite of {args.target} (world size {args.world_size}), {kind} graph {i}\n")
            f.write(gm.print_readable(print_output=False))
        written.append(path)
    with open(os.path.join(args.out, "report.json"), "w") as f:
        f.write(report.to_json())
    with open(os.path.join(args.out, "report.txt"), "w") as f:
        f.write(str(report) + "\n")
    print(str(report))
    print(f"wrote {len(written)} graphs, report.json and report.txt to {args.out}")
    return 0


def cmd_plan(args) -> int:
    from .explain import explain
    from .plan_view import plan_json, plan_table, write_trace

    if args.hardware is not None:
        args.option = [*args.option, f"hardware={args.hardware!r}"]
    model, inputs, opts = build(args)
    report = explain(model, *inputs, options=opts)
    if args.json:
        print(plan_json(report, opts))
    else:
        print(plan_table(report, opts))
    if args.trace:
        for path in write_trace(report, opts, args.trace):
            print(f"wrote {path}")
    return 0


def cmd_calibrate(args) -> int:
    import os

    from .calibrate import main as calibrate
    from .calibrate import main_launched

    if args.world_size is None:
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise UsageError(
                "calibrate: give --world-size N to spawn a local world, or run it under torchrun "
                "(torchrun --nproc-per-node N [--nnodes ...] -m overlapc calibrate --out FILE)"
            )
        path = main_launched(args.out)
        if path:
            print(f"wrote {path}")
        return 0
    path = calibrate(args.world_size, args.out)
    print(f"wrote {path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    try:
        args = _parser().parse_args(argv)
        return {"explain": cmd_explain, "rewrite": cmd_rewrite, "plan": cmd_plan, "calibrate": cmd_calibrate}[args.cmd](
            args
        )
    except (UsageError, OverlapError) as e:
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"overlapc: error: {msg}", file=sys.stderr)
        return EXIT_USAGE


if __name__ == "__main__":
    sys.exit(main())
