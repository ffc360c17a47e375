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
    sites = [s for s in report.sites if s.pattern != "collective"]
    assert sites, str(report)
    for s in sites:
        assert s.status == "rewritten", str(report)
    return {"sites": len(sites), "graphs": sorted({s.graph for s in report.sites})}


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
