"""Reference models compiled with backend="overlapc" equal eager, on every rank (real gloo worlds).

Forward outputs and every gradient (parameters and inputs) are compared on each rank.
strategy "decompose" rewrites every site, whatever its size. Tolerances, fp32:
- inner="eager": the same ATen ops run, but chunked GEMMs have smaller M (BLAS may block
  and vectorise them differently, and operand alignment changes), and a chunked
  reduce-scatter/all-reduce associates the cross-rank sum of each element in another
  order: last-bit differences, bounded here by 1e-5 relative and absolute.
- inner="inductor": inductor also fuses pointwise ops and reductions (RMSNorm's mean,
  softmax) and vectorises them, changing summation order: 1e-4 relative, 1e-5 absolute.
- bf16 (the TP-only plan): every partial result is rounded to 8 bits of mantissa, and
  coalesced all-reduces (passes/coalesce.py) sum each element's partials in another order,
  so differences are a few ulp of the largest partial sum: rtol 1.6e-2 (torch's bf16
  default), atol 2 ulp of the largest reference value (2^-6 * max|ref|, at least 2e-2).
"""

from __future__ import annotations

import eager_check
import pytest
import torch
import torch.distributed as dist

TOL = {"eager": dict(rtol=1e-5, atol=1e-5), "inductor": dict(rtol=1e-4, atol=1e-5)}


def check_model(builder: str, inner: str, options: dict | None = None, **build_kw):
    """Job: build the model twice from one seed; compile one; compare forward and grads."""
    from torch.distributed.device_mesh import init_device_mesh

    import overlapc
    from overlapc.models import llama, moe

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    build = {"tp_sp": llama.build_tp_sp, "tp": llama.build_tp, "moe": moe.build_ep}[builder]
    ref_model, ref_inputs = build(mesh, **build_kw)
    model, inputs = build(mesh, **build_kw)
    inputs = tuple(x.detach().clone().requires_grad_(x.requires_grad) for x in inputs)
    opts = {"inner": inner, "strategy": "decompose", **(options or {})}
    overlapc.reset_report()
    compiled = torch.compile(model, backend="overlapc", options=opts)
    ref_out = eager_check.step(ref_model, ref_inputs, seed=7)
    out = eager_check.step(compiled, inputs, seed=7)

    def tol(ref):
        if ref.dtype != torch.bfloat16:
            return TOL[inner]
        return dict(rtol=1.6e-2, atol=max(2e-2, 2**-6 * ref.abs().max().item()))

    want = {"forward": ref_out, **eager_check.grads(ref_model, ref_inputs)}
    eager_check.assert_matches({"forward": out, **eager_check.grads(model, inputs)}, want, tol)
    report = overlapc.last_report()
    # Automatic sequence parallelism is the planner's choice by rows and bytes, not a site
    # "decompose" forces: its rows are returned for the caller to check.
    sites = [s for s in report.sites if s.pattern not in ("collective", "all_reduce_rows")]
    assert sites, str(report)
    for s in sites:
        assert s.status == "rewritten" or opts["strategy"] != "decompose", str(report)
    rows = [(s.status, s.details) for s in report.by(pattern="all_reduce_rows")]
    return {"sites": len(sites), "graphs": sorted({s.graph for s in report.sites}), "auto_sp": rows}


SMALL = dict(n_layers=1, dim=64, n_heads=4, ffn_dim=128, vocab_size=64, seq=16)


@pytest.mark.distributed
@pytest.mark.parametrize("builder", ["tp_sp", "tp", "moe"])
def test_models_eager_inner_world2(world2, builder):
    kw = dict(SMALL) if builder != "moe" else dict(tokens=32)
    res = world2.run(check_model, builder, "eager", **kw)
    assert all(r["sites"] > 0 and r["graphs"] == ["backward", "forward"] for r in res)


@pytest.mark.distributed
@pytest.mark.parametrize("builder", ["tp_sp", "tp", "moe"])
def test_models_eager_inner_world4(world4, builder):
    kw = dict(SMALL) if builder != "moe" else dict(tokens=32)
    res = world4.run(check_model, builder, "eager", **kw)
    assert all(r["sites"] > 0 for r in res)


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("builder", ["tp_sp", "tp", "moe"])
def test_models_inductor_inner_world2(world2, builder):
    kw = dict(SMALL) if builder != "moe" else dict(tokens=32)
    res = world2.run(check_model, builder, "inductor", **kw)
    assert all(r["sites"] > 0 and r["graphs"] == ["backward", "forward"] for r in res)


@pytest.mark.distributed
@pytest.mark.parametrize("inner", ["eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_tp_bf16_world2(world2, inner):
    """The TP-only plan in bf16: coalesced and chunked all-reduces against eager."""
    res = world2.run(check_model, "tp", inner, dtype="bfloat16", **SMALL)
    assert all(r["sites"] > 0 for r in res)


_SLOW = pytest.mark.slow
_EXTENDED = pytest.mark.extended  # the rest of the dtype x world x inner grid: `make test-all`


@pytest.mark.distributed
@pytest.mark.parametrize(
    "world,dtype,inner,strategy",
    [
        (2, "float32", "eager", "decompose"),
        (4, "bfloat16", "eager", "auto"),
        pytest.param(2, "float32", "inductor", "decompose", marks=_SLOW),
        pytest.param(2, "float32", "eager", "auto", marks=_EXTENDED),
        pytest.param(4, "float32", "eager", "decompose", marks=_EXTENDED),
        pytest.param(2, "bfloat16", "eager", "decompose", marks=_EXTENDED),
        pytest.param(4, "bfloat16", "inductor", "auto", marks=[_SLOW, _EXTENDED]),
    ],
)
def test_tp_auto_sequence_parallel(request, world, dtype, inner, strategy):
    """The TP-only plan with enough rows a rank (16) for automatic sequence parallelism:
    its all-reduces become reduce-scatters, row-wise ops on each rank's rows and all-gathers,
    in forward and backward (one region over the joint graph), and every rank equals eager.
    The norms' weight gradients are then summed over this rank's rows and all-reduced:
    reassociated sums, inside the tolerances above."""
    w = request.getfixturevalue(f"world{world}")
    kw = dict(SMALL, n_layers=2, seq=8 * world)
    res = w.run(check_model, "tp", inner, {"strategy": strategy}, dtype=dtype, **kw)
    for r in res:
        ((status, details),) = r["auto_sp"]
        assert status == "rewritten", details
        # embedding + 2 per layer forward; output + 2 per layer backward (coalesced)
        assert details["all_reduces"] == 10 and details["all_gathers"] == 10, details
        assert details["partial_sums"] == 5, details  # the norms' weights: 2 per layer + the final one
    assert res[0] == res[-1]


@pytest.mark.distributed
def test_tp_auto_sequence_parallel_with_slices(world2):
    """Micro-batch slices of the rows automatic SP made: a slice along the sequence runs
    attention whole on queries rebuilt from the slices, whose output CPU flash attention lays
    out like the rebuilt query (not like its fake kernel's): the slices' views must still run."""
    kw = dict(SMALL, n_layers=1, seq=16)
    for r in world2.run(check_model, "tp", "eager", {"strategy": "decompose", "microbatches": 2}, **kw):
        ((status, _),) = r["auto_sp"]
        assert status == "rewritten"
