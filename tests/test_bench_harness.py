"""The benchmark harness's measurement of compute under communication (benchmarks/common.py),
in a real gloo world: every rank returns the same numbers, and a replay that cannot run
raises on every rank."""

from __future__ import annotations


def _loaded(dtype: str):
    import torch
    import torch.distributed as dist

    from benchmarks import common

    group = dist.new_group(backend="gloo")
    # Both ranks connected before either can fail and destroy the group: a rank that tears it
    # down while its peer is still connecting makes the peer's new_group fail instead.
    dist.barrier(group=group)
    calls = [{"op": "all_reduce", "shape": [1 << 16], "dtype": dtype, "group": None, "world": dist.get_world_size()}]
    x = torch.randn(128, 128)
    try:
        return common.loaded_times(lambda: x @ x, calls, group, rounds=3)
    except Exception as e:  # noqa: BLE001 - the test wants to see each rank's error
        return f"{type(e).__name__}: {e}"
    finally:
        dist.destroy_process_group(group)


def test_loaded_times_agree_across_ranks(world2):
    a, b = world2.run(_loaded, "float32")
    assert a == b and a[0] > 0 and a[1] > 0, (a, b)


def test_a_bad_replay_raises_on_every_rank(world2):
    errs = world2.run(_loaded, "no_such_dtype", timeout=120)
    assert all(isinstance(e, str) and "no_such_dtype" in e for e in errs), errs


def _expert_rows(cfg: dict) -> list[int]:
    """Job: the rows each grouped matmul of the dropless MoE's compute-alone step gets."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.profiler import ProfilerActivity, profile

    from benchmarks import harness
    from overlapc.models import moe

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    model, (x,) = moe.build_ep(mesh, **cfg)
    be = harness.compute_alone("eager")
    torch._dynamo.reset()
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        fn = torch.compile(model, backend=be)
        fn(x)
        # (The profiler, not a dispatch mode: under a dispatch mode dynamo runs the eager model.)
        with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
            fn(x)
    return [e.input_shapes[0][0] for e in prof.events() if e.name == "aten::_grouped_mm"]


def test_compute_alone_keeps_the_experts_rows(world2):
    """benchmarks/common.strip_collectives (T_compute): the dropless MoE's exchange of
    per-expert counts becomes a copy, so its experts still get every routed row (as zeros,
    as if every rank routed like this one); with the counts zeroed they got none and
    T_compute held a tenth of the step's GEMM time."""
    cfg = dict(
        tokens=64, dim=32, hidden=64, n_experts=4, top_k=2, form="dropless", expert_form="grouped", dtype="bfloat16"
    )
    for rows in world2.run(_expert_rows, cfg):
        assert len(rows) == 3 and all(r == cfg["tokens"] * cfg["top_k"] for r in rows), rows


def test_compile_time_benchmark_runs_and_counts_the_passes(fake_mesh8, capsys):
    """benchmarks/compile_time at a toy depth and size (it must not rot): both memo settings
    run, the same sites are found, and the passes' share is inside the total."""
    from benchmarks import compile_time

    assert (
        compile_time.main(["--layers", "1", "--dim", "64", "--ffn", "128", "--heads", "8", "--seq", "32", "--no-write"])
        == 0
    )
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("layers")]
    assert len(lines) == 2 and lines[0].split("passes")[1].split("s,")[1] == lines[1].split("passes")[1].split("s,")[1]
    for ln in lines:
        total = float(ln.split("total")[1].split("s,")[0])
        passes = float(ln.split("passes")[1].split("s,")[0])
        assert 0 < passes <= total, ln
