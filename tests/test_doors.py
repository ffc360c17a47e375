"""The three doors: torch.compile backend (by name, with options, as a callable), the
decorator (class, instance, function), explain() and the CLI; options validation."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

import overlapc
from overlapc import Options, OverlapError

# ---------------------------------------------------------------- options


def test_options_defaults_and_merge():
    o = Options.from_user({"chunks": 4}, inner="eager")
    assert o.chunks == 4 and o.inner == "eager" and o.strategy == "auto"
    assert Options.from_user(o, chunks=2).chunks == 2


@pytest.mark.parametrize(
    "bad,needle",
    [
        ({"chunk": 4}, "unknown option 'chunk' (did you mean 'chunks'?)"),
        ({"inner": "aot"}, "option 'inner' must be one of 'inductor', 'eager'; got 'aot'"),
        ({"strategy": "fast"}, "option 'strategy' must be one of 'auto', 'decompose', 'fuse', 'none'"),
        ({"chunks": 1}, "option 'chunks' must be 'auto' or an int >= 2; got 1"),
        ({"chunks": True}, "option 'chunks' must be 'auto' or an int >= 2"),
        ({"min_bytes": -1}, "option 'min_bytes' must be an int >= 0"),
        ({"timeout": 0}, "option 'timeout' must be a number of seconds > 0"),
        ({"overrides": {"*wo*": {"chunk": 2}}}, "per-site options allowed: strategy, chunks"),
        ({"overrides": {"*wo*": {"chunks": 0}}}, "option \"overrides['*wo*'].chunks\" must be 'auto' or an int >= 2"),
    ],
)
def test_options_errors_name_the_option(bad, needle):
    with pytest.raises(OverlapError) as e:
        Options.from_user(bad)
    assert needle in str(e.value)


def test_per_site_overrides():
    o = Options.from_user(overrides={"forward:*wo*": {"chunks": 8}, "*": {"strategy": "none"}})
    assert o.for_site("forward:layers.0.attention.wo:matmul_reduce_scatter") == {"strategy": "auto", "chunks": 8}
    assert o.for_site("backward:x:all_gather_matmul") == {"strategy": "none", "chunks": "auto"}


def test_bad_options_through_every_door():
    with pytest.raises(OverlapError):
        overlapc.backend(chunks=0)
    with pytest.raises(OverlapError):
        overlapc.overlap(inner="nope")
    with pytest.raises(OverlapError):
        overlapc.explain(lambda x: x, torch.ones(1), options={"bogus": 1})
    # By name, options reach the backend only when Dynamo compiles: Dynamo wraps the error.
    with pytest.raises(Exception, match="OverlapError: unknown option 'bogus'"):
        torch.compile(torch.nn.Linear(2, 2), backend="overlapc", options={"bogus": 1})(torch.ones(2))


# ---------------------------------------------------------------- registration


def test_listed_as_dynamo_backend():
    assert "overlapc" in torch._dynamo.list_backends()


def test_decorator_rejects_non_modules():
    with pytest.raises(OverlapError, match="only nn.Module subclasses, nn.Module instances and functions"):
        overlapc.overlap()(int)
    with pytest.raises(OverlapError):
        overlapc.overlap()(42)


# ---------------------------------------------------------------- doors in a real world


def doors_job():
    """Job: every door on a small AG -> mm -> RS program gives eager's result on this rank."""
    import torch.nn as nn

    import overlapc

    group = dist.group.WORLD
    torch.manual_seed(0)
    w_full = torch.randn(16, 24)

    def fn(x, w):
        g = funcol.all_gather_tensor(x, gather_dim=0, group=group)
        return funcol.reduce_scatter_tensor(g @ w, "sum", scatter_dim=0, group=group)

    class Lin(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(w_full.clone())

        def forward(self, x):
            return fn(x, self.w)

    torch.manual_seed(1 + dist.get_rank())
    x = torch.randn(4, 16)
    want = fn(x, w_full)
    got = {}
    got["name"] = torch.compile(fn, backend="overlapc", options={"inner": "eager"})(x, w_full)
    be = overlapc.backend(inner="eager")
    got["callable"] = torch.compile(fn, backend=be)(x, w_full)
    assert be.report.by(pattern="all_gather_matmul"), be.report

    @overlapc.overlap(inner="eager")
    class DecoratedLin(Lin):
        pass

    m = DecoratedLin()
    got["class"] = m(x)
    assert m.overlapc_report.sites, "the decorated class compiled"
    inst = overlapc.overlap(inner="eager")(Lin())
    got["instance"] = inst(x)
    assert isinstance(inst, Lin) and "w" in dict(inst.named_parameters())
    got["function"] = overlapc.overlap(inner="eager")(fn)(x, w_full)
    got["bare"] = overlapc.overlap(fn)  # @overlap without parentheses
    got["bare"] = got["bare"](x, w_full)
    for door, y in got.items():
        torch.testing.assert_close(y, want, rtol=0, atol=0, msg=lambda m: f"door {door}: {m}")
    return sorted(got)


@pytest.mark.distributed
def test_doors(world2):
    res = world2.run(doors_job)
    assert res[0] == sorted(["name", "callable", "class", "instance", "function", "bare"])


def explain_on_one_rank_job():
    """Job: explain() on rank 0 only must not issue a collective (rank 1 would never answer)."""
    from torch.distributed.device_mesh import init_device_mesh

    import overlapc
    from overlapc.models import llama

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, inputs = llama.build_tp_sp(mesh, n_layers=1, dim=64, n_heads=4, ffn_dim=128, vocab_size=64, seq=16)
    n = 0
    if dist.get_rank() == 0:
        report = overlapc.explain(model, *inputs)
        n = len(report.sites)
        # The real parameters are untouched (explain ran on fake copies).
        assert all(p.grad is None for p in model.parameters())
    # Both ranks then meet in one real collective: had explain issued one, they would mismatch.
    t = torch.tensor([float(dist.get_rank() + 1)])
    dist.all_reduce(t)
    assert t.item() == 3.0
    return n


@pytest.mark.distributed
def test_explain_runs_no_collective(world2):
    n0, n1 = world2.run(explain_on_one_rank_job, timeout=120)
    assert n0 > 0 and n1 == 0


def plans_disagree_job():
    """Job: rank r compiles with chunks=2+r. The ranks must refuse with the same clear error
    (naming the site and both plans) before any rewritten collective runs, not hang."""
    import overlapc
    from overlapc.errors import OverlapError

    group = dist.group.WORLD

    def fn(x, w):
        return funcol.all_gather_tensor(x, gather_dim=0, group=group) @ w

    x, w = torch.randn(8, 16), torch.randn(16, 8)
    opts = {"inner": "eager", "strategy": "decompose", "chunks": 2 + dist.get_rank()}
    try:
        torch.compile(fn, backend=overlapc.backend(**opts))(x, w)
    except Exception as e:  # dynamo wraps backend errors
        cause = e
        while cause is not None and not isinstance(cause, OverlapError):
            cause = cause.__cause__ or cause.__context__
        assert cause is not None, f"expected OverlapError, got {type(e).__name__}: {e}"
        msg = str(cause)
        assert "graph differently at site" in msg and "all_gather_matmul" in msg, msg
        assert "decompose/2" in msg and "decompose/3" in msg, msg
        # The world is still usable: nobody is stuck in a half-issued collective.
        t = torch.ones(1)
        dist.all_reduce(t)
        return t.item()
    raise AssertionError("ranks with different plans compiled without an error")


@pytest.mark.distributed
def test_ranks_that_plan_differently_fail_fast(world2):
    assert world2.run(plans_disagree_job, timeout=120) == [2.0, 2.0]


# ---------------------------------------------------------------- CLI


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "overlapc.cli", *args], capture_output=True, text=True, timeout=300)


def test_cli_explain_table_and_json():
    p = _cli("explain", "overlapc.models.llama:build_tp_sp", "--world-size", "8", "--arg", "n_layers=1")
    assert p.returncode == 0, p.stderr
    assert "all_gather_matmul" in p.stdout and "matmul_reduce_scatter" in p.stdout
    p = _cli("explain", "overlapc.models.llama:build_tp", "-w", "4", "--json", "-a", "n_layers=1")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    # 128 rows, 32 a rank: automatic sequence parallelism turns the two all-reduces of a
    # layer's forward into reduce-scatters under their matmuls
    assert d["summary"]["forward/all_reduce_rows"] == 1, d["summary"]
    assert d["summary"]["forward/matmul_reduce_scatter"] == 2, d["summary"]


def test_cli_rewrite_writes_graphs(tmp_path):
    p = _cli("rewrite", "overlapc.models.moe:build_ep", "-w", "2", "-o", str(tmp_path))
    assert p.returncode == 0, p.stderr
    names = sorted(f.name for f in tmp_path.iterdir())
    assert names == ["backward_0.py", "forward_0.py", "report.json", "report.txt"]
    assert "all_to_all_single" in (tmp_path / "forward_0.py").read_text()
    json.loads((tmp_path / "report.json").read_text())


@pytest.mark.parametrize(
    "args,needle",
    [
        (["explain", "no_such_module:build", "-w", "2"], "cannot import module 'no_such_module'"),
        (["explain", "overlapc.models.llama", "-w", "2"], "is not MODULE:CALLABLE"),
        (["explain", "overlapc.models.llama:nope", "-w", "2"], "has no attribute 'nope'"),
        (["explain", "overlapc.models.llama:build_tp", "-w", "zero"], "must be an integer >= 1"),
        (["explain", "overlapc.models.llama:build_tp", "-w", "0"], "must be an integer >= 1"),
        (["explain", "overlapc.models.llama:build_tp", "-w", "2", "-O", "chunks=1"], "option 'chunks'"),
        (["explain", "overlapc.models.llama:build_tp", "-w", "3"], "not divisible"),
        (["frobnicate"], "invalid choice"),
    ],
)
def test_cli_errors_exit_2_with_one_line(args, needle, capsys):
    if needle == "not divisible":  # builds the model (a process group): in its own process
        p = _cli(*args)
        code, err = p.returncode, p.stderr
    else:  # fails before any model exists: in this process, without ~1.4 s of start-up each
        from overlapc import cli

        try:
            code = cli.main(list(args))
        except SystemExit as e:  # argparse's own errors
            code = e.code
        err = capsys.readouterr().err
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("overlapc: error:"), err
    assert needle in lines[0], lines[0]


def test_explain_past_dynamo_recompile_limit(fake_mesh8):
    """explain() compiles the same forward code once per call. Past dynamo's recompile
    limit (8) dynamo would run it eagerly and the report would silently list no sites;
    explain() lifts the limit for its own capture, so the tenth report equals the first."""
    group = fake_mesh8.get_group()

    def fn(x, w):
        return funcol.all_gather_tensor(x, gather_dim=0, group=group) @ w

    x, w = torch.randn(4, 16), torch.randn(16, 8)
    first = overlapc.explain(fn, x, w)
    assert len(first.sites) == 1
    for _ in range(torch._dynamo.config.recompile_limit + 1):
        report = overlapc.explain(fn, x, w)
    assert [s.name for s in report.sites] == [s.name for s in first.sites]


def test_cli_calibrate_needs_a_world():
    """Without --world-size, calibrate measures the world torchrun launched; outside one it
    says how to run it (exit 2), rather than measuring a one-rank world."""
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    p = subprocess.run(
        [sys.executable, "-m", "overlapc", "calibrate"], capture_output=True, text=True, timeout=120, env=env
    )
    assert p.returncode == 2, p.stderr
    assert "--world-size" in p.stderr and "torchrun" in p.stderr, p.stderr


def test_demo_without_root_draws_the_planned_timeline(tmp_path, own_fake_world, capsys):
    """make demo's second half where no link can be emulated: the planner's timeline of the
    wire-bound block at 100 Mbit/s, as Chrome trace JSON and a PNG it names; at that rate the
    planner rewrites sites (a timeline without them would show nothing overlapc does)."""
    import re

    from overlapc import demo

    written = demo.show_predicted(str(tmp_path / "d.png"))
    assert [os.path.basename(p) for p in written] == ["d.json", "d.png"]
    assert all(os.path.getsize(p) > 0 for p in written)
    rewritten = int(re.search(r"(\d+) sites rewritten", capsys.readouterr().out).group(1))
    assert rewritten > 0
